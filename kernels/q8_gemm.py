"""Prefill GEMM for q8 block-32 weights with int16 activations on AVX-512 VNNI (``vpdpwssd``).

    out (T, N) = x (T, K) @ W.T,   W = q8 block-32 (w_q int8 (N, Kp), w_s uint16 (N, Kp // 32))

Numerics ("W8A16", the same as the decode matvec ``q8.matvec_q8``): every row of x is quantized
to int16 blocks of 32 (``q8.quantize_act_q16``: scale max|v| / 32767), and

    out[t, n] = sum_b f16(w_s[n, b]) * x_s[t, b] * sum_j w_q[n, 32b + j] * x_q[t, 32b + j]

with the inner sums exact in int32 (|sum| <= 32 * 127 * 32767 < 2^27) and float32 across blocks.
The activation rounding error is <= 2^-16 of each block's largest value: for the logits this is
as good as float32 activations, unlike int8 activations (llama.cpp's Q8_0 x Q8_0), which cost
SmolLM2-135M measurable top-1 agreement with float32.

Why: one ``vpdpwssd`` does 32 int16 multiply-adds, twice the work of a float32 FMA of the same
width, and the weights stay 1 byte each in memory. On the 2-core Zen 5 this replaces
dequantize + OpenBLAS sgemm (benchmarks/kernels_q8.py ``matmul`` shows both).

Structure (GotoBLAS-like, everything sized for one core's L1 / L2):

* x is quantized once: ``x_q`` int16 (Tp, Kp), ``x_s`` float32 (Tp, nb), Tp = T rounded up to the
  register tile's TR rows (the extra rows are zero).
* The N rows of W are cut into panels of NR = 16 * V rows; each thread takes a contiguous range
  of panels (static split over ``numba.get_num_threads()`` threads).
* A panel is packed KC_BLOCKS = 8 blocks (256 values of K) at a time into an L1-resident buffer,
  sign-extended to int16 and interleaved as ``vpdpwssd`` reads it:
  ``wp[((b * 16 + p) * V + v) * 32 + 2 * lane + e] = w_q[n0 + 16 v + lane, 32 b + 2 p + e]``,
  with the panel's scales ``sp[(b * V + v) * 16 + lane]`` as float32 (rows past N are zero).
* For each packed chunk the register micro-kernel (LLVM IR, TR x V vectors of 16 int32 / float32
  lanes) runs over every TR-row tile of x: per block, 16 steps of V weight loads and TR x V
  ``vpdpwssd`` with the activation pair broadcast from memory; then the int32 block sums are
  converted and accumulated into float32 with one FMA by ``w_scale * x_scale``. Tiles accumulate
  in a per-panel float32 buffer (Tp, NR), copied to ``out`` when the panel is done.

Only on x86 hosts with AVX-512 F/BW/VNNI (``HAVE_VNNI512``). :func:`matmul_q8`, the prefill
entry point the executor calls, picks the path: this kernel where it runs and T >= MIN_ROWS; one
quantize + ``q8.matvec_q8`` per row for fewer rows (the same numerics, without packing every
weight for one or two rows); elsewhere ``q8.matmul_q8_sgemm`` (dequantize + OpenBLAS, float32
activations). The numpy reference is :func:`matmul_w8a16_ref`.

Not for AVX2-only CPUs: an 8-lane variant of this kernel (``vpmaddwd`` + ``vpaddd``, 3 x 2
tiles in the 16 ymm registers) was built and measured with AVX2-only code generation on the
Zen 5 (NUMBA_CPU_NAME=znver3 without the AVX-512 features, OpenBLAS on its Haswell kernels):
165 / 169 / 189 GOP/s on Qwen2.5-0.5B's gate/up, down and qkv shapes against sgemm's 161 / 186 /
208, no gain, so those CPUs keep dequantize + sgemm.
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from . import numba_setup
from .q8 import (QBLOCK, _c64, _decl, half_to_float, matmul_q8_sgemm, matvec_q8, matvec_q8_ref, padded_k,
                 quantize_act_q16, quantize_act_q16_ref)

HAVE_VNNI512 = numba_setup.HOST_IS_X86 and {"avx512f", "avx512bw", "avx512vnni"} <= numba_setup.HOST_FEATURES
"""True when this CPU can run :func:`matmul_w8a16` (AVX-512 VNNI)."""

MIN_ROWS = 3
"""Fewest rows :func:`matmul_q8` sends through the GEMM: packing a panel costs about as much as
reading the weights once, which is what a matvec per row costs (measured on Qwen2.5-0.5B's
gate/up, 9728 x 896: 0.2 ms per row by matvec, 0.55-0.6 ms by the GEMM for 2 or 3 rows)."""

# Register tile and K chunk, measured on the 2-core Zen 5 (T=512, Qwen2.5-0.5B's gate/up and down
# shapes, GOP/s): 3x4 512 / 638, 4x3 465 / 540, 6x2 470 / 620, 4x4 (spills) 369 / 333, 8x1 380 / 465;
# K chunks of 4 or 16 blocks were no better than 8.
TR = 3                # activation rows per register tile
V = 4                 # 16-lane weight vectors per register tile: NR = 64 weight rows
NR = 16 * V
KC_BLOCKS = 8         # blocks of 32 packed and multiplied at a time: 64 x 256 int16 = 32 KiB (L1)

_I16, _I32, _I64 = ir.IntType(16), ir.IntType(32), ir.IntType(64)
_F32 = ir.FloatType()
_V16I32 = ir.VectorType(_I32, 16)
_V16F32 = ir.VectorType(_F32, 16)


def _splat(b, scalar, vty):
    v = b.insert_element(ir.Constant(vty, ir.Undefined), scalar, ir.Constant(_I32, 0))
    return b.shuffle_vector(v, v, ir.Constant(_V16I32, [0] * 16))


def _define_tile(module):
    """void @cpullm_w8a16_tile(i16* wp, f32* sp, i16* xq, i64 xq_stride, f32* xs, i64 xs_stride,
    i64 nblocks, f32* c): c[t * NR + 16 v + lane] += the tile's sums over ``nblocks`` blocks.

    wp / sp: a packed panel chunk (see the module docstring); xq / xs: row t0 of the activations
    at the chunk's first value / block; strides in elements. alwaysinline.
    """
    name = f"cpullm_w8a16_tile_{TR}x{V}"
    fn = module.globals.get(name)
    if fn is not None:
        return fn
    p16, pf = _I16.as_pointer(), _F32.as_pointer()
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [p16, pf, p16, _I64, pf, _I64, _I64, pf]), name)
    fn.linkage = "internal"
    fn.attributes.add("alwaysinline")
    fn.attributes.add("nounwind")
    wp, sp, xq, xq_st, xs, xs_st, nb, c = fn.args
    entry, loop, done = (fn.append_basic_block(s) for s in ("entry", "loop", "done"))
    dpwssd = _decl(module, "llvm.x86.avx512.vpdpwssd.512", _V16I32, [_V16I32, _V16I32, _V16I32])
    fmuladd = _decl(module, "llvm.fmuladd.v16f32", _V16F32, [_V16F32, _V16F32, _V16F32])
    zero_i = ir.Constant(_V16I32, [0] * 16)

    b = ir.IRBuilder(entry)
    cvec = [[b.bitcast(b.gep(c, [_c64(t * NR + 16 * v)]), _V16F32.as_pointer()) for v in range(V)] for t in range(TR)]
    acc0 = [[b.load(cvec[t][v], align=4) for v in range(V)] for t in range(TR)]
    xrows = [b.gep(xq, [b.mul(xq_st, _c64(t))]) for t in range(TR)]
    srows = [b.gep(xs, [b.mul(xs_st, _c64(t))]) for t in range(TR)]
    b.branch(loop)

    b = ir.IRBuilder(loop)
    blk = b.phi(_I64)
    acc = [[b.phi(_V16F32) for v in range(V)] for t in range(TR)]
    dots = [[zero_i for v in range(V)] for t in range(TR)]
    wblk = b.gep(wp, [b.mul(blk, _c64(16 * V * 32))])
    k0 = b.mul(blk, _c64(QBLOCK))
    xpairs = [b.bitcast(b.gep(xrows[t], [k0]), _I32.as_pointer()) for t in range(TR)]
    for p in range(16):
        w = [b.load(b.bitcast(b.gep(wblk, [_c64((p * V + v) * 32)]), _V16I32.as_pointer()), align=4)
             for v in range(V)]
        for t in range(TR):
            a = _splat(b, b.load(b.gep(xpairs[t], [_c64(p)]), align=4), _V16I32)
            for v in range(V):
                dots[t][v] = b.call(dpwssd, [dots[t][v], a, w[v]])
    ws = [b.load(b.bitcast(b.gep(sp, [b.add(b.mul(blk, _c64(NR)), _c64(16 * v))]), _V16F32.as_pointer()), align=4)
          for v in range(V)]
    new = [[None] * V for _ in range(TR)]
    for t in range(TR):
        xs_t = _splat(b, b.load(b.gep(srows[t], [blk]), align=4), _V16F32)
        for v in range(V):
            new[t][v] = b.call(fmuladd, [b.sitofp(dots[t][v], _V16F32), b.fmul(ws[v], xs_t), acc[t][v]])
    nxt = b.add(blk, _c64(1))
    blk.add_incoming(_c64(0), entry)
    blk.add_incoming(nxt, loop)
    for t in range(TR):
        for v in range(V):
            acc[t][v].add_incoming(acc0[t][v], entry)
            acc[t][v].add_incoming(new[t][v], loop)
    b.cbranch(b.icmp_signed("<", nxt, nb), loop, done)

    b = ir.IRBuilder(done)
    for t in range(TR):
        for v in range(V):
            b.store(new[t][v], cvec[t][v], align=4)
    b.ret_void()
    return fn


@intrinsic
def _w8a16_tile(typingctx, wp, sp, xq, xs, t0, k0, c, c0, nblocks):
    """Micro-kernel call: c[c0:] (TR x NR) += packed chunk (wp, sp) times rows t0.. of (xq, xs)
    from value k0 / block k0 // 32 on, over ``nblocks`` blocks (>= 1). No bounds checks."""
    ok = (isinstance(wp, types.Array) and wp.dtype == types.int16 and wp.ndim == 1
          and isinstance(sp, types.Array) and sp.dtype == types.float32 and sp.ndim == 1
          and isinstance(xq, types.Array) and xq.dtype == types.int16 and xq.ndim == 2
          and isinstance(xs, types.Array) and xs.dtype == types.float32 and xs.ndim == 2
          and isinstance(c, types.Array) and c.dtype == types.float32 and c.ndim == 1
          and all(isinstance(i, types.Integer) for i in (t0, k0, c0, nblocks)))
    if not ok:
        return None
    sig = types.void(wp, sp, xq, xs, t0, k0, c, c0, nblocks)

    def codegen(context, builder, sig, args):
        awp, asp, axq, axs = (context.make_array(ty)(context, builder, v) for ty, v in zip(sig.args[:4], args[:4]))
        ac = context.make_array(sig.args[6])(context, builder, args[6])
        t0_, k0_, c0_, nb_ = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (4, 5, 7, 8))
        xq_st = builder.ashr(builder.extract_value(axq.strides, 0), _c64(1))   # bytes -> int16
        xs_st = builder.ashr(builder.extract_value(axs.strides, 0), _c64(2))   # bytes -> float32
        xq_p = builder.gep(axq.data, [builder.add(builder.mul(t0_, xq_st), k0_)])
        xs_p = builder.gep(axs.data, [builder.add(builder.mul(t0_, xs_st), builder.ashr(k0_, _c64(5)))])
        fn = _define_tile(builder.module)
        builder.call(fn, [awp.data, asp.data, xq_p, xq_st, xs_p, xs_st, nb_, builder.gep(ac.data, [c0_])])
        return context.get_dummy_value()

    return sig, codegen


