"""LLVM IR building blocks of the integer kernels (q8_panels, q8_gemm, head_screen, kquant,
kquant_panels, kquant_gemm): IR types, binary16 conversions, block dot products, the inline-assembly
register tiles (AVX-512 VNNI and the 256-bit AVX2 / AVX-VNNI ones), prefetch and loop builders.

Numba's on-disk cache keys a kernel on its own source file only: a change here needs the numba
cache cleared for the kernels of other modules that inline these pieces.
"""
from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils

from ..setup import numba_setup

PREFETCH_BYTES = 4096
"""Software-prefetch distance in a q8 weight stream (:func:`prefetch_ahead`): 4 KiB brought a
whole decode sweep to the speed of a plain read of the same bytes (+4-7 % over 1 KiB; 8 KiB no
better)."""

HALF_IN_HARDWARE = "f16c" in numba_setup.HOST_FEATURES or not numba_setup.HOST_IS_X86
"""binary16 -> float32 by LLVM's fpext (vcvtph2ps on x86 with F16C); else integer IR."""

I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F32 = ir.FloatType()
V16I16 = ir.VectorType(I16, 16)
V8I32 = ir.VectorType(I32, 8)
V8F32 = ir.VectorType(F32, 8)
P8 = I8.as_pointer()


def const_i64(v):
    return ir.Constant(I64, v)


def declare(module, name, ret, args):
    return cgutils.get_or_insert_function(module, ir.FunctionType(ret, args), name)


def hsum_v8f32(b, v):
    """Horizontal sum of an <8 x float>."""
    idx = lambda *ix: ir.Constant(ir.VectorType(I32, len(ix)), list(ix))  # noqa: E731
    s = b.fadd(b.shuffle_vector(v, v, idx(0, 1, 2, 3)), b.shuffle_vector(v, v, idx(4, 5, 6, 7)))
    s = b.fadd(s, b.shuffle_vector(s, s, idx(2, 3, 2, 3)))
    return b.fadd(b.extract_element(s, ir.Constant(I32, 0)), b.extract_element(s, ir.Constant(I32, 1)))


def half_to_float_ir(b, h):
    """IR: i16 binary16 bits -> float (finite values: normal, subnormal, zero)."""
    if HALF_IN_HARDWARE:
        return b.fpext(b.bitcast(h, ir.HalfType()), F32)
    u = b.zext(h, I32)
    sign = b.shl(b.and_(u, ir.Constant(I32, 0x8000)), ir.Constant(I32, 16))
    mag = b.and_(u, ir.Constant(I32, 0x7FFF))
    normal = b.bitcast(b.or_(sign, b.add(b.shl(mag, ir.Constant(I32, 13)), ir.Constant(I32, 112 << 23))), F32)
    sub = b.fmul(b.uitofp(b.and_(u, ir.Constant(I32, 0x3FF)), F32), ir.Constant(F32, 2.0 ** -24))
    sub = b.bitcast(b.or_(b.bitcast(sub, I32), sign), F32)
    is_sub = b.icmp_unsigned("<", mag, ir.Constant(I32, 0x400))
    return b.select(is_sub, sub, normal)


def half_to_float_ir_fresh(b, h):
    """IR: as :func:`half_to_float_ir`, but the hardware conversion reads a register that was
    written whole. LLVM turns a scalar ``fpext half`` (and every vector form that uses one lane)
    into ``vpinsrw $0, mem, %xmmK, %xmmD`` with whatever register it picks as %xmmK; in a loop of
    FMAs that can be a float accumulator, which chains each block's scale conversion to the
    previous block's FMA (measured in a row-dot loop: 7-9 cycles per block of 32 in L1). Here the
    bits go through a GPR and ``vmovd`` (which zeroes the rest), then one ``vcvtph2ps`` LLVM
    cannot rewrite (inline asm)."""
    if not (HALF_IN_HARDWARE and numba_setup.HOST_IS_X86):
        return half_to_float_ir(b, h)
    v4i32, v4f32 = ir.VectorType(I32, 4), ir.VectorType(F32, 4)
    v = b.insert_element(ir.Constant(v4i32, [0] * 4), b.zext(h, I32), ir.Constant(I32, 0))
    cvt = ir.InlineAsm(ir.FunctionType(v4f32, [v4i32]), "vcvtph2ps $1, $0", "=x,x")
    return b.extract_element(b.call(cvt, [v]), ir.Constant(I32, 0))


def block_dot_i32x8(b, module, wp, xp, x86):
    """w (32 x i8 at wp) . x (32 x i16 at xp) -> <8 x i32> partial sums (each lane sums 4 products).

    |w| <= 127, |x| <= 32767: every partial sum stays below 4 * 127 * 32767 < 2^24, exact in int32
    and in its float32 conversion.
    """
    v16i8 = ir.VectorType(I8, 16)
    w0 = b.load(b.bitcast(wp, v16i8.as_pointer()), align=1)
    w1 = b.load(b.bitcast(b.gep(wp, [const_i64(16)]), v16i8.as_pointer()), align=1)
    x0 = b.load(b.bitcast(xp, V16I16.as_pointer()), align=1)
    x1 = b.load(b.bitcast(b.gep(xp, [const_i64(32)]), V16I16.as_pointer()), align=1)
    if x86:   # vpmovsxbw + vpmaddwd (pairs of products summed into int32 lanes)
        maddwd = declare(module, "llvm.x86.avx2.pmadd.wd", V8I32, [V16I16, V16I16])
        return b.add(b.call(maddwd, [b.sext(w0, V16I16), x0]), b.call(maddwd, [b.sext(w1, V16I16), x1]))
    v16i32 = ir.VectorType(I32, 16)
    p = b.add(b.mul(b.sext(w0, v16i32), b.sext(x0, v16i32)), b.mul(b.sext(w1, v16i32), b.sext(x1, v16i32)))
    half = lambda h: b.shuffle_vector(p, p, ir.Constant(V8I32, list(range(8 * h, 8 * h + 8))))  # noqa: E731
    return b.add(half(0), half(1))


