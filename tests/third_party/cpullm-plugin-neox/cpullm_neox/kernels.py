"""numba kernels of neox.gelu_erf over (T, w) row-strided views (imported on first use)."""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

_INV_SQRT2 = np.float32(1.0 / math.sqrt(2.0))


@njit(cache=True)
def gelu_erf_rows(out, x):
    """Serial over rows: decode runs one row, where a parallel launch costs more than the work."""
    for t in range(x.shape[0]):
        for j in range(x.shape[1]):
            v = x[t, j]
            out[t, j] = np.float32(0.5) * v * (np.float32(1.0) + np.float32(math.erf(v * _INV_SQRT2)))


@njit(cache=True, parallel=True)
def gelu_erf_par(out, x):
    for t in prange(x.shape[0]):
        for j in range(x.shape[1]):
            v = x[t, j]
            out[t, j] = np.float32(0.5) * v * (np.float32(1.0) + np.float32(math.erf(v * _INV_SQRT2)))