def _transpose16(b, rows):
    """16 <16 x i32> vectors -> their transpose (out[p][r] = rows[r][p]): 4 stages of 16
    two-source shuffles, each swapping one bit of the vector index with one of the lane index."""
    vecs = list(rows)
    for j in range(4):
        bit = 1 << j
        lo = ir.Constant(_V16I32, [(16 if e & bit else 0) + (e & ~bit) for e in range(16)])
        hi = ir.Constant(_V16I32, [(16 if e & bit else 0) + (e | bit) for e in range(16)])
        nxt = list(vecs)
        for i in range(16):
            if i & bit:
                continue
            a, c = vecs[i], vecs[i | bit]
            nxt[i] = b.shuffle_vector(a, c, lo)
            nxt[i | bit] = b.shuffle_vector(a, c, hi)
        vecs = nxt
    return vecs


@intrinsic
def _pack_rows16(typingctx, w_q, n0, blk, wp, off):
    """Pack one block of 16 weight rows: rows n0 .. n0 + 15 of w_q (int8 (N, Kp)), values
    32 blk .. 32 blk + 31, sign-extended to int16 pairs and transposed so that pair p of row
    n0 + lane lands at int16 offset ``off + p * V * 32 + 2 * lane`` of wp. No bounds checks."""
    ok = (isinstance(w_q, types.Array) and w_q.dtype == types.int8 and w_q.ndim == 2
          and isinstance(wp, types.Array) and wp.dtype == types.int16 and wp.ndim == 1
          and all(isinstance(i, types.Integer) for i in (n0, blk, off)))
    if not ok:
        return None
    sig = types.void(w_q, n0, blk, wp, off)

    def codegen(context, builder, sig, args):
        aw = context.make_array(sig.args[0])(context, builder, args[0])
        awp = context.make_array(sig.args[3])(context, builder, args[3])
        n0_, blk_, off_ = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (1, 2, 4))
        stride = builder.extract_value(aw.strides, 0)
        base = builder.gep(builder.bitcast(aw.data, ir.IntType(8).as_pointer()),
                           [builder.add(builder.mul(n0_, stride), builder.shl(blk_, _c64(5)))])
        v32i8, v32i16 = ir.VectorType(ir.IntType(8), 32), ir.VectorType(_I16, 32)
        rows = []
        for r in range(16):
            p = builder.bitcast(builder.gep(base, [builder.mul(stride, _c64(r))]), v32i8.as_pointer())
            rows.append(builder.bitcast(builder.sext(builder.load(p, align=1), v32i16), _V16I32))
        dst = builder.gep(awp.data, [off_])
        for p, vec in enumerate(_transpose16(builder, rows)):
            q = builder.bitcast(builder.gep(dst, [_c64(p * V * 32)]), _V16I32.as_pointer())
            builder.store(vec, q, align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True)
