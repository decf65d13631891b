"""The execution-program interpreter: one compiled call runs a range of instructions.

An ExecutionProgram (see cpullm.compile.compiler) is a table of instructions ``I`` (int64, NI columns)
and ``F`` (float64, NF columns) over flat arrays:

    arena  float32  activations, every value at (offset, row stride)
    state  float32  KV caches and linear-attention states
    wq     int8     quantized weights (q8 block-32), ws uint16 their scales (binary16 bits);
                    also the raw bytes of GGUF-format blocks (kind WEIGHT_BLOCKS, read as ``wb``)
    wf     float32  float weights (norms, biases, f32-mode matrices, RoPE frequencies, ...)

Decode runs the whole token (every layer and the head) in a single call of :func:`run`; prefill
runs the non-matmul ops through the same function between batched matmuls done by the executor.

The columns of ``I`` and ``F`` are named in :mod:`cpullm_kernels.program.program_table` (every reader
indexes them by those names). ``rt`` = [T, pos0, head_row0, head_rows, threads].
"""
from __future__ import annotations

import numpy as np
from numba import njit
from numba import types as nt

from ..attention.attention import ATTENTION
from ..ops.elementwise import copy_rows
from ..attention.gated_delta import gated_delta
from ..setup.addressed import Addressed
from .formats import WB_KINDS, MATMUL_ROWS, embed_row_into, int8_activations
from .row_ops import ROW_OP, ROW_OP_PAR, is_row_op
from ..setup.operand_types import ARENA, PROG_I, WF, WQ, WS, XQ, i64
from . import program_table as P
from .program_table import (  # noqa: F401  (re-exported: the opcodes and weight kinds by their old home)
    NF, NI, OP_ADD, OP_ATTENTION, OP_EMBED, OP_GATED_DELTA, OP_GLU, OP_LAYERNORM, OP_LINEAR, OP_PLUGIN,
    OP_RMSNORM, OP_ROPE, OP_SCALE, OP_SELECT_ROWS, OP_SIGMOID_MUL, OP_SOFTCAP, WEIGHT_BLOCKS, WEIGHT_F32,
    WEIGHT_Q8,
)

# Ops a plugin kernel may replace, and the arguments its function receives (the reference
# kernel's signature). The executor calls the external function with exactly these: the integers
# are the row's program_table.GATED_DELTA_KERNEL_COLUMNS, in that order.
EXTERNAL_SIGNATURES = {
    OP_GATED_DELTA: "gated_delta(arena, state, wf, qkv_off, qkv_st, z_off, z_st, b_off, b_st, "
                    "a_off, a_st, o_off, o_st, nk, dk, nv, dv, conv_k, conv_w_off, dt_off, alog_off, "
                    "norm_off, s_off, eps, T)",
}


# The large kernels the interpreter calls through their address (cpullm_kernels.setup.addressed):
# linked, each was compiled again inside run (5.5 s of the default model's cold start).
attention_at, matmul_rows_at = ATTENTION.call, MATMUL_ROWS.call
row_op_at, row_op_par_at = ROW_OP.call, ROW_OP_PAR.call


