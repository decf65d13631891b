"""Entry point of cpullm-plugin-gemma: registers the families; imports nothing heavy."""
from cpullm.plugin import hookimpl


@hookimpl
def cpullm_families():
    from .gemma import FAMILY as GEMMA
    from .gemma2 import FAMILY as GEMMA2
    from .gemma3 import FAMILY as GEMMA3
    from .gemma3_text import FAMILY as GEMMA3_TEXT

    return [GEMMA, GEMMA2, GEMMA3, GEMMA3_TEXT]


@hookimpl
def cpullm_gguf_architectures():
    from .gguf_arch import GEMMA3

    return [GEMMA3]
