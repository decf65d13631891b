"""The KV cache's storage format: float16 (the default for quantized weights, as llama.cpp's
``--cache-type-k/-v f16``) or float32 (the default for ``quant="f32"``, the reference runs).

Why float16: on Llama 3.2 3B's shape (28 layers, 8 KV heads, head_dim 128) a token of context is
229 KB of float32 keys and values, so at 8k tokens decode reads 1.9 GB of KV per step beside
3.4 GB of INT8 weights; float16 halves that. The kernels widen float16 to float32 as they load
it (cpullm.kernels.attention); softmax and sums stay float32. A float16 region keeps the float32
region's layout (cpullm.kernels.attention.kv_views) in half the bytes: its ``floats`` in the
program's state plan count 4-byte units, each holding two float16 values.
"""
from __future__ import annotations

import numpy as np

KV_DTYPES = ("f16", "f32")


def resolve_kv_dtype(kv_dtype: str | None, quant: str) -> str:
    """The KV format to use: ``kv_dtype`` checked, or the default for ``quant`` (f32 weights keep
    a float32 cache, every quantized mode gets float16)."""
    from .errors import ConfigError
    if kv_dtype is None:
        return "f32" if quant == "f32" else "f16"
    if kv_dtype not in KV_DTYPES:
        raise ConfigError(f"kv_dtype (--cache-type) must be one of {', '.join(KV_DTYPES)}, not {kv_dtype!r}")
    return kv_dtype


def region_is_f16(reg: dict) -> bool:
    """Whether a ``meta["state_regions"]`` KV entry stores float16 (older plans: float32)."""
    return reg.get("kv_dtype", "f32") == "f16"


def element_bytes(reg: dict) -> int:
    """Bytes of one stored key or value element of a KV region."""
    return 2 if region_is_f16(reg) else 4


def region_floats(n_kv: int, cap: int, head_dim: int, kv_dtype: str) -> int:
    """4-byte units of a KV region of ``cap`` slots (keys and values)."""
    return (1 if kv_dtype == "f16" else 2) * n_kv * cap * head_dim


def numpy_dtype(reg: dict):
    return np.float16 if region_is_f16(reg) else np.float32
