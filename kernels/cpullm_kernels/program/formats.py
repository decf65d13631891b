"""The weight formats a compiled program stores its matrices in, one row of :data:`FORMATS` each:
how the compiler lays a block of its rows out (pack), how a matrix of that format lies in the
program's arrays (its spans, so its bytes; a row's bytes; a member's weight slot), how a prefill
chunk multiplies by it, how its values are read back as numbers, which head screen reads it for
greedy decoding, whether a decode batch's rows equal a lone decode's, and which optional operand
of the interpreter (so which warm-up specialization) its kernels need. Every reader of a LINEAR's (or EMBED's, or an expert's)
weight kind looks it up here instead of testing ``kind == WEIGHT_…``: the compiler's packer, the
executor's prefill, the batch decoder, a plugin op's matrices, the execution cache's bounds check,
the head screen, the bench's memory-bound count and the warm-up.

    kind            name     lies in                            row of K weights
    WEIGHT_F32      f32      wf, N * K float32                  4 K bytes
    WEIGHT_Q8       q8       wq int8 + ws binary16 scales, in   Kp + Kp / 16 bytes (Kp: K to
                             panels of 16 rows, N padded to 64  whole blocks of 32)
    WEIGHT_BLOCKS   blocks   wq's bytes: raw ggml blocks, the   the ggml type's row bytes
                             ggml type in s_off (+ PANELED:
                             Q4_K / Q6_K in panels of 16 rows)

(Q4_K / Q6_K panels, the file's own GGUF blocks and ``quant="q4"``'s 4-bit blocks are all
WEIGHT_BLOCKS: their sub-format is the ggml type the kernels read from s_off; a GGUF's Q8_0 goes
in as q8, the same values.)

Why a table of Python rows plus integer codes in the compiled kernels: numba compiles a kernel per
argument type, not per Python object, so a compiled driver cannot call a row's function. The
kernels that run inside one compiled call (:mod:`cpullm_kernels.program.interpreter`'s decode, the
batch decoder's fused segments, the routed experts) switch on the same integer ``kind`` the
program stores in two functions here, :func:`matmul_rows` (a batch of rows, each quantized alone)
and :func:`embed_row_into` (an EMBED row), which those three call instead of keeping a driver per
format each; numba prunes a branch whose operand is None (``wb``), so a program without raw blocks
compiles no block kernel. tests/test_formats.py runs every kind of the table through both against
the row's prefill and dense values. Everything called from Python (packing, prefill, plugin op
matrices, bounds, bytes, screen, warm-up flags) takes the row's function from this table.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
from numba import njit
from numba import types as nt

from ..panels.kquant_panels import MATMUL as KPANELS_MATMUL
from ..panels.kquant_panels import PANELED
from ..panels.kquant_panels import matmul_many as matmul_kpanels_many
from ..panels.kquant_panels import scaled_row_into as scaled_kpanel_row_into
from ..panels.q8_panels import PANELS_MATMUL, PANELS_MATVEC, ROW_ALIGN, padded_rows, panels_matmul_many, scaled_row_into
from ..rows.batch_linear import linear_rows_f32
from ..rows.gguf_blocks import BY_TYPE
from ..rows.kquant import matvec_at as blocks_matvec_at
from ..rows.kquant import quantize_act_q8_at
from ..rows.q8 import matvec_f32, quantize_act_q16_at
from ..tiles.kquant_gemm import dequantize_rows_into
from ..setup.addressed import Addressed
from ..setup.operand_types import ARENA, WB, WF, WQ, WS, XQ, array, i64
from .program_table import WEIGHT_BLOCKS, WEIGHT_F32, WEIGHT_Q8

ITEM_BYTES = {"wq": 1, "ws": 2, "wf": 4}
"""Bytes per element of the program's weight arrays (wq int8 / raw block bytes, ws binary16, wf float32)."""


