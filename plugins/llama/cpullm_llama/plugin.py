"""Entry point of cpullm-plugin-llama: registers the family; imports nothing heavy."""
from cpullm.plugin import hookimpl


@hookimpl
def cpullm_families():
    from .llama import FAMILY

    return [FAMILY]


@hookimpl
def cpullm_gguf_architectures():
    from .gguf_arch import GGUF_ARCH

    return [GGUF_ARCH]
