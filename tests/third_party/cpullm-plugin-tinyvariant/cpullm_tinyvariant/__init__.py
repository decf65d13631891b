"""cpullm-plugin-tinyvariant: the ``tinyllama_variant`` family for cpullm."""
__version__ = "0.1.0"
