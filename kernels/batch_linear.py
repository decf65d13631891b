"""LINEAR for a decode batch: B rows (one per running sequence), one pass over the weights.

    out (B, N) = x (B, K) @ W.T

Each weight row is read from memory once and dotted with every batch row while it sits in L1
(a q8 row is Kp bytes: 896 to 4864 for Qwen2.5-0.5B), so B sequences cost one weight stream,
not B, which is what makes batched decode pay: decode is bound by reading the weights.

Batch invariance is the point of these kernels, not an accident: every (row, output) product is
computed by exactly the routine one-token decode uses (``q8._q8_row_dot_*``, whose float32 result
is fixed by its written order of blocks; ``quantize_act_q16`` per row), so a row's result is
bit-identical to the single-sequence decode and independent of what else is in the batch. The
prefill GEMM (``q8_gemm.matmul_w8a16``) sums in another order and is not used here.

The f32 variant keeps one compiled inner loop for every (row, output) pair, so its result does
not depend on B either (it is not promised to equal ``q8.matvec_f32`` bit for bit: a fastmath
reduction's order is LLVM's choice per function).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import numba_setup  # noqa: F401  (code-generation settings first)
from .q8 import (HAVE_AVX2, LONG_ROW_K, _q8_row_dot_avx2, _q8_row_dot_avx2_l2, _q8_row_dot_generic,
                 _q8_row_dot_generic_l2, matvec_q8_ref, quantize_act_q16, quantize_act_q16_ref)


@njit(cache=True, parallel=True)
def _rows_q8_avx2(w_q, w_s, x_q, x_s, out):
    # static split: each thread streams one range of W; long rows prefetch into L2 as matvec_q8
    # does (the same float32 result whichever prefetch)
    if w_q.shape[1] >= LONG_ROW_K:
        for n in prange(w_q.shape[0]):
            for t in range(x_q.shape[0]):
                out[t, n] = _q8_row_dot_avx2_l2(w_q, w_s, x_q[t], x_s[t], n)
    else:
        for n in prange(w_q.shape[0]):
            for t in range(x_q.shape[0]):
                out[t, n] = _q8_row_dot_avx2(w_q, w_s, x_q[t], x_s[t], n)


@njit(cache=True, parallel=True)
def _rows_q8_generic(w_q, w_s, x_q, x_s, out):
    if w_q.shape[1] >= LONG_ROW_K:
        for n in prange(w_q.shape[0]):
            for t in range(x_q.shape[0]):
                out[t, n] = _q8_row_dot_generic_l2(w_q, w_s, x_q[t], x_s[t], n)
    else:
        for n in prange(w_q.shape[0]):
            for t in range(x_q.shape[0]):
                out[t, n] = _q8_row_dot_generic(w_q, w_s, x_q[t], x_s[t], n)


_rows_q8 = _rows_q8_avx2 if HAVE_AVX2 else _rows_q8_generic


@njit(cache=True, nogil=True)
def _quantize_rows(x, x_q, x_s):
    for t in range(x.shape[0]):
        quantize_act_q16(x[t], x_q[t], x_s[t])


def linear_rows_q8(x, w_q, w_s, out, x_q, x_s):
    """out (B, N) = x (B, K) @ W.T with the decode numerics, row by row, one pass over W.

    x float32 (B, K) (any row stride), w_q int8 (N, Kp), w_s uint16 (N, Kp // 32) binary16 bits,
    out float32 (B, N) (any row stride); x_q int16 (>= B, Kp) and x_s float32 (>= B, Kp // 32)
    are scratch (C-contiguous)."""
    B = x.shape[0]
    N, Kp = w_q.shape
    if out.shape != (B, N) or x_q.shape[1] != Kp or x_s.shape[1] * 32 != Kp or x_q.shape[0] < B:
        raise ValueError(f"linear_rows_q8: bad shapes x {x.shape}, w_q {w_q.shape}, out {out.shape}, "
                         f"x_q {x_q.shape}, x_s {x_s.shape}")
    _quantize_rows(x, x_q[:B], x_s[:B])
    _rows_q8(w_q, w_s, x_q[:B], x_s[:B], out)


@njit(cache=True, parallel=True, fastmath=True)
def linear_rows_f32(x, w, out):
    """out (B, N) = x (B, K) @ w (N, K).T, float32; each weight row read once for all B rows."""
    N, K = w.shape
    for n in prange(N):
        row = w[n]
        for t in range(x.shape[0]):
            xr = x[t]
            acc = np.float32(0.0)
            for k in range(K):
                acc += row[k] * xr[k]
            out[t, n] = acc


def linear_rows_q8_ref(x, w_q, w_s):
    """numpy reference (float64): each row quantized as quantize_act_q16_ref, then matvec_q8_ref."""
    Kp = w_q.shape[1]
    rows = []
    for t in range(x.shape[0]):
        x_q, x_s = quantize_act_q16_ref(x[t], Kp)
        rows.append(matvec_q8_ref(w_q, w_s, x_q, x_s))
    return np.stack(rows)


def linear_rows_f32_ref(x, w):
    """numpy reference (float64)."""
    return x.astype(np.float64) @ w.astype(np.float64).T