def halves_to_floats(b, v):
    """IR: <n x i16> binary16 bits -> <n x float> (one ``vcvtph2ps`` with F16C)."""
    n = v.type.count
    vf = ir.VectorType(F32, n)
    if HALF_IN_HARDWARE:
        return b.fpext(b.bitcast(v, ir.VectorType(ir.HalfType(), n)), vf)
    out = ir.Constant(vf, ir.Undefined)
    for k in range(n):
        e = half_to_float_ir(b, b.extract_element(v, ir.Constant(I32, k)))
        out = b.insert_element(out, e, ir.Constant(I32, k))
    return out


def scaled_fma(b, module, sums, factor, acc):
    """IR: acc + float(sums) * factor: <8 x i32> block sums, one float factor, <8 x float> acc."""
    fmuladd = declare(module, "llvm.fmuladd.v8f32", V8F32, [V8F32, V8F32, V8F32])
    sv = b.insert_element(ir.Constant(V8F32, ir.Undefined), factor, ir.Constant(I32, 0))
    sv = b.shuffle_vector(sv, sv, ir.Constant(V8I32, [0] * 8))
    return b.call(fmuladd, [b.sitofp(sums, V8F32), sv, acc])


def prefetch_ahead(b, module, p, locality=3):
    """IR: prefetch (read) PREFETCH_BYTES past the byte pointer p, into L1 (``locality`` 3:
    ``prefetcht0``) or L2 (2: ``prefetcht1``)."""
    prefetch = declare(module, "llvm.prefetch.p0", ir.VoidType(), [P8, I32, I32, I32])
    b.call(prefetch, [b.gep(p, [const_i64(PREFETCH_BYTES)]), ir.Constant(I32, 0), ir.Constant(I32, locality),
                      ir.Constant(I32, 1)])


def vnni_block_sums(b, wptrs, xptrs, load: str, pair_bytes: int, chains: int = 1):
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
    v16i32 = ir.VectorType(I32, 16)
    ret = ir.LiteralStructType([v16i32] * (nacc + V))
    ins = list(wptrs) + list(xptrs)
    asm = ir.InlineAsm(ir.FunctionType(ret, [x.type for x in ins]), "\n\t".join(lines),
                       ",".join(["=&v"] * (nacc + V) + ["r"] * len(ins) + ["~{memory}"]))
    r = b.call(asm, ins)
    return [[[b.extract_value(r, (t * V + v) * chains + c) for c in range(chains)] for v in range(V)]
            for t in range(TR)]


YMM_DOTS = ("avx2", "avxvnni")
"""The 256-bit multiply-add variants of :func:`ymm_block_sums`: ``vpmaddwd`` + ``vpaddd``
(AVX2), or the VEX-encoded ``vpdpwssd`` (AVX-VNNI: Alder Lake and later client CPUs, which have
no AVX-512)."""


def ymm_block_sums(b, wptrs, xptrs, load: str, pair_bytes: int, dot: str):
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
    ret = ir.LiteralStructType([V8I32] * (nacc + scratch))
    ins = list(wptrs) + list(xptrs)
    # "~{memory}": the routine reads memory LLVM cannot see through its pointer operands
    asm = ir.InlineAsm(ir.FunctionType(ret, [x.type for x in ins]), "\n\t".join(lines),
                       ",".join(["=&x"] * (nacc + scratch) + ["r"] * len(ins) + ["~{memory}"]))
    r = b.call(asm, ins)
    return [[b.extract_value(r, t * H + h) for h in range(H)] for t in range(TR)]


def emit_counted_loop(fn, b, start, end, step, accs, body, name):
    """IR: ``for i in range(start, end, step): accs = body(b, i, accs)``.

    ``b`` is a builder at the end of an open basic block where ``accs`` (a list of values) hold;
    ``body`` emits one step into the loop's block and returns the new values. Returns (builder at
    the end of an open block after the loop, the values after it).
    """
    pre = b.block
    loop, done = fn.append_basic_block(name), fn.append_basic_block(name + "_done")
    b.cbranch(b.icmp_signed("<", start, end), loop, done)
    b = ir.IRBuilder(loop)
    i = b.phi(I64)
    phis = [b.phi(a.type) for a in accs]
    new = list(body(b, i, phis))
    i_next = b.add(i, const_i64(step))
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


def emit_if(fn, b, cond, acc, step, name):
    """IR: ``acc = step(b, acc) if cond else acc``, the step in a block of its own; ``acc`` is one
    value or a list of values. Returns (builder at the end of an open block after it, the value or
    values after it)."""
    pre = b.block
    body, done = fn.append_basic_block(name), fn.append_basic_block(name + "_done")
    b.cbranch(cond, body, done)
    b = ir.IRBuilder(body)
    new = step(b, acc)
    last = b.block
    b.branch(done)
    b = ir.IRBuilder(done)
    one = not isinstance(acc, (list, tuple))
    out = []
    for a, n in zip([acc] if one else acc, [new] if one else new):
        phi = b.phi(a.type)
        phi.add_incoming(a, pre)
        phi.add_incoming(n, last)
        out.append(phi)
    return b, out[0] if one else out
