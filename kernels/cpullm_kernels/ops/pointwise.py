"""Kernels of the ACT op (a unary activation) and the POS_EMBED op (learned absolute position
embeddings), over strided (T, width) views of a flat float32 arena, as cpullm_kernels.ops.elementwise.

Each has a serial row-range kernel (decode, and the batch decoder's per-sequence rows), a
parallel one over rows where the work is worth a launch (ACT in prefill), and a numpy reference
``*_ref`` on 2-D arrays computed in float64 (tests/test_pointwise_ops.py compares them).

ACT kinds (the node attribute ``act``, :data:`ACT_KINDS`):

    gelu       x * (1 + erf(x / sqrt 2)) / 2           exact GELU (GPT-NeoX, StarCoder, OPT-350m...)
    gelu_tanh  x * (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) / 2   GPT-2's "gelu_new"
    relu       max(x, 0)                                OPT
    silu       x / (1 + exp(-x))

POS_EMBED: ``out[t] = x[t] + table[first + t]`` where row t of the value is at sequence position
``pos0 + t`` and ``first = pos0 + offset`` (OPT's table starts its positions at row 2).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit
from numba import types as nt

from .vmath import exp_f32, tanh_f32
from ..setup.addressed import Addressed
from ..setup.operand_types import ARENA, WF, i64

ACT_GELU = 0
ACT_GELU_TANH = 1
ACT_RELU = 2
ACT_SILU = 3
ACT_KINDS = {"gelu": ACT_GELU, "gelu_tanh": ACT_GELU_TANH, "relu": ACT_RELU, "silu": ACT_SILU}
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)


@njit(cache=True, fastmath=True, error_model="numpy")
def act_rows(arena, x_off, x_st, o_off, o_st, width, kind, r0, r1):
    """Rows [r0, r1): out = act(x). One loop per kind, so each vectorizes on its own."""
    for t in range(r0, r1):
        x = arena[x_off + t * x_st: x_off + t * x_st + width]
        o = arena[o_off + t * o_st: o_off + t * o_st + width]
        if kind == ACT_GELU:
            for j in range(width):
                v = x[j]
                o[j] = np.float32(0.5) * v * (np.float32(1.0) + np.float32(math.erf(v * np.float32(_INV_SQRT_2))))
        elif kind == ACT_GELU_TANH:
            for j in range(width):
                v = x[j]
                inner = np.float32(_SQRT_2_OVER_PI) * (v + np.float32(0.044715) * v * v * v)
                o[j] = np.float32(0.5) * v * (np.float32(1.0) + tanh_f32(inner))
        elif kind == ACT_RELU:
            for j in range(width):
                o[j] = max(x[j], np.float32(0.0))
        else:
            for j in range(width):
                o[j] = x[j] / (np.float32(1.0) + exp_f32(-x[j]))


ACT_ROWS = Addressed(act_rows, nt.none, [(ARENA, *[i64] * 8)])
"""act_rows through its address (cpullm_kernels.program.row_ops calls it so)."""


_erf = np.vectorize(math.erf, otypes=[np.float64])


def act_ref(x: np.ndarray, kind: int) -> np.ndarray:
    """numpy reference of :func:`act_rows`, in float64."""
    v = np.asarray(x, np.float64)
    if kind == ACT_GELU:
        out = 0.5 * v * (1.0 + _erf(v * _INV_SQRT_2))
    elif kind == ACT_GELU_TANH:
        out = 0.5 * v * (1.0 + np.tanh(_SQRT_2_OVER_PI * (v + 0.044715 * v ** 3)))
    elif kind == ACT_RELU:
        out = np.maximum(v, 0.0)
    elif kind == ACT_SILU:
        out = v / (1.0 + np.exp(-v))
    else:
        raise ValueError(f"unknown activation kind {kind}")
    return out.astype(np.float32)


@njit(cache=True, fastmath=True, error_model="numpy")
def pos_embed_rows(arena, x_off, x_st, o_off, o_st, width, wf, t_off, n_rows, first, r0, r1):
    """Rows [r0, r1): out[t] = x[t] + table[first + t], the table (n_rows, width) at wf[t_off:].
    A position past the table is refused (the compiler sizes the context so none is)."""
    if first + r0 < 0 or first + r1 > n_rows:
        raise ValueError("cpullm POS_EMBED: a position runs past the position table")
    for t in range(r0, r1):
        x = arena[x_off + t * x_st: x_off + t * x_st + width]
        o = arena[o_off + t * o_st: o_off + t * o_st + width]
        p = wf[t_off + (first + t) * width: t_off + (first + t + 1) * width]
        for j in range(width):
            o[j] = x[j] + p[j]


POS_EMBED_ROWS = Addressed(pos_embed_rows, nt.none, [(ARENA, *[i64] * 5, WF, *[i64] * 5)])
"""pos_embed_rows through its address (cpullm_kernels.program.row_ops calls it so)."""


def pos_embed_ref(x: np.ndarray, table: np.ndarray, pos0: int, offset: int = 0) -> np.ndarray:
    """numpy reference of :func:`pos_embed_rows`: rows of ``x`` at positions pos0, pos0 + 1, ..."""
    T = x.shape[0]
    first = pos0 + offset
    if first < 0 or first + T > table.shape[0]:
        raise ValueError("a position runs past the position table")
    return (np.asarray(x, np.float64) + table[first: first + T]).astype(np.float32)
