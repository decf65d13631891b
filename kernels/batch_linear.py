"""LINEAR for a decode batch: B rows (one per running sequence), one pass over the weights.

    out (B, N) = x (B, K) @ W.T

Each weight row is read from memory once and dotted with every batch row while it sits in L1
(a q8 row is Kp bytes: 896 to 4864 for Qwen2.5-0.5B), so B sequences cost one weight stream,
not B, which is what makes batched decode pay: decode is bound by reading the weights.

Batch invariance is the point of these kernels, not an accident: every (row, output) value is
computed with exactly the float arithmetic of the routine one-token decode uses
(``q8._q8_row_dot_*``, whose float32 result is fixed by its written order of blocks;
``quantize_act_q16`` per row), so a row's result is bit-identical to the single-sequence decode
and independent of what else is in the batch. The prefill GEMM (``q8_gemm.matmul_w8a16``) sums in
another order and is not used here.

The q8 kernel (``_rows_q8``) is a multi-row routine (``_define_rows_dot``): per weight row and
tile of up to 8 (AVX-512 VNNI) or 4 (AVX2, generic) batch rows, each block of 32 weights is loaded
and sign-extended once, its integer dot with every row's block formed (the same 8 int32 lane sums
as the one-row routine: exact, whichever instructions form them; ``vpmaddwd`` + ``vpdpwssd`` on
VNNI), and only the float steps are per row, in the one-row routine's order. The row-wise kernel
(the one-row routine once per (row, output): ``_rows_q8_rowwise``) is kept as the baseline.
Measured on the shared 2-core Zen 4 (benchmarks/batch_linear.py, a 65 MB matrix from DRAM, 2
threads, interleaved): 1.3-1.5x the row-wise kernel's speed at B = 8 and 16, 1.1-1.3x at B = 4,
equal at B = 1-2 (benchmarks/results/2026-12-04-batch-linear.md). The per-(row, block) float steps
(convert + FMA) that batch invariance fixes keep it far from the prefill GEMM's ~4x.

The f32 variant keeps one compiled inner loop for every (row, output) pair, so its result does
not depend on B either (it is not promised to equal ``q8.matvec_f32`` bit for bit: a fastmath
reduction's order is LLVM's choice per function).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from . import numba_setup  # code-generation settings first
from .q8 import (_F32, _I8, _I16, _I32, _I64, _P8, _V8F32, _V8I32, _V16I16, HAVE_AVX2, LONG_ROW_K,
                 _c64, _decl, _emit_counted_loop, _halves_to_floats, _hsum_v8f32, _ir_half_to_float_fresh,
                 _prefetch_ahead,
                 _q8_row_dot_avx2, _q8_row_dot_avx2_l2, _q8_row_dot_generic, _q8_row_dot_generic_l2,
                 matvec_q8_ref, quantize_act_q16, quantize_act_q16_ref)


# ================================================================================================
# multi-row routine: one weight row against R batch rows, each weight block loaded and
# sign-extended once, each (row, output) summed in exactly the one-row decode's float order
# ================================================================================================

HAVE_VNNI = (HAVE_AVX2 and numba_setup.HOST_IS_X86
             and {"avx512f", "avx512bw", "avx512vl", "avx512vnni"} <= numba_setup.HOST_FEATURES)
"""True when the multi-row routine uses ``vpdpwssd`` (AVX-512 VNNI on ymm; 32 vector registers)."""

ROWS_PER_TILE = {"vnni": 8, "avx2": 4, "generic": 4}
"""Batch rows one weight row is dotted with at a time: 2 float accumulators per row must stay in
registers (AVX-512: 32 ymm, AVX2: 16). A tile of 2 weight rows x 4 batch rows (each activation
block loaded once for both) was tried on the Zen 4: faster L2-resident on 1 thread (B = 4: 0.64 vs
0.88 ns per (row, block)) but slower streaming the 65 MB matrix on 2 threads (B = 2: 0.59x the
row-wise kernel's speed, B = 8: 1.25x vs 1.45x for 1 x 8), so it was not kept."""

_V16I32 = ir.VectorType(_I32, 16)

FACTOR_CHUNK = 64
"""Blocks whose factors f16(w_s) * x_s the multi-row routine forms ahead into its stack buffer
(R x 64 floats: 2 KiB for 8 rows)."""


def _splat8(b, v):
    """IR: float -> <8 x float> (every lane v)."""
    sv = b.insert_element(ir.Constant(_V8F32, ir.Undefined), v, ir.Constant(_I32, 0))
    return b.shuffle_vector(sv, sv, ir.Constant(_V8I32, [0] * 8))


def _load_weight_block(b, wp, isa):
    """IR: the 32 int8 weights at wp, sign-extended once for all batch rows: two <16 x i16>
    (x86: ``vpmovsxbw``) or two <16 x i32> (generic)."""
    v16i8 = ir.VectorType(_I8, 16)
    halves = (b.load(b.bitcast(wp, v16i8.as_pointer()), align=1),
              b.load(b.bitcast(b.gep(wp, [_c64(16)]), v16i8.as_pointer()), align=1))
    wide = _V16I32 if isa == "generic" else _V16I16
    return tuple(b.sext(h, wide) for h in halves)


def _block_sums(b, module, w, xp, isa):
    """IR: <8 x i32> sums of the sign-extended block w with the 32 int16 activations at xp,
    lane for lane those of ``q8._block_dot_i32x8`` on the same ISA family (exact integers, so
    any instruction that forms the same lanes gives the same float result):
    x86 lane l = products 2l, 2l+1, 16+2l, 17+2l (``vpmaddwd`` x2 + add, or ``vpmaddwd`` + ``vpdpwssd``);
    generic lane l = products l, 8+l, 16+l, 24+l."""
    x0 = b.load(b.bitcast(xp, _V16I16.as_pointer()), align=1)
    x1 = b.load(b.bitcast(b.gep(xp, [_c64(32)]), _V16I16.as_pointer()), align=1)
    if isa == "vnni":
        dpwssd = _decl(module, "llvm.x86.avx512.vpdpwssd.256", _V8I32, [_V8I32, _V8I32, _V8I32])
        maddwd = _decl(module, "llvm.x86.avx2.pmadd.wd", _V8I32, [_V16I16, _V16I16])
        as8 = lambda v: b.bitcast(v, _V8I32)  # noqa: E731  (the intrinsic types its int16 pairs as i32)
        return b.call(dpwssd, [b.call(maddwd, [w[0], x0]), as8(w[1]), as8(x1)])
    if isa == "avx2":
        maddwd = _decl(module, "llvm.x86.avx2.pmadd.wd", _V8I32, [_V16I16, _V16I16])
        return b.add(b.call(maddwd, [w[0], x0]), b.call(maddwd, [w[1], x1]))
    p = b.add(b.mul(w[0], b.sext(x0, _V16I32)), b.mul(w[1], b.sext(x1, _V16I32)))
    half = lambda h: b.shuffle_vector(p, p, ir.Constant(_V8I32, list(range(8 * h, 8 * h + 8))))  # noqa: E731
    return b.add(half(0), half(1))


def _define_rows_dot(module, isa: str, R: int, locality: int):
    """void @cpullm_q8_rows_dot_*(i8* w_row, i8* ws_row, i8* x, i64 x_stride, i8* xs, i64 xs_stride,
    i64 nblocks, i8* out, i64 out_stride): out[t] = the q8 row dot of (w_row, ws_row) with batch
    row t of (x, xs), for t < R (strides in bytes).

    Per row t the float arithmetic is that of ``q8._define_row_dot`` (same ISA family): block b's
    8 lane sums, converted to float, FMA'd with the factor f16(ws[b]) * xs[t, b] into accumulator
    b % 2 in block order; then acc0 + acc1, an odd last block FMA'd into that, and the same
    horizontal sum. What is shared: each weight block is loaded and sign-extended once for the R
    rows, and the R rows' 2R accumulator chains interleave. The factors of a chunk of FACTOR_CHUNK
    blocks are formed first, 8 (or 4) blocks per ``vcvtph2ps`` + ``vmulps`` per row, into a stack
    buffer, from which each block's FMA takes its factor as a broadcast memory operand (AVX-512: an
    embedded broadcast; no shuffle per (row, block)). One loop step is a pair of blocks (even, odd)
    for every row: one block per step with the accumulators swapping roles cost 16 register moves
    per step at R = 8 and measured 0.79 vs 0.64 ns per (row, block). One prefetch
    ``q8.PREFETCH_BYTES`` ahead per pair (``locality`` 3: L1, 2: L2).
    """
    name = f"cpullm_q8_rows_dot_v2_{isa}_r{R}_l{locality}"
    fn = module.globals.get(name)
    if fn is not None:
        return fn
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [_P8, _P8, _P8, _I64, _P8, _I64, _I64, _P8, _I64]), name)
    fn.linkage = "internal"
    fn.attributes.add("nounwind")
    w, ws, x, xst, xs, xsst, nb, out, ost = fn.args
    CH = FACTOR_CHUNK
    zero = ir.Constant(_V8F32, [0.0] * 8)
    fmuladd = _decl(module, "llvm.fmuladd.v8f32", _V8F32, [_V8F32, _V8F32, _V8F32])
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    fbuf = b.alloca(ir.ArrayType(_F32, R * CH), name="factors")
    fbase = b.bitcast(fbuf, _F32.as_pointer())
    wsp = b.bitcast(ws, _I16.as_pointer())
    xrow = [b.gep(x, [b.mul(xst, _c64(t))]) for t in range(R)]
    xsrow = [b.bitcast(b.gep(xs, [b.mul(xsst, _c64(t))]), _F32.as_pointer()) for t in range(R)]
    frow = [b.gep(fbase, [_c64(t * CH)]) for t in range(R)]

    def factors(b, c0, i, width):
        """factors of blocks i .. i + width - 1 (chunk starting at c0) into the buffer, every row."""
        if width == 1:       # a lone scale: through vmovd, never a vpinsrw merging into an accumulator
            hf = _ir_half_to_float_fresh(b, b.load(b.gep(wsp, [i])))
            for t in range(R):
                b.store(b.fmul(hf, b.load(b.gep(xsrow[t], [i]))), b.gep(frow[t], [b.sub(i, c0)]))
            return
        h = b.load(b.bitcast(b.gep(wsp, [i]), ir.VectorType(_I16, width).as_pointer()), align=2)
        hf = _halves_to_floats(b, h)
        vf = ir.VectorType(_F32, width).as_pointer()
        for t in range(R):
            xv = b.load(b.bitcast(b.gep(xsrow[t], [i]), vf), align=4)
            b.store(b.fmul(hf, xv), b.bitcast(b.gep(frow[t], [b.sub(i, c0)]), vf), align=4)

    def block(b, i, c0, accs):
        """Block i for every row, factors from the buffer (chunk at c0): accs (R values) -> new."""
        off = b.shl(i, _c64(5))
        wp = b.gep(w, [off])
        wv = _load_weight_block(b, wp, isa)
        xoff = b.shl(off, _c64(1))
        new = []
        for t in range(R):
            sums = _block_sums(b, module, wv, b.gep(xrow[t], [xoff]), isa)
            factor = _splat8(b, b.load(b.gep(frow[t], [b.sub(i, c0)])))
            new.append(b.call(fmuladd, [b.sitofp(sums, _V8F32), factor, accs[t]]))
        return new

    def chunk(b, c0, accs):
        """Blocks [c0, min(c0 + CH, pair_end)): accs = [acc0 (R), acc1 (R)] -> new (c0 even, CH even)."""
        c1 = b.select(b.icmp_signed("<", b.add(c0, _c64(CH)), pair_end), b.add(c0, _c64(CH)), pair_end)
        end8 = b.add(c0, b.and_(b.sub(c1, c0), _c64(-8)))
        end4 = b.add(end8, b.and_(b.sub(c1, end8), _c64(-4)))
        b, _ = _emit_counted_loop(fn, b, c0, end8, 8, [], lambda b, i, a: (factors(b, c0, i, 8), [])[1], "f8")
        b, _ = _emit_counted_loop(fn, b, end8, end4, 4, [], lambda b, i, a: (factors(b, c0, i, 4), [])[1], "f4")
        b, _ = _emit_counted_loop(fn, b, end4, c1, 1, [], lambda b, i, a: (factors(b, c0, i, 1), [])[1], "f1")

        def step(b, i, a):      # blocks i (even: a[:R]) and i + 1 (odd: a[R:])
            _prefetch_ahead(b, module, b.gep(w, [b.shl(i, _c64(5))]), locality)
            even = block(b, i, c0, a[:R])
            return even + block(b, b.add(i, _c64(1)), c0, a[R:])

        b, accs = _emit_counted_loop(fn, b, c0, c1, 2, accs, step, "blocks")
        return b, accs

    pair_end = b.and_(nb, _c64(-2))

    b, accs = _emit_counted_loop_nested(fn, b, _c64(0), pair_end, CH, [zero] * (2 * R), chunk)
    tots = [b.fadd(accs[t], accs[R + t]) for t in range(R)]
    pre = b.block
    odd_bb, done = fn.append_basic_block("odd"), fn.append_basic_block("odd_done")
    b.cbranch(b.icmp_signed("<", pair_end, nb), odd_bb, done)
    b = ir.IRBuilder(odd_bb)
    h = _splat8(b, _ir_half_to_float_fresh(b, b.load(b.gep(wsp, [pair_end]))))
    wv = _load_weight_block(b, b.gep(w, [b.shl(pair_end, _c64(5))]), isa)
    xoff = b.shl(pair_end, _c64(6))
    odd_tots = []
    for t in range(R):
        sums = _block_sums(b, module, wv, b.gep(xrow[t], [xoff]), isa)
        factor = b.fmul(h, _splat8(b, b.load(b.gep(xsrow[t], [pair_end]))))
        odd_tots.append(b.call(fmuladd, [b.sitofp(sums, _V8F32), factor, tots[t]]))
    last = b.block
    b.branch(done)
    b = ir.IRBuilder(done)
    finals = []
    for t in range(R):
        r = b.phi(_V8F32)
        r.add_incoming(tots[t], pre)
        r.add_incoming(odd_tots[t], last)
        finals.append(r)
    for t in range(R):
        op = b.bitcast(b.gep(out, [b.mul(ost, _c64(t))]), _F32.as_pointer())
        b.store(_hsum_v8f32(b, finals[t]), op)
    b.ret_void()
    return fn


