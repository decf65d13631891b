"""The 8-bit KV cache: kv_write stores each (position, KV head) row of keys and of values as int8
with a float32 scale per 32 values exactly as the numpy reference rounds it, the region's layout is
what kv_views_q8 reads, and attention() over it equals the numpy reference over the dequantized keys
and values on awkward shapes (head_dim 64/80/128/256 and 8, whose last block is short or the only
one; GQA, sliding windows, softcap, odd lengths, key ranges split across threads); the batched
decode is bit-identical to attention()."""
import numpy as np
import pytest

from cpullm_kernels.attention import attention as A
from cpullm_kernels.attention.attention_batch import attention_decode_batch


def _arena_with(*mats, extra=0):
    """Matrices at row stride width + 3 (strided, like the compiler's views), then ``extra`` floats."""
    offs, parts, off = [], [], 0
    for m in mats:
        T, w = m.shape
        buf = np.zeros((T, w + 3), np.float32)
        buf[:, :w] = m
        offs.append(off)
        parts.append(buf.reshape(-1))
        off += buf.size
    return np.concatenate(parts + [np.zeros(extra, np.float32)]), offs, off


def _floats(nkv, cap, hd):
    from cpullm.compile.kvformat import region_floats
    return region_floats(nkv, cap, hd, "q8_0")


def _run(chunks, nh, nkv, hd, window, softcap, nthreads, seed=0, outlier=0.0):
    r = np.random.default_rng(seed)
    total = sum(chunks)
    q = r.standard_normal((total, nh * hd)).astype(np.float32)
    k = r.standard_normal((total, nkv * hd)).astype(np.float32)
    v = r.standard_normal((total, nkv * hd)).astype(np.float32)
    k[:, ::7] *= np.float32(1.0 + outlier)                  # channels far larger than the rest
    k[3 % total] = 0.0                                      # a row of zeros: scale 0
    cap = A.padded_cap((window + max(chunks)) if window else total)
    floats = _floats(nkv, cap, hd)
    state = np.full(floats + 64, 1e30, np.float32)           # stale slots (and a neighbour) never read
    c_off = 32                                               # the region not at the array's start
    pos, outs = 0, []
    for T in chunks:
        arena, (qo, ko, vo), end = _arena_with(q[pos:pos + T], k[pos:pos + T], v[pos:pos + T], extra=T * nh * hd)
        A.attention(arena, state, qo, nh * hd + 3, ko, nkv * hd + 3, vo, nkv * hd + 3, end, nh * hd,
                    nh, nkv, hd, c_off, cap, 0.3, softcap, window, pos, T, nthreads, A.kv_operand(A.KV_Q8))
        outs.append(arena[end: end + T * nh * hd].reshape(T, nh * hd).copy())
        pos += T
    assert (state[:c_off] == np.float32(1e30)).all() and (state[c_off + floats:] == np.float32(1e30)).all()
    return np.concatenate(outs), (q, k, v), state[c_off: c_off + floats], cap


def test_operand_and_region_size():
    assert A.kv_operand(A.KV_Q8).dtype == np.int8 and A.kv_operand(A.KV_F16).dtype == np.int64
    assert A.kv_operand(A.KV_F32) is None
    # int8 keys and values, then a float32 scale per 32 values of each: (hd + 4 * blocks) / 2 floats a row
    assert A.Q8_BLOCK == 32 and [A.q8_blocks(h) for h in (8, 32, 64, 80, 128)] == [1, 1, 2, 3, 4]
    assert _floats(2, 32, 64) == 2 * 32 * (64 + 4 * 2) // 2
    assert _floats(3, 16, 80) == 3 * 16 * (80 + 4 * 3) // 2


def test_reference_rounds_each_block_on_its_own():
    """A block's scale follows only its own values: a large channel in block 0 leaves block 1's
    rounding as fine as without it (one scale per row would make it coarse)."""
    r = np.random.default_rng(1)
    x = r.standard_normal((5, 80)).astype(np.float32)
    x[:, 3] = 400.0
    q, sc = A.q8_rows_ref(x)
    assert q.shape == (5, 80) and q.dtype == np.int8 and sc.shape == (5, 3)
    for b, (lo, hi) in enumerate([(0, 32), (32, 64), (64, 80)]):
        np.testing.assert_array_equal(sc[:, b], np.abs(x[:, lo:hi]).max(-1) / np.float32(127.0))
        qb, sb = A.q8_quantize_ref(x[:, lo:hi], 32)
        np.testing.assert_array_equal(q[:, lo:hi], qb)
        np.testing.assert_array_equal(sc[:, b], sb[:, 0])
    back = A.q8_dequantize_ref(x, 80)
    assert np.abs(back - x)[:, 32:].max() < 0.05 < np.abs(A.q8_quantize_ref(x, 80)[1]).min()


