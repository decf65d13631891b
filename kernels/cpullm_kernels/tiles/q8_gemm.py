"""W8A16 GEMM for int8 weights with int16 activations: the register micro-kernel (AVX-512 VNNI
or AVX2), its panel packing, and a driver on q8 block-32 weights.

    out (T, N) = x (T, K) @ W.T,   W = q8 block-32 (w_q int8 (N, Kp), w_s uint16 (N, Kp // 32))

Users: kquant_gemm's integer GEMM (prefill over raw GGUF blocks) runs the micro-kernel
(:func:`w8a16_tile`) on panels it packs from the blocks' own quants with :func:`pack_rows16` /
:func:`transpose16`, with this module's activation quantizer, scratch, tile and chunk sizes.
:func:`matmul_w8a16` runs the same micro-kernel on q8 block-32 weights, where its tests
(tests/test_kernels_q8_gemm.py) and benchmarks reach it. The runtime's q8 LINEAR is
kernels/cpullm_kernels/panels/q8_panels.py.

Numerics ("W8A16", the activation quantization of the q8 LINEAR): every row of x is quantized to
int16 blocks of 32 (``q8.quantize_act_q16``: scale max|v| / 32767), and

    out[t, n] = sum_b f16(w_s[n, b]) * x_s[t, b] * sum_j w_q[n, 32b + j] * x_q[t, 32b + j]

with the inner sums exact in int32 (|sum| <= 32 * 127 * 32767 < 2^27) and float32 across blocks.
The activation rounding error is <= 2^-16 of each block's largest value: for the logits this is
as good as float32 activations, unlike int8 activations (llama.cpp's Q8_0 x Q8_0), which cost
SmolLM2-135M measurable top-1 agreement with float32.

Why: an int16 multiply-add instruction does twice the work of a float32 FMA of the same width,
and the weights stay 1 byte each in memory. Two variants (``GEMM_ISA``), one code path:

* ``avx512vnni``: ``vpdpwssd`` on zmm (32 multiply-adds, accumulating), register tile TR x V =
  3 x 4 vectors of 16 lanes: 2.2-3x the speed of dequantize + OpenBLAS sgemm at T=512.
* ``avx2`` (x86 with AVX2, FMA and F16C): ``vpmaddwd`` + ``vpaddd`` on ymm, tile 4 x 2 vectors of
  8 lanes with the float32 accumulators in an L1/L2-resident panel buffer (the 16 ymm registers
  hold the int32 block sums, two weight vectors, the broadcast and the product). A block's 16
  steps are one inline-assembly routine (:func:`llvm_ir.ymm_block_sums`): written as IR, LLVM
  reassociates each accumulator's adds, keeps all 16 weight vectors live and spills (half the
  speed). With the routine it beats dequantize + sgemm by about 1.25x at T=512.
* ``avxvnni`` (AVX2 + AVX-VNNI without AVX-512: Intel's client CPUs): the same with one VEX
  ``vpdpwssd`` per multiply-add, tile 6 x 2.

Structure (GotoBLAS-like, everything sized for one core's L1 / L2):

* x is quantized once: ``x_q`` int16 (Tp, Kp), ``x_s`` float32 (Tp, nb), Tp = T rounded up to the
  register tile's TR rows (the extra rows are zero).
* The N rows of W are cut into panels of NR = LANES * V rows (64 / 16); each thread takes a
  contiguous range of panels (static split over ``numba.get_num_threads()`` threads).
* A panel is packed KC_BLOCKS = 32 blocks (AVX-512: 128 KiB, AVX2: 32 KiB) at a time into a
  buffer that stays in L2 (AVX-512) or L1 (AVX2), sign-extended to int16 and interleaved as the
  multiply-add reads it, row r of the panel:
  ``wp[(b * 16 + p) * 2 * NR + 2 * r + e] = w_q[n0 + r, 32 b + 2 p + e]``, so weight vector v of
  pair p is the LANES rows from LANES * v on; the panel's scales as float32 in ``sp[b * NR + r]``
  (rows past N are zero). Packing goes 16 rows at a time (a 16 x 16 dword transpose).
* For each packed chunk the register micro-kernel (LLVM IR, TR x V vectors of int32 / float32
  lanes) runs over every TR-row tile of x: per block, 16 steps of V weight loads and TR x V
  multiply-adds with the activation pair broadcast from memory; then the int32 block sums are
  converted and accumulated into float32 with one FMA by ``w_scale * x_scale``. Tiles accumulate
  in ``out`` itself (AVX-512; a panel's columns of it stay in L2 over its K chunks), except the
  last T % TR rows and a partial last panel, or in a per-panel buffer (Tp, NR) copied to ``out``
  when the panel is done (AVX2, see SUM_INTO_OUT).

The numpy reference is :func:`matmul_w8a16_ref`.
"""
from __future__ import annotations


