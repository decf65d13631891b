"""Q4_K and Q6_K LINEAR over blocks rearranged in panels of 16 rows: decode, batches and prefill.

    out (B, N) = x (B, K) @ W.T,   W a ggml Q4_K or Q6_K matrix, N a multiple of 16

Why a layout of its own: decode of a 1.24B model at 4.5-6.6 bits reads ~800 MB a token, and a
kernel that walks one row at a time (kernels/cpullm_kernels/rows/kquant.py) spends per 32 weights of every row an
unpack of its scales, a horizontal sum and a float step: its Q4_K rows streamed at about half
the machine's read rate, so decode was bound by that work, not by the bytes. Here the 16 rows of a panel sit side by side, one int32 lane a row: one
``vpdpbusd`` multiplies 4 quants of each of 16 rows by 4 broadcast activation bytes, the sums of a
sub-block form in their lanes with no horizontal reduction, and one scale step a sub-block
serves 16 rows. The bytes are the file's, only in another order: a panel holds exactly its 16
rows' blocks (Q4_K 144, Q6_K 210 bytes a row and super-block of 256 weights), so resident
weights equal the file's tensor bytes.

Layout, for panel g (rows 16 g .. 16 g + 15) and super-block s (weights 256 s .. 256 s + 255),
lane l = row 16 g + l, one region of 16 * block bytes at (g * nsb + s) * 16 * block bytes:

Q4_K (2304 bytes; w = d sc_j q - dmin mn_j in sub-block j of 32, q 0..15, sc / mn 6 bits):

    [0, 32)       d     binary16, one a lane
    [32, 64)      dmin  binary16, one a lane
    [64, 256)     the 12 bytes of the row's packed sc / mn as 3 words: word w of lane l at 64 + 64 w + 4 l
    [256, 2304)   quants: sub-block j, group t (weights 32 j + 8 t .. + 7) at 256 + 64 (4 j + t):
                  byte 4 l + e = q[32 j + 8 t + e] | q[32 j + 8 t + 4 + e] << 4

Q6_K (3360 bytes; w = d sc_j (q - 32) in sub-block j of 16, q 0..63, sc int8):

    [0, 32)       d     binary16, one a lane
    [32, 288)     sc_j  int8 at 32 + 16 j + l
    [288, 3360)   sub-block j at 288 + 192 j: three 64-byte vectors, byte 4 l + e of each
                  L0 = lo4(q[16 j + e])     | lo4(q[16 j + 4 + e]) << 4
                  L1 = lo4(q[16 j + 8 + e]) | lo4(q[16 j + 12 + e]) << 4
                  H  = hi2(q[16 j + e]) | hi2(q[16 j + 4 + e]) << 2 | hi2(q[16 j + 8 + e]) << 4
                       | hi2(q[16 j + 12 + e]) << 6

So every 64-byte vector of quants unpacks (a mask and a shift; Q6_K an OR of the high bits) into
vectors whose lane l holds 4 consecutive quants of row l, vector u of a sub-block (u = 0 .. 7 for
Q4_K, 0 .. 3 for Q6_K) pairing with activations 4 u .. 4 u + 3 of the sub-block.

Activations: int8 per block of 32 (``kquant.quantize_act_q8``: x_q, x_s = max|v| / 127, x_m[i] =
x_s[i // 2] * the integer sum of x_q[16 i .. 16 i + 15]), as the row kernels use.

Numerics (the same for every B, tile, thread count and ISA: the integer sums are exact and the
float steps are one fixed sequence a lane): per super-block, with S_j the exact int32 sum of
q x_q over sub-block j and f_j = d * float(sc_j) (exact: an 11-bit by 8-bit product),

    Q4_K  for j in 0..7:   acc = fma(float(S_j), f_j * x_s[b_j], acc)
                           ms  = fma(float(mn_j), x_m[2 b_j] + x_m[2 b_j + 1], ms)      (ms from 0)
          acc = fma(-dmin, ms, acc)
    Q6_K  for j in 0..15:  acc = fma(float(S_j), f_j * x_s[b_j], acc)
                           ms  = fma(float(sc_j), x_m[16 s + j], ms)                     (ms from 0)
          acc = fma(-32 d, ms, acc)

(b_j the activation block of sub-block j), acc from 0 at the row's start. A row's value therefore
does not depend on the batch it is computed in, and a prefill row equals a decode of the same
activations. The numpy reference :func:`matmul_ref` follows the same steps
(tests/test_kernels_kquant_panels.py holds every ISA to it bit for bit).

ISA variants (``ISAS``; ``CPULLM_KQ_PANELS_ISA`` picks a lesser one, with a numba cache of its
own): ``vnni`` (AVX-512 VNNI: ``vpdpbusd`` on zmm, by inline assembly as in llvm_ir.vnni_block_sums,
since LLVM's tuning for some Intel hosts rewrites the instruction), ``avx2`` (``vpmaddubsw`` +
``vpmaddwd``, two ymm halves of a panel; Q4_K's one-panel tiles a super-block at a time by inline
assembly, :func:`_avx2_q4k_superblock`), ``avxvnni`` (the same, but ``vpdpbusd`` on ymm where the
tile is IR) and ``generic`` (portable IR).

Streaming: a register tile is 1, 2, 4 or 8 activation rows by one panel (AVX2, AVX-VNNI: 1, 2, 3,
5; :data:`TILES`), a lone row (decode) included. Tiles prefetch every 64-byte line of their
super-block into L2 ``llvm_ir.PREFETCH_BYTES`` (4 KiB) ahead: without it 5 rows of an 8192 x 2048
Q4_K matrix took 0.60 ms instead of 0.40. For decode, one prefetching panel at a time beat 4
panels at once without prefetches on Zen 5: a 1.24B Q4_K_M decoded 1.08-1.24x faster (AVX-512;
AVX2 1.35-1.9x), though on Zen 4 the 4 panels had read Q4_K faster (24 GB/s against 20)
(benchmarks/results/2026-12-07-zen5-decode-tile.md, benchmarks/ab/decode_prefetch.py).

Entry points:

    pack(fmt, raw uint8 (N, row bytes)) -> uint8 (N * row bytes,)           at compile time, numpy
    fields_ref(fmt, packed, N, K) -> the rows' numbers (d, dmin, sc, mn, q)   numpy
    dequantize_ref(fmt, packed, N, K) -> float32 (N, K)                       numpy
    matmul(fmt, w, x_q (B, Kp), x_s, x_m, out (B, >= N), nthreads)            @njit, parallel
    matmul_many(fmt, w, mats, x_q, x_s, x_m, out, nthreads)                   several matrices at once
    matmul_float(fmt, x float32 (T, K), w, N, out)                            prefill (quantizes x)
    scaled_row_into(fmt, w, Kp, n, scale, out)                                @njit, an EMBED row
    matmul_ref(fmt, packed, N, x_q, x_s, x_m) -> float32 (B, N)               numpy
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
from ..setup.operand_types import WB, array, i64
from ..rows.gguf_blocks import Q4_K as _Q4_K_FMT
from ..rows.gguf_blocks import Q6_K as _Q6_K_FMT
from ..rows.gguf_blocks import k_low4, k_scales_mins, q6_k_quants
from ..rows.kquant import quantize_act_q8
from ..rows.llvm_ir import (F32, I8, I16, I32, I64, P8, const_i64, declare, emit_counted_loop,
                            halves_to_floats, prefetch_ahead)
from ..rows.q8 import HAVE_AVX2, half_to_float

Q4_K, Q6_K = _Q4_K_FMT.ggml_type, _Q6_K_FMT.ggml_type
FORMATS = (Q4_K, Q6_K)
"""ggml types with a panel layout (what Q4_K_M files and ``--quant q4`` are made of)."""
PANEL = 16
"""Rows per panel: the int32 lanes of one 512-bit register."""
SUPER = 256
SB_BYTES = {Q4_K: PANEL * _Q4_K_FMT.block_bytes, Q6_K: PANEL * _Q6_K_FMT.block_bytes}
"""Bytes of one super-block of one panel."""
_Q4_K_BLOCK, _Q6_K_BLOCK = _Q4_K_FMT.block_bytes, _Q6_K_FMT.block_bytes


@njit(cache=True, inline="always")
def block_bytes(fmt):
    """Bytes of one row's super-block of 256 weights, Q4_K else Q6_K (callable from @njit code)."""
    return _Q4_K_BLOCK if fmt == Q4_K else _Q6_K_BLOCK