@pytest.mark.parametrize("hd", [32, 80])
def test_quantized_rows_match_the_reference(hd):
    nkv, T = 2, 21
    _, (_, k, v), region, cap = _run([T], 4, nkv, hd, 0, 0.0, 1, outlier=30.0)
    kt, vc, ks, vs = A.kv_views_q8(region, nkv, cap, hd)
    nb = A.q8_blocks(hd)
    assert kt.dtype == np.int8 and vc.dtype == np.int8 and ks.dtype == np.float32
    assert ks.shape == (nkv, cap // 16, nb, 16) and vs.shape == (nkv, cap, nb)
    kq, kscale = A.q8_rows_ref(k.reshape(T, nkv, hd))
    vq, vscale = A.q8_rows_ref(v.reshape(T, nkv, hd))
    for t in range(T):
        for h in range(nkv):
            np.testing.assert_array_equal(kt[h, t // 16, :, t % 16], kq[t, h])
            np.testing.assert_array_equal(vc[h, t], vq[t, h])
            np.testing.assert_array_equal(ks[h, t // 16, :, t % 16], kscale[t, h])
            np.testing.assert_array_equal(vs[h, t], vscale[t, h])
    assert np.abs(kq).max() == 127 and (kq[3] == 0).all() and (kscale[3] == 0).all()
    # the round trip is within half a step of each block's scale
    back = kq.astype(np.float32) * np.repeat(kscale, 32, -1)[..., :hd]
    assert (np.abs(back - k.reshape(T, nkv, hd)) <= np.repeat(kscale, 32, -1)[..., :hd] * 0.5000001).all()
    np.testing.assert_array_equal(back.reshape(T, -1), A.q8_dequantize_ref(k, hd))


@pytest.mark.parametrize("nh,nkv,hd", [(8, 2, 64), (6, 3, 80), (24, 8, 128), (4, 1, 256), (6, 2, 8)])
@pytest.mark.parametrize("window,softcap,chunks,nthreads", [(0, 0.0, [37, 1, 1, 1], 2),
                                                            (0, 30.0, [5, 1, 3], 1),
                                                            (20, 0.0, [33, 1, 2, 1], 2),      # the ring wraps
                                                            (0, 0.0, [101, 1], 4)])           # split keys
def test_attention_matches_reference(nh, nkv, hd, window, softcap, chunks, nthreads):
    got, (q, k, v), _, _ = _run(chunks, nh, nkv, hd, window, softcap, nthreads, seed=hd + nh)
    ref = A.attention_ref(q, k, v, nh, nkv, hd, 0.3, softcap, window, kv8=True)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=3e-5)
    ref32 = A.attention_ref(q, k, v, nh, nkv, hd, 0.3, softcap, window)
    err = np.abs(got - ref32)
    assert err.max() > 1e-4 and err.mean() < 0.02 * np.abs(ref32).mean()   # the rounding separates them, a little


@pytest.mark.parametrize("nh,nkv,hd,window", [(8, 2, 64, 0), (6, 3, 80, 0), (4, 1, 128, 24)])
def test_batched_decode_is_bit_identical(nh, nkv, hd, window):
    """Three sequences at different positions decoded in one call equal each decoded alone."""
    r = np.random.default_rng(hd)
    lengths = [9, 40, 71]
    cap = A.padded_cap((window + 8) if window else 128)
    floats = _floats(nkv, cap, hd)
    states = np.zeros((len(lengths), floats), np.float32)
    kv = A.kv_operand(A.KV_Q8)
    for s, L in enumerate(lengths):                        # prompts, in chunks of 8
        for p0 in range(0, L, 8):
            T = min(8, L - p0)
            arena, (qo, ko, vo), end = _arena_with(*(r.standard_normal((T, w)).astype(np.float32)
                                                     for w in (nh * hd, nkv * hd, nkv * hd)), extra=T * nh * hd)
            A.attention(arena, states[s], qo, nh * hd + 3, ko, nkv * hd + 3, vo, nkv * hd + 3, end, nh * hd,
                        nh, nkv, hd, 0, cap, 0.125, 0.0, window, p0, T, 2, kv)
    B = len(lengths)
    q, k, v = (r.standard_normal((B, w)).astype(np.float32) for w in (nh * hd, nkv * hd, nkv * hd))
    alone, alone_states = [], states.copy()
    for s in range(B):
        arena, (qo, ko, vo), end = _arena_with(q[s:s + 1], k[s:s + 1], v[s:s + 1], extra=nh * hd)
        A.attention(arena, alone_states[s], qo, nh * hd + 3, ko, nkv * hd + 3, vo, nkv * hd + 3, end, nh * hd,
                    nh, nkv, hd, 0, cap, 0.125, 0.0, window, lengths[s], 1, 2, kv)
        alone.append(arena[end: end + nh * hd].copy())
    arena, (qo, ko, vo), end = _arena_with(q, k, v, extra=B * nh * hd)
    attention_decode_batch(arena, states, np.arange(B), np.array(lengths), qo, nh * hd + 3, ko, nkv * hd + 3,
                           vo, nkv * hd + 3, end, nh * hd, nh, nkv, hd, 0, cap, 0.125, 0.0, window, 2, kv)
    got = arena[end: end + B * nh * hd].reshape(B, nh * hd)
    np.testing.assert_array_equal(got, np.stack(alone))
    np.testing.assert_array_equal(states, alone_states)