def _emit_counted_loop_nested(fn, b, start, end, step, accs, body):
    """IR: ``for i in range(start, end, step): accs = body(b, i, accs)`` where ``body`` may emit
    blocks of its own: it returns (builder at the end of its last open block, new values)."""
    pre = b.block
    head, done = fn.append_basic_block("chunks"), fn.append_basic_block("chunks_done")
    b.cbranch(b.icmp_signed("<", start, end), head, done)
    b = ir.IRBuilder(head)
    i = b.phi(_I64)
    phis = [b.phi(a.type) for a in accs]
    b, new = body(b, i, phis)
    i_next = b.add(i, _c64(step))
    last = b.block
    for phi, v_in, v_loop in zip([i, *phis], [start, *accs], [i_next, *new]):
        phi.add_incoming(v_in, pre)
        phi.add_incoming(v_loop, last)
    b.cbranch(b.icmp_signed("<", i_next, end), head, done)
    b = ir.IRBuilder(done)
    out = []
    for a, n in zip(accs, new):
        phi = b.phi(a.type)
        phi.add_incoming(a, pre)
        phi.add_incoming(n, last)
        out.append(phi)
    return b, out


def _rows_dot_typer(w_q, w_s, x_q, x_s, out, n, t0, nrows, isa, locality):
    ok = (isinstance(w_q, types.Array) and w_q.dtype == types.int8 and w_q.ndim == 2
          and isinstance(w_s, types.Array) and w_s.dtype == types.uint16 and w_s.ndim == 2
          and isinstance(x_q, types.Array) and x_q.dtype == types.int16 and x_q.ndim == 2
          and isinstance(x_s, types.Array) and x_s.dtype == types.float32 and x_s.ndim == 2
          and isinstance(out, types.Array) and out.dtype == types.float32 and out.ndim == 2
          and all(isinstance(v, types.Integer) for v in (n, t0, nrows)))
    if not ok:
        return None
    sig = types.void(w_q, w_s, x_q, x_s, out, n, t0, nrows)
    rmax = ROWS_PER_TILE[isa]

    def codegen(context, builder, sig, args):
        aw, asc, ax, axs, ao = (context.make_array(t)(context, builder, v) for t, v in zip(sig.args[:5], args[:5]))
        row, t0_, nr = (context.cast(builder, v, t, types.int64) for v, t in zip(args[5:], sig.args[5:]))
        st = lambda a, k: builder.extract_value(a.strides, k)  # noqa: E731
        ptr = lambda a, off: builder.gep(builder.bitcast(a.data, _P8), [off])  # noqa: E731
        nb = builder.ashr(builder.extract_value(aw.shape, 1), _c64(5))
        wrow = ptr(aw, builder.mul(row, st(aw, 0)))
        srow = ptr(asc, builder.mul(row, st(asc, 0)))
        xrow = ptr(ax, builder.mul(t0_, st(ax, 0)))
        xsrow = ptr(axs, builder.mul(t0_, st(axs, 0)))
        orow = ptr(ao, builder.add(builder.mul(t0_, st(ao, 0)), builder.mul(row, st(ao, 1))))
        fn_args = [wrow, srow, xrow, st(ax, 0), xsrow, st(axs, 0), nb, orow, st(ao, 0)]
        fnb = builder.function
        done = fnb.append_basic_block("rows_dot_done")
        switch = builder.switch(nr, done)
        for R in range(1, rmax + 1):
            bb = fnb.append_basic_block(f"rows_dot_{R}")
            switch.add_case(ir.Constant(_I64, R), bb)
            with builder.goto_block(bb):
                builder.call(_define_rows_dot(builder.module, isa, R, locality), fn_args)
                builder.branch(done)
        builder.position_at_end(done)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _q8_rows_dot_vnni(typingctx, w_q, w_s, x_q, x_s, out, n, t0, nrows):
    """out[t0:t0+nrows, n] = decode row dots of weight row n with batch rows t0..t0+nrows-1
    (1 <= nrows <= ROWS_PER_TILE["vnni"]), AVX-512 VNNI; each equals ``q8._q8_row_dot_avx2``'s. No bounds checks."""
    return _rows_dot_typer(w_q, w_s, x_q, x_s, out, n, t0, nrows, "vnni", 3)


