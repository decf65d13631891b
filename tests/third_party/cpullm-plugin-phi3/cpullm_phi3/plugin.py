"""Entry point of cpullm-plugin-phi3: the family and its RoPE scaling; imports nothing heavy."""
from cpullm.plugin import hookimpl


@hookimpl
def cpullm_families():
    from .phi3 import FAMILY

    return [FAMILY]


@hookimpl
def cpullm_rope_types():
    from .longrope import LONGROPE

    return [LONGROPE]
