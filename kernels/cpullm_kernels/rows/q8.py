"""q8 block-32: the INT8 weight format, its quantization kernels, the f32 reference kernels, and
the numpy references and LLVM IR helpers the integer kernels share.

Format ("q8 block-32": GGML Q8_0's numbers, planar arrays). K is padded with zeros to
Kp = 32 * ceil(K / 32).

    weights      w_q int8 (N, Kp) C-contiguous, w_s uint16 (N, Kp // 32): binary16 bits of the scales
    activations  x_q int16 (Kp,),               x_s float32 (Kp // 32,)
    w[n, k] ~= w_q[n, k] * f16(w_s[n, k // 32])

Quantization of a block of 32 values v (float32 arithmetic throughout, identical in the numpy
references and the numba kernels):

    weights      d = the smallest binary16 >= max|v| / 127    (0 for an all-zero block)
    activations  d = max|v| / 32767, kept in float32
    q = rint(v * (1 / d))     numpy rint: round half to EVEN; |q| <= 127 (weights) / 32767

Binary16 scales make the weights 34 bytes per 32 values, as GGML Q8_0 (float32 scales: 36): decode
streams every weight once per token, so this is 5.6 % less time per token. Rounding the scale *up*
keeps |q| <= 127 without clamping. Activations are int16 ("W8A16"): the decode dot products are
then as accurate as with float32 activations (llama.cpp's Q8_0 x Q8_0 int8 activations cost
SmolLM2-135M ~3 points of top-1 agreement with float32) at the same speed, since decode is bound
by streaming the weights.

The q8 LINEAR (decode, decode batches, prefill, the head screen's exact rows) is
kernels/cpullm_kernels/panels/q8_panels.py, on these weights repacked in panels of 16 rows.

Kernels (all take arrays of exactly these shapes and dtypes; ``out`` is written, never read):

    quantize_weight_q8(w (N, K)) -> (w_q, w_s)            parallel, once per weight at compile time
    dequantize_weight_q8(w_q, w_s) -> w (N, Kp)           parallel
    quantize_act_q16(x (K,), x_q (Kp,), x_s (Kp//32,))    serial, in place, zero padding
    matvec_f32(w (N, K), x (K,), out (N,))                f32 reference mode, parallel
    matmul_f32(x (T, K), w (N, K), out (T, N))            f32 reference mode (numpy)
    half_to_float(bits)                                   binary16 bits -> float32 inside @njit code

and a numpy reference ``*_ref`` for each (tests/test_kernels_q8.py compares them), plus
``matvec_q8_ref``: the exact q8 matrix-vector product (int64 block sums, float64 scaling) that
the integer q8 kernels are checked against.

Shared with the kernels of other modules (q8_panels, q8_gemm, head_screen, kquant, kquant_gemm):
the one-row block quantizer ``quantize_row`` and its reference ``quantize_blocks_ref``;
``activation_scratch``, the prefill GEMMs' kept int16 buffers; ``worker_pool``, Python worker
threads. The LLVM IR pieces the integer kernels share are in rows/llvm_ir.py.
"""
from __future__ import annotations

import math
import threading

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ..setup import numba_setup
from ..setup.addressed import Addressed
from ..setup.operand_types import array
from .llvm_ir import F32, I16, I32, V8F32, const_i64, declare, half_to_float_ir

QBLOCK = 32
"""Values per quantization block along K."""

HAVE_AVX2 = {"avx2", "fma"} <= numba_setup.HOST_FEATURES
"""True on x86 with AVX2 and FMA: the kernels that import it compile their AVX2 variants (else
portable IR)."""


_SCRATCH = threading.local()


