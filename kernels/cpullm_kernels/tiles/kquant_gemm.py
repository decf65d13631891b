"""Prefill over raw GGUF blocks: out (T, N) = x (T, K) @ W.T, W in a ggml block format.

    matmul(fmt, x float32 (T, K), w uint8 (N, row bytes), out float32 (T, N))

Paths, chosen by :func:`matmul`:

* **Integer GEMM** (``q8_gemm.GEMM_ISA`` set: AVX-512 VNNI, AVX-VNNI or AVX2; every format),
  T >= MIN_ROWS. The register micro-kernel of ``q8_gemm`` (W8A16: int16 activations per block of
  32, ``vpdpwssd`` / ``vpmaddwd``) runs on the blocks' own quants: each panel of NR rows x
  KC_BLOCKS blocks is unpacked into int8 quants by the decode kernels' own IR
  (``kquant.unpack_group_quants``: Q8_0 q, Q4_0 q - 8, Q5_0 q - 16 signed; the others' q
  unsigned) and a float32 scale a per block of 32 (d, or d sc for the K-quants), packed with
  ``q8_gemm.pack_rows16`` and multiplied. The formats with a min (w = a q + c: Q4_1 / Q5_1
  c = m, Q4_K / Q5_K c = -dmin mn) add the offsets afterwards as one float32 product of rank
  K / 32:
  out += xsum (T, K/32) @ C (N, K/32).T with xsum[t, b] = x_s[t, b] * sum of x_q[t]'s block b,
  1/32 of the GEMM's multiply-adds (OpenBLAS sgemm). Numerics: the W8A16 GEMM's (activations
  rounded to int16 per 32: 2^-16 of a block's largest value), the weights exact.
  Q6_K, whose sub-blocks of 16 carry their own int8 scales, is packed as int16 weights
  sc (q - 32) (|.| <= 4096) with scale d, against activations rounded to at most
  Q6_K_ACT_QMAX = 16383 so the tile's int32 block sums cannot overflow.
* **Dequantize + sgemm** (CPUs without AVX2), T >= MIN_ROWS: tiles of weight rows are
  dequantized (:func:`dequantize_rows_into`, serial numba, nogil: the values of
  :func:`gguf_blocks.dequantize_ref` bit for bit) into a float32 buffer of TILE_BYTES and
  multiplied by OpenBLAS sgemm; the rows of W are split over the configured number of Python
  threads, each running single-threaded OpenBLAS (no spinning pool fights the prefill threads). float32
  activations.
* T < MIN_ROWS: one ``kquant.quantize_act_q8`` + ``kquant.matvec`` per row (decode's numerics),
  which reads the blocks once per row instead of unpacking every one.

:func:`dequantize` (parallel, whole matrix) is also what a requantization on request
(``quant="int8"`` of a GGUF) starts from.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange, types
from numba.extending import intrinsic

from ..setup import numba_setup
from . import q8_gemm as g8
from ..rows.gguf_blocks import BY_TYPE, block_format, dequantize_ref
from ..rows.kquant import (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, matvec_at, quantize_act_q8_at,
                           unpack_group_quants)
from ..rows.q8 import QBLOCK, worker_pool, quantize_row, activation_scratch, half_to_float

MIN_ROWS = 3
"""Fewest rows sent through dequantize + sgemm: below, a matvec per row reads the blocks once
per row, cheaper than writing every weight out as float32."""

TILE_BYTES = 8 << 20
"""float32 bytes of one dequantized tile of weight rows per thread."""


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
# integer GEMM on the blocks' quants (q8_gemm's micro-kernel)
# ================================================================================================

INT_FORMATS = (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)
"""Formats the integer GEMM takes (all)."""

_HAS_MIN = (Q4_1, Q5_1, Q4_K, Q5_K)

@njit(cache=True, inline="always")
def _f16_at(w, n, p):
    return half_to_float(np.uint16(w[n, p]) | (np.uint16(w[n, p + 1]) << np.uint16(8)))


@njit(cache=True, inline="always")
def _block_scale_offset(fmt, w, n, b):
    """(a, c) of 32-weight block b of row n: w = a q + c for the quants of
    kquant.unpack_group_quants (unsigned, Q8_0's signed)."""
    if fmt == Q8_0:
        return _f16_at(w, n, 34 * b), np.float32(0)
    if fmt == Q4_0 or fmt == Q5_0:
        return _f16_at(w, n, b * (18 if fmt == Q4_0 else 22)), np.float32(0)
    if fmt == Q4_1 or fmt == Q5_1:
        p = b * (20 if fmt == Q4_1 else 24)
        return _f16_at(w, n, p), _f16_at(w, n, p + 2)
    g, s = b // 8, b % 8                                   # Q4_K / Q5_K: super-block g, sub-block s
    p = g * (144 if fmt == Q4_K else 176)
    s4 = p + 4
    if s < 4:
        sc, mn = np.int32(w[n, s4 + s]) & 63, np.int32(w[n, s4 + s + 4]) & 63
    else:
        sc = (np.int32(w[n, s4 + s + 4]) & 15) | ((np.int32(w[n, s4 + s - 4]) >> 6) << 4)
        mn = (np.int32(w[n, s4 + s + 4]) >> 4) | ((np.int32(w[n, s4 + s]) >> 6) << 4)
    return _f16_at(w, n, p) * np.float32(sc), -(_f16_at(w, n, p + 2) * np.float32(mn))


@njit(cache=True, inline="always")
def _unpack_quants(fmt, w, n, g, tq, r, o):
    """kquant.unpack_group_quants with a run-time fmt (a branch per format, each inlined IR)."""
    if fmt == Q4_K:
        unpack_group_quants(w, n, g, tq, r, o, 12)
    elif fmt == Q8_0:
        unpack_group_quants(w, n, g, tq, r, o, 8)
    elif fmt == Q4_0:
        unpack_group_quants(w, n, g, tq, r, o, 2)
    elif fmt == Q5_K:
        unpack_group_quants(w, n, g, tq, r, o, 13)
    elif fmt == Q4_1:
        unpack_group_quants(w, n, g, tq, r, o, 3)
    elif fmt == Q5_0:
        unpack_group_quants(w, n, g, tq, r, o, 6)
    else:
        unpack_group_quants(w, n, g, tq, r, o, 7)


@njit(cache=True, nogil=True)
def _decode_pack_chunk(fmt, w, n0, b0, nblocks, tq, wp, sp, C):
    """Rows n0 .. n0 + NR - 1, blocks b0 .. b0 + nblocks - 1 of the raw blocks w -> the packed
    chunk (wp, sp) of q8_gemm's layout (rows past N zero), and their offsets into C (N, nb).
    b0 and nblocks are whole file blocks (KC_BLOCKS is a multiple of 8)."""
    N = w.shape[0]
    NR = g8.NR
    G = 8 if (fmt == Q4_K or fmt == Q5_K) else 1
    for r in range(NR):
        n = n0 + r
        if n < N:
            for gg in range(b0 // G, (b0 + nblocks) // G):
                _unpack_quants(fmt, w, n, gg, tq, r, (gg * G - b0) * 32)
            for bb in range(nblocks):
                a, c = _block_scale_offset(fmt, w, n, b0 + bb)
                sp[bb * NR + r] = a
                C[n, b0 + bb] = c
        else:
            tq[r, :nblocks * 32] = 0
            for bb in range(nblocks):
                sp[bb * NR + r] = 0.0
    for g in range(NR // 16):
        for bb in range(nblocks):
            g8.pack_rows16(tq, 16 * g, bb, wp, bb * 16 * 2 * NR + g * 32)


# ---- Q6_K: int16 weights sc (q - 32), activations rounded to 15 bits -----------------------------

Q6_K_ACT_QMAX = 16383
"""Largest activation quant of the Q6_K GEMM: its int16 weights reach |sc (q - 32)| = 128 * 32,
and a block's int32 sum 32 * 4096 * 16383 = 2147352576 stays below 2^31 (with 32767 it would
not). The activations' rounding is then 2^-15 of a block's largest value."""


@njit(cache=True, nogil=True)
def _unpack_q6_k_rows(w, n0, b0, nblocks, tq16):
    """tq16[r, 32 bb + j] = sc (q - 32) (int16) of weight j of 32-block b0 + bb of row n0 + r,
    for the rows of the panel inside w (the rest zero); b0, nblocks whole 256-blocks."""
    N = w.shape[0]
    for r in range(tq16.shape[0]):
        n = n0 + r
        if n >= N:
            tq16[r, :nblocks * 32] = 0
            continue
        for gg in range(b0 // 8, (b0 + nblocks) // 8):
            p = gg * 210
            o = (gg * 8 - b0) * 32
            for h in range(2):
                for k in range(4):
                    lo_shift = np.uint8(4 * (k // 2))
                    hi_shift = np.uint8(2 * k)
                    for l in range(32):
                        lo = (w[n, p + 64 * h + 32 * (k % 2) + l] >> lo_shift) & np.uint8(15)
                        hi = (w[n, p + 128 + 32 * h + l] >> hi_shift) & np.uint8(3)
                        j = 128 * h + 32 * k + l
                        sc = np.int16(np.int8(w[n, p + 192 + j // 16]))
                        tq16[r, o + j] = sc * (np.int16(lo | (hi << np.uint8(4))) - np.int16(32))


@intrinsic
def _pack_rows16_i16(typingctx, tq16, n0, blk, wp, off):
    """q8_gemm.pack_rows16 for int16 rows: rows n0 .. n0 + 15 of tq16 (int16 2-D), values
    32 blk .. 32 blk + 31, transposed into wp as that kernel does (pair p of row n0 + lane at
    int16 offset off + p * 2 * NR + 2 * lane). No bounds checks."""
    ok = (isinstance(tq16, types.Array) and tq16.dtype == types.int16 and tq16.ndim == 2
          and isinstance(wp, types.Array) and wp.dtype == types.int16 and wp.ndim == 1
          and all(isinstance(i, types.Integer) for i in (n0, blk, off)))
    if not ok:
        return None
    sig = types.void(tq16, n0, blk, wp, off)

    def codegen(context, builder, sig, args):
        from llvmlite import ir
        at = context.make_array(sig.args[0])(context, builder, args[0])
        awp = context.make_array(sig.args[3])(context, builder, args[3])
        n0_, blk_, off_ = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (1, 2, 4))
        i8p = ir.IntType(8).as_pointer()
        stride = builder.extract_value(at.strides, 0)
        base = builder.gep(builder.bitcast(at.data, i8p), [builder.add(builder.mul(n0_, stride),
                                                                       builder.shl(blk_, ir.Constant(ir.IntType(64), 6)))])
        v16i32 = ir.VectorType(ir.IntType(32), 16)
        rows = [builder.load(builder.bitcast(builder.gep(base, [builder.mul(stride, ir.Constant(ir.IntType(64), r))]),
                                             v16i32.as_pointer()), align=1) for r in range(16)]
        dst = builder.gep(awp.data, [off_])
        for p, vec in enumerate(g8.transpose16(builder, rows)):
            q = builder.bitcast(builder.gep(dst, [ir.Constant(ir.IntType(64), p * 2 * g8.NR)]), v16i32.as_pointer())
            builder.store(vec, q, align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True)
def _decode_pack_chunk_q6_k(w, n0, b0, nblocks, tq16, wp, sp):
    NR = g8.NR
    N = w.shape[0]
    _unpack_q6_k_rows(w, n0, b0, nblocks, tq16)
    for r in range(NR):
        n = n0 + r
        for bb in range(nblocks):
            sp[bb * NR + r] = _f16_at(w, n, ((b0 + bb) // 8) * 210 + 208) if n < N else np.float32(0.0)
    for g in range(NR // 16):
        for bb in range(nblocks):
            _pack_rows16_i16(tq16, 16 * g, bb, wp, bb * 16 * 2 * NR + g * 32)


@njit(cache=True, parallel=True)
def kquant_gemm_blocks(fmt, x_q, x_s, w, T, out, C, nthreads, q6k):
    """out[:T] = the W8A16 product on the blocks' quants (without the offsets, which go to C).

    The panel / chunk / tile loop of ``q8_gemm._gemm_panels``, packing from the raw blocks.
    ``q6k``: True for a Q6_K matrix, None for the other formats: numba then compiles no Q6_K
    unpacker (with the tile's one call site, this unit compiled in 5.0 s of CPU, not 7.3)."""
    N = w.shape[0]
    nb = x_s.shape[1]
    Tp = x_q.shape[0]
    NR, TR, KC = g8.NR, g8.TR, g8.KC_BLOCKS
    npanel = (N + NR - 1) // NR
    nth = max(1, min(nthreads, npanel))
    t_direct = T // TR * TR
    for c in prange(nth):
        tq = np.empty((NR, KC * QBLOCK), np.int8)
        tq16 = np.empty((0 if q6k is None else NR, KC * QBLOCK), np.int16)
        wp = np.empty(KC * 16 * 2 * NR, np.int16)
        sp = np.empty(KC * NR, np.float32)
        edge = np.empty((Tp if N % NR or not g8.SUM_INTO_OUT else TR, NR), np.float32)
        for p in range(c * npanel // nth, (c + 1) * npanel // nth):
            n0 = p * NR
            ncols = min(NR, N - n0)
            e0 = t_direct if g8.SUM_INTO_OUT and ncols == NR else 0
            for b0 in range(0, nb, KC):
                nblk = min(KC, nb - b0)
                first = b0 == 0
                if q6k is None:
                    _decode_pack_chunk(fmt, w, n0, b0, nblk, tq, wp, sp, C)
                else:
                    _decode_pack_chunk_q6_k(w, n0, b0, nblk, tq16, wp, sp)
                for t0 in range(0, Tp, TR):     # one call site: the tile is inlined at each
                    direct = t0 < e0
                    g8.w8a16_tile(wp, sp, x_q, x_s, t0, b0 * QBLOCK, out if direct else edge,
                                  t0 if direct else t0 - e0, n0 if direct else 0, nblk, first)
            for t in range(e0, T):
                out[t, n0:n0 + ncols] = edge[t - e0, :ncols]


@njit(cache=True, parallel=True)
def kquant_block_sums(x_q, x_s, T, xsum):
    """xsum[t, b] = x_s[t, b] * sum of x_q[t, 32 b:32 b + 32] for t < T."""
    for t in prange(T):
        for b in range(xsum.shape[1]):
            s = 0
            for j in range(32):
                s += np.int32(x_q[t, 32 * b + j])
            xsum[t, b] = np.float32(s) * x_s[t, b]


def matmul_int(fmt, x, w, out):
    """The integer GEMM (module docstring); needs ``q8_gemm.GEMM_ISA`` and fmt in INT_FORMATS."""
    fmt = int(fmt)
    if g8.GEMM_ISA is None or fmt not in INT_FORMATS:
        raise RuntimeError("kquant_gemm.matmul_int needs AVX2 or AVX-512 VNNI and a format of INT_FORMATS")
    _check(fmt, x, w, out)
    T, K = x.shape
    nb = K // QBLOCK
    Tp = (T + g8.TR - 1) // g8.TR * g8.TR
    x_q, x_s = activation_scratch(Tp, K)
    if fmt == Q6_K:
        quantize_rows_i8(x, x_q, x_s, Q6_K_ACT_QMAX)
    else:
        g8.quantize_rows_q16(x, x_q, x_s)
    C = np.zeros((w.shape[0], nb), np.float32)
    kquant_gemm_blocks(fmt, x_q, x_s, w, T, out, C, numba.get_num_threads(), True if fmt == Q6_K else None)
    if fmt in _HAS_MIN:
        xsum = np.empty((T, nb), np.float32)
        kquant_block_sums(x_q, x_s, T, xsum)
        # single-threaded OpenBLAS: its threads spinning against numba's just-finished ones made
        # a 256-token SmolLM2 Q4_1 prefill 4.8x slower on 2 threads (56 against 273 tok/s on 1)
        with numba_setup.blas_threads(1):
            out += xsum @ C.T


@njit(cache=True, parallel=True)
def quantize_rows_i8(x, x_q, x_s, qmax):
    """Rows of x float32 (T, K) -> x_q int16 (Tp, K) / x_s float32 (Tp, K // 32) with quants up
    to qmax (q8.quantize_row); rows >= T zero."""
    T = x.shape[0]
    for t in prange(x_q.shape[0]):
        if t < T:
            quantize_row(x[t], x_q[t], x_s[t], qmax)
        else:
            x_q[t, :] = 0
            x_s[t, :] = 0.0


def matmul_int_ref(x, w, fmt, shape):
    """numpy reference of :func:`matmul_int` (float64): rows of x rounded to int16 blocks of 32
    (quants up to 32767, Q6_K's up to Q6_K_ACT_QMAX), times the exactly dequantized weights."""
    from ..rows.q8 import quantize_blocks_ref
    qmax = Q6_K_ACT_QMAX if block_format(fmt).ggml_type == Q6_K else 32767
    K = x.shape[1]
    q, d = quantize_blocks_ref(x.reshape(-1, K), qmax, False)
    xr = q.astype(np.float64) * np.repeat(d.astype(np.float64), 32, axis=1)
    return xr @ dequantize_ref(w, fmt, shape).astype(np.float64).T


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
        futs = [worker_pool(parts - 1).submit(_matmul_rows, fmt, x, w, out, bounds[p], bounds[p + 1])
                for p in range(1, parts)]
        _matmul_rows(fmt, x, w, out, bounds[0], bounds[1])
        for f in futs:
            f.result()


@njit(cache=True)
def kquant_matvec_rows(fmt, x, w, out, x_q, x_s, x_m):
    for t in range(x.shape[0]):
        quantize_act_q8_at(x[t], x_q, x_s, x_m)
        matvec_at(fmt, w, x_q, x_s, x_m, out[t])


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
        kquant_matvec_rows(fmt, x, w, out, np.empty(K, np.int8), np.empty(K // 32, np.float32),
                     np.empty(K // 16, np.float32))
        return
    if g8.GEMM_ISA is not None and fmt in INT_FORMATS:
        matmul_int(fmt, x, w, out)
    else:
        matmul_sgemm(fmt, x, w, out)


def matmul_sgemm(fmt, x, w, out):
    """The dequantize + sgemm path (module docstring), any T and format."""
    fmt = int(fmt)
    _check(fmt, x, w, out)
    parts = numba.get_num_threads()          # the count the caller (cpullm.run.forward.Forward) set
    if parts > 1 and w.shape[0] >= 64 * parts and numba_setup.openblas_libs():
        _matmul_split(fmt, x, w, out, parts)
    else:
        _matmul_rows(fmt, x, w, out, 0, w.shape[0])


def matmul_sgemm_ref(x, w, fmt, shape):
    """numpy reference of :func:`matmul_sgemm` (float64): x @ dequantize_ref(w).T."""
    return x.astype(np.float64) @ dequantize_ref(w, fmt, shape).astype(np.float64).T

