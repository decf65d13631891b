"""Entry point of cpullm-plugin-gpt2: the family; imports nothing heavy."""
from cpullm.plugin import hookimpl


@hookimpl
def cpullm_families():
    from .gpt2 import FAMILY

    return [FAMILY]
