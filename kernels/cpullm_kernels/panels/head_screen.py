"""Greedy decoding's lm_head at about half its bytes, with exactly the same answer ("head screen").

In a greedy decode step only the argmax of the logits is used, and the lm_head (vocab x hidden)
is the largest single matrix a token reads: 144 of Qwen2.5-0.5B's 525 MB, 178 of Gemma 3 270M's
~290 MB. The screen reads a compact copy of it, gets every row's logit to within a proven bound,
and recomputes exactly (``q8_panels.panel_row_dot``: the lm_head kernel's arithmetic for one row)
only the rows whose bound reaches the best lower bound. The token it returns is the argmax of the
full q8 logits, lowest index on ties, as ``np.argmax`` of the lm_head kernel's logits: nothing is approximated in what the caller sees. (An
lm_head of raw ggml blocks, ``--quant q4``'s Q6_K, has its own bound and exact path over the same
compact copy and bounds pass: :mod:`cpullm_kernels.panels.head_screen_blocks`.)

Compact copy, per row n of the lm_head (columns permuted by ``perm``: the ``k_sel`` columns where
the activations are expected to be large first, the rest after; K padded to Kp):

    hq  int8 (N, k_sel + (Kp - k_sel) // 2)   the first k_sel columns as int8 blocks of 32, the rest
                                              as 4-bit blocks of 32: 16 bytes per block, byte j
                                              holds value j (low nibble) and value j + 16 (high)
    hs  uint16 (N, Kp // 32)                  binary16 scales of those blocks (rounded up as q8's)
    hb  float32 (N, 3)                        E_sel, E_rest: Euclidean norms of the row's error
                                              (exact dequantized q8 row minus the compact row) over
                                              the two column sets; Wn: the larger of the two rows'
                                              norms. Each rounded up.

The bound. Let w be the exact row (q8 values times scales), v the compact one, x the int16
activations the exact matvec uses (dequantized), x' the permuted x re-quantized in blocks of 32
(what the compact dot reads: int16 on the k_sel columns, int8 on the rest, where the activations
are small; their larger rounding enters the bound through |x - x'|). Then, by Cauchy-Schwarz on
each column set,

    |w.x - v.x'| <= E_sel |x_sel| + E_rest |x_rest| + Wn |x - x'|

plus float rounding: of the two dot products, each below (nb + 8) 2^-24 Wn |x| for nb blocks
(int32 block sums are exact; a float32 FMA per block, or per pair of 4-bit blocks), and of approx
+- bound in float32, each below 2^-24 (|approx| + bound); ``Wn (nb + 16) 2^-22 |x|`` is added for
all of them, and the sum is scaled by (1 + 2^-10) for the rounding of the bound's own float32
arithmetic. Rows whose upper bound is below the largest lower bound cannot be the argmax (strictly
below it: they cannot tie either). With the activations' large channels kept at 8 bits (chosen
from the final norm's weights by the compiler) the 4-bit part's error sees only the small ones: on
Qwen2.5-0.5B text a few hundred of 151936 rows survive (median; a few thousand at the 90th
percentile), so the step reads ~55 % of the lm_head's bytes.

Kernels:

    screen_columns(column_weights, Kp, k_sel) -> perm                 numpy, at compile time
    build_screen(w_q, w_s, perm, k_sel) -> (hq, hs, hb)                numpy, at compile time
    screen_argmax(x, perm, k_sel // 32, hq, hs, hb, w_q, w_s, scratch..., nthreads, max_rows)
        -> (token, rows left to compute exactly); token -1 (non-finite bounds) or -2 (more than
        max_rows rows left): run the full head
    screen_dots(hq, hs, p_q, p_s, k_sel // 32, out)                    the compact rows' dot products
                                                    (p_q int16; within +-127 past k_sel)

with numpy references ``screen_argmax_ref``, ``screen_bounds_ref``, ``screen_dots_ref``,
``screen_activations_ref`` (tests/test_head_screen.py). Each pass splits the rows into one
contiguous range per thread: the bounds pass streams the compact rows (prefetching 4 KiB ahead);
the exact rows are read out of order.

The bounds pass has to keep up with memory: at 576 bytes a row (Qwen2.5-0.5B) a 2-core VM
streaming 30-45 GB/s leaves it 25-40 ns a row per thread. Its 4-bit blocks therefore take int8
activations and go two blocks (32 bytes) per vector: ``vpdpbusd`` (AVX-512 VNNI, ymm) or
``vpmaddubsw`` + ``vpmaddwd`` (AVX2) on the nibbles as unsigned bytes, whose +8 offset is taken
back exactly by a per-pair integer correction computed once per token (:func:`_pack_rest`).
Against an int16 version (two ``vpmaddwd`` a block after sign-extending and shifting the nibbles)
a row from L2 takes 22 ns instead of 27; the int8 rounding leaves a few more rows to compute
exactly (tens, of 262144).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..rows.llvm_ir import (F32, I8, I16, I32, I64, P8, V8F32, V8I32, V16I16, block_dot_i32x8, const_i64,
                            declare, emit_counted_loop, emit_if, halves_to_floats, hsum_v8f32,
                            prefetch_ahead, scaled_fma)
from ..rows.q8 import HAVE_AVX2, QBLOCK, quantize_blocks_ref, quantize_row, quantize_act_q16, scale_values
from ..setup import numba_setup
from .q8_panels import panel_row_dot

HAVE_VNNI256 = (numba_setup.HOST_IS_X86 and HAVE_AVX2
                and {"avx512f", "avx512vl", "avx512bw", "avx512vnni"} <= numba_setup.HOST_FEATURES)
"""True when the screen's 4-bit blocks use ``vpdpbusd`` on ymm (else ``vpmaddubsw`` + ``vpmaddwd``)."""

SEL_COLUMNS = 128
"""Columns kept at 8 bits (at most a quarter of them: :func:`sel_columns`), chosen from greedy
decode's activations: 128 rather than 64 cut the surviving rows about 3.5x (Gemma 3 270M: median
960 -> 270 of 262144); columns chosen by the final norm's weights kept many times more. 3-bit
rests keep most rows whatever the columns."""


