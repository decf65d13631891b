"""Decode matvec over raw GGUF blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K).

    out (N,) = W (N, K) @ x (K,),   W = the GGUF tensor's bytes as they are: uint8 (N, row bytes)

The weights are read in their own block format (layouts: :mod:`cpullm_kernels.rows.gguf_blocks`),
never requantized. The activation vector is quantized per block of 32 to **int8**
(:func:`quantize_act_q8`):

    x_q int8 (K,)         q = rint(v / d), d = max|v| / 127 per block of 32 (q8.quantize_row)
    x_s float32 (K / 32,) d
    x_m float32 (K / 16,) x_s[i // 2] * sum(x_q[16 i:16 i + 16])   (the offsets' partner, below)

Why int8 and not the int16 of the q8 kernel (``q8_panels``): a 4-bit block carries twice the multiply-adds
per byte read that an 8-bit one does, so the arithmetic per byte, not the read, decides whether
decode stays at the memory wall. With int8 activations one ``vpmaddubsw`` + ``vpmaddwd`` (AVX2)
or one ``vpdpbusd`` (AVX-512 VNNI, 64 weights a zmm) covers 32 weights whose quants are unpacked
as unsigned bytes; int16 activations would need the nibbles widened to int16 and two
``vpmaddwd`` per 32. The rounding is ggml's own for Q4_0/Q5_0/Q8_0 (its Q8_0 activations, one
scale per 32) and finer than its K-quant path (Q8_K: one scale per 256), and at 4-6 bits the
weights' own error is 8-30x the activations' (1/254 of a block's largest value).

Every format is reduced to the same arithmetic: per block of 32 weights, unsigned quants
q (0..63, one byte each), a per-lane factor f (weight scale x activation scale, for the 4-value
lane groups of the int32 sums) and an offset o per (sub-)block:

    w = a * q + c    ->   sum_j w_j x_j = f * sum_j q_j x_q[j]  +  c * (x_s * sum_j x_q[j])

The first term is the integer dot product (exact in int32: |q| <= 63 keeps vpmaddubsw's int16
pairs below 2 * 63 * 127), the second uses ``x_m`` (the activation block sums, once per token),
so the offsets of Q4_0 (-8 d), Q5_0 (-16 d), Q4_1/Q5_1 (+m), Q4_K/Q5_K (-dmin mn) and Q6_K
(-32 d sc) cost one multiply-add per block or per 8 sub-blocks, not per weight. Q8_0's quants
are signed: its AVX2 / VNNI dots take |q| and x with q's sign (``vpsignb``), the generic one
multiplies signed values. Float32 sums across blocks, two accumulators (even / odd blocks).

ISA variants (``ISAS``), each compiled only on a CPU that runs it, all against the same numpy
reference (:func:`matvec_ref`):

* ``vnni512`` (AVX-512 F/BW/VL + VNNI): K-quants, and Q4_0 / Q4_1 / Q5_0 / Q5_1 taken 8 blocks
  at a time (``_Legacy8``), two 32-weight blocks per ``vpdpbusd`` on zmm, 16 float lanes; Q8_0
  and the last K/32 % 8 blocks of a row one block per ymm ``vpdpbusd``.
* ``avx2`` (AVX2 + FMA): ``vpmaddubsw`` + ``vpmaddwd`` by ones per block, ymm; the K-quants two
  blocks per ``vpmaddwd`` and float step after one ``vphaddw`` (``_avx2_pair``).
* ``generic``: portable LLVM IR (widen, multiply, add); what LLVM makes of it for the host.

Each row's dot product is an LLVM IR routine inlined into a numba ``prange`` over rows (static
schedule: one contiguous range of rows per thread), with a software prefetch llvm_ir.PREFETCH_BYTES
ahead in the weight stream.

Entry points (``fmt`` is the ggml type number):

    quantize_act_q8(x (K,), x_q (K,), x_s (K//32,), x_m (K//16,))     @njit, serial, in place
    matvec(fmt, w (N, row bytes) uint8, x_q, x_s, x_m, out (N,))       the best ISA of this CPU
    matvec_on(isa, fmt, ...)                                           one ISA
    matvec_at(fmt, ...)                                                matvec from @njit code
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from ..setup import numba_setup
from ..setup.addressed import Addressed
from ..setup.operand_types import ARENA, array
from .gguf_blocks import BY_TYPE, FORMATS, dequantize_ref
from .llvm_ir import (F32, HALF_IN_HARDWARE, I8, I16, I32, I64, P8, PREFETCH_BYTES, const_i64, declare,
                      emit_counted_loop, emit_if, half_to_float_ir, half_to_float_ir_fresh, hsum_v8f32)
from .q8 import quantize_blocks_ref, quantize_row

ISA_GENERIC, ISA_AVX2, ISA_VNNI512, ISA_AVXVNNI = 0, 1, 2, 3
ISA_NAMES = {ISA_GENERIC: "generic", ISA_AVX2: "avx2", ISA_VNNI512: "vnni512", ISA_AVXVNNI: "avxvnni"}

HAVE_AVX2 = numba_setup.HOST_IS_X86 and {"avx2", "fma"} <= numba_setup.HOST_FEATURES
HAVE_AVXVNNI = HAVE_AVX2 and "avxvnni" in numba_setup.HOST_FEATURES
HAVE_VNNI512 = numba_setup.HOST_IS_X86 and {"avx512f", "avx512bw", "avx512vl", "avx512vnni"} <= numba_setup.HOST_FEATURES
ISAS = ([ISA_GENERIC] + ([ISA_AVX2] if HAVE_AVX2 else []) + ([ISA_AVXVNNI] if HAVE_AVXVNNI else [])
        + ([ISA_VNNI512] if HAVE_VNNI512 else []))
"""The ISA variants this CPU runs (generic always), best last: AVX-VNNI's VEX ``vpdpbusd`` on ymm
is the best on CPUs that have it and no AVX-512 (Intel's client CPUs)."""
BEST_ISA = ISAS[-1]

# ggml type numbers of the formats (gguf_blocks.FORMATS), as plain ints for jitted code
Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K = (FORMATS[n].ggml_type for n in
                                                  ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"))
SUPPORTED = tuple(sorted(BY_TYPE))

# ================================================================================================
# activations and numpy references
# ================================================================================================


@njit(cache=True, nogil=True)
def quantize_act_q8(x, x_q, x_s, x_m):
    """x float32 (K,) -> x_q int8 (K,), x_s float32 (K // 32,), x_m float32 (K // 16,) in place.

    K a multiple of 32 (every GGUF block format's rows are). x_m[i] = x_s[i // 2] * the sum of
    x_q's 16 values from 16 i (exact integer sum, one float product).
    """
    K = x.size
    if K % 32 != 0 or x_q.size != K or x_s.size * 32 != K or x_m.size * 16 != K:
        raise ValueError("quantize_act_q8: need K % 32 == 0, x_q (K,), x_s (K//32,), x_m (K//16,)")
    quantize_row(x, x_q, x_s, 127)
    for i in range(x_m.size):
        s = 0
        for j in range(16):
            s += np.int32(x_q[16 * i + j])
        x_m[i] = np.float32(s) * x_s[i // 2]


QUANTIZE_ACT_Q8 = Addressed(quantize_act_q8, types.none, [
    (array(types.float32, layout=lay), array(types.int8), ARENA, ARENA) for lay in ("C", "A")])
""":func:`quantize_act_q8` as formats.matmul_rows and kquant_gemm's short prompts call it for each
row, through its address (cpullm_kernels.setup.addressed), so it compiles once, not in each caller."""
quantize_act_q8_at = QUANTIZE_ACT_Q8.call


def quantize_act_q8_ref(x):
    """numpy reference of :func:`quantize_act_q8`: x (K,) -> (x_q int8, x_s float32, x_m float32)."""
    x = np.asarray(x, np.float32)
    q, s = quantize_blocks_ref(x.reshape(1, -1), 127, False)
    x_q = q[0].astype(np.int8)
    x_s = s[0].astype(np.float32)
    sums = x_q.astype(np.int32).reshape(-1, 16).sum(1).astype(np.float32)
    return x_q, x_s, (sums * np.repeat(x_s, 2)).astype(np.float32)


def matvec_ref(w, fmt, shape, x_q, x_s):
    """numpy reference (float64 result): dequantize_ref(w) @ (x_q * x_s per block)."""
    deq = dequantize_ref(w, fmt, shape).astype(np.float64)
    x = x_q.astype(np.float64) * np.repeat(x_s.astype(np.float64), 32)
    return deq @ x


# ================================================================================================
# LLVM IR: per-format unpacking
# ================================================================================================

_I1 = ir.IntType(1)


def _vec(t, n):
    return ir.VectorType(t, n)


def _splat_c(t, n, v):
    return ir.Constant(_vec(t, n), [v] * n)


def _idx(*ix):
    return ir.Constant(_vec(I32, len(ix)), list(ix))


def _load(b, p, off, ty):
    """Unaligned load of ``ty`` at byte offset ``off`` (int or i64 value) of the i8* p."""
    off = const_i64(off) if isinstance(off, int) else off
    return b.load(b.bitcast(b.gep(p, [off]), ty.as_pointer()), align=1)


def _f16_at(b, p, off):
    """float32 of the binary16 at byte offset ``off`` of p."""
    return half_to_float_ir_fresh(b, _load(b, p, off, I16))


def _splat(b, scalar, n):
    v = b.insert_element(ir.Constant(_vec(scalar.type, n), ir.Undefined), scalar, ir.Constant(I32, 0))
    return b.shuffle_vector(v, v, _idx(*([0] * n)))


def _lanes(b, v, ix):
    """shuffle of one vector: out[i] = v[ix[i]]."""
    return b.shuffle_vector(v, v, _idx(*ix))


def _concat(b, a, c):
    n = a.type.count
    return b.shuffle_vector(a, c, _idx(*range(2 * n)))


def _nibbles16(b, qs):
    """<16 x i8> bytes -> <32 x i8> (low nibbles, then high nibbles): the 32-weight formats' quants."""
    lo = b.and_(qs, _splat_c(I8, 16, 15))
    hi = b.lshr(qs, _splat_c(I8, 16, 4))
    return _concat(b, lo, hi)


def _bits32_to_16s(b, p, off):
    """The little-endian 32-bit word at p + off -> <32 x i8>: 16 where bit j is set, else 0."""
    qh = _load(b, p, off, _vec(I8, 4))
    spread = _lanes(b, qh, [j // 8 for j in range(32)])
    sel = b.and_(spread, ir.Constant(_vec(I8, 32), [1 << (j % 8) for j in range(32)]))
    return b.select(b.icmp_unsigned("!=", sel, _splat_c(I8, 32, 0)), _splat_c(I8, 32, 16), _splat_c(I8, 32, 0))


class _Group:
    """What a format's routine computed for one group (block of the file format: 32 or 256
    weights): ``factors`` (a float vector), ``offset`` (<8 x float> to add to the offset sum),
    anything else the block unpacker needs."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


class _Format:
    """IR emitters of one block format. G: 32-weight blocks per file block (1 or 8)."""

    G = 1
    signed = False

    def __init__(self, fmt):
        self.fmt = fmt
        self.bytes = fmt.block_bytes

    def group(self, b, gp, xs, xm):
        """``gp``: i8* the file block; ``xs`` / ``xm``: float* x_s / x_m at this group's first
        32- / 16-block. Returns a _Group."""
        raise NotImplementedError

    def quants(self, b, st, gp, j):
        """<32 x i8> unsigned quants (signed for Q8_0) of 32-weight block j of the group."""
        raise NotImplementedError

    def factor(self, b, st, j):
        """<8 x float>: lane i multiplies the int32 sum of weights 4i .. 4i + 3 of block j."""
        return _lanes(b, st.factors, [j] * 8)


def _xm32(b, xm, n):
    """<n x float>: the n 32-block sums x_m[2i] + x_m[2i + 1] from the float* xm."""
    v = b.load(b.bitcast(xm, _vec(F32, 2 * n).as_pointer()), align=4)
    return b.fadd(_lanes(b, v, list(range(0, 2 * n, 2))), _lanes(b, v, list(range(1, 2 * n, 2))))


def _offset_vec(b, scalar):
    """<8 x float> with ``scalar`` in lane 0, zeros elsewhere (an offset sum's contribution)."""
    return b.insert_element(ir.Constant(_vec(F32, 8), [0.0] * 8), scalar, ir.Constant(I32, 0))


class _Legacy(_Format):
    """Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0: one scale d (and a min m) per block of 32."""

    def __init__(self, fmt, has_min, qs_off, qh_off, bias):
        super().__init__(fmt)
        self.has_min, self.qs_off, self.qh_off, self.bias = has_min, qs_off, qh_off, bias

    def group(self, b, gp, xs, xm):
        d = _f16_at(b, gp, 0)
        factors = _splat(b, b.fmul(d, b.load(xs, align=4)), 8)
        xsum = _xm32(b, xm, 1)
        xsum = b.extract_element(xsum, ir.Constant(I32, 0))
        if self.has_min:            # w = d q + m
            off = b.fmul(_f16_at(b, gp, 2), xsum)
        elif self.bias:             # w = d (q - bias)
            off = b.fmul(b.fmul(d, ir.Constant(F32, -float(self.bias))), xsum)
        else:
            off = None
        return _Group(factors=factors, offset=None if off is None else _offset_vec(b, off))

    def quants(self, b, st, gp, j):
        if self.signed:
            return _load(b, gp, self.qs_off, _vec(I8, 32))
        q = _nibbles16(b, _load(b, gp, self.qs_off, _vec(I8, 16)))
        if self.qh_off is not None:
            q = b.or_(q, _bits32_to_16s(b, gp, self.qh_off))
        return q

    def factor(self, b, st, j):
        return st.factors


class _Q8_0(_Legacy):
    signed = True

    def __init__(self, fmt):
        super().__init__(fmt, False, 2, None, 0)


def _halves8(b, gp, offs):
    """<8 x float> of the binary16 values at byte offsets ``offs`` of gp (one vcvtph2ps on x86
    with F16C: the 8 bits gathered through GPRs into a vector written whole, as
    llvm_ir.half_to_float_ir_fresh does for one value)."""
    v = ir.Constant(_vec(I16, 8), [0] * 8)
    for i, off in enumerate(offs):
        v = b.insert_element(v, _load(b, gp, off, I16), ir.Constant(I32, i))
    if HALF_IN_HARDWARE and numba_setup.HOST_IS_X86:
        cvt = ir.InlineAsm(ir.FunctionType(_vec(F32, 8), [_vec(I16, 8)]), "vcvtph2ps $1, $0", "=x,x")
        return b.call(cvt, [v])
    out = ir.Constant(_vec(F32, 8), [0.0] * 8)
    for i in range(8):
        out = b.insert_element(out, half_to_float_ir(b, b.extract_element(v, ir.Constant(I32, i))),
                               ir.Constant(I32, i))
    return out


class _Legacy8(_Format):
    """Eight consecutive blocks of a 32-weight format as one group (256 weights), as the K-quants
    go: the 8 scales (and mins) in one vcvtph2ps, one <8 x float> of factors and one of offsets
    per 8 blocks instead of a scalar conversion, splat and offset per block; on vnni512 two blocks
    per zmm vpdpbusd. The per-block scalar work, not the dot products, bounded the one-block loop:
    grouping took Q4_1 on one thread from 7.5 to 13.4 G weights/s
    (benchmarks/results/2026-12-04-kquant-speed.md). The row's last K/32 % 8 blocks go through the
    one-block routine (``one``); the sums' order changes (per-lane float accumulators over groups),
    so results differ from the one-block loop's in the last bits, within the tests' tolerance."""

    G = 8

    def __init__(self, one):
        super().__init__(one.fmt)
        self.one = one
        self.bytes = 8 * one.bytes
        self.signed = one.signed

    def group(self, b, gp, xs, xm):
        one, bb = self.one, self.one.bytes
        d = _halves8(b, gp, [bb * i for i in range(8)])
        xsv = b.load(b.bitcast(xs, _vec(F32, 8).as_pointer()), align=4)
        factors = b.fmul(d, xsv)
        if one.has_min:             # w = d q + m
            offset = b.fmul(_halves8(b, gp, [bb * i + 2 for i in range(8)]), _xm32(b, xm, 8))
        elif one.bias:              # w = d (q - bias)
            offset = b.fmul(b.fmul(d, _splat_c(F32, 8, -float(one.bias))), _xm32(b, xm, 8))
        else:
            offset = None
        return _Group(factors=factors, offset=offset)

    def quants(self, b, st, gp, j):
        return self.one.quants(b, st, b.gep(gp, [const_i64(self.one.bytes * j)]), 0)

    def pair_vnni(self, b, st, gp, j):
        """(<64 x i8> quants, <16 x float> factors) of blocks j, j + 1 for one zmm vpdpbusd, or
        None. Q4_0 / Q4_1 only: the 16 bytes of each block twice, masked to the low nibbles
        (weights 0..15) and to the high ones in place (16 q, weights 16..31), whose int32 sums
        the factor / 16 (a power of two: the same float product) scales back: one byte shuffle
        and one AND for 64 weights instead of two shifts, two ANDs and three inserts. The lane
        layout and every product equal the quants() path's (results identical). vpdpbusd only:
        16 q x 127 overflows vpmaddubsw's int16 pairs, not vpdpbusd's int32 (4 x 240 x 128)."""
        one = self.one
        if one.qh_off is not None or one.signed:
            return None
        qa = _load(b, gp, one.bytes * j + one.qs_off, _vec(I8, 16))
        qb = _load(b, gp, one.bytes * (j + 1) + one.qs_off, _vec(I8, 16))
        z = b.shuffle_vector(qa, qb, _idx(*(list(range(16)) * 2 + list(range(16, 32)) * 2)))
        q = b.and_(z, ir.Constant(_vec(I8, 64), ([15] * 16 + [0xF0] * 16) * 2))
        if not hasattr(st, "factors16"):          # [f, f / 16], once per group
            st.factors16 = _concat(b, st.factors, b.fmul(st.factors, _splat_c(F32, 8, 1.0 / 16)))
        f = _lanes(b, st.factors16, [j] * 4 + [8 + j] * 4 + [j + 1] * 4 + [9 + j] * 4)
        return q, f


def _k_scales_mins(b, gp):
    """The 12-byte scales field of Q4_K / Q5_K at gp + 4 -> (sc, mn) <8 x i32> (6 bits each)."""
    s = _load(b, gp, 4, _vec(I8, 16))            # bytes 4..19 of the block: scales + 4 bytes of qh/qs

    def pick(ix):
        return b.zext(_lanes(b, s, ix), _vec(I32, 8))

    def c(vals):
        return ir.Constant(_vec(I32, 8), vals)

    top2 = lambda v: b.and_(b.shl(b.lshr(v, c([6] * 8)), c([4] * 8)), c([0] * 4 + [0x30] * 4))  # noqa: E731
    lo = [0, 1, 2, 3, 8, 9, 10, 11]
    sc = b.or_(b.and_(pick(lo), c([63] * 4 + [15] * 4)), top2(pick([0, 1, 2, 3, 0, 1, 2, 3])))
    mraw = pick([4, 5, 6, 7, 8, 9, 10, 11])
    mn = b.or_(b.and_(b.lshr(mraw, c([0] * 4 + [4] * 4)), c([63] * 4 + [15] * 4)), top2(pick([4, 5, 6, 7] * 2)))
    return sc, mn


class _QK(_Format):
    """Q4_K / Q5_K: 8 sub-blocks of 32, w = (d sc) q - (dmin mn)."""

    G = 8

    def __init__(self, fmt, qh_off, qs_off):
        super().__init__(fmt)
        self.qh_off, self.qs_off = qh_off, qs_off

    def group(self, b, gp, xs, xm):
        v8f = _vec(F32, 8)
        sc, mn = _k_scales_mins(b, gp)
        d, dmin = _f16_at(b, gp, 0), _f16_at(b, gp, 2)
        xsv = b.load(b.bitcast(xs, v8f.as_pointer()), align=4)
        factors = b.fmul(b.fmul(_splat(b, d, 8), b.uitofp(sc, v8f)), xsv)
        mins = b.fmul(_splat(b, b.fneg(dmin), 8), b.uitofp(mn, v8f))
        return _Group(factors=factors, offset=b.fmul(mins, _xm32(b, xm, 8)))

    def quants(self, b, st, gp, j):
        qs = _load(b, gp, self.qs_off + 32 * (j // 2), _vec(I8, 32))
        q = b.and_(qs, _splat_c(I8, 32, 15)) if j % 2 == 0 else b.lshr(qs, _splat_c(I8, 32, 4))
        if self.qh_off is not None:                 # bit j of qh[l] is bit 4 of weight 32 j + l
            qh = _load(b, gp, self.qh_off, _vec(I8, 32))
            hb = b.shl(qh, _splat_c(I8, 32, 4 - j)) if j < 4 else b.lshr(qh, _splat_c(I8, 32, j - 4))
            q = b.or_(q, b.and_(hb, _splat_c(I8, 32, 16)))
        return q


class _Q6_K(_Format):
    """Q6_K: 16 sub-blocks of 16, w = (d sc) (q - 32), q 6 bits from ql (4) and qh (2)."""

    G = 8

    def group(self, b, gp, xs, xm):
        v16f = _vec(F32, 16)
        d = _f16_at(b, gp, 208)
        dsc = b.fmul(_splat(b, d, 16), b.sitofp(_load(b, gp, 192, _vec(I8, 16)), v16f))   # (16,)
        xsv = b.load(b.bitcast(xs, _vec(F32, 8).as_pointer()), align=4)
        factors = b.fmul(dsc, _lanes(b, xsv, [i // 2 for i in range(16)]))
        xmv = b.load(b.bitcast(xm, v16f.as_pointer()), align=4)
        t = b.fmul(dsc, xmv)
        t8 = b.fadd(_lanes(b, t, list(range(8))), _lanes(b, t, list(range(8, 16))))
        return _Group(factors=factors, offset=b.fmul(t8, _splat_c(F32, 8, -32.0)))

    def quants(self, b, st, gp, j):
        h, k = divmod(j, 4)
        ql = _load(b, gp, 64 * h + 32 * (k % 2), _vec(I8, 32))
        low = b.and_(ql, _splat_c(I8, 32, 15)) if k < 2 else b.lshr(ql, _splat_c(I8, 32, 4))
        qh = _load(b, gp, 128 + 32 * h, _vec(I8, 32))
        sh = 4 - 2 * k                              # bits 2k, 2k+1 of qh -> bits 4, 5
        hb = b.shl(qh, _splat_c(I8, 32, sh)) if sh >= 0 else b.lshr(qh, _splat_c(I8, 32, -sh))
        return b.or_(low, b.and_(hb, _splat_c(I8, 32, 0x30)))

    def factor(self, b, st, j):
        return _lanes(b, st.factors, [2 * j] * 4 + [2 * j + 1] * 4)


_FORMATS_IR = {
    Q8_0: _Q8_0(FORMATS["Q8_0"]),
    Q4_0: _Legacy(FORMATS["Q4_0"], False, 2, None, 8),
    Q4_1: _Legacy(FORMATS["Q4_1"], True, 4, None, 0),
    Q5_0: _Legacy(FORMATS["Q5_0"], False, 6, 2, 16),
    Q5_1: _Legacy(FORMATS["Q5_1"], True, 8, 4, 0),
    Q4_K: _QK(FORMATS["Q4_K"], None, 16),
    Q5_K: _QK(FORMATS["Q5_K"], 16, 48),
    Q6_K: _Q6_K(FORMATS["Q6_K"]),
}
_WIDE_IR = {f: _Legacy8(_FORMATS_IR[f]) for f in (Q4_0, Q4_1, Q5_0, Q5_1)}
"""The 32-weight formats whose rows go 8 blocks per group (Q8_0 stays one block per step: its
signed dot takes one block per instruction, and it is mapped to cpullm's INT8 layout anyway)."""


# ================================================================================================
# LLVM IR: the integer dot product of a step (one or two blocks of 32) per ISA
# ================================================================================================

def _dot(b, module, q, x, isa, signed):
    """<32W x i8> quants q (unsigned 0..63, or signed) . <32W x i8> x -> <8W x i32>, lane i the
    sum of the products 4i .. 4i + 3."""
    n = q.type.count
    if isa == ISA_GENERIC:
        v = _vec(I32, n)
        p = b.mul(b.sext(q, v) if signed else b.zext(q, v), b.sext(x, v))
        p = b.add(_lanes(b, p, list(range(0, n, 2))), _lanes(b, p, list(range(1, n, 2))))
        return b.add(_lanes(b, p, list(range(0, n // 2, 2))), _lanes(b, p, list(range(1, n // 2, 2))))
    v32i8 = _vec(I8, 32)
    if signed:                                  # |q| . (x with q's sign): exact for q = -128 too
        if n != 32:
            raise ValueError("signed quants go one block at a time")
        sign = declare(module, "llvm.x86.avx2.psign.b", v32i8, [v32i8, v32i8])
        x = b.call(sign, [x, q])
        q = b.select(b.icmp_signed("<", q, _splat_c(I8, 32, 0)), b.sub(_splat_c(I8, 32, 0), q), q)
    if isa == ISA_AVX2:
        maddubs = declare(module, "llvm.x86.avx2.pmadd.ub.sw", _vec(I16, 16), [v32i8, v32i8])
        maddwd = declare(module, "llvm.x86.avx2.pmadd.wd", _vec(I32, 8), [_vec(I16, 16)] * 2)
        return b.call(maddwd, [b.call(maddubs, [q, x]), _splat_c(I16, 16, 1)])
    vi = _vec(I32, n // 4)     # AVX-VNNI (n = 32): LLVM selects the VEX form without AVX-512
    dpbusd = declare(module, f"llvm.x86.avx512.vpdpbusd.{8 * n}", vi, [vi, vi, vi])
    return b.call(dpbusd, [ir.Constant(vi, [0] * (n // 4)), b.bitcast(q, vi), b.bitcast(x, vi)])


def _avx2_pair(b, module, F, st, gp, j, xq, blk0):
    """AVX2, unsigned quants: blocks j, j + 1 of a 256-weight group -> (<8 x i32> sums, <8 x float>
    factors), one ``vpmaddwd`` and one float step for the two blocks instead of one each:
    vpmaddubsw per block (int16 pairs <= 2 x 63 x 127), vphaddw of the two (<= 32004: exact in
    int16 for quants up to 6 bits), vpmaddwd by ones. Lane l of the sums holds 8 weights: per
    128-bit half h, lanes 4h, 4h + 1 block j's weights 16h .. 16h + 15, lanes 4h + 2, 4h + 3
    block j + 1's; the factors follow (each old lane pair shares one factor, Q6_K's 16-weight
    sub-blocks included)."""
    v32i8, v16i16 = _vec(I8, 32), _vec(I16, 16)
    maddubs = declare(module, "llvm.x86.avx2.pmadd.ub.sw", v16i16, [v32i8, v32i8])
    maddwd = declare(module, "llvm.x86.avx2.pmadd.wd", _vec(I32, 8), [v16i16] * 2)
    haddw = declare(module, "llvm.x86.avx2.phadd.w", v16i16, [v16i16] * 2)
    m = []
    for e in range(2):
        x = _load(b, xq, b.shl(b.add(blk0, const_i64(j + e)), const_i64(5)), v32i8)
        m.append(b.call(maddubs, [F.quants(b, st, gp, j + e), x]))
    sums = b.call(maddwd, [b.call(haddw, m), _splat_c(I16, 16, 1)])
    f = b.shuffle_vector(F.factor(b, st, j), F.factor(b, st, j + 1), _idx(0, 2, 8, 10, 4, 6, 12, 14))
    return sums, f


def _hsum(b, v):
    if v.type.count == 16:
        v = b.fadd(_lanes(b, v, list(range(8))), _lanes(b, v, list(range(8, 16))))
    return hsum_v8f32(b, v)


def _define_row_dot(module, fmt_id: int, isa: int):
    """float @cpullm_kq_row_dot_<fmt>_<isa>(i8* w_row, i8* x_q, i8* x_s, i8* x_m, i64 nblocks).

    One row of file blocks against the quantized activations (module docstring). Step width W
    (32-weight blocks per integer dot): 2 for the 256-weight groups (K-quants, and Q4_0 / Q4_1 /
    Q5_0 / Q5_1 eight blocks at a time: ``_Legacy8``) on vnni512 (zmm), else 1. Q8_0, and the
    last K/32 % 8 blocks of the other 32-weight formats, go two file blocks per loop step (even /
    odd accumulators) with an odd tail.
    """
    F1 = _FORMATS_IR[fmt_id]
    wide = _WIDE_IR.get(fmt_id)
    name = f"cpullm_kq_row_dot_v2_{F1.fmt.name}_{ISA_NAMES[isa]}"
    fn = module.globals.get(name)
    if fn is not None:
        return fn
    fn = ir.Function(module, ir.FunctionType(F32, [P8, P8, P8, P8, I64]), name)
    fn.linkage = "internal"
    fn.attributes.add("alwaysinline")
    fn.attributes.add("nounwind")
    w, xq, xs_raw, xm_raw, ng = fn.args
    wide_step = 2 if isa == ISA_VNNI512 else 1
    v8f, v16f = _vec(F32, 8), _vec(F32, 16)
    zero8, zero16 = ir.Constant(v8f, [0.0] * 8), ir.Constant(v16f, [0.0] * 16)
    fmuladds = {L: declare(module, f"llvm.fmuladd.v{L}f32", _vec(F32, L), [_vec(F32, L)] * 3) for L in (8, 16)}
    prefetch = declare(module, "llvm.prefetch.p0", ir.VoidType(), [P8, I32, I32, I32])

    b = ir.IRBuilder(fn.append_basic_block("entry"))
    xs = b.bitcast(xs_raw, F32.as_pointer())
    xm = b.bitcast(xm_raw, F32.as_pointer())

    def one_group(b, F, W, g, acc, first_slot):
        """File block (or 8-block group) g of format F; its 32-weight blocks alternate between
        acc[0] and acc[1] from first_slot, W blocks per integer dot."""
        gp = b.gep(w, [b.mul(g, const_i64(F.bytes))])
        for line in range(0, F.bytes, 64):
            b.call(prefetch, [b.gep(gp, [const_i64(PREFETCH_BYTES + line)]), ir.Constant(I32, 0),
                              ir.Constant(I32, 3), ir.Constant(I32, 1)])
        blk0 = b.mul(g, const_i64(F.G))                  # first 32-weight block of the group
        st = F.group(b, gp, b.gep(xs, [blk0]), b.gep(xm, [b.shl(blk0, const_i64(1))]))
        acc = list(acc)
        if st.offset is not None:
            acc[2] = b.fadd(acc[2], st.offset)
        if isa == ISA_AVX2 and F.G == 8 and not isinstance(F, _Legacy8):   # Q4_1: 0.76x with it
            for s, j in enumerate(range(0, F.G, 2)):
                sums, f = _avx2_pair(b, module, F, st, gp, j, xq, blk0)
                slot = (first_slot + s) % 2
                acc[slot] = b.call(fmuladds[8], [b.sitofp(sums, v8f), f, acc[slot]])
            return acc
        for s, j in enumerate(range(0, F.G, W)):
            pair = F.pair_vnni(b, st, gp, j) if (W == 2 and hasattr(F, "pair_vnni")) else None
            if pair is not None:
                q, f = pair
            else:
                qs = [F.quants(b, st, gp, j + e) for e in range(W)]
                fs = [F.factor(b, st, j + e) for e in range(W)]
                q, f = (qs[0], fs[0]) if W == 1 else (_concat(b, *qs), _concat(b, *fs))
            x = _load(b, xq, b.shl(b.add(blk0, const_i64(j)), const_i64(5)), _vec(I8, 32 * W))
            sums = _dot(b, module, q, x, isa, F.signed)
            slot = (first_slot + s) % 2
            acc[slot] = b.call(fmuladds[8 * W], [b.sitofp(sums, _vec(F32, 8 * W)), f, acc[slot]])
        return acc

    if F1.G == 1:
        if wide is not None:                       # groups of 8 blocks, then the rest one by one
            W = wide_step
            zero = zero16 if W == 2 else zero8
            b, (a0, a1, off) = emit_counted_loop(fn, b, const_i64(0), b.ashr(ng, const_i64(3)), 1, [zero, zero, zero8],
                                                  lambda b, g, acc: one_group(b, wide, W, g, acc, 0), "groups")
            if W == 2:
                a0, a1 = (b.fadd(_lanes(b, a, list(range(8))), _lanes(b, a, list(range(8, 16)))) for a in (a0, a1))
            start = b.and_(ng, const_i64(-8))
            accs = [a0, a1, off]
        else:
            start, accs = const_i64(0), [zero8, zero8, zero8]
        pairs_end = b.and_(ng, const_i64(-2))           # two file blocks per step, then an odd one
        b, accs = emit_counted_loop(fn, b, start, pairs_end, 2, accs,
                                     lambda b, g, acc: one_group(b, F1, 1, b.add(g, const_i64(1)),
                                                                 one_group(b, F1, 1, g, acc, 0), 1),
                                     "pairs")
        b, accs = emit_if(fn, b, b.icmp_signed("<", pairs_end, ng), accs,
                                lambda b, acc: one_group(b, F1, 1, pairs_end, acc, 0), "odd")
    else:
        W = wide_step
        zero = zero16 if W == 2 else zero8
        b, accs = emit_counted_loop(fn, b, const_i64(0), ng, 1, [zero, zero, zero8],
                                     lambda b, g, acc: one_group(b, F1, W, g, acc, 0), "groups")
    total = b.fadd(_hsum(b, b.fadd(accs[0], accs[1])), hsum_v8f32(b, accs[2]))
    b.ret(total)
    return fn


@intrinsic
def kq_row_dot(typingctx, w, x_q, x_s, x_m, n, fmt, isa):
    """float32 dot of row n of the raw blocks w (uint8 2-D) with (x_q, x_s, x_m); ``fmt`` (ggml
    type) and ``isa`` compile-time constants. No bounds checks."""
    ok = (isinstance(w, types.Array) and w.dtype == types.uint8 and w.ndim == 2
          and isinstance(x_q, types.Array) and x_q.dtype == types.int8 and x_q.ndim == 1
          and isinstance(x_s, types.Array) and x_s.dtype == types.float32 and x_s.ndim == 1
          and isinstance(x_m, types.Array) and x_m.dtype == types.float32 and x_m.ndim == 1
          and isinstance(n, types.Integer)
          and isinstance(fmt, types.IntegerLiteral) and fmt.literal_value in _FORMATS_IR
          and isinstance(isa, types.IntegerLiteral) and isa.literal_value in ISA_NAMES)
    if not ok:
        return None
    fmt_id, isa_id = fmt.literal_value, isa.literal_value
    sig = types.float32(w, x_q, x_s, x_m, n, fmt, isa)

    def codegen(context, builder, sig, args):
        aw, axq, axs, axm = (context.make_array(t)(context, builder, v) for t, v in zip(sig.args[:4], args[:4]))
        row = context.cast(builder, args[4], sig.args[4], types.int64)
        stride = builder.extract_value(aw.strides, 0)
        ng = builder.sdiv(builder.extract_value(aw.shape, 1), const_i64(_FORMATS_IR[fmt_id].bytes))
        wrow = builder.gep(builder.bitcast(aw.data, P8), [builder.mul(row, stride)])
        fn = _define_row_dot(builder.module, fmt_id, isa_id)
        return builder.call(fn, [wrow, builder.bitcast(axq.data, P8), builder.bitcast(axs.data, P8),
                                 builder.bitcast(axm.data, P8), ng])

    return sig, codegen


@intrinsic
def unpack_group_quants(typingctx, w, n, g, tq, r, o, fmt):
    """tq[r, o:o + 32 G] = the quants of file block g of row n of the raw blocks w, 32-weight
    block by block in weight order (G = 1, or 8 for the K-quants): signed for the formats
    without a min (Q8_0 q, Q4_0 q - 8, Q5_0 q - 16), unsigned (0..31) for those with one. ``fmt`` a compile-time constant. The same IR
    unpackers as the matvec, for the prefill GEMM's packing. No bounds checks."""
    ok = (isinstance(w, types.Array) and w.dtype == types.uint8 and w.ndim == 2
          and isinstance(tq, types.Array) and tq.dtype == types.int8 and tq.ndim == 2
          and all(isinstance(i, types.Integer) for i in (n, g, r, o))
          and isinstance(fmt, types.IntegerLiteral) and fmt.literal_value in _FORMATS_IR)
    if not ok:
        return None
    F = _FORMATS_IR[fmt.literal_value]
    sig = types.void(w, n, g, tq, r, o, fmt)

    def codegen(context, builder, sig, args):
        aw = context.make_array(sig.args[0])(context, builder, args[0])
        at = context.make_array(sig.args[3])(context, builder, args[3])
        n_, g_, r_, o_ = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (1, 2, 4, 5))
        wrow = builder.gep(builder.bitcast(aw.data, P8), [builder.mul(n_, builder.extract_value(aw.strides, 0))])
        gp = builder.gep(wrow, [builder.mul(g_, const_i64(F.bytes))])
        dst = builder.gep(builder.bitcast(at.data, P8), [builder.add(builder.mul(r_, builder.extract_value(at.strides, 0)), o_)])
        bias = getattr(F, "bias", 0) if not getattr(F, "has_min", True) else 0
        for j in range(F.G):
            q = F.quants(builder, None, gp, j)
            if bias:                                     # Q4_0 / Q5_0: signed q - bias, no offset
                q = builder.sub(q, _splat_c(I8, 32, bias))
            builder.store(q, builder.bitcast(builder.gep(dst, [const_i64(32 * j)]), _vec(I8, 32).as_pointer()), align=1)
        return context.get_dummy_value()

    return sig, codegen


# ================================================================================================
# matvec entry points
# ================================================================================================

_ROW_BYTES = np.array([BY_TYPE[t].block_bytes if t in BY_TYPE else 0 for t in range(max(BY_TYPE) + 1)], np.int64)
_ROW_WEIGHTS = np.array([BY_TYPE[t].block_weights if t in BY_TYPE else 0 for t in range(max(BY_TYPE) + 1)], np.int64)


@njit(cache=True, inline="always")
def _check(fmt, w, x_q, x_s, x_m, out):
    if fmt < 0 or fmt >= _ROW_BYTES.size or _ROW_BYTES[fmt] == 0:
        raise ValueError("kquant.matvec: unsupported block format (ggml type)")
    N, rb = w.shape
    bpb = _ROW_BYTES[fmt]
    K = rb // bpb * _ROW_WEIGHTS[fmt]
    if (rb % bpb != 0 or x_q.shape[0] != K or x_s.shape[0] * 32 != K or x_m.shape[0] * 16 != K
            or out.shape[0] != N):
        raise ValueError("kquant.matvec: shapes must be w (N, K/W*B) uint8, x_q (K,), x_s (K//32,), x_m (K//16,), out (N,)")
    if w.strides[1] != 1 or x_q.strides[0] != 1 or x_s.strides[0] != 4 or x_m.strides[0] != 4:
        raise ValueError("kquant.matvec: rows of w and x_q / x_s / x_m must be contiguous")


MATVEC_FORMATS = (Q4_K, Q6_K, Q8_0, Q4_0, Q5_K, Q4_1, Q5_0, Q5_1)
"""The formats :func:`matvec` takes, in the order :func:`matvec_at` tests them."""

_MATVEC_KERNELS: dict = {}


def matvec_kernel(fmt: int, isa: int):
    """The compiled matvec of one block format on one ISA (``out = W x``, arguments as
    :func:`matvec` without ``fmt``). One kernel per format, so a program compiles only the row
    routines of the formats it holds: the default model's Q4_1 matvec took 1.3 s of CPU to
    compile on a 2-core Ice Lake, one kernel with all eight formats 2.6-3.6 s."""
    key = (int(fmt), int(isa))
    if key[0] not in MATVEC_FORMATS:
        raise ValueError("kquant.matvec: unsupported block format (ggml type)")
    if key[1] not in ISA_NAMES:
        raise ValueError(f"kquant.matvec: no ISA variant {isa}: one of {sorted(ISA_NAMES)}")
    if key not in _MATVEC_KERNELS:
        _MATVEC_KERNELS[key] = _make_matvec(*key)
    return _MATVEC_KERNELS[key]


def _make_matvec(fmt: int, isa: int):
    def kernel(w, x_q, x_s, x_m, out):
        _check(fmt, w, x_q, x_s, x_m, out)
        for n in prange(w.shape[0]):
            out[n] = kq_row_dot(w, x_q, x_s, x_m, n, fmt, isa)
    # its own name: numba's cache files and the Addressed cells are named after it
    kernel.__name__ = kernel.__qualname__ = f"matvec_{BY_TYPE[fmt].name.lower()}_{ISA_NAMES[isa]}"
    kernel.__doc__ = f":func:`matvec` of {BY_TYPE[fmt].name} blocks with the {ISA_NAMES[isa]} row routine."
    return njit(cache=True, parallel=True)(kernel)


def matvec_on(isa: int, fmt: int, w, x_q, x_s, x_m, out) -> None:
    """:func:`matvec` with the row routine of ``isa`` (one of ISAS)."""
    matvec_kernel(fmt, isa)(w, x_q, x_s, x_m, out)


def matvec(fmt: int, w, x_q, x_s, x_m, out) -> None:
    """out[n] = sum_k W[n, k] x[k] over the raw GGUF blocks of W (decode hot path).

    fmt: ggml type number (gguf_blocks: Q8_0 8, Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q4_K 12, Q5_K 13,
    Q6_K 14); w uint8 (N, K / W * B) (a GGUF tensor's bytes, row stride free, rows contiguous);
    x_q int8 (K,), x_s float32 (K // 32,), x_m float32 (K // 16,) from :func:`quantize_act_q8`;
    out float32 (N,). Parallel over rows. Raises ValueError on an unsupported fmt or inconsistent
    shapes. The fastest ISA variant this CPU runs (``BEST_ISA``); compiled code calls
    :func:`matvec_at`."""
    matvec_on(BEST_ISA, fmt, w, x_q, x_s, x_m, out)


MATVECS = {isa: (lambda fmt, w, x_q, x_s, x_m, out, isa=isa: matvec_on(isa, fmt, w, x_q, x_s, x_m, out))
           for isa in ISA_NAMES}
"""matvec of each ISA variant, for tests and benchmarks (each compiles only on a CPU that runs it)."""

MATVEC_SIGNATURE = (array(types.uint8, 2, readonly=True), array(types.int8), ARENA, ARENA, ARENA)
MATVEC = {fmt: Addressed(matvec_kernel(fmt, BEST_ISA), types.none, [MATVEC_SIGNATURE]) for fmt in MATVEC_FORMATS}
"""Each format's matvec on this CPU's best ISA, as :func:`matvec_at` calls it: through its address
(cpullm_kernels.setup.addressed), bound on first use, so only the formats a program holds compile."""
_mv_q4_k, _mv_q6_k, _mv_q8_0, _mv_q4_0, _mv_q5_k, _mv_q4_1, _mv_q5_0, _mv_q5_1 = (MATVEC[f].call
                                                                                  for f in MATVEC_FORMATS)


@njit(cache=True, inline="always")
def matvec_at(fmt, w, x_q, x_s, x_m, out):
    """:func:`matvec` from compiled code (formats.matmul_rows, kquant_gemm's short prompts): the
    format's own kernel through its address. Not from a worker thread of a parallel region
    before the format's kernel is bound (cpullm_kernels.setup.addressed)."""
    if fmt == Q4_K:
        _mv_q4_k(w, x_q, x_s, x_m, out)
    elif fmt == Q6_K:
        _mv_q6_k(w, x_q, x_s, x_m, out)
    elif fmt == Q8_0:
        _mv_q8_0(w, x_q, x_s, x_m, out)
    elif fmt == Q4_0:
        _mv_q4_0(w, x_q, x_s, x_m, out)
    elif fmt == Q5_K:
        _mv_q5_k(w, x_q, x_s, x_m, out)
    elif fmt == Q4_1:
        _mv_q4_1(w, x_q, x_s, x_m, out)
    elif fmt == Q5_0:
        _mv_q5_0(w, x_q, x_s, x_m, out)
    elif fmt == Q5_1:
        _mv_q5_1(w, x_q, x_s, x_m, out)
    else:
        raise ValueError("kquant.matvec: unsupported block format (ggml type)")
