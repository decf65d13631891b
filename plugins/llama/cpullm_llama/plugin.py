"""Entry point of cpullm-plugin-llama: registers the family; imports nothing heavy."""
from cpullm.hookspecs import hookimpl


@hookimpl
def cpullm_families():
    from .llama import FAMILY

    return [FAMILY]
