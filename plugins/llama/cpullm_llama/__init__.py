"""cpullm-plugin-llama: the Llama family (model_type ``llama``) for cpullm."""
__version__ = "0.1.0"
