"""INT8 LINEAR over weights stored in panels of 16 rows: one kernel for decode, batch and the head.

    out (B, N) = x (B, K) @ W.T,   W = q8 block-32 (``q8``: int8 values, binary16 scale per 32)

Layout ("q8 panels"). The N rows are cut into panels of PANEL = 16 rows (N padded with zero rows
to Np, a multiple of ROW_ALIGN = 64: threads take whole groups of 4 panels); within a panel, block b (values 32b .. 32b + 31), pair p (values
32b + 2p, 32b + 2p + 1):

    wp int8   (Np // 16, nb, 16, 32):  wp[g, b, p, 2 l + e] = w_q[16 g + l, 32 b + 2 p + e]
    sp uint16 (Np // 16, nb, 16):      sp[g, b, l]          = w_s[16 g + l, b]

so 32 consecutive bytes hold one pair of values for each of 16 rows: sign-extended to int16 they
are one ``vpdpwssd`` operand whose 16 int32 lanes are 16 rows, against one broadcast activation
pair. A row's sum over a block is then formed in its own lane, with no horizontal reduction, and
one float step per block serves 16 rows. A panel is nb * 512 bytes, contiguous: each thread
streams whole panels, the access pattern the hardware prefetchers follow best.

Numerics (the same for every B, tile shape, thread count and ISA): activations int16 per block
of 32 (``q8.quantize_act_q16``), and for output (t, n)

    acc = 0;  for b in 0 .. nb - 1:  acc = fma(float(S[t, n, b]), f16(w_s[n, b]) * x_s[t, b], acc)

with S the block's exact int32 sum of products (|S| <= 32 * 127 * 32767 < 2^27, so any order of
forming it gives the same integer) and ``fma`` one rounding. So a row's value does not depend on
what else is in the batch (batch invariance, by construction), and a prefill row equals the
decode of the same activations.

Why this layout: decode is bound by reading the weights, so a batch of B sequences should read
them once and do B times the arithmetic; that only pays if the arithmetic is cheap. Here a block
of 32 values of 16 rows costs 16 ``vpdpwssd`` (32 multiply-adds each) and one convert + FMA per
batch row, so 8 batch rows of an lm_head cost about 1.1x one row (a row-major layout, which
converts and FMAs 8 lanes per (row, block, batch row), could not do that; benchmarks/ab/batch_linear.py). The weights stay int8 in memory and are widened in
registers (an int16 copy would double the bytes a single stream reads).

ISA variants (``ISA``): AVX-512 VNNI runs a panel as one zmm register (tiles of TILES, sums and
float accumulators in registers); AVX2 and AVX-VNNI as two ymm halves of 8 rows (tiles of
YMM_TILES, the int32 sums of a block in registers, the float accumulators in ``out``): without
VNNI a multiply-add of 16 int16 pairs is ``vpmaddwd`` + ``vpaddd``, two instructions, and that
bounds the AVX2 prefill LINEAR (67 GMAC/s on one core of this Sapphire-Rapids-class host, AVX-VNNI 91-95,
AVX-512 VNNI 153: benchmarks/results/2026-12-05-isa.md).

Kernels: ``pack_panels(w_q, w_s) -> (wp, sp)`` at compile time (``unpack_panels``, its inverse;
``dequantized_rows``, rows as numbers for the head screen's build), ``panels_matmul(wp, sp, N,
x_q, x_s, out, nthreads)`` for B >= 1 rows of quantized activations (decode, batches),
``matmul_panels`` quantizing float rows first (prefill, a batch's LINEAR run from Python),
``panel_row_dot`` for one row (the head screen's exact rows); numpy reference
``panels_matmul_ref`` (tests/test_kernels_q8_panels.py).
"""
from __future__ import annotations

import os

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from ..setup import numba_setup  # code-generation settings first
from ..setup.addressed import Addressed
from ..setup.operand_types import WQ, WS, array, i64
from ..rows.llvm_ir import (F32, I8, I16, I32, I64, P8, const_i64, declare, halves_to_floats, YMM_DOTS,
                            prefetch_ahead, vnni_block_sums, ymm_block_sums)
from ..rows.q8 import QBLOCK, HAVE_AVX2, activation_scratch, half_to_float, quantize_act_q16, scale_values

PANEL = 16
"""Rows per panel: the int32 lanes of one 512-bit register."""
PANEL_BLOCK_BYTES = PANEL * QBLOCK
"""Bytes of one block of one panel (512)."""

HAVE_VNNI = (HAVE_AVX2 and numba_setup.HOST_IS_X86
             and {"avx512f", "avx512bw", "avx512vnni"} <= numba_setup.HOST_FEATURES)
HAVE_AVXVNNI = HAVE_AVX2 and numba_setup.HOST_IS_X86 and "avxvnni" in numba_setup.HOST_FEATURES
ISAS = ("vnni",) * HAVE_VNNI + ("avxvnni",) * HAVE_AVXVNNI + ("avx2",) * HAVE_AVX2 + ("generic",)
"""The variants this CPU runs, best first."""
ISA = os.environ.get("CPULLM_Q8_PANELS_ISA") or ISAS[0]
"""The variant this process compiles: ``vpdpwssd`` on zmm (AVX-512 VNNI), the VEX ``vpdpwssd`` on
ymm (AVX-VNNI without AVX-512: Intel's client CPUs), ``vpmaddwd`` + ``vpaddd`` on ymm (AVX2), or
portable IR. The environment variable picks a lesser one for tests (with a numba cache of its
own: the on-disk cache does not tell variants apart)."""
YMM = ISA in YMM_DOTS
"""Whether this variant runs the 256-bit tiles (:func:`_define_tile_ymm`)."""
if ISA not in ISAS:
    raise ImportError(f"CPULLM_Q8_PANELS_ISA={ISA!r}: this CPU runs {', '.join(ISAS)}")