HAVE_VNNI = (HAVE_AVX2 and numba_setup.HOST_IS_X86
             and {"avx512f", "avx512bw", "avx512vnni"} <= numba_setup.HOST_FEATURES)
HAVE_AVXVNNI = HAVE_AVX2 and numba_setup.HOST_IS_X86 and "avxvnni" in numba_setup.HOST_FEATURES
ISAS = ("vnni",) * HAVE_VNNI + ("avxvnni",) * HAVE_AVXVNNI + ("avx2",) * HAVE_AVX2 + ("generic",)
"""The variants this CPU runs, best first (``avxvnni``: the VEX ``vpdpbusd`` on ymm, for CPUs with
AVX-VNNI and no AVX-512)."""
ISA = os.environ.get("CPULLM_KQ_PANELS_ISA") or ISAS[0]
if ISA not in ISAS:
    raise ImportError(f"CPULLM_KQ_PANELS_ISA={ISA!r}: this CPU runs {', '.join(ISAS)}")

YMM_ISAS = ("avx2", "avxvnni")
"""The variants that keep a panel's 16 lanes in two ymm halves (16 registers, no AVX-512)."""

TILES = (5, 3, 2, 1) if ISA in YMM_ISAS else (8, 4, 2, 1)
"""Batch rows a register tile takes, largest first: B is cut into tiles of these sizes, each
reading the panel's quants once and unpacking them once for all its rows. AVX2 keeps a row's 16
lanes in two ymm halves, so 8 rows of float sums (32 registers) spill from its 16 (6 and 3 rows
ran Q4_K at 121-133 GMAC/s on 2 Zen 4 cores where 8 ran 107-116). Its Q4_K tile is assembly of
2 TR + 6 ymm registers, so at most 5 rows: on 2 Ice Lake cores (B = 512, 9 interleaved rounds)
5 rows of it ran 8192 x 2048 at 68.2 GMAC/s and 2048 x 8192 at 66.8 where the 6-row IR tile
ran 53.8 and 51.7; Q6_K's IR tile ran the same at 5 rows as at 6 (69.7 / 75.1 against 69.3 /
74.5 GMAC/s). AVX-VNNI takes the same tiles and routine: its IR tiles of 8 rows (``vpdpbusd``,
mins beside the quants) ran Q4_K at 119-129 GMAC/s and Q6_K at 56-89 on 2 Zen 5 cores restricted
to AVX2 + AVX-VNNI, these 5-row ones 146-170 and 104-124 (B = 512, two alternating pairs of
benchmarks/ab/panel_tiles.py runs)."""


def mins_apart(isa: str, TR: int) -> bool:
    """Whether a tile's super-block min sums (the mins times the activations' sums) run in a loop
    of their own after its quants' sums, not beside them: the same steps in the same order per
    lane, but the min sums' registers are free while the quants are multiplied. The ymm variants'
    tiles (a row's 16 lanes in two of 16 registers) then ran Q4_K at 135-143 GMAC/s where they ran
    104-132 (AVX2, 6 rows, 2 Zen 4 cores). With AVX-512's 32 zmm it cost Q4_K's 4-row tile
    (227-273 GMAC/s against 280-292), so there only the one-row tile (decode) takes it: it streamed
    Q6_K from DRAM in 0.89-1.04x the time (``benchmarks/ab/decode_prefetch.py --kq-against
    mins-beside``, 2 Zen 5 threads; benchmarks/results/2026-12-07-zen5-decode-tile.md)."""
    return isa in YMM_ISAS or TR == 1


SKIP_LARGEST_TILE = {("vnni", Q4_K)}
"""(ISA, format) pairs that start at the second of TILES, not the largest: measured at
8192 x 2048 and 2048 x 8192, B = 512, medians of 9 interleaved runs, 2 Zen 4 cores: vnni Q4_K 4
rows 289-302 GMAC/s, 8 rows 263-268 (Q6_K: 8 rows 204-213, 4 rows 185-202)
(benchmarks/ab/panel_tiles.py). The tile changes no number: every lane runs the same float steps
whatever tile holds its row."""


PANELED = 256
"""Added to the ggml type in a program's LINEAR_S_OFF / EMBED_S_OFF (kind WEIGHT_BLOCKS) when the
matrix is stored in this layout (ggml types are below 64)."""


def can_pack(fmt, N: int) -> bool:
    """Whether an (N, K) matrix of ggml type ``fmt`` goes into panels."""
    return int(fmt) in FORMATS and int(N) > 0 and int(N) % PANEL == 0


# ================================================================================================
# layout (numpy)
# ================================================================================================

def _lanes(a, G: int, nsb: int, *inner):
    """(N, nsb, *inner) per row -> (G, nsb, 16, *inner): the 16 lanes of a panel side by side."""
    return np.ascontiguousarray(a.reshape(G, PANEL, nsb, *inner).swapaxes(1, 2))