@intrinsic
def _q8_rows_dot_vnni_l2(typingctx, w_q, w_s, x_q, x_s, out, n, t0, nrows):
    """As _q8_rows_dot_vnni, prefetching the weight stream into L2."""
    return _rows_dot_typer(w_q, w_s, x_q, x_s, out, n, t0, nrows, "vnni", 2)


@intrinsic
def _q8_rows_dot_avx2(typingctx, w_q, w_s, x_q, x_s, out, n, t0, nrows):
    """As _q8_rows_dot_vnni with ``vpmaddwd`` (AVX2; nrows <= ROWS_PER_TILE["avx2"])."""
    return _rows_dot_typer(w_q, w_s, x_q, x_s, out, n, t0, nrows, "avx2", 3)


@intrinsic
def _q8_rows_dot_avx2_l2(typingctx, w_q, w_s, x_q, x_s, out, n, t0, nrows):
    """As _q8_rows_dot_avx2, prefetching the weight stream into L2."""
    return _rows_dot_typer(w_q, w_s, x_q, x_s, out, n, t0, nrows, "avx2", 2)


@intrinsic
def _q8_rows_dot_generic(typingctx, w_q, w_s, x_q, x_s, out, n, t0, nrows):
    """As _q8_rows_dot_vnni in portable IR; each equals ``q8._q8_row_dot_generic``'s."""
    return _rows_dot_typer(w_q, w_s, x_q, x_s, out, n, t0, nrows, "generic", 3)


