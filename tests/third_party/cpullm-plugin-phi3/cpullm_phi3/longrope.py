"""``longrope`` (Phi-3 128k, Phi-3.5, Phi-4-mini): per-frequency rescaling factors, one list for
contexts up to ``original_max_position_embeddings`` (``short_factor``) and one beyond
(``long_factor``), and cos/sin scaled by ``attention_factor`` (default
``sqrt(1 + ln(factor) / ln(original))`` with ``factor = max_position_embeddings / original``).

transformers switches the lists by the length of the sequence in hand; a runtime with a KV cache
cannot re-rotate the keys it stored, so the list is chosen once, for the context the program is
compiled for: ``n_ctx > original_max_position_embeddings`` takes the long factors. Up to the
original context that equals transformers' short case; a program for a longer context equals
transformers' long case on sequences longer than the original context.
"""
from __future__ import annotations

import math

import numpy as np

from cpullm.plugin import RopeType, UnsupportedConfigError


def _factors(params: dict, key: str, n: int) -> np.ndarray:
    values = params.get(key)
    if not isinstance(values, list) or len(values) != n:
        raise UnsupportedConfigError(
            f"config key 'rope_parameters.{key}' (longrope) must list {n} numbers (one per rotary "
            f"frequency), got {values!r}")
    return np.asarray(values, np.float32)


def inv_freq(params: dict, rotary_dim: int, n_ctx: int) -> tuple[np.ndarray, float]:
    """(rotary_dim/2,) float32 frequencies for a program of ``n_ctx`` positions, attention factor."""
    original = params.get("original_max_position_embeddings")
    if not isinstance(original, int) or original <= 1:
        raise UnsupportedConfigError("config key 'original_max_position_embeddings' (longrope) must be "
                                     f"an integer > 1, got {original!r}")
    half = rotary_dim // 2
    short, long = _factors(params, "short_factor", half), _factors(params, "long_factor", half)
    factor = params.get("factor") or params["max_position_embeddings"] / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = long if n_ctx > original else short
    exponent = np.arange(0, rotary_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(rotary_dim)
    base = np.float32(params["rope_theta"]) ** exponent                     # (half,) float32
    return (np.float32(1.0) / (ext * base)).astype(np.float32), float(attention)


LONGROPE = RopeType(name="longrope", inv_freq=inv_freq, version="1")