@njit(cache=True)
def linear_rows(I, r, arena, wq, ws, wf, wb, wbp, xq, xs, T, refine, nthreads):
    """LINEAR r one row of activations at a time (decode; T is 1 or the head's few rows), each row
    through :func:`cpullm_kernels.program.formats.matmul_rows` as a batch of one, whatever the
    weight format; then the bias. ``wb``: wq's bytes for a program with raw-block LINEARs, else
    None (no block kernel compiled); ``wbp``: the same for one with Q4_K / Q6_K LINEARs (their panel
    kernel). ``xq`` / ``xs``: the executor's one-row scratch (xs sized
    max_k // 32 * 3: raw blocks' scales and 16-sums)."""
    x_off, x_st, o_off, o_st = I[r, P.LINEAR_X_OFF], I[r, P.LINEAR_X_ST], I[r, P.LINEAR_OUT_OFF], I[r, P.LINEAR_OUT_ST]
    K, N, kind = I[r, P.LINEAR_K], I[r, P.LINEAR_N], I[r, P.LINEAR_KIND]
    w_off, s_off, Kp, b_off = I[r, P.LINEAR_W_OFF], I[r, P.LINEAR_S_OFF], I[r, P.LINEAR_KP], I[r, P.LINEAR_BIAS_OFF]
    # ``refine``: a second pass on int8 activations' rounding error (which leaves 1/254 of it),
    # for the head after a prefill chunk, whose body ran with int16 activations: one pass flipped
    # SmolLM2-135M Q4_1's first chat token after "What is the capital of France?" ("The" -> "L",
    # top-2 logits 0.08 apart, moved by 0.24; llama.cpp, int8 activations too, says "L"). Decode
    # steps keep one pass: their body LINEARs' int8 rounding dominates there (mean KL to f32
    # 0.006 over that prompt with or without it) and the lm_head would be read twice.
    refine = refine and int8_activations(kind)
    res = np.empty((1, K if refine else 0), np.float32)
    extra = np.empty((1, N if refine else 0), np.float32)
    x_q = xq.view(np.int8)
    for t in range(T):
        x = arena[x_off + t * x_st: x_off + t * x_st + K]
        out = arena[o_off + t * o_st: o_off + t * o_st + N]
        matmul_rows_at(kind, w_off, s_off, Kp, N, wq, ws, wf, wb, wbp, x.reshape((1, K)), out.reshape((1, N)), xq,
                       xs, True, nthreads)
        if refine:
            for j in range(K):
                res[0, j] = x[j] - np.float32(x_q[j]) * xs[j // 32]
            matmul_rows_at(kind, w_off, s_off, Kp, N, wq, ws, wf, wb, wbp, res, extra, xq, xs, True, nthreads)
            for n in range(N):
                out[n] += extra[0, n]
        if b_off >= 0:
            for n in range(N):
                out[n] += wf[b_off + n]


def linear_rows_signature(wb, wbp) -> tuple:
    """linear_rows' argument types for the operand types ``wb`` / ``wbp`` (None or WB)."""
    return (PROG_I, i64, ARENA, WQ, WS, WF, wb, wbp, XQ, ARENA, i64, nt.boolean, i64)


LINEAR_ROWS = Addressed(linear_rows, nt.none, [linear_rows_signature(wb, wbp) for wb in WB_KINDS for wbp in WB_KINDS])
"""linear_rows as :func:`run` calls it, through its address (cpullm_kernels.setup.addressed)."""
linear_rows_at = LINEAR_ROWS.call


@njit(cache=True)
def run(I, F, start, end, tokens, rt, arena, state, wq, ws, wf, xq, xs, linear_state, wb, wb_panels, wb_embed,
        wf_layernorm, kv16):
    """Execute instructions [start, end) with runtime values ``rt`` = [T, pos0, head_row0,
    head_rows, threads] (threads: numba's thread count for this call, which attention splits
    its work by).

    ``linear_state`` is ``state`` for a program with linear-attention (GATED_DELTA) instructions
    and None for one without: numba then prunes that branch at compile time, so a model without
    such layers never compiles the gated-delta kernels (about a seventh of a cold start).
    ``wb`` is ``wq`` viewed as uint8 for a program whose LINEARs read raw-block (GGUF format)
    weights, ``wb_panels`` the same for one with Q4_K / Q6_K LINEARs (the panel kernel), ``wb_embed``
    the same for one whose EMBED table is raw blocks, ``wf_layernorm`` is
    ``wf`` for one with LAYERNORM: each None otherwise, and the same pruning keeps the block
    kernels out of an int8 program's compile, the block dequantizer (2 s of a cold start) out of a
    GGUF whose table is Q8_0, the layer norm out of an RMSNorm model's. ``kv16`` is the attention
    kernels' KV format operand (:func:`cpullm_kernels.attention.attention.kv_operand`: None for float32
    caches), so only the program's own format is compiled."""
    T_body, pos0, head_row0, head_rows, nthreads = rt[0], rt[1], rt[2], rt[3], rt[4]
    row0 = np.int64(0)     # not the literal 0: the row kernels keep one (int64) specialization
    for r in range(start, end):
        op = I[r, P.COL_OP]
        head = I[r, P.COL_SECTION] == P.SECTION_HEAD
        T = head_rows if head else T_body
        par = T > 1
        if op == OP_LINEAR:
            linear_rows_at(I, r, arena, wq, ws, wf, wb, wb_panels, xq, xs, T, head and T_body > 1, nthreads)
        elif op == OP_ATTENTION:
            attention_at(arena, state, I[r, P.ATTENTION_Q_OFF], I[r, P.ATTENTION_Q_ST], I[r, P.ATTENTION_K_OFF],
                         I[r, P.ATTENTION_K_ST], I[r, P.ATTENTION_V_OFF], I[r, P.ATTENTION_V_ST],
                         I[r, P.ATTENTION_OUT_OFF], I[r, P.ATTENTION_OUT_ST], I[r, P.ATTENTION_N_HEADS],
                         I[r, P.ATTENTION_N_KV_HEADS], I[r, P.ATTENTION_HEAD_DIM], I[r, P.ATTENTION_CACHE_OFF],
                         I[r, P.ATTENTION_CAP], F[r, P.F_ATTENTION_SCALE], F[r, P.F_ATTENTION_SOFTCAP],
                         np.int64(F[r, P.F_ATTENTION_WINDOW]), pos0, T, nthreads, kv16)
        elif op == OP_SELECT_ROWS:
            copy_rows(arena, I[r, P.UNARY_X_OFF], I[r, P.UNARY_X_ST], I[r, P.UNARY_OUT_OFF], I[r, P.UNARY_OUT_ST],
                      I[r, P.UNARY_WIDTH], head_row0, head_rows)
        elif op == OP_EMBED:
            o_off, o_st, H, kind = I[r, P.EMBED_OUT_OFF], I[r, P.EMBED_OUT_ST], I[r, P.EMBED_WIDTH], I[r, P.EMBED_KIND]
            w_off, s_off, Kp = I[r, P.EMBED_W_OFF], I[r, P.EMBED_S_OFF], I[r, P.EMBED_KP]
            sc = np.float32(F[r, P.F_EMBED_SCALE])
            for t in range(T):
                o = o_off + t * o_st
                embed_row_into(kind, w_off, s_off, Kp, wq, ws, wf, wb_embed, tokens[t], sc, arena[o: o + H])
        elif op == OP_GATED_DELTA:
            if linear_state is None:
                raise ValueError("cpullm interpreter: a GATED_DELTA instruction needs linear_state")
            gated_delta(arena, linear_state, wf,
                        I[r, P.GATED_DELTA_QKV_OFF], I[r, P.GATED_DELTA_QKV_ST], I[r, P.GATED_DELTA_Z_OFF],
                        I[r, P.GATED_DELTA_Z_ST], I[r, P.GATED_DELTA_B_OFF], I[r, P.GATED_DELTA_B_ST],
                        I[r, P.GATED_DELTA_A_OFF], I[r, P.GATED_DELTA_A_ST], I[r, P.GATED_DELTA_OUT_OFF],
                        I[r, P.GATED_DELTA_OUT_ST], I[r, P.GATED_DELTA_NK], I[r, P.GATED_DELTA_DK],
                        I[r, P.GATED_DELTA_NV], I[r, P.GATED_DELTA_DV], I[r, P.GATED_DELTA_CONV_K],
                        I[r, P.GATED_DELTA_CONV_W_OFF], I[r, P.GATED_DELTA_DT_OFF], I[r, P.GATED_DELTA_ALOG_OFF],
                        I[r, P.GATED_DELTA_NORM_OFF], I[r, P.GATED_DELTA_STATE_OFF], F[r, P.F_GATED_DELTA_EPS], T)
        elif is_row_op(op):                 # norms, RoPE, GLU, binary, unary, activations
            if par:
                row_op_par_at(I, F, r, arena, wf, wf_layernorm, pos0, T)
            else:
                row_op_at(I, F, r, arena, wf, wf_layernorm, pos0, row0, T)
        else:
            raise ValueError("cpullm interpreter: unknown opcode")
