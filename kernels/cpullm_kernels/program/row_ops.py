"""The program's row ops (RMSNorm, LayerNorm, RoPE, GLU, ADD / SIGMOID_MUL, SOFTCAP / SCALE, ACT,
POS_EMBED): one instruction over a range of rows in one thread (:func:`row_op`: decode, the
head's few rows), or over every row of a prefill chunk in one parallel region
(:func:`row_op_par`). Each row's numbers are the row kernel's (cpullm_kernels.ops), whichever
of the two runs it.

:func:`cpullm_kernels.program.interpreter.run` calls both through their address, and both call
the row kernels through theirs (cpullm_kernels.setup.addressed), so each row kernel is compiled
once: a parallel kernel per op around its own copy, all linked into ``run``, compiled each three
times (those five parallel kernels took 3.8 s of a cold start's CPU on a 2-core Ice Lake).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange
from numba import types as nt

from ..ops.elementwise import BINARY_ROWS, GLU_ROWS, UNARY_ROWS
from ..ops.norm import LAYERNORM_ROWS, RMSNORM_ROWS
from ..ops.pointwise import ACT_ROWS, POS_EMBED_ROWS
from ..ops.rope import ROPE_ROWS
from ..setup.addressed import Addressed
from ..setup.operand_types import ARENA, PROG_F, PROG_I, WF, i64
from . import program_table as P

rmsnorm_at, layernorm_at, rope_at = RMSNORM_ROWS.call, LAYERNORM_ROWS.call, ROPE_ROWS.call
glu_at, binary_at, unary_at = GLU_ROWS.call, BINARY_ROWS.call, UNARY_ROWS.call
act_at, pos_embed_at = ACT_ROWS.call, POS_EMBED_ROWS.call
rmsnorm_ready, layernorm_ready, rope_ready = RMSNORM_ROWS.ensure, LAYERNORM_ROWS.ensure, ROPE_ROWS.ensure
glu_ready, binary_ready, unary_ready = GLU_ROWS.ensure, BINARY_ROWS.ensure, UNARY_ROWS.ensure
act_ready, pos_embed_ready = ACT_ROWS.ensure, POS_EMBED_ROWS.ensure


@njit(cache=True)
def _row_op(I, F, r, arena, wf, wf_layernorm, pos0, r0, r1):
    """Instruction r (an opcode :func:`is_row_op` accepts) over rows [r0, r1) of its operands; ``pos0``: the position
    of row 0 (RoPE, POS_EMBED). ``wf_layernorm``: ``wf`` for a program with LAYERNORM, else None
    (numba then prunes the layer norm)."""
    op = I[r, P.COL_OP]
    if op == P.OP_RMSNORM:
        rmsnorm_at(arena, I[r, P.NORM_X_OFF], I[r, P.NORM_X_ST], I[r, P.NORM_OUT_OFF], I[r, P.NORM_OUT_ST],
                   I[r, P.NORM_WIDTH], I[r, P.NORM_GROUP], wf, I[r, P.NORM_W_OFF], F[r, P.F_NORM_EPS], r0, r1)
    elif op == P.OP_LAYERNORM:
        if wf_layernorm is None:
            raise ValueError("cpullm row ops: a LAYERNORM instruction needs wf_layernorm")
        layernorm_at(arena, I[r, P.NORM_X_OFF], I[r, P.NORM_X_ST], I[r, P.NORM_OUT_OFF], I[r, P.NORM_OUT_ST],
                     I[r, P.NORM_WIDTH], I[r, P.NORM_GROUP], wf_layernorm, I[r, P.NORM_W_OFF],
                     I[r, P.NORM_BIAS_OFF], F[r, P.F_NORM_EPS], r0, r1)
    elif op == P.OP_ROPE:
        rope_at(arena, I[r, P.ROPE_X_OFF], I[r, P.ROPE_X_ST], I[r, P.ROPE_OUT_OFF], I[r, P.ROPE_OUT_ST],
                I[r, P.ROPE_N_HEADS], I[r, P.ROPE_HEAD_DIM], I[r, P.ROPE_ROTARY_DIM], wf, I[r, P.ROPE_FREQ_OFF],
                F[r, P.F_ROPE_SCALING], pos0, r0, r1)
    elif op == P.OP_GLU:
        glu_at(arena, I[r, P.GLU_GATE_OFF], I[r, P.GLU_GATE_ST], I[r, P.GLU_UP_OFF], I[r, P.GLU_UP_ST],
               I[r, P.GLU_OUT_OFF], I[r, P.GLU_OUT_ST], I[r, P.GLU_WIDTH], I[r, P.GLU_ACT], r0, r1)
    elif op == P.OP_ADD or op == P.OP_SIGMOID_MUL:
        binary_at(arena, I[r, P.BINARY_A_OFF], I[r, P.BINARY_A_ST], I[r, P.BINARY_B_OFF], I[r, P.BINARY_B_ST],
                  I[r, P.BINARY_OUT_OFF], I[r, P.BINARY_OUT_ST], I[r, P.BINARY_WIDTH],
                  0 if op == P.OP_ADD else 1, r0, r1)
    elif op == P.OP_SOFTCAP or op == P.OP_SCALE:
        unary_at(arena, I[r, P.UNARY_X_OFF], I[r, P.UNARY_X_ST], I[r, P.UNARY_OUT_OFF], I[r, P.UNARY_OUT_ST],
                 I[r, P.UNARY_WIDTH], 0 if op == P.OP_SOFTCAP else 1, F[r, P.F_UNARY_PARAM], r0, r1)
    elif op == P.OP_ACT:
        act_at(arena, I[r, P.UNARY_X_OFF], I[r, P.UNARY_X_ST], I[r, P.UNARY_OUT_OFF], I[r, P.UNARY_OUT_ST],
               I[r, P.UNARY_WIDTH], I[r, P.ACT_KIND], r0, r1)
    elif op == P.OP_POS_EMBED:
        pos_embed_at(arena, I[r, P.UNARY_X_OFF], I[r, P.UNARY_X_ST], I[r, P.UNARY_OUT_OFF], I[r, P.UNARY_OUT_ST],
                     I[r, P.UNARY_WIDTH], wf, I[r, P.POS_TABLE_OFF], I[r, P.POS_ROWS], pos0 + I[r, P.POS_OFFSET],
                     r0, r1)
    else:
        raise ValueError("cpullm row ops: not a row op")


@njit(cache=True)
def row_op(I, F, r, arena, wf, wf_layernorm, pos0, r0, r1):
    """Instruction r over rows [r0, r1), in this thread (:func:`_row_op`)."""
    _row_op(I, F, r, arena, wf, wf_layernorm, pos0, r0, r1)


def row_op_signature(wf_layernorm) -> tuple:
    """row_op's argument types; ``wf_layernorm``: WF or none."""
    return (PROG_I, PROG_F, i64, ARENA, WF, wf_layernorm, i64, i64, i64)