def pack(fmt, raw) -> np.ndarray:
    """The file's row-major blocks uint8 (N, row bytes) -> the panel layout, uint8 (N * row bytes,)."""
    fmt = int(fmt)
    raw = np.ascontiguousarray(raw, np.uint8)
    N = raw.shape[0]
    if not can_pack(fmt, N):
        raise ValueError(f"kquant_panels.pack: type {fmt} with {N} rows has no panel layout")
    G = N // PANEL
    if fmt == Q4_K:
        nsb = raw.shape[1] // 144
        b = raw.reshape(N, nsb, 144)
        q = k_low4(b[..., 16:144].reshape(-1, 128)).reshape(N, nsb, 8, 4, 2, 4)    # (n, s, j, t, h, e)
        qb = (q[..., 0, :] | (q[..., 1, :] << 4)).astype(np.uint8)                 # (n, s, j, t, e)
        parts = [_lanes(b[..., 0:2], G, nsb, 2).reshape(G, nsb, 32),
                 _lanes(b[..., 2:4], G, nsb, 2).reshape(G, nsb, 32),
                 _lanes(b[..., 4:16].reshape(N, nsb, 3, 4), G, nsb, 3, 4).swapaxes(2, 3).reshape(G, nsb, 192),
                 _lanes(qb, G, nsb, 8, 4, 4).transpose(0, 1, 3, 4, 2, 5).reshape(G, nsb, 2048)]
    else:
        nsb = raw.shape[1] // 210
        b = raw.reshape(N, nsb, 210)
        q = q6_k_quants(b.reshape(-1, 210)).reshape(N, nsb, 16, 4, 4)              # (n, s, j, u, e)
        lo, hi = q & 15, q >> 4
        L0 = lo[..., 0, :] | (lo[..., 1, :] << 4)
        L1 = lo[..., 2, :] | (lo[..., 3, :] << 4)
        H = hi[..., 0, :] | (hi[..., 1, :] << 2) | (hi[..., 2, :] << 4) | (hi[..., 3, :] << 6)
        v = np.stack([L0, L1, H], axis=3).astype(np.uint8)                         # (n, s, j, 3, e)
        parts = [_lanes(b[..., 208:210], G, nsb, 2).reshape(G, nsb, 32),
                 _lanes(b[..., 192:208], G, nsb, 16).swapaxes(2, 3).reshape(G, nsb, 256),
                 _lanes(v, G, nsb, 16, 3, 4).transpose(0, 1, 3, 4, 2, 5).reshape(G, nsb, 3072)]
    return np.concatenate(parts, axis=2).reshape(-1)


def fields_ref(fmt, packed, N: int, K: int) -> dict:
    """The numbers of every row, read back from the panel layout (K a multiple of 256):
    Q4_K {"d", "dmin": float32 (N, nsb), "sc", "mn": int32 (N, nsb, 8), "q": int32 (N, K)};
    Q6_K {"d": float32 (N, nsb), "sc": int32 (N, nsb, 16), "q": int32 (N, K) (0..63)}."""
    fmt = int(fmt)
    G, nsb = N // PANEL, K // SUPER
    p = np.asarray(packed, np.uint8).reshape(G, nsb, SB_BYTES[fmt])

    def rows(a):                                    # (G, nsb, 16, ...) -> (N, nsb, ...)
        return np.ascontiguousarray(a.swapaxes(1, 2)).reshape(N, nsb, *a.shape[3:])

    def halves(a):
        return rows(np.ascontiguousarray(a).view(np.float16).astype(np.float32).reshape(G, nsb, PANEL))

    if fmt == Q4_K:
        words = p[..., 64:256].reshape(G, nsb, 3, PANEL, 4).transpose(0, 1, 3, 2, 4)
        sc, mn = k_scales_mins(rows(words).reshape(-1, 12))
        qb = rows(p[..., 256:].reshape(G, nsb, 8, 4, PANEL, 4).transpose(0, 1, 4, 2, 3, 5))   # (N, s, j, t, e)
        q = np.stack([qb & 15, qb >> 4], axis=4).reshape(N, K)                      # (n, s, j, t, h, e)
        return {"d": halves(p[..., 0:32]), "dmin": halves(p[..., 32:64]),
                "sc": sc.reshape(N, nsb, 8).astype(np.int32), "mn": mn.reshape(N, nsb, 8).astype(np.int32),
                "q": q.astype(np.int32)}
    sc = rows(p[..., 32:288].reshape(G, nsb, 16, PANEL).swapaxes(2, 3)).view(np.int8)
    v = rows(p[..., 288:].reshape(G, nsb, 16, 3, PANEL, 4).transpose(0, 1, 4, 2, 3, 5))     # (N, s, j, 3, e)
    L0, L1, H = v[..., 0, :], v[..., 1, :], v[..., 2, :]
    lo = np.stack([L0 & 15, L0 >> 4, L1 & 15, L1 >> 4], axis=3)
    hi = np.stack([H & 3, (H >> 2) & 3, (H >> 4) & 3, H >> 6], axis=3)
    q = (lo | (hi << 4)).reshape(N, K)
    return {"d": halves(p[..., 0:32]), "sc": sc.astype(np.int32), "q": q.astype(np.int32)}


def dequantize_ref(fmt, packed, N: int, K: int) -> np.ndarray:
    """float32 (N, K): the weights as gguf_blocks.dequantize_ref computes them from the file."""
    fmt = int(fmt)
    f = fields_ref(fmt, packed, N, K)
    nsb = K // SUPER
    if fmt == Q4_K:
        d1 = f["d"][..., None] * f["sc"].astype(np.float32)                        # (N, nsb, 8)
        m1 = f["dmin"][..., None] * f["mn"].astype(np.float32)
        q = f["q"].reshape(N, nsb, 8, 32).astype(np.float32)
        return (d1[..., None] * q - m1[..., None]).reshape(N, K)
    dsc = f["d"][..., None] * f["sc"].astype(np.float32)                           # (N, nsb, 16)
    q = f["q"].reshape(N, nsb, 16, 16).astype(np.float32) - np.float32(32)
    return (dsc[..., None] * q).reshape(N, K)


def _fma(a, b, c):
    """float32 a * b + c with one rounding, elementwise (exact product in float64, then rounded
    once to float64 and to float32: equal to a true fma except in double-rounding ties)."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def matmul_ref(fmt, packed, N: int, x_q, x_s, x_m) -> np.ndarray:
    """numpy reference: float32 (B, N) by the module's float steps, in their order."""
    fmt = int(fmt)
    x_q, x_s, x_m = np.atleast_2d(x_q), np.atleast_2d(x_s).astype(np.float32), np.atleast_2d(x_m).astype(np.float32)
    B, Kp = x_q.shape
    nsb = Kp // SUPER
    f = fields_ref(fmt, packed, N, Kp)
    sub = 32 if fmt == Q4_K else 16
    nsub = SUPER // sub
    S = np.einsum("nsjk,tsjk->tnsj", f["q"].reshape(N, nsb, nsub, sub).astype(np.int64),
                  x_q.reshape(B, nsb, nsub, sub).astype(np.int64)).astype(np.float32)        # exact
    acc = np.zeros((B, N), np.float32)
    d = f["d"]
    for s in range(nsb):
        ms = np.zeros((B, N), np.float32)
        for j in range(nsub):
            blk = (s * SUPER + j * sub) // 32
            fj = d[:, s] * f["sc"][:, s, j].astype(np.float32)                     # exact
            acc = _fma(S[:, :, s, j], fj[None, :] * x_s[:, blk:blk + 1], acc)
            if fmt == Q4_K:
                xm = x_m[:, 2 * blk] + x_m[:, 2 * blk + 1]
                ms = _fma(np.broadcast_to(f["mn"][:, s, j].astype(np.float32), (B, N)), xm[:, None], ms)
            else:
                ms = _fma(np.broadcast_to(f["sc"][:, s, j].astype(np.float32), (B, N)),
                          x_m[:, 16 * s + j: 16 * s + j + 1], ms)
        off = -f["dmin"][:, s] if fmt == Q4_K else np.float32(-32) * d[:, s]
        acc = _fma(np.broadcast_to(off, (B, N)), ms, acc)
    return acc


# ================================================================================================
# the register tile (LLVM IR)
# ================================================================================================

_V16I32 = ir.VectorType(I32, 16)
_V16F32 = ir.VectorType(F32, 16)
_V64I8 = ir.VectorType(I8, 64)
_V16I16 = ir.VectorType(I16, 16)
_V32I8 = ir.VectorType(I8, 32)
_V8I32 = ir.VectorType(I32, 8)


