"""Entry point of cpullm-plugin-tinyvariant: registers the family; imports nothing heavy."""
from cpullm.plugin import hookimpl


@hookimpl
def cpullm_families():
    from .tinyllama_variant import FAMILY

    return [FAMILY]