@intrinsic
def _q8_rows_dot_generic_l2(typingctx, w_q, w_s, x_q, x_s, out, n, t0, nrows):
    """As _q8_rows_dot_generic, prefetching the weight stream into L2."""
    return _rows_dot_typer(w_q, w_s, x_q, x_s, out, n, t0, nrows, "generic", 2)


# The multi-row kernels: weight rows split over the threads (static ``prange``: each thread
# streams one contiguous range of W, as matvec_q8 does), each weight row dotted with the B batch
# rows in ceil(B / tile) near-equal tiles (B = 12 on AVX2: 3 tiles of 4).
ROWS_PER_TILE_GENERIC = ROWS_PER_TILE["generic"]


@njit(cache=True, inline="always")
def _tile_starts(B, ntiles):
    """First batch row of each of ntiles near-equal tiles of B rows, and B (ntiles + 1 values;
    formed once per call: an integer division per (weight row, tile) cost ~10 % at B = 2)."""
    starts = np.empty(ntiles + 1, np.int64)
    for i in range(ntiles + 1):
        starts[i] = B * i // ntiles
    return starts


ROWS_PER_TILE_AVX2 = ROWS_PER_TILE["avx2"]
ROWS_PER_TILE_VNNI = ROWS_PER_TILE["vnni"]

