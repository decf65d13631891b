"""INT8 linear-layer kernels: q8 block-32 weights (the runtime's hot path).

Format ("q8 block-32": GGML Q8_0's numbers, planar arrays). K is padded with zeros to
Kp = 32 * ceil(K / 32).

    weights      w_q int8 (N, Kp) C-contiguous, w_s uint16 (N, Kp // 32): binary16 bits of the scales
    activations  x_q int16 (Kp,),               x_s float32 (Kp // 32,)   (decode only)
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

Kernels (all take arrays of exactly these shapes and dtypes; ``out`` is written, never read):

    quantize_weight_q8(w (N, K)) -> (w_q, w_s)            parallel, once per weight at compile time
    dequantize_weight_q8(w_q, w_s) -> w (N, Kp)           parallel
    quantize_act_q16(x (K,), x_q (Kp,), x_s (Kp//32,))    serial, in place, zero padding
    matvec_q8(w_q, w_s, x_q, x_s, out (N,))               decode hot path, parallel over rows
    matmul_q8_sgemm(x (T, K), w_q, w_s, out (T, N))       prefill: plain Python (OpenBLAS sgemm)
    matvec_f32(w (N, K), x (K,), out (N,))                f32 reference mode, parallel
    matmul_f32(x (T, K), w (N, K), out (T, N))            f32 reference mode (numpy)
    half_to_float(bits)                                   binary16 bits -> float32 inside @njit code

and a numpy reference ``*_ref`` for each (tests/test_kernels_q8.py compares them).

matvec_q8: on x86 with AVX2 (the CI machine: AMD EPYC Zen 3, AVX2+FMA+F16C, no AVX-512/VNNI)
the per-row dot product is a small LLVM IR routine inlined into the numba ``prange`` body
(``_q8_row_dot_avx2``): per block of 32, ``vpmovsxbw`` (weights to int16) + 2 ``vpmaddwd`` with
the int16 activations -> 8 int32 partial sums, converted once to float and accumulated with one
FMA by the block's factor ``f16(w_s) * x_s`` into two 8-float accumulators, the factors of 8
blocks at a time from one ``vcvtph2ps`` + ``vmulps``; a software prefetch 4 KiB ahead in the
weight stream, into L1 for rows shorter than LONG_ROW_K and into L2 for longer ones (see
matvec_q8). Each thread streams one contiguous range of
rows (static ``prange`` schedule), the access pattern the hardware prefetchers like best:
processing 2-4 rows at once (sharing the x loads) measured 35-50 % slower here. Elsewhere a
portable IR variant (sign-extend, multiply, add) is used. The int8-activation variant (``vpsignb``
+ ``vpmaddubsw``, llama.cpp's numerics) measured the same speed on a whole Qwen2.5-0.5B decode
sweep, interleaved in one process (25.1 vs 25.3 ms median), so only the int16 one is kept.
Throughput: benchmarks/kernels_q8.py. The IR lives in this module (not in llvm_intrinsics.py) on
purpose: numba's on-disk cache of a kernel is invalidated by its own source file only.

matmul_q8_sgemm (the prefill path on CPUs without AVX2 or VNNI; ``q8_gemm.matmul_q8`` picks the
path): each tile of weight rows (8 MB of float32) is dequantized (serial numba, nogil) and
multiplied with OpenBLAS sgemm (numpy); the rows of W are split over the configured number of
Python threads, each running single-threaded OpenBLAS. Measured (T=512, 2 threads): 93-98 % of
sgemm on pre-dequantized float32 weights (dequantizing costs 2-4 %); equal to a 2-thread OpenBLAS
pool on a quiet machine and 3x faster than it when another process competes for the cores (no
spinning barriers). Activations are not quantized in prefill (weights-only INT8). For T < ~4 a
quantize_act_q16 + matvec_q8 per row is cheaper than dequantizing (it reads the int8 weights once
per row instead of writing float32).
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from . import numba_setup

QBLOCK = 32
"""Values per quantization block along K."""

PREFETCH_BYTES = 4096
"""Software-prefetch distance in the weight stream of matvec_q8. Measured: 0 -> 1 KiB +10-25 % (Zen 3);
1 -> 4 KiB +4-7 % on a whole Qwen2.5-0.5B decode sweep on the Zen 5 (AVX-512), reaching a plain
read of the same bytes; 8 KiB no better; on the Zen 3, 0-8 KiB were equal within the noise."""

LONG_ROW_K = 4096
"""Rows at least this long (int16 activations of >= 8 KiB) prefetch into L2, not L1 (see matvec_q8)."""

HAVE_AVX2 = {"avx2", "fma"} <= numba_setup.HOST_FEATURES
"""True when matvec_q8 uses the AVX2 routine (else the portable IR)."""

_HALF_IN_HARDWARE = "f16c" in numba_setup.HOST_FEATURES or not numba_setup.HOST_IS_X86
"""binary16 -> float32 by LLVM's fpext (vcvtph2ps on x86 with F16C); else integer IR."""


