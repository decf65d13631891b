"""Causal grouped-query attention over a per-layer KV cache (full or sliding-window ring).

Cache region of one layer inside the flat ``state`` array, at ``c_off``:
    K: (n_kv, cap, head_dim)  then  V: (n_kv, cap, head_dim)
Position p lives in slot ``p % cap``. A full-attention layer has cap = n_ctx; a sliding-window layer
has cap = window + max_chunk, so a whole prefill chunk fits beside the window it looks back on.
Query row t (position pos0 + t) attends to positions [lo, pos0 + t], lo = max(0, p - window + 1)
for window > 0, else 0. Query head h reads KV head h // (n_heads // n_kv).
Softmax in float32 (max subtracted, exp_f32), with optional tanh soft-capping.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .vmath import exp_f32, tanh_f32


@njit(cache=True)
def kv_write(arena, state, k_off, k_st, v_off, v_st, n_kv, head_dim, c_off, cap, pos0, T):
    """Copy the T new key/value rows into their cache slots."""
    v_base = c_off + n_kv * cap * head_dim
    for t in range(T):
        slot = (pos0 + t) % cap
        for h in range(n_kv):
            dst = h * cap * head_dim + slot * head_dim
            src_k = k_off + t * k_st + h * head_dim
            src_v = v_off + t * v_st + h * head_dim
            for d in range(head_dim):
                state[c_off + dst + d] = arena[src_k + d]
                state[v_base + dst + d] = arena[src_v + d]


@njit(cache=True, fastmath=True, error_model="numpy")
def _attend_heads(arena, q0, o0, hd, nq, kc, vc, cap, lo, hi, scale, softcap, scores):
    """Query heads q0 .. q0+nq-1 (arena offsets q0 + j*hd, outputs o0 + j*hd) of one KV head over
    cached positions [lo, hi]. kc/vc (cap, hd); scores (>= nq, >= hi-lo+1) scratch.

    Three passes, each contiguous and vectorized: scores (each K row read once for all nq heads),
    softmax (exp_f32), weighted sum of V rows (each read once). Slots advance with a wrap check
    instead of a modulo per row."""
    n = hi - lo + 1
    q = np.empty((nq, hd), np.float32)
    for j in range(nq):
        for d in range(hd):
            q[j, d] = arena[q0 + j * hd + d] * np.float32(scale)
    slot = lo % cap
    for i in range(n):
        krow = kc[slot]
        for j in range(nq):
            dot = np.float32(0.0)
            for d in range(hd):
                dot += q[j, d] * krow[d]
            scores[j, i] = dot
        slot += 1
        if slot == cap:
            slot = 0
    inv = np.empty(nq, np.float32)
    for j in range(nq):
        row = scores[j, :n]
        if softcap > 0.0:
            for i in range(n):
                row[i] = np.float32(softcap) * tanh_f32(row[i] / np.float32(softcap))
        m = row[0]
        for i in range(n):
            m = max(m, row[i])
        total = np.float32(0.0)
        for i in range(n):
            e = exp_f32(row[i] - m)
            row[i] = e
            total += e
        inv[j] = np.float32(1.0) / total
    acc = np.zeros((nq, hd), np.float32)
    slot = lo % cap
    for i in range(n):
        vrow = vc[slot]
        for j in range(nq):
            w = scores[j, i]
            for d in range(hd):
                acc[j, d] += w * vrow[d]
        slot += 1
        if slot == cap:
            slot = 0
    for j in range(nq):
        for d in range(hd):
            arena[o0 + j * hd + d] = acc[j, d] * inv[j]


DECODE_JOBS = 4
"""Fewest parallel jobs :func:`attention` makes (2 per thread on the 2-core target): a decode step
of Qwen2.5-0.5B (2 KV heads of 7 query heads) runs as 4 jobs of 3-4 heads."""


@njit(cache=True, parallel=True)
def attention(arena, state, q_off, q_st, k_off, k_st, v_off, v_st, o_off, o_st,
              n_heads, n_kv, head_dim, c_off, cap, scale, softcap, window, pos0, T):
    """Write the new K/V rows, then attend: one parallel job per (query row, KV head, slice of
    that KV head's query heads). The query heads sharing a KV head are processed together so each
    cached row is read once per job; when there are fewer (row, KV head) pairs than 2 per thread
    (decode), each group's heads are split into slices so every thread has work."""
    kv_write(arena, state, k_off, k_st, v_off, v_st, n_kv, head_dim, c_off, cap, pos0, T)
    group = n_heads // n_kv
    size = n_kv * cap * head_dim
    kc = state[c_off: c_off + size].reshape(n_kv, cap, head_dim)
    vc = state[c_off + size: c_off + 2 * size].reshape(n_kv, cap, head_dim)
    span = pos0 + T if window <= 0 else min(pos0 + T, window)
    pairs = T * n_kv
    slices = min(group, (DECODE_JOBS + pairs - 1) // pairs)
    for job in prange(pairs * slices):
        t = job // (n_kv * slices)
        kvh = (job // slices) % n_kv
        s = job % slices
        h0 = kvh * group + group * s // slices
        h1 = kvh * group + group * (s + 1) // slices
        p = pos0 + t
        lo = 0
        if window > 0:
            lo = max(0, p - window + 1)
        scores = np.empty((h1 - h0, span), dtype=np.float32)
        _attend_heads(arena, q_off + t * q_st + h0 * head_dim, o_off + t * o_st + h0 * head_dim, head_dim,
                      h1 - h0, kc[kvh], vc[kvh], cap, lo, p, scale, softcap, scores)


def attention_ref(q, k, v, n_heads, n_kv, head_dim, scale, softcap=0.0, window=0, pos0=0,
                  k_past=None, v_past=None):
    """q (T, nh*hd), k/v (T, nkv*hd) for positions pos0.., with optional past k/v (pos0, nkv*hd).
    Returns (T, nh*hd), computed as transformers' eager attention (scale, softcap, mask, softmax)."""
    T = q.shape[0]
    if k_past is not None:
        k = np.concatenate([k_past, k])
        v = np.concatenate([v_past, v])
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


@njit(cache=True, parallel=True, fastmath=True, error_model="numpy")
def _masked_softmax(scores, T, pos0, lo, window):
    """In place over scores (R, T, L): row (r, t) is query position pos0 + t over key positions
    lo .. lo + L - 1; keys after the query (and, with a window, before p - window + 1) get 0.
    Only the visible span is exponentiated, so no -inf ever enters the arithmetic. The loops run
    over a view of the visible span (vectorized: 4x faster than indexing the full row)."""
    R, _, L = scores.shape
    for job in prange(R * T):
        r = job // T
        t = job % T
        p = pos0 + t
        j1 = p - lo                       # last visible key index
        j0 = 0
        if window > 0:
            j0 = max(0, p - window + 1 - lo)
        row = scores[r, t, j0:j1 + 1]
        m = row[0]
        for j in range(row.size):
            m = max(m, row[j])
        total = np.float32(0.0)
        for j in range(row.size):
            e = exp_f32(row[j] - m)
            row[j] = e
            total += e
        inv = np.float32(1.0) / total
        for j in range(row.size):
            row[j] *= inv
        full = scores[r, t]
        for j in range(0, j0):
            full[j] = np.float32(0.0)
        for j in range(j1 + 1, L):
            full[j] = np.float32(0.0)


QUERY_BLOCK = 128   # prefill query rows per block: keys past a block's last row are skipped
# (measured, Qwen2.5-0.5B shapes, 512 rows: 128 -> ~12 ms per layer, 256 -> ~13, 512 -> ~17)


def attention_batched(arena, state, q_off, q_st, k_off, k_st, v_off, v_st, o_off, o_st,
                      n_heads, n_kv, head_dim, c_off, cap, scale, softcap, window, pos0, T):
    """Prefill form of :func:`attention` (same arguments, same result): the score and value
    products run as batched matrix products (BLAS) per KV head group, a block of query rows at a
    time, each block against only the keys it can see."""
    kv_write(arena, state, k_off, k_st, v_off, v_st, n_kv, head_dim, c_off, cap, pos0, T)
    size = n_kv * cap * head_dim
    kc = state[c_off: c_off + size].reshape(n_kv, cap, head_dim)
    vc = state[c_off + size: c_off + 2 * size].reshape(n_kv, cap, head_dim)
    q_all = arena[q_off: q_off + T * q_st].reshape(T, q_st)[:, : n_heads * head_dim]
    o_all = arena[o_off: o_off + T * o_st].reshape(T, o_st)[:, : n_heads * head_dim]
    for t0 in range(0, T, QUERY_BLOCK):
        t1 = min(T, t0 + QUERY_BLOCK)
        o_all[t0:t1] = _attend_block(q_all[t0:t1], kc, vc, n_heads, n_kv, head_dim, cap, scale,
                                     softcap, window, pos0 + t0)


def _attend_block(q, kc, vc, n_heads, n_kv, head_dim, cap, scale, softcap, window, pos0):
    """q (B, nh*hd) for positions pos0 .. pos0+B-1, keys already in the cache -> (B, nh*hd)."""
    B = q.shape[0]
    g = n_heads // n_kv
    end = pos0 + B
    lo = max(0, pos0 - window + 1) if window > 0 else 0
    L = end - lo
    s0 = lo % cap
    if s0 + L <= cap:                      # contiguous slots: views, no gather
        keys, values = kc[:, s0: s0 + L], vc[:, s0: s0 + L]
    else:
        slots = np.arange(lo, end) % cap
        keys, values = kc[:, slots], vc[:, slots]
    q = q.reshape(B, n_kv, g, head_dim).transpose(1, 2, 0, 3).reshape(n_kv, g * B, head_dim)
    q = q * np.float32(scale)                                         # scaled copy (small)
    scores = np.matmul(q, keys.transpose(0, 2, 1))                    # (n_kv, g*B, L)
    if softcap > 0.0:
        np.tanh(scores / np.float32(softcap), out=scores)
        scores *= np.float32(softcap)
    _masked_softmax(scores.reshape(n_kv * g, B, L), B, pos0, lo, window)
    out = np.matmul(scores.reshape(n_kv, g * B, L), values)          # (n_kv, g*B, hd)
    return out.reshape(n_kv, g, B, head_dim).transpose(2, 0, 1, 3).reshape(B, n_heads * head_dim)