import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from ..setup import numba_setup
from ..rows.q8 import HAVE_AVX2 as q8_HAVE_AVX2
from ..rows.llvm_ir import F32, I16, I32, I64, const_i64, declare, vnni_block_sums, ymm_block_sums
from ..rows.q8 import (QBLOCK, activation_scratch, half_to_float, matvec_q8_ref, padded_k, quantize_act_q16_ready,
                       quantize_act_q16_at, quantize_act_q16_ref)

HAVE_VNNI512 = numba_setup.HOST_IS_X86 and {"avx512f", "avx512bw", "avx512vnni"} <= numba_setup.HOST_FEATURES
"""True when this CPU runs the AVX-512 VNNI variant of the micro-kernel."""

HAVE_AVX2 = q8_HAVE_AVX2 and "f16c" in numba_setup.HOST_FEATURES
"""True when this CPU runs at least the AVX2 variant (``vpmaddwd`` + ``vpaddd``)."""

HAVE_AVXVNNI = HAVE_AVX2 and numba_setup.HOST_IS_X86 and "avxvnni" in numba_setup.HOST_FEATURES
"""True when this CPU runs the AVX-VNNI variant (the VEX ``vpdpwssd`` on ymm)."""

GEMM_ISA = "avx512vnni" if HAVE_VNNI512 else "avxvnni" if HAVE_AVXVNNI else "avx2" if HAVE_AVX2 else None
"""Which variant of the micro-kernel this process compiles, or None (no AVX2 + FMA + F16C:
:func:`matmul_w8a16` raises, kquant_gemm's prefill uses dequantize + sgemm)."""

# Register tiles (TR activation rows x V weight vectors of LANES int32 lanes): the largest tile
# whose accumulators fit the register file without spilling (AVX-512's 32 zmm: 3x4 was the fastest
# of 3x4, 4x3, 6x2, 8x1 and 4x4, which spills; AVX2's 16 ymm: 4x2, sums in the panel buffer).
# AVX-VNNI: 6 x 2, so that 12 independent sums keep two vpdpwssd a cycle busy through the
# instruction's 5-cycle latency (4 x 2 would wait on it).
if GEMM_ISA == "avx512vnni":
    LANES, TR, V = 16, 3, 4
elif GEMM_ISA == "avxvnni":
    LANES, TR, V = 8, 6, 2
else:
    LANES, TR, V = 8, 4, 2
NR = LANES * V        # weight rows per panel (a multiple of the 16 rows pack_rows16 packs)
KC_BLOCKS = 32
"""Blocks of 32 packed and multiplied at a time: 1024 values of 64 rows (AVX-512) or 16 rows (AVX2)
as int16. Each chunk reloads and stores the panel's sums in ``out``, so fewer, larger chunks win
until the packed chunk crowds x out of L2 (a 512-token prefill took 0.95x the time with 32 blocks
against an L1-sized 8; larger chunks gained nothing more)."""
FACC_IN_REGS = 2 * TR * V + V + 2 <= (32 if LANES == 16 else 16)
"""Whether the float32 accumulators of a tile fit in registers beside the int32 block sums (else
they live in the panel buffer, loaded and stored once per block)."""
SUM_INTO_OUT = FACC_IN_REGS
"""Whether full panels' tiles sum straight into ``out`` rather than a per-panel buffer (Tp, NR)
copied out at the end. With the sums in registers (AVX-512), the buffer and its copy took 15-22 %
of the GEMM's time; the AVX2 tile, which loads and stores its sums every block, keeps them in the
compact buffer (summing into ``out`` gained nothing there)."""