@njit(cache=True, parallel=True)
def _rows_q8_generic(w_q, w_s, x_q, x_s, out):
    """out (B, N): the decode row dots through _q8_rows_dot_generic (tiles: above)."""
    B = x_q.shape[0]
    ntiles = (B + ROWS_PER_TILE_GENERIC - 1) // ROWS_PER_TILE_GENERIC
    starts = _tile_starts(B, ntiles)
    if B == 1:           # nothing to share: the one-row routine (faster alone, the same numbers)
        if w_q.shape[1] >= LONG_ROW_K:
            for n in prange(w_q.shape[0]):
                out[0, n] = _q8_row_dot_generic_l2(w_q, w_s, x_q[0], x_s[0], n)
        else:
            for n in prange(w_q.shape[0]):
                out[0, n] = _q8_row_dot_generic(w_q, w_s, x_q[0], x_s[0], n)
    elif w_q.shape[1] >= LONG_ROW_K:
        for n in prange(w_q.shape[0]):
            for i in range(ntiles):
                _q8_rows_dot_generic_l2(w_q, w_s, x_q, x_s, out, n, starts[i], starts[i + 1] - starts[i])
    else:
        for n in prange(w_q.shape[0]):
            for i in range(ntiles):
                _q8_rows_dot_generic(w_q, w_s, x_q, x_s, out, n, starts[i], starts[i + 1] - starts[i])