def padded_k(K: int) -> int:
    """Kp: K rounded up to a multiple of 32."""
    return (int(K) + QBLOCK - 1) // QBLOCK * QBLOCK


# ================================================================================================
# numpy references
# ================================================================================================

def scale_values(w_s):
    """float32 values of weight scales stored as binary16 bits (uint16, any shape)."""
    return np.asarray(w_s, np.uint16).view(np.float16).astype(np.float32)


def _quantize_blocks_ref(w, qmax: int, f16_scale: bool):
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
    q, s = _quantize_blocks_ref(w, 127, True)
    return q.astype(np.int8), s


def dequantize_weight_q8_ref(w_q, w_s):
    """numpy reference. (w_q (N, Kp), w_s (N, Kp // 32)) -> float32 (N, Kp)."""
    N, Kp = w_q.shape
    return (w_q.reshape(N, Kp // QBLOCK, QBLOCK).astype(np.float32) * scale_values(w_s)[..., None]).reshape(N, Kp)


def quantize_act_q16_ref(x, Kp: int | None = None):
    """numpy reference. x float (K,) -> (x_q int16 (Kp,), x_s float32 (Kp // 32,))."""
    x = np.asarray(x, dtype=np.float32)
    q, s = _quantize_blocks_ref(x.reshape(1, -1), 32767, False)
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


def matmul_q8_ref(x, w_q, w_s):
    """numpy reference (float64 result). x (T, K) @ dequantize(w_q, w_s)[:, :K].T -> (T, N)."""
    K = x.shape[1]
    w = dequantize_weight_q8_ref(w_q, w_s)[:, :K].astype(np.float64)
    return x.astype(np.float64) @ w.T


def matvec_f32_ref(w, x):
    """numpy reference (float64 result). w (N, K) @ x (K,) -> (N,)."""
    return w.astype(np.float64) @ x.astype(np.float64)


def matmul_f32_ref(x, w):
    """numpy reference (float64 result). x (T, K) @ w (N, K).T -> (T, N)."""
    return x.astype(np.float64) @ w.astype(np.float64).T


# ================================================================================================
# LLVM IR helpers
# ================================================================================================

_I1, _I8, _I16, _I32, _I64 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_F32 = ir.FloatType()
_V32I8 = ir.VectorType(_I8, 32)
_V16I16 = ir.VectorType(_I16, 16)
_V8I32 = ir.VectorType(_I32, 8)
_V8F32 = ir.VectorType(_F32, 8)
_P8 = _I8.as_pointer()


def _c64(v):
    return ir.Constant(_I64, v)


def _decl(module, name, ret, args):
    return cgutils.get_or_insert_function(module, ir.FunctionType(ret, args), name)


def _hsum_v8f32(b, v):
    """Horizontal sum of an <8 x float>."""
    idx = lambda *ix: ir.Constant(ir.VectorType(_I32, len(ix)), list(ix))  # noqa: E731
    s = b.fadd(b.shuffle_vector(v, v, idx(0, 1, 2, 3)), b.shuffle_vector(v, v, idx(4, 5, 6, 7)))
    s = b.fadd(s, b.shuffle_vector(s, s, idx(2, 3, 2, 3)))
    return b.fadd(b.extract_element(s, ir.Constant(_I32, 0)), b.extract_element(s, ir.Constant(_I32, 1)))


# ================================================================================================
# quantization kernels
# ================================================================================================

def _ir_half_to_float(b, h):
    """IR: i16 binary16 bits -> float (finite values: normal, subnormal, zero)."""
    if _HALF_IN_HARDWARE:
        return b.fpext(b.bitcast(h, ir.HalfType()), _F32)
    u = b.zext(h, _I32)
    sign = b.shl(b.and_(u, ir.Constant(_I32, 0x8000)), ir.Constant(_I32, 16))
    mag = b.and_(u, ir.Constant(_I32, 0x7FFF))
    normal = b.bitcast(b.or_(sign, b.add(b.shl(mag, ir.Constant(_I32, 13)), ir.Constant(_I32, 112 << 23))), _F32)
    sub = b.fmul(b.uitofp(b.and_(u, ir.Constant(_I32, 0x3FF)), _F32), ir.Constant(_F32, 2.0 ** -24))
    sub = b.bitcast(b.or_(b.bitcast(sub, _I32), sign), _F32)
    is_sub = b.icmp_unsigned("<", mag, ir.Constant(_I32, 0x400))
    return b.select(is_sub, sub, normal)


def _ir_half_to_float_fresh(b, h):
    """IR: as :func:`_ir_half_to_float`, but the hardware conversion reads a register that was
    written whole. LLVM turns a scalar ``fpext half`` (and every vector form that uses one lane)
    into ``vpinsrw $0, mem, %xmmK, %xmmD`` with whatever register it picks as %xmmK; in the matvec
    row loop that was the float accumulator, which chained each block's scale conversion to the
    previous block's FMA (7-9 cycles per block of 32 in L1). Here the bits go through a GPR and
    ``vmovd`` (which zeroes the rest), then one ``vcvtph2ps`` LLVM cannot rewrite (inline asm)."""
    if not (_HALF_IN_HARDWARE and numba_setup.HOST_IS_X86):
        return _ir_half_to_float(b, h)
    v4i32, v4f32 = ir.VectorType(_I32, 4), ir.VectorType(_F32, 4)
    v = b.insert_element(ir.Constant(v4i32, [0] * 4), b.zext(h, _I32), ir.Constant(_I32, 0))
    cvt = ir.InlineAsm(ir.FunctionType(v4f32, [v4i32]), "vcvtph2ps $1, $0", "=x,x")
    return b.extract_element(b.call(cvt, [v]), ir.Constant(_I32, 0))


@intrinsic
def half_to_float(typingctx, h):
    """float32 value of binary16 bits ``h`` (uint16), for @njit code (numba has no float16)."""
    if not isinstance(h, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return _ir_half_to_float(builder, builder.trunc(args[0], _I16) if h.bitwidth > 16 else args[0])

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
        p = builder.gep(builder.bitcast(av.data, _F32.as_pointer()), [k])
        fabs = _decl(builder.module, "llvm.fabs.v8f32", _V8F32, [_V8F32])
        parts = []
        for i in range(4):
            q = builder.bitcast(builder.gep(p, [_c64(8 * i)]), _V8F32.as_pointer())
            parts.append(builder.call(fabs, [builder.load(q, align=4)]))

        def vmax(a, b_):
            return builder.select(builder.fcmp_ordered(">", a, b_), a, b_)
        m = vmax(vmax(parts[0], parts[1]), vmax(parts[2], parts[3]))
        r = builder.extract_element(m, ir.Constant(_I32, 0))
        for i in range(1, 8):
            e = builder.extract_element(m, ir.Constant(_I32, i))
            r = builder.select(builder.fcmp_ordered(">", e, r), e, r)
        return r

    return sig, codegen


@njit(cache=True, nogil=True)
def _quantize_row(v, q, s, qmax):
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
        _quantize_row(w[n], w_q[n], w_s[n], 127)


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
    _quantize_row(x, x_q, x_s, 32767)


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
# matvec_q8: LLVM IR row dot product
# ================================================================================================

def _block_dot_i32x8(b, module, wp, xp, x86):
    """w (32 x i8 at wp) . x (32 x i16 at xp) -> <8 x i32> partial sums (each lane sums 4 products).

    |w| <= 127, |x| <= 32767: every partial sum stays below 4 * 127 * 32767 < 2^24, exact in int32
    and in its float32 conversion.
    """
    v16i8 = ir.VectorType(_I8, 16)
    w0 = b.load(b.bitcast(wp, v16i8.as_pointer()), align=1)
    w1 = b.load(b.bitcast(b.gep(wp, [_c64(16)]), v16i8.as_pointer()), align=1)
    x0 = b.load(b.bitcast(xp, _V16I16.as_pointer()), align=1)
    x1 = b.load(b.bitcast(b.gep(xp, [_c64(32)]), _V16I16.as_pointer()), align=1)
    if x86:   # vpmovsxbw + vpmaddwd (pairs of products summed into int32 lanes)
        maddwd = _decl(module, "llvm.x86.avx2.pmadd.wd", _V8I32, [_V16I16, _V16I16])
        return b.add(b.call(maddwd, [b.sext(w0, _V16I16), x0]), b.call(maddwd, [b.sext(w1, _V16I16), x1]))
    v16i32 = ir.VectorType(_I32, 16)
    p = b.add(b.mul(b.sext(w0, v16i32), b.sext(x0, v16i32)), b.mul(b.sext(w1, v16i32), b.sext(x1, v16i32)))
    half = lambda h: b.shuffle_vector(p, p, ir.Constant(_V8I32, list(range(8 * h, 8 * h + 8))))  # noqa: E731
    return b.add(half(0), half(1))


def _halves_to_floats(b, v):
    """IR: <n x i16> binary16 bits -> <n x float> (one ``vcvtph2ps`` with F16C)."""
    n = v.type.count
    vf = ir.VectorType(_F32, n)
    if _HALF_IN_HARDWARE:
        return b.fpext(b.bitcast(v, ir.VectorType(ir.HalfType(), n)), vf)
    out = ir.Constant(vf, ir.Undefined)
    for k in range(n):
        e = _ir_half_to_float(b, b.extract_element(v, ir.Constant(_I32, k)))
        out = b.insert_element(out, e, ir.Constant(_I32, k))
    return out


def _scaled_fma(b, module, sums, factor, acc):
    """IR: acc + float(sums) * factor: <8 x i32> block sums, one float factor, <8 x float> acc."""
    fmuladd = _decl(module, "llvm.fmuladd.v8f32", _V8F32, [_V8F32, _V8F32, _V8F32])
    sv = b.insert_element(ir.Constant(_V8F32, ir.Undefined), factor, ir.Constant(_I32, 0))
    sv = b.shuffle_vector(sv, sv, ir.Constant(_V8I32, [0] * 8))
    return b.call(fmuladd, [b.sitofp(sums, _V8F32), sv, acc])


def _prefetch_ahead(b, module, p, locality=3):
    """IR: prefetch (read) PREFETCH_BYTES past the byte pointer p, into L1 (``locality`` 3:
    ``prefetcht0``) or L2 (2: ``prefetcht1``)."""
    prefetch = _decl(module, "llvm.prefetch.p0", ir.VoidType(), [_P8, _I32, _I32, _I32])
    b.call(prefetch, [b.gep(p, [_c64(PREFETCH_BYTES)]), ir.Constant(_I32, 0), ir.Constant(_I32, locality),
                      ir.Constant(_I32, 1)])


def _emit_counted_loop(fn, b, start, end, step, accs, body, name):
    """IR: ``for i in range(start, end, step): accs = body(b, i, accs)``.

    ``b`` is a builder at the end of an open basic block where ``accs`` (a list of values) hold;
    ``body`` emits one step into the loop's block and returns the new values. Returns (builder at
    the end of an open block after the loop, the values after it).
    """
    pre = b.block
    loop, done = fn.append_basic_block(name), fn.append_basic_block(name + "_done")
    b.cbranch(b.icmp_signed("<", start, end), loop, done)
    b = ir.IRBuilder(loop)
    i = b.phi(_I64)
    phis = [b.phi(a.type) for a in accs]
    new = list(body(b, i, phis))
    i_next = b.add(i, _c64(step))
    last = b.block
    for phi, v_in, v_loop in zip([i, *phis], [start, *accs], [i_next, *new]):
        phi.add_incoming(v_in, pre)
        phi.add_incoming(v_loop, last)
    b.cbranch(b.icmp_signed("<", i_next, end), loop, done)
    b = ir.IRBuilder(done)
    out = []
    for a, n in zip(accs, new):
        phi = b.phi(a.type)
        phi.add_incoming(a, pre)
        phi.add_incoming(n, last)
        out.append(phi)
    return b, out


def _emit_paired_blocks(fn, b, start, end, acc0, acc1, block):
    """IR: blocks [start, end) two per loop step into two <8 x float> accumulators, an odd last one in a tail.

    ``b`` is a builder at the end of an open basic block (``acc0`` / ``acc1`` are its values);
    ``block(b, i, acc, slot) -> acc`` emits block i, slot 0 / 1 for the first / second of a pair,
    2 for the tail. Block start + 2j goes to acc0 and start + 2j + 1 to acc1, so the sum order is
    that of one loop over all blocks alternating two accumulators. Returns (builder at the end of
    an open block, acc0 + acc1 (+ the tail block)).
    """
    pair_end = b.add(start, b.and_(b.sub(end, start), _c64(-2)))

    def pair(b, i, acc):
        return block(b, i, acc[0], 0), block(b, b.add(i, _c64(1)), acc[1], 1)

    b, (m0, m1) = _emit_counted_loop(fn, b, start, pair_end, 2, [acc0, acc1], pair, "pairs")
    tot = b.fadd(m0, m1)            # at most one block left: end - pair_end is 0 or 1
    return _emit_if(fn, b, b.icmp_signed("<", pair_end, end), tot, lambda b, acc: block(b, pair_end, acc, 2), "odd")


def _emit_if(fn, b, cond, acc, step, name):
    """IR: ``acc = step(b, acc) if cond else acc`` for one <8 x float> value, the step in a block of its own.
    Returns (builder at the end of an open block after it, the value)."""
    pre = b.block
    body, done = fn.append_basic_block(name), fn.append_basic_block(name + "_done")
    b.cbranch(cond, body, done)
    b = ir.IRBuilder(body)
    new = step(b, acc)
    last = b.block
    b.branch(done)
    b = ir.IRBuilder(done)
    r = b.phi(_V8F32)
    r.add_incoming(acc, pre)
    r.add_incoming(new, last)
    return b, r


def _define_row_dot(module, x86: bool, stream: bool = True, locality: int = 3):
    """float @cpullm_q8_row_dot_*(i8* w_row, i8* ws_row, i8* x, i8* xs, i64 nblocks), alwaysinline.

    sum over blocks b of float(dot32(w_row[32b:], x[32b:])) * (f16(ws_row[b]) * xs[b]) into two
    <8 x float> accumulators (even / odd blocks). Blocks go 8 at a time, then 4 if that many are
    left: the group's factors f16(ws) * xs are one ``vcvtph2ps`` + ``vmulps``, and each block's FMA
    broadcasts its own lane (per block: 2 ``vpmovsxbw``, 2 ``vpmaddwd``, ``vcvtdq2ps``, the
    broadcast and an FMA; a block's factor on its own takes a GPR load, ``vmovd``, ``vcvtph2ps``,
    ``vmulss`` and the broadcast: 9-13 % slower in L1/L2 on the Zen 4). The last nblocks % 4 blocks
    take their factors one by one. A prefetch PREFETCH_BYTES ahead per block (one per 64 bytes
    measured 2-3 % slower), none in the odd tail. ``stream=False``: the same arithmetic without the
    prefetches, for rows read out of order (the head screen's exact rows). Every variant returns
    the same float32: block b always goes to accumulator b % 2, in order. ``locality``: the
    prefetch's target (3: L1, 2: L2; the arithmetic is the same).
    """
    name = "cpullm_q8_row_dot_v5_" + ("avx2" if x86 else "generic") + ("" if stream else "_rows") + f"_l{locality}"
    fn = module.globals.get(name)
    if fn is not None:
        return fn
    fn = ir.Function(module, ir.FunctionType(_F32, [_P8, _P8, _P8, _P8, _I64]), name)
    fn.linkage = "internal"
    fn.attributes.add("alwaysinline")
    fn.attributes.add("nounwind")
    w, ws, x, xs, nb = fn.args
    entry, group4, after4 = (fn.append_basic_block(s) for s in ("entry", "group4", "after4"))
    zero = ir.Constant(_V8F32, [0.0] * 8)

    b = ir.IRBuilder(entry)
    wsp = b.bitcast(ws, _I16.as_pointer())
    xsp = b.bitcast(xs, _F32.as_pointer())
    end8 = b.and_(nb, _c64(-8))

    def dot(b, i, factor, acc, prefetch=True):
        off = b.shl(i, _c64(5))
        wp = b.gep(w, [off])
        if stream and prefetch:
            _prefetch_ahead(b, module, wp, locality)
        sums = _block_dot_i32x8(b, module, wp, b.gep(x, [b.shl(off, _c64(1))]), x86)   # x: 64 bytes per block
        return _scaled_fma(b, module, sums, factor, acc)

    def group(b, g, width, acc):
        """Blocks g .. g + width - 1 (g even) with one vector of factors; acc: [even, odd]."""
        h = b.load(b.bitcast(b.gep(wsp, [g]), ir.VectorType(_I16, width).as_pointer()), align=2)
        xv = b.load(b.bitcast(b.gep(xsp, [g]), ir.VectorType(_F32, width).as_pointer()), align=4)
        factors = b.fmul(_halves_to_floats(b, h), xv)
        acc = list(acc)
        for j in range(width):
            acc[j % 2] = dot(b, b.add(g, _c64(j)), b.extract_element(factors, ir.Constant(_I32, j)), acc[j % 2])
        return acc

    b, (r0, r1) = _emit_counted_loop(fn, b, _c64(0), end8, 8, [zero, zero],
                                     lambda b, g, acc: group(b, g, 8, acc), "group8")
    after8 = b.block
    b.cbranch(b.icmp_signed(">=", b.sub(nb, end8), _c64(4)), group4, after4)

    b = ir.IRBuilder(group4)
    q0, q1 = group(b, end8, 4, (r0, r1))
    end4 = b.add(end8, _c64(4))
    b.branch(after4)

    b = ir.IRBuilder(after4)
    start = b.phi(_I64)
    s0 = b.phi(_V8F32)
    s1 = b.phi(_V8F32)
    for phi, v_skip, v_four in ((start, end8, end4), (s0, r0, q0), (s1, r1, q1)):
        phi.add_incoming(v_skip, after8)
        phi.add_incoming(v_four, group4)

    def lone_block(b, i, acc, slot):
        factor = b.fmul(_ir_half_to_float_fresh(b, b.load(b.gep(wsp, [i]))), b.load(b.gep(xsp, [i])))
        return dot(b, i, factor, acc, prefetch=slot != 2)

    b, r = _emit_paired_blocks(fn, b, start, nb, s0, s1, lone_block)
    b.ret(_hsum_v8f32(b, r))
    return fn


def _row_dot_typer(w_q, w_s, x_q, x_s, n, x86, stream=True, locality=3):
    ok = (isinstance(w_q, types.Array) and w_q.dtype == types.int8 and w_q.ndim == 2
          and isinstance(w_s, types.Array) and w_s.dtype == types.uint16 and w_s.ndim == 2
          and isinstance(x_q, types.Array) and x_q.dtype == types.int16 and x_q.ndim == 1
          and isinstance(x_s, types.Array) and x_s.dtype == types.float32 and x_s.ndim == 1
          and isinstance(n, types.Integer))
    if not ok:
        return None
    sig = types.float32(w_q, w_s, x_q, x_s, n)

    def codegen(context, builder, sig, args):
        aw, asc, ax, axs = (context.make_array(t)(context, builder, v) for t, v in zip(sig.args[:4], args[:4]))
        row = context.cast(builder, args[4], sig.args[4], types.int64)
        wstride = builder.extract_value(aw.strides, 0)
        sstride = builder.extract_value(asc.strides, 0)
        nb = builder.ashr(builder.extract_value(aw.shape, 1), _c64(5))
        wrow = builder.gep(builder.bitcast(aw.data, _P8), [builder.mul(row, wstride)])
        srow = builder.gep(builder.bitcast(asc.data, _P8), [builder.mul(row, sstride)])
        fn = _define_row_dot(builder.module, x86, stream, locality)
        return builder.call(fn, [wrow, srow, builder.bitcast(ax.data, _P8), builder.bitcast(axs.data, _P8), nb])

    return sig, codegen


@intrinsic
def _q8_row_dot_avx2(typingctx, w_q, w_s, x_q, x_s, n):
    """float32 dot of row n of (w_q, w_s) with (x_q, x_s): AVX2 vpmaddwd. No bounds checks."""
    return _row_dot_typer(w_q, w_s, x_q, x_s, n, True)


@intrinsic
def _q8_row_dot_generic(typingctx, w_q, w_s, x_q, x_s, n):
    """float32 dot of row n of (w_q, w_s) with (x_q, x_s): portable IR. No bounds checks."""
    return _row_dot_typer(w_q, w_s, x_q, x_s, n, False)


@intrinsic
def _q8_row_dot_avx2_l2(typingctx, w_q, w_s, x_q, x_s, n):
    """As _q8_row_dot_avx2 (the same float32 result), prefetching the weight stream into L2."""
    return _row_dot_typer(w_q, w_s, x_q, x_s, n, True, True, 2)


@intrinsic
def _q8_row_dot_generic_l2(typingctx, w_q, w_s, x_q, x_s, n):
    """As _q8_row_dot_generic (the same float32 result), prefetching the weight stream into L2."""
    return _row_dot_typer(w_q, w_s, x_q, x_s, n, False, True, 2)


@intrinsic
def _q8_row_dot_avx2_rows(typingctx, w_q, w_s, x_q, x_s, n):
    """As _q8_row_dot_avx2 (the same float32 result), without the stream prefetch."""
    return _row_dot_typer(w_q, w_s, x_q, x_s, n, True, False)


@intrinsic
def _q8_row_dot_generic_rows(typingctx, w_q, w_s, x_q, x_s, n):
    """As _q8_row_dot_generic (the same float32 result), without the stream prefetch."""
    return _row_dot_typer(w_q, w_s, x_q, x_s, n, False, False)


@njit(cache=True, inline="always")
def _check_q8(w_q, w_s, x_q, x_s, out):
    N, Kp = w_q.shape
    if (Kp % QBLOCK != 0 or w_s.shape[0] != N or w_s.shape[1] * QBLOCK != Kp or x_q.shape[0] != Kp
            or x_s.shape[0] * QBLOCK != Kp or out.shape[0] != N):
        raise ValueError("matvec_q8: shapes must be w_q (N, Kp), w_s (N, Kp//32), x_q (Kp,), x_s (Kp//32,), out (N,)")
    if w_q.strides[1] != 1 or w_s.strides[1] != 2 or x_q.strides[0] != 2 or x_s.strides[0] != 4:
        raise ValueError("matvec_q8: rows of w_q / w_s and x_q / x_s must be contiguous")


@njit(cache=True, parallel=True)
def _matvec_q8_avx2(w_q, w_s, x_q, x_s, out):
    """matvec_q8 with the AVX2 row routine (see matvec_q8)."""
    _check_q8(w_q, w_s, x_q, x_s, out)
    if w_q.shape[1] >= LONG_ROW_K:
        for n in prange(w_q.shape[0]):
            out[n] = _q8_row_dot_avx2_l2(w_q, w_s, x_q, x_s, n)
    else:
        for n in prange(w_q.shape[0]):
            out[n] = _q8_row_dot_avx2(w_q, w_s, x_q, x_s, n)


@njit(cache=True, parallel=True)
def _matvec_q8_generic(w_q, w_s, x_q, x_s, out):
    """matvec_q8 with the portable row routine (see matvec_q8)."""
    _check_q8(w_q, w_s, x_q, x_s, out)
    if w_q.shape[1] >= LONG_ROW_K:
        for n in prange(w_q.shape[0]):
            out[n] = _q8_row_dot_generic_l2(w_q, w_s, x_q, x_s, n)
    else:
        for n in prange(w_q.shape[0]):
            out[n] = _q8_row_dot_generic(w_q, w_s, x_q, x_s, n)


matvec_q8 = _matvec_q8_avx2 if HAVE_AVX2 else _matvec_q8_generic
matvec_q8.__doc__ = """out[n] = sum_b w_s[n,b] x_s[b] sum_j w_q[n,32b+j] x_q[32b+j]  (decode hot path).

w_q int8 (N, Kp), w_s uint16 (N, Kp//32) binary16 bits, x_q int16 (Kp,), x_s float32 (Kp//32,),
out float32 (N,).
int32 sums inside a block, float32 across blocks. Parallel over rows (``prange``, static schedule:
each thread streams one contiguous range); callable from other @njit functions. Raises
ValueError on inconsistent shapes or non-contiguous rows.

The weight stream's software prefetch goes to L1 (``prefetcht0``) for rows shorter than
:data:`LONG_ROW_K` and to L2 (``prefetcht1``) for longer ones, whose int16 activations (9.7 KB
for Qwen2.5-0.5B's MLP down rows of 4864) and the stream pulled into L1 4 KiB ahead evict each
other. Measured on the 2-core Zen 4 VM on the body matrices of a real decode token, the variants
interleaved in one process (medians of per-round time ratios over 60-90 rounds,
``benchmarks/matvec_prefetch.py``): L2 for the long rows alone 0.94-0.96x the time of L1
everywhere on Qwen2.5-0.5B with 2 threads, 0.99x with 1; L2 for every matrix 0.93x with 2
threads but 1.07-1.10x with 1 (Qwen2.5, SmolLM2) and 0.99-1.00x on Gemma 3 270M and SmolLM2
with 2. (Choosing by thread count inside the kernel would cost numba's on-disk cache:
``numba.get_num_threads()`` in jitted code is a dynamic global.)
"""


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
# matmul_q8 (prefill)
# ================================================================================================

TILE_BYTES = 8 << 20
"""Size of the float32 buffer one weight tile is dequantized into (per thread; L3-resident).
Measured (T=512, 2 threads): 1 MB -> 8 MB tiles raise K=4864 from 156 to 172 GFLOP/s."""


def _tile_rows(N: int, Kp: int) -> int:
    rows = max(64, min(1024, TILE_BYTES // (4 * Kp)))
    return min(N, rows // 16 * 16)


def _matmul_q8_rows(x, w_q, w_s, out, lo, hi):
    """out[:, lo:hi] = x @ dequantize(w_q, w_s)[lo:hi, :K].T, tile by tile (serial dequant + sgemm)."""
    K = x.shape[1]
    rows = _tile_rows(hi - lo, w_q.shape[1])
    buf = np.empty((rows, K), np.float32)
    for n0 in range(lo, hi, rows):
        n1 = min(hi, n0 + rows)
        _dequantize_rows_into(w_q, w_s, n0, n1, buf)
        np.matmul(x, buf[:n1 - n0].T, out=out[:, n0:n1])


_POOL = {}


def _pool(n: int):
    """A process-wide ThreadPoolExecutor with n workers (created on first use)."""
    ex = _POOL.get(n)
    if ex is None:
        from concurrent.futures import ThreadPoolExecutor
        ex = _POOL.setdefault(n, ThreadPoolExecutor(n, thread_name_prefix="cpullm-prefill"))
    return ex


def _matmul_q8_split(x, w_q, w_s, out, parts: int):
    """Row ranges of W on ``parts`` Python threads, each with single-threaded OpenBLAS."""
    N = w_q.shape[0]
    bounds = [min(N, (N * p // parts + 15) // 16 * 16) for p in range(parts)] + [N]
    with numba_setup.blas_threads(1):
        futs = [_pool(parts - 1).submit(_matmul_q8_rows, x, w_q, w_s, out, bounds[p], bounds[p + 1])
                for p in range(1, parts)]
        _matmul_q8_rows(x, w_q, w_s, out, bounds[0], bounds[1])
        for f in futs:
            f.result()


def _check_mm(x, w_q, w_s, out):
    T, K = x.shape
    N, Kp = w_q.shape
    if padded_k(K) != Kp or w_s.shape != (N, Kp // QBLOCK) or out.shape != (T, N):
        raise ValueError(f"matmul_q8: bad shapes x {x.shape}, w_q {w_q.shape}, w_s {w_s.shape}, out {out.shape}")


def matmul_q8_sgemm(x, w_q, w_s, out):
    """out (T, N) = x (T, K) @ dequantize(w_q, w_s)[:, :K].T  (prefill without the W8A16 GEMM).

    x float32 (T, K), w_q int8 (N, Kp), w_s uint16 (N, Kp // 32), out float32 (T, N) (any row
    strides).
    Plain Python, no numba parallel region (so no spin fight with OpenBLAS's threads): tiles of
    weight rows are dequantized by serial numba (nogil) into a float32 buffer and multiplied by
    OpenBLAS sgemm (numpy.matmul writes straight into the strided column block of ``out``).
    With k > 1 configured threads the rows of W are split over k Python threads, each running
    single-threaded OpenBLAS (no OpenBLAS thread pool, no barriers between tiles).
    """
    _check_mm(x, w_q, w_s, out)
    parts = numba_setup.configured_threads()
    if parts > 1 and w_q.shape[0] >= 64 * parts and numba_setup._openblas_libs():
        _matmul_q8_split(x, w_q, w_s, out, parts)
    else:
        _matmul_q8_rows(x, w_q, w_s, out, 0, w_q.shape[0])
