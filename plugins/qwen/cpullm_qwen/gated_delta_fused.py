"""Fused Gated DeltaNet step (numba): conv + SiLU, L2 norms, gates, delta-rule update, output
and gated RMSNorm in one parallel loop over key heads.

Each key head ``kh`` owns its q and k conv channels and the conv channels of the value heads it
serves (``h = kh*rep .. kh*rep+rep-1``, rep = nv/nk, as transformers' repeat_interleave), so the
loop over key heads has no shared writes. Per token and value head the state S (dk, dv) is swept
twice, the first sweep read-only (the reference writes the decayed state back in it):

    u     = exp(g) * (S^T k)                   read-only sweep
    delta = beta * (v - u)
    S     = exp(g) * S + k (x) delta ;  o = S^T q      one read-modify-write sweep

Same math and state layout as cpullm_kernels.attention.gated_delta (the reference); the conv output is
kept in registers instead of being written back over the qkv input, and the state is addressed
through array views (flat signed offsets keep LLVM from vectorizing the sweeps). Measured at
Qwen3.5-4B layer sizes on one thread: ~0.85 ms per decode step vs ~4.1 ms for the reference.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange


@njit(cache=True, inline="always")
def _conv_silu_channel(xin, hist, w, km1):
    """One channel's causal conv output for the new input ``xin``, SiLU applied; shifts the
    channel's history ``hist`` (its conv_k - 1 previous inputs). ``w``: the channel's taps."""
    y = w[km1] * xin
    for j in range(km1):
        y += w[j] * hist[j]
    for j in range(km1 - 1):
        hist[j] = hist[j + 1]
    if km1 > 0:
        hist[km1 - 1] = xin
    return y / (np.float32(1.0) + np.exp(-y))


@njit(cache=True, parallel=True, fastmath=True)
def gated_delta_fused(arena, state, wf, qkv_off, qkv_st, z_off, z_st, b_off, b_st, a_off, a_st,
                      o_off, o_st, nk, dk, nv, dv, conv_k, conv_w_off, dt_off, alog_off, norm_off,
                      s_off, eps, T):
    key_dim = nk * dk
    conv_dim = 2 * key_dim + nv * dv
    rep = nv // nk
    km1 = conv_k - 1
    # views (slices, not flat offsets: unsigned-looking indices let LLVM vectorize the sweeps)
    hist = state[s_off: s_off + conv_dim * km1].reshape((conv_dim, km1))          # (conv_dim, K-1)
    taps = wf[conv_w_off: conv_w_off + conv_dim * conv_k].reshape((conv_dim, conv_k))
    S_base = s_off + conv_dim * km1
    Sall = state[S_base: S_base + nv * dk * dv].reshape((nv, dk, dv))             # (nv, dk, dv)
    dt = wf[dt_off: dt_off + nv]
    alog = wf[alog_off: alog_off + nv]
    norm_w = wf[norm_off: norm_off + dv]
    q_scale = np.float32(1.0) / np.sqrt(np.float32(dk))
    for kh in prange(nk):
        q = np.empty(dk, dtype=np.float32)
        k = np.empty(dk, dtype=np.float32)
        v = np.empty(rep * dv, dtype=np.float32)
        u = np.empty(dv, dtype=np.float32)
        o = np.empty(dv, dtype=np.float32)
        for t in range(T):
            x = arena[qkv_off + t * qkv_st: qkv_off + t * qkv_st + conv_dim]
            # ---- conv + SiLU of this key head's channels; L2 norms of q and k -------------
            sq = np.float32(0.0)
            sk = np.float32(0.0)
            for i in range(dk):
                cq = kh * dk + i
                ck = key_dim + cq
                qi = _conv_silu_channel(x[cq], hist[cq], taps[cq], km1)
                ki = _conv_silu_channel(x[ck], hist[ck], taps[ck], km1)
                q[i] = qi
                k[i] = ki
                sq += qi * qi
                sk += ki * ki
            qs = q_scale / np.sqrt(sq + np.float32(1e-6))
            ks = np.float32(1.0) / np.sqrt(sk + np.float32(1e-6))
            for i in range(dk):
                q[i] *= qs
                k[i] *= ks
            v0 = 2 * key_dim + kh * rep * dv
            for j in range(rep * dv):
                v[j] = _conv_silu_channel(x[v0 + j], hist[v0 + j], taps[v0 + j], km1)
            # ---- per value head: gates, delta rule, output, gated RMSNorm -------------------
            for r in range(rep):
                h = kh * rep + r
                S = Sall[h]
                beta = np.float32(1.0) / (np.float32(1.0) + np.exp(-arena[b_off + t * b_st + h]))
                xa = arena[a_off + t * a_st + h] + dt[h]
                softplus = np.log1p(np.exp(xa)) if xa < 20.0 else xa
                decay = np.float32(np.exp(-np.exp(np.float32(alog[h])) * np.float32(softplus)))
                u[:] = np.float32(0.0)
                o[:] = np.float32(0.0)
                for i in range(dk):                                 # u = S^T k   (read-only)
                    row = S[i]
                    ki = k[i]
                    for j in range(dv):
                        u[j] += row[j] * ki
                for j in range(dv):                                 # delta
                    u[j] = beta * (v[r * dv + j] - decay * u[j])
                for i in range(dk):                                 # S = decay*S + k (x) delta; o = S^T q
                    row = S[i]
                    ki = k[i]
                    qi = q[i]
                    for j in range(dv):
                        s = row[j] * decay + ki * u[j]
                        row[j] = s
                        o[j] += s * qi
                ss = np.float32(0.0)
                for j in range(dv):
                    ss += o[j] * o[j]
                inv = np.float32(1.0) / np.sqrt(ss / np.float32(dv) + np.float32(eps))
                out = arena[o_off + t * o_st + h * dv: o_off + t * o_st + (h + 1) * dv]
                z = arena[z_off + t * z_st + h * dv: z_off + t * z_st + (h + 1) * dv]
                for j in range(dv):
                    zj = z[j]
                    out[j] = norm_w[j] * (o[j] * inv) * (zj / (np.float32(1.0) + np.exp(-zj)))