_VI32 = ir.VectorType(I32, LANES)
_VF32 = ir.VectorType(F32, LANES)
_V16I32 = ir.VectorType(I32, 16)   # 16 packed rows (pack_rows16), whatever LANES is


def _splat(b, scalar, vty):
    v = b.insert_element(ir.Constant(vty, ir.Undefined), scalar, ir.Constant(I32, 0))
    return b.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, vty.count), [0] * vty.count))


def _define_tile(module):
    """void @cpullm_w8a16_tile(i16* wp, f32* sp, i16* xq, i64 xq_stride, f32* xs, i64 xs_stride,
    i64 nblocks, f32* c, i64 c_stride, i1 init): c[t * c_stride + LANES * v + lane] += the tile's
    sums over ``nblocks`` blocks (with ``init``, = instead of +=: the tile is zeroed first).

    wp / sp: a packed panel chunk (see the module docstring); xq / xs: row t0 of the activations
    at the chunk's first value / block; strides in elements. alwaysinline.
    """
    name = f"cpullm_w8a16_tile_{GEMM_ISA}_{TR}x{V}"
    fn = module.globals.get(name)
    if fn is not None:
        return fn
    p16, pf = I16.as_pointer(), F32.as_pointer()
    fnty = ir.FunctionType(ir.VoidType(), [p16, pf, p16, I64, pf, I64, I64, pf, I64, ir.IntType(1)])
    fn = ir.Function(module, fnty, name)
    fn.linkage = "internal"
    fn.attributes.add("alwaysinline")
    fn.attributes.add("nounwind")
    wp, sp, xq, xq_st, xs, xs_st, nb, c, c_st, init = fn.args
    entry, zero, load, loop, done = (fn.append_basic_block(s) for s in ("entry", "zero", "load", "loop", "done"))
    fmuladd = declare(module, f"llvm.fmuladd.v{LANES}f32", _VF32, [_VF32, _VF32, _VF32])

    b = ir.IRBuilder(entry)
    cvec = [[b.bitcast(b.gep(c, [b.add(b.mul(c_st, const_i64(t)), const_i64(LANES * v))]), _VF32.as_pointer())
             for v in range(V)] for t in range(TR)]
    xrows = [b.gep(xq, [b.mul(xq_st, const_i64(t))]) for t in range(TR)]
    srows = [b.gep(xs, [b.mul(xs_st, const_i64(t))]) for t in range(TR)]
    b.cbranch(init, zero, load)

    zeros = ir.Constant(_VF32, [0.0] * LANES)
    b = ir.IRBuilder(zero)              # the panel's first chunk: the sums start at zero
    if not FACC_IN_REGS:
        for t in range(TR):
            for v in range(V):
                b.store(zeros, cvec[t][v], align=4)
    b.branch(loop)
    b = ir.IRBuilder(load)              # a later chunk: the sums so far are in c
    acc0 = [[b.load(cvec[t][v], align=4) for v in range(V)] for t in range(TR)] if FACC_IN_REGS else None
    b.branch(loop)

    b = ir.IRBuilder(loop)
    blk = b.phi(I64)
    if FACC_IN_REGS:
        acc = [[b.phi(_VF32) for v in range(V)] for t in range(TR)]
    wblk = b.gep(wp, [b.mul(blk, const_i64(16 * 2 * NR))])
    k0 = b.mul(blk, const_i64(QBLOCK))
    xpairs = [b.bitcast(b.gep(xrows[t], [k0]), I32.as_pointer()) for t in range(TR)]
    if LANES == 16:                     # V weight vectors of 16 rows' int16 pairs, the next pair 4 NR bytes on
        w8 = b.bitcast(wblk, ir.IntType(8).as_pointer())
        sums = vnni_block_sums(b, [b.gep(w8, [const_i64(4 * LANES * v)]) for v in range(V)], xpairs, "vmovdqu64", 4 * NR)
        dots = [[sums[t][v][0] for v in range(V)] for t in range(TR)]
    else:                               # V vectors of 8 rows' int16 pairs, the next pair 4 NR bytes on
        w8 = b.bitcast(wblk, ir.IntType(8).as_pointer())
        dots = ymm_block_sums(b, [b.gep(w8, [const_i64(4 * LANES * v)]) for v in range(V)], xpairs, "vmovdqu",
                               4 * NR, GEMM_ISA)
    ws = [b.load(b.bitcast(b.gep(sp, [b.add(b.mul(blk, const_i64(NR)), const_i64(LANES * v))]), _VF32.as_pointer()), align=4)
          for v in range(V)]
    new = [[None] * V for _ in range(TR)]
    for t in range(TR):
        xs_t = _splat(b, b.load(b.gep(srows[t], [blk]), align=4), _VF32)
        for v in range(V):
            prev = acc[t][v] if FACC_IN_REGS else b.load(cvec[t][v], align=4)
            new[t][v] = b.call(fmuladd, [b.sitofp(dots[t][v], _VF32), b.fmul(ws[v], xs_t), prev])
            if not FACC_IN_REGS:
                b.store(new[t][v], cvec[t][v], align=4)
    nxt = b.add(blk, const_i64(1))
    blk.add_incoming(const_i64(0), zero)
    blk.add_incoming(const_i64(0), load)
    blk.add_incoming(nxt, loop)
    if FACC_IN_REGS:
        for t in range(TR):
            for v in range(V):
                acc[t][v].add_incoming(zeros, zero)
                acc[t][v].add_incoming(acc0[t][v], load)
                acc[t][v].add_incoming(new[t][v], loop)
    b.cbranch(b.icmp_signed("<", nxt, nb), loop, done)

    b = ir.IRBuilder(done)
    if FACC_IN_REGS:
        for t in range(TR):
            for v in range(V):
                b.store(new[t][v], cvec[t][v], align=4)
    b.ret_void()
    return fn