def _splat_i8(b, v):
    return ir.Constant(_V64I8, [v] * 64)


def _splat(b, scalar, vty):
    v = b.insert_element(ir.Constant(vty, ir.Undefined), scalar, ir.Constant(I32, 0))
    return b.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, vty.count), [0] * vty.count))


def _fsplat(b, v):
    """IR: float v in every lane of a <16 x float>."""
    return b.shuffle_vector(b.insert_element(ir.Constant(_V16F32, ir.Undefined), v, ir.Constant(I32, 0)),
                            ir.Constant(_V16F32, ir.Undefined), ir.Constant(_V16I32, [0] * 16))


def _load(b, p, off, ty, align=1):
    return b.load(b.bitcast(b.gep(p, [off if isinstance(off, ir.Value) else const_i64(off)]), ty.as_pointer()),
                  align=align)


def _unpacked(b, fmt, sbp, j, high_in_place=False):
    """IR: the quant vectors of sub-block j of a panel super-block at sbp (i8*), <64 x i8> each,
    vector u pairing with activations 4 u .. 4 u + 3 of the sub-block. ``high_in_place``: Q4_K's
    high nibbles are left at bits 4-7 (16 q: a mask instead of a shift, whose port the dot
    products need; the caller divides their sum by 16)."""
    m15 = _splat_i8(b, 15)
    if fmt == Q4_K:
        out = []
        for t in range(4):
            w = _load(b, sbp, 256 + 64 * (4 * j + t), _V64I8)
            out += [b.and_(w, m15), b.and_(w, _splat_i8(b, 0xF0)) if high_in_place else b.lshr(w, _splat_i8(b, 4))]
        return out
    base = 288 + 192 * j
    L0, L1, H = (_load(b, sbp, base + 64 * i, _V64I8) for i in range(3))
    m48 = _splat_i8(b, 0x30)
    return [b.or_(b.and_(L0, m15), b.and_(b.shl(H, _splat_i8(b, 4)), m48)),
            b.or_(b.lshr(L0, _splat_i8(b, 4)), b.and_(b.shl(H, _splat_i8(b, 2)), m48)),
            b.or_(b.and_(L1, m15), b.and_(H, m48)),
            b.or_(b.lshr(L1, _splat_i8(b, 4)), b.and_(b.lshr(H, _splat_i8(b, 2)), m48))]


def _vnni_sums(b, fmt, vecs, xptrs):
    """IR: per activation row t, the <16 x i32> sum over u of vecs[u] (u8 quants, lane = row of
    the panel) times the 4 int8 activations at xptrs[t] + 4 u broadcast: ``vpdpbusd`` by inline
    assembly (see the module docstring). Q4_K: vecs from ``_unpacked(..., high_in_place=True)``,
    the odd vectors (16 q) summed in a chain of their own, divided by 16 exactly (an arithmetic
    shift of a multiple of 16); Q6_K: two chains a row when the tile has one or two rows."""
    TR, U = len(xptrs), len(vecs)
    chains = 2 if (TR <= 2 or fmt == Q4_K) else 1
    nacc = TR * chains
    reg = lambda i: f"${i}"  # noqa: E731
    acc = lambda t, c: reg(t * chains + c)  # noqa: E731
    vreg = lambda u: reg(nacc + u)  # noqa: E731
    xreg = lambda t: reg(nacc + U + t)  # noqa: E731
    lines = [f"vpxord {acc(t, c)}, {acc(t, c)}, {acc(t, c)}" for t in range(TR) for c in range(chains)]
    for u in range(U):
        for t in range(TR):
            lines.append(f"vpdpbusd {4 * u}({xreg(t)}){{1to16}}, {vreg(u)}, {acc(t, u % chains)}")
    ret = ir.LiteralStructType([_V16I32] * nacc)
    ins = [b.bitcast(v, _V16I32) for v in vecs] + list(xptrs)
    asm = ir.InlineAsm(ir.FunctionType(ret, [x.type for x in ins]), "\n\t".join(lines),
                       ",".join(["=&v"] * nacc + ["v"] * U + ["r"] * TR))
    r = b.call(asm, ins)
    out = []
    for t in range(TR):
        s = b.extract_value(r, t * chains)
        for c in range(1, chains):
            part = b.extract_value(r, t * chains + c)
            s = b.add(s, b.ashr(part, ir.Constant(_V16I32, [4] * 16)) if fmt == Q4_K else part)
        out.append(s)
    return out


def _avx2_sums(b, module, fmt, vecs, xptrs):
    """IR: :func:`_vnni_sums` by ``vpmaddubsw`` (int16 sums of pairs) + ``vpmaddwd`` by ones, on
    the two ymm halves (rows 0-7, 8-15) of the panel. int16 partial sums stay below 2^15: Q4_K's
    8 products of a lane pair at most 8 * 2 * 15 * 127 = 30480; Q6_K's quants reach 63, so its
    pairs of products (32004) go to int32 two at a time."""
    maddubs = declare(module, "llvm.x86.avx2.pmadd.ub.sw", _V16I16, [_V32I8, _V32I8])
    maddwd = declare(module, "llvm.x86.avx2.pmadd.wd", _V8I32, [_V16I16, _V16I16])
    ones = ir.Constant(_V16I16, [1] * 16)
    per = 8 if fmt == Q4_K else 2
    halves = [[b.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, 32), list(range(32 * h, 32 * h + 32)))) for v in vecs]
              for h in range(2)]
    out = []
    for xp in xptrs:
        xs = [b.bitcast(_splat(b, _load(b, xp, 4 * u, I32), _V8I32), _V32I8) for u in range(len(vecs))]
        res = []
        for h in range(2):
            s32 = None
            for u0 in range(0, len(vecs), per):
                s16 = None
                for u in range(u0, u0 + per):
                    p = b.call(maddubs, [halves[h][u], xs[u]])
                    s16 = p if s16 is None else b.add(s16, p)
                w = b.call(maddwd, [s16, ones])
                s32 = w if s32 is None else b.add(s32, w)
            res.append(s32)
        out.append(b.shuffle_vector(res[0], res[1], ir.Constant(_V16I32, list(range(16)))))
    return out


