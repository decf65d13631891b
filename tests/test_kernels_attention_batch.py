"""Decode attention for a batch: each row bit-identical to attention() run for its sequence alone
(T = 1), with key ranges split across threads (long caches, few KV heads) and sliding windows."""
import numpy as np
import pytest

from cpullm_kernels.attention.attention import KV_F16, KV_F32, attention, kv_operand, padded_cap
from cpullm_kernels.attention.attention_batch import attention_decode_batch


@pytest.mark.parametrize("kv16", [KV_F32, KV_F16])
@pytest.mark.parametrize("n_heads,n_kv,hd,window,softcap", [(4, 1, 32, 0, 0.0), (6, 3, 16, 0, 0.0),
                                                            (4, 2, 32, 12, 5.0), (8, 4, 16, 0, 0.0),
                                                            (8, 2, 8, 0, 0.0)])     # hd 8: plain value loop
def test_batch_rows_equal_one_sequence_decodes(n_heads, n_kv, hd, window, softcap, kv16):
    rng = np.random.default_rng(n_heads * 7 + n_kv)
    B, n_ctx = 5, 200
    cap = padded_cap(n_ctx if not window else min(n_ctx, window + 16))
    q_st, kv_st = n_heads * hd, n_kv * hd
    q_off, k_off, v_off = 0, B * q_st, B * q_st + B * kv_st
    o_off = v_off + B * kv_st
    arena = np.zeros(o_off + B * q_st, np.float32)
    arena[:o_off] = rng.standard_normal(o_off).astype(np.float32)
    states = rng.standard_normal((4 + B, 2 * n_kv * cap * hd)).astype(np.float32)
    if kv16:      # float16 caches: random halves in the first half of each row (finite: +-4)
        states[:, : n_kv * cap * hd] = (rng.standard_normal((4 + B, 2 * n_kv * cap * hd)) * 2).astype(
            np.float16).view(np.float32)
    slots = np.array([3, 0, 7, 1, 5], np.int64)
    positions = np.array([0, 150, 40, 99, 7], np.int64)         # long ones split their keys
    ref_arena, ref_states = arena.copy(), states.copy()
    for s in range(B):
        st = ref_states[slots[s]]
        attention(ref_arena, st, q_off + s * q_st, q_st, k_off + s * kv_st, kv_st, v_off + s * kv_st, kv_st,
                  o_off + s * q_st, q_st, n_heads, n_kv, hd, 0, cap, 0.125, softcap, window, positions[s], 1, 2,
                  kv_operand(kv16))
    attention_decode_batch(arena, states, slots, positions, q_off, q_st, k_off, kv_st, v_off, kv_st, o_off, q_st,
                           n_heads, n_kv, hd, 0, cap, 0.125, softcap, window, 2, kv_operand(kv16))
    np.testing.assert_array_equal(arena, ref_arena)
    np.testing.assert_array_equal(states, ref_states)
