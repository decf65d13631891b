"""Entry point: the tinyllama_variant family again, under another name and with priority 1."""
from cpullm.plugin import hookimpl


@hookimpl
def cpullm_families():
    import attrs
    from cpullm_tinyvariant.tinyllama_variant import FAMILY

    return [attrs.evolve(FAMILY, name="tinyvariant_fast", priority=1,
                         description="tinyllama_variant, overriding cpullm-plugin-tinyvariant")]