_V16I32 = ir.VectorType(I32, 16)
_V16F32 = ir.VectorType(F32, 16)
_V32I8 = ir.VectorType(I8, 32)
_V32I16 = ir.VectorType(I16, 32)
_V16I16 = ir.VectorType(I16, 16)
_V8I32 = ir.VectorType(I32, 8)

TILES = ((8, 1), (5, 1), (4, 2), (3, 2), (2, 4), (1, 4))
"""Register tiles (batch rows TR, panels V) a group of 4 panels is covered with: B is cut into
tiles of 8 rows, then the rest into one tile of 5, 4, 3, 2 or 1 rows (6 and 7 into two), so the
weights are read from memory once and a verify pass's 2, 3 or 5 rows (1, 2 or 4 guesses) take one
tile (a tile of TR rows takes 4 // V passes over the group, the later ones from L1/L2). Cut as
4 + 1, a verify pass of 5 rows at Qwen2.5-0.5B took 28.3 ms, as one tile 21.0 (one row: 20 ms);
tiles of 6 and 7 rows would add 0.75 s to a cold start's compile for passes the pacer rarely
makes. TR x V float accumulators stay in registers (AVX-512: 32 zmm)."""
GROUP = 4
"""Panels a thread's work is counted in (64 rows)."""


# ================================================================================================
# layout
# ================================================================================================

ROW_ALIGN = 64
"""N is padded with zero rows to a multiple of this (GROUP panels): every group is whole."""


@njit(cache=True)
def padded_rows(N):
    """Np: N rounded up to ROW_ALIGN (callable from @njit code)."""
    return (int(N) + ROW_ALIGN - 1) // ROW_ALIGN * ROW_ALIGN