def activation_scratch(rows: int, Kp: int):
    """int16 (rows, Kp) and float32 (rows, Kp // 32) views of this thread's activation scratch,
    grown to the largest size asked for and kept: a prefill quantizes every LINEAR's input (up to
    5 MB for 512 rows of 4864), and fresh memory costs page faults on every call (measured: a
    512-token Qwen2.5-0.5B prefill 0.97x the time with the buffers kept, 2 threads, 12 interleaved
    runs). For the prefill GEMMs (q8_panels, kquant_gemm), which run one at a time per thread."""
    nq, ns = rows * Kp, rows * (Kp // QBLOCK)
    q, s = getattr(_SCRATCH, "q", None), getattr(_SCRATCH, "s", None)
    if q is None or q.size < nq:
        q = _SCRATCH.q = np.empty(nq, np.int16)
    if s is None or s.size < ns:
        s = _SCRATCH.s = np.empty(ns, np.float32)
    return q[:nq].reshape(rows, Kp), s[:ns].reshape(rows, Kp // QBLOCK)


def padded_k(K: int) -> int:
    """Kp: K rounded up to a multiple of 32."""
    return (int(K) + QBLOCK - 1) // QBLOCK * QBLOCK


# ================================================================================================
# numpy references
# ================================================================================================

def scale_values(w_s):
    """float32 values of weight scales stored as binary16 bits (uint16, any shape)."""
    return np.asarray(w_s, np.uint16).view(np.float16).astype(np.float32)


def quantize_blocks_ref(w, qmax: int, f16_scale: bool):
    """numpy reference of blocks-of-32 quantization -> (q (N, Kp) float32 integers, d (N, Kp//32) float32, s stored)."""
    w = np.asarray(w, dtype=np.float32)
    N, K = w.shape
    Kp = padded_k(K)
    wp = np.zeros((N, Kp), np.float32)
    wp[:, :K] = w
    blocks = wp.reshape(N, Kp // QBLOCK, QBLOCK)
    amax = np.abs(blocks).max(-1)
    d = (amax / np.float32(qmax)).astype(np.float32)
    stored = d
    if f16_scale:                       # smallest binary16 >= d, so |v| / d never exceeds qmax
        h = d.astype(np.float16)
        h = np.where(h.astype(np.float32) < d, np.nextafter(h, np.float16(np.inf)), h)
        stored, d = h.view(np.uint16), h.astype(np.float32)
    inv = np.where(d > 0, np.float32(1.0) / np.where(d > 0, d, np.float32(1.0)), np.float32(0.0))
    q = np.clip(np.rint(blocks * inv[..., None].astype(np.float32)), -qmax, qmax)
    return q.reshape(N, Kp), stored


def quantize_weight_q8_ref(w):
    """numpy reference. w float (N, K) -> (w_q int8 (N, Kp), w_s uint16 (N, Kp // 32) binary16 bits)."""
    q, s = quantize_blocks_ref(w, 127, True)
    return q.astype(np.int8), s


def dequantize_weight_q8_ref(w_q, w_s):
    """numpy reference. (w_q (N, Kp), w_s (N, Kp // 32)) -> float32 (N, Kp)."""
    N, Kp = w_q.shape
    return (w_q.reshape(N, Kp // QBLOCK, QBLOCK).astype(np.float32) * scale_values(w_s)[..., None]).reshape(N, Kp)


def quantize_act_q16_ref(x, Kp: int | None = None):
    """numpy reference. x float (K,) -> (x_q int16 (Kp,), x_s float32 (Kp // 32,))."""
    x = np.asarray(x, dtype=np.float32)
    q, s = quantize_blocks_ref(x.reshape(1, -1), 32767, False)
    Kp = q.shape[1] if Kp is None else Kp
    x_q = np.zeros(Kp, np.int16)
    x_s = np.zeros(Kp // QBLOCK, np.float32)
    x_q[:q.shape[1]] = q[0]
    x_s[:s.shape[1]] = s[0]
    return x_q, x_s


def matvec_q8_ref(w_q, w_s, x_q, x_s):
    """numpy reference (float64 result). out[n] = sum_b w_s[n,b] x_s[b] sum_j w_q[n,32b+j] x_q[32b+j]."""
    N, Kp = w_q.shape
    dots = (w_q.reshape(N, -1, QBLOCK).astype(np.int64) * x_q.reshape(-1, QBLOCK).astype(np.int64)).sum(-1)
    return (dots.astype(np.float64) * scale_values(w_s).astype(np.float64) * x_s.astype(np.float64)).sum(-1)


def matvec_f32_ref(w, x):
    """numpy reference (float64 result). w (N, K) @ x (K,) -> (N,)."""
    return w.astype(np.float64) @ x.astype(np.float64)


def matmul_f32_ref(x, w):
    """numpy reference (float64 result). x (T, K) @ w (N, K).T -> (T, N)."""
    return x.astype(np.float64) @ w.astype(np.float64).T


# ================================================================================================
# quantization kernels
# ================================================================================================


@intrinsic
def half_to_float(typingctx, h):
    """float32 value of binary16 bits ``h`` (uint16), for @njit code (numba has no float16)."""
    if not isinstance(h, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return half_to_float_ir(builder, builder.trunc(args[0], I16) if h.bitwidth > 16 else args[0])

    return types.float32(h), codegen


@njit(cache=True)
def _f16_ceil(x):
    """Smallest binary16 value >= x, for 0 <= x <= 65504: (bits as uint16, value as float32)."""
    if not x > 0.0:
        return np.uint16(0), np.float32(0.0)
    if x > 65504.0:
        raise ValueError("weight block scale beyond the binary16 range (|w| > 8e6)")
    e = math.frexp(np.float64(x))[1] - 1             # x in [2^e, 2^(e+1))
    e = max(e, -14)                                  # subnormals share exponent -14
    quantum = math.ldexp(1.0, e - 10)
    n = np.int64(math.ceil(np.float64(x) / quantum))  # x <= n * quantum, n <= 2048
    if n == 2048:
        n, e = 1024, e + 1
    bits = n if n < 1024 else ((e + 15) << 10) | (n - 1024)
    return np.uint16(bits), np.float32(math.ldexp(np.float64(n), e - 10))


def _store_scale(s, b, d):
    """s[b] <- the block scale d as stored; returns the scale value the quants must use."""


@overload(_store_scale)
def _store_scale_impl(s, b, d):
    if s.dtype == types.uint16:
        def store_f16(s, b, d):
            bits, v = _f16_ceil(d)
            s[b] = bits
            return v
        return store_f16

    def store_f32(s, b, d):
        s[b] = d
        return d
    return store_f32


@intrinsic
def _absmax32(typingctx, v, k0):
    """max |v[k0 + j]| for j < 32, float32 (v float32 1-D contiguous; no bounds check).

    LLVM IR: numba's loop compiles to 32 dependent scalar vmaxss (LLVM does not vectorize a float
    max reduction without fast-math, and with it still unrolls it first); this is 4 x vandps +
    3 x vmaxps + a horizontal max. Exact, so the result equals numpy's abs().max().
    """
    if not (isinstance(v, types.Array) and v.dtype == types.float32 and v.ndim == 1
            and isinstance(k0, types.Integer)):
        return None
    sig = types.float32(v, k0)

    def codegen(context, builder, sig, args):
        av = context.make_array(sig.args[0])(context, builder, args[0])
        k = context.cast(builder, args[1], sig.args[1], types.int64)
        p = builder.gep(builder.bitcast(av.data, F32.as_pointer()), [k])
        fabs = declare(builder.module, "llvm.fabs.v8f32", V8F32, [V8F32])
        parts = []
        for i in range(4):
            q = builder.bitcast(builder.gep(p, [const_i64(8 * i)]), V8F32.as_pointer())
            parts.append(builder.call(fabs, [builder.load(q, align=4)]))

        def vmax(a, b_):
            return builder.select(builder.fcmp_ordered(">", a, b_), a, b_)
        m = vmax(vmax(parts[0], parts[1]), vmax(parts[2], parts[3]))
        r = builder.extract_element(m, ir.Constant(I32, 0))
        for i in range(1, 8):
            e = builder.extract_element(m, ir.Constant(I32, i))
            r = builder.select(builder.fcmp_ordered(">", e, r), e, r)
        return r

    return sig, codegen


@njit(cache=True, nogil=True)
def quantize_row(v, q, s, qmax):
    """Quantize one row to blocks of 32: d = max|v| / qmax, q = rint(v / d) clamped to +-qmax.

    v float32 (K,), q int8 or int16 (Kp,), s (Kp // 32,) float32 scales, or uint16 binary16 bits
    (then d is first rounded up to binary16); K <= Kp, padding written as 0.
    """
    K = v.size
    nfull = K // QBLOCK
    lim = np.float32(qmax)
    for b in range(nfull):                       # full blocks: fixed trip count, vectorizes
        k0 = b * QBLOCK
        blk = v[k0:k0 + QBLOCK]
        d = _store_scale(s, b, _absmax32(v, k0) / lim)
        inv = np.float32(1.0) / d if d > np.float32(0.0) else np.float32(0.0)
        qb = q[k0:k0 + QBLOCK]
        for j in range(QBLOCK):
            r = np.rint(blk[j] * inv)
            qb[j] = min(max(r, -lim), lim)
    for b in range(nfull, s.size):
        k0 = b * QBLOCK
        blk = v[k0:min(k0 + QBLOCK, K)]          # short (last block) or empty (padding)
        amax = np.float32(0.0)
        for j in range(blk.size):
            a = abs(blk[j])
            amax = a if a > amax else amax
        d = _store_scale(s, b, amax / lim)
        inv = np.float32(1.0) / d if d > np.float32(0.0) else np.float32(0.0)
        qb = q[k0:k0 + QBLOCK]
        for j in range(blk.size):
            r = np.rint(blk[j] * inv)
            qb[j] = min(max(r, -lim), lim)
        for j in range(blk.size, QBLOCK):
            qb[j] = 0


@njit(cache=True, parallel=True)
def _quantize_rows_q8(w, w_q, w_s):
    """w float32 (N, K) -> fills w_q int8 (N, Kp), w_s uint16 (N, Kp // 32) binary16 bits."""
    for n in prange(w.shape[0]):
        quantize_row(w[n], w_q[n], w_s[n], 127)


def quantize_weight_q8(w):
    """Quantize a weight matrix. w float (N, K) -> (w_q int8 (N, Kp), w_s uint16 (N, Kp // 32) binary16 bits).

    Parallel numba (~0.3 s for 151936 x 896 on 2 threads); any float dtype is converted to float32.
    """
    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"quantize_weight_q8 expects a 2-D matrix, got shape {w.shape}")
    N, K = w.shape
    Kp = padded_k(K)
    w_q = np.empty((N, Kp), np.int8)
    w_s = np.empty((N, Kp // QBLOCK), np.uint16)
    _quantize_rows_q8(w, w_q, w_s)
    return w_q, w_s


@njit(cache=True, nogil=True)
def quantize_act_q16(x, x_q, x_s):
    """Quantize an activation vector to int16 blocks of 32. x float32 (K,) -> x_q int16 (Kp,), x_s float32 (Kp // 32,).

    d = max|v| / 32767 per block (relative error <= 2^-16 of the block's largest value: as good as
    float32 for the dot products that follow). Blocks past K are zero.
    """
    if x_q.size != x_s.size * QBLOCK or x.size > x_q.size:
        raise ValueError("quantize_act_q16: need x.size <= x_q.size == 32 * x_s.size")
    quantize_row(x, x_q, x_s, 32767)


QUANTIZE_ACT_Q16 = Addressed(quantize_act_q16, types.none, [
    (array(types.float32, layout=lay), array(types.int16), array(types.float32)) for lay in ("C", "A")])
""":func:`quantize_act_q16` as formats.matmul_rows calls it for each row, through its address
(cpullm_kernels.setup.addressed): compiled once, not again inside every caller (the block driver
compiled in 3.2-3.9 s of CPU without the two quantizers, 5.4-6.0 with them linked, alternating on a
2-core Ice Lake). Rows of a C-contiguous matrix, or of a row-strided view (the batched step)."""
quantize_act_q16_at = QUANTIZE_ACT_Q16.call
quantize_act_q16_ready = QUANTIZE_ACT_Q16.ensure


@njit(cache=True, nogil=True)
def _dequantize_rows_into(w_q, w_s, n0, n1, out):
    """out[r, :] = dequantized row n0 + r of (w_q, w_s), for r < n1 - n0. out float32 (>= n1-n0, >= K)."""
    K = out.shape[1]
    nb = (K + QBLOCK - 1) // QBLOCK
    for r in range(n1 - n0):
        qr = w_q[n0 + r]
        sr = w_s[n0 + r]
        o = out[r]
        for b in range(nb):
            s = half_to_float(sr[b])
            k0 = b * QBLOCK
            ob = o[k0:min(k0 + QBLOCK, K)]
            qb = qr[k0:k0 + QBLOCK]
            for j in range(ob.size):
                ob[j] = np.float32(qb[j]) * s


@njit(cache=True, parallel=True)
def _dequantize_par(w_q, w_s, out):
    """Parallel dequantization of all rows: out float32 (N, Kp)."""
    N = w_q.shape[0]
    nch = min(N, 64)
    for c in prange(nch):
        n0 = c * N // nch
        n1 = (c + 1) * N // nch
        _dequantize_rows_into(w_q, w_s, n0, n1, out[n0:n1])


def dequantize_weight_q8(w_q, w_s):
    """(w_q int8 (N, Kp), w_s uint16 (N, Kp // 32) binary16 bits) -> float32 (N, Kp)."""
    out = np.empty(w_q.shape, np.float32)
    _dequantize_par(w_q, w_s, out)
    return out


# ================================================================================================
# f32 reference mode
# ================================================================================================

@njit(cache=True, parallel=True, fastmath=True)
def matvec_f32(w, x, out):
    """out (N,) = w (N, K) @ x (K,), float32, parallel over rows."""
    N, K = w.shape
    if x.shape[0] != K or out.shape[0] != N:
        raise ValueError("matvec_f32: shapes must be w (N, K), x (K,), out (N,)")
    for n in prange(N):
        row = w[n]
        acc = np.float32(0.0)
        for k in range(row.size):
            acc += row[k] * x[k]
        out[n] = acc


def matmul_f32(x, w, out):
    """out (T, N) = x (T, K) @ w (N, K).T, float32 (numpy / OpenBLAS sgemm)."""
    np.matmul(x, w.T, out=out)


# ================================================================================================
# Python worker threads
# ================================================================================================

_POOL = {}


def worker_pool(n: int):
    """A process-wide ThreadPoolExecutor with n workers (created on first use): kquant_gemm's
    dequantize + sgemm prefill splits the rows of W over such threads, the cache's weight
    checksum its lanes."""
    ex = _POOL.get(n)
    if ex is None:
        from concurrent.futures import ThreadPoolExecutor
        ex = _POOL.setdefault(n, ThreadPoolExecutor(n, thread_name_prefix="cpullm-worker"))
    return ex
