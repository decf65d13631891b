"""Entry point of cpullm-plugin-qwen: registers the families and the fused Gated DeltaNet
kernel. Imports nothing heavy: numba kernels are compiled only when first called."""
from cpullm.plugin import hookimpl


@hookimpl
def cpullm_families():
    from .qwen2 import FAMILY as QWEN2
    from .qwen3 import FAMILY as QWEN3
    from .qwen3_moe import FAMILY as QWEN3_MOE
    from .qwen3_5 import FAMILY as QWEN3_5
    from .qwen3_5_moe import FAMILY as QWEN3_5_MOE
    from .qwen3_5_moe import TEXT_FAMILY as QWEN3_5_MOE_TEXT
    from .qwen3_5_text import FAMILY as QWEN3_5_TEXT

    return [QWEN2, QWEN3, QWEN3_MOE, QWEN3_5, QWEN3_5_TEXT, QWEN3_5_MOE, QWEN3_5_MOE_TEXT]


@hookimpl
def cpullm_kernels():
    from .kernels import KERNEL

    return [KERNEL]


@hookimpl
def cpullm_gguf_architectures():
    from .gguf_arch import QWEN2, QWEN3, QWEN3_MOE
    from .gguf_qwen35 import QWEN35, QWEN35_MOE

    return [QWEN2, QWEN3, QWEN3_MOE, QWEN35, QWEN35_MOE]
