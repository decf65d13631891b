"""RMSNorm and LayerNorm over rows, or over groups of columns (per-head q/k norms), float32 in
and out.

RMSNorm: ``out = x * rsqrt(mean(x^2) + eps) * w``; zero-centred (1 + w) weights arrive already
folded. LayerNorm: ``out = (x - mean(x)) * rsqrt(var(x) + eps) * w (+ b)``.
"""
from __future__ import annotations

import numpy as np
from numba import njit
from numba import types as nt
from ..setup.addressed import Addressed
from ..setup.operand_types import ARENA, WF, f64, i64


# No "reassoc" fast-math flag: with it, LLVM vectorizes the sum of squares in an order of its
# choosing, which differed between an interpreter compiled in this process and the same one
# loaded from numba's cache (logits differing in the 6th digit between two processes). The
# sequential sum costs ~1.6 us per 896-wide row.
@njit(cache=True, fastmath={"nnan", "ninf", "nsz", "arcp", "afn"}, error_model="numpy")
def rmsnorm_rows(arena, x_off, x_st, o_off, o_st, width, group, wf, w_off, eps, r0, r1):
    n_groups = width // group
    w = wf[w_off: w_off + group]
    for t in range(r0, r1):
        for gi in range(n_groups):
            # views, not arena[x + j]: offset indexing into one array keeps LLVM from vectorizing
            x = arena[x_off + t * x_st + gi * group: x_off + t * x_st + (gi + 1) * group]
            o = arena[o_off + t * o_st + gi * group: o_off + t * o_st + (gi + 1) * group]
            ss = np.float32(0.0)
            for j in range(group):
                ss += x[j] * x[j]
            inv = np.float32(1.0) / np.sqrt(ss / np.float32(group) + np.float32(eps))
            for j in range(group):
                o[j] = x[j] * inv * w[j]


RMSNORM_ROWS = Addressed(rmsnorm_rows, nt.none, [(ARENA, *[i64] * 6, WF, i64, f64, i64, i64)])
"""rmsnorm_rows through its address (cpullm_kernels.program.row_ops calls it so)."""


def rmsnorm_ref(x: np.ndarray, w: np.ndarray, eps: float, group: int | None = None) -> np.ndarray:
    """x (T, width), w (group,) -> (T, width)."""
    T, width = x.shape
    group = group or width
    xg = x.reshape(T, width // group, group).astype(np.float32)
    ms = np.mean(xg * xg, axis=-1, keepdims=True)
    return (xg / np.sqrt(ms + np.float32(eps)) * w).reshape(T, width).astype(np.float32)


# ---- LayerNorm: (x - mean) / sqrt(var + eps) * w [+ b], var the biased variance ----------------
# Sums in written order, like rmsnorm_rows (no "reassoc": results must not depend on whether the
# function was compiled in this process or loaded from numba's cache). Two passes over the row
# (mean, then the centred sum of squares), as torch.nn.functional.layer_norm computes it.
@njit(cache=True, fastmath={"nnan", "ninf", "nsz", "arcp", "afn"}, error_model="numpy")
def layernorm_rows(arena, x_off, x_st, o_off, o_st, width, group, wf, w_off, b_off, eps, r0, r1):
    """b_off < 0: no bias."""
    n_groups = width // group
    w = wf[w_off: w_off + group]
    b = wf[b_off: b_off + group] if b_off >= 0 else wf[w_off: w_off + group]
    inv_n = np.float32(1.0) / np.float32(group)
    for t in range(r0, r1):
        for gi in range(n_groups):
            x = arena[x_off + t * x_st + gi * group: x_off + t * x_st + (gi + 1) * group]
            o = arena[o_off + t * o_st + gi * group: o_off + t * o_st + (gi + 1) * group]
            s = np.float32(0.0)
            for j in range(group):
                s += x[j]
            mean = s * inv_n
            ss = np.float32(0.0)
            for j in range(group):
                d = x[j] - mean
                ss += d * d
            inv = np.float32(1.0) / np.sqrt(ss * inv_n + np.float32(eps))
            if b_off >= 0:
                for j in range(group):
                    o[j] = (x[j] - mean) * inv * w[j] + b[j]
            else:
                for j in range(group):
                    o[j] = (x[j] - mean) * inv * w[j]


LAYERNORM_ROWS = Addressed(layernorm_rows, nt.none, [(ARENA, *[i64] * 6, WF, i64, i64, f64, i64, i64)])
"""layernorm_rows through its address (cpullm_kernels.program.row_ops calls it so)."""


def layernorm_ref(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, eps: float,
                  group: int | None = None) -> np.ndarray:
    """x (T, width), w and b (group,) or b None -> (T, width), computed in float64."""
    T, width = x.shape
    group = group or width
    xg = x.reshape(T, width // group, group).astype(np.float64)
    mean = xg.mean(-1, keepdims=True)
    var = ((xg - mean) ** 2).mean(-1, keepdims=True)
    y = (xg - mean) / np.sqrt(var + eps) * w
    if b is not None:
        y = y + b
    return y.reshape(T, width).astype(np.float32)