@intrinsic
def w8a16_tile(typingctx, wp, sp, xq, xs, t0, k0, c, ct, cn, nblocks, init):
    """Micro-kernel call: c[ct:ct + TR, cn:cn + NR] += (or with ``init``, =) packed chunk (wp, sp)
    times rows t0.. of (xq, xs) from value k0 / block k0 // 32 on, over ``nblocks`` blocks (>= 1).
    c float32 2-D, rows contiguous, any row stride. No bounds checks."""
    ok = (isinstance(wp, types.Array) and wp.dtype == types.int16 and wp.ndim == 1
          and isinstance(sp, types.Array) and sp.dtype == types.float32 and sp.ndim == 1
          and isinstance(xq, types.Array) and xq.dtype == types.int16 and xq.ndim == 2
          and isinstance(xs, types.Array) and xs.dtype == types.float32 and xs.ndim == 2
          and isinstance(c, types.Array) and c.dtype == types.float32 and c.ndim == 2
          and all(isinstance(i, types.Integer) for i in (t0, k0, ct, cn, nblocks))
          and isinstance(init, types.Boolean))
    if not ok:
        return None
    sig = types.void(wp, sp, xq, xs, t0, k0, c, ct, cn, nblocks, init)

    def codegen(context, builder, sig, args):
        awp, asp, axq, axs = (context.make_array(ty)(context, builder, v) for ty, v in zip(sig.args[:4], args[:4]))
        ac = context.make_array(sig.args[6])(context, builder, args[6])
        t0_, k0_, ct_, cn_, nb_ = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (4, 5, 7, 8, 9))
        xq_st = builder.ashr(builder.extract_value(axq.strides, 0), const_i64(1))   # bytes -> int16
        xs_st = builder.ashr(builder.extract_value(axs.strides, 0), const_i64(2))   # bytes -> float32
        c_st = builder.ashr(builder.extract_value(ac.strides, 0), const_i64(2))
        xq_p = builder.gep(axq.data, [builder.add(builder.mul(t0_, xq_st), k0_)])
        xs_p = builder.gep(axs.data, [builder.add(builder.mul(t0_, xs_st), builder.ashr(k0_, const_i64(5)))])
        c_p = builder.gep(ac.data, [builder.add(builder.mul(ct_, c_st), cn_)])
        fn = _define_tile(builder.module)
        builder.call(fn, [awp.data, asp.data, xq_p, xq_st, xs_p, xs_st, nb_, c_p, c_st, args[10]])
        return context.get_dummy_value()

    return sig, codegen


