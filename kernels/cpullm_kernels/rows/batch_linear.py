"""f32 LINEAR for a decode batch: B rows (one per running sequence), one pass over the weights.

    out (B, N) = x (B, K) @ w.T,   w float32 (N, K)

Each weight row is read from memory once and dotted with every batch row while it sits in L1, so
B sequences cost one weight stream, not B: decode is bound by reading the weights. This is the
f32 reference mode's batch LINEAR (core/cpullm/run/batch.py); the q8 one is ``q8_panels.panels_matmul``.

One compiled inner loop serves every (row, output) pair, so a row's result does not depend on B
or on the other rows (batch invariance). It is not promised to equal ``q8.matvec_f32`` bit for
bit: a fastmath reduction's order is LLVM's choice per function.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..setup import numba_setup  # noqa: F401  (code-generation settings first)


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


def linear_rows_f32_ref(x, w):
    """numpy reference (float64)."""
    return x.astype(np.float64) @ w.astype(np.float64).T