@njit(cache=True, parallel=True)
def _rows_q8_avx2(w_q, w_s, x_q, x_s, out):
    """out (B, N): the decode row dots through _q8_rows_dot_avx2 (tiles: above)."""
    B = x_q.shape[0]
    ntiles = (B + ROWS_PER_TILE_AVX2 - 1) // ROWS_PER_TILE_AVX2
    starts = _tile_starts(B, ntiles)
    if B == 1:           # nothing to share: the one-row routine (faster alone, the same numbers)
        if w_q.shape[1] >= LONG_ROW_K:
            for n in prange(w_q.shape[0]):
                out[0, n] = _q8_row_dot_avx2_l2(w_q, w_s, x_q[0], x_s[0], n)
        else:
            for n in prange(w_q.shape[0]):
                out[0, n] = _q8_row_dot_avx2(w_q, w_s, x_q[0], x_s[0], n)
    elif w_q.shape[1] >= LONG_ROW_K:
        for n in prange(w_q.shape[0]):
            for i in range(ntiles):
                _q8_rows_dot_avx2_l2(w_q, w_s, x_q, x_s, out, n, starts[i], starts[i + 1] - starts[i])
    else:
        for n in prange(w_q.shape[0]):
            for i in range(ntiles):
                _q8_rows_dot_avx2(w_q, w_s, x_q, x_s, out, n, starts[i], starts[i + 1] - starts[i])


@njit(cache=True, parallel=True)
def _rows_q8_vnni(w_q, w_s, x_q, x_s, out):
    """out (B, N): the decode row dots through _q8_rows_dot_vnni (tiles: above)."""
    B = x_q.shape[0]
    ntiles = (B + ROWS_PER_TILE_VNNI - 1) // ROWS_PER_TILE_VNNI
    starts = _tile_starts(B, ntiles)
    if B == 1:           # nothing to share: the one-row routine (faster alone, the same numbers)
        if w_q.shape[1] >= LONG_ROW_K:
            for n in prange(w_q.shape[0]):
                out[0, n] = _q8_row_dot_avx2_l2(w_q, w_s, x_q[0], x_s[0], n)
        else:
            for n in prange(w_q.shape[0]):
                out[0, n] = _q8_row_dot_avx2(w_q, w_s, x_q[0], x_s[0], n)
    elif w_q.shape[1] >= LONG_ROW_K:
        for n in prange(w_q.shape[0]):
            for i in range(ntiles):
                _q8_rows_dot_vnni_l2(w_q, w_s, x_q, x_s, out, n, starts[i], starts[i + 1] - starts[i])
    else:
        for n in prange(w_q.shape[0]):
            for i in range(ntiles):
                _q8_rows_dot_vnni(w_q, w_s, x_q, x_s, out, n, starts[i], starts[i + 1] - starts[i])


