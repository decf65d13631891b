"""The float16 KV cache: kv_write's rounding equals numpy's astype(float16), the widening of
float16 to float32 is exact on both code paths (F16C's fpext and the integer one), and
attention() over a float16 cache equals the numpy reference with float16-rounded keys and values
on awkward shapes (head_dim 64/80/128/256 and 8, GQA, sliding windows, softcap, odd lengths,
key ranges split across threads)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from numba import njit

from cpullm_kernels.attention import attention as A
from cpullm_kernels.setup import numba_setup

rng = np.random.default_rng(16)


def test_f16_rounding_matches_numpy():
    # random magnitudes over the whole half range (and beyond), every tie and both subnormal edges
    vals = [rng.standard_normal(20000).astype(np.float32) * np.float32(10.0) ** rng.integers(-9, 6, 20000)]
    halves = np.arange(0, 1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    finite = halves[np.isfinite(halves)].astype(np.float32)
    up = np.nextafter(finite, np.float32(np.inf))
    vals += [finite, up, np.nextafter(finite, np.float32(-np.inf))]
    ties = ((finite.view(np.uint32).astype(np.uint64) + (1 << 12)) & 0xFFFFFFFF).astype(np.uint32).view(np.float32)
    vals += [ties[np.isfinite(ties)]]
    vals += [np.array([0.0, -0.0, 65504.0, 65519.99, 65520.0, 1e6, -1e6, np.inf, -np.inf, 2.0 ** -25,
                       2.0 ** -25 * 1.0000001, 2.0 ** -24, 3 * 2.0 ** -26, 2.0 ** -14, 1e-30], np.float32)]
    x = np.concatenate(vals).astype(np.float32)
    got = np.empty(x.size, np.uint16)
    A.kv_write_h(x, got)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(got, want)
    nan = np.empty(2, np.uint16)
    A.kv_write_h(np.array([np.nan, -np.nan], np.float32), nan)
    assert np.isnan(nan.view(np.float16)).all()


@njit
def _widen_all(bits, out, generic):
    for i in range(0, bits.size, 16):
        if generic:
            A.widen16_generic(bits, i, out, i)
        else:
            A.widen16_f16c(bits, i, out, i)


@pytest.mark.parametrize("generic", [True, pytest.param(False, marks=pytest.mark.skipif(
    not A._target_has_f16c(), reason="the host has no F16C (fpext would need a runtime helper)"))])
def test_widen_every_half_exactly(generic):
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    out = np.empty(1 << 16, np.float32)
    _widen_all(bits, out, generic)
    want = bits.view(np.float16).astype(np.float32)
    ok = ~np.isnan(want)
    np.testing.assert_array_equal(out[ok].view(np.uint32), want[ok].view(np.uint32))
    assert np.isnan(out[~ok]).all()


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


def _run(chunks, nh, nkv, hd, window, softcap, nthreads, kv16, seed=0):
    r = np.random.default_rng(seed)
    total = sum(chunks)
    q = r.standard_normal((total, nh * hd)).astype(np.float32)
    k = r.standard_normal((total, nkv * hd)).astype(np.float32)
    v = r.standard_normal((total, nkv * hd)).astype(np.float32)
    cap = A.padded_cap((window + max(chunks)) if window else total)
    floats = (1 if kv16 else 2) * nkv * cap * hd
    state = np.full(floats + 64, 1e30, np.float32)           # stale slots (and a neighbour) never read
    c_off = 32                                               # the region not at the array's start
    pos, outs = 0, []
    for T in chunks:
        arena, (qo, ko, vo), end = _arena_with(q[pos:pos + T], k[pos:pos + T], v[pos:pos + T], extra=T * nh * hd)
        A.attention(arena, state, qo, nh * hd + 3, ko, nkv * hd + 3, vo, nkv * hd + 3, end, nh * hd,
                    nh, nkv, hd, c_off, cap, 0.3, softcap, window, pos, T, nthreads, A.kv_operand(kv16))
        outs.append(arena[end: end + T * nh * hd].reshape(T, nh * hd).copy())
        pos += T
    assert (state[:c_off] == np.float32(1e30)).all() and (state[c_off + floats:] == np.float32(1e30)).all()
    return np.concatenate(outs), (q, k, v), state[c_off: c_off + floats], cap


@pytest.mark.parametrize("kv16", [A.KV_F16, A.KV_F32])
@pytest.mark.parametrize("nh,nkv,hd", [(8, 2, 64), (6, 3, 80), (24, 8, 128), (4, 1, 256), (6, 2, 8)])
@pytest.mark.parametrize("window,softcap,chunks,nthreads", [(0, 0.0, [37, 1, 1, 1], 2),
                                                            (0, 30.0, [5, 1, 3], 1),
                                                            (20, 0.0, [33, 1, 2, 1], 2),      # the ring wraps
                                                            (0, 0.0, [101, 1], 4)])           # split keys
def test_attention_matches_reference(kv16, nh, nkv, hd, window, softcap, chunks, nthreads):
    got, (q, k, v), _, _ = _run(chunks, nh, nkv, hd, window, softcap, nthreads, kv16, seed=hd + nh)
    ref = A.attention_ref(q, k, v, nh, nkv, hd, 0.3, softcap, window, kv16=bool(kv16))
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=2e-5)
    if kv16:      # and the rounding is what separates the formats: f16 KV is not the f32 answer
        ref32 = A.attention_ref(q, k, v, nh, nkv, hd, 0.3, softcap, window)
        assert np.abs(got - ref32).max() > 1e-5


def test_kv16_cache_layout_and_views():
    nkv, hd, T = 2, 32, 21
    got, (_, k, v), region, cap = _run([T], 4, nkv, hd, 0, 0.0, 1, A.KV_F16)
    kt, vc = A.kv_views(region, nkv, cap, hd, kv16=True)
    assert kt.dtype == np.float16 and vc.dtype == np.float16
    for t in range(T):
        for h in range(nkv):
            np.testing.assert_array_equal(kt[h, t // 16, :, t % 16], k[t, h * hd:(h + 1) * hd].astype(np.float16))
            np.testing.assert_array_equal(vc[h, t], v[t, h * hd:(h + 1) * hd].astype(np.float16))


_OUTPUTS = r"""
import hashlib, json, sys
import numpy as np
from cpullm_kernels.attention import attention as A
rng = np.random.default_rng(7)
out = {"pv_vectors": A.PV_VECTORS}
for nh, nkv, hd, T, window, softcap, code in [(9, 3, 64, 200, 0, 0.0, 1), (9, 3, 64, 37, 0, 0.0, 0),
        (4, 1, 256, 130, 64, 0.0, 1), (8, 2, 64, 70, 0, 30.0, 1), (14, 2, 64, 90, 0, 0.0, 2), (4, 2, 48, 33, 0, 0.0, 1)]:
    cap = A.padded_cap(T + 40)
    qst, kst = nh * hd, nkv * hd
    arena = np.zeros(T * (2 * qst + 2 * kst), np.float32)
    arena[: T * (qst + 2 * kst)] = rng.standard_normal(T * (qst + 2 * kst)).astype(np.float32) * 2
    q, k, v, o = 0, T * qst, T * (qst + kst), T * (qst + 2 * kst)
    state = np.zeros(2 * nkv * cap * hd + 2 * nkv * cap * A.q8_blocks(hd), np.float32)
    for pos0, t in ((0, min(T, 40)), (min(T, 40), T - min(T, 40))):   # a prefill chunk, then the rest
        if t:
            A.attention(arena, state, q + pos0 * qst, qst, k + pos0 * kst, kst, v + pos0 * kst, kst, o + pos0 * qst,
                        qst, nh, nkv, hd, 0, cap, np.float32(hd ** -0.5), np.float32(softcap), window, pos0, t, 2,
                        A.kv_operand(code))
    out[f"{nh}/{nkv}/{hd}/{T}/{window}/{softcap}/{code}"] = hashlib.sha256(arena[o:].tobytes()).hexdigest()
print(json.dumps(out))
"""


@pytest.mark.cold
def test_value_pass_width_gives_the_same_bits(tmp_path):
    """The value pass takes 4 vectors of 16 dimensions on AVX-512 and 1 on 256-bit targets (its
    accumulators would spill there): compiled as for each, in processes of their own, prefill and
    decode give the same bits."""
    try:
        avx2 = numba_setup.restricted_target_env("avx2")
    except ValueError as e:
        pytest.skip(str(e))
    got = {}
    for name, extra in (("host", {}), ("avx2", avx2)):
        env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / name), **extra)
        r = subprocess.run([sys.executable, "-c", _OUTPUTS], env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-2000:]
        got[name] = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["avx2"].pop("pv_vectors") == 1
    got["host"].pop("pv_vectors")
    assert got["host"] == got["avx2"]
