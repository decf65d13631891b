"""Causal grouped-query attention over a per-layer KV cache (full or sliding-window ring).

Cache region of one layer inside the flat ``state`` array, at ``c_off`` (cap a multiple of 16):

    K: (n_kv, cap // 16, head_dim, 16)   keys in tiles of 16 slots, transposed inside a tile
    V: (n_kv, cap, head_dim)             values, one row per slot

(float32; a float16 cache the same in 2-byte elements; an 8-bit one the same in int8 bytes,
then float32 scales, one per Q8_BLOCK (32) values of a row: the keys' KS (n_kv, cap // 16,
n_blocks, 16), tiled as the keys are, and the values' VS (n_kv, cap, n_blocks), n_blocks =
ceil(head_dim / 32): :func:`kv_views_q8`, :func:`q8_row`.)

Position p lives in slot ``p % cap`` (K: tile ``slot // 16``, lane ``slot % 16``). A full-attention
layer has cap = n_ctx (rounded up to 16); a sliding-window layer has cap >= window + max_chunk, so
a whole prefill chunk fits beside the window it looks back on. Query row t (position pos0 + t)
attends to positions [lo, pos0 + t], lo = max(0, p - window + 1) for window > 0, else 0. Query
head h reads KV head h // (n_heads // n_kv). Softmax in float32 (max subtracted, exp_f32), with
optional tanh soft-capping.

Why the key tiles: the score of 16 keys for one query head is then 16 lanes of one vector,
accumulated over head_dim with one broadcast FMA per dimension (``_scores_tiles``, LLVM IR: four
query heads share each tile load, no horizontal sums). The values are multiplied the other way
round (``_pv_rows``: each value row is loaded once per PV_VECTORS x 16 dimensions and added into
register accumulators of up to four heads). Both run the same for decode (one query row) and
prefill (every row of a chunk is an independent job), so there is one attention kernel,
:func:`attention`, parallel over (query row, KV head, range of its keys). In decode (chunks of at most STREAM_ROWS rows) the
cache comes from DRAM, so both loops prefetch PREFETCH_BYTES ahead; prefill, whose cache is
warm, does not.

Key tiles and shared value rows replaced row-major keys with a horizontal sum per score: decode
at a 512-token context took about a third of the time per layer (Qwen2.5-0.5B's shapes, 2
threads: 0.035 -> 0.011 ms).
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from ..ops.vmath import exp_f32, exp_f32_ir, fdiv_ieee, tanh_f32_ir
from ..rows.llvm_ir import F32, I8, I16, I32, I64, P8, const_i64, declare
from ..setup import numba_setup
from ..setup.addressed import Addressed
from ..setup.operand_types import ARENA, array, f64, i64

TILE = 16
"""Key slots per tile (the vector width of the score kernel)."""

_VF = ir.VectorType(F32, TILE)
_PF = F32.as_pointer()
_HALF = ir.HalfType()
_VI16 = ir.VectorType(I16, TILE)
_VI8 = ir.VectorType(I8, TILE)
_VI32 = ir.VectorType(I32, TILE)

KV_F32, KV_F16, KV_Q8 = 0, 1, 2
"""KV storage formats as the instruction table codes them (cpullm.compile.kvformat names them)."""

Q8_BLOCK = 32
"""Values per float32 scale in an 8-bit cache's rows (ggml's Q8_0 block): keys and values."""


def q8_blocks(head_dim: int) -> int:
    """Scales per (slot, KV head) row of an 8-bit cache: ceil(head_dim / Q8_BLOCK)."""
    return (int(head_dim) + Q8_BLOCK - 1) // Q8_BLOCK


def kv_operand(code: int):
    """The kernels' ``kv16`` operand for a KV format code: None for float32 caches, an int64 for
    float16 ones, an int8 for 8-bit ones. Its type, not its value, selects the format: numba
    compiles one specialization per type and keeps only that format's code (``is None`` branches
    pruned, the helpers below overloaded on the type), so a cold start compiles only the format
    the program uses (attention's cold compile: 22 s with both float formats, 13-15 s with one)."""
    code = int(code)
    if code == KV_F16:
        return np.int64(KV_F16)
    if code == KV_Q8:
        return np.int8(KV_Q8)
    return None


KV_OPERANDS = (types.none, i64, types.int8)
"""The types of :func:`kv_operand` (float32, float16, int8 caches): the specializations an addressed
call of attention may take."""


def _kv_kind(kv) -> int:
    """The KV format code a ``kv16`` operand's numba type stands for (:func:`kv_operand`)."""
    if kv is None or isinstance(kv, (types.NoneType, types.Omitted)):
        return KV_F32
    if isinstance(kv, types.Integer) and kv.bitwidth == 8:
        return KV_Q8
    return KV_F16


WIDEN_F16C, WIDEN_GENERIC, WIDEN_I8 = 1, 2, 3
"""How the kernels widen a cache element to float32: float16 by LLVM's ``fpext`` (vcvtph2ps on
F16C / AVX-512 hosts) or by integer operations (any host: LLVM would otherwise call a runtime
helper that a JIT-compiled function may not find); an 8-bit cache's int8 by ``sitofp``
(vpmovsxbd + vcvtdq2ps), its block scales applied per block of sums (keys) or per loaded
vector (values)."""
HEADS_PER_PASS = 4   # query heads sharing one tile / value-row load
PREFETCH_BYTES = 8192
"""Software-prefetch distance in the key-tile and value-row streams of decode (see STREAM_ROWS)."""
PV_VECTORS = 4 if "avx512f" in numba_setup.HOST_FEATURES else 1
"""16-float vectors of head_dim per value pass. With AVX-512's 32 registers, 4: up to 4 heads x 4
accumulators. With 16 (AVX2) the 16-float vectors are register pairs and 4 heads x 4 spill, so
1: prefill attention at 512 tokens took 20-29 % less time (SmolLM2, Qwen2.5-0.5B and Gemma 3
270M shapes, one thread, measured in one process against 4), decode the same or less. The sums
run in the same order either way."""


def _target_has_f16c() -> bool:
    """Whether the code numba generates may use F16C: the host's features, or NUMBA_CPU_FEATURES
    when a portable target is configured (NUMBA_CPU_NAME=generic without them: no)."""
    from numba.core import config
    if config.CPU_FEATURES is not None:
        return "+f16c" in config.CPU_FEATURES.split(",")
    if config.CPU_NAME not in (None, "host"):
        return False
    try:
        import llvmlite.binding as llvm
        return bool(llvm.get_host_cpu_features().get("f16c", False))
    except Exception:  # pragma: no cover - llvmlite always present with numba
        return False


def _widen_mode() -> int:
    return WIDEN_F16C if _target_has_f16c() else WIDEN_GENERIC


def padded_cap(cap: int) -> int:
    """A cache capacity rounded up to whole tiles."""
    return (int(cap) + TILE - 1) // TILE * TILE


def _splat(b, x):
    v = b.insert_element(ir.Constant(_VF, ir.Undefined), x, ir.Constant(I32, 0))
    return b.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, TILE), [0] * TILE))


def _vload(b, p, off):
    return b.load(b.bitcast(b.gep(p, [off]), _VF.as_pointer()), align=4)


def _widen_h16(b, h, widen):
    """<16 x i16> float16 bit patterns -> <16 x float>, exactly (every half is a float).
    WIDEN_GENERIC: the magnitude bits shifted into a float32's place and scaled by 2^112 (which
    also turns a half subnormal into the right float32 normal), infinities and NaNs given the
    all-ones exponent, the sign put back."""
    if widen == WIDEN_F16C:
        return b.fpext(b.bitcast(h, ir.VectorType(_HALF, TILE)), _VF)
    x = b.zext(h, _VI32)
    mag = b.and_(x, ir.Constant(_VI32, [0x7FFF] * TILE))
    sh = b.shl(mag, ir.Constant(_VI32, [13] * TILE))
    scaled = b.bitcast(b.fmul(b.bitcast(sh, _VF), ir.Constant(_VF, [2.0 ** 112] * TILE)), _VI32)
    special = b.icmp_unsigned(">=", mag, ir.Constant(_VI32, [0x7C00] * TILE))
    bits = b.select(special, b.or_(sh, ir.Constant(_VI32, [0x7F800000] * TILE)), scaled)
    sign = b.shl(b.and_(x, ir.Constant(_VI32, [0x8000] * TILE)), ir.Constant(_VI32, [16] * TILE))
    return b.bitcast(b.or_(bits, sign), _VF)


def _vload_kv(b, p, off, widen):
    """16 consecutive cache values from ``p[off]`` as <16 x float>: ``p`` is float* (widen 0),
    i16* of float16 bit patterns (widen WIDEN_F16C / WIDEN_GENERIC) or i8* of int8 (WIDEN_I8)."""
    if not widen:
        return _vload(b, p, off)
    if widen == WIDEN_I8:
        return b.sitofp(b.load(b.bitcast(b.gep(p, [off]), _VI8.as_pointer()), align=1), _VF)
    h = b.load(b.bitcast(b.gep(p, [off]), _VI16.as_pointer()), align=2)
    return _widen_h16(b, h, widen)


def _vstore(b, v, p, off):
    b.store(v, b.bitcast(b.gep(p, [off]), _VF.as_pointer()), align=4)


def _prefetch(b, p, off):
    """Prefetch (read, to L1) the cache line of element ``p[off]`` (any address: never faults)."""
    fn = declare(b.module, "llvm.prefetch.p0", ir.VoidType(), [P8, I32, I32, I32])
    b.call(fn, [b.bitcast(b.gep(p, [off]), P8), ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])


def _counted_loop(fn, b, n, name):
    """for i in range(n) as IR blocks: returns (body builder, i, after-loop builder, close)."""
    head = fn.append_basic_block(name + "_head")
    body = fn.append_basic_block(name + "_body")
    end = fn.append_basic_block(name + "_end")
    pre = b.block
    b.branch(head)
    bh = ir.IRBuilder(head)
    i = bh.phi(I64)
    i.add_incoming(const_i64(0), pre)
    bh.cbranch(bh.icmp_signed("<", i, n), body, end)
    bb = ir.IRBuilder(body)

    def close(b_last):
        i.add_incoming(b_last.add(i, const_i64(1)), b_last.block)
        b_last.branch(head)
    return bb, i, ir.IRBuilder(end), close