@dataclass(frozen=True)
class WeightFormat:
    """One stored weight format. The functions take a matrix's operands as the program stores them:
    ``w_off``, ``s_off`` (scales' offset in ws, or the ggml type), ``Kp`` (weights per stored row),
    the matrix's N rows and K columns."""

    kind: int
    """program_table.WEIGHT_*: the code LINEAR_KIND / EMBED_KIND / an expert's table holds."""
    name: str
    pack: Callable
    """(s_off, *rows) -> {array: values}: a block of a matrix's rows in the layout this format
    stores (f32: the float32 rows; q8: (int8 quants, binary16 scales) into panels of 16 rows,
    padded to whole groups of 64; raw blocks: the file's block rows, regrouped into panels of 16
    rows when s_off says PANELED), by the array it goes to. The compiler appends the values."""
    spans: Callable
    """(N, K, Kp, w_off, s_off) -> ((array, first element, elements), ...): where the matrix lies
    (padding rows included), or None when K, Kp or s_off cannot be this format's."""
    row_bytes: Callable
    """(Kp, s_off) -> bytes of one stored row (q8: its quants and binary16 scales)."""
    slot: Callable
    """(w_off, s_off, Kp, r0, n) -> where rows [r0, r0 + n) of the matrix lie, as the compiled
    program's ``meta["weight_slots"]`` records a tensor: [label, first element, elements, Kp,
    scale offset or -1] (q8: the whole matrix's offsets, the panels interleave rows, and a sixth
    item, the first row; raw blocks: label the ggml type's name, "Q4_K panels" in panels, whose
    member rows are whole panels and so still their own byte range)."""
    prefill: Callable
    """(wq, ws, wf, w_off, s_off, Kp, N, x, out): out[:, :N] = x (T, K) @ W.T, a prefill chunk's
    product; ``out`` float32 (T, >= N), rows C-contiguous (the kernels' one specialization)."""
    dense: Callable
    """(wq, ws, wf, w_off, s_off, Kp, N, K) -> float32 (N, K): the values the program holds."""
    screen: Callable
    """(s_off) -> which head screen reads an lm_head of this format for greedy decoding: "q8"
    (cpullm_kernels.panels.head_screen), "blocks" (head_screen_blocks: its SCREEN_FORMATS), or None."""
    decode_exact: bool
    """The batch decoder's rows equal a one-token decode bit for bit (f32's batch kernel is not
    promised to: cpullm_kernels.rows.batch_linear)."""
    one_pass: Callable
    """(s_off) -> whether :func:`matmul_rows` reads the matrix once for a batch of rows (q8, f32,
    Q4_K / Q6_K panels) or once per row (other raw blocks, a row at a time): what an extra row of
    a verify pass costs."""
    run_flag: str | None
    """interpreter.run's optional operand a LINEAR of this format needs (warmup.RUN_FLAGS)."""
    embed_flag: str | None
    """... an EMBED table of this format needs."""


def _nbytes(spans) -> int:
    return sum(n * ITEM_BYTES[a] for a, _, n in spans)


# ---- float32 ------------------------------------------------------------------------------------

def _f32_pack(s_off, rows):
    return {"wf": rows}


def _f32_spans(N, K, Kp, w_off, s_off):
    return (("wf", w_off, N * K),) if 0 < K and Kp == K else None


def _f32_slot(w_off, s_off, Kp, r0, n):
    return ["f32", w_off + r0 * Kp, n * Kp, Kp, -1]


def _f32_prefill(wq, ws, wf, w_off, s_off, Kp, N, x, out):
    from ..rows.q8 import matmul_f32
    K = x.shape[1]
    matmul_f32(x, wf[w_off: w_off + N * K].reshape(N, K), out[:, :N])


def _f32_dense(wq, ws, wf, w_off, s_off, Kp, N, K):
    return wf[w_off: w_off + N * K].reshape(N, K)


# ---- q8: int8 panels ----------------------------------------------------------------------------

def _q8_pack(s_off, q, scales):
    from ..panels.q8_panels import pack_panels
    wp, sp = pack_panels(q, scales)
    return {"wq": wp, "ws": sp}


