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

from . import numba_setup
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


@njit(cache=True, nogil=True, fastmath=True, error_model="numpy")
def _masked_softmax(scores, T, pos0, lo, window):
    """In place over scores (R, T, L): row (r, t) is query position pos0 + t over key positions
    lo .. lo + L - 1; keys after the query (and, with a window, before p - window + 1) get 0.
    Only the visible span is exponentiated, so no -inf ever enters the arithmetic. The loops run
    over a view of the visible span (vectorized: 4x faster than indexing the full row). Serial
    and nogil: :func:`attention_batched` runs one job per Python thread."""
    R, _, L = scores.shape
    for job in range(R * T):
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

MIN_JOBS_PER_THREAD = 4
"""attention_batched splits the query heads of a KV head group into slices until there are at
least this many jobs per thread, so the unequal blocks (later blocks see more keys) balance."""


def attention_batched(arena, state, q_off, q_st, k_off, k_st, v_off, v_st, o_off, o_st,
                      n_heads, n_kv, head_dim, c_off, cap, scale, softcap, window, pos0, T):
    """Prefill form of :func:`attention` (same arguments, same result): the score and value
    products run as matrix products (OpenBLAS sgemm), one job per (block of query rows, KV head,
    slice of its query heads), each block against only the keys it can see.

    The jobs run on the configured number of Python threads, each with single-threaded OpenBLAS
    and the serial nogil softmax: alternating a 2-thread OpenBLAS pool with numba's parallel
    softmax made the softmax 3-4x slower (both pools spin for the same 2 cores)."""
    kv_write(arena, state, k_off, k_st, v_off, v_st, n_kv, head_dim, c_off, cap, pos0, T)
    size = n_kv * cap * head_dim
    kc = state[c_off: c_off + size].reshape(n_kv, cap, head_dim)
    vc = state[c_off + size: c_off + 2 * size].reshape(n_kv, cap, head_dim)
    q_all = arena[q_off: q_off + T * q_st].reshape(T, q_st)[:, : n_heads * head_dim]
    o_all = arena[o_off: o_off + T * o_st].reshape(T, o_st)[:, : n_heads * head_dim]
    g = n_heads // n_kv
    threads = numba_setup.configured_threads()
    blocks = [(t0, min(T, t0 + QUERY_BLOCK)) for t0 in range(0, T, QUERY_BLOCK)]
    slices = 1
    while slices < g and len(blocks) * n_kv * slices < MIN_JOBS_PER_THREAD * threads:
        slices += 1
    jobs = [(t0, t1, kvh, kvh * g + g * s // slices, kvh * g + g * (s + 1) // slices)
            for t0, t1 in blocks for kvh in range(n_kv) for s in range(slices)]
    jobs.sort(key=lambda j: -(j[1] * (j[4] - j[3])))       # largest first (longest key spans)

    def run(part):
        for t0, t1, kvh, h0, h1 in part:
            o_all[t0:t1, h0 * head_dim: h1 * head_dim] = _attend_job(
                q_all[t0:t1, h0 * head_dim: h1 * head_dim], kc[kvh], vc[kvh], h1 - h0, head_dim, cap,
                scale, softcap, window, pos0 + t0)

    if threads <= 1 or len(jobs) == 1:
        with numba_setup.blas_threads(1):
            run(jobs)
        return
    parts = [jobs[i::threads] for i in range(threads)]
    with numba_setup.blas_threads(1):
        futs = [numba_setup.python_pool(threads - 1).submit(run, part) for part in parts[1:]]
        run(parts[0])
        for f in futs:
            f.result()


def _attend_job(q, keys_all, values_all, nh, head_dim, cap, scale, softcap, window, pos0):
    """q (B, nh*hd): nh query heads sharing one KV head, positions pos0 .. pos0+B-1; keys_all /
    values_all (cap, hd) that KV head's cache (keys already written) -> (B, nh*hd)."""
    B = q.shape[0]
    end = pos0 + B
    lo = max(0, pos0 - window + 1) if window > 0 else 0
    L = end - lo
    s0 = lo % cap
    if s0 + L <= cap:                      # contiguous slots: views, no gather
        keys, values = keys_all[s0: s0 + L], values_all[s0: s0 + L]
    else:
        slots = np.arange(lo, end) % cap
        keys, values = keys_all[slots], values_all[slots]
    q = q.reshape(B, nh, head_dim).transpose(1, 0, 2).reshape(nh * B, head_dim)
    q = q * np.float32(scale)                                         # scaled copy (small)
    scores = q @ keys.T                                               # (nh*B, L)
    if softcap > 0.0:
        np.tanh(scores / np.float32(softcap), out=scores)
        scores *= np.float32(softcap)
    _masked_softmax(scores.reshape(nh, B, L), B, pos0, lo, window)
    out = scores @ values                                             # (nh*B, hd)
    return out.reshape(nh, B, head_dim).transpose(1, 0, 2).reshape(B, nh * head_dim)