def _pack_chunk(w_q, w_s, n0, b0, nblocks, wp, sp):
    """Pack rows n0 .. n0 + NR - 1, blocks b0 .. b0 + nblocks - 1 of (w_q, w_s) into (wp, sp)
    (layout: module docstring); rows past N are packed as zeros."""
    N = w_q.shape[0]
    for v in range(V):
        g0 = n0 + 16 * v
        for lane in range(16):
            n = g0 + lane
            for bb in range(nblocks):
                sp[(bb * V + v) * 16 + lane] = half_to_float(w_s[n, b0 + bb]) if n < N else np.float32(0.0)
        if g0 + 16 <= N:
            for bb in range(nblocks):
                _pack_rows16(w_q, g0, b0 + bb, wp, bb * 16 * V * 32 + v * 32)
            continue
        for lane in range(16):                     # the last, partial group of rows
            n = g0 + lane
            for bb in range(nblocks):
                base = bb * 16 * V * 32 + v * 32 + 2 * lane
                for p in range(16):
                    if n < N:
                        wp[base + p * V * 32] = w_q[n, (b0 + bb) * QBLOCK + 2 * p]
                        wp[base + p * V * 32 + 1] = w_q[n, (b0 + bb) * QBLOCK + 2 * p + 1]
                    else:
                        wp[base + p * V * 32] = 0
                        wp[base + p * V * 32 + 1] = 0


