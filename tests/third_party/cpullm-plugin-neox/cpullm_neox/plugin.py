"""Entry point of cpullm-plugin-neox: the family and its op; imports nothing heavy (numba kernels
compile on their first call)."""
from cpullm.plugin import hookimpl


@hookimpl
def cpullm_families():
    from .gpt_neox import FAMILY

    return [FAMILY]


@hookimpl
def cpullm_ops():
    from .ops import GELU_ERF

    return [GELU_ERF]