def _remainder_pass(fn, b, nrest, emit, name):
    """switch nrest in (1, 2, 3): emit(builder, nh) for that many heads; returns the builder after.
    ``emit`` may return a new builder (its code ended in another block) or anything else."""
    end = fn.append_basic_block(name + "_rest_end")
    cases = []
    for nh in (1, 2, 3):
        blk = fn.append_basic_block(f"{name}_rest{nh}")
        cases.append((nh, blk))
    sw = b.switch(nrest, end)
    for nh, blk in cases:
        sw.add_case(const_i64(nh), blk)
        bb = ir.IRBuilder(blk)
        r = emit(bb, nh)
        last = r if isinstance(r, ir.IRBuilder) else bb
        last.branch(end)
    return ir.IRBuilder(end)


def _elem(widen):
    """(LLVM pointer type, bytes) of one cache element for a widen mode."""
    if widen == WIDEN_I8:
        return I8.as_pointer(), 1
    return (I16.as_pointer(), 2) if widen else (_PF, 4)


def _dims_loop(fn, b_pre, start, stop, step, accs_in, name, q, hd, tile, widen, pf, esize):
    """for d in range(start, stop, step) as IR blocks after ``b_pre``: each head j's
    accumulators accs_in[j] (P vectors, dimension d + k into accumulator k % P) take
    q[j * hd + d] * tile[d * 16 : d * 16 + 16] by FMA (the keys widened as loaded, prefetched pf
    bytes ahead when pf). Returns (builder after the loop, the accumulators there)."""
    module = fn.module
    fma = declare(module, "llvm.fmuladd.v16f32", _VF, [_VF, _VF, _VF])
    nh = len(accs_in)
    pre_block = b_pre.block
    head = fn.append_basic_block(name + "_head")
    body = fn.append_basic_block(name + "_body")
    end = fn.append_basic_block(name + "_end")
    b_pre.branch(head)
    bh = ir.IRBuilder(head)
    d = bh.phi(I64)
    accs = [[bh.phi(_VF) for _ in range(len(accs_in[0]))] for _ in range(nh)]
    d.add_incoming(start, pre_block)
    for j in range(nh):
        for k, a in enumerate(accs[j]):
            a.add_incoming(accs_in[j][k], pre_block)
    bh.cbranch(bh.icmp_signed("<", d, stop), body, end)
    bb = ir.IRBuilder(body)
    new = [list(a) for a in accs]
    for k in range(step):
        dk = bb.add(d, const_i64(k))
        kv = _vload_kv(bb, tile, bb.mul(dk, const_i64(TILE)), widen)
        if pf:
            _prefetch(bb, tile, bb.add(bb.mul(dk, const_i64(TILE)), const_i64(pf // esize)))
        for j in range(nh):
            qj = bb.load(bb.gep(q, [bb.add(bb.mul(hd, const_i64(j)), dk)]), align=4)
            slot = k % len(new[j])
            new[j][slot] = bb.call(fma, [_splat(bb, qj), kv, new[j][slot]])
    d.add_incoming(bb.add(d, const_i64(step)), body)
    for j in range(nh):
        for a, v in zip(accs[j], new[j]):
            a.add_incoming(v, body)
    bb.branch(head)
    return ir.IRBuilder(end), accs


def _pairwise(b, parts):
    """The sum of a power-of-two list of vectors, added in pairs (a fixed order)."""
    while len(parts) > 1:
        parts = [b.fadd(parts[i], parts[i + 1]) for i in range(0, len(parts), 2)]
    return parts[0]


def _dot_range(fn, b, start, stop, accs_in, name, q, hd, tile, widen, pf, esize):
    """Dimensions [start, stop) of the score sums: P interleaved partial sums per head
    (``accs_in``), added pairwise, then the dimensions past the last whole P one by one.
    Returns (builder after, one sum vector per head)."""
    P = len(accs_in[0])
    dmain = b.add(start, b.mul(b.sdiv(b.sub(stop, start), const_i64(P)), const_i64(P)))
    b2, accs = _dims_loop(fn, b, start, dmain, P, accs_in, name + "m", q, hd, tile, widen, pf, esize)
    sums = [[_pairwise(b2, list(accs[j]))] for j in range(len(accs))]
    b3, fin = _dims_loop(fn, b2, dmain, stop, 1, sums, name + "t", q, hd, tile, widen, pf, esize)
    return b3, [f[0] for f in fin]


def _new_function(module, name, args):
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), args), name)
    fn.linkage = "internal"
    fn.attributes.add("alwaysinline")
    fn.attributes.add("nounwind")
    return fn


def _define_scores(module, nh: int, pf: int, widen: int = 0):
    """void @cpullm_att_scores_<nh>(f32* q, i64 hd, f32* tile, f32* out, i64 out_st):
    out[j * out_st + l] = sum_d q[j * hd + d] * tile[d * 16 + l] for j < nh, l < 16.

    Each head keeps P = 8 // nh (a power of two) partial sums over interleaved dimensions, so at
    least 6 independent FMA chains hide the FMA latency even for one head. With pf > 0, a software
    prefetch pf bytes ahead in the key stream per 64-byte line (the next tiles). ``widen`` > 0:
    the tile is i16* of float16 keys, widened to float32 as loaded (:func:`_widen_h16`)."""
    name = f"cpullm_att_scores_v3_{nh}_pf{pf}_w{widen}"
    fn = module.globals.get(name)
    if fn is not None:
        return fn
    tile_ty, esize = _elem(widen)
    fn = _new_function(module, name, [_PF, I64, tile_ty, _PF, I64])
    q, hd, tile, out, out_st = fn.args
    P = {1: 8, 2: 4, 3: 2, 4: 2}[nh]
    zero = ir.Constant(_VF, [0.0] * TILE)
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    b3, fin = _dot_range(fn, b, const_i64(0), hd, [[zero] * P for _ in range(nh)], "d", q, hd, tile, widen, pf, esize)
    for j in range(nh):
        _vstore(b3, fin[j], out, b3.mul(out_st, const_i64(j)))
    b3.ret_void()
    return fn