def transpose16(b, rows):
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
def pack_rows16(typingctx, w_q, n0, blk, wp, off):
    """Pack one block of 16 weight rows: rows n0 .. n0 + 15 of w_q (int8 (N, Kp)), values
    32 blk .. 32 blk + 31, sign-extended to int16 pairs and transposed so that pair p of row
    n0 + lane lands at int16 offset ``off + p * 2 * NR + 2 * lane`` of wp. No bounds checks."""
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
                           [builder.add(builder.mul(n0_, stride), builder.shl(blk_, const_i64(5)))])
        v32i8, v32i16 = ir.VectorType(ir.IntType(8), 32), ir.VectorType(I16, 32)
        rows = []
        for r in range(16):
            p = builder.bitcast(builder.gep(base, [builder.mul(stride, const_i64(r))]), v32i8.as_pointer())
            rows.append(builder.bitcast(builder.sext(builder.load(p, align=1), v32i16), _V16I32))
        dst = builder.gep(awp.data, [off_])
        for p, vec in enumerate(transpose16(builder, rows)):
            q = builder.bitcast(builder.gep(dst, [const_i64(p * 2 * NR)]), _V16I32.as_pointer())
            builder.store(vec, q, align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True)
def _pack_chunk(w_q, w_s, n0, b0, nblocks, wp, sp):
    """Pack rows n0 .. n0 + NR - 1, blocks b0 .. b0 + nblocks - 1 of (w_q, w_s) into (wp, sp)
    (layout: module docstring), 16 rows at a time; rows past N are packed as zeros."""
    N = w_q.shape[0]
    for g in range(NR // 16):
        g0 = n0 + 16 * g
        for lane in range(16):
            n = g0 + lane
            for bb in range(nblocks):
                sp[bb * NR + 16 * g + lane] = half_to_float(w_s[n, b0 + bb]) if n < N else np.float32(0.0)
        if g0 + 16 <= N:
            for bb in range(nblocks):
                pack_rows16(w_q, g0, b0 + bb, wp, bb * 16 * 2 * NR + g * 32)
            continue
        for lane in range(16):                     # the last, partial group of rows
            n = g0 + lane
            for bb in range(nblocks):
                base = bb * 16 * 2 * NR + g * 32 + 2 * lane
                for p in range(16):
                    if n < N:
                        wp[base + p * 2 * NR] = w_q[n, (b0 + bb) * QBLOCK + 2 * p]
                        wp[base + p * 2 * NR + 1] = w_q[n, (b0 + bb) * QBLOCK + 2 * p + 1]
                    else:
                        wp[base + p * 2 * NR] = 0
                        wp[base + p * 2 * NR + 1] = 0


@njit(cache=True, parallel=True)
def quantize_rows_q16(x, x_q, x_s):
    """x float32 (T, K) -> rows of x_q int16 (Tp, Kp) / x_s float32 (Tp, Kp // 32); rows >= T zero.
    Each row through the quantizer's address (q8.QUANTIZE_ACT_Q16), bound before the region."""
    T = x.shape[0]
    if T > 0:
        quantize_act_q16_ready(x[0], x_q[0], x_s[0])
    for t in prange(x_q.shape[0]):
        if t < T:
            quantize_act_q16_at(x[t], x_q[t], x_s[t])
        else:
            x_q[t, :] = 0
            x_s[t, :] = 0.0


@njit(cache=True, parallel=True)
def _gemm_panels(x_q, x_s, w_q, w_s, T, out, nthreads):
    """out[:T] = the W8A16 product, panels of NR rows split over the threads.

    With SUM_INTO_OUT a full panel's tiles sum straight into ``out`` (the first K chunk stores,
    the later ones add), all but the last T % TR rows; those, and every row of a partial last
    panel (N % NR columns) or of any panel without SUM_INTO_OUT, go through a buffer copied out
    when the panel is done.
    """
    N, Kp = w_q.shape
    nb = Kp // QBLOCK
    Tp = x_q.shape[0]
    npanel = (N + NR - 1) // NR
    nth = max(1, min(nthreads, npanel))
    t_direct = T // TR * TR
    for c in prange(nth):
        wp = np.empty(KC_BLOCKS * 16 * 2 * NR, np.int16)
        sp = np.empty(KC_BLOCKS * NR, np.float32)
        edge = np.empty((Tp if N % NR or not SUM_INTO_OUT else TR, NR), np.float32)
        for p in range(c * npanel // nth, (c + 1) * npanel // nth):
            n0 = p * NR
            ncols = min(NR, N - n0)
            # rows e0 .. T - 1 go through the buffer: all of them unless the panel sums into out
            e0 = t_direct if SUM_INTO_OUT and ncols == NR else 0
            for b0 in range(0, nb, KC_BLOCKS):
                nblk = min(KC_BLOCKS, nb - b0)
                first = b0 == 0
                _pack_chunk(w_q, w_s, n0, b0, nblk, wp, sp)
                for t0 in range(0, Tp, TR):     # one call site: the tile is inlined at each
                    direct = t0 < e0
                    w8a16_tile(wp, sp, x_q, x_s, t0, b0 * QBLOCK, out if direct else edge,
                               t0 if direct else t0 - e0, n0 if direct else 0, nblk, first)
            for t in range(e0, T):
                out[t, n0:n0 + ncols] = edge[t - e0, :ncols]


def _check(x, w_q, w_s, out):
    T, K = x.shape
    N, Kp = w_q.shape
    if padded_k(K) != Kp or w_s.shape != (N, Kp // QBLOCK) or out.shape != (T, N):
        raise ValueError(f"matmul_w8a16: bad shapes x {x.shape}, w_q {w_q.shape}, w_s {w_s.shape}, out {out.shape}")
    if x.dtype != np.float32 or w_q.dtype != np.int8 or w_s.dtype != np.uint16 or out.dtype != np.float32:
        raise ValueError("matmul_w8a16: dtypes must be x float32, w_q int8, w_s uint16, out float32")


def matmul_w8a16(x, w_q, w_s, out):
    """out (T, N) = x (T, K) @ W.T with int16-quantized x (see the module docstring).

    x float32 (T, K), w_q int8 (N, Kp), w_s uint16 (N, Kp // 32) binary16 bits, out float32
    (T, N); x and out any row stride (rows contiguous). Needs ``GEMM_ISA``.
    """
    if GEMM_ISA is None:
        raise RuntimeError("matmul_w8a16 needs an x86 CPU with AVX2, FMA and F16C (or AVX-512 VNNI)")
    _check(x, w_q, w_s, out)
    T = x.shape[0]
    Kp = w_q.shape[1]
    Tp = (T + TR - 1) // TR * TR
    x_q, x_s = activation_scratch(Tp, Kp)
    quantize_rows_q16(x, x_q, x_s)
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
