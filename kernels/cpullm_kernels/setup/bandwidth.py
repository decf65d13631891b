"""A plain streaming read: the rate decode is measured against.

Decode of one token reads every weight matrix once and does little arithmetic per byte, so its
speed is set by how fast this machine streams memory. :func:`read_sum_u32` is that stream with
nothing else: a parallel pass that only adds the 32-bit words up (``vpaddd``, one instruction per
32 bytes), one contiguous range per thread as the LINEAR kernels split their rows.
``cpullm.bench.memory_bound`` runs it over exactly the packed weights one decode token reads,
alternating with decode steps; :func:`read_rate` times it over any buffers (the kernel
microbenchmark's ceiling). The gap between the read's rate and decode's is what kernels and
scheduling leave on the table; the rate itself is the ceiling for a runtime reading those bytes.
"""
from __future__ import annotations

import time

import numba
import numpy as np
from numba import njit, prange


@njit(cache=True, parallel=True)
def read_sum_u32(a, nchunks):
    """Wrapping (mod 2**32) sum of the uint32 array ``a`` (1-D, contiguous), ``nchunks``
    contiguous ranges in parallel; the elements past ``nchunks * (a.size // nchunks)`` serially."""
    n = a.size // nchunks
    part = np.zeros(nchunks, np.uint32)
    for c in prange(nchunks):
        s = a[c * n:(c + 1) * n]
        t = np.uint32(0)
        for i in range(s.size):
            t += s[i]
        part[c] = t
    tot = np.uint64(0)        # (numba widens uint32 sums to 64 bits; the low 32 are the answer)
    for c in range(nchunks):
        tot += part[c]
    for i in range(nchunks * n, a.size):
        tot += a[i]
    return np.uint32(tot & np.uint64(0xFFFFFFFF))


def read_sum_u32_ref(a) -> np.uint32:
    """numpy reference of :func:`read_sum_u32`."""
    return np.uint32(np.sum(np.asarray(a, np.uint32), dtype=np.uint32))


def as_words(buf: np.ndarray) -> np.ndarray:
    """The whole 4-byte words of a contiguous array's bytes, as a uint32 view (no copy)."""
    b = np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    return b[: b.size // 4 * 4].view(np.uint32)


def read_rate(buffers, repeat: int = 5) -> dict:
    """Bytes/s of :func:`read_sum_u32` over ``buffers`` (arrays, read one after another per pass)
    with ``numba.get_num_threads()`` threads: median and best of ``repeat`` passes after one
    untimed pass. Returns {"gbps", "best_gbps", "bytes", "passes"}."""
    words = [as_words(b) for b in buffers if b.size]
    nbytes = sum(w.nbytes for w in words)
    if nbytes == 0:
        raise ValueError("read_rate: nothing to read")
    nth = numba.get_num_threads()

    def one_pass():
        for w in words:
            read_sum_u32(w, nth)

    one_pass()
    times = []
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - t0)
    return {"gbps": nbytes / float(np.median(times)) / 1e9, "best_gbps": nbytes / min(times) / 1e9,
            "bytes": nbytes, "passes": len(times)}
