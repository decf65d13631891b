"""Arrays whose data start on a 64-byte boundary (a cache line, an AVX-512 vector).

numpy takes arrays of 128 KiB and more from malloc's mapped chunks, which start 16 bytes into a
page, so every 64-byte load the kernels make from such an array straddles two cache lines. The
program's weights in memory, the arena, the activation buffers and the slot tables come from here
(the execution cache's files are mapped at page boundaries already).
"""
from __future__ import annotations

import numpy as np


def aligned_empty(shape, dtype=np.float32, zero: bool = False) -> np.ndarray:
    """An uninitialized (or with ``zero``, zeroed) C-contiguous array starting on 64 bytes."""
    shape = (int(shape),) if np.isscalar(shape) else tuple(int(d) for d in shape)
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    buf = (np.zeros if zero else np.empty)(nbytes + 64, np.uint8)
    skip = -buf.ctypes.data % 64
    return buf[skip: skip + nbytes].view(dtype).reshape(shape)


def aligned_zeros(shape, dtype=np.float32) -> np.ndarray:
    """Zeros starting on 64 bytes (np.zeros' calloc: pages are touched only when written)."""
    return aligned_empty(shape, dtype, zero=True)
