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
the one-row block quantizer ``_quantize_row`` and its reference ``_quantize_blocks_ref``; LLVM IR
pieces (integer block dot products ``_block_dot_i32x8``, binary16 conversions
``_ir_half_to_float`` / ``_ir_half_to_float_fresh`` / ``_halves_to_floats``, the scaled FMA
``_scaled_fma``, the weight-stream prefetch ``_prefetch_ahead``, ``_hsum_v8f32``, the loop
builders ``_emit_counted_loop`` / ``_emit_if``, and ``_vnni_block_sums``, the ``vpdpwssd`` register
tile of q8_panels and q8_gemm); ``activation_scratch``, the prefill GEMMs' kept int16 buffers;
``_pool``, Python worker threads. Numba's
on-disk cache keys a kernel on its own source file only: a changed IR helper here needs the numba
cache cleared for the kernels of other modules that inline it.
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

QBLOCK = 32
"""Values per quantization block along K."""

PREFETCH_BYTES = 4096
"""Software-prefetch distance in a q8 weight stream (:func:`_prefetch_ahead`): 4 KiB brought a
whole decode sweep to the speed of a plain read of the same bytes (+4-7 % over 1 KiB; 8 KiB no
better)."""

HAVE_AVX2 = {"avx2", "fma"} <= numba_setup.HOST_FEATURES
"""True on x86 with AVX2 and FMA: the kernels that import it compile their AVX2 variants (else
portable IR)."""

_HALF_IN_HARDWARE = "f16c" in numba_setup.HOST_FEATURES or not numba_setup.HOST_IS_X86
"""binary16 -> float32 by LLVM's fpext (vcvtph2ps on x86 with F16C); else integer IR."""


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


def matvec_f32_ref(w, x):
    """numpy reference (float64 result). w (N, K) @ x (K,) -> (N,)."""
    return w.astype(np.float64) @ x.astype(np.float64)


def matmul_f32_ref(x, w):
    """numpy reference (float64 result). x (T, K) @ w (N, K).T -> (T, N)."""
    return x.astype(np.float64) @ w.astype(np.float64).T


