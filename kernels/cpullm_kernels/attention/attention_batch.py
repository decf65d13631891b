"""Decode attention for a batch of sequences in one parallel region.

Row s of the arena is sequence s's one new token, at position ``positions[s]``, with its KV cache
in ``states[slots[s]]``. Every (sequence, KV head, key range) is one job of exactly the work
:func:`cpullm_kernels.attention.attention.attention` does for that sequence alone with T = 1 (the same key
ranges, the same ``attend_part``, the same normalization and combination of ranges), so each
row's output is bit-identical to a one-token decode of its sequence. What changes is only that
the jobs of all sequences share one parallel region: B separate calls cost B regions per layer,
each a barrier for both threads (measured on a loaded 2-core host: 270 ms of an 8-sequence
Qwen2.5-0.5B step spent in per-sequence RoPE and attention calls).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange, types

from ..setup.addressed import Addressed
from ..setup.operand_types import ARENA, INTS, array, f64, i64
from .attention import (KV_OPERANDS, MAX_CHUNKS, STREAM_ROWS, attend_part_at, attend_part_bind, job_scratch,
                        combine_parts, keep_part, kv_base, normalize_into, key_splits, kv_write, q8_head_scales)


@njit(cache=True, parallel=True, fastmath=True, error_model="numpy")
def attention_decode_batch(arena, states, slots, positions, q_off, q_st, k_off, k_st, v_off, v_st, o_off, o_st,
                           n_heads, n_kv, head_dim, c_off, cap, scale, softcap, window, nthreads, kv16):
    """``kv16``: None for float32 caches, an int64 for float16 ones, an int8 for 8-bit ones (as
    attention(); kv_operand)."""
    B = slots.shape[0]
    group = n_heads // n_kv
    size = n_kv * cap * head_dim
    base = kv_base(kv16, c_off)
    hd = head_dim
    splits = np.ones(B, np.int64)
    first_job = np.zeros(B + 1, np.int64)
    max_span = 1
    for s in range(B):
        pos0 = positions[s]
        kv_write(arena, states[slots[s]], k_off + s * k_st, k_st, v_off + s * v_st, v_st, n_kv, head_dim,
                 c_off, cap, pos0, 1, kv16)
        sp = key_splits(n_kv, nthreads, pos0)          # T = 1: one row per KV head
        splits[s] = sp
        first_job[s + 1] = first_job[s] + n_kv * sp
        span = pos0 + 1 if window <= 0 else min(pos0 + 1, window)
        max_span = max(max_span, span)
    jobs = first_job[B]
    job_seq = np.empty(jobs, np.int64)
    for s in range(B):
        for j in range(first_job[s], first_job[s + 1]):
            job_seq[j] = s
    part = np.empty((jobs, group, hd + 2), np.float32)
    nchunk = min(jobs, MAX_CHUNKS)
    attend_part_bind(arena, kv16, hd)
    for c in prange(nchunk):
        qbuf, acc, mx, tot, scores = job_scratch(group, hd, max_span)
        for job in range(c, jobs, nchunk):
            s = job_seq[job]
            local = job - first_job[s]
            sp = splits[s]
            kvh = local // sp                          # as attention(): job // (T * splits), T = 1
            r = local % sp
            p = positions[s]
            lo = 0
            if window > 0:
                lo = max(0, p - window + 1)
            n = p - lo + 1
            k0 = lo + n * r // sp
            k1 = lo + n * (r + 1) // sp - 1
            q0 = q_off + s * q_st + kvh * group * hd
            ks, vs = q8_head_scales(c_off, n_kv, cap, hd, kvh)
            attend_part_at(arena, states[slots[s]], q0, group, hd, base + kvh * cap * hd,
                           base + size + kvh * cap * hd, ks, vs, cap, k0, k1,
                           scale, softcap, qbuf, scores, acc, mx, tot, 1 <= STREAM_ROWS, kv16)
            if sp == 1:
                normalize_into(arena, o_off + s * o_st + kvh * group * hd, acc, tot, group, hd)
            else:
                keep_part(part, job, acc, mx, tot, group, hd)
    for s in range(B):                                 # combine the key ranges of each pair
        sp = splits[s]
        if sp > 1:
            for kvh in range(n_kv):
                combine_parts(arena, o_off + s * o_st + kvh * group * hd, part, first_job[s] + kvh * sp, 1, sp,
                               group, hd)


def attention_decode_batch_signature(kv) -> tuple:
    """attention_decode_batch's argument types for the KV operand type ``kv`` (one of KV_OPERANDS)."""
    return (ARENA, array(types.float32, 2), INTS, INTS, *[i64] * 13, f64, f64, i64, i64, kv)


ATTENTION_DECODE_BATCH = Addressed(attention_decode_batch, types.none, [
    attention_decode_batch_signature(kv) for kv in KV_OPERANDS])
"""attention_decode_batch as the batched step calls it, through its address (cpullm_kernels.setup.addressed)."""
