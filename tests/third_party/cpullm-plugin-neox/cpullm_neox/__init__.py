"""cpullm-plugin-neox: the ``gpt_neox`` family for cpullm and the op it needs."""
__version__ = "0.1.0"