@njit(cache=True, parallel=True)
def _rows_q8_rowwise_avx2(w_q, w_s, x_q, x_s, out):
    # the one-row decode routine once per (batch row, output): the previous kernel, kept as the
    # baseline of benchmarks/batch_linear.py and a second witness in the tests
    if w_q.shape[1] >= LONG_ROW_K:
        for n in prange(w_q.shape[0]):
            for t in range(x_q.shape[0]):
                out[t, n] = _q8_row_dot_avx2_l2(w_q, w_s, x_q[t], x_s[t], n)
    else:
        for n in prange(w_q.shape[0]):
            for t in range(x_q.shape[0]):
                out[t, n] = _q8_row_dot_avx2(w_q, w_s, x_q[t], x_s[t], n)


@njit(cache=True, parallel=True)
def _rows_q8_rowwise_generic(w_q, w_s, x_q, x_s, out):
    if w_q.shape[1] >= LONG_ROW_K:
        for n in prange(w_q.shape[0]):
            for t in range(x_q.shape[0]):
                out[t, n] = _q8_row_dot_generic_l2(w_q, w_s, x_q[t], x_s[t], n)
    else:
        for n in prange(w_q.shape[0]):
            for t in range(x_q.shape[0]):
                out[t, n] = _q8_row_dot_generic(w_q, w_s, x_q[t], x_s[t], n)


ROWS_Q8_KERNELS = {"generic": _rows_q8_generic}
"""The multi-row kernel of every ISA this CPU runs (the tests check each against matvec_q8)."""
if HAVE_AVX2:
    ROWS_Q8_KERNELS["avx2"] = _rows_q8_avx2
    _rows_q8_rowwise = _rows_q8_rowwise_avx2
else:
    _rows_q8_rowwise = _rows_q8_rowwise_generic
if HAVE_VNNI:
    ROWS_Q8_KERNELS["vnni"] = _rows_q8_vnni
ROWS_Q8_ISA = "vnni" if HAVE_VNNI else "avx2" if HAVE_AVX2 else "generic"
_rows_q8 = ROWS_Q8_KERNELS[ROWS_Q8_ISA]


@njit(cache=True, nogil=True)
def _quantize_rows(x, x_q, x_s):
    for t in range(x.shape[0]):
        quantize_act_q16(x[t], x_q[t], x_s[t])


def linear_rows_q8(x, w_q, w_s, out, x_q, x_s):
    """out (B, N) = x (B, K) @ W.T with the decode numerics, row by row, one pass over W.

    x float32 (B, K) (any row stride), w_q int8 (N, Kp), w_s uint16 (N, Kp // 32) binary16 bits,
    out float32 (B, N) (any row stride); x_q int16 (>= B, Kp) and x_s float32 (>= B, Kp // 32)
    are scratch (C-contiguous)."""
    B = x.shape[0]
    N, Kp = w_q.shape
    if out.shape != (B, N) or x_q.shape[1] != Kp or x_s.shape[1] * 32 != Kp or x_q.shape[0] < B:
        raise ValueError(f"linear_rows_q8: bad shapes x {x.shape}, w_q {w_q.shape}, out {out.shape}, "
                         f"x_q {x_q.shape}, x_s {x_s.shape}")
    _quantize_rows(x, x_q[:B], x_s[:B])
    _rows_q8(w_q, w_s, x_q[:B], x_s[:B], out)


@njit(cache=True, parallel=True, fastmath=True)
def linear_rows_f32(x, w, out):
    """out (B, N) = x (B, K) @ w (N, K).T, float32; each weight row read once for all B rows."""
    N, K = w.shape
    for n in prange(N):
        row = w[n]
        for t in range(x.shape[0]):
            xr = x[t]
            acc = np.float32(0.0)
            for k in range(K):
                acc += row[k] * xr[k]
            out[t, n] = acc


def linear_rows_q8_ref(x, w_q, w_s):
    """numpy reference (float64): each row quantized as quantize_act_q16_ref, then matvec_q8_ref."""
    Kp = w_q.shape[1]
    rows = []
    for t in range(x.shape[0]):
        x_q, x_s = quantize_act_q16_ref(x[t], Kp)
        rows.append(matvec_q8_ref(w_q, w_s, x_q, x_s))
    return np.stack(rows)


def linear_rows_f32_ref(x, w):
    """numpy reference (float64)."""
    return x.astype(np.float64) @ w.astype(np.float64).T