@njit(cache=True, parallel=True)
def _quantize_rows_q16(x, x_q, x_s):
    """x float32 (T, K) -> rows of x_q int16 (Tp, Kp) / x_s float32 (Tp, Kp // 32); rows >= T zero."""
    T = x.shape[0]
    for t in prange(x_q.shape[0]):
        if t < T:
            quantize_act_q16(x[t], x_q[t], x_s[t])
        else:
            x_q[t, :] = 0
            x_s[t, :] = 0.0


@njit(cache=True, parallel=True)
def _gemm_panels(x_q, x_s, w_q, w_s, T, out, nthreads):
    """out[:T] = the W8A16 product, panels of NR rows split over the threads."""
    N, Kp = w_q.shape
    nb = Kp // QBLOCK
    Tp = x_q.shape[0]
    npanel = (N + NR - 1) // NR
    nth = max(1, min(nthreads, npanel))
    for c in prange(nth):
        wp = np.empty(KC_BLOCKS * 16 * V * 32, np.int16)
        sp = np.empty(KC_BLOCKS * NR, np.float32)
        cbuf = np.empty(Tp * NR, np.float32)
        for p in range(c * npanel // nth, (c + 1) * npanel // nth):
            n0 = p * NR
            cbuf[:] = 0.0
            for b0 in range(0, nb, KC_BLOCKS):
                nblk = min(KC_BLOCKS, nb - b0)
                _pack_chunk(w_q, w_s, n0, b0, nblk, wp, sp)
                for t0 in range(0, Tp, TR):
                    _w8a16_tile(wp, sp, x_q, x_s, t0, b0 * QBLOCK, cbuf, t0 * NR, nblk)
            ncols = min(NR, N - n0)
            for t in range(T):
                orow = out[t]
                for j in range(ncols):
                    orow[n0 + j] = cbuf[t * NR + j]


def _check(x, w_q, w_s, out):
    T, K = x.shape
    N, Kp = w_q.shape
    if padded_k(K) != Kp or w_s.shape != (N, Kp // QBLOCK) or out.shape != (T, N):
        raise ValueError(f"matmul_w8a16: bad shapes x {x.shape}, w_q {w_q.shape}, w_s {w_s.shape}, out {out.shape}")
    if x.dtype != np.float32 or w_q.dtype != np.int8 or w_s.dtype != np.uint16 or out.dtype != np.float32:
        raise ValueError("matmul_w8a16: dtypes must be x float32, w_q int8, w_s uint16, out float32")


def matmul_w8a16(x, w_q, w_s, out):
    """out (T, N) = x (T, K) @ W.T with int16-quantized x (see the module docstring).

    x float32 (T, K) (rows contiguous), w_q int8 (N, Kp), w_s uint16 (N, Kp // 32) binary16
    bits, out float32 (T, N) (rows contiguous; any row stride). Needs ``HAVE_VNNI512``.
    """
    if not HAVE_VNNI512:
        raise RuntimeError("matmul_w8a16 needs a CPU with AVX-512 VNNI")
    _check(x, w_q, w_s, out)
    T = x.shape[0]
    Kp = w_q.shape[1]
    Tp = (T + TR - 1) // TR * TR
    x_q = np.empty((Tp, Kp), np.int16)
    x_s = np.empty((Tp, Kp // QBLOCK), np.float32)
    _quantize_rows_q16(np.ascontiguousarray(x), x_q, x_s)
    _gemm_panels(x_q, x_s, w_q, w_s, T, out, numba.get_num_threads())


def matmul_w8a16_ref(x, w_q, w_s):
    """numpy reference (float64 result): each row of x quantized as quantize_act_q16_ref, then
    the exact block sums of matvec_q8_ref. (T, N)."""
    Kp = w_q.shape[1]
    rows = []
    for t in range(x.shape[0]):
        x_q, x_s = quantize_act_q16_ref(x[t], Kp)
        rows.append(matvec_q8_ref(w_q, w_s, x_q, x_s))
    return np.stack(rows) if rows else np.zeros((0, w_q.shape[0]))


@njit(cache=True, parallel=False)
def _matvec_rows(x, w_q, w_s, out, x_q, x_s):
    for t in range(x.shape[0]):
        quantize_act_q16(x[t], x_q, x_s)
        matvec_q8(w_q, w_s, x_q, x_s, out[t])


def matmul_q8(x, w_q, w_s, out):
    """out (T, N) = x (T, K) @ W.T for q8 weights (prefill): the fastest path this CPU has.

    x float32 (T, K) C-contiguous, w_q int8 (N, Kp), w_s uint16 (N, Kp // 32), out float32 (T, N)
    C-contiguous. With AVX-512 VNNI the activations are int16-quantized per block of 32 (the
    decode path's numerics); otherwise they stay float32 (weights-only INT8 via sgemm).
    """
    if not HAVE_VNNI512:
        matmul_q8_sgemm(x, w_q, w_s, out)
        return
    _check(x, w_q, w_s, out)
    if x.shape[0] >= MIN_ROWS:
        matmul_w8a16(x, w_q, w_s, out)
        return
    Kp = w_q.shape[1]
    _matvec_rows(np.ascontiguousarray(x), w_q, w_s, out, np.empty(Kp, np.int16), np.empty(Kp // QBLOCK, np.float32))
