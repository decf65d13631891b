"""cpullm-plugin-phi3: the ``phi3`` family for cpullm and the ``longrope`` RoPE scaling."""
__version__ = "0.1.0"