def _define_scores_q8(module, nh: int, pf: int):
    """void @cpullm_att_scores_q8_<nh>(f32* q, i64 hd, i8* tile, f32* sc, f32* out, i64 out_st):
    out[j * out_st + l] = sum_b sc[b * 16 + l] * sum_{d in block b} q[j * hd + d] * tile[d * 16 + l]
    for j < nh, l < 16: int8 keys with a float32 scale per Q8_BLOCK dimensions of each key (the
    tile's scales ``sc``: (n_blocks, 16), a vector per block). Each block's sums run as
    :func:`_define_scores`' (P partial sums, added pairwise), then one FMA per head adds the
    block's sum times its 16 scales to the head's total; the last block may be shorter."""
    name = f"cpullm_att_scores_q8_v1_{nh}_pf{pf}"
    fn = module.globals.get(name)
    if fn is not None:
        return fn
    fn = _new_function(module, name, [_PF, I64, P8, _PF, _PF, I64])
    q, hd, tile, sc, out, out_st = fn.args
    P = {1: 8, 2: 4, 3: 2, 4: 2}[nh]
    fma = declare(module, "llvm.fmuladd.v16f32", _VF, [_VF, _VF, _VF])
    zero = ir.Constant(_VF, [0.0] * TILE)
    entry = fn.append_basic_block("entry")
    b = ir.IRBuilder(entry)
    nb = b.sdiv(b.add(hd, const_i64(Q8_BLOCK - 1)), const_i64(Q8_BLOCK))
    head = fn.append_basic_block("blk_head")
    body = fn.append_basic_block("blk_body")
    end = fn.append_basic_block("blk_end")
    b.branch(head)
    bh = ir.IRBuilder(head)
    blk = bh.phi(I64)
    totals = [bh.phi(_VF) for _ in range(nh)]
    blk.add_incoming(const_i64(0), entry)
    for t in totals:
        t.add_incoming(zero, entry)
    bh.cbranch(bh.icmp_signed("<", blk, nb), body, end)
    bb = ir.IRBuilder(body)
    d0 = bb.mul(blk, const_i64(Q8_BLOCK))
    d1 = bb.add(d0, const_i64(Q8_BLOCK))
    d1 = bb.select(bb.icmp_signed("<", d1, hd), d1, hd)
    if pf:      # the scales are 4 * n_blocks bytes per 16 * head_dim of keys: ~pf / 8 ahead
        _prefetch(bb, sc, bb.add(bb.mul(blk, const_i64(TILE)), const_i64(pf // 8 // 4)))
    bl, sums = _dot_range(fn, bb, d0, d1, [[zero] * P for _ in range(nh)], "qd", q, hd, tile, WIDEN_I8, pf, 1)
    svec = _vload(bl, sc, bl.mul(blk, const_i64(TILE)))
    for j in range(nh):
        totals[j].add_incoming(bl.call(fma, [sums[j], svec, totals[j]]), bl.block)
    blk.add_incoming(bl.add(blk, const_i64(1)), bl.block)
    bl.branch(head)
    be = ir.IRBuilder(end)
    for j in range(nh):
        _vstore(be, totals[j], out, be.mul(out_st, const_i64(j)))
    be.ret_void()
    return fn


def _define_pv(module, nh: int, nv: int, pf: int, widen: int = 0, q8: bool = False):
    """void @cpullm_att_pv_<nh>_<nv>(f32* s, i64 s_st, f32* v, i64 v_st, i64 n, f32* acc, i64 acc_st):
    acc[j * acc_st + e] += sum_i s[j * s_st + i] * v[i * v_st + e] for j < nh, e < 16 nv; with
    pf > 0 a software prefetch of the value rows ~pf bytes ahead. ``widen`` > 0: v is i16* of
    float16 values, widened to float32 as loaded. ``q8``: v is i8* of int8 values and two more
    arguments (f32* vs, i64 vs_st) give their scales: column e of row i is v[i * v_st + e] times
    vs[i * vs_st + e // Q8_BLOCK] (v points at a multiple of Q8_BLOCK columns, or nv = 1 and its
    16 columns are in one block), the widened vector multiplied by its block's scale as loaded."""
    name = f"cpullm_att_pv_v3_{nh}_{nv}_pf{pf}_w{widen}" + ("_q8b" if q8 else "")
    fn = module.globals.get(name)
    if fn is not None:
        return fn
    v_ty, esize = _elem(widen)
    fn = _new_function(module, name, [_PF, I64, v_ty, I64, I64, _PF, I64] + ([_PF, I64] if q8 else []))
    s, s_st, v, v_st, n, acc, acc_st = fn.args[:7]
    vs, vs_st = fn.args[7:] if q8 else (None, None)
    fma = declare(module, "llvm.fmuladd.v16f32", _VF, [_VF, _VF, _VF])
    entry = fn.append_basic_block("entry")
    b = ir.IRBuilder(entry)
    init = [[_vload(b, acc, b.add(b.mul(acc_st, const_i64(j)), const_i64(16 * e))) for e in range(nv)] for j in range(nh)]
    pf_rows = b.add(b.sdiv(const_i64(pf // esize), v_st), const_i64(1)) if pf else None
    head = fn.append_basic_block("i_head")
    body = fn.append_basic_block("i_body")
    end = fn.append_basic_block("i_end")
    b.branch(head)
    bh = ir.IRBuilder(head)
    i = bh.phi(I64)
    accs = [[bh.phi(_VF) for _ in range(nv)] for _ in range(nh)]
    i.add_incoming(const_i64(0), entry)
    for j in range(nh):
        for e in range(nv):
            accs[j][e].add_incoming(init[j][e], entry)
    bh.cbranch(bh.icmp_signed("<", i, n), body, end)
    bb = ir.IRBuilder(body)
    vrow = bb.mul(i, v_st)
    vv = [_vload_kv(bb, v, bb.add(vrow, const_i64(16 * e)), widen) for e in range(nv)]
    if q8:                   # each 16 columns times their block's scale
        srow = bb.mul(i, vs_st)
        scales = [_splat(bb, bb.load(bb.gep(vs, [bb.add(srow, const_i64(k))]), align=4))
                  for k in range((16 * nv + Q8_BLOCK - 1) // Q8_BLOCK)]
        vv = [bb.fmul(vv[e], scales[16 * e // Q8_BLOCK]) for e in range(nv)]
        if pf:
            _prefetch(bb, vs, bb.add(srow, bb.mul(vs_st, pf_rows)))
    if pf:                   # the same columns, ~pf bytes ahead (at least one row)
        ahead = bb.add(vrow, bb.mul(v_st, pf_rows))
        for e in range(nv):
            _prefetch(bb, v, bb.add(ahead, const_i64(16 * e)))
    for j in range(nh):
        w = _splat(bb, bb.load(bb.gep(s, [bb.add(bb.mul(s_st, const_i64(j)), i)]), align=4))
        for e in range(nv):
            nxt = bb.call(fma, [w, vv[e], accs[j][e]])
            accs[j][e].add_incoming(nxt, body)
    i.add_incoming(bb.add(i, const_i64(1)), body)
    bb.branch(head)
    be = ir.IRBuilder(end)
    for j in range(nh):
        for e in range(nv):
            _vstore(be, accs[j][e], acc, be.add(be.mul(acc_st, const_i64(j)), const_i64(16 * e)))
    be.ret_void()
    return fn


def _ptr(context, builder, aty, arr, off, half=False, byte=False):
    """&arr[off]; with ``half`` the array's memory read as float16 (i16) elements, with ``byte``
    as int8 elements, off counted in them."""
    a = context.make_array(aty)(context, builder, arr)
    data = a.data
    if byte:
        data = builder.bitcast(a.data, I8.as_pointer())
    elif half:
        data = builder.bitcast(a.data, I16.as_pointer())
    return builder.gep(data, [off])


def _scores_typer(q, q_off, nq, hd, kt, t_off, out, o_off, o_st, pf, widen=0, sc=None, sc_off=None):
    """out[o_off + j * o_st + l] = sum_d q[q_off + j * hd + d] * kt[t_off + d * 16 + l] for
    j < nq, l < 16 (one key tile against nq query heads). No bounds checks. pf: prefetch
    distance (bytes, 0 for none; None: PREFETCH_BYTES when the caller is compiled). widen: 0,
    kt holds float32 keys; else kt's memory holds float16 keys, t_off counted in them (None: the
    target's conversion, :func:`_widen_mode`); WIDEN_I8: int8 keys, t_off counted in bytes, with
    the tile's block scales at float offset sc_off of ``sc`` (:func:`_define_scores_q8`)."""
    q8 = widen == WIDEN_I8
    arrs = (q, kt, out) + ((sc,) if q8 else ())
    ints = (q_off, nq, hd, t_off, o_off, o_st) + ((sc_off,) if q8 else ())
    if not (all(isinstance(a, types.Array) and a.dtype == types.float32 and a.ndim == 1 for a in arrs)
            and all(isinstance(i, types.Integer) for i in ints)):
        return None
    sig = types.void(q, q_off, nq, hd, kt, t_off, out, o_off, o_st, *((sc, sc_off) if q8 else ()))

    def codegen(context, builder, sig, args):
        pf_ = PREFETCH_BYTES if pf is None else pf
        w_ = _widen_mode() if widen is None else widen
        c = [context.cast(builder, args[i], sig.args[i], types.int64) if isinstance(sig.args[i], types.Integer)
             else None for i in range(len(args))]
        qp = _ptr(context, builder, sig.args[0], args[0], c[1])
        tp = _ptr(context, builder, sig.args[4], args[4], c[5], half=bool(w_), byte=w_ == WIDEN_I8)
        op = _ptr(context, builder, sig.args[6], args[6], c[7])
        extra = [_ptr(context, builder, sig.args[9], args[9], c[10])] if q8 else []
        nq_, hd_, o_st_ = c[2], c[3], c[8]
        fn_ = builder.function

        def define(nh):
            if q8:
                return _define_scores_q8(builder.module, nh, pf_)
            return _define_scores(builder.module, nh, pf_, w_)
        # heads in passes of 4, then one pass of the remaining 1-3
        full = builder.sdiv(nq_, const_i64(HEADS_PER_PASS))
        bb, k, after, close = _counted_loop(fn_, builder, full, "sc4")
        j0 = bb.mul(k, const_i64(HEADS_PER_PASS))
        bb.call(define(HEADS_PER_PASS),
                [bb.gep(qp, [bb.mul(j0, hd_)]), hd_, tp, *extra, bb.gep(op, [bb.mul(j0, o_st_)]), o_st_])
        close(bb)
        rest0 = after.mul(full, const_i64(HEADS_PER_PASS))
        after2 = _remainder_pass(fn_, after, after.sub(nq_, rest0), lambda br, nh: br.call(
            define(nh), [br.gep(qp, [br.mul(rest0, hd_)]), hd_, tp, *extra, br.gep(op, [br.mul(rest0, o_st_)]),
                         o_st_]), "sc")
        builder.position_at_end(after2.block)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _scores_tiles(typingctx, q, q_off, nq, hd, kt, t_off, out, o_off, o_st):
    """out[o_off + j * o_st + l] = sum_d q[q_off + j * hd + d] * kt[t_off + d * 16 + l] for
    j < nq, l < 16 (one key tile against nq query heads). No bounds checks."""
    return _scores_typer(q, q_off, nq, hd, kt, t_off, out, o_off, o_st, 0)


@intrinsic
def _scores_tiles_stream(typingctx, q, q_off, nq, hd, kt, t_off, out, o_off, o_st):
    """:func:`_scores_tiles` with a prefetch PREFETCH_BYTES ahead in the key tiles (decode)."""
    return _scores_typer(q, q_off, nq, hd, kt, t_off, out, o_off, o_st, None)


def _pv_typer(s, s_off, s_st, nq, v, v_off, v_st, n, acc, hd, pf, widen=0, vs=None, vs_off=None, vs_st=None):
    """acc[j * hd + e] += sum_{i < n} s[s_off + j * s_st + i] * v[v_off + i * v_st + e] for
    j < nq, e < hd (hd a multiple of 16). No bounds checks. pf: prefetch distance (bytes, 0 for
    none; None: PREFETCH_BYTES when the caller is compiled). widen: as :func:`_scores_typer`
    (v_off, v_st counted in float16 elements when the values are float16); WIDEN_I8: int8 values
    (v_off, v_st in bytes), value e of row i times vs[vs_off + i * vs_st + e // Q8_BLOCK]."""
    q8 = widen == WIDEN_I8
    arrs = (s, v, acc) + ((vs,) if q8 else ())
    ints = (s_off, s_st, nq, v_off, v_st, n, hd) + ((vs_off, vs_st) if q8 else ())
    if not (all(isinstance(a, types.Array) and a.dtype == types.float32 and a.ndim == 1 for a in arrs)
            and all(isinstance(i, types.Integer) for i in ints)):
        return None
    sig = types.void(s, s_off, s_st, nq, v, v_off, v_st, n, acc, hd, *((vs, vs_off, vs_st) if q8 else ()))

    def codegen(context, builder, sig, args):
        pf_ = PREFETCH_BYTES if pf is None else pf
        w_ = _widen_mode() if widen is None else widen
        c = [context.cast(builder, args[i], sig.args[i], types.int64) if isinstance(sig.args[i], types.Integer)
             else None for i in range(len(args))]
        vsp = _ptr(context, builder, sig.args[10], args[10], c[11]) if q8 else None
        vs_st_ = c[12] if q8 else None
        sp = _ptr(context, builder, sig.args[0], args[0], c[1])
        vp = _ptr(context, builder, sig.args[4], args[4], c[5], half=bool(w_), byte=w_ == WIDEN_I8)
        ap = _ptr(context, builder, sig.args[8], args[8], const_i64(0))
        s_st_, nq_, v_st_, n_, hd_ = c[2], c[3], c[6], c[7], c[9]
        fn_ = builder.function
        module = builder.module
        b = builder
        def scales(bc, e):          # q8: the scales of the block holding column e, and their row stride
            return [bc.gep(vsp, [bc.sdiv(e, const_i64(Q8_BLOCK))]), vs_st_] if q8 else []

        # head passes (4 heads, then one of the remaining 1-3) x column chunks (64 values, then 16)
        def columns(bh, nh, j0):
            s_j = bh.gep(sp, [bh.mul(j0, s_st_)])
            a_j = bh.gep(ap, [bh.mul(j0, hd_)])
            wide = bh.sdiv(hd_, const_i64(16 * PV_VECTORS))
            bc, m, after_c, close_c = _counted_loop(fn_, bh, wide, f"pvc{nh}")
            e0 = bc.mul(m, const_i64(16 * PV_VECTORS))
            bc.call(_define_pv(module, nh, PV_VECTORS, pf_, w_, q8),
                    [s_j, s_st_, bc.gep(vp, [e0]), v_st_, n_, bc.gep(a_j, [e0]), hd_] + scales(bc, e0))
            close_c(bc)
            e_rest = after_c.mul(wide, const_i64(16 * PV_VECTORS))
            nrest = after_c.sdiv(after_c.sub(hd_, e_rest), const_i64(16))
            bd, m2, after_d, close_d = _counted_loop(fn_, after_c, nrest, f"pvd{nh}")
            e1 = bd.add(e_rest, bd.mul(m2, const_i64(16)))
            bd.call(_define_pv(module, nh, 1, pf_, w_, q8),
                    [s_j, s_st_, bd.gep(vp, [e1]), v_st_, n_, bd.gep(a_j, [e1]), hd_] + scales(bd, e1))
            close_d(bd)
            return after_d

        npass = b.sdiv(nq_, const_i64(HEADS_PER_PASS))
        bh, k, after_h, close_h = _counted_loop(fn_, b, npass, "pvh4")
        close_h(columns(bh, HEADS_PER_PASS, bh.mul(k, const_i64(HEADS_PER_PASS))))
        rest0 = after_h.mul(npass, const_i64(HEADS_PER_PASS))
        b = _remainder_pass(fn_, after_h, after_h.sub(nq_, rest0), lambda br, nh: columns(br, nh, rest0), "pv")
        builder.position_at_end(b.block)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _pv_rows(typingctx, s, s_off, s_st, nq, v, v_off, v_st, n, acc, hd):
    """acc[j * hd + e] += sum_{i < n} s[s_off + j * s_st + i] * v[v_off + i * v_st + e] for
    j < nq, e < hd (hd a multiple of 16). No bounds checks."""
    return _pv_typer(s, s_off, s_st, nq, v, v_off, v_st, n, acc, hd, 0)


@intrinsic
def _pv_rows_stream(typingctx, s, s_off, s_st, nq, v, v_off, v_st, n, acc, hd):
    """:func:`_pv_rows` with a prefetch ~PREFETCH_BYTES ahead in the value rows (decode)."""
    return _pv_typer(s, s_off, s_st, nq, v, v_off, v_st, n, acc, hd, None)


@intrinsic
def _scores_tiles_h(typingctx, q, q_off, nq, hd, kt, t_off, out, o_off, o_st):
    """:func:`_scores_tiles` over float16 keys (t_off counted in float16 elements)."""
    return _scores_typer(q, q_off, nq, hd, kt, t_off, out, o_off, o_st, 0, None)


@intrinsic
def _scores_tiles_stream_h(typingctx, q, q_off, nq, hd, kt, t_off, out, o_off, o_st):
    """:func:`_scores_tiles_stream` over float16 keys."""
    return _scores_typer(q, q_off, nq, hd, kt, t_off, out, o_off, o_st, None, None)


@intrinsic
def _pv_rows_h(typingctx, s, s_off, s_st, nq, v, v_off, v_st, n, acc, hd):
    """:func:`_pv_rows` over float16 values (v_off, v_st counted in float16 elements)."""
    return _pv_typer(s, s_off, s_st, nq, v, v_off, v_st, n, acc, hd, 0, None)


@intrinsic
def _pv_rows_stream_h(typingctx, s, s_off, s_st, nq, v, v_off, v_st, n, acc, hd):
    """:func:`_pv_rows_stream` over float16 values."""
    return _pv_typer(s, s_off, s_st, nq, v, v_off, v_st, n, acc, hd, None, None)


@intrinsic
def _scores_tiles_b(typingctx, q, q_off, nq, hd, kt, t_off, out, o_off, o_st, sc, sc_off):
    """:func:`_scores_tiles` over int8 keys (t_off counted in bytes), each Q8_BLOCK dimensions'
    sum times its keys' scales, the tile's (n_blocks, 16) float32 at sc[sc_off:]."""
    return _scores_typer(q, q_off, nq, hd, kt, t_off, out, o_off, o_st, 0, WIDEN_I8, sc, sc_off)


@intrinsic
def _scores_tiles_stream_b(typingctx, q, q_off, nq, hd, kt, t_off, out, o_off, o_st, sc, sc_off):
    """:func:`_scores_tiles_stream` over int8 keys (:func:`_scores_tiles_b`)."""
    return _scores_typer(q, q_off, nq, hd, kt, t_off, out, o_off, o_st, None, WIDEN_I8, sc, sc_off)


@intrinsic
def _pv_rows_b(typingctx, s, s_off, s_st, nq, v, v_off, v_st, n, acc, hd, vs, vs_off, vs_st):
    """:func:`_pv_rows` over int8 values (v_off, v_st counted in bytes), value e of row i times
    its block's scale vs[vs_off + i * vs_st + e // Q8_BLOCK]."""
    return _pv_typer(s, s_off, s_st, nq, v, v_off, v_st, n, acc, hd, 0, WIDEN_I8, vs, vs_off, vs_st)


@intrinsic
def _pv_rows_stream_b(typingctx, s, s_off, s_st, nq, v, v_off, v_st, n, acc, hd, vs, vs_off, vs_st):
    """:func:`_pv_rows_stream` over int8 values (:func:`_pv_rows_b`)."""
    return _pv_typer(s, s_off, s_st, nq, v, v_off, v_st, n, acc, hd, None, WIDEN_I8, vs, vs_off, vs_st)


def _widen16_typer(src, s_off, out, o_off, widen):
    if not (isinstance(src, types.Array) and isinstance(out, types.Array) and out.dtype == types.float32
            and src.ndim == 1 and out.ndim == 1 and src.dtype in (types.float32, types.uint16)
            and isinstance(s_off, types.Integer) and isinstance(o_off, types.Integer)):
        return None
    sig = types.void(src, s_off, out, o_off)

    def codegen(context, builder, sig, args):
        so = context.cast(builder, args[1], sig.args[1], types.int64)
        oo = context.cast(builder, args[3], sig.args[3], types.int64)
        sp = _ptr(context, builder, sig.args[0], args[0], so, half=sig.args[0].dtype == types.float32)
        sp = builder.bitcast(sp, I16.as_pointer())
        op = _ptr(context, builder, sig.args[2], args[2], oo)
        _vstore(builder, _vload_kv(builder, sp, const_i64(0), _widen_mode() if widen is None else widen), op, const_i64(0))
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def widen16_f16c(typingctx, src, s_off, out, o_off):
    """out[o_off:o_off+16] = the 16 float16 values at element s_off of src, by LLVM's fpext
    (the attention kernels' conversion on F16C hosts; a test checks every bit pattern)."""
    return _widen16_typer(src, s_off, out, o_off, WIDEN_F16C)


@intrinsic
def widen16_generic(typingctx, src, s_off, out, o_off):
    """:func:`widen16_f16c` by integer operations (the kernels' conversion without F16C)."""
    return _widen16_typer(src, s_off, out, o_off, WIDEN_GENERIC)


@intrinsic
def _load_h(typingctx, arr, idx):
    """float32 value of the float16 element ``idx`` of ``arr``'s memory (the target's conversion)."""
    if not (isinstance(arr, types.Array) and isinstance(idx, types.Integer)):
        return None
    sig = types.float32(arr, idx)

    def codegen(context, builder, sig, args):
        i = context.cast(builder, args[1], sig.args[1], types.int64)
        p = _ptr(context, builder, sig.args[0], args[0], i, half=True)
        h = builder.load(p, align=2)
        vec = builder.insert_element(ir.Constant(_VI16, ir.Undefined), h, ir.Constant(I32, 0))
        return builder.extract_element(_widen_h16(builder, vec, _widen_mode()), ir.Constant(I32, 0))
    return sig, codegen


@intrinsic
def _fdiv(typingctx, a, b):
    """a / b for float32 operands as one IEEE division (no fast-math flags, which a caller
    compiled with fastmath would otherwise pass on: x / 127 became x * (1 / 127))."""
    if not (a == types.float32 and b == types.float32):
        return None
    sig = types.float32(a, b)

    def codegen(context, builder, sig, args):
        return fdiv_ieee(builder, args[0], args[1])
    return sig, codegen


@intrinsic
def _load_b(typingctx, arr, idx):
    """float32 value of the int8 element (byte) ``idx`` of ``arr``'s memory."""
    if not (isinstance(arr, types.Array) and isinstance(idx, types.Integer)):
        return None
    sig = types.float32(arr, idx)

    def codegen(context, builder, sig, args):
        i = context.cast(builder, args[1], sig.args[1], types.int64)
        return builder.sitofp(builder.load(_ptr(context, builder, sig.args[0], args[0], i, byte=True), align=1), F32)
    return sig, codegen


@intrinsic
def _store_b(typingctx, arr, idx, q):
    """Store the integer ``q`` (-127 .. 127) as the int8 element (byte) ``idx`` of ``arr``'s memory."""
    if not (isinstance(arr, types.Array) and isinstance(idx, types.Integer) and isinstance(q, types.Integer)):
        return None
    sig = types.void(arr, idx, q)

    def codegen(context, builder, sig, args):
        i = context.cast(builder, args[1], sig.args[1], types.int64)
        builder.store(builder.trunc(args[2], I8), _ptr(context, builder, sig.args[0], args[0], i, byte=True), align=1)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def _store_h(typingctx, arr, idx, bits):
    """Store the float16 bit pattern ``bits`` (an integer) as element ``idx`` of ``arr``'s memory."""
    if not (isinstance(arr, types.Array) and isinstance(idx, types.Integer) and isinstance(bits, types.Integer)):
        return None
    sig = types.void(arr, idx, bits)

    def codegen(context, builder, sig, args):
        i = context.cast(builder, args[1], sig.args[1], types.int64)
        p = _ptr(context, builder, sig.args[0], args[0], i, half=True)
        builder.store(builder.trunc(args[2], I16), p, align=2)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def _f32_bits(typingctx, x):
    """The IEEE bit pattern of a float32, as int64 (0 .. 2^32 - 1)."""
    if x != types.float32:
        return None
    sig = types.int64(x)

    def codegen(context, builder, sig, args):
        return builder.zext(builder.bitcast(args[0], I32), I64)
    return sig, codegen


@njit(cache=True, inline="always")
def f16_bits(x):
    """float32 -> float16 bit pattern, rounded to nearest even (as numpy's astype(float16)):
    integer operations only, so the result is the same on every host. Overflow gives infinity,
    a NaN the quiet NaN 0x7e00 (with its sign)."""
    b = _f32_bits(np.float32(x))
    sign = (b >> 16) & 0x8000
    e = (b >> 23) & 0xFF
    m = b & 0x7FFFFF
    if e == 0xFF:
        return sign | (0x7E00 if m != 0 else 0x7C00)
    if e > 142:                                  # >= 2^16: beyond the largest half (65504)
        return sign | 0x7C00
    if e < 113:                                  # below 2^-14: a half subnormal (units of 2^-24) or 0
        if e < 102:                              # below 2^-25: rounds to zero
            return sign
        m = m | 0x800000
        shift = 126 - e                          # 14 .. 24
        q = m >> shift
        rem = m & ((1 << shift) - 1)
        halfway = 1 << (shift - 1)
        if rem > halfway or (rem == halfway and (q & 1) == 1):
            q += 1
        return sign | q
    q = ((e - 112) << 10) | (m >> 13)
    rem = m & 0x1FFF
    if rem > 0x1000 or (rem == 0x1000 and (q & 1) == 1):
        q += 1                                   # a carry into the exponent is right (up to inf)
    return sign | q


@njit(cache=True, nogil=True)
def kv_write_h(values, out):
    """out[i] = float16 bit pattern of values[i] (kv_write's rounding, for tests and references)."""
    for i in range(values.size):
        out[i] = f16_bits(values[i])


@njit(cache=True, nogil=True, error_model="numpy", fastmath=False)
def q8_row(arena, src, state, dst, step, si, sstep, hd):
    """Store the hd values arena[src:src + hd] as int8 bytes dst, dst + step, ... of ``state``'s
    memory with a float32 scale per Q8_BLOCK values (the last block may be shorter): block b's
    scale state[si + b * sstep] = max|x| / 127 over its values, q = rint(x * (127 / max|x|)),
    within [-127, 127] (symmetric, as ggml's Q8_0). A block of zeros stores zeros and scale 0.
    ``fastmath=False`` is explicit: a callee without it inherits the caller's (attention's), and
    fastmath's reciprocal rewrites (x / 127 as x * (1 / 127)) changed scales in their last bit.
    The divisions are single IEEE ones (:func:`_fdiv`) for the same reason."""
    for b0 in range(0, hd, Q8_BLOCK):
        b1 = min(b0 + Q8_BLOCK, hd)
        amax = np.float32(0.0)
        for d in range(b0, b1):
            a = abs(arena[src + d])
            amax = a if a > amax else amax
        inv = np.float32(0.0)
        if amax > 0:
            inv = _fdiv(np.float32(127.0), amax)
        for d in range(b0, b1):
            q = np.rint(arena[src + d] * inv)
            q = min(max(q, np.float32(-127.0)), np.float32(127.0))
            _store_b(state, dst + d * step, np.int64(q))
        state[si + (b0 // Q8_BLOCK) * sstep] = _fdiv(amax, np.float32(127.0))


def q8_quantize_ref(x, block=Q8_BLOCK):
    """numpy reference of :func:`q8_row` over the last axis (head_dim values) with a scale per
    ``block`` values (the last block may be shorter): (int8 values (..., head_dim), float32
    scales (..., ceil(head_dim / block)))."""
    x = np.asarray(x, np.float32)
    hd = x.shape[-1]
    nb = (hd + block - 1) // block
    pad = np.zeros(x.shape[:-1] + (nb * block,), np.float32)
    pad[..., :hd] = x
    blocks = pad.reshape(x.shape[:-1] + (nb, block))
    amax = np.abs(blocks).max(-1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    q = np.clip(np.rint(blocks * inv[..., None]), -127, 127).astype(np.int8)
    return q.reshape(pad.shape)[..., :hd], (amax / np.float32(127.0)).astype(np.float32)


def q8_rows_ref(x):
    """The 8-bit cache's rounding of rows (..., head_dim): :func:`q8_quantize_ref` in Q8_BLOCKs."""
    return q8_quantize_ref(x, Q8_BLOCK)


def kv_base(kv16, c_off):
    """The element offset of a cache region at float offset ``c_off``, in its format's elements
    (float32: c_off; float16: 2 * c_off; int8: 4 * c_off)."""
    raise NotImplementedError("called from compiled code only")


@overload(kv_base)
def _ov_kv_base(kv16, c_off):
    kind = _kv_kind(kv16)
    if kind == KV_Q8:
        return lambda kv16, c_off: 4 * c_off
    if kind == KV_F16:
        return lambda kv16, c_off: 2 * c_off
    return lambda kv16, c_off: c_off


def _write_row(kv16, arena, src, state, dst, step, si, sstep, hd):
    """Store the hd values arena[src:] as cache elements dst, dst + step, ... in the format of
    ``kv16`` (float32 as they are; float16 rounded to nearest even; int8 with their block scales
    at state[si], state[si + sstep], ..., :func:`q8_row`)."""
    raise NotImplementedError("called from compiled code only")


@overload(_write_row)
def _ov_write_row(kv16, arena, src, state, dst, step, si, sstep, hd):
    kind = _kv_kind(kv16)
    if kind == KV_Q8:
        def impl(kv16, arena, src, state, dst, step, si, sstep, hd):
            q8_row(arena, src, state, dst, step, si, sstep, hd)
    elif kind == KV_F16:
        def impl(kv16, arena, src, state, dst, step, si, sstep, hd):
            for d in range(hd):
                _store_h(state, dst + d * step, f16_bits(arena[src + d]))
    else:
        def impl(kv16, arena, src, state, dst, step, si, sstep, hd):
            for d in range(hd):
                state[dst + d * step] = arena[src + d]
    return impl


def _load_kv(kv16, state, idx):
    """Cache element ``idx`` (counted in the format's elements) as float32."""
    raise NotImplementedError("called from compiled code only")


@overload(_load_kv)
def _ov_load_kv(kv16, state, idx):
    kind = _kv_kind(kv16)
    if kind == KV_Q8:
        return lambda kv16, state, idx: _load_b(state, idx)
    if kind == KV_F16:
        return lambda kv16, state, idx: _load_h(state, idx)
    return lambda kv16, state, idx: state[idx]


def q8_scales_offset(c_off, n_kv, cap, head_dim):
    """Float offset, in ``state``, of an 8-bit region's scales: the keys' (n_kv, cap // 16,
    n_blocks, 16) float32, then the values' (n_kv, cap, n_blocks), after the int8 keys and values
    (2 * n_kv * cap * head_dim bytes from byte 4 * c_off)."""
    return c_off + n_kv * cap * head_dim // 2


@njit(cache=True, inline="always")
def q8_head_scales(c_off, n_kv, cap, head_dim, h):
    """(float offset of KV head h's key scales, of its value scales) in an 8-bit region at c_off
    (:func:`q8_scales_offset`; other formats never read them)."""
    nb = (head_dim + Q8_BLOCK - 1) // Q8_BLOCK
    s_base = c_off + n_kv * cap * head_dim // 2
    return s_base + h * cap * nb, s_base + (n_kv + h) * cap * nb


@njit(cache=True, nogil=True)
def kv_write(arena, state, k_off, k_st, v_off, v_st, n_kv, head_dim, c_off, cap, pos0, T, kv16):
    """Copy the T new key/value rows into their cache slots (keys into their tile lane), in the
    format ``kv16`` selects (:func:`kv_operand`): float32 as they are; float16 (from element
    2 * c_off) each rounded to nearest even (:func:`f16_bits`); int8 (from byte 4 * c_off) with
    a scale per Q8_BLOCK values of each (slot, KV head) row of keys and of values (:func:`q8_row`;
    the keys' scales tiled as the keys are)."""
    base = kv_base(kv16, c_off)
    size = n_kv * cap * head_dim
    v_base = base + size
    nb = (head_dim + Q8_BLOCK - 1) // Q8_BLOCK
    for t in range(T):
        slot = (pos0 + t) % cap
        tile_base = (slot // TILE) * head_dim * TILE + slot % TILE
        for h in range(n_kv):
            ks, vs = q8_head_scales(c_off, n_kv, cap, head_dim, h)     # int8 only
            kdst = base + h * cap * head_dim + tile_base
            vdst = v_base + h * cap * head_dim + slot * head_dim
            src_k = k_off + t * k_st + h * head_dim
            src_v = v_off + t * v_st + h * head_dim
            _write_row(kv16, arena, src_k, state, kdst, TILE, ks + (slot // TILE) * nb * TILE + slot % TILE, TILE,
                       head_dim)
            _write_row(kv16, arena, src_v, state, vdst, 1, vs + slot * nb, 1, head_dim)


_NO_REASSOC = {"nnan", "ninf", "nsz", "arcp", "afn"}
"""fastmath without "reassoc" (and "contract") for everything a job computes between the cache
reads and its output: the sums then run in written order, so :func:`attention` and the batched
decode give the same bits whether each was compiled in this process or loaded from numba's cache
(with "reassoc", a batched decode compiled beside an ``attention`` loaded from the cache
differed in the last bit on 5 of 10 shapes of tests/test_kernels_attention_batch.py)."""


def _carried_loop(fn, b, start, stop, carried, body, name):
    """for i in range(start, stop) as IR blocks carrying the values ``carried`` (a list):
    ``body(builder, i, values)`` returns the next values. Returns (builder after, final values)."""
    pre = b.block
    head = fn.append_basic_block(name + "_head")
    blk = fn.append_basic_block(name + "_body")
    end = fn.append_basic_block(name + "_end")
    b.branch(head)
    bh = ir.IRBuilder(head)
    i = bh.phi(I64)
    i.add_incoming(start, pre)
    vals = [bh.phi(v.type) for v in carried]
    for ph, v in zip(vals, carried):
        ph.add_incoming(v, pre)
    bh.cbranch(bh.icmp_signed("<", i, stop), blk, end)
    bb = ir.IRBuilder(blk)
    nxt = body(bb, i, vals)
    i.add_incoming(bb.add(i, const_i64(1)), bb.block)
    for ph, v in zip(vals, nxt):
        ph.add_incoming(v, bb.block)
    bb.branch(head)
    return ir.IRBuilder(end), vals


@intrinsic
def _softmax_row(typingctx, s, off, n, softcap, mx, tot, j):
    """Soft-capping when softcap > 0 (s = softcap * tanh(s / softcap)), then s[off : off + n] =
    exp_f32(s - m) with m their max (n >= 1); mx[j] = m, tot[j] = the sum of the exponentials,
    summed in 16 lanes over whole blocks of 16, the lanes added in order, then the last n % 16 one
    by one: the order a numba loop over :func:`exp_f32` summed them in, with the same bits
    (:func:`cpullm_kernels.ops.vmath.exp_f32_ir`), but in vectors: numba ran those loops an element
    at a time, and the softmax took a third of SmolLM2's prefill attention (1.8 of 5.8 ms a layer
    at 512 tokens, AVX2, one thread; 0.8 ms in vectors)."""
    if not (all(isinstance(a, types.Array) and a.dtype == types.float32 for a in (s, mx, tot))
            and all(isinstance(i, types.Integer) for i in (off, n, j)) and isinstance(softcap, types.Float)):
        return None
    sig = types.void(s, off, n, softcap, mx, tot, j)

    def codegen(context, builder, sig, args):
        off_, n_, j_ = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (1, 2, 6))
        cap = context.cast(builder, args[3], sig.args[3], types.float32)
        builder.call(_define_softmax_row(builder.module), [
            _ptr(context, builder, sig.args[0], args[0], off_), n_, cap,
            _ptr(context, builder, sig.args[4], args[4], j_), _ptr(context, builder, sig.args[5], args[5], j_)])
        return context.get_dummy_value()
    return sig, codegen


def _define_softmax_row(module):
    """void @cpullm_softmax_row_v1(f32* p, i64 n, f32 softcap, f32* mx, f32* tot): the body of
    :func:`_softmax_row`. Always inlined: called, it took SmolLM2's prefill attention on 2 threads
    from 109 to 162 ms (AVX2, 512 tokens; 200 ms on one thread either way)."""
    name = "cpullm_softmax_row_v1"
    fn = module.globals.get(name)
    if fn is not None:
        return fn
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [_PF, I64, F32, _PF, _PF]), name)
    fn.linkage = "internal"
    fn.attributes.add("alwaysinline")
    fn.attributes.add("nounwind")
    p, n_, cap, mxp, totp = fn.args
    builder = ir.IRBuilder(fn.append_basic_block("entry"))
    blocks = builder.sdiv(n_, const_i64(TILE))
    n16 = builder.mul(blocks, const_i64(TILE))
    with builder.if_then(builder.fcmp_ordered(">", cap, ir.Constant(F32, 0.0))):
        caps = _splat(builder, cap)

        def vcap(b, i, v):
            o = b.mul(i, const_i64(TILE))
            _vstore(b, b.fmul(caps, tanh_f32_ir(b, fdiv_ieee(b, _vload(b, p, o), caps))), p, o)
            return []

        def scap(b, i, v):
            q = b.gep(p, [i])
            b.store(b.fmul(cap, tanh_f32_ir(b, fdiv_ieee(b, b.load(q, align=4), cap))), q, align=4)
            return []
        b, _ = _carried_loop(fn, builder, const_i64(0), blocks, [], vcap, "scap")
        b, _ = _carried_loop(fn, b, n16, n_, [], scap, "scapt")
        builder.position_at_end(b.block)
    m0 = builder.load(p, align=4)
    rem = builder.trunc(builder.sub(n_, n16), I32)
    tail = builder.icmp_signed("<", ir.Constant(_VI32, list(range(TILE))),
                               builder.shuffle_vector(builder.insert_element(ir.Constant(_VI32, ir.Undefined), rem, ir.Constant(I32, 0)),
                                                      ir.Constant(_VI32, ir.Undefined), ir.Constant(_VI32, [0] * TILE)))
    ld = declare(builder.module, "llvm.masked.load.v16f32.p0", _VF,
                 [_VF.as_pointer(), I32, ir.VectorType(ir.IntType(1), TILE), _VF])
    st = declare(builder.module, "llvm.masked.store.v16f32.p0", ir.VoidType(),
                 [_VF, _VF.as_pointer(), I32, ir.VectorType(ir.IntType(1), TILE)])

    def vmax(b, i, v):
        x = _vload(b, p, b.mul(i, const_i64(TILE)))
        return [b.select(b.fcmp_ordered(">", x, v[0]), x, v[0])]
    b, (lanes,) = _carried_loop(fn, builder, const_i64(0), blocks, [_splat(builder, m0)], vmax, "smax")
    tp = b.bitcast(b.gep(p, [n16]), _VF.as_pointer())
    x = b.call(ld, [tp, ir.Constant(I32, 4), tail, ir.Constant(_VF, [float("-inf")] * TILE)])
    lanes = b.select(b.fcmp_ordered(">", x, lanes), x, lanes)
    w = TILE
    while w > 1:                         # the max of the lanes: any order gives the same value
        w //= 2
        hi = b.shuffle_vector(lanes, lanes, ir.Constant(_VI32, [w + k if k < w else k for k in range(TILE)]))
        lanes = b.select(b.fcmp_ordered(">", hi, lanes), hi, lanes)
    m = b.extract_element(lanes, ir.Constant(I32, 0))
    ms = _splat(b, m)

    def vexp(b, i, v):
        o = b.mul(i, const_i64(TILE))
        e = exp_f32_ir(b, b.fsub(_vload(b, p, o), ms))
        _vstore(b, e, p, o)
        return [b.fadd(v[0], e)]
    b, (acc,) = _carried_loop(fn, b, const_i64(0), blocks, [ir.Constant(_VF, [0.0] * TILE)], vexp, "sexp")
    total = ir.Constant(F32, 0.0)
    for k in range(TILE):
        total = b.fadd(total, b.extract_element(acc, ir.Constant(I32, k)))
    et = exp_f32_ir(b, b.fsub(b.call(ld, [tp, ir.Constant(I32, 4), tail, ir.Constant(_VF, [0.0] * TILE)]), ms))
    b.call(st, [et, tp, ir.Constant(I32, 4), tail])

    def sadd(b, i, v):                   # the last n % 16, one by one
        return [b.fadd(v[0], b.extract_element(et, b.trunc(b.sub(i, n16), I32)))]
    b, (total,) = _carried_loop(fn, b, n16, n_, [total], sadd, "ssum")
    b.store(m, mxp, align=4)
    b.store(total, totp, align=4)
    b.ret_void()
    return fn


@njit(cache=True, fastmath=_NO_REASSOC, error_model="numpy", inline="always")
def _softmax_rows(scores, width, nq, c0, c1, softcap, mx, tot):
    """Columns [c0, c1) of rows 0..nq-1 of ``scores`` (flat, rows of ``width``): soft-capped,
    exp(s - max); mx[j] the row's max, tot[j] its sum of exponentials (:func:`_softmax_row`)."""
    for j in range(nq):
        _softmax_row(scores, j * width + c0, c1 - c0, np.float32(softcap), mx, tot, j)


def _scores(stream, kv16, q, nq, hd, kt, t_off, out, o_off, o_st, sc_off):
    """_scores_tiles (q from offset 0) over the cache format of ``kv16``, with the key-stream
    prefetch when ``stream``. int8 keys: each block's sums times the tile's key scales at float
    offset ``sc_off`` of ``kt`` (:func:`_scores_tiles_b`; other formats ignore sc_off)."""
    raise NotImplementedError("called from compiled code only")


@overload(_scores)
def _ov_scores(stream, kv16, q, nq, hd, kt, t_off, out, o_off, o_st, sc_off):
    kind = _kv_kind(kv16)
    if kind == KV_Q8:
        def impl(stream, kv16, q, nq, hd, kt, t_off, out, o_off, o_st, sc_off):
            if stream:
                _scores_tiles_stream_b(q, 0, nq, hd, kt, t_off, out, o_off, o_st, kt, sc_off)
            else:
                _scores_tiles_b(q, 0, nq, hd, kt, t_off, out, o_off, o_st, kt, sc_off)
    elif kind == KV_F16:
        def impl(stream, kv16, q, nq, hd, kt, t_off, out, o_off, o_st, sc_off):
            if stream:
                _scores_tiles_stream_h(q, 0, nq, hd, kt, t_off, out, o_off, o_st)
            else:
                _scores_tiles_h(q, 0, nq, hd, kt, t_off, out, o_off, o_st)
    else:
        def impl(stream, kv16, q, nq, hd, kt, t_off, out, o_off, o_st, sc_off):
            if stream:
                _scores_tiles_stream(q, 0, nq, hd, kt, t_off, out, o_off, o_st)
            else:
                _scores_tiles(q, 0, nq, hd, kt, t_off, out, o_off, o_st)
    return impl


def _pv(stream, kv16, s, s_off, s_st, nq, v, v_off, n, acc, hd, vs_off):
    """_pv_rows over n consecutive value rows (row stride hd) in the cache format of ``kv16``,
    with the prefetch when ``stream`` (int8 values: each times its block's scale, the rows'
    scales at float offset ``vs_off`` of ``v``, n_blocks a row; other formats ignore vs_off)."""
    raise NotImplementedError("called from compiled code only")


@overload(_pv)
def _ov_pv(stream, kv16, s, s_off, s_st, nq, v, v_off, n, acc, hd, vs_off):
    kind = _kv_kind(kv16)
    if kind == KV_Q8:
        def impl(stream, kv16, s, s_off, s_st, nq, v, v_off, n, acc, hd, vs_off):
            nb = (hd + Q8_BLOCK - 1) // Q8_BLOCK
            if stream:
                _pv_rows_stream_b(s, s_off, s_st, nq, v, v_off, hd, n, acc, hd, v, vs_off, nb)
            else:
                _pv_rows_b(s, s_off, s_st, nq, v, v_off, hd, n, acc, hd, v, vs_off, nb)
    elif kind == KV_F16:
        def impl(stream, kv16, s, s_off, s_st, nq, v, v_off, n, acc, hd, vs_off):
            if stream:
                _pv_rows_stream_h(s, s_off, s_st, nq, v, v_off, hd, n, acc, hd)
            else:
                _pv_rows_h(s, s_off, s_st, nq, v, v_off, hd, n, acc, hd)
    else:
        def impl(stream, kv16, s, s_off, s_st, nq, v, v_off, n, acc, hd, vs_off):
            if stream:
                _pv_rows_stream(s, s_off, s_st, nq, v, v_off, hd, n, acc, hd)
            else:
                _pv_rows(s, s_off, s_st, nq, v, v_off, hd, n, acc, hd)
    return impl


def _value_scale(kv16, state, vs_row, d):
    """int8 values: the scale of column d of the value row whose scales start at float offset
    ``vs_row``; other formats: 1."""
    raise NotImplementedError("called from compiled code only")


@overload(_value_scale)
def _ov_value_scale(kv16, state, vs_row, d):
    if _kv_kind(kv16) != KV_Q8:
        return lambda kv16, state, vs_row, d: np.float32(1.0)
    return lambda kv16, state, vs_row, d: state[vs_row + d // Q8_BLOCK]


@njit(cache=True, fastmath=_NO_REASSOC, error_model="numpy")
def attend_part(arena, state, q0, nq, hd, k_base, v_base, ks_base, vs_base, cap, lo, p, scale, softcap, qbuf,
                 scores, acc, mx, tot, stream, kv16):
    """Query heads q0 .. q0 + nq - 1 (arena offsets q0 + j*hd) of one KV head (keys at k_base,
    values at v_base in ``state``, counted in the cache format's elements; an int8 cache's
    block scales of this head at float offsets ks_base and vs_base, :func:`q8_head_scales`) over cached
    positions [lo, p] (p >= lo): acc[j*hd:] the
    unnormalized sum of exp(s - mx[j]) * value rows, tot[j] the sum of the exponentials.

    Scratch: qbuf (>= nq*hd), scores flat (>= nq * (n + 32)); acc (>= nq*hd), mx, tot (>= nq).
    Score column c is position lo - lo % 16 + c, read from tile ((lo % cap) // 16 + c // 16) mod
    (cap / 16); only columns [lo % 16, lo % 16 + n) enter the softmax. ``stream``: the cache is
    read from DRAM (decode), so the key and value loops prefetch PREFETCH_BYTES ahead."""
    n = p - lo + 1
    for j in range(nq):
        for d in range(hd):
            qbuf[j * hd + d] = arena[q0 + j * hd + d] * np.float32(scale)
    a = lo % cap
    c0 = a % TILE
    ntiles_cap = cap // TILE
    nt = (c0 + n + TILE - 1) // TILE
    width = nt * TILE
    t0 = a // TILE
    nb = (hd + Q8_BLOCK - 1) // Q8_BLOCK           # int8 caches: scales per row
    for c in range(nt):
        tile = t0 + c
        if tile >= ntiles_cap:
            tile -= ntiles_cap
        _scores(stream, kv16, qbuf, nq, hd, state, k_base + tile * hd * TILE, scores, c * TILE, width,
                ks_base + tile * nb * TILE)
    _softmax_rows(scores, width, nq, c0, c0 + n, softcap, mx, tot)
    for i in range(nq * hd):
        acc[i] = 0.0
    first = min(n, cap - a)                      # slots a .. a + first - 1, then 0 .. n - first - 1
    if hd % TILE == 0:
        _pv(stream, kv16, scores, c0, width, nq, state, v_base + a * hd, first, acc, hd, vs_base + a * nb)
        if first < n:
            _pv(stream, kv16, scores, c0 + first, width, nq, state, v_base, n - first, acc, hd, vs_base)
    else:                                        # head_dim not a multiple of 16: plain loops
        pv_plain_at(state, scores, c0, width, nq, v_base, vs_base, a, n, cap, acc, hd, kv16)


@njit(cache=True, fastmath=_NO_REASSOC, error_model="numpy")
def pv_plain(state, scores, c0, width, nq, v_base, vs_base, a, n, cap, acc, hd, kv16):
    """:func:`attend_part`'s weighted sum of values in plain loops, for a head_dim that is not a
    multiple of 16: acc[j*hd + d] += sum over the n slots a, a + 1, ... (mod cap) of score column
    c0 + i (rows of ``width``) times the value. A kernel of its own, called through its address
    and bound only for such a head_dim (no supported model has one): inside attend_part, the
    float16-cache attention unit compiled in a median of 6.0 s of CPU, without it 5.6 s (5
    alternating runs, 2-core Ice Lake)."""
    nb = (hd + Q8_BLOCK - 1) // Q8_BLOCK
    s2 = scores[: nq * width].reshape(nq, width)
    for i in range(n):
        slot = a + i
        if slot >= cap:
            slot -= cap
        r0 = v_base + slot * hd
        for j in range(nq):
            w = s2[j, c0 + i]
            aj = acc[j * hd: j * hd + hd]
            for d in range(hd):
                aj[d] += w * (_load_kv(kv16, state, r0 + d) * _value_scale(kv16, state, vs_base + slot * nb, d))


def pv_plain_signature(kv) -> tuple:
    """pv_plain's argument types for the KV operand type ``kv`` (one of KV_OPERANDS)."""
    return (ARENA, ARENA, *[i64] * 8, ARENA, i64, kv)


PV_PLAIN = Addressed(pv_plain, types.none, [pv_plain_signature(kv) for kv in KV_OPERANDS])
pv_plain_at = PV_PLAIN.call
pv_plain_ready = PV_PLAIN.ensure


def attend_part_signature(kv) -> tuple:
    """attend_part's argument types for the KV operand type ``kv`` (one of KV_OPERANDS)."""
    return (ARENA, ARENA, *[i64] * 10, f64, f64, ARENA, ARENA, ARENA, ARENA, ARENA, types.boolean, kv)


ATTEND_PART = Addressed(attend_part, types.none, [attend_part_signature(kv) for kv in KV_OPERANDS])
"""attend_part, called through its address (cpullm_kernels.setup.addressed) by the parallel loops of
:func:`attention` and the batched decode: linked, its code was compiled again inside each (with
the two linked, attention took 8.9-9.9 s of a cold start's CPU, 3.4 s without attend_part's 2 s)."""
attend_part_at = ATTEND_PART.call
attend_part_ready = ATTEND_PART.ensure


@njit(cache=True, inline="always")
def attend_part_bind(arena, kv16, hd):
    """Bind attend_part's specialization for ``kv16`` before a parallel region calls it (a worker
    thread must not bind: cpullm_kernels.setup.addressed), and :func:`pv_plain`'s where head_dim
    ``hd`` needs it."""
    z, f = np.int64(0), np.float64(0.0)
    attend_part_ready(arena, arena, z, z, z, z, z, z, z, z, z, z, f, f, arena, arena, arena, arena, arena, False,
                      kv16)
    if hd % TILE != 0:
        pv_plain_ready(arena, arena, z, z, z, z, z, z, z, z, arena, z, kv16)


@njit(cache=True, inline="always")
def aligned_scratch(n):
    """n float32 of scratch starting on a 64-byte boundary. The kernels load the scores and sums
    in 64-byte vectors, and numba's np.empty does not promise that alignment: with rows that
    straddled cache lines one run of SmolLM2's prefill attention took 5.9 ms and the next 3.2
    (AVX2, 512 tokens)."""
    buf = np.empty(n + TILE, np.float32)
    skip = (64 - buf.ctypes.data % 64) % 64 // 4
    return buf[skip: skip + n]


@njit(cache=True, inline="always")
def key_splits(pairs, nthreads, pos0):
    """Key ranges per (query row, KV head) pair: 1, or enough that ``pairs`` jobs fill (or
    divide evenly over) the threads, each range at least MIN_SPLIT_KEYS keys (the first row's
    position ``pos0`` bounds the keys)."""
    if pairs < nthreads or (pairs % nthreads != 0 and pairs < BALANCE_PAIRS * nthreads):
        return max(1, min(nthreads // math.gcd(pairs, nthreads), (pos0 + 1) // MIN_SPLIT_KEYS))
    return 1


@njit(cache=True, fastmath=_NO_REASSOC, error_model="numpy")
def normalize_into(out, o0, acc, tot, nq, hd):
    """out[o0 + j*hd + d] = acc[j*hd + d] / tot[j]: a job's heads when its keys were not split."""
    for j in range(nq):
        inv = np.float32(1.0) / tot[j]
        for d in range(hd):
            out[o0 + j * hd + d] = acc[j * hd + d] * inv


@njit(cache=True, fastmath=_NO_REASSOC, error_model="numpy")
def keep_part(part, job, acc, mx, tot, nq, hd):
    """part[job, j] = (acc[j*hd:(j+1)*hd], mx[j], tot[j]): one key range's partial softmax."""
    for j in range(nq):
        for d in range(hd):
            part[job, j, d] = acc[j * hd + d]
        part[job, j, hd] = mx[j]
        part[job, j, hd + 1] = tot[j]


@njit(cache=True, fastmath=_NO_REASSOC, error_model="numpy")
def combine_parts(out, o0, part, first, stride, nsplit, nq, hd):
    """out[o0 + j*hd:] for heads j < nq from the key ranges part[first + r*stride], r < nsplit:
    rescale each range's sums to the common max, add, normalize (flash-decoding's combine).
    :func:`attention` and the batched decode share it, so their rows agree to the bit."""
    for j in range(nq):
        m = part[first, j, hd]
        for r in range(1, nsplit):
            m = max(m, part[first + r * stride, j, hd])
        total = np.float32(0.0)
        for d in range(hd):                  # loops, not array expressions: in a parallel
            out[o0 + j * hd + d] = 0.0       # function those become parallel regions
        for r in range(nsplit):
            row = part[first + r * stride, j]
            w = exp_f32(row[hd] - m)
            total += w * row[hd + 1]
            for d in range(hd):
                out[o0 + j * hd + d] += w * row[d]
        inv = np.float32(1.0) / total
        for d in range(hd):
            out[o0 + j * hd + d] *= inv


MAX_CHUNKS = 64
"""Parallel chunks of jobs per call (each allocates its scratch once): numba's static schedule
gives each thread a contiguous range of chunks, and chunk c takes jobs c, c + 64, ..."""

MIN_SPLIT_KEYS = 2 * TILE
"""Fewest keys per range when :func:`attention` splits a (query row, KV head) pair's keys."""

STREAM_ROWS = 4
"""Chunks of at most this many query rows (decode) read the KV cache with software prefetch:
between tokens the weights streamed through the caches evict it (decode at 576 keys: -16-19 %
per layer with 8 KiB ahead). Prefill chunks, whose cache is warm, do not prefetch: it only cost
them time."""

BALANCE_PAIRS = 4
"""With fewer than this many (query row, KV head) pairs per thread that do not divide evenly
over the threads (decode of SmolLM2's 3 KV heads on 2 threads), :func:`attention` splits each
pair's keys so that every thread gets the same number of equal jobs."""


@njit(cache=True, inline="always")
def job_scratch(group, hd, span):
    """One chunk's scratch for :func:`attend_part` jobs of ``group`` query heads of ``hd`` over at
    most ``span`` keys: (qbuf, acc, mx, tot, scores)."""
    return (aligned_scratch(group * hd), aligned_scratch(group * hd), np.empty(group, np.float32),
            np.empty(group, np.float32), aligned_scratch(group * (span + 2 * TILE)))


@njit(cache=True, error_model="numpy")
def attend_chunk(arena, state, c, nchunk, jobs, T, splits, window, pos0, q_off, q_st, o_off, o_st, group, hd,
                 base, size, cap, c_off, n_kv, span, scale, softcap, part, kv16):
    """Jobs c, c + nchunk, ... of :func:`attention`'s parallel loop, with this chunk's own
    scratch. A function of its own, called through its address: as the loop's body, numba compiled
    it into the parallel region's function and again into attention."""
    qbuf, acc, mx, tot, scores = job_scratch(group, hd, span)
    for job in range(c, jobs, nchunk):
        kvh = job // (T * splits)
        s = (job // T) % splits
        t = job % T
        p = pos0 + t
        lo = 0
        if window > 0:
            lo = max(0, p - window + 1)
        n = p - lo + 1
        k0 = lo + n * s // splits                # this job's keys: [k0, k1]
        k1 = lo + n * (s + 1) // splits - 1
        q0 = q_off + t * q_st + kvh * group * hd
        ks, vs = q8_head_scales(c_off, n_kv, cap, hd, kvh)
        attend_part_at(arena, state, q0, group, hd, base + kvh * cap * hd, base + size + kvh * cap * hd,
                       ks, vs, cap, k0, k1, scale, softcap, qbuf,
                       scores, acc, mx, tot, T <= STREAM_ROWS, kv16)
        if splits == 1:
            normalize_into(arena, o_off + t * o_st + kvh * group * hd, acc, tot, group, hd)
        else:
            keep_part(part, job, acc, mx, tot, group, hd)


def attend_chunk_signature(kv) -> tuple:
    """attend_chunk's argument types for the KV operand type ``kv`` (one of KV_OPERANDS)."""
    return (ARENA, ARENA, *[i64] * 19, f64, f64, array(types.float32, 3), kv)


ATTEND_CHUNK = Addressed(attend_chunk, types.none, [attend_chunk_signature(kv) for kv in KV_OPERANDS])
attend_chunk_at = ATTEND_CHUNK.call
attend_chunk_ready = ATTEND_CHUNK.ensure


@njit(cache=True, inline="always")
def attend_chunk_bind(arena, kv16):
    """Bind attend_chunk's specialization for ``kv16`` before attention's parallel region."""
    z, f = np.int64(0), np.float64(0.0)
    attend_chunk_ready(arena, arena, z, z, z, z, z, z, z, z, z, z, z, z, z, z, z, z, z, z, z, f, f,
                       np.empty((1, 1, 1), np.float32), kv16)


@njit(cache=True, parallel=True, fastmath=True, error_model="numpy")
def attention(arena, state, q_off, q_st, k_off, k_st, v_off, v_st, o_off, o_st,
              n_heads, n_kv, head_dim, c_off, cap, scale, softcap, window, pos0, T, nthreads, kv16):
    """Write the new K/V rows, then attend: one job per (query row, KV head, range of its keys).
    ``kv16`` (:func:`kv_operand`): None for a float32 cache; an int64, the cache region holds
    float16 keys and values, widened to float32 as they are loaded; an int8, it holds int8 keys
    and values with a float32 scale per Q8_BLOCK values of each (slot, KV head) row (:func:`q8_row`):
    a score is the sum over the key's blocks of the query's dot product with the block's stored
    integers times its scale, and each value is multiplied by its block's scale as it is loaded
    for the weighted sum. Softmax and sums stay float32 in every format.

    All query heads sharing a KV head are one job, so each cached key tile and value row is
    loaded once per job. Prefill has a job per (row, KV head); with fewer (row, KV head) pairs
    than ``nthreads`` (decode of a model with few KV heads) each pair's visible keys are split
    into ranges of at least MIN_SPLIT_KEYS, whose partial softmax sums (max, sum of
    exponentials, weighted values) are combined afterwards, as flash-decoding does; so are they
    when a few pairs do not divide evenly over the threads (3 KV heads on 2 threads: 2 ranges
    each, 3 equal jobs per thread instead of 2 and 1). Pairs that already divide evenly are not
    split: the combine costs more than it balances (0.010 ms unsplit, 0.018 ms in 4 ranges at
    512 keys). Jobs are dealt round-robin to at most MAX_CHUNKS parallel chunks (later rows see more keys, so each
    chunk gets early and late rows), each chunk with its own scratch."""
    kv_write(arena, state, k_off, k_st, v_off, v_st, n_kv, head_dim, c_off, cap, pos0, T, kv16)
    group = n_heads // n_kv
    size = n_kv * cap * head_dim
    base = kv_base(kv16, c_off)                    # in elements of the cache's format
    span = pos0 + T if window <= 0 else min(pos0 + T, window)
    pairs = T * n_kv
    splits = key_splits(pairs, nthreads, pos0)
    jobs = pairs * splits
    hd = head_dim
    part = np.empty((jobs, group, hd + 2), np.float32) if splits > 1 else np.empty((1, 1, 1), np.float32)
    nchunk = min(jobs, MAX_CHUNKS)
    attend_part_bind(arena, kv16, hd)
    attend_chunk_bind(arena, kv16)
    for c in prange(nchunk):
        attend_chunk_at(arena, state, np.int64(c), nchunk, jobs, T, splits, window, pos0, q_off, q_st, o_off, o_st,
                        group, hd, base, size, cap, c_off, n_kv, span, scale, softcap, part, kv16)
    if splits > 1:                                   # combine the key ranges of each pair
        for pair in range(pairs):
            kvh = pair // T
            t = pair % T
            combine_parts(arena, o_off + t * o_st + kvh * group * hd, part, (kvh * splits) * T + t, T, splits,
                           group, hd)


def attention_signature(kv) -> tuple:
    """attention's argument types for the KV operand type ``kv`` (one of KV_OPERANDS)."""
    return (ARENA, ARENA, *[i64] * 13, f64, f64, i64, i64, i64, i64, kv)


ATTENTION = Addressed(attention, types.none, [attention_signature(kv) for kv in KV_OPERANDS])
"""attention as interpreter.run and the batched step call it, through its address
(cpullm_kernels.setup.addressed)."""


def q8_dequantize_ref(x, head_dim):
    """(L, n*head_dim) float32 rows as an 8-bit cache holds them: each head's row of head_dim
    values quantized (:func:`q8_rows_ref`) and each value multiplied back by its block's scale."""
    x = np.asarray(x, np.float32)
    rows = x.reshape(x.shape[0], -1, head_dim)
    q, sc = q8_rows_ref(rows)
    per_value = np.repeat(sc, Q8_BLOCK, axis=-1)[..., :head_dim]
    return (q.astype(np.float32) * per_value).reshape(x.shape)


def attention_ref(q, k, v, n_heads, n_kv, head_dim, scale, softcap=0.0, window=0, pos0=0,
                  k_past=None, v_past=None, kv16=False, kv8=False):
    """q (T, nh*hd), k/v (T, nkv*hd) for positions pos0.., with optional past k/v (pos0, nkv*hd).
    Returns (T, nh*hd), computed as transformers' eager attention (scale, softcap, mask, softmax).
    ``kv16``: keys and values rounded to float16 first, as a float16 KV cache stores them;
    ``kv8``: quantized to int8 with a scale per Q8_BLOCK values of each (position, head) row and
    scaled back, as an 8-bit cache."""
    T = q.shape[0]
    if k_past is not None:
        k = np.concatenate([k_past, k])
        v = np.concatenate([v_past, v])
    if kv16:
        k = np.asarray(k, np.float32).astype(np.float16)
        v = np.asarray(v, np.float32).astype(np.float16)
    if kv8:
        k, v = q8_dequantize_ref(k, head_dim), q8_dequantize_ref(v, head_dim)
    L = k.shape[0]
    qh = q.reshape(T, n_heads, head_dim).transpose(1, 0, 2).astype(np.float64)
    kh = k.reshape(L, n_kv, head_dim).transpose(1, 0, 2).astype(np.float64)
    vh = v.reshape(L, n_kv, head_dim).transpose(1, 0, 2).astype(np.float64)
    g = n_heads // n_kv
    kh = np.repeat(kh, g, axis=0)
    vh = np.repeat(vh, g, axis=0)
    scores = qh @ kh.transpose(0, 2, 1) * scale
    if softcap:
        scores = softcap * np.tanh(scores / softcap)
    qpos = np.arange(T)[:, None] + pos0
    kpos = np.arange(L)[None, :]
    allowed = kpos <= qpos
    if window:
        allowed &= kpos > qpos - window
    scores = np.where(allowed[None], scores, -np.inf)
    scores -= scores.max(-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(-1, keepdims=True)
    return (p @ vh).transpose(1, 0, 2).reshape(T, n_heads * head_dim).astype(np.float32)


def kv_views(region: np.ndarray, n_kv: int, cap: int, head_dim: int, kv16: bool = False):
    """(K tiles (n_kv, cap // 16, head_dim, 16), V (n_kv, cap, head_dim)) views of one layer's
    flat cache region (float32: 2 * n_kv * cap * head_dim floats; ``kv16``: n_kv * cap * head_dim
    floats whose memory holds the float16 keys and values, returned as float16 views, so that
    assigning float32 rows to them rounds to nearest even as the kernels do)."""
    if kv16:
        region = region.view(np.float16)
    size = n_kv * cap * head_dim
    return (region[:size].reshape(n_kv, cap // TILE, head_dim, TILE),
            region[size: 2 * size].reshape(n_kv, cap, head_dim))


def kv_views_q8(region: np.ndarray, n_kv: int, cap: int, head_dim: int):
    """An 8-bit region's (K tiles (n_kv, cap // 16, head_dim, 16) int8, V (n_kv, cap, head_dim)
    int8, key scales (n_kv, cap // 16, n_blocks, 16) float32 (block b of the key in slot s at
    [h, s // 16, b, s % 16]), value scales (n_kv, cap, n_blocks) float32), views of its flat
    float32 memory (n_kv * cap * (head_dim / 2 + 2 * n_blocks) floats, n_blocks = ceil(head_dim /
    Q8_BLOCK); :func:`q8_scales_offset`)."""
    size = n_kv * cap * head_dim
    nb = q8_blocks(head_dim)
    b = region[: size // 2].view(np.int8)
    sc = region[size // 2: size // 2 + 2 * n_kv * cap * nb]
    return (b[:size].reshape(n_kv, cap // TILE, head_dim, TILE), b[size: 2 * size].reshape(n_kv, cap, head_dim),
            sc[: n_kv * cap * nb].reshape(n_kv, cap // TILE, nb, TILE), sc[n_kv * cap * nb:].reshape(n_kv, cap, nb))