def _avx2_q4k_superblock(b, wq, xptrs, sb, fa, cst):
    """IR: the quants' part of one Q4_K super-block of a one-panel register tile on AVX2 and AVX-VNNI, as one
    inline-assembly routine: for sub-block j = 0 .. 7 in order, each activation row t and ymm
    half h (panel rows 8 h .. 8 h + 7),

        fa[t][h] = fma(float(S_j), sb[j][t][h], fa[t][h])

    with S_j the exact int32 sums of sub-block j's 32 quants (the four 64-byte vectors at
    ``wq + 256 j``, unpacked by a shift and a mask) times the int8 activations at
    ``xptrs[t] + 32 j`` (``vpmaddubsw`` into int16, at most 8 * 2 * 15 * 127 = 30480 a lane, then
    one ``vpmaddwd`` by ones). ``sb`` points at 8 x TR <16 x float> (the scales f_j x_s, sub-block
    j's at byte 64 TR j), ``fa`` at TR (the float sums), ``cst`` at 32 bytes of 15 then 16 int16
    ones. The same float steps as :func:`matmul_ref`; the caller adds the mins.

    Inline assembly, not IR: written as IR, the 6-row tile kept 16 weight halves and 12 float
    sums live and LLVM spilled (the tile's code, both formats, held 2055 moves to or from the
    stack beside its 1536 ``vpmaddubsw``). One routine a super-block, not a sub-block: with the
    address work of eight calls between them, 5-row tiles of it ran 1.13-1.18x the speed of the IR
    5-row tile, as one routine 1.33x (2 threads, interleaved in one process, Q4_K 8192 x 2048 and
    2048 x 8192, B = 512).
    Registers: the 2 TR int16 sums, the four unpacked quant vectors of a 64-byte vector's two
    halves (each broadcast serves both), a broadcast and a product: 2 TR + 6 <= 16, TR <= 5."""
    TR = len(xptrs)
    nacc = 2 * TR
    nscr = nacc + 6
    if nscr > 16:
        raise ValueError(f"a {TR}-row Q4_K tile needs {nscr} ymm registers")
    reg = lambda i: f"${i}"  # noqa: E731
    acc = lambda t, h: reg(2 * t + h)  # noqa: E731
    vec = lambda h, e: reg(nacc + 2 * h + e)  # noqa: E731
    bx, prod = reg(nacc + 4), reg(nacc + 5)
    wq_r, cst_r, sb_r, fa_r = (reg(nscr + i) for i in range(4))
    x_r = lambda t: reg(nscr + 4 + t)  # noqa: E731
    lines = []
    for j in range(8):
        started = set()

        def unpack(h, g):           # 64-byte vector g, half h -> quants u = 2 g (low), 2 g + 1 (high)
            lo, hi = vec(h, 0), vec(h, 1)
            lines.extend([f"vmovdqu {256 * j + 64 * g + 32 * h}({wq_r}), {lo}", f"vpsrlw $$4, {lo}, {hi}",
                          f"vpand ({cst_r}), {lo}, {lo}", f"vpand ({cst_r}), {hi}, {hi}"])

        def madd(v, t, h):
            if (t, h) in started:
                lines.extend([f"vpmaddubsw {bx}, {v}, {prod}", f"vpaddw {prod}, {acc(t, h)}, {acc(t, h)}"])
            else:
                started.add((t, h))
                lines.append(f"vpmaddubsw {bx}, {v}, {acc(t, h)}")

        for g in range(4):
            unpack(0, g)
            unpack(1, g)
            for t in range(TR):
                for e in range(2):
                    lines.append(f"vpbroadcastd {32 * j + 4 * (2 * g + e)}({x_r(t)}), {bx}")
                    madd(vec(0, e), t, 0)
                    madd(vec(1, e), t, 1)
        tmp = vec(0, 0)
        for t in range(TR):
            for h in range(2):
                off = 64 * t + 32 * h
                lines.extend([f"vpmaddwd 32({cst_r}), {acc(t, h)}, {acc(t, h)}", f"vcvtdq2ps {acc(t, h)}, {acc(t, h)}",
                              f"vmovups {off}({fa_r}), {tmp}",
                              f"vfmadd231ps {64 * TR * j + off}({sb_r}), {acc(t, h)}, {tmp}",
                              f"vmovups {tmp}, {off}({fa_r})"])
    ret = ir.LiteralStructType([_V8I32] * nscr)
    ins = [wq, cst, sb, fa] + list(xptrs)
    # "~{memory}": the routine reads and writes memory LLVM cannot see through its pointer operands
    asm = ir.InlineAsm(ir.FunctionType(ret, [x.type for x in ins]), "\n\t".join(lines),
                       ",".join(["=&x"] * nscr + ["r"] * len(ins) + ["~{memory}"]))
    b.call(asm, ins)


def _avxvnni_sums(b, module, vecs, xptrs):
    """IR: :func:`_vnni_sums` by the VEX-encoded ``vpdpbusd`` (AVX-VNNI) on the two ymm halves
    (rows 0-7, 8-15) of the panel: the 4 products of a lane summed straight into int32, exact
    for any quants up to 8 bits (no int16 step, unlike :func:`_avx2_sums`)."""
    v8i32 = ir.VectorType(I32, 8)
    dpbusd = declare(module, "llvm.x86.avx512.vpdpbusd.256", v8i32, [v8i32] * 3)
    halves = [[b.shuffle_vector(b.bitcast(v, _V16I32), b.bitcast(v, _V16I32),
                                ir.Constant(v8i32, list(range(8 * h, 8 * h + 8)))) for v in vecs] for h in range(2)]
    out = []
    for xp in xptrs:
        xs = [_splat(b, _load(b, xp, 4 * u, I32), v8i32) for u in range(len(vecs))]
        res = []
        for h in range(2):
            acc = ir.Constant(v8i32, [0] * 8)
            for u in range(len(vecs)):
                acc = b.call(dpbusd, [acc, halves[h][u], xs[u]])
            res.append(acc)
        out.append(b.shuffle_vector(res[0], res[1], ir.Constant(_V16I32, list(range(16)))))
    return out


def _generic_sums(b, vecs, xptrs):
    """IR: :func:`_vnni_sums` in portable IR (widen, multiply, add the 4 products of a lane)."""
    v64i32 = ir.VectorType(I32, 64)
    wide = [b.zext(v, v64i32) for v in vecs]
    out = []
    for xp in xptrs:
        s = None
        for u, w in enumerate(wide):
            x4 = b.bitcast(_splat(b, _load(b, xp, 4 * u, I32), _V16I32), _V64I8)
            p = b.mul(w, b.sext(x4, v64i32))
            s = p if s is None else b.add(s, p)
        q = [b.shuffle_vector(s, s, ir.Constant(_V16I32, list(range(e, 64, 4)))) for e in range(4)]
        out.append(b.add(b.add(q[0], q[1]), b.add(q[2], q[3])))
    return out


def _code_words(b, sbp):
    """IR: Q4_K's 6-bit scale and min codes of a panel super-block (ggml's packing: j < 4 in
    bytes j, j + 4; else 4 bits in byte j + 4 and the top 2 of bytes j - 4, j) as four
    <16 x i32> words per lane, byte i of each one code: (sc_0..3, mn_0..3, sc_4..7, mn_4..7)."""
    W0, W1, W2 = (_load(b, sbp, 64 + 64 * w, _V16I32) for w in range(3))
    c = lambda v: ir.Constant(_V16I32, [v] * 16)  # noqa: E731
    top = lambda w: b.lshr(b.and_(w, c(0xC0C0C0C0)), c(2))  # noqa: E731
    return (b.and_(W0, c(0x3F3F3F3F)), b.and_(W1, c(0x3F3F3F3F)),
            b.or_(b.and_(W2, c(0x0F0F0F0F)), top(W0)), b.or_(b.and_(b.lshr(W2, c(4)), c(0x0F0F0F0F)), top(W1)))


def _code(b, word, i):
    """IR: byte i of each lane's word as <16 x i32> (one byte shuffle)."""
    zero = ir.Constant(_V64I8, [0] * 64)
    mask = [x for lane in range(16) for x in (4 * lane + i, 64, 64, 64)]
    return b.bitcast(b.shuffle_vector(b.bitcast(word, _V64I8), zero, ir.Constant(ir.VectorType(I32, 64), mask)),
                     _V16I32)


