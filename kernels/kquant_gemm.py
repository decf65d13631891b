"""Prefill over raw GGUF blocks: out (T, N) = x (T, K) @ W.T, W in a ggml block format.

    matmul(fmt, x float32 (T, K), w uint8 (N, row bytes), out float32 (T, N))

Paths (the same split as ``q8.matmul_q8_sgemm``, whose structure this follows):

* T >= MIN_ROWS: tiles of weight rows are dequantized (:func:`dequantize_rows_into`, serial
  numba, nogil: the values of :func:`gguf_blocks.dequantize_ref` bit for bit) into a float32
  buffer of TILE_BYTES and multiplied by OpenBLAS sgemm (numpy.matmul straight into the column
  block of ``out``); the rows of W are split over the configured number of Python threads, each
  running single-threaded OpenBLAS (no spinning pool, no barriers between tiles). Activations
  stay float32: the result is the float32 product with the exactly dequantized weights.
* T < MIN_ROWS: one ``kquant.quantize_act_q8`` + ``kquant.matvec`` per row (decode's numerics),
  which reads the blocks once per row instead of writing them out as float32.

:func:`dequantize` (parallel, whole matrix) is also what a requantization on request
(``quant="int8"`` of a GGUF) starts from.

Not done yet: an integer GEMM on the blocks (the q8_gemm micro-kernel on unpacked quants, with
the offsets as a rank-K/32 float correction); measured q8's W8A16 GEMM is 1.3-3x this path.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import numba_setup
from .gguf_blocks import BY_TYPE, block_format, dequantize_ref
from .kquant import Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, matvec, quantize_act_q8
from .q8 import _pool, half_to_float

MIN_ROWS = 3
"""Fewest rows sent through dequantize + sgemm: below, a matvec per row reads the blocks once
per row, cheaper than writing every weight out as float32 (as ``q8.MIN_ROWS``)."""

TILE_BYTES = 8 << 20
"""float32 bytes of one dequantized tile of weight rows per thread (as ``q8.TILE_BYTES``)."""


# ================================================================================================
# numba dequantizers, one row at a time (same float32 operations as gguf_blocks' references)
# ================================================================================================

@njit(cache=True, inline="always")
def _b(row, i):
    """Byte i of a row as int32 (numba types uint8 op int64 as float64 in some operators)."""
    return np.int32(row[i])


@njit(cache=True, inline="always")
def _f16(row, p):
    return half_to_float(np.uint16(row[p]) | (np.uint16(row[p + 1]) << np.uint16(8)))


@njit(cache=True, inline="always")
def _nib(row, qs, j):
    """Quant j (< 32) of a 32-weight block whose 16 nibble bytes start at qs."""
    return (_b(row, qs + j) & 15) if j < 16 else (_b(row, qs + j - 16) >> 4)


@njit(cache=True, inline="always")
def _bit(row, qh, j):
    """Bit j of the little-endian 32-bit word at qh, as 0 / 16."""
    return ((_b(row, qh + j // 8) >> (j % 8)) & 1) << 4


@njit(cache=True, nogil=True)
def _row_legacy(fmt, row, o):
    nb = o.size // 32
    for g in range(nb):
        o32 = o[32 * g:32 * g + 32]
        if fmt == Q8_0:
            p = g * 34
            d = _f16(row, p)
            for j in range(32):
                v = _b(row, p + 2 + j)
                o32[j] = np.float32(v - 256 if v > 127 else v) * d
        elif fmt == Q4_0:
            p = g * 18
            d = _f16(row, p)
            for j in range(32):
                o32[j] = (np.float32(_nib(row, p + 2, j)) - np.float32(8)) * d
        elif fmt == Q4_1:
            p = g * 20
            d, m = _f16(row, p), _f16(row, p + 2)
            for j in range(32):
                o32[j] = np.float32(_nib(row, p + 4, j)) * d + m
        elif fmt == Q5_0:
            p = g * 22
            d = _f16(row, p)
            for j in range(32):
                o32[j] = (np.float32(_nib(row, p + 6, j) | _bit(row, p + 2, j)) - np.float32(16)) * d
        else:  # Q5_1
            p = g * 24
            d, m = _f16(row, p), _f16(row, p + 2)
            for j in range(32):
                o32[j] = np.float32(_nib(row, p + 8, j) | _bit(row, p + 4, j)) * d + m


@njit(cache=True, inline="always")
def _k_scale_min(row, s, j):
    """6-bit scale and min of sub-block j from the 12-byte field at s (gguf_blocks.k_scales_mins)."""
    if j < 4:
        return _b(row, s + j) & 63, _b(row, s + j + 4) & 63
    return ((_b(row, s + j + 4) & 15) | ((_b(row, s + j - 4) >> 6) << 4),
            (_b(row, s + j + 4) >> 4) | ((_b(row, s + j) >> 6) << 4))


@njit(cache=True, nogil=True)
def _row_k(fmt, row, o):
    nb = o.size // 256
    for g in range(nb):
        if fmt == Q6_K:
            p = g * 210
            d = _f16(row, p + 208)
            for j in range(256):
                h, k, l = j // 128, (j // 32) % 4, j % 32
                lo = _b(row, p + 64 * h + 32 * (k % 2) + l)
                lo = (lo & 15) if k < 2 else (lo >> 4)
                hi = (_b(row, p + 128 + 32 * h + l) >> (2 * k)) & 3
                sc = _b(row, p + 192 + j // 16)
                dsc = d * np.float32(sc - 256 if sc > 127 else sc)
                o[256 * g + j] = dsc * (np.float32(lo | (hi << 4)) - np.float32(32))
            continue
        bpb = 144 if fmt == Q4_K else 176
        qs = 16 if fmt == Q4_K else 48
        p = g * bpb
        d, dmin = _f16(row, p), _f16(row, p + 2)
        for s in range(8):
            sc, mn = _k_scale_min(row, p + 4, s)
            d1 = d * np.float32(sc)
            m1 = dmin * np.float32(mn)
            base = p + qs + 32 * (s // 2)
            shift = 4 * (s % 2)
            for l in range(32):
                q = (_b(row, base + l) >> shift) & 15
                if fmt == Q5_K:
                    q |= ((_b(row, p + 16 + l) >> s) & 1) << 4
                o[256 * g + 32 * s + l] = d1 * np.float32(q) - m1


@njit(cache=True, nogil=True)
def dequantize_rows_into(fmt, w, n0, n1, out):
    """out[r, :K] = dequantized row n0 + r of the raw blocks w (uint8 (N, row bytes)), r < n1 - n0.

    out float32 (>= n1 - n0, K) (row stride free). Serial, nogil. Raises ValueError on an
    unsupported fmt or a row that is not a whole number of blocks of K weights.
    """
    if not (fmt == Q8_0 or fmt == Q4_0 or fmt == Q4_1 or fmt == Q5_0 or fmt == Q5_1
            or fmt == Q4_K or fmt == Q5_K or fmt == Q6_K):
        raise ValueError("dequantize_rows_into: unsupported block format (ggml type)")
    K = out.shape[1]
    wpb = 256 if (fmt == Q4_K or fmt == Q5_K or fmt == Q6_K) else 32
    bpb = (144 if fmt == Q4_K else 176 if fmt == Q5_K else 210 if fmt == Q6_K else 34 if fmt == Q8_0
           else 18 if fmt == Q4_0 else 20 if fmt == Q4_1 else 22 if fmt == Q5_0 else 24)
    if K % wpb != 0 or w.shape[1] != K // wpb * bpb:
        raise ValueError("dequantize_rows_into: out's width does not match the rows' blocks")
    for r in range(n1 - n0):
        if wpb == 256:
            _row_k(fmt, w[n0 + r], out[r])
        else:
            _row_legacy(fmt, w[n0 + r], out[r])


@njit(cache=True, parallel=True)
def _dequantize_par(fmt, w, out):
    N = w.shape[0]
    nch = min(N, 64)
    for c in prange(nch):
        n0 = c * N // nch
        n1 = (c + 1) * N // nch
        dequantize_rows_into(fmt, w, n0, n1, out[n0:n1])


def dequantize(fmt, w, K: int) -> np.ndarray:
    """The raw blocks w (uint8 (N, row bytes)) of rows of K weights -> float32 (N, K), parallel."""
    f = block_format(fmt)
    if w.ndim != 2 or w.dtype != np.uint8 or w.shape[1] != f.row_bytes(K):
        raise ValueError(f"{f.name}: expected uint8 (N, {f.row_bytes(K)}) for rows of {K} weights")
    out = np.empty((w.shape[0], K), np.float32)
    _dequantize_par(f.ggml_type, w, out)
    return out


# ================================================================================================
# matmul (prefill)
# ================================================================================================

def _tile_rows(N: int, K: int) -> int:
    rows = max(64, min(1024, TILE_BYTES // (4 * K)))
    return min(N, rows // 16 * 16)


def _matmul_rows(fmt, x, w, out, lo, hi):
    """out[:, lo:hi] = x @ dequantize(w)[lo:hi].T, tile by tile (serial dequantization + sgemm)."""
    K = x.shape[1]
    rows = _tile_rows(hi - lo, K)
    buf = np.empty((rows, K), np.float32)
    for n0 in range(lo, hi, rows):
        n1 = min(hi, n0 + rows)
        dequantize_rows_into(fmt, w, n0, n1, buf)
        np.matmul(x, buf[:n1 - n0].T, out=out[:, n0:n1])


def _matmul_split(fmt, x, w, out, parts: int):
    N = w.shape[0]
    bounds = [min(N, (N * p // parts + 15) // 16 * 16) for p in range(parts)] + [N]
    with numba_setup.blas_threads(1):
        futs = [_pool(parts - 1).submit(_matmul_rows, fmt, x, w, out, bounds[p], bounds[p + 1])
                for p in range(1, parts)]
        _matmul_rows(fmt, x, w, out, bounds[0], bounds[1])
        for f in futs:
            f.result()


@njit(cache=True)
def _matvec_rows(fmt, x, w, out, x_q, x_s, x_m):
    for t in range(x.shape[0]):
        quantize_act_q8(x[t], x_q, x_s, x_m)
        matvec(fmt, w, x_q, x_s, x_m, out[t])


def _check(fmt, x, w, out):
    f = BY_TYPE.get(int(fmt))
    if f is None:
        raise ValueError(f"kquant_gemm.matmul: unsupported ggml type {fmt}")
    T, K = x.shape
    if w.ndim != 2 or w.shape[1] != f.row_bytes(K) or out.shape != (T, w.shape[0]):
        raise ValueError(f"kquant_gemm.matmul: bad shapes x {x.shape}, w {w.shape} ({f.name}), out {out.shape}")
    if x.dtype != np.float32 or w.dtype != np.uint8 or out.dtype != np.float32:
        raise ValueError("kquant_gemm.matmul: dtypes must be x float32, w uint8, out float32")


def matmul(fmt, x, w, out):
    """out (T, N) = x (T, K) @ W.T over the raw blocks of W (prefill; paths: module docstring).

    fmt: ggml type number; x float32 (T, K), w uint8 (N, row bytes), out float32 (T, N); x and
    out may be row-strided views (rows contiguous).
    """
    fmt = int(fmt)
    _check(fmt, x, w, out)
    T, K = x.shape
    if T < MIN_ROWS:
        _matvec_rows(fmt, x, w, out, np.empty(K, np.int8), np.empty(K // 32, np.float32),
                     np.empty(K // 16, np.float32))
        return
    parts = numba_setup.configured_threads()
    if parts > 1 and w.shape[0] >= 64 * parts and numba_setup._openblas_libs():
        _matmul_split(fmt, x, w, out, parts)
    else:
        _matmul_rows(fmt, x, w, out, 0, w.shape[0])


def matmul_ref(x, w, fmt, shape):
    """numpy reference of the T >= MIN_ROWS path (float64): x @ dequantize_ref(w).T."""
    return x.astype(np.float64) @ dequantize_ref(w, fmt, shape).astype(np.float64).T