ROW_OP = Addressed(row_op, nt.none, [row_op_signature(w) for w in (nt.none, WF)])


@njit(cache=True)
def _bind_row_kernel(op, arena, wf, wf_layernorm):
    """Bind opcode ``op``'s row kernel before a parallel region calls it (a worker must not bind:
    cpullm_kernels.setup.addressed). Only that one: a kernel of an op the program lacks is then
    never compiled (the default model's ACT, POS_EMBED and SOFTCAP / SCALE kernels were 1.4 s of
    its cold start's CPU on a 2-core Ice Lake)."""
    z, f = np.int64(0), np.float64(0.0)
    if op == P.OP_RMSNORM:
        rmsnorm_ready(arena, z, z, z, z, z, z, wf, z, f, z, z)
    elif op == P.OP_LAYERNORM:
        if wf_layernorm is not None:
            layernorm_ready(arena, z, z, z, z, z, z, wf_layernorm, z, z, f, z, z)
    elif op == P.OP_ROPE:
        rope_ready(arena, z, z, z, z, z, z, z, wf, z, f, z, z, z)
    elif op == P.OP_GLU:
        glu_ready(arena, z, z, z, z, z, z, z, z, z, z)
    elif op == P.OP_ADD or op == P.OP_SIGMOID_MUL:
        binary_ready(arena, z, z, z, z, z, z, z, z, z, z)
    elif op == P.OP_SOFTCAP or op == P.OP_SCALE:
        unary_ready(arena, z, z, z, z, z, z, f, z, z)
    elif op == P.OP_ACT:
        act_ready(arena, z, z, z, z, z, z, z, z)
    elif op == P.OP_POS_EMBED:
        pos_embed_ready(arena, z, z, z, z, z, wf, z, z, z, z, z)


@njit(cache=True, parallel=True)
def row_op_par(I, F, r, arena, wf, wf_layernorm, pos0, T):
    """Instruction r over rows [0, T), the rows split over the threads of one parallel region."""
    _bind_row_kernel(I[r, P.COL_OP], arena, wf, wf_layernorm)
    for t in prange(T):
        row = np.int64(t)
        _row_op(I, F, r, arena, wf, wf_layernorm, pos0, row, row + 1)


def row_op_par_signature(wf_layernorm) -> tuple:
    """row_op_par's argument types; ``wf_layernorm``: WF or none."""
    return (PROG_I, PROG_F, i64, ARENA, WF, wf_layernorm, i64, i64)


ROW_OP_PAR = Addressed(row_op_par, nt.none, [row_op_par_signature(w) for w in (nt.none, WF)])
row_op_par_at = ROW_OP_PAR.call


@njit(cache=True, inline="always")
def is_row_op(op):
    """Whether :func:`row_op` runs opcode ``op``."""
    return (op == P.OP_RMSNORM or op == P.OP_LAYERNORM or op == P.OP_ROPE or op == P.OP_GLU or op == P.OP_ADD
            or op == P.OP_SIGMOID_MUL or op == P.OP_SOFTCAP or op == P.OP_SCALE or op == P.OP_ACT
            or op == P.OP_POS_EMBED)