def _define_tile(module, fmt: int, isa: str, TR: int, V: int, prefetch: bool = True, apart=None):
    """void @tile(i8* w, i64 nsb, i8* xq, i64 xq_stride, i8* xs, i64 xs_stride, i8* xm,
    i64 xm_stride, i8* out, i64 out_stride): out[t, 16 v .. 16 v + 15] for t < TR, v < V = the
    16 rows of panel v (the panels at w, each nsb super-blocks) against activation row t. Strides
    in bytes. ``apart``: :func:`mins_apart`'s choice unless given (benchmarks build the other)."""
    apart = mins_apart(isa, TR) if apart is None else apart
    asm_q4k = fmt == Q4_K and isa in YMM_ISAS and apart and V == 1 and TR <= 5     # _avx2_q4k_superblock
    name = (f"cpullm_kq_panel_tile_{fmt}_{isa}_{TR}x{V}" + ("" if prefetch else "_nopf") + ("_ma" if apart else "")
            + ("_asm" if asm_q4k else ""))
    fn = module.globals.get(name)
    if fn is not None:
        return fn
    fnty = ir.FunctionType(ir.VoidType(), [P8, I64, P8, I64, P8, I64, P8, I64, P8, I64])
    fn = ir.Function(module, fnty, name)
    fn.linkage = "internal"
    fn.attributes.add("nounwind")
    wp, nsb, xq, xqst, xs, xsst, xm, xmst, out, ost = fn.args
    fma = declare(module, "llvm.fma.v16f32", _V16F32, [_V16F32, _V16F32, _V16F32])
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    sbytes = SB_BYTES[fmt]
    pbytes = b.mul(nsb, const_i64(sbytes))
    wpan = [b.gep(wp, [b.mul(pbytes, const_i64(v))]) for v in range(V)]
    xrow = [b.gep(xq, [b.mul(xqst, const_i64(t))]) for t in range(TR)]
    xsrow = [b.bitcast(b.gep(xs, [b.mul(xsst, const_i64(t))]), F32.as_pointer()) for t in range(TR)]
    xmrow = [b.bitcast(b.gep(xm, [b.mul(xmst, const_i64(t))]), F32.as_pointer()) for t in range(TR)]
    nsub, sub = (8, 32) if fmt == Q4_K else (16, 16)
    zero = ir.Constant(_V16F32, [0.0] * 16)
    if asm_q4k:                     # the float sums, the sub-block's scales and the constants
        fa, sbuf, cst = (b.alloca(ty, size=ir.Constant(I32, n)) for ty, n in ((_V16F32, TR), (_V16F32, 8 * TR), (_V32I8, 2)))
        b.store(ir.Constant(_V32I8, [15] * 32), cst)
        b.store(ir.Constant(_V16I16, [1] * 16), b.bitcast(b.gep(cst, [ir.Constant(I32, 1)]), _V16I16.as_pointer()))

    def superblock(bb, s, accs):
        fsplat = lambda v: _fsplat(bb, v)  # noqa: E731

        def act_sums(blk, j):
            """Per row, the activations' sums that sub-block j's min (Q4_K) or scale (Q6_K) multiplies."""
            if fmt == Q4_K:
                i2 = bb.mul(blk, const_i64(2))
                return [fsplat(bb.fadd(bb.load(bb.gep(xmrow[t], [i2]), align=4),
                                       bb.load(bb.gep(xmrow[t], [bb.add(i2, const_i64(1))]), align=4))) for t in range(TR)]
            i16 = bb.add(bb.mul(s, const_i64(16)), const_i64(j))
            return [fsplat(bb.load(bb.gep(xmrow[t], [i16]), align=4)) for t in range(TR)]
        sbps = [bb.gep(wpan[v], [bb.mul(s, const_i64(sbytes))]) for v in range(V)]
        for sbp in sbps if prefetch else ():
            for line in range(0, sbytes, 64):
                prefetch_ahead(bb, module, bb.gep(sbp, [const_i64(line)]), 2)
        ds = [halves_to_floats(bb, _load(bb, sbp, 0, _V16I16, 2)) for sbp in sbps]
        words = [_code_words(bb, sbp) for sbp in sbps] if fmt == Q4_K else None
        ms = [zero] * (TR * V)
        accs = list(accs)
        if asm_q4k:                 # the quants' sums by _avx2_q4k_superblock, on the float sums in fa
            fat = [bb.gep(fa, [ir.Constant(I32, t)]) for t in range(TR)]
            for t in range(TR):
                bb.store(accs[t], fat[t])
            for j in range(nsub):
                blk = bb.add(bb.mul(s, const_i64(SUPER // 32)), const_i64(j))
                fj = bb.fmul(ds[0], bb.sitofp(_code(bb, words[0][2 * (j // 4)], j % 4), _V16F32))
                for t in range(TR):
                    bb.store(bb.fmul(fj, fsplat(bb.load(bb.gep(xsrow[t], [blk]), align=4))),
                             bb.gep(sbuf, [ir.Constant(I32, TR * j + t)]))
            k0 = bb.mul(s, const_i64(SUPER))
            _avx2_q4k_superblock(bb, bb.gep(sbps[0], [const_i64(256)]), [bb.gep(xrow[t], [k0]) for t in range(TR)],
                                 bb.bitcast(sbuf, P8), bb.bitcast(fa, P8), bb.bitcast(cst, P8))
            accs = [bb.load(fat[t]) for t in range(TR)]
        for j in () if asm_q4k else range(nsub):   # the quants' sums in IR
            k0 = bb.add(bb.mul(s, const_i64(SUPER)), const_i64(j * sub))          # first activation of the sub-block
            xp = [bb.gep(xrow[t], [k0]) for t in range(TR)]
            blk = bb.add(bb.mul(s, const_i64(SUPER // 32)), const_i64(j * sub // 32))
            xsv = [fsplat(bb.load(bb.gep(xsrow[t], [blk]), align=4)) for t in range(TR)]
            xmv = None if apart else act_sums(blk, j)
            for v, sbp in enumerate(sbps):
                vecs = _unpacked(bb, fmt, sbp, j, high_in_place=isa == "vnni")
                if isa == "vnni":
                    sums = _vnni_sums(bb, fmt, vecs, xp)
                elif isa == "avx2":
                    sums = _avx2_sums(bb, module, fmt, vecs, xp)
                elif isa == "avxvnni":
                    sums = _avxvnni_sums(bb, module, vecs, xp)
                else:
                    sums = _generic_sums(bb, vecs, xp)
                if fmt == Q4_K:
                    sc = _code(bb, words[v][2 * (j // 4)], j % 4)
                    mnf = None if apart else bb.sitofp(_code(bb, words[v][2 * (j // 4) + 1], j % 4), _V16F32)
                else:
                    sc = bb.sext(_load(bb, sbp, 32 + 16 * j, ir.VectorType(I8, 16)), _V16I32)
                scf = bb.sitofp(sc, _V16F32)
                fj = bb.fmul(ds[v], scf)
                for t in range(TR):
                    a = t * V + v
                    accs[a] = bb.call(fma, [bb.sitofp(sums[t], _V16F32), bb.fmul(fj, xsv[t]), accs[a]])
                    if not apart:
                        ms[a] = bb.call(fma, [mnf if fmt == Q4_K else scf, xmv[t], ms[a]])
        for j in range(nsub) if apart else ():   # the min sums, after the quants' (registers)
            xmv = act_sums(bb.add(bb.mul(s, const_i64(SUPER // 32)), const_i64(j * sub // 32)), j)
            for v, sbp in enumerate(sbps):
                if fmt == Q4_K:
                    mw = bb.sitofp(_code(bb, words[v][2 * (j // 4) + 1], j % 4), _V16F32)
                else:
                    mw = bb.sitofp(bb.sext(_load(bb, sbp, 32 + 16 * j, ir.VectorType(I8, 16)), _V16I32), _V16F32)
                for t in range(TR):
                    ms[t * V + v] = bb.call(fma, [mw, xmv[t], ms[t * V + v]])
        offs = [bb.fneg(halves_to_floats(bb, _load(bb, sbp, 32, _V16I16, 2))) if fmt == Q4_K
                else bb.fmul(ds[v], ir.Constant(_V16F32, [-32.0] * 16)) for v, sbp in enumerate(sbps)]
        return [bb.call(fma, [offs[a % V], ms[a], accs[a]]) for a in range(TR * V)]

    b, accs = emit_counted_loop(fn, b, const_i64(0), nsb, 1, [zero] * (TR * V), superblock, "superblocks")
    for t in range(TR):
        for v in range(V):
            b.store(accs[t * V + v], b.bitcast(b.gep(out, [b.add(b.mul(ost, const_i64(t)), const_i64(64 * v))]),
                                               _V16F32.as_pointer()), align=4)
    b.ret_void()
    return fn


def _make_tile(isa: str, TR: int, V: int, prefetch: bool = True, apart=None):
    @intrinsic
    def tile(typingctx, fmt, w, g, x_q, x_s, x_m, t0, out, o_t):
        """Register tile: out[o_t + t, 16 v .. 16 v + 15] for t < TR, v < V = panel g + v's rows
        against activation row t0 + t (out must have those 16 V columns); fmt Q4_K, else Q6_K.
        No bounds checks."""
        sig = types.void(fmt, w, g, x_q, x_s, x_m, t0, out, o_t)

        def codegen(context, builder, sig, args):
            aw, axq, axs, axm, aout = (context.make_array(sig.args[i])(context, builder, args[i]) for i in (1, 3, 4, 5, 7))
            fmt_, g_, t0_, ot_ = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (0, 2, 6, 8))
            st = lambda a: builder.extract_value(a.strides, 0)  # noqa: E731
            p8 = lambda a: builder.bitcast(a.data, P8)  # noqa: E731
            nsb = builder.ashr(builder.extract_value(axq.shape, 1), const_i64(8))
            xs = [builder.gep(p8(axq), [builder.mul(t0_, st(axq))]), st(axq),
                  builder.gep(p8(axs), [builder.mul(t0_, st(axs))]), st(axs),
                  builder.gep(p8(axm), [builder.mul(t0_, st(axm))]), st(axm),
                  builder.gep(p8(aout), [builder.mul(ot_, st(aout))]), st(aout)]
            with builder.if_else(builder.icmp_signed("==", fmt_, const_i64(Q4_K))) as (q4, q6):
                for f, branch in ((Q4_K, q4), (Q6_K, q6)):
                    with branch:
                        wptr = builder.gep(p8(aw), [builder.mul(builder.mul(g_, nsb), const_i64(SB_BYTES[f]))])
                        builder.call(_define_tile(builder.module, f, isa, TR, V, prefetch, apart), [wptr, nsb] + xs)
            return context.get_dummy_value()

        return sig, codegen
    return tile


GROUP = 4
"""Panels a thread's work is counted in: a group of 64 rows is a work item of :func:`matmul` and
:func:`matmul_many`."""

_tile_a, _tile_b, _tile2, _tile1 = (_make_tile(ISA, t, 1) for t in TILES)
_TILE_A, _TILE_B = TILES[0], TILES[1]
_Q4_K_SKIPS_A, _Q6_K_SKIPS_A = (ISA, Q4_K) in SKIP_LARGEST_TILE, (ISA, Q6_K) in SKIP_LARGEST_TILE


@njit(cache=True, nogil=True)
def _panels(fmt, w, g, npanels, x_q, x_s, x_m, out):
    """Panels g .. g + npanels - 1 against every row of x: out (B, 16 npanels)."""
    B = x_q.shape[0]
    skip_a = _Q4_K_SKIPS_A if fmt == Q4_K else _Q6_K_SKIPS_A
    for v in range(npanels):
        o = out[:, 16 * v:]
        t0 = 0
        while not skip_a and B - t0 >= _TILE_A:
            _tile_a(fmt, w, g + v, x_q, x_s, x_m, t0, o, t0)
            t0 += _TILE_A
        while B - t0 >= _TILE_B:
            _tile_b(fmt, w, g + v, x_q, x_s, x_m, t0, o, t0)
            t0 += _TILE_B
        if B - t0 >= 2:
            _tile2(fmt, w, g + v, x_q, x_s, x_m, t0, o, t0)
            t0 += 2
        if B - t0 >= 1:
            _tile1(fmt, w, g + v, x_q, x_s, x_m, t0, o, t0)


@njit(cache=True, parallel=True)
def matmul(fmt, w, x_q, x_s, x_m, out, nthreads):
    """out[:, :N] = the panels' N rows (N = w.size / row bytes) against rows of (x_q int8 (B, Kp),
    x_s float32 (B, Kp // 32), x_m float32 (B, Kp // 16)), Kp a multiple of 256; w uint8, flat
    (:func:`pack`); out float32 (B, >= N). Groups of GROUP panels split over the threads in
    contiguous ranges."""
    B, Kp = x_q.shape
    sbb = block_bytes(fmt) * PANEL
    if fmt != Q4_K and fmt != Q6_K:
        raise ValueError("kquant_panels.matmul: the format must be Q4_K or Q6_K")
    nsb = Kp // SUPER
    if Kp % SUPER != 0 or nsb == 0 or w.shape[0] % (nsb * sbb) != 0:
        raise ValueError("kquant_panels.matmul: w must hold whole panels of Kp / 256 super-blocks")
    npan = w.shape[0] // (nsb * sbb)
    N = npan * PANEL
    if (x_s.shape[0] != B or x_s.shape[1] * 32 != Kp or x_m.shape[0] != B or x_m.shape[1] * 16 != Kp
            or out.shape[0] != B or out.shape[1] < N):
        raise ValueError("kquant_panels.matmul: shapes must be x_q (B, Kp), x_s (B, Kp // 32), "
                         "x_m (B, Kp // 16), out (B, >= N)")
    if x_q.strides[1] != 1 or x_s.strides[1] != 4 or x_m.strides[1] != 4 or out.strides[1] != 4:
        raise ValueError("kquant_panels.matmul: rows of x_q, x_s, x_m and out must be contiguous")
    ngroups = (npan + GROUP - 1) // GROUP
    nth = max(1, min(nthreads, ngroups))
    for c in prange(nth):
        for grp in range(c * ngroups // nth, (c + 1) * ngroups // nth):
            g = grp * GROUP
            _panels(fmt, w, g, min(GROUP, npan - g), x_q, x_s, x_m, out[:, g * PANEL:])

MATMUL = Addressed(matmul, types.none, [
    (i64, WB, array(types.int8, 2), array(types.float32, 2), array(types.float32, 2), array(types.float32, 2), i64)])
""":func:`matmul` as formats.matmul_rows calls it, through its address (cpullm_kernels.setup.addressed)."""


@njit(cache=True, parallel=True)
def matmul_many(fmt, w, mats, x_q, x_s, x_m, out, nthreads):
    """Several matrices of one format in one parallel region: for each row m of ``mats`` (int64
    (M, 6): w_off, N, row0, nrows, out_row0, col0), out[out_row0 .. + nrows, col0 .. col0 + N] =
    the matrix of N rows at w[w_off:] (:func:`pack`'s layout) against rows row0 .. row0 + nrows
    of (x_q, x_s, x_m) (:func:`matmul`'s shapes, one Kp for all). Work items are (matrix, group of
    GROUP panels), split over the threads in contiguous ranges: a routed layer's 8 experts of
    768 x 2048 took 0.24 ms as 8 calls of :func:`matmul` and 0.18 ms as one matrix of their rows
    (Zen 4, 2 threads), the difference being the calls' thread starts and their ragged ends. Each
    row's numbers are :func:`matmul`'s (the same tiles per group)."""
    Kp = x_q.shape[1]
    nsb = Kp // SUPER
    row_bytes = nsb * block_bytes(fmt)
    if fmt != Q4_K and fmt != Q6_K:
        raise ValueError("kquant_panels.matmul_many: the format must be Q4_K or Q6_K")
    M = mats.shape[0]
    first = np.zeros(M + 1, np.int64)
    for m in range(M):
        N = mats[m, 1]
        if (Kp % SUPER != 0 or nsb == 0 or N % PANEL != 0 or mats[m, 0] < 0
                or mats[m, 0] + N * row_bytes > w.shape[0] or mats[m, 2] < 0
                or mats[m, 2] + mats[m, 3] > x_q.shape[0] or mats[m, 3] < 0 or mats[m, 4] < 0
                or mats[m, 4] + mats[m, 3] > out.shape[0] or mats[m, 5] < 0 or mats[m, 5] + N > out.shape[1]):
            raise ValueError("kquant_panels.matmul_many: a matrix or its rows lie outside the operands")
        first[m + 1] = first[m] + (N // PANEL + GROUP - 1) // GROUP
    total = first[M]
    nth = max(1, min(nthreads, total))
    for c in prange(nth):
        m = 0
        for item in range(c * total // nth, (c + 1) * total // nth):
            while item >= first[m + 1]:
                m += 1
            w_off, N, r0, nr, o0, col0 = mats[m, 0], mats[m, 1], mats[m, 2], mats[m, 3], mats[m, 4], mats[m, 5]
            if nr == 0:
                continue
            g = (item - first[m]) * GROUP
            npan = N // PANEL
            _panels(fmt, w[w_off: w_off + N * row_bytes], g, min(GROUP, npan - g), x_q[r0: r0 + nr],
                    x_s[r0: r0 + nr], x_m[r0: r0 + nr], out[o0: o0 + nr, col0 + g * PANEL:])


@njit(cache=True, parallel=True)
def quantize_rows_q8k(x, x_q, x_s, x_m):
    for t in prange(x.shape[0]):
        quantize_act_q8(x[t], x_q[t], x_s[t], x_m[t])


def quantize_rows(x, Kp: int):
    """Rows of x float32 (T, K) -> (x_q int8 (T, Kp), x_s (T, Kp // 32), x_m (T, Kp // 16)),
    zero past K (kquant.quantize_act_q8 on each row)."""
    T, K = x.shape
    xp = x if K == Kp else np.concatenate([x, np.zeros((T, Kp - K), np.float32)], axis=1)
    x_q = np.empty((T, Kp), np.int8)
    x_s = np.empty((T, Kp // 32), np.float32)
    x_m = np.empty((T, Kp // 16), np.float32)
    quantize_rows_q8k(np.ascontiguousarray(xp, np.float32), x_q, x_s, x_m)
    return x_q, x_s, x_m


def matmul_float(fmt, x, w, N: int, out):
    """out[:, :N] = x (T, K) @ W.T (prefill): x quantized per row, then :func:`matmul`."""
    nsb_bytes = SB_BYTES[int(fmt)]
    Kp = w.size // (N // PANEL) // nsb_bytes * SUPER
    x_q, x_s, x_m = quantize_rows(np.asarray(x, np.float32), Kp)
    matmul(int(fmt), w, x_q, x_s, x_m, out, numba.get_num_threads())


@njit(cache=True, nogil=True)
def scaled_row_into(fmt, w, Kp, n, scale, out):
    """out[k] = w[n, k] * scale for k < out.size: row n as numbers (the values
    gguf_blocks.dequantize_ref gives, then one product), for an EMBED table stored as panels."""
    nsb = Kp // SUPER
    g, lane = n // PANEL, n % PANEL
    sbb = block_bytes(fmt) * PANEL
    for k in range(out.shape[0]):
        s, r = k // SUPER, k % SUPER
        p = (g * nsb + s) * sbb
        d = half_to_float(np.uint16(w[p + 2 * lane]) | (np.uint16(w[p + 2 * lane + 1]) << np.uint16(8)))
        if fmt == Q4_K:
            j, t, h, e = r // 32, (r % 32) // 8, (r % 8) // 4, r % 4
            byte = w[p + 256 + 64 * (4 * j + t) + 4 * lane + e]
            q = np.int32((byte >> np.uint8(4 * h)) & np.uint8(15))
            sc, mn = _k_code(w, p, lane, j)
            dmin = half_to_float(np.uint16(w[p + 32 + 2 * lane]) | (np.uint16(w[p + 33 + 2 * lane]) << np.uint16(8)))
            v = (d * np.float32(sc)) * np.float32(q) - dmin * np.float32(mn)
        else:
            j, u, e = r // 16, (r % 16) // 4, r % 4
            base = p + 288 + 192 * j + 4 * lane + e
            lo = (w[base + 64 * (u // 2)] >> np.uint8(4 * (u % 2))) & np.uint8(15)
            hi = (w[base + 128] >> np.uint8(2 * u)) & np.uint8(3)
            sc = np.int8(w[p + 32 + 16 * j + lane])
            v = (d * np.float32(sc)) * (np.float32(np.int32(lo | (hi << np.uint8(4)))) - np.float32(32))
        out[k] = v * scale


@njit(cache=True, nogil=True, inline="always")
def _k_code(w, p, lane, j):
    """Q4_K's 6-bit (sc_j, mn_j) of a lane of the panel super-block at byte p."""
    base = p + 64 + 4 * lane
    jj = j % 4                                   # byte j of the 12 is byte j % 4 of word j // 4
    b0 = np.int32(w[base + jj])                  # byte j % 4      (word 0)
    b1 = np.int32(w[base + 64 + jj])             # byte 4 + j % 4  (word 1)
    b2 = np.int32(w[base + 128 + jj])            # byte 8 + j % 4  (word 2)
    if j < 4:
        return b0 & 63, b1 & 63
    return (b2 & 15) | ((b0 >> 6) << 4), (b2 >> 4) | ((b1 >> 6) << 4)