def pack_panels(w_q, w_s):
    """(w_q int8 (N, Kp), w_s uint16 (N, Kp // 32)) -> (wp int8 (Np * Kp,), sp uint16 (Np * Kp // 32,))."""
    N, Kp = w_q.shape
    nb = Kp // QBLOCK
    Np = padded_rows(N)
    q = np.zeros((Np, Kp), np.int8)
    q[:N] = w_q
    s = np.zeros((Np, nb), np.uint16)
    s[:N] = w_s
    wp = q.reshape(Np // PANEL, PANEL, nb, PANEL, 2).transpose(0, 2, 3, 1, 4)   # (g, b, p, l, e)
    sp = s.reshape(Np // PANEL, PANEL, nb).transpose(0, 2, 1)                   # (g, b, l)
    return np.ascontiguousarray(wp).reshape(-1), np.ascontiguousarray(sp).reshape(-1)


def unpack_panels(wp, sp, N: int, Kp: int):
    """Inverse of :func:`pack_panels`: (w_q (N, Kp), w_s (N, Kp // 32))."""
    nb = Kp // QBLOCK
    Np = padded_rows(N)
    q = np.asarray(wp).reshape(Np // PANEL, nb, PANEL, PANEL, 2).transpose(0, 3, 1, 2, 4).reshape(Np, Kp)
    s = np.asarray(sp).reshape(Np // PANEL, nb, PANEL).transpose(0, 2, 1).reshape(Np, nb)
    return np.ascontiguousarray(q[:N]), np.ascontiguousarray(s[:N])


def panels_matmul_ref(wp, sp, N: int, x_q, x_s):
    """numpy reference: (B, N) float32 in exactly the kernel's order (fma emulated in float64:
    float(S) * factor is exact there; the sum rounds once to float64, then to float32)."""
    x_q = np.atleast_2d(x_q)
    x_s = np.atleast_2d(x_s)
    Kp = x_q.shape[1]
    nb = Kp // QBLOCK
    w_q, w_s = unpack_panels(wp, sp, N, Kp)
    S = np.einsum("nbj,tbj->tnb", w_q.reshape(N, nb, QBLOCK).astype(np.int64),
                  x_q.reshape(-1, nb, QBLOCK).astype(np.int64))            # exact
    Sf = S.astype(np.float32)
    fac = scale_values(w_s)[None, :, :] * x_s.astype(np.float32)[:, None, :]   # float32 product
    acc = np.zeros((x_q.shape[0], N), np.float32)
    for b in range(nb):
        acc = (Sf[:, :, b].astype(np.float64) * fac[:, :, b].astype(np.float64) + acc).astype(np.float32)
    return acc


# ================================================================================================
# the register tile
# ================================================================================================

def _splat(b, scalar, vty):
    v = b.insert_element(ir.Constant(vty, ir.Undefined), scalar, ir.Constant(I32, 0))
    return b.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, vty.count), [0] * vty.count))


def _pair_dot(b, module, acc, w, a, isa):
    """IR: acc (<16 x i32>, one lane a row) + the row's pair of weights (w: <32 x i16>, lanes 2l,
    2l + 1) times the activation pair (a: <16 x i32>, the pair as int16 halves, every lane)."""
    if isa == "vnni":
        dpwssd = declare(module, "llvm.x86.avx512.vpdpwssd.512", _V16I32, [_V16I32, _V16I32, _V16I32])
        return b.call(dpwssd, [acc, a, b.bitcast(w, _V16I32)])
    if isa == "avx2":
        maddwd = declare(module, "llvm.x86.avx2.pmadd.wd", _V8I32, [_V16I16, _V16I16])
        a16 = b.bitcast(b.shuffle_vector(a, a, ir.Constant(_V8I32, list(range(8)))), _V16I16)
        lo = b.shuffle_vector(w, w, ir.Constant(_V16I32, list(range(16))))
        hi = b.shuffle_vector(w, w, ir.Constant(_V16I32, list(range(16, 32))))
        prod = b.shuffle_vector(b.call(maddwd, [lo, a16]), b.call(maddwd, [hi, a16]),
                                ir.Constant(_V16I32, list(range(16))))
        return b.add(acc, prod)
    w32 = b.sext(w, ir.VectorType(I32, 32))
    a32 = b.sext(b.bitcast(a, _V32I16), ir.VectorType(I32, 32))
    p = b.mul(w32, a32)
    ev = b.shuffle_vector(p, p, ir.Constant(_V16I32, list(range(0, 32, 2))))
    od = b.shuffle_vector(p, p, ir.Constant(_V16I32, list(range(1, 32, 2))))
    return b.add(acc, b.add(ev, od))


def _define_tile(module, isa: str, TR: int, V: int, locality: int):
    """void @cpullm_q8_panel_tile(i8* wp, i8* sp, i64 panel_bytes, i8* xq, i64 xq_stride,
    i8* xs, i64 xs_stride, i64 nb, i8* out, i64 out_stride): for t < TR, v < V:
    out[t, 16 v .. 16 v + 15] = the rows of panel v (at wp + v * panel_bytes, scales at
    sp + v * panel_bytes / 16) against activation row t. Strides in bytes.

    Tiles of one panel (V = 1: one weight stream) prefetch it ``llvm_ir.PREFETCH_BYTES`` ahead,
    every 64-byte line of every block (8 a block): an 8-row step over Qwen2.5-0.5B's lm_head took
    6.5 ms against 9.2 with 2 prefetches a block, and without any the 5- and 8-row tiles take
    1.1-1.4x longer. ``locality`` 0: no prefetch, for the tiles of 2 or 4 panels (decode's 1 x 4,
    and 2 x 4, 4 x 2, 3 x 2, 2 x 2), whose streams the hardware prefetcher runs faster alone:
    with the prefetches they took 1.02-1.42x as long, and the 1.24B decoded at 67-86 % of a
    plain read's rate against 97-98 % (benchmarks/results/2026-12-06-panel-prefetch.md)."""
    name = f"cpullm_q8_panel_tile_{isa}_{TR}x{V}_l{locality}"
    fn = module.globals.get(name)
    if fn is not None:
        return fn
    fnty = ir.FunctionType(ir.VoidType(), [P8, P8, I64, P8, I64, P8, I64, I64, P8, I64])
    fn = ir.Function(module, fnty, name)
    fn.linkage = "internal"
    fn.attributes.add("nounwind")
    wp, sp, pbytes, xq, xqst, xs, xsst, nb, out, ost = fn.args
    fma = declare(module, "llvm.fma.v16f32", _V16F32, [_V16F32, _V16F32, _V16F32])
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    sbytes = b.ashr(pbytes, const_i64(4))
    wpan = [b.gep(wp, [b.mul(pbytes, const_i64(v))]) for v in range(V)]
    span = [b.gep(sp, [b.mul(sbytes, const_i64(v))]) for v in range(V)]
    xrow = [b.gep(xq, [b.mul(xqst, const_i64(t))]) for t in range(TR)]
    xsrow = [b.bitcast(b.gep(xs, [b.mul(xsst, const_i64(t))]), F32.as_pointer()) for t in range(TR)]
    # int32 sums of a block: 2 chains a (row, panel) up to 8 of them (16 sums beside 8 float
    # accumulators fit the 32 zmm), so that vpdpwssd's latency is hidden: a 5-row verify pass of
    # Qwen2.5-0.5B took 21.0 ms against 23.2 with one chain (the integer sum is exact: any split
    # gives the same value)
    chains = 2 if TR * V <= 8 else 1
    zero_f = ir.Constant(_V16F32, [0.0] * 16)
    zero_i = ir.Constant(_V16I32, [0] * 16)

    def block(b, i, accs):
        boff = b.shl(i, const_i64(9))                    # 512 bytes a panel-block
        for v in range(V if locality else 0):
            for line in range(0, PANEL_BLOCK_BYTES, 64):   # every line: see _define_tile
                prefetch_ahead(b, module, b.gep(wpan[v], [b.add(boff, const_i64(line))]), locality)
        xoff = b.shl(i, const_i64(6))                    # 64 bytes of int16 activations a block
        if isa == "vnni":
            # the activation pointers as they are (i8*): cast to i32* they measured an 8-row decode
            # step 18 % slower (LLVM's address arithmetic around the routine)
            sums = vnni_block_sums(b, [b.gep(wpan[v], [boff]) for v in range(V)],
                                    [b.gep(xrow[t], [xoff]) for t in range(TR)], "vpmovsxbw", 32, chains)
        else:
            sums = [[[zero_i] * chains for _ in range(V)] for _ in range(TR)]
            for p in range(16):
                w = [b.sext(b.load(b.bitcast(b.gep(wpan[v], [b.add(boff, const_i64(32 * p))]), _V32I8.as_pointer()),
                                   align=1), _V32I16) for v in range(V)]
                for t in range(TR):
                    pair = b.load(b.bitcast(b.gep(xrow[t], [b.add(xoff, const_i64(4 * p))]), I32.as_pointer()), align=2)
                    a = _splat(b, pair, _V16I32)
                    for v in range(V):
                        c = p % chains
                        sums[t][v][c] = _pair_dot(b, module, sums[t][v][c], w[v], a, isa)
        soff = b.shl(i, const_i64(5))                    # 32 bytes of scales a panel-block
        sc = [halves_to_floats(b, b.load(b.bitcast(b.gep(span[v], [soff]), _V16I16.as_pointer()), align=2))
              for v in range(V)]
        new = []
        for t in range(TR):
            xsv = b.load(b.gep(xsrow[t], [i]), align=4)
            xsv = b.shuffle_vector(b.insert_element(ir.Constant(_V16F32, ir.Undefined), xsv, ir.Constant(I32, 0)),
                                   ir.Constant(_V16F32, ir.Undefined), ir.Constant(_V16I32, [0] * 16))
            for v in range(V):
                s = sums[t][v][0] if chains == 1 else b.add(sums[t][v][0], sums[t][v][1])
                new.append(b.call(fma, [b.sitofp(s, _V16F32), b.fmul(sc[v], xsv), accs[t * V + v]]))
        return new

    from ..rows.llvm_ir import emit_counted_loop
    b, accs = emit_counted_loop(fn, b, const_i64(0), nb, 1, [zero_f] * (TR * V), block, "blocks")
    for t in range(TR):
        orow = b.gep(out, [b.mul(ost, const_i64(t))])
        for v in range(V):
            b.store(accs[t * V + v], b.bitcast(b.gep(orow, [const_i64(64 * v)]), _V16F32.as_pointer()), align=4)
    b.ret_void()
    return fn


YMM_TILES = ((6, 1), (5, 1), (4, 1), (3, 1), (2, 2), (1, 4))
"""The 256-bit variants' register tiles (batch rows TR, panels V): a panel is two vectors of 8
rows, so a tile holds TR x 2V int32 sums; 6 x 1 is the largest that fits the 16 ymm registers
beside its operands (:func:`llvm_ir.ymm_block_sums`), and its 12 independent sums keep two
``vpdpwssd`` a cycle busy through the instruction's latency (an 8-row tile, as IR, spilled)."""


def _define_tile_ymm(module, isa: str, TR: int, V: int, locality: int):
    """As :func:`_define_tile` (same signature and result, bit for bit), for the 256-bit variants:
    each panel as two halves of 8 rows, the block's int32 sums in registers (one inline-assembly
    routine a block), the float32 accumulators in ``out`` itself (the tile's TR rows of 16 V
    floats, in L1), loaded, stepped by one FMA and stored once a block: with 16 registers, sums
    and accumulators together would spill."""
    name = f"cpullm_q8_panel_tile_{isa}_{TR}x{V}_l{locality}"
    fn = module.globals.get(name)
    if fn is not None:
        return fn
    fnty = ir.FunctionType(ir.VoidType(), [P8, P8, I64, P8, I64, P8, I64, I64, P8, I64])
    fn = ir.Function(module, fnty, name)
    fn.linkage = "internal"
    fn.attributes.add("nounwind")
    wp, sp, pbytes, xq, xqst, xs, xsst, nb, out, ost = fn.args
    v8f32 = ir.VectorType(F32, 8)
    v8i16 = ir.VectorType(I16, 8)
    fma = declare(module, "llvm.fma.v8f32", v8f32, [v8f32, v8f32, v8f32])
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    sbytes = b.ashr(pbytes, const_i64(4))
    wpan = [b.gep(wp, [b.mul(pbytes, const_i64(v))]) for v in range(V)]
    span = [b.gep(sp, [b.mul(sbytes, const_i64(v))]) for v in range(V)]
    xrow = [b.gep(xq, [b.mul(xqst, const_i64(t))]) for t in range(TR)]
    xsrow = [b.bitcast(b.gep(xs, [b.mul(xsst, const_i64(t))]), F32.as_pointer()) for t in range(TR)]
    oacc = [[b.bitcast(b.gep(out, [b.add(b.mul(ost, const_i64(t)), const_i64(32 * h))]), v8f32.as_pointer())
             for h in range(2 * V)] for t in range(TR)]       # half h of the tile: 8 floats, 32 bytes
    zero_f = ir.Constant(v8f32, [0.0] * 8)
    for t in range(TR):
        for h in range(2 * V):
            b.store(zero_f, oacc[t][h], align=4)

    def block(b, i, accs):
        boff = b.shl(i, const_i64(9))                    # 512 bytes a panel-block
        for v in range(V if locality else 0):
            for line in range(0, PANEL_BLOCK_BYTES, 64):
                prefetch_ahead(b, module, b.gep(wpan[v], [b.add(boff, const_i64(line))]), locality)
        xoff = b.shl(i, const_i64(6))                    # 64 bytes of int16 activations a block
        # half h = 2 v + e: rows 8 e .. 8 e + 7 of panel v, the low / high 16 bytes of each pair
        sums = ymm_block_sums(b, [b.gep(wpan[h // 2], [b.add(boff, const_i64(16 * (h % 2)))]) for h in range(2 * V)],
                               [b.gep(xrow[t], [xoff]) for t in range(TR)], "vpmovsxbw", 32, isa)
        soff = b.shl(i, const_i64(5))                    # 32 bytes of scales a panel-block
        sc = [halves_to_floats(b, b.load(b.bitcast(b.gep(span[h // 2], [b.add(soff, const_i64(16 * (h % 2)))]),
                                                    v8i16.as_pointer()), align=2))
              for h in range(2 * V)]
        for t in range(TR):
            xsv = b.load(b.gep(xsrow[t], [i]), align=4)
            xsv = b.shuffle_vector(b.insert_element(ir.Constant(v8f32, ir.Undefined), xsv, ir.Constant(I32, 0)),
                                   ir.Constant(v8f32, ir.Undefined), ir.Constant(_V8I32, [0] * 8))
            for h in range(2 * V):
                prev = b.load(oacc[t][h], align=4)
                b.store(b.call(fma, [b.sitofp(sums[t][h], v8f32), b.fmul(sc[h], xsv), prev]), oacc[t][h], align=4)
        return []

    from ..rows.llvm_ir import emit_counted_loop
    b, _ = emit_counted_loop(fn, b, const_i64(0), nb, 1, [], block, "blocks")
    b.ret_void()
    return fn


def _make_tile(isa: str, TR: int, V: int, prefetch: bool = True):
    @intrinsic
    def tile(typingctx, wp, sp, g, x_q, x_s, t0, out, o_t, o_n):
        """Register tile: out[o_t + t, o_n + 16 v + l] for t < TR, v < V, l < 16 = panel g + v's
        row l against activation row t0 + t (out must have those 16 V columns). No bounds checks.
        Rows of at least LONG_ROW_K values prefetch into L2, shorter ones into L1; none with
        ``prefetch`` False (the tiles of several panels)."""
        sig = types.void(wp, sp, g, x_q, x_s, t0, out, o_t, o_n)

        def codegen(context, builder, sig, args):
            awp, asp, axq, axs = (context.make_array(sig.args[i])(context, builder, args[i]) for i in (0, 1, 3, 4))
            aout = context.make_array(sig.args[6])(context, builder, args[6])
            g_, t0_, ot_, on_ = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (2, 5, 7, 8))
            xqst = builder.extract_value(axq.strides, 0)
            xsst = builder.extract_value(axs.strides, 0)
            ost = builder.extract_value(aout.strides, 0)
            nb = builder.ashr(builder.extract_value(axq.shape, 1), const_i64(5))
            pbytes = builder.shl(nb, const_i64(9))
            p8 = lambda a: builder.bitcast(a.data, P8)  # noqa: E731
            wptr = builder.gep(p8(awp), [builder.mul(g_, pbytes)])
            sptr = builder.gep(p8(asp), [builder.mul(g_, builder.ashr(pbytes, const_i64(4)))])
            xptr = builder.gep(p8(axq), [builder.mul(t0_, xqst)])
            sxptr = builder.gep(p8(axs), [builder.mul(t0_, xsst)])
            optr = builder.gep(p8(aout), [builder.add(builder.mul(ot_, ost), builder.shl(on_, const_i64(2)))])
            operands = [wptr, sptr, pbytes, xptr, xqst, sxptr, xsst, nb, optr, ost]
            define = _define_tile_ymm if isa in YMM_DOTS else _define_tile
            long_rows = builder.icmp_signed(">=", nb, const_i64(LONG_ROW_K // QBLOCK))
            with builder.if_else(long_rows) as (long_, short):
                with long_:
                    builder.call(define(builder.module, isa, TR, V, 2 if prefetch else 0), operands)
                with short:
                    builder.call(define(builder.module, isa, TR, V, 3 if prefetch else 0), operands)
            return context.get_dummy_value()

        return sig, codegen
    return tile


LONG_ROW_K = 4096
"""Rows at least this long prefetch into L2, not L1: their int16 activations (>= 8 KiB a row) and
a stream pulled into L1 4 KiB ahead evict each other."""

_t8x1, _t5x1, _t4x2, _t3x2, _t2x4, _t1x4 = (_make_tile(ISA, TR, V, prefetch=V == 1) for TR, V in TILES)
_y6x1, _y5x1, _y4x1, _y3x1, _y2x2, _y1x4 = (_make_tile(ISA, TR, V, prefetch=V == 1) for TR, V in YMM_TILES)
YMM_TILE_ROWS = YMM_TILES[0][0]
"""Rows of the 256-bit variants' accumulator buffer (:func:`_group_ymm`)."""


@njit(cache=True, nogil=True, inline="always")
def _group_ymm(wp, sp, g, x_q, x_s, out, o_n, acc):
    """:func:`_group_zmm` with the 256-bit variants' tiles (YMM_TILES). Tiles of 3 to 6 rows sum
    into ``acc`` (a thread's (YMM_TILE_ROWS, 64) buffer: 1.5 KiB, contiguous, L1-resident) and
    are copied to ``out`` after the group's 4 panels: their float accumulators live in memory (the
    tile loads, steps and stores them once a block), and kept in ``out`` they are TR lines at a
    stride of N floats, which from N ~ 2048 at T = 256 (out past the 2 MiB L2) halved the AVX2
    prefill LINEAR (36.8 against 67.0 GMAC/s at K = 640; AVX-512, sums in registers, unaffected).
    2 and 1 rows (decode, a batch's tail) write ``out`` directly."""
    B = x_q.shape[0]
    t0 = 0
    while B - t0 >= 3:
        r = min(B - t0, 6)
        for v in range(4):
            if r == 6:
                _y6x1(wp, sp, g + v, x_q, x_s, t0, acc, 0, 16 * v)
            elif r == 5:
                _y5x1(wp, sp, g + v, x_q, x_s, t0, acc, 0, 16 * v)
            elif r == 4:
                _y4x1(wp, sp, g + v, x_q, x_s, t0, acc, 0, 16 * v)
            else:
                _y3x1(wp, sp, g + v, x_q, x_s, t0, acc, 0, 16 * v)
        for t in range(r):
            out[t0 + t, o_n:o_n + GROUP * PANEL] = acc[t]
        t0 += r
    if B - t0 == 2:
        for v in range(0, 4, 2):
            _y2x2(wp, sp, g + v, x_q, x_s, t0, out, t0, o_n + 16 * v)
    elif B - t0 == 1:
        _y1x4(wp, sp, g, x_q, x_s, t0, out, t0, o_n)


@njit(cache=True, nogil=True, inline="always")
def _group_zmm(wp, sp, g, x_q, x_s, out, o_n, acc):
    """Every tile of panels g .. g + 3 (GROUP) against all B rows; results at out[:, o_n:]
    (``acc``: the 256-bit variants' buffer, unused here: the tiles' sums stay in registers)."""
    B = x_q.shape[0]
    t0 = 0
    while B - t0 >= 8:
        for v in range(4):
            _t8x1(wp, sp, g + v, x_q, x_s, t0, out, t0, o_n + 16 * v)
        t0 += 8
    r = B - t0
    if r == 5:
        for v in range(4):
            _t5x1(wp, sp, g + v, x_q, x_s, t0, out, t0, o_n + 16 * v)
        r = 0
    elif r > 5:                         # 6, 7: 4 rows, then 2 or 3
        for v in range(0, 4, 2):
            _t4x2(wp, sp, g + v, x_q, x_s, t0, out, t0, o_n + 16 * v)
        t0 += 4
        r -= 4
    if r >= 3:
        for v in range(0, 4, 2):
            if r == 4:
                _t4x2(wp, sp, g + v, x_q, x_s, t0, out, t0, o_n + 16 * v)
            else:
                _t3x2(wp, sp, g + v, x_q, x_s, t0, out, t0, o_n + 16 * v)
    elif r == 2:
        _t2x4(wp, sp, g, x_q, x_s, t0, out, t0, o_n)
    elif r == 1:
        _t1x4(wp, sp, g, x_q, x_s, t0, out, t0, o_n)


_group = _group_ymm if YMM else _group_zmm


@njit(cache=True, inline="always")
def _check_panels(wp, sp, N, x_q, x_s, out):
    """Raise unless the operands fit :func:`panels_matmul`; (groups whose 64 rows are all < N,
    groups)."""
    B, Kp = x_q.shape
    nb = Kp // QBLOCK
    npan = (N + ROW_ALIGN - 1) // ROW_ALIGN * GROUP
    if (wp.shape[0] != npan * PANEL * Kp or sp.shape[0] != npan * PANEL * nb or Kp % QBLOCK != 0
            or x_s.shape[0] != B or x_s.shape[1] != nb or out.shape[0] != B or out.shape[1] < N):
        raise ValueError("panels_matmul: shapes must be wp (Np * Kp,), sp (Np * Kp // 32,), x_q (B, Kp), "
                         "x_s (B, Kp // 32), out (B, >= N)")
    if x_q.strides[1] != 2 or x_s.strides[1] != 4 or out.strides[1] != 4:
        raise ValueError("panels_matmul: rows of x_q, x_s and out must be contiguous")
    return N // (GROUP * PANEL), npan // GROUP


@njit(cache=True, parallel=True)
def panels_matmul(wp, sp, N, x_q, x_s, out, nthreads):
    """out[:, :N] = the panels' rows against rows of (x_q int16 (B, Kp), x_s float32 (B, Kp // 32)),
    the module's numerics. wp int8 / sp uint16 flat (pack_panels); out float32 (B, >= N) (the
    columns past N are left alone). Callers pass C-contiguous 2-D arrays, so that one compiled
    specialization serves decode, batches and prefill. Groups of 4 panels (64 rows) split over the threads in contiguous
    ranges; a group that would run past Np, or holds rows past N, goes through a scratch tile."""
    B = x_q.shape[0]
    nfull, ngroups = _check_panels(wp, sp, N, x_q, x_s, out)
    nth = max(1, min(nthreads, ngroups))
    for c in prange(nth):
        lo = c * ngroups // nth
        hi = (c + 1) * ngroups // nth
        acc = np.empty((YMM_TILE_ROWS if B >= 3 else 1, GROUP * PANEL), np.float32)
        edge = np.empty((B if hi > nfull else 0, GROUP * PANEL), np.float32)
        for grp in range(lo, hi):
            # one call site: _group inlines its six tiles (with a second one: 4.4 s of CPU, not 2.3)
            full = grp < nfull
            _group(wp, sp, grp * GROUP, x_q, x_s, out if full else edge, grp * GROUP * PANEL if full else 0, acc)
            if not full:                    # the last group holds rows past N: via a scratch tile
                for t in range(B):
                    for j in range(N - nfull * GROUP * PANEL):
                        out[t, nfull * GROUP * PANEL + j] = edge[t, j]


PANELS_MATMUL = Addressed(panels_matmul, types.none, [
    (WQ, WS, i64, array(types.int16, 2), array(types.float32, 2), array(types.float32, 2), i64)])
"""panels_matmul as formats.matmul_rows calls it for two rows or more (a batched step, a verify
pass, routed experts), through its address (cpullm_kernels.setup.addressed)."""

_tile_1x4 = _y1x4 if YMM else _t1x4


@njit(cache=True, parallel=True)
def panels_matvec(wp, sp, N, x_q, x_s, out, nthreads):
    """:func:`panels_matmul` for one row (B = 1: decode, the head of a prefill chunk), bit for bit:
    the same groups over the threads and the same one-row tile of 4 panels, which is all this
    kernel holds. panels_matmul's six tiles took 2.5-4.1 s of CPU to compile on a cold start's
    path, for a model (the default GGUF) whose one q8 matrix, the head, sees one row at a time."""
    nfull, ngroups = _check_panels(wp, sp, N, x_q, x_s, out)
    if x_q.shape[0] != 1:
        raise ValueError("panels_matvec: one row of activations (panels_matmul takes more)")
    nth = max(1, min(nthreads, ngroups))
    for c in prange(nth):
        lo = c * ngroups // nth
        hi = (c + 1) * ngroups // nth
        edge = np.empty((1 if hi > nfull else 0, GROUP * PANEL), np.float32)
        for grp in range(lo, hi):
            full = grp < nfull
            _tile_1x4(wp, sp, grp * GROUP, x_q, x_s, 0, out if full else edge, 0,
                      grp * GROUP * PANEL if full else 0)
            if not full:                    # the last group holds rows past N: via a scratch tile
                for j in range(N - nfull * GROUP * PANEL):
                    out[0, nfull * GROUP * PANEL + j] = edge[0, j]


PANELS_MATVEC = Addressed(panels_matvec, types.none, PANELS_MATMUL.signatures)
"""panels_matvec as formats.matmul_rows calls it for one row, through its address."""


@njit(cache=True, parallel=True)
def panels_matmul_many(wq, ws, mats, x_q, x_s, out, nthreads):
    """Several q8 panel matrices in one parallel region: for each row m of ``mats`` (int64
    (M, 7): w_off, s_off, N, row0, nrows, out_row0, col0; N a multiple of ROW_ALIGN),
    out[out_row0 .. + nrows, col0 .. col0 + N] = the matrix at wq[w_off:] / ws[s_off:] (:func:`panels_matmul`'s
    layout) against rows row0 .. row0 + nrows of (x_q, x_s), one Kp for all. Work items are
    (matrix, group of GROUP panels) split over the threads in contiguous ranges, so the routed
    experts of a layer cost one thread start, not one a matrix; each row's numbers are
    :func:`panels_matmul`'s (the same tiles per group)."""
    Kp = x_q.shape[1]
    nb = Kp // QBLOCK
    M = mats.shape[0]
    first = np.zeros(M + 1, np.int64)
    for m in range(M):
        N = mats[m, 2]
        if (Kp % QBLOCK != 0 or N % ROW_ALIGN != 0 or mats[m, 0] < 0 or mats[m, 1] < 0
                or mats[m, 0] + N * Kp > wq.shape[0] or mats[m, 1] + N * nb > ws.shape[0]
                or mats[m, 3] < 0 or mats[m, 4] < 0 or mats[m, 3] + mats[m, 4] > x_q.shape[0] or mats[m, 5] < 0
                or mats[m, 5] + mats[m, 4] > out.shape[0] or mats[m, 6] < 0 or mats[m, 6] + N > out.shape[1]):
            raise ValueError("panels_matmul_many: a matrix or its rows lie outside the operands")
        first[m + 1] = first[m] + N // (GROUP * PANEL)
    total = first[M]
    nth = max(1, min(nthreads, total))
    for c in prange(nth):
        acc = np.empty((YMM_TILE_ROWS, GROUP * PANEL), np.float32)
        m = 0
        for item in range(c * total // nth, (c + 1) * total // nth):
            while item >= first[m + 1]:
                m += 1
            w_off, s_off, N, r0, nr = mats[m, 0], mats[m, 1], mats[m, 2], mats[m, 3], mats[m, 4]
            o0, col0 = mats[m, 5], mats[m, 6]
            if nr == 0:
                continue
            grp = item - first[m]
            _group(wq[w_off: w_off + N * Kp], ws[s_off: s_off + N * nb], grp * GROUP, x_q[r0: r0 + nr],
                   x_s[r0: r0 + nr], out[o0: o0 + nr], col0 + grp * GROUP * PANEL, acc)


@njit(cache=True, nogil=True)
def _quantize_rows(x, x_q, x_s):
    for t in range(x.shape[0]):
        quantize_act_q16(x[t], x_q[t], x_s[t])


# ================================================================================================
# one row at a time (the head screen's exact rows), the rows as numbers, prefill
# ================================================================================================

@intrinsic
def _fma32(typingctx, a, b, c):
    """float32 a * b + c with one rounding (``llvm.fma``: the lanes of the tile's FMA exactly)."""
    if not all(isinstance(v, types.Float) and v.bitwidth == 32 for v in (a, b, c)):
        return None

    def codegen(context, builder, sig, args):
        fma = declare(builder.module, "llvm.fma.f32", F32, [F32, F32, F32])
        return builder.call(fma, list(args))

    return types.float32(a, b, c), codegen


@njit(cache=True, nogil=True)
def panel_row_dot(wp, sp, n, x_q, x_s):
    """Row n of the panels against one row of activations (x_q int16 (Kp,), x_s float32 (Kp // 32,)):
    the value :func:`panels_matmul` writes for it, bit for bit (the same integer block sums, the
    same float steps in the same order)."""
    Kp = x_q.shape[0]
    nb = Kp // QBLOCK
    g = n // PANEL
    lane = n % PANEL
    acc = np.float32(0.0)
    for b in range(nb):
        base = (g * nb + b) * PANEL_BLOCK_BYTES + 2 * lane
        s = 0
        for p in range(16):
            s += np.int32(wp[base + 32 * p]) * np.int32(x_q[QBLOCK * b + 2 * p])
            s += np.int32(wp[base + 32 * p + 1]) * np.int32(x_q[QBLOCK * b + 2 * p + 1])
        factor = half_to_float(sp[(g * nb + b) * PANEL + lane]) * x_s[b]
        acc = _fma32(np.float32(s), factor, acc)
    return acc


@njit(cache=True, nogil=True)
def scaled_row_into(wp, sp, Kp, n, scale, out):
    """out[j] = w[n, j] * scale for j < out.size: row n of the panels as numbers (an embedding
    row read from a table stored as panels, tied to the lm_head)."""
    nb = Kp // QBLOCK
    g, lane = n // PANEL, n % PANEL
    for j in range(out.shape[0]):
        blk = g * nb + j // QBLOCK
        q = wp[blk * PANEL_BLOCK_BYTES + (j % QBLOCK) // 2 * 2 * PANEL + 2 * lane + j % 2]
        out[j] = np.float32(q) * half_to_float(sp[blk * PANEL + lane]) * scale


def dequantized_rows(wp, sp, Kp: int, n0: int, n1: int):
    """float64 (n1 - n0, Kp): rows n0 .. n1 of the panels as numbers (values times scales)."""
    nb = Kp // QBLOCK
    g0, g1 = n0 // PANEL, (n1 + PANEL - 1) // PANEL
    q = np.asarray(wp[g0 * nb * PANEL_BLOCK_BYTES: g1 * nb * PANEL_BLOCK_BYTES]).reshape(g1 - g0, nb, 16, PANEL, 2)
    q = q.transpose(0, 3, 1, 2, 4).reshape((g1 - g0) * PANEL, nb, QBLOCK)
    s = np.asarray(sp[g0 * nb * PANEL: g1 * nb * PANEL]).reshape(g1 - g0, nb, PANEL).transpose(0, 2, 1)
    s = scale_values(s.reshape((g1 - g0) * PANEL, nb)).astype(np.float64)
    rows = (q.astype(np.float64) * s[..., None]).reshape(-1, Kp)
    return rows[n0 - g0 * PANEL: n1 - g0 * PANEL]


@njit(cache=True, parallel=True)
def quantize_rows_par(x, x_q, x_s):
    for t in prange(x.shape[0]):
        quantize_act_q16(x[t], x_q[t], x_s[t])


ACT_CHUNK_BYTES = 1 << 19
"""Rows of int16 activations a prefill LINEAR passes over each group of weights at a time (512 KiB:
a quarter of a 2 MiB L2). Every row passes every 64-row group, so all of them are re-read once a
group; past L2 they come from L3 at every group (T = 256 rows of K = 4864, 2.4 MiB: 29 GMAC/s on
one AVX2 core, against 65 for 64 of those rows). Cut into chunks, the weights are re-read once a
chunk instead (from L3: a few MB per chunk of ~10 ms of arithmetic)."""


def act_chunk_rows(Kp: int) -> int:
    """Rows of Kp int16 activations in one chunk (ACT_CHUNK_BYTES; a multiple of the largest
    register tile's 6 rows, at least 6)."""
    rows = ACT_CHUNK_BYTES // (2 * Kp)
    return max(6, rows // 6 * 6)


def matmul_panels(x, wp, sp, N: int, out):
    """out[:, :N] = x (T, K) @ W.T for a prefill chunk: x float32 (T, K) (rows contiguous, any
    row stride) quantized once, then :func:`panels_matmul` (each 64-row group of W read from
    memory once and kept in L2 while every row of x passes it), over chunks of
    :func:`act_chunk_rows` rows when x's int16 rows would not stay in L2; out C-contiguous
    (T, >= N). Rows are independent: the chunking changes no value."""
    T, K = x.shape
    Kp = (K + QBLOCK - 1) // QBLOCK * QBLOCK
    x_q, x_s = activation_scratch(T, Kp)
    quantize_rows_par(x, x_q, x_s)
    step = act_chunk_rows(Kp)
    nthreads = numba.get_num_threads()
    if T <= step:
        panels_matmul(wp, sp, N, x_q, x_s, out, nthreads)
        return
    for r0 in range(0, T, step):
        r1 = min(T, r0 + step)
        panels_matmul(wp, sp, N, x_q[r0:r1], x_s[r0:r1], out[r0:r1], nthreads)
