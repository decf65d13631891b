"""cpullm-plugin-tinyvariant-fast: claims model_type ``tinyllama_variant`` too, with priority 1,
so it wins over cpullm-plugin-tinyvariant (and cpullm warns about the conflict)."""
__version__ = "0.2.0"
