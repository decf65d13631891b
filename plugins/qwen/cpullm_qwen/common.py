"""Pieces every Qwen model type shares: layer-type checks, prefix aliases,
and the per-head row reordering of Qwen3.5's gated q projection."""
from __future__ import annotations

import numpy as np

from cpullm.plugin import Transform, UnsupportedConfigError

# Prefixes real checkpoints use for the text model, mapped onto the text-only form ("model.").
#   model.language_model.*   multimodal wrappers saved by transformers (Qwen3.5 Hub checkpoints)
#   language_model.model.*   older multimodal exports (lm_head under language_model.lm_head)
TEXT_PREFIX_ALIASES = [
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
]

# Tensors present on purpose but not used by the text model.
BUFFER_IGNORES = [r"rotary_emb\.inv_freq$"]                  # buffers some old checkpoints saved
MULTIMODAL_IGNORES = [r"^model\.visual\.", r"^visual\.", r"^mtp\."]   # vision tower, multi-token prediction


def check_layer_types(layer_types, n_layers: int, allowed: tuple, key: str = "layer_types") -> list:
    """The per-layer kinds as a list; unknown kinds or a wrong length raise naming the config key."""
    types = list(layer_types)
    if len(types) != n_layers:
        raise UnsupportedConfigError(
            f"config key {key!r} has {len(types)} entries but num_hidden_layers is {n_layers}; "
            f"give one entry per layer (or remove {key!r} to use the default pattern)")
    for i, t in enumerate(types):
        if t not in allowed:
            raise UnsupportedConfigError(
                f"config key {key!r} entry {i} = {t!r} is not supported by this family "
                f"(supported: {', '.join(allowed)})")
    return types


def per_head_halves(n_heads: int, head_dim: int, parts: int = 2) -> Transform:
    """Rows interleaved per head, ``[h0: part0 | part1 | h1: part0 | part1 | ...]`` (each part
    ``head_dim`` rows), reordered to ``[part0 of every head | part1 of every head]``.

    Qwen3.5's q_proj (weight (2*nh*hd, H) and bias (2*nh*hd,)) stores query and output gate this
    way; after the transform ``blocks.attention(..., output_gate=True)`` slices [q | gate]. Pure:
    always computed from the stored tensor, never in place."""

    def fn(arr, args=None):
        arr = np.asarray(arr, dtype=np.float32)
        rest = arr.shape[1:]
        # (nh*parts*hd, ...) -> (nh, parts, hd, ...) -> (parts, nh, hd, ...)
        split = arr.reshape(n_heads, parts, head_dim, *rest)
        return np.ascontiguousarray(np.swapaxes(split, 0, 1).reshape(parts * n_heads * head_dim, *rest))

    return Transform(f"per_head_halves(heads={n_heads},head_dim={head_dim},parts={parts})", fn)