def sel_columns(Kp: int) -> int:
    """Columns a screen keeps at 8 bits for a padded width Kp: SEL_COLUMNS, at most Kp / 4, whole blocks."""
    return max(32, min(SEL_COLUMNS, Kp // 4) // QBLOCK * QBLOCK)

MIN_LM_HEAD_BYTES = 64 << 20
"""Smallest q8 lm_head (bytes) that gets a screen. A smaller one stays largely in the last-level
cache between tokens and is cheap to read whole: a 30 MB head decoded 3 % slower through a
screen, 144-173 MB heads 8-14 % faster."""

ROUNDING_MARGIN = 1.0 + 2.0 ** -10

SCALE_GROUP = 8
"""Block scales are converted 8 at a time (``vcvtph2ps`` on a vector) at the start of a row, times
the activations' block scales, into a small stack buffer; each block's FMA then reads its factor
from there (a broadcast load) instead of converting a scalar: 7 -> 2 instructions per block, the
difference between a compute-bound and a bandwidth-bound screen. The scale rows (and the
activation-scale scratch) are padded to a multiple of 8 for it."""
MAX_BLOCKS = 1024
"""Largest K / 32 the row routine's stack buffer holds (K <= 32768)."""


@njit(cache=True)
def rounding_term(Kp):
    """Float rounding, relative to Wn |x|, covered by the bound: (Kp/32 + 16) 2^-22, four times
    the worst case of one float32 dot product over Kp/32 blocks (the exact one, the compact one,
    and the float32 sums approx +- bound)."""
    return (Kp // QBLOCK + 16) * 2.0 ** -22


def padded_blocks(Kp: int) -> int:
    """Columns of a screen's scale rows (and of the activation-scale scratch): Kp / 32 rounded up to 8."""
    return (Kp // QBLOCK + SCALE_GROUP - 1) // SCALE_GROUP * SCALE_GROUP


def _round_up_f32(x):
    """float64 array -> the smallest float32 values >= x (elementwise)."""
    f = np.asarray(x, np.float64).astype(np.float32)
    return np.where(f.astype(np.float64) < x, np.nextafter(f, np.float32(np.inf)), f).astype(np.float32)


def screen_columns(weight_of_column, Kp: int, k_sel: int = SEL_COLUMNS) -> np.ndarray:
    """perm (Kp,) int64: the ``k_sel`` columns of largest ``|weight_of_column|`` (K values, K <= Kp;
    ties to the lower index) in ascending order, then every other column (padding included) in order."""
    w = np.abs(np.asarray(weight_of_column, np.float64))
    k_sel = min(int(k_sel), Kp - QBLOCK) // QBLOCK * QBLOCK
    top = np.sort(np.argsort(-w, kind="stable")[:k_sel])
    rest = np.setdiff1d(np.arange(Kp), top)
    return np.concatenate([top, rest]).astype(np.int64)


def _pack_nibbles(q):
    """q integer (N, 32 * m) in [-8, 7] -> int8 (N, 16 * m): byte j of a block holds value j low, j + 16 high."""
    N = q.shape[0]
    b = q.reshape(N, -1, 2, 16).astype(np.int64) & 0xF
    return ((b[:, :, 0] | (b[:, :, 1] << 4)).astype(np.uint8).view(np.int8)).reshape(N, -1)


def unpack_nibbles(p):
    """Inverse of the nibble packing: int8 (N, 16 * m) -> int8 (N, 32 * m) values in [-8, 7]."""
    u = np.asarray(p).view(np.uint8).reshape(p.shape[0], -1, 16).astype(np.int16)
    lo = ((u & 0xF) ^ 8) - 8
    hi = ((u >> 4) ^ 8) - 8
    return np.concatenate([lo, hi], axis=2).reshape(p.shape[0], -1).astype(np.int8)


def build_screen(w_q, w_s, perm, k_sel: int, rows_per_chunk: int | None = None):
    """The compact copy and error norms of the q8 matrix (w_q int8 (N, Kp), w_s uint16 (N, Kp//32))
    with columns ``perm`` (k_sel of them at 8 bits). Returns (hq, hs, hb) as in the module docstring.
    Rows go ``rows_per_chunk`` at a time, by default ~8 MB of float64 per temporary: under glibc's
    mmap threshold, so the heap is reused instead of fresh pages (slow to touch on some VMs)."""
    N, Kp = w_q.shape
    nb = Kp // QBLOCK

    def exact_rows(n0, n1):
        exact = (w_q[n0:n1].reshape(n1 - n0, nb, QBLOCK).astype(np.float64)
                 * scale_values(w_s[n0:n1]).astype(np.float64)[..., None]).reshape(n1 - n0, Kp)
        return exact, None
    return build_screen_rows(exact_rows, N, Kp, perm, k_sel, rows_per_chunk)


def build_screen_rows(exact_rows, N: int, Kp: int, perm, k_sel: int, rows_per_chunk: int | None = None):
    """(hq, hs, hb) of the module docstring for N rows of Kp columns given by ``exact_rows(n0, n1)``
    -> (float64 (n1 - n0, Kp) the exact rows n0..n1 in their own column order, float64 (n1 - n0,)
    amounts added to both error norms of each row (E_sel, E_rest: a term of the bound per unit of
    activation norm that the caller proves, e.g. the exact path's float rounding), or None). Rows
    go ``rows_per_chunk`` at a time (default ~8 MB of float64 per temporary), so no more than a
    chunk is ever dequantized."""
    if (Kp % QBLOCK or k_sel % QBLOCK or not 0 < k_sel < Kp or Kp > QBLOCK * MAX_BLOCKS
            or sorted(perm) != list(range(Kp))):
        raise ValueError("build_screen: Kp and k_sel must be multiples of 32, 0 < k_sel < Kp <= 32768, "
                         "perm a permutation of range(Kp)")
    perm = np.asarray(perm, np.int64)
    rows_per_chunk = rows_per_chunk or max(1, (1 << 20) // Kp)
    hq = np.empty((N, k_sel + (Kp - k_sel) // 2), np.int8)
    hs = np.zeros((N, padded_blocks(Kp)), np.uint16)
    hb = np.empty((N, 3), np.float32)
    nb = Kp // QBLOCK
    for n0 in range(0, N, rows_per_chunk):
        n1 = min(N, n0 + rows_per_chunk)
        exact, err_extra = exact_rows(n0, n1)
        exact = exact[:, perm]
        q8, s8 = quantize_blocks_ref(exact[:, :k_sel].astype(np.float32), 127, True)
        q4, s4 = quantize_blocks_ref(exact[:, k_sel:].astype(np.float32), 7, True)
        hq[n0:n1, :k_sel] = q8.astype(np.int8)
        hq[n0:n1, k_sel:] = _pack_nibbles(q4)
        hs[n0:n1, :k_sel // QBLOCK] = s8
        hs[n0:n1, k_sel // QBLOCK:nb] = s4
        compact = np.concatenate([
            (q8.reshape(n1 - n0, -1, QBLOCK) * scale_values(s8)[..., None]).reshape(n1 - n0, -1),
            (q4.reshape(n1 - n0, -1, QBLOCK) * scale_values(s4)[..., None]).reshape(n1 - n0, -1)], axis=1)
        err = exact - compact.astype(np.float64)
        add = 0.0 if err_extra is None else err_extra
        hb[n0:n1, 0] = _round_up_f32((np.sqrt((err[:, :k_sel] ** 2).sum(1)) + add) * (1 + 2.0 ** -40))
        hb[n0:n1, 1] = _round_up_f32((np.sqrt((err[:, k_sel:] ** 2).sum(1)) + add) * (1 + 2.0 ** -40))
        norms = np.maximum(np.sqrt((exact ** 2).sum(1)), np.sqrt((compact.astype(np.float64) ** 2).sum(1)))
        hb[n0:n1, 2] = _round_up_f32(norms * (1 + 2.0 ** -40))
    return hq, hs, hb


# ================================================================================================
# numpy reference
# ================================================================================================

def screen_dots_ref(hq, hs, x_q, x_s, k_sel: int):
    """float64 compact dot products (N,) of the screen rows with permuted int16 activations."""
    N = hq.shape[0]
    vals = np.concatenate([hq[:, :k_sel], unpack_nibbles(hq[:, k_sel:])], axis=1).astype(np.int64)
    dots = (vals.reshape(N, -1, QBLOCK) * x_q.reshape(-1, QBLOCK).astype(np.int64)).sum(-1)
    nb = dots.shape[1]
    return (dots * scale_values(hs[:, :nb]).astype(np.float64) * x_s[:nb].astype(np.float64)).sum(-1)


def screen_activations_ref(xp, k_sel: int):
    """numpy reference of what the compact rows read: permuted activations xp float32 (Kp,) ->
    (p_q int16 (Kp,), p_s float32 (Kp // 32,)): the first k_sel values as int16 blocks
    (quantize_act_q16), the rest as int8 blocks (scale max|v| / 127)."""
    from ..rows.q8 import quantize_act_q16_ref
    xp = np.asarray(xp, np.float32)
    sel_q, sel_s = quantize_act_q16_ref(xp[:k_sel], k_sel)
    rest_q, rest_s = quantize_blocks_ref(xp[k_sel:].reshape(1, -1), 127, False)
    return (np.concatenate([sel_q, rest_q[0].astype(np.int16)]),
            np.concatenate([sel_s, rest_s[0].astype(np.float32)]))


def screen_bounds_ref(x, perm, k_sel: int, hq, hs, hb):
    """(approx (N,), bound (N,), exact activations (x_q, x_s)) in float64, as the kernel defines them."""
    from ..rows.q8 import quantize_act_q16_ref
    Kp = perm.size
    x_q, x_s = quantize_act_q16_ref(x, Kp)
    xd = (x_q.reshape(-1, QBLOCK).astype(np.float32) * x_s[:, None]).reshape(-1)   # float32, as the kernel
    xp = xd[perm]
    p_q, p_s = screen_activations_ref(xp, k_sel)
    pd = (p_q.reshape(-1, QBLOCK).astype(np.float32) * p_s[:, None]).reshape(-1)
    xp64 = xp.astype(np.float64)
    n_sel = np.sqrt((xp64[:k_sel] ** 2).sum())
    n_rest = np.sqrt((xp64[k_sel:] ** 2).sum())
    delta = np.sqrt(((xp64 - pd.astype(np.float64)) ** 2).sum())
    extra = delta + rounding_term(Kp) * np.sqrt(n_sel ** 2 + n_rest ** 2)
    hb64 = hb.astype(np.float64)
    bound = (hb64[:, 0] * n_sel + hb64[:, 1] * n_rest + hb64[:, 2] * extra) * ROUNDING_MARGIN
    return screen_dots_ref(hq, hs, p_q, p_s, k_sel), bound, (x_q, x_s)


def screen_argmax_ref(x, perm, k_sel: int, hq, hs, hb, w_q, w_s):
    """numpy reference: (argmax of the exact q8 logits found through the screen, survivor count)."""
    from ..rows.q8 import matvec_q8_ref
    approx, bound, (x_q, x_s) = screen_bounds_ref(x, perm, k_sel, hq, hs, hb)
    lower = (approx - bound).max()
    keep = np.nonzero(approx + bound >= lower)[0]
    exact = matvec_q8_ref(w_q[keep], w_s[keep], x_q, x_s)
    return int(keep[np.argmax(exact)]), keep.size


# ================================================================================================
# LLVM IR: the compact row's dot product
# ================================================================================================

def _nibble_pair_dot_i32x8(b, module, nib, xp, init, isa):
    """Two blocks of 4-bit values . their int8 activations, plus ``init``, as <8 x i32>.

    ``nib``: <32 x i8>, the 16 bytes of block i then those of block i + 1 (the layout above); xp:
    64 int8 activations in pair order (:func:`_pack_rest`); init: <8 x i32> (the offset
    correction). The nibbles are taken as unsigned u = v + 8 (``xor 0x88``, one mask and one
    shift for both halves of all 32 bytes), multiplied with the signed activations four bytes to
    a lane (``vpdpbusd``; on AVX2 ``vpmaddubsw`` + ``vpmaddwd`` with ones), so lane l holds
    sum u x over values 4l..4l+3 and 16+4l..16+4l+3 of block i (l < 4) or of block i + 1 (l - 4).
    ``init`` = -8 * (the same sums of x) turns that into the signed sum of v x, exactly: every
    lane stays below 8 * 15 * 127 in magnitude.
    """
    v32i8 = ir.VectorType(I8, 32)
    nib = b.xor(nib, ir.Constant(v32i8, [0x88 - 256] * 32))
    lo = b.and_(nib, ir.Constant(v32i8, [0x0F] * 32))          # values 0..15 of both blocks
    hi = b.lshr(nib, ir.Constant(v32i8, [4] * 32))             # values 16..31
    x_lo = b.load(b.bitcast(xp, v32i8.as_pointer()), align=1)
    x_hi = b.load(b.bitcast(b.gep(xp, [const_i64(32)]), v32i8.as_pointer()), align=1)
    if isa == "vnni":
        dpbusd = declare(module, "llvm.x86.avx512.vpdpbusd.256", V8I32, [V8I32, V8I32, V8I32])
        acc = b.call(dpbusd, [init, b.bitcast(lo, V8I32), b.bitcast(x_lo, V8I32)])
        return b.call(dpbusd, [acc, b.bitcast(hi, V8I32), b.bitcast(x_hi, V8I32)])
    if isa == "avx2":
        ubsw = declare(module, "llvm.x86.avx2.pmadd.ub.sw", V16I16, [v32i8, v32i8])
        maddwd = declare(module, "llvm.x86.avx2.pmadd.wd", V8I32, [V16I16, V16I16])
        pairs = b.add(b.call(ubsw, [lo, x_lo]), b.call(ubsw, [hi, x_hi]))   # each |.| <= 4 * 15 * 127
        return b.add(init, b.call(maddwd, [pairs, ir.Constant(V16I16, [1] * 16)]))
    v32i32 = ir.VectorType(I32, 32)
    p = b.add(b.mul(b.zext(lo, v32i32), b.sext(x_lo, v32i32)), b.mul(b.zext(hi, v32i32), b.sext(x_hi, v32i32)))
    out = init
    for k in range(4):
        out = b.add(out, b.shuffle_vector(p, p, ir.Constant(V8I32, [4 * lane + k for lane in range(8)])))
    return out


def _define_screen_row_dot(module, isa: str):
    """float @cpullm_screen_row_dot_v3_*(i8* row, i8* scales_row, i8* x16, i8* x8, i8* corr, i8* xs,
    i64 nsel, i64 nblocks): the compact dot product of one screen row.

    First the row's block factors f16(scale) * xs, 8 at a time, into a stack buffer; then blocks
    [0, nsel): int8 weights, int16 activations (x16), 32 bytes each (q8's block dot); then the
    4-bit blocks [nsel, nblocks) two at a time with int8 activations (x8, corr: pair order, see
    :func:`_pack_rest`), two pairs (one 64-byte line of the row) per loop step with one prefetch
    PREFETCH_BYTES ahead, a pair's factors as one vector (4 lanes each); an odd last pair, then an
    odd last block (its 16 bytes widened with zeros: activations and correction are zero there).
    One row at a time: two rows sharing the activation loads were faster from the caches but
    slower from DRAM.
    """
    name = "cpullm_screen_row_dot_v3_" + isa
    fn = module.globals.get(name)
    if fn is not None:
        return fn
    fn = ir.Function(module, ir.FunctionType(F32, [P8, P8, P8, P8, P8, P8, I64, I64]), name)
    fn.linkage = "internal"
    fn.attributes.add("alwaysinline")
    fn.attributes.add("nounwind")
    row, srow, x16, x8, corr, xs, nsel, nblk = fn.args
    zero = ir.Constant(V8F32, [0.0] * 8)
    v8i16 = ir.VectorType(I16, 8)
    v16i8 = ir.VectorType(I8, 16)
    v32i8 = ir.VectorType(I8, 32)
    fmuladd = declare(module, "llvm.fmuladd.v8f32", V8F32, [V8F32, V8F32, V8F32])

    b = ir.IRBuilder(fn.append_basic_block("entry"))
    bufp = b.bitcast(b.alloca(ir.ArrayType(F32, MAX_BLOCKS), name="factors"), F32.as_pointer())
    wsp = b.bitcast(srow, I16.as_pointer())
    xsp = b.bitcast(xs, F32.as_pointer())
    corrp = b.bitcast(corr, I32.as_pointer())
    rest0 = b.gep(row, [b.shl(nsel, const_i64(5))])            # first 4-bit byte
    npair = b.ashr(b.sub(nblk, nsel), const_i64(1))
    even_end = b.and_(npair, const_i64(-2))

    def factors(b, g, _):                                  # factors[g:g+8] = f16(scales) * xs
        h = b.load(b.bitcast(b.gep(wsp, [g]), v8i16.as_pointer()), align=2)
        xv = b.load(b.bitcast(b.gep(xsp, [g]), V8F32.as_pointer()), align=4)
        b.store(b.fmul(halves_to_floats(b, h), xv), b.bitcast(b.gep(bufp, [g]), V8F32.as_pointer()), align=4)
        return []

    b, _ = emit_counted_loop(fn, b, const_i64(0), nblk, SCALE_GROUP, [], factors, "factors")

    def int8_block(b, i, acc):                             # the few int8 blocks: one accumulator
        wp = b.gep(row, [b.shl(i, const_i64(5))])
        prefetch_ahead(b, module, wp)
        sums = block_dot_i32x8(b, module, wp, b.gep(x16, [b.shl(i, const_i64(6))]), isa != "generic")
        return [scaled_fma(b, module, sums, b.load(b.gep(bufp, [i])), acc[0])]

    b, (acc_sel,) = emit_counted_loop(fn, b, const_i64(0), nsel, 1, [zero], int8_block, "int8")

    def pair(b, q, acc, nib=None, lone=False):
        """Pair q of the 4-bit blocks (blocks nsel + 2q, + 1) into acc."""
        if nib is None:
            nib = b.load(b.bitcast(b.gep(rest0, [b.shl(q, const_i64(5))]), v32i8.as_pointer()), align=1)
        init = b.load(b.bitcast(b.gep(corrp, [b.shl(q, const_i64(3))]), V8I32.as_pointer()), align=4)
        sums = _nibble_pair_dot_i32x8(b, module, nib, b.gep(x8, [b.shl(q, const_i64(6))]), init, isa)
        i = b.add(nsel, b.shl(q, const_i64(1)))
        if lone:                                           # one block: lanes 4..7 are zero sums
            f = b.load(b.gep(bufp, [i]))
            fv = b.insert_element(ir.Constant(V8F32, ir.Undefined), f, ir.Constant(I32, 0))
            fv = b.shuffle_vector(fv, fv, ir.Constant(V8I32, [0] * 8))
        else:                                              # the pair's two factors, 4 lanes each
            two = b.load(b.bitcast(b.gep(bufp, [i]), ir.VectorType(F32, 2).as_pointer()), align=4)
            fv = b.shuffle_vector(two, two, ir.Constant(V8I32, [0, 0, 0, 0, 1, 1, 1, 1]))
        return b.call(fmuladd, [b.sitofp(sums, V8F32), fv, acc])

    def two_pairs(b, q, acc):                              # one 64-byte line of the row
        prefetch_ahead(b, module, b.gep(rest0, [b.shl(q, const_i64(5))]))
        return pair(b, q, acc[0]), pair(b, b.add(q, const_i64(1)), acc[1])

    b, (a0, a1) = emit_counted_loop(fn, b, const_i64(0), even_end, 2, [acc_sel, zero], two_pairs, "pairs")

    def lone_block(b, acc):
        half = b.load(b.bitcast(b.gep(rest0, [b.shl(npair, const_i64(5))]), v16i8.as_pointer()), align=1)
        widen = ir.Constant(ir.VectorType(I32, 32), list(range(32)))       # then 16 zero bytes
        nib = b.shuffle_vector(half, ir.Constant(v16i8, [0] * 16), widen)
        return pair(b, npair, acc, nib=nib, lone=True)

    odd_block = b.icmp_signed("<", b.add(nsel, b.shl(npair, const_i64(1))), nblk)
    b, a0 = emit_if(fn, b, b.icmp_signed("<", even_end, npair), a0, lambda b, acc: pair(b, even_end, acc), "odd_pair")
    b, a1 = emit_if(fn, b, odd_block, a1, lone_block, "lone_block")
    b.ret(hsum_v8f32(b, b.fadd(a0, a1)))
    return fn


def _screen_dot_typer(hq, hs, x16, x8, corr, x_s, n, nsel, nblk, isa):
    ok = (isinstance(hq, types.Array) and hq.dtype == types.int8 and hq.ndim == 2
          and isinstance(hs, types.Array) and hs.dtype == types.uint16 and hs.ndim == 2
          and isinstance(x16, types.Array) and x16.dtype == types.int16 and x16.ndim == 1
          and isinstance(x8, types.Array) and x8.dtype == types.int8 and x8.ndim == 1
          and isinstance(corr, types.Array) and corr.dtype == types.int32 and corr.ndim == 1
          and isinstance(x_s, types.Array) and x_s.dtype == types.float32 and x_s.ndim == 1
          and all(isinstance(v, types.Integer) for v in (n, nsel, nblk)))
    if not ok:
        return None
    sig = types.float32(hq, hs, x16, x8, corr, x_s, n, nsel, nblk)

    def codegen(context, builder, sig, args):
        aq, asc, *acts = (context.make_array(t)(context, builder, v) for t, v in zip(sig.args[:6], args[:6]))
        row, ns, nb = (context.cast(builder, args[k], sig.args[k], types.int64) for k in (6, 7, 8))
        qrow = builder.gep(builder.bitcast(aq.data, P8), [builder.mul(row, builder.extract_value(aq.strides, 0))])
        srow = builder.gep(builder.bitcast(asc.data, P8), [builder.mul(row, builder.extract_value(asc.strides, 0))])
        fn = _define_screen_row_dot(builder.module, isa)
        return builder.call(fn, [qrow, srow, *(builder.bitcast(a.data, P8) for a in acts), ns, nb])

    return sig, codegen


@intrinsic
def _screen_row_dot_vnni(typingctx, hq, hs, x16, x8, corr, x_s, n, nsel, nblk):
    """float32 compact dot of screen row n (nsel int8 blocks, then 4-bit ones up to nblk): AVX-512
    VNNI (``vpdpbusd`` on ymm). No bounds checks; hs rows and x_s padded to a multiple of 8 scales."""
    return _screen_dot_typer(hq, hs, x16, x8, corr, x_s, n, nsel, nblk, "vnni")


@intrinsic
def _screen_row_dot_avx2(typingctx, hq, hs, x16, x8, corr, x_s, n, nsel, nblk):
    """As _screen_row_dot_vnni (the same float32 result): AVX2 ``vpmaddubsw`` + ``vpmaddwd``."""
    return _screen_dot_typer(hq, hs, x16, x8, corr, x_s, n, nsel, nblk, "avx2")


@intrinsic
def _screen_row_dot_generic(typingctx, hq, hs, x16, x8, corr, x_s, n, nsel, nblk):
    """As _screen_row_dot_vnni (the same float32 result): portable IR."""
    return _screen_dot_typer(hq, hs, x16, x8, corr, x_s, n, nsel, nblk, "generic")


# ================================================================================================
# numba kernels
# ================================================================================================

ROW_PREFETCH = 4
"""Exact rows of a raw-block head (head_screen_blocks) are requested this many rows ahead of their
dot product (each row: its cache lines)."""


@intrinsic
def prefetch_row(typingctx, a, n):
    """Prefetch every 64-byte line of row n of the C-contiguous 2-D array ``a``."""
    if not (isinstance(a, types.Array) and a.ndim == 2 and isinstance(n, types.Integer)):
        return None
    sig = types.void(a, n)

    def codegen(context, builder, sig, args):
        arr = context.make_array(sig.args[0])(context, builder, args[0])
        row = context.cast(builder, args[1], sig.args[1], types.int64)
        stride = builder.extract_value(arr.strides, 0)
        start = builder.gep(builder.bitcast(arr.data, P8), [builder.mul(row, stride)])
        prefetch = declare(builder.module, "llvm.prefetch.p0", ir.VoidType(), [P8, I32, I32, I32])
        with cgutils.for_range_slice(builder, const_i64(0), stride, const_i64(64)) as (off, _):
            builder.call(prefetch, [builder.gep(start, [off]), ir.Constant(I32, 0), ir.Constant(I32, 3),
                                    ir.Constant(I32, 1)])
        return context.get_dummy_value()

    return sig, codegen


SCREEN_ISA = "vnni" if HAVE_VNNI256 else "avx2" if HAVE_AVX2 else "generic"
"""Which row routine the bounds pass compiles (every one gives the same float32 dot products)."""
_screen_dot = {"vnni": _screen_row_dot_vnni, "avx2": _screen_row_dot_avx2}.get(SCREEN_ISA, _screen_row_dot_generic)


@njit(cache=True)
def rest_pairs(Kp, k_sel):
    """Pairs of 4-bit blocks in a screen row (an odd last block counts as a pair)."""
    return ((Kp - k_sel) // QBLOCK + 1) // 2


@njit(cache=True, nogil=True)
def _pack_rest(p_q, k_sel, x8, corr):
    """The 4-bit blocks' int8 activations (p_q[k_sel:], values within +-127) in the order the row
    routine reads them, and their offset corrections. Pair q (blocks r = 2q, 2q + 1 of the rest):

        x8[64q + 32 half + 16 h + j] = value 16 half + j of block 2q + h     (0 past the last block)
        corr[8q + 4h + l] = -8 * (sum of values 4l..4l+3 and 16+4l..16+4l+3 of block 2q + h)

    x8 int8 (>= 64 * pairs), corr int32 (>= 8 * pairs)."""
    nrest = (p_q.size - k_sel) // QBLOCK
    for q in range(rest_pairs(p_q.size, k_sel)):
        for h in range(2):
            r = 2 * q + h
            base = k_sel + QBLOCK * r
            for half in range(2):
                for j in range(16):
                    x8[64 * q + 32 * half + 16 * h + j] = p_q[base + 16 * half + j] if r < nrest else 0
            for lane in range(4):
                t = 0
                if r < nrest:
                    for k in range(4):
                        t += np.int32(p_q[base + 4 * lane + k]) + np.int32(p_q[base + 16 + 4 * lane + k])
                corr[8 * q + 4 * h + lane] = -8 * t


@njit(cache=True)
def _rest_activations(p_q, k_sel):
    """(x8, corr) of :func:`_pack_rest`, freshly allocated (about 1 KB a token)."""
    npair = rest_pairs(p_q.size, k_sel)
    x8 = np.empty(64 * npair, np.int8)
    corr = np.empty(8 * npair, np.int32)
    _pack_rest(p_q, k_sel, x8, corr)
    return x8, corr


@njit(cache=True)
def permuted_activations(xp, p_q, p_s, sel_blocks):
    """What the compact rows read of the permuted activations xp (Kp,): p_q/p_s int16 blocks for
    the first sel_blocks (int8 blocks of the screen), int8 values for the rest (4-bit blocks), with
    their packed form (x8, corr); and, in float64, |xp_sel|^2, |xp_rest|^2 and delta = |xp - p|
    (the re-quantization error the bound adds). Shared by the q8 and raw-block screens."""
    Kp = xp.size
    k_sel = sel_blocks * QBLOCK
    quantize_act_q16(xp[:k_sel], p_q[:k_sel], p_s[:sel_blocks])            # int16 for the int8 blocks,
    quantize_row(xp[k_sel:], p_q[k_sel:], p_s[sel_blocks:Kp // QBLOCK], 127)   # int8 for the 4-bit ones
    x8, corr = _rest_activations(p_q, k_sel)
    s_sel, s_rest, s_d = 0.0, 0.0, 0.0
    for k in range(Kp):
        v = np.float64(xp[k])
        if k < k_sel:
            s_sel += v * v
        else:
            s_rest += v * v
        d = v - np.float64(np.float32(p_q[k]) * p_s[k // QBLOCK])
        s_d += d * d
    return x8, corr, s_sel, s_rest, np.sqrt(s_d)


@njit(cache=True)
def screen_dots(hq, hs, p_q, p_s, sel_blocks, out):
    """out[n] = the compact dot product of row n with permuted activations (p_q int16 (Kp,): the
    first sel_blocks blocks int16, the rest within +-127; p_s), as the bounds pass computes it
    (tests compare it with :func:`screen_dots_ref`)."""
    Kp = p_q.size
    k_sel = sel_blocks * QBLOCK
    for k in range(k_sel, Kp):
        if p_q[k] < -127 or p_q[k] > 127:
            raise ValueError("screen_dots: the 4-bit blocks' activations must lie within +-127")
    x8, corr = _rest_activations(p_q, k_sel)
    _dots_par(hq, hs, p_q, x8, corr, p_s, sel_blocks, out)


@njit(cache=True, parallel=True)
def _dots_par(hq, hs, p_q, x8, corr, p_s, sel_blocks, out):
    nblk = p_q.size // QBLOCK
    for n in prange(hq.shape[0]):
        out[n] = _screen_dot(hq, hs, p_q, x8, corr, p_s, n, sel_blocks, nblk)


@njit(cache=True, parallel=True)
def bounds_pass(hq, hs, hb, p_q, x8, corr, p_s, sel_blocks, n_sel, n_rest, extra, upper, lower_max, nthreads):
    """upper[n] = approx + bound of every row; lower_max[t] = the largest approx - bound of thread
    t's contiguous range of rows."""
    N = hq.shape[0]
    nblk = p_q.size // QBLOCK
    margin = np.float32(ROUNDING_MARGIN)
    per = (N + nthreads - 1) // nthreads
    for t in prange(nthreads):
        lo = min(N, t * per)
        hi = min(N, lo + per)
        m = np.float32(-np.inf)
        for n in range(lo, hi):
            a = _screen_dot(hq, hs, p_q, x8, corr, p_s, n, sel_blocks, nblk)
            bd = (hb[n, 0] * n_sel + hb[n, 1] * n_rest + hb[n, 2] * extra) * margin
            upper[n] = a + bd
            if a - bd > m:
                m = a - bd
        lower_max[t] = m


@njit(cache=True, parallel=True)
def _survivor_rows(upper, lower, rows, counts, nthreads):
    """Each thread, over its range of rows: the rows whose upper bound reaches ``lower`` go to
    rows[lo:], their number to counts[t]."""
    N = upper.size
    per = (N + nthreads - 1) // nthreads
    for t in prange(nthreads):
        lo = min(N, t * per)
        hi = min(N, lo + per)
        c = 0
        for n in range(lo, hi):
            if upper[n] >= lower:
                rows[lo + c] = n
                c += 1
        counts[t] = c


@njit(cache=True, parallel=True)
def _exact_rows(w_q, w_s, x_q, x_s, rows, vals, counts, nthreads):
    """vals[i] = the exact q8 logit of row rows[i] (``q8_panels.panel_row_dot``: what the
    lm_head's own kernel writes for it, bit for bit) for each thread's survivors."""
    N = rows.size
    per = (N + nthreads - 1) // nthreads
    for t in prange(nthreads):
        lo = min(N, t * per)
        for i in range(lo, lo + counts[t]):
            vals[i] = panel_row_dot(w_q, w_s, rows[i], x_q, x_s)


@njit(cache=True)
def screen_argmax(x, perm, sel_blocks, hq, hs, hb, w_q, w_s, x_q, x_s, p_q, p_s, xd, xp,
                  upper, rows, vals, lower_max, counts, nthreads, max_rows):
    """(token, survivors): the argmax (lowest index on ties) of the q8 logits ``w . x`` found
    through the screen, and how many rows were computed exactly. (-1, 0) when the bounds are not
    finite, (-2, survivors) when more than ``max_rows`` rows survive (out of order they would cost
    more than the plain matvec): the caller then runs the full lm_head.

    x float32 (K,); perm int64 (Kp,); w_q/w_s the lm_head's q8 panels (flat, q8_panels); x_q/p_q int16 (Kp,),
    x_s float32 (Kp//32,), p_s float32 (padded_blocks(Kp),), xd/xp float32 (Kp,), upper float32 (N,), rows int64 (N,),
    vals float32 (N,), lower_max float32 / counts int64 (>= nthreads,): scratch.
    """
    lower = screen_upper(x, perm, sel_blocks, hq, hs, hb, x_q, x_s, p_q, p_s, xd, xp, upper, lower_max, nthreads)
    if not np.isfinite(lower):
        return -1, 0
    _survivor_rows(upper, lower, rows, counts, nthreads)
    total = 0
    for t in range(nthreads):
        total += counts[t]
    if total > max_rows:
        return -2, total
    _exact_rows(w_q, w_s, x_q, x_s, rows, vals, counts, nthreads)
    return _best_survivor(rows, vals, counts, upper.size, nthreads), total


@njit(cache=True, inline="always")
def _best_survivor(rows, vals, counts, N, nthreads):
    """The row of the largest exact logit among the survivors (thread t's counts[t] rows from
    t * ceil(N / nthreads) on, rows ascending: strict > keeps the lowest index)."""
    per = (N + nthreads - 1) // nthreads
    best, best_v = -1, np.float32(0.0)
    for t in range(nthreads):
        lo = min(N, t * per)
        for i in range(lo, lo + counts[t]):
            if best < 0 or vals[i] > best_v:
                best, best_v = rows[i], vals[i]
    return best


# ================================================================================================
# several rows: a verify pass's greedy rows (cpullm.generate.speculative)
# ================================================================================================

ROWS_TILE = 32
"""Compact rows a multi-row bounds pass takes at a time (32 x ~600 bytes stay in L1): each tile is
read from memory once and scored against every activation row from the cache."""


def rows_scratch(M: int, N: int, Kp: int, threads: int) -> tuple:
    """The scratch of :func:`screen_argmax_rows` for up to M activation rows, an lm_head of N rows,
    padded width Kp and up to ``threads`` threads (numba's pool size: every thread t < nthreads
    writes lower_max[:, t] and counts[t]): (x_q, x_s, p_q, p_s, x8, corr, norms, xd, xp, upper,
    rows, vals, lower_max (M, threads), counts (threads,))."""
    nb, npair = Kp // QBLOCK, (Kp // QBLOCK + 1) // 2
    return (np.zeros((M, Kp), np.int16), np.zeros((M, nb), np.float32), np.zeros((M, Kp), np.int16),
            np.zeros((M, padded_blocks(Kp)), np.float32), np.zeros((M, 64 * npair), np.int8),
            np.zeros((M, 8 * npair), np.int32), np.zeros((M, 3), np.float32), np.zeros(Kp, np.float32),
            np.zeros(Kp, np.float32), np.zeros((M, N), np.float32), np.zeros(N, np.int64),
            np.zeros(N, np.float32), np.zeros((M, threads), np.float32), np.zeros(threads, np.int64))


@njit(cache=True, parallel=True)
def _bounds_pass_rows(hq, hs, hb, p_q, x8, corr, p_s, sel_blocks, norms, M, upper, lower_max, nthreads):
    """:func:`bounds_pass` for M activation rows at once: upper[m, n] = approx + bound of compact
    row n against activation row m, lower_max[m, t] = the largest approx - bound of thread t's
    rows. Each thread goes through its contiguous rows ROWS_TILE at a time and scores a tile
    against every activation row before the next (the compact head is read once)."""
    N = hq.shape[0]
    nblk = p_q.shape[1] // QBLOCK
    margin = np.float32(ROUNDING_MARGIN)
    per = (N + nthreads - 1) // nthreads
    for t in prange(nthreads):
        lo = min(N, t * per)
        hi = min(N, lo + per)
        for m in range(M):
            lower_max[m, t] = -np.inf
        for n0 in range(lo, hi, ROWS_TILE):
            n1 = min(hi, n0 + ROWS_TILE)
            for m in range(M):
                pq, xm, cm, ps = p_q[m], x8[m], corr[m], p_s[m]
                n_sel, n_rest, extra = norms[m, 0], norms[m, 1], norms[m, 2]
                best = lower_max[m, t]
                for n in range(n0, n1):
                    a = _screen_dot(hq, hs, pq, xm, cm, ps, n, sel_blocks, nblk)
                    bd = (hb[n, 0] * n_sel + hb[n, 1] * n_rest + hb[n, 2] * extra) * margin
                    upper[m, n] = a + bd
                    if a - bd > best:
                        best = a - bd
                lower_max[m, t] = best


@njit(cache=True)
def screen_argmax_rows(X, M, perm, sel_blocks, hq, hs, hb, w_q, w_s, x_q, x_s, p_q, p_s, x8, corr, norms,
                       xd, xp, upper, rows, vals, lower_max, counts, tokens, nthreads, max_rows):
    """Each of M rows' greedy token through the screen, the compact head read once for all of
    them: tokens[m] = the argmax (lowest index on ties) of the q8 logits ``w . X[m]``, as
    :func:`screen_argmax` gives it for X[m] alone (the same bounds, the same exact rows). Returns
    the rows computed exactly (all M rows' survivors), or -1 when some row's bounds are not
    finite, -2 when some row leaves more than ``max_rows`` rows to compute: the caller then runs
    the full lm_head for all of them.

    X float32 (>= M, K) (C-contiguous); the rest as :func:`screen_argmax` and :func:`rows_scratch`
    (per activation row m: x_q[m], x_s[m], p_q[m], p_s[m], x8[m], corr[m], norms[m], upper[m]);
    tokens int64 (>= M,). nthreads <= the ``threads`` the scratch was made for."""
    Kp = perm.size
    for m in range(M):
        quantize_act_q16(X[m], x_q[m], x_s[m])          # exactly what the matvec reads
        for k in range(Kp):
            xd[k] = np.float32(x_q[m, k]) * x_s[m, k // QBLOCK]
        for k in range(Kp):
            xp[k] = xd[perm[k]]
        x8m, cm, s_sel, s_rest, delta = permuted_activations(xp, p_q[m], p_s[m], sel_blocks)
        x8[m, :x8m.size] = x8m
        corr[m, :cm.size] = cm
        norms[m, 0] = np.float32(np.sqrt(s_sel))
        norms[m, 1] = np.float32(np.sqrt(s_rest))
        norms[m, 2] = np.float32(delta + rounding_term(Kp) * np.sqrt(s_sel + s_rest))
    _bounds_pass_rows(hq, hs, hb, p_q, x8, corr, p_s, sel_blocks, norms, M, upper, lower_max, nthreads)
    N = hq.shape[0]
    total = 0
    for m in range(M):
        lower = lower_max[m, 0]
        for t in range(1, nthreads):
            lower = max(lower, lower_max[m, t])
        if not np.isfinite(lower):
            return -1
        _survivor_rows(upper[m], lower, rows, counts, nthreads)
        found = 0
        for t in range(nthreads):
            found += counts[t]
        if found > max_rows:
            return -2
        total += found
        _exact_rows(w_q, w_s, x_q[m], x_s[m], rows, vals, counts, nthreads)
        tokens[m] = _best_survivor(rows, vals, counts, N, nthreads)
    return total


# ================================================================================================
# sampled decoding's entry points: every row's upper bound, then exact logits of chosen rows
# ================================================================================================

@njit(cache=True)
def screen_upper(x, perm, sel_blocks, hq, hs, hb, x_q, x_s, p_q, p_s, xd, xp, upper, lower_max, nthreads):
    """The bounds pass of :func:`screen_argmax` alone, for a sampled step (cpullm_kernels.ops.sample's
    ``sample_screened`` decides which rows it needs exactly): fills upper (N,) with every row's
    upper bound on its q8 logit and x_q/x_s with the activations the exact rows read
    (:func:`exact_logits`); returns the largest lower bound (float32; not finite: the bounds
    are of no use, run the full head). Arguments as :func:`screen_argmax`'s."""
    quantize_act_q16(x, x_q, x_s)                       # exactly what the matvec reads
    for k in range(perm.size):
        xd[k] = np.float32(x_q[k]) * x_s[k // QBLOCK]
    for k in range(perm.size):
        xp[k] = xd[perm[k]]
    return permuted_bounds(xp, p_q, p_s, sel_blocks, hq, hs, hb, False, upper, lower_max, nthreads)


@njit(cache=True)
def permuted_bounds(xp, p_q, p_s, sel_blocks, hq, hs, hb, delta_in_rounding, upper, lower_max, nthreads):
    """The bounds pass on activations already dequantized and permuted (xp float32 (Kp,)): fills
    upper (N,) with every row's upper bound and returns the largest lower bound. The compact rows'
    error margin is ``delta + rounding * sqrt(s_sel + s_rest)``; with ``delta_in_rounding`` (the
    k-quant screen, whose exact rows read int8 activations) the rounding term also scales delta."""
    Kp = xp.size
    x8, corr, s_sel, s_rest, delta = permuted_activations(xp, p_q, p_s, sel_blocks)   # what the compact rows read
    spread = np.sqrt(s_sel + s_rest)
    if delta_in_rounding:
        spread = spread + delta
    extra = delta + rounding_term(Kp) * spread
    bounds_pass(hq, hs, hb, p_q, x8, corr, p_s, sel_blocks, np.float32(np.sqrt(s_sel)), np.float32(np.sqrt(s_rest)),
                 np.float32(extra), upper, lower_max, nthreads)
    lower = lower_max[0]
    for t in range(1, nthreads):
        lower = max(lower, lower_max[t])
    return lower


@njit(cache=True, parallel=True)
def exact_logits(w_q, w_s, x_q, x_s, rows, start, stop, vals):
    """vals[i] = the exact q8 logit of row rows[i] for start <= i < stop (``panel_row_dot``: what
    the lm_head's kernel writes for it, bit for bit), after :func:`screen_upper` filled x_q/x_s."""
    for i in prange(start, stop):
        vals[i] = panel_row_dot(w_q, w_s, rows[i], x_q, x_s)