def _q8_spans(N, K, Kp, w_off, s_off):
    if not 0 < K <= Kp or Kp % 32:
        return None
    Np = padded_rows(N)
    return ("wq", w_off, Np * Kp), ("ws", s_off, Np * (Kp // 32))


def _q8_slot(w_off, s_off, Kp, r0, n):
    return ["q8", w_off, n * Kp, Kp, s_off, r0]


def _q8_prefill(wq, ws, wf, w_off, s_off, Kp, N, x, out):
    from ..panels.q8_panels import matmul_panels
    Np = padded_rows(N)
    matmul_panels(x, wq[w_off: w_off + Np * Kp], ws[s_off: s_off + Np * (Kp // 32)], N, out)


def _q8_dense(wq, ws, wf, w_off, s_off, Kp, N, K):
    from ..panels.q8_panels import dequantized_rows
    Np = padded_rows(N)
    rows = dequantized_rows(wq[w_off: w_off + Np * Kp], ws[s_off: s_off + Np * (Kp // 32)], Kp, 0, N)
    return np.ascontiguousarray(rows[:, :K], dtype=np.float32)


# ---- raw ggml blocks ----------------------------------------------------------------------------

def block_rows_bytes(s_off: int, rows: int, Kp: int) -> int | None:
    """Bytes of ``rows`` rows of ``Kp`` weights in the ggml block type ``s_off`` (plus PANELED:
    rows in panels of 16, the last one padded), or None when ``s_off`` or ``Kp`` cannot be one."""
    if s_off < 0 or s_off >= 2 * PANELED:
        return None
    spec = BY_TYPE.get(s_off % PANELED)
    if spec is None or Kp <= 0 or Kp % spec.block_weights:
        return None
    if s_off >= PANELED:
        rows = -(-rows // 16) * 16
    return rows * (Kp // spec.block_weights) * spec.block_bytes


def _blocks_pack(s_off, raw):
    from ..panels import kquant_panels
    if s_off >= PANELED:
        raw = kquant_panels.pack(s_off % PANELED, raw)
    return {"wq": raw.view(np.int8).reshape(-1)}


def _blocks_spans(N, K, Kp, w_off, s_off):
    need = block_rows_bytes(s_off, N, Kp)
    return (("wq", w_off, need),) if need is not None and 0 < K <= Kp else None


def _blocks_slot(w_off, s_off, Kp, r0, n):
    spec = BY_TYPE[s_off % PANELED]
    rb = spec.row_bytes(Kp)
    return [f"{spec.name} panels" if s_off >= PANELED else spec.name, w_off + r0 * rb, n * rb, Kp, -1]


def _blocks_prefill(wq, ws, wf, w_off, s_off, Kp, N, x, out):
    """kquant_gemm.matmul, or kquant_panels.matmul_float for Q4_K / Q6_K in panels; rows stored
    padded to Kp weights (zero weights) get x padded with zeros."""
    from ..panels.kquant_panels import matmul_float
    from ..tiles.kquant_gemm import matmul
    wb, fmt = wq.view(np.uint8), s_off % PANELED
    rb = BY_TYPE[fmt].row_bytes(Kp)
    out = out[:, :N]
    if s_off >= PANELED:                   # Q4_K / Q6_K in panels of 16 rows
        matmul_float(fmt, x, wb[w_off: w_off + N * rb], N, out)
        return
    w = wb[w_off: w_off + N * rb].reshape(N, rb)
    if x.shape[1] != Kp:
        xp = np.zeros((x.shape[0], Kp), np.float32)
        xp[:, :x.shape[1]] = x
        x = xp
    matmul(fmt, x, w, out)


def _blocks_dense(wq, ws, wf, w_off, s_off, Kp, N, K):
    from ..panels.kquant_panels import dequantize_ref
    from ..tiles.kquant_gemm import dequantize
    fmt = s_off % PANELED
    rb = BY_TYPE[fmt].row_bytes(Kp)
    data = wq.view(np.uint8)[w_off: w_off + N * rb]
    full = dequantize_ref(fmt, data, N, Kp) if s_off >= PANELED else dequantize(fmt, data.reshape(N, rb), Kp)
    return np.ascontiguousarray(full[:, :K], dtype=np.float32)


def _blocks_screen(s_off):
    from ..panels.head_screen_blocks import SCREEN_FORMATS
    return "blocks" if s_off in SCREEN_FORMATS else None


FORMATS = {f.kind: f for f in (
    WeightFormat(WEIGHT_F32, "f32", pack=_f32_pack, spans=_f32_spans, row_bytes=lambda Kp, s_off: 4 * Kp,
                 slot=_f32_slot, prefill=_f32_prefill, dense=_f32_dense, screen=lambda s_off: None,
                 decode_exact=False, one_pass=lambda s_off: True, run_flag=None, embed_flag=None),
    WeightFormat(WEIGHT_Q8, "q8", pack=_q8_pack, spans=_q8_spans, row_bytes=lambda Kp, s_off: Kp + Kp // 16,
                 slot=_q8_slot, prefill=_q8_prefill, dense=_q8_dense, screen=lambda s_off: "q8",
                 decode_exact=True, one_pass=lambda s_off: True, run_flag=None, embed_flag=None),
    WeightFormat(WEIGHT_BLOCKS, "blocks", pack=_blocks_pack, spans=_blocks_spans,
                 row_bytes=lambda Kp, s_off: BY_TYPE[s_off % PANELED].row_bytes(Kp), slot=_blocks_slot,
                 prefill=_blocks_prefill, dense=_blocks_dense, screen=_blocks_screen, decode_exact=True,
                 one_pass=lambda s_off: s_off >= PANELED, run_flag="blocks", embed_flag="embed_blocks"),
)}
"""kind -> WeightFormat, every kind a program may store."""


def weight_format(kind) -> WeightFormat:
    """The row of ``kind``; ValueError for a kind no format has (a program from elsewhere)."""
    found = FORMATS.get(int(kind))
    if found is None:
        raise ValueError(f"weight kind {kind} is none of the stored formats {sorted(FORMATS)}")
    return found


def matrix_bytes(kind, N: int, K: int, Kp: int, w_off: int, s_off: int) -> int:
    """Bytes a stored matrix takes (what a pass over it reads), padding rows included."""
    spans = weight_format(kind).spans(int(N), int(K), int(Kp), int(w_off), int(s_off))
    if spans is None:
        raise ValueError(f"a {weight_format(kind).name} matrix ({N}, {K}) cannot have Kp {Kp}, s_off {s_off}")
    return _nbytes(spans)


# The matrix kernels matmul_rows calls through their address (cpullm_kernels.setup.addressed, declared
# beside each): linked, each was compiled again inside every specialization of matmul_rows and
# every caller above it.
panels_matmul_at, kpanels_matmul_at = PANELS_MATMUL.call, KPANELS_MATMUL.call
panels_matvec_at = PANELS_MATVEC.call

# The float32 kernels, called through their address: compiled on their first call, so a program
# without float32 LINEARs (every GGUF file of quantized matrices) never compiles them (linked,
# they were about 1 s of the block driver's 5-6 s of CPU).
F32_MATVEC = Addressed(matvec_f32, nt.none, [(array(nt.float32, 2, readonly=True), array(nt.float32, 1, layout=lay),
                                              array(nt.float32, 1)) for lay in ("C", "A")])
F32_ROWS = Addressed(linear_rows_f32, nt.none, [(array(nt.float32, 2, layout=lay), array(nt.float32, 2, readonly=True),
                                                 array(nt.float32, 2, layout="A")) for lay in ("C", "A")])
matvec_f32_at, linear_rows_f32_at = F32_MATVEC.call, F32_ROWS.call


# ---- a batch of rows in one compiled call -----------------------------------------------------------

@njit(cache=True)
def matmul_rows(kind, w_off, s_off, Kp, N, wq, ws, wf, wb, wbp, x, out, xq, xs, f32_lone, nthreads):
    """out[:, :N] = x (T, K) @ W.T from inside a compiled call: the one-token decode (T = 1), a
    decode batch's rows (the batch decoder's fused segments), the rows routed to an expert. Each
    row's activations are quantized on their own, exactly as a lone decode quantizes them, and the
    kernels compute every row as they would alone: q8 and Q4_K / Q6_K panels in one pass over the
    weights for all rows, other raw blocks a row at a time (kquant.matvec), float32 one row at a
    time through the decode's matvec (``f32_lone``) or in one pass (rows.batch_linear, which is
    not promised to equal it bit for bit).

    ``out`` (T, >= N) C-contiguous. Scratch, flat: ``xq`` int16 (>= T * Kp; raw blocks use its
    bytes as int8), ``xs`` float32 (>= T * Kp // 32 * 3). ``wb``: wq's bytes, None when no matrix
    of raw blocks can reach here (numba then compiles no block kernel); ``wbp`` the same for Q4_K
    / Q6_K matrices, which the compiler may store in panels (warmup.run_flags): None keeps the
    panel kernel out (9.4 of the 19.3 s of CPU a Q4_1 file's block driver took to compile on a
    2-core Zen 4). Leaves the last row's
    quantized activations at the start of the scratch (the interpreter's refinement reads them)."""
    T, K = x.shape
    nb = Kp // 32
    quantize_rows_into(kind, Kp, x, xq, xs, wb)
    if kind == WEIGHT_Q8:
        Np = padded_rows(N)
        wp, sp = wq[w_off: w_off + Np * Kp], ws[s_off: s_off + Np * nb]
        x_q, x_s = xq[:T * Kp].reshape((T, Kp)), xs[:T * nb].reshape((T, nb))
        if T == 1:                          # decode: the kernel of the one-row tile alone
            panels_matvec_at(wp, sp, N, x_q, x_s, out, nthreads)
        else:
            panels_matmul_at(wp, sp, N, x_q, x_s, out, nthreads)
    elif kind == WEIGHT_BLOCKS:
        if wb is None:
            raise ValueError("cpullm formats: a matrix of raw ggml blocks needs wb")
        fmt = s_off % PANELED
        row_bytes = Kp // _BLOCK_WEIGHTS[fmt] * _BLOCK_BYTES[fmt]
        x_q = xq.view(np.int8)[:T * Kp].reshape((T, Kp))
        x_s = xs[:T * nb].reshape((T, nb))
        x_m = xs[T * nb: T * nb + T * 2 * nb].reshape((T, 2 * nb))
        if s_off >= PANELED:                # Q4_K / Q6_K in panels of 16 rows
            if wbp is None:
                raise ValueError("cpullm formats: a matrix in Q4_K / Q6_K panels needs wbp")
            kpanels_matmul_at(fmt, wbp[w_off: w_off + N * row_bytes], x_q, x_s, x_m, out, nthreads)
        else:
            w2 = wb[w_off: w_off + N * row_bytes].reshape((N, row_bytes))
            for t in range(T):
                blocks_matvec_at(fmt, w2, x_q[t], x_s[t], x_m[t], out[t, :N])
    elif kind == WEIGHT_F32:
        w = wf[w_off: w_off + N * K].reshape((N, K))
        if f32_lone:
            for t in range(T):
                matvec_f32_at(w, x[t], out[t, :N])
        else:
            linear_rows_f32_at(x, w, out[:, :N])
    else:
        raise ValueError("cpullm formats: unknown weight kind")


WB_KINDS = (nt.none, WB)                # a program without / with raw-block matrices


def matmul_rows_signature(wb, wbp, layout: str = "C") -> tuple:
    """matmul_rows' argument types for the operand types ``wb`` / ``wbp`` and rows x of ``layout``."""
    return (i64, i64, i64, i64, i64, WQ, WS, WF, wb, wbp, array(nt.float32, 2, layout=layout), array(nt.float32, 2),
            XQ, ARENA, nt.boolean, i64)


MATMUL_ROWS = Addressed(matmul_rows, nt.none, [
    matmul_rows_signature(wb, wbp, layout) for layout in ("C", "A") for wb in WB_KINDS for wbp in WB_KINDS])
"""matmul_rows as the LINEAR driver (x one C-contiguous row) and the batched step (x a strided view)
call it, through its address (cpullm_kernels.setup.addressed)."""


@njit(cache=True, inline="always")
def quantize_rows_into(kind, Kp, x, xq, xs, wb):
    """The activations of rows x (T, K) as :func:`matmul_rows` multiplies them by a matrix of
    ``kind``, each row alone: q8 int16 in xq[:T * Kp], scales in xs[:T * Kp // 32]; raw blocks
    int8 in xq's bytes, scales xs[:T nb], the sums of 16 xs[T nb: 3 T nb] (nb = Kp // 32), zero
    past K; float32 nothing (its kernels read x). ``wb``: the raw blocks' bytes, None in a program
    without them (numba then compiles no int8 quantizer here)."""
    T, K = x.shape
    nb = Kp // 32
    if kind == WEIGHT_Q8:
        x_q = xq[:T * Kp].reshape((T, Kp))
        x_s = xs[:T * nb].reshape((T, nb))
        for t in range(T):
            quantize_act_q16_at(x[t], x_q[t], x_s[t])
    elif kind == WEIGHT_BLOCKS:
        if wb is None:
            raise ValueError("cpullm formats: a matrix of raw ggml blocks needs wb")
        x_q = xq.view(np.int8)[:T * Kp].reshape((T, Kp))
        x_s = xs[:T * nb].reshape((T, nb))
        x_m = xs[T * nb: T * nb + T * 2 * nb].reshape((T, 2 * nb))
        for t in range(T):
            quantize_act_q8_at(x[t], x_q[t, :K], x_s[t, :K // 32], x_m[t, :K // 16])
            for j in range(K, Kp):          # padding weights are zero: their activations too
                x_q[t, j] = 0
            for j in range(K // 32, nb):
                x_s[t, j] = 0.0
            for j in range(K // 16, 2 * nb):
                x_m[t, j] = 0.0


@njit(cache=True)
def many_at_once(kind, s_off, N):
    """Whether :func:`matmul_many` takes a matrix of ``kind`` (s_off its scales' offset or ggml
    type) with N rows: q8 panels of whole groups, Q4_K / Q6_K panels."""
    if kind == WEIGHT_Q8:
        return N % ROW_ALIGN == 0
    return kind == WEIGHT_BLOCKS and s_off >= PANELED


@njit(cache=True)
def matmul_many(kind, fmt, Kp, wq, ws, wbp, mats, x, out, xq, xs, nthreads):
    """Several matrices of one kind (and ggml type ``fmt`` for panels) in one parallel region:
    for each row m of ``mats`` (int64 (M, 7): w_off, s_off, N, row0, nrows, out_row0, col0),
    out[out_row0 .. + nrows, col0 .. col0 + N] = rows row0 .. row0 + nrows of x (T, K) times the matrix,
    each row's activations quantized alone (:func:`quantize_rows_into`), so every number is
    :func:`matmul_rows`'. Every matrix must pass :func:`many_at_once`; scratch as matmul_rows'."""
    T = x.shape[0]
    nb = Kp // 32
    quantize_rows_into(kind, Kp, x, xq, xs, wbp)
    if kind == WEIGHT_Q8:
        panels_matmul_many(wq, ws, mats, xq[:T * Kp].reshape((T, Kp)), xs[:T * nb].reshape((T, nb)), out,
                           nthreads)
    elif kind == WEIGHT_BLOCKS:
        if wbp is None:
            raise ValueError("cpullm formats: a matrix in Q4_K / Q6_K panels needs wbp")
        m6 = np.empty((mats.shape[0], 6), np.int64)       # s_off (the ggml type) dropped
        for m in range(mats.shape[0]):
            m6[m, 0] = mats[m, 0]
            for c in range(1, 6):
                m6[m, c] = mats[m, c + 1]
        matmul_kpanels_many(fmt, wbp, m6, xq.view(np.int8)[:T * Kp].reshape((T, Kp)),
                            xs[:T * nb].reshape((T, nb)), xs[T * nb: T * nb + T * 2 * nb].reshape((T, 2 * nb)),
                            out, nthreads)
    else:
        raise ValueError("cpullm formats: matmul_many takes q8 and Q4_K / Q6_K panels")


@njit(cache=True, inline="always")
def int8_activations(kind):
    """Whether the kernels of ``kind`` multiply int8 activations (raw blocks; q8 reads int16):
    the interpreter's head refines their rounding error with a second pass."""
    return kind == WEIGHT_BLOCKS


@njit(cache=True)
def embed_row_into(kind, w_off, s_off, Kp, wq, ws, wf, wb, n, scale, out):
    """out[j] = W[n, j] * scale for j < out.size: row n of a stored matrix as numbers (an EMBED
    table's row; a table tied to the lm_head is stored as the lm_head is). ``wb``: wq's bytes, or
    None for a program whose table is not raw blocks."""
    H = out.shape[0]
    if kind == WEIGHT_Q8:                   # row n of the panels
        scaled_row_into(wq[w_off:], ws[s_off:], Kp, n, scale, out)
    elif kind == WEIGHT_BLOCKS:
        if wb is None:
            raise ValueError("cpullm formats: a table of raw ggml blocks needs wb")
        fmt = s_off % PANELED
        if s_off >= PANELED:                # a table in panels (tied to a panel lm_head)
            scaled_kpanel_row_into(fmt, wb[w_off:], Kp, n, scale, out)
            return
        row_bytes = Kp // _BLOCK_WEIGHTS[fmt] * _BLOCK_BYTES[fmt]
        buf = np.empty((1, Kp), np.float32)
        dequantize_rows_into(fmt, wb[w_off + n * row_bytes: w_off + (n + 1) * row_bytes].reshape((1, row_bytes)),
                             0, 1, buf)
        for j in range(H):
            out[j] = buf[0, j] * scale
    elif kind == WEIGHT_F32:
        for j in range(H):
            out[j] = wf[w_off + n * H + j] * scale
    else:
        raise ValueError("cpullm formats: unknown weight kind")


_BLOCK_BYTES = np.array([BY_TYPE[t].block_bytes if t in BY_TYPE else 0 for t in range(max(BY_TYPE) + 1)], np.int64)
_BLOCK_WEIGHTS = np.array([BY_TYPE[t].block_weights if t in BY_TYPE else 0 for t in range(max(BY_TYPE) + 1)],
                          np.int64)
