"""Rotary position embedding, NeoX / rotate_half style (dim i pairs with i + rotary_dim/2).

Angles are ``float32(pos) * inv_freq`` in float32, as transformers computes them; dims past
``rotary_dim`` (partial rotary) pass through unchanged.
"""
from __future__ import annotations

import numpy as np
from numba import njit
from numba import types as nt
from ..setup.addressed import Addressed
from ..setup.operand_types import ARENA, WF, f64, i64


@njit(cache=True, fastmath=False)
def rope_rows(arena, x_off, x_st, o_off, o_st, n_heads, head_dim, rotary_dim, wf, f_off,
              att_scale, pos0, r0, r1):
    half = rotary_dim // 2
    cos = np.empty(half, np.float32)
    sin = np.empty(half, np.float32)
    freqs = wf[f_off: f_off + half]
    for t in range(r0, r1):
        pos = np.float32(pos0 + t)
        for i in range(half):                     # once per row, shared by every head
            ang = pos * freqs[i]
            cos[i] = np.float32(np.cos(ang)) * np.float32(att_scale)
            sin[i] = np.float32(np.sin(ang)) * np.float32(att_scale)
        for h in range(n_heads):
            x = arena[x_off + t * x_st + h * head_dim: x_off + t * x_st + (h + 1) * head_dim]
            o = arena[o_off + t * o_st + h * head_dim: o_off + t * o_st + (h + 1) * head_dim]
            for i in range(half):
                x1 = x[i]
                x2 = x[i + half]
                o[i] = x1 * cos[i] - x2 * sin[i]
                o[i + half] = x2 * cos[i] + x1 * sin[i]
            for i in range(rotary_dim, head_dim):
                o[i] = x[i]


ROPE_ROWS = Addressed(rope_rows, nt.none, [(ARENA, *[i64] * 7, WF, i64, f64, i64, i64, i64)])
"""rope_rows through its address (cpullm_kernels.program.row_ops calls it so)."""


def rope_ref(x: np.ndarray, positions: np.ndarray, n_heads: int, head_dim: int,
             inv_freq: np.ndarray, att_scale: float = 1.0) -> np.ndarray:
    """x (T, n_heads*head_dim), positions (T,) -> rotated copy."""
    rd = 2 * len(inv_freq)
    T = x.shape[0]
    xh = x.reshape(T, n_heads, head_dim).astype(np.float32)
    ang = positions.astype(np.float32)[:, None] * inv_freq.astype(np.float32)[None, :]
    emb = np.concatenate([ang, ang], axis=-1)
    cos = (np.cos(emb) * att_scale).astype(np.float32)[:, None, :]
    sin = (np.sin(emb) * att_scale).astype(np.float32)[:, None, :]
    rot = xh[..., :rd]
    rotate_half = np.concatenate([-rot[..., rd // 2:], rot[..., : rd // 2]], axis=-1)
    out = xh.copy()
    out[..., :rd] = rot * cos + rotate_half * sin
    return out.reshape(T, n_heads * head_dim)
