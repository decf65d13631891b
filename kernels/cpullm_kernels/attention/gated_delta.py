"""Gated DeltaNet linear attention (Qwen3.5's ``linear_attn`` mixer): reference kernel.

Per layer state inside the flat ``state`` array at ``s_off``:
    conv: (conv_dim, conv_k - 1)  the last conv_k-1 pre-convolution inputs of every channel
    S:    (nv, dk, dv)            the recurrent state of every value head (float32)
Per token: causal depthwise conv1d + SiLU over the qkv channels; split q (nk,dk), k (nk,dk),
v (nv,dv); beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias); q, k L2-normalised
(eps 1e-6 inside the rsqrt), q scaled by dk^-0.5; value head h uses key head h // (nv/nk);
S = S*exp(g); u = S^T k; S += k (x) beta*(v - u); o = S^T q; then the gated RMSNorm
``norm_w * rmsnorm(o) * silu(z)``. The conv runs in place on the qkv input (its only reader).
Prefill uses the same token recurrence (transformers' chunked form is the same math).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange, types

from ..ops.vmath import exp_f32
from ..setup.addressed import Addressed
from ..setup.operand_types import ARENA, WF, f64, i64


@njit(cache=True, parallel=True, fastmath=True)
def _conv_silu(arena, state, wf, qkv_off, qkv_st, conv_dim, conv_k, conv_w_off, s_off, T):
    km1 = conv_k - 1
    for c in prange(conv_dim):
        st = s_off + c * km1
        w = conv_w_off + c * conv_k
        for t in range(T):
            x = qkv_off + t * qkv_st + c
            xin = arena[x]
            y = wf[w + km1] * xin
            for j in range(km1):
                y += wf[w + j] * state[st + j]
            for j in range(km1 - 1):
                state[st + j] = state[st + j + 1]
            if km1 > 0:
                state[st + km1 - 1] = xin
            arena[x] = y / (np.float32(1.0) + exp_f32(-y))


@njit(cache=True, parallel=True, fastmath=True)
def _recurrence(arena, state, wf, qkv_off, qkv_st, z_off, z_st, b_off, b_st, a_off, a_st,
                o_off, o_st, nk, dk, nv, dv, dt_off, alog_off, norm_off, S_off, eps, T):
    key_dim = nk * dk
    rep = nv // nk
    for h in prange(nv):
        kh = h // rep
        S = S_off + h * dk * dv
        q = np.empty(dk, dtype=np.float32)
        k = np.empty(dk, dtype=np.float32)
        u = np.empty(dv, dtype=np.float32)
        o = np.empty(dv, dtype=np.float32)
        A = -np.exp(np.float32(wf[alog_off + h]))
        for t in range(T):
            row = qkv_off + t * qkv_st
            qq, kk = row + kh * dk, row + key_dim + kh * dk
            vv = row + 2 * key_dim + h * dv
            sq = np.float32(0.0)
            sk = np.float32(0.0)
            for i in range(dk):
                q[i] = arena[qq + i]
                k[i] = arena[kk + i]
                sq += q[i] * q[i]
                sk += k[i] * k[i]
            qs = np.float32(1.0) / np.sqrt(sq + np.float32(1e-6)) / np.sqrt(np.float32(dk))
            ks = np.float32(1.0) / np.sqrt(sk + np.float32(1e-6))
            for i in range(dk):
                q[i] *= qs
                k[i] *= ks
            beta = np.float32(1.0) / (np.float32(1.0) + np.exp(-arena[b_off + t * b_st + h]))
            x = arena[a_off + t * a_st + h] + wf[dt_off + h]
            softplus = np.log1p(np.exp(x)) if x < 20.0 else x
            decay = np.exp(A * np.float32(softplus))
            for j in range(dv):
                u[j] = np.float32(0.0)
            for i in range(dk):
                base = S + i * dv
                for j in range(dv):
                    s = state[base + j] * decay
                    state[base + j] = s
                    u[j] += s * k[i]
            for j in range(dv):
                u[j] = beta * (arena[vv + j] - u[j])      # delta
                o[j] = np.float32(0.0)
            for i in range(dk):
                base = S + i * dv
                for j in range(dv):
                    s = state[base + j] + k[i] * u[j]
                    state[base + j] = s
                    o[j] += s * q[i]
            ss = np.float32(0.0)
            for j in range(dv):
                ss += o[j] * o[j]
            inv = np.float32(1.0) / np.sqrt(ss / np.float32(dv) + np.float32(eps))
            out = o_off + t * o_st + h * dv
            zz = z_off + t * z_st + h * dv
            for j in range(dv):
                z = arena[zz + j]
                arena[out + j] = wf[norm_off + j] * (o[j] * inv) * (z / (np.float32(1.0) + exp_f32(-z)))


@njit(cache=True)
def gated_delta(arena, state, wf, qkv_off, qkv_st, z_off, z_st, b_off, b_st, a_off, a_st,
                o_off, o_st, nk, dk, nv, dv, conv_k, conv_w_off, dt_off, alog_off, norm_off,
                s_off, eps, T):
    """The GATED_DELTA op over T tokens; see the module docstring for the layout."""
    conv_dim = 2 * nk * dk + nv * dv
    _conv_silu(arena, state, wf, qkv_off, qkv_st, conv_dim, conv_k, conv_w_off, s_off, T)
    S_off = s_off + conv_dim * (conv_k - 1)
    _recurrence(arena, state, wf, qkv_off, qkv_st, z_off, z_st, b_off, b_st, a_off, a_st,
                o_off, o_st, nk, dk, nv, dv, dt_off, alog_off, norm_off, S_off, eps, T)


GATED_DELTA = Addressed(gated_delta, types.none, [(ARENA, ARENA, WF, *[i64] * 20, f64, i64)])
"""gated_delta as the batched step calls it, through its address (cpullm_kernels.setup.addressed)."""


def state_size(nk: int, dk: int, nv: int, dv: int, conv_k: int) -> int:
    """Floats of state one GATED_DELTA layer needs."""
    return (2 * nk * dk + nv * dv) * (conv_k - 1) + nv * dk * dv


def gated_delta_ref(qkv, z, b, a, conv_w, dt_bias, A_log, norm_w, nk, dk, nv, dv, eps,
                    conv_state=None, S=None):
    """numpy reference. qkv (T, conv_dim) pre-conv, z (T, nv*dv), b/a (T, nv), conv_w (conv_dim, K).
    Returns (out (T, nv*dv), conv_state (conv_dim, K-1), S (nv, dk, dv))."""
    T, C = qkv.shape
    K = conv_w.shape[1]
    f = np.float64
    hist = np.zeros((C, K - 1)) if conv_state is None else conv_state.astype(f)
    seq = np.concatenate([hist, qkv.T.astype(f)], axis=1)           # (C, K-1+T)
    y = np.stack([(seq[:, t:t + K] * conv_w).sum(1) for t in range(T)])  # (T, C)
    y = y / (1 + np.exp(-y))
    new_conv = seq[:, -(K - 1):] if K > 1 else hist
    key_dim = nk * dk
    q = y[:, :key_dim].reshape(T, nk, dk)
    k = y[:, key_dim:2 * key_dim].reshape(T, nk, dk)
    v = y[:, 2 * key_dim:].reshape(T, nv, dv)
    rep = nv // nk
    q = np.repeat(q, rep, axis=1)
    k = np.repeat(k, rep, axis=1)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(dk)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    beta = 1 / (1 + np.exp(-b.astype(f)))
    g = -np.exp(A_log.astype(f)) * np.log1p(np.exp(a.astype(f) + dt_bias))
    S = np.zeros((nv, dk, dv)) if S is None else S.astype(f)
    out = np.zeros((T, nv, dv))
    for t in range(T):
        S = S * np.exp(g[t])[:, None, None]
        u = np.einsum("hij,hi->hj", S, k[t])
        delta = beta[t][:, None] * (v[t] - u)
        S = S + k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hij,hi->hj", S, q[t])
    o = out / np.sqrt((out * out).mean(-1, keepdims=True) + eps) * norm_w
    zz = z.reshape(T, nv, dv).astype(f)
    o = o * zz / (1 + np.exp(-zz))
    return o.reshape(T, nv * dv).astype(np.float32), new_conv.astype(np.float32), S.astype(np.float32)
