"""The execution-program interpreter: one compiled call runs a range of instructions.

An ExecutionProgram (see cpullm.compiler) is a table of instructions ``I`` (int64, NI columns)
and ``F`` (float64, NF columns) over flat arrays:

    arena  float32  activations, every value at (offset, row stride)
    state  float32  KV caches and linear-attention states
    wq     int8     quantized weights (q8 block-32), ws uint16 their scales (binary16 bits);
                    also the raw bytes of GGUF-format blocks (kind WEIGHT_BLOCKS, read as ``wb``)
    wf     float32  float weights (norms, biases, f32-mode matrices, RoPE frequencies, ...)

Decode runs the whole token (every layer and the head) in a single call of :func:`run`; prefill
runs the non-matmul ops through the same function between batched matmuls done by the executor.

Column layout of ``I`` (common): 0 opcode, 1 impl (0 = here, 1 = external kernel, 2 = a
plugin op's kernels, called by the executor), 2 section
(0 body: ``rt[0]`` rows; 1 head: ``rt[3]`` rows). The rest is per op, documented at each branch.
``rt`` = [T, pos0, head_row0, head_rows, threads].
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .attention import attention
from .elementwise import binary_par, binary_rows, copy_rows, glu_par, glu_rows, unary_rows
from .gated_delta import gated_delta
from .norm import layernorm_par, layernorm_rows, rmsnorm_par, rmsnorm_rows
from .kquant import matvec as matvec_blocks
from .kquant import _ROW_BYTES, _ROW_WEIGHTS, quantize_act_q8
from .kquant_gemm import dequantize_rows_into
from .q8 import half_to_float, matvec_f32, matvec_q8, quantize_act_q16
from .rope import rope_par, rope_rows

NI = 24
NF = 4

# Opcodes (== cpullm.ir.Op values; a test checks they agree).
OP_EMBED = 1
OP_RMSNORM = 2
OP_LINEAR = 3
OP_ROPE = 4
OP_ATTENTION = 5
OP_GLU = 6
OP_ADD = 7
OP_SIGMOID_MUL = 8
OP_SOFTCAP = 9
OP_SELECT_ROWS = 11
OP_GATED_DELTA = 12
OP_SCALE = 13
OP_LAYERNORM = 14
OP_PLUGIN = 15         # a plugin's op: run by the executor from Python (meta["plugin_ops"]), never here

WEIGHT_F32 = 0
WEIGHT_Q8 = 1
WEIGHT_BLOCKS = 2      # raw ggml blocks (kernels/gguf_blocks.py) in wq's bytes; s_off holds the ggml type

# Ops a plugin kernel may replace, and the arguments its function receives (the reference
# kernel's signature). The executor calls the external function with exactly these.
EXTERNAL_SIGNATURES = {
    OP_GATED_DELTA: "gated_delta(arena, state, wf, qkv_off, qkv_st, z_off, z_st, b_off, b_st, "
                    "a_off, a_st, o_off, o_st, nk, dk, nv, dv, conv_k, conv_w_off, dt_off, alog_off, "
                    "norm_off, s_off, eps, T)",
}


@njit(cache=True)
def _linear_rows(I, r, arena, wq, ws, wf, xq, xs, T):
    """LINEAR, row by row through the matrix-vector kernels (decode; T is 1 or small).
    I: 3 x_off 4 x_st 5 o_off 6 o_st 7 K 8 N 9 kind 10 w_off 11 s_off 12 Kp 13 bias_off"""
    x_off, x_st, o_off, o_st = I[r, 3], I[r, 4], I[r, 5], I[r, 6]
    K, N, kind, w_off, s_off, Kp, b_off = I[r, 7], I[r, 8], I[r, 9], I[r, 10], I[r, 11], I[r, 12], I[r, 13]
    for t in range(T):
        x = arena[x_off + t * x_st: x_off + t * x_st + K]
        out = arena[o_off + t * o_st: o_off + t * o_st + N]
        if kind == WEIGHT_Q8:
            quantize_act_q16(x, xq[:Kp], xs[:Kp // 32])
            w = wq[w_off: w_off + N * Kp].reshape(N, Kp)
            s = ws[s_off: s_off + N * (Kp // 32)].reshape(N, Kp // 32)
            matvec_q8(w, s, xq[:Kp], xs[:Kp // 32], out)
        else:
            w = wf[w_off: w_off + N * K].reshape(N, K)
            matvec_f32(w, x, out)
        if b_off >= 0:
            for n in range(N):
                out[n] += wf[b_off + n]


@njit(cache=True)
def _linear_blocks_rows(I, r, arena, wb, wf, xq, xs, T, refine):
    """LINEAR over raw ggml blocks, row by row through kquant.matvec (decode; T is 1 or small).
    I: 3 x_off 4 x_st 5 o_off 6 o_st 7 K 8 N 9 kind (WEIGHT_BLOCKS) 10 w_off (bytes into wb)
    11 ggml type 12 Kp (weights per stored row: K, or K padded with zero weights to whole blocks)
    13 bias_off. Activations: int8 per block of 32 (kquant.quantize_act_q8) in xq's bytes, their
    scales and 16-sums in xs (the executor sizes xs to max_k // 32 * 3); padding columns zero."""
    x_off, x_st, o_off, o_st = I[r, 3], I[r, 4], I[r, 5], I[r, 6]
    K, N, w_off, fmt, Kp, b_off = I[r, 7], I[r, 8], I[r, 10], I[r, 11], I[r, 12], I[r, 13]
    row_bytes = Kp // _ROW_WEIGHTS[fmt] * _ROW_BYTES[fmt]
    x_q = xq.view(np.int8)[:Kp]
    x_s = xs[:Kp // 32]
    x_m = xs[Kp // 32: Kp // 32 + Kp // 16]
    w = wb[w_off: w_off + N * row_bytes].reshape(N, row_bytes)
    # ``refine``: a second pass on the activations' int8 rounding error (which leaves 1/254 of
    # it), for the head after a prefill chunk, whose body ran with int16 activations: one pass
    # flipped SmolLM2-135M Q4_1's first chat token after "What is the capital of France?" ("The"
    # -> "L", top-2 logits 0.08 apart, moved by 0.24; llama.cpp, int8 activations too, says "L").
    # Decode steps keep one pass: their body LINEARs' int8 rounding dominates there (mean KL to
    # f32 0.006 over that prompt with or without it) and the lm_head would be read twice.
    res = np.empty(K if refine else 0, np.float32)
    extra = np.empty(N if refine else 0, np.float32)
    for j in range(K, Kp):
        x_q[j] = 0
    for j in range(K // 32, Kp // 32):
        x_s[j] = 0.0
    for j in range(K // 16, Kp // 16):
        x_m[j] = 0.0
    for t in range(T):
        x = arena[x_off + t * x_st: x_off + t * x_st + K]
        out = arena[o_off + t * o_st: o_off + t * o_st + N]
        quantize_act_q8(x, x_q[:K], x_s[:K // 32], x_m[:K // 16])
        matvec_blocks(fmt, w, x_q, x_s, x_m, out)
        if refine:
            for j in range(K):
                res[j] = x[j] - np.float32(x_q[j]) * x_s[j // 32]
            quantize_act_q8(res, x_q[:K], x_s[:K // 32], x_m[:K // 16])
            matvec_blocks(fmt, w, x_q, x_s, x_m, extra)
            for n in range(N):
                out[n] += extra[n]
        if b_off >= 0:
            for n in range(N):
                out[n] += wf[b_off + n]


@njit(cache=True)
def _embed_blocks(I, r, arena, wb, tokens, scale, T):
    """EMBED from raw ggml blocks: each token's row dequantized (kquant_gemm.dequantize_rows_into).
    I: 3 o_off 4 o_st 5 H 6 kind 7 w_off (bytes into wb) 8 ggml type 9 Kp (H padded to whole blocks)."""
    o_off, o_st, H, w_off, fmt, Kp = I[r, 3], I[r, 4], I[r, 5], I[r, 7], I[r, 8], I[r, 9]
    row_bytes = Kp // _ROW_WEIGHTS[fmt] * _ROW_BYTES[fmt]
    buf = np.empty((1, Kp), np.float32)
    for t in range(T):
        tok = tokens[t]
        dequantize_rows_into(fmt, wb[w_off + tok * row_bytes: w_off + (tok + 1) * row_bytes].reshape(1, row_bytes),
                             0, 1, buf)
        o = o_off + t * o_st
        for j in range(H):
            arena[o + j] = buf[0, j] * scale


@njit(cache=True)
def run(I, F, start, end, tokens, rt, arena, state, wq, ws, wf, xq, xs, linear_state, wb):
    """Execute instructions [start, end) with runtime values ``rt`` = [T, pos0, head_row0,
    head_rows, threads] (threads: numba's thread count for this call, which attention splits
    its work by).

    ``linear_state`` is ``state`` for a program with linear-attention (GATED_DELTA) instructions
    and None for one without: numba then prunes that branch at compile time, so a model without
    such layers never compiles the gated-delta kernels (about a seventh of a cold start).
    ``wb`` is ``wq`` viewed as uint8 for a program with raw-block (GGUF format) weights and None
    for one without: the same pruning keeps the block kernels out of an int8 program's compile."""
    T_body, pos0, head_row0, head_rows, nthreads = rt[0], rt[1], rt[2], rt[3], rt[4]
    row0 = np.int64(0)     # not the literal 0: the row kernels keep one (int64) specialization
    for r in range(start, end):
        op = I[r, 0]
        T = T_body if I[r, 2] == 0 else head_rows
        par = T > 1
        if op == OP_LINEAR:
            if I[r, 9] == WEIGHT_BLOCKS:
                if wb is None:
                    raise ValueError("cpullm interpreter: a WEIGHT_BLOCKS LINEAR needs wb")
                _linear_blocks_rows(I, r, arena, wb, wf, xq, xs, T, I[r, 2] == 1 and T_body > 1)
            else:
                _linear_rows(I, r, arena, wq, ws, wf, xq, xs, T)
        elif op == OP_RMSNORM:
            # 3 x_off 4 x_st 5 o_off 6 o_st 7 width 8 group 9 w_off; F0 eps
            if par:
                rmsnorm_par(arena, I[r, 3], I[r, 4], I[r, 5], I[r, 6], I[r, 7], I[r, 8], wf, I[r, 9], F[r, 0], T)
            else:
                rmsnorm_rows(arena, I[r, 3], I[r, 4], I[r, 5], I[r, 6], I[r, 7], I[r, 8], wf, I[r, 9], F[r, 0], row0, T)
        elif op == OP_LAYERNORM:
            # 3 x_off 4 x_st 5 o_off 6 o_st 7 width 8 group 9 w_off 10 b_off (-1: no bias); F0 eps
            if par:
                layernorm_par(arena, I[r, 3], I[r, 4], I[r, 5], I[r, 6], I[r, 7], I[r, 8], wf, I[r, 9], I[r, 10],
                              F[r, 0], T)
            else:
                layernorm_rows(arena, I[r, 3], I[r, 4], I[r, 5], I[r, 6], I[r, 7], I[r, 8], wf, I[r, 9], I[r, 10],
                               F[r, 0], row0, T)
        elif op == OP_ROPE:
            # 3 x_off 4 x_st 5 o_off 6 o_st 7 n_heads 8 head_dim 9 rotary_dim 10 freq_off; F0 attention_scaling
            if par:
                rope_par(arena, I[r, 3], I[r, 4], I[r, 5], I[r, 6], I[r, 7], I[r, 8], I[r, 9], wf, I[r, 10], F[r, 0], pos0, T)
            else:
                rope_rows(arena, I[r, 3], I[r, 4], I[r, 5], I[r, 6], I[r, 7], I[r, 8], I[r, 9], wf, I[r, 10], F[r, 0], pos0, row0, T)
        elif op == OP_ATTENTION:
            # 3 q_off 4 q_st 5 k_off 6 k_st 7 v_off 8 v_st 9 o_off 10 o_st 11 n_heads 12 n_kv 13 head_dim
            # 14 cache_off 15 cap; F0 scale F1 softcap F2 window
            attention(arena, state, I[r, 3], I[r, 4], I[r, 5], I[r, 6], I[r, 7], I[r, 8], I[r, 9], I[r, 10],
                      I[r, 11], I[r, 12], I[r, 13], I[r, 14], I[r, 15], F[r, 0], F[r, 1], np.int64(F[r, 2]), pos0, T,
                      nthreads)
        elif op == OP_GLU:
            # 3 g_off 4 g_st 5 u_off 6 u_st 7 o_off 8 o_st 9 width 10 act
            if par:
                glu_par(arena, I[r, 3], I[r, 4], I[r, 5], I[r, 6], I[r, 7], I[r, 8], I[r, 9], I[r, 10], T)
            else:
                glu_rows(arena, I[r, 3], I[r, 4], I[r, 5], I[r, 6], I[r, 7], I[r, 8], I[r, 9], I[r, 10], row0, T)
        elif op == OP_ADD or op == OP_SIGMOID_MUL:
            # 3 a_off 4 a_st 5 b_off 6 b_st 7 o_off 8 o_st 9 width
            kind = 0 if op == OP_ADD else 1
            if par:
                binary_par(arena, I[r, 3], I[r, 4], I[r, 5], I[r, 6], I[r, 7], I[r, 8], I[r, 9], kind, T)
            else:
                binary_rows(arena, I[r, 3], I[r, 4], I[r, 5], I[r, 6], I[r, 7], I[r, 8], I[r, 9], kind, row0, T)
        elif op == OP_SOFTCAP or op == OP_SCALE:
            # 3 x_off 4 x_st 5 o_off 6 o_st 7 width; F0 cap or scale
            kind = 0 if op == OP_SOFTCAP else 1
            unary_rows(arena, I[r, 3], I[r, 4], I[r, 5], I[r, 6], I[r, 7], kind, F[r, 0], row0, T)
        elif op == OP_SELECT_ROWS:
            # 3 x_off 4 x_st 5 o_off 6 o_st 7 width
            copy_rows(arena, I[r, 3], I[r, 4], I[r, 5], I[r, 6], I[r, 7], head_row0, head_rows)
        elif op == OP_EMBED:
            # 3 o_off 4 o_st 5 H 6 kind 7 w_off 8 s_off 9 Kp; F0 scale
            o_off, o_st, H, kind, w_off, s_off, Kp = I[r, 3], I[r, 4], I[r, 5], I[r, 6], I[r, 7], I[r, 8], I[r, 9]
            sc = np.float32(F[r, 0])
            if kind == WEIGHT_BLOCKS:
                if wb is None:
                    raise ValueError("cpullm interpreter: a WEIGHT_BLOCKS EMBED needs wb")
                _embed_blocks(I, r, arena, wb, tokens, sc, T)
                continue
            for t in range(T):
                tok = tokens[t]
                o = o_off + t * o_st
                if kind == WEIGHT_Q8:
                    nb = Kp // 32
                    for j in range(H):
                        arena[o + j] = np.float32(wq[w_off + tok * Kp + j]) * half_to_float(ws[s_off + tok * nb + j // 32]) * sc
                else:
                    for j in range(H):
                        arena[o + j] = wf[w_off + tok * H + j] * sc
        elif op == OP_GATED_DELTA:
            # 3 qkv_off 4 qkv_st 5 z_off 6 z_st 7 b_off 8 b_st 9 a_off 10 a_st 11 o_off 12 o_st
            # 13 nk 14 dk 15 nv 16 dv 17 conv_k 18 conv_w_off 19 dt_off 20 alog_off 21 norm_off 22 state_off; F0 eps
            if linear_state is None:
                raise ValueError("cpullm interpreter: a GATED_DELTA instruction needs linear_state")
            gated_delta(arena, linear_state, wf, I[r, 3], I[r, 4], I[r, 5], I[r, 6], I[r, 7], I[r, 8], I[r, 9], I[r, 10],
                        I[r, 11], I[r, 12], I[r, 13], I[r, 14], I[r, 15], I[r, 16], I[r, 17], I[r, 18],
                        I[r, 19], I[r, 20], I[r, 21], I[r, 22], F[r, 0], T)
        else:
            raise ValueError("cpullm interpreter: unknown opcode")