# ================================================================================================
# LLVM IR types and small helpers
# ================================================================================================

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_F32 = ir.FloatType()
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
    into ``vpinsrw $0, mem, %xmmK, %xmmD`` with whatever register it picks as %xmmK; in a loop of
    FMAs that can be a float accumulator, which chains each block's scale conversion to the
    previous block's FMA (measured in a row-dot loop: 7-9 cycles per block of 32 in L1). Here the
    bits go through a GPR and ``vmovd`` (which zeroes the rest), then one ``vcvtph2ps`` LLVM
    cannot rewrite (inline asm)."""
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
# LLVM IR building blocks of the integer kernels (q8_panels, head_screen, kquant)
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


def _vnni_block_sums(b, wptrs, xptrs, load: str, pair_bytes: int, chains: int = 1):
    """IR: the int32 sums of one block of 32 values for a register tile of TR activation rows
    (``xptrs``: pointers at each row's block, one int16 pair every 4 bytes) by V weight vectors
    (``wptrs``: i8* at each vector's first pair, the next pair ``pair_bytes`` on), as one
    inline-assembly routine: per pair, V loads (``load``: "vmovdqu64" for int16 weights,
    "vpmovsxbw" to widen 32 int8 ones) and TR x V ``vpdpwssd`` with the activation pair broadcast
    from memory. Returns sums[t][v][c] (<16 x i32>), pair p summed into chain p % chains (several
    chains hide the instruction's latency in a small tile; the integer sum is the same).

    Inline assembly, not IR: LLVM's tuning for some Intel hosts rewrites every ``vpdpwssd`` into
    ``vpmaddwd`` + ``vpaddd`` and hoists the broadcasts into spilled registers (the q8 panels'
    8-row tile then ran at a third to half the speed)."""
    TR, V = len(xptrs), len(wptrs)
    nacc = TR * V * chains
    reg = lambda i: f"${i}"  # noqa: E731
    acc = lambda t, v, c: reg((t * V + v) * chains + c)  # noqa: E731
    wreg = lambda v: reg(nacc + v)  # noqa: E731
    wptr = lambda v: reg(nacc + V + v)  # noqa: E731
    xptr = lambda t: reg(nacc + 2 * V + t)  # noqa: E731
    lines = [f"vpxord {acc(t, v, c)}, {acc(t, v, c)}, {acc(t, v, c)}"
             for t in range(TR) for v in range(V) for c in range(chains)]
    for p in range(16):
        for v in range(V):
            lines.append(f"{load} {pair_bytes * p}({wptr(v)}), {wreg(v)}")
        for t in range(TR):
            for v in range(V):
                lines.append(f"vpdpwssd {4 * p}({xptr(t)}){{1to16}}, {wreg(v)}, {acc(t, v, p % chains)}")
    v16i32 = ir.VectorType(_I32, 16)
    ret = ir.LiteralStructType([v16i32] * (nacc + V))
    ins = list(wptrs) + list(xptrs)
    asm = ir.InlineAsm(ir.FunctionType(ret, [x.type for x in ins]), "\n\t".join(lines),
                       ",".join(["=&v"] * (nacc + V) + ["r"] * len(ins) + ["~{memory}"]))
    r = b.call(asm, ins)
    return [[[b.extract_value(r, (t * V + v) * chains + c) for c in range(chains)] for v in range(V)]
            for t in range(TR)]


YMM_DOTS = ("avx2", "avxvnni")
"""The 256-bit multiply-add variants of :func:`_ymm_block_sums`: ``vpmaddwd`` + ``vpaddd``
(AVX2), or the VEX-encoded ``vpdpwssd`` (AVX-VNNI: Alder Lake and later client CPUs, which have
no AVX-512)."""


def _ymm_block_sums(b, wptrs, xptrs, load: str, pair_bytes: int, dot: str):
    """IR: the int32 sums of one block of 32 values for a register tile of TR activation rows
    (``xptrs``: pointers at each row's block, one int16 pair every 4 bytes) by H weight vectors of
    8 int32 lanes (``wptrs``: i8* at each vector's first pair, the next pair ``pair_bytes`` on;
    ``load``: "vpmovsxbw" widens 16 int8 values, "vmovdqu" loads 16 int16 ones), as one
    inline-assembly routine on the 16 ymm registers. Returns sums[t][h] (<8 x i32>).

    ``dot`` "avx2": per pair and (row, vector) ``vpmaddwd`` into a product register, then
    ``vpaddd``; "avxvnni": one ``{vex} vpdpwssd`` (accumulating). Per pair, whichever of the
    weight vectors (H) or the broadcast activation pairs (TR) are fewer stay live, so the tile
    needs TR * H + min(TR, H) + 1 registers (+ 1 product for "avx2"); callers keep that <= 16.
    Inline assembly, not IR: as IR, LLVM reorders the work accumulator by accumulator and spills
    (measured: the q8 panels' AVX2 tile as IR spilled 1100 ymm registers per call site)."""
    TR, H = len(xptrs), len(wptrs)
    nacc = TR * H
    weights_live = H <= TR
    nlive = min(TR, H)
    scratch = nlive + 1 + (dot == "avx2")
    if nacc + scratch > 16:
        raise ValueError(f"a {TR} x {H} ymm tile needs {nacc + scratch} registers")
    reg = lambda i: f"${i}"  # noqa: E731
    acc = lambda t, h: reg(t * H + h)  # noqa: E731
    live = lambda i: reg(nacc + i)  # noqa: E731
    one = reg(nacc + nlive)                    # the other operand: a broadcast or a weight vector
    prod = reg(nacc + nlive + 1)
    wptr = lambda h: reg(nacc + scratch + h)  # noqa: E731
    xptr = lambda t: reg(nacc + scratch + H + t)  # noqa: E731

    def madd(w, x, a):
        if dot == "avx2":
            return [f"vpmaddwd {w}, {x}, {prod}", f"vpaddd {prod}, {a}, {a}"]
        return [f"{{vex}} vpdpwssd {w}, {x}, {a}"]

    lines = [f"vpxor {acc(t, h)}, {acc(t, h)}, {acc(t, h)}" for t in range(TR) for h in range(H)]
    for p in range(16):
        if weights_live:
            for h in range(H):
                lines.append(f"{load} {pair_bytes * p}({wptr(h)}), {live(h)}")
            for t in range(TR):
                lines.append(f"vpbroadcastd {4 * p}({xptr(t)}), {one}")
                for h in range(H):
                    lines += madd(live(h), one, acc(t, h))
        else:
            for t in range(TR):
                lines.append(f"vpbroadcastd {4 * p}({xptr(t)}), {live(t)}")
            for h in range(H):
                lines.append(f"{load} {pair_bytes * p}({wptr(h)}), {one}")
                for t in range(TR):
                    lines += madd(one, live(t), acc(t, h))
    ret = ir.LiteralStructType([_V8I32] * (nacc + scratch))
    ins = list(wptrs) + list(xptrs)
    # "~{memory}": the routine reads memory LLVM cannot see through its pointer operands
    asm = ir.InlineAsm(ir.FunctionType(ret, [x.type for x in ins]), "\n\t".join(lines),
                       ",".join(["=&x"] * (nacc + scratch) + ["r"] * len(ins) + ["~{memory}"]))
    r = b.call(asm, ins)
    return [[b.extract_value(r, t * H + h) for h in range(H)] for t in range(TR)]


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


def _pool(n: int):
    """A process-wide ThreadPoolExecutor with n workers (created on first use): kquant_gemm's
    dequantize + sgemm prefill splits the rows of W over such threads."""
    ex = _POOL.get(n)
    if ex is None:
        from concurrent.futures import ThreadPoolExecutor
        ex = _POOL.setdefault(n, ThreadPoolExecutor(n, thread_name_prefix="cpullm-prefill"))
    return ex
