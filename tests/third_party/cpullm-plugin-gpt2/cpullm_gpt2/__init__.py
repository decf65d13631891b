"""cpullm-plugin-gpt2: the ``gpt2`` family for cpullm (GPT-2, DistilGPT-2)."""
__version__ = "0.1.0"
