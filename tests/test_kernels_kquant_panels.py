"""Q4_K / Q6_K in panels of 16 rows (cpullm_kernels.panels.kquant_panels): the layout holds the file's
numbers, the kernel equals its numpy reference bit for bit on every ISA variant this CPU runs,
rows do not depend on the batch, and an EMBED row reads back as the file's dequantized row."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from cpullm_kernels.panels import kquant_panels as KP
from cpullm_kernels.setup import numba_setup
from cpullm_kernels.rows.gguf_blocks import dequantize_ref, random_blocks
from cpullm_kernels.rows.kquant import quantize_act_q8_ref

FORMATS = [KP.Q4_K, KP.Q6_K]
SHAPES = [(16, 256), (48, 512), (80, 1024), (64, 2304)]


def _raw(fmt, N, K, seed=0):
    return random_blocks(fmt, N, K, np.random.default_rng(seed)).reshape(N, -1)


def _acts(B, K, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, K)).astype(np.float32)
    x[:, ::7] *= 40                                   # blocks of unequal scale
    rows = [quantize_act_q8_ref(r) for r in x]
    return x, np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows]), np.stack([r[2] for r in rows])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("N,K", SHAPES)
def test_layout_holds_the_files_numbers(fmt, N, K):
    raw = _raw(fmt, N, K)
    packed = KP.pack(fmt, raw)
    assert packed.size == raw.size                    # the same bytes, in another order
    assert np.array_equal(KP.dequantize_ref(fmt, packed, N, K), dequantize_ref(raw, fmt, (N, K)))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("N,K", SHAPES)
def test_kernel_equals_reference_for_every_batch_size(fmt, N, K):
    raw = _raw(fmt, N, K, seed=N + K)
    packed = KP.pack(fmt, raw)
    x, x_q, x_s, x_m = _acts(13, K, seed=K)
    want = KP.matmul_ref(fmt, packed, N, x_q, x_s, x_m)
    for B in (1, 2, 3, 4, 5, 8, 9, 13):
        out = np.full((B, N + 5), 7.0, np.float32)
        KP.matmul(fmt, packed, x_q[:B], x_s[:B], x_m[:B], out, 2)
        assert np.array_equal(out[:, :N], want[:B]), (B, np.abs(out[:, :N] - want[:B]).max())
        assert np.all(out[:, N:] == 7.0)              # columns past N untouched
    # the reference is the product of the file's weights with the quantized activations
    exact = (x_q.astype(np.float64) * np.repeat(x_s, 32, axis=1)) @ dequantize_ref(raw, fmt, (N, K)).T.astype(np.float64)
    scale = np.abs(exact).max()
    assert np.abs(want - exact).max() <= 1e-5 * scale


@pytest.mark.parametrize("fmt", FORMATS)
def test_many_matrices_at_once_give_each_matrix_s_own_numbers(fmt):
    """matmul_many: several matrices, each on its own rows into its own rows and columns of one
    output, bit for bit what matmul gives each alone (the routed experts' path)."""
    K = 512
    packed = [KP.pack(fmt, _raw(fmt, N, K, seed=N)) for N in (48, 80, 16)]
    w = np.concatenate(packed)
    _, x_q, x_s, x_m = _acts(7, K, seed=2)
    spans = [(0, 3, 2, 0), (0, 3, 2, 48), (3, 4, 5, 0)]     # first row of x, rows, first row of out, column
    table, off = [], 0
    for p, N, (r0, nr, o0, col0) in zip(packed, (48, 80, 16), spans):
        table.append([off, N, r0, nr, o0, col0])
        off += p.size
    out = np.full((9, 128), np.nan, np.float32)
    KP.matmul_many(fmt, w, np.array(table, np.int64), x_q, x_s, x_m, out, 2)
    for p, (_, N, r0, nr, o0, col0) in zip(packed, table):
        alone = np.empty((nr, N), np.float32)
        KP.matmul(fmt, p, x_q[r0: r0 + nr], x_s[r0: r0 + nr], x_m[r0: r0 + nr], alone, 2)
        assert np.array_equal(out[o0: o0 + nr, col0: col0 + N], alone)
    with pytest.raises(ValueError, match="outside"):
        KP.matmul_many(fmt, w, np.array([[0, 48, 5, 4, 6, 0]], np.int64), x_q, x_s, x_m, out, 2)


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_entry_quantizes_like_decode(fmt):
    N, K = 32, 512
    packed = KP.pack(fmt, _raw(fmt, N, K, seed=3))
    x, x_q, x_s, x_m = _acts(6, K, seed=4)
    out = np.zeros((6, N), np.float32)
    KP.matmul_float(fmt, x, packed, N, out)
    assert np.array_equal(out, KP.matmul_ref(fmt, packed, N, x_q, x_s, x_m))


@pytest.mark.parametrize("fmt", FORMATS)
def test_scaled_row_reads_back_the_files_row(fmt):
    N, K = 48, 512
    raw = _raw(fmt, N, K, seed=9)
    packed = KP.pack(fmt, raw)
    rows = dequantize_ref(raw, fmt, (N, K))
    out = np.empty(K - 100, np.float32)
    for n in (0, 17, 47):
        KP.scaled_row_into(fmt, packed, K, n, np.float32(1.5), out)
        assert np.array_equal(out, rows[n, :K - 100] * np.float32(1.5))


def test_shapes_and_formats_are_checked():
    packed = KP.pack(KP.Q4_K, _raw(KP.Q4_K, 16, 256))
    _, x_q, x_s, x_m = _acts(2, 256)
    with pytest.raises(ValueError):
        KP.matmul(KP.Q4_K, packed, x_q, x_s, x_m, np.zeros((2, 15), np.float32), 2)
    with pytest.raises(ValueError):
        KP.matmul(KP.Q4_K, packed[:-1], x_q, x_s, x_m, np.zeros((2, 16), np.float32), 2)
    with pytest.raises(ValueError):
        KP.matmul(KP.Q6_K + 1, packed, x_q, x_s, x_m, np.zeros((2, 16), np.float32), 2)
    with pytest.raises(ValueError):
        KP.pack(KP.Q4_K, _raw(KP.Q4_K, 24, 256))       # not whole panels
    assert not KP.can_pack(KP.Q4_K, 24) and KP.can_pack(KP.Q6_K, 32) and not KP.can_pack(8, 32)


_VARIANT = """
import json, sys
import numpy as np
from cpullm_kernels.panels import kquant_panels as KP
from cpullm_kernels.rows.gguf_blocks import random_blocks
from cpullm_kernels.rows.kquant import quantize_act_q8_ref
assert KP.ISA == sys.argv[1], KP.ISA
rng = np.random.default_rng(5)
out = {}
for fmt in KP.FORMATS:
    for N, K in ((80, 1024), (64, 2304)):
        packed = KP.pack(fmt, random_blocks(fmt, N, K, rng).reshape(N, -1))
        acts = [quantize_act_q8_ref(r) for r in rng.standard_normal((11, K)).astype(np.float32)]
        x_q, x_s, x_m = (np.stack([a[i] for a in acts]) for i in range(3))
        want = KP.matmul_ref(fmt, packed, N, x_q, x_s, x_m)
        for B in (1, 2, 3, 8, 11):         # every tile of every ISA's TILES, a lone row (decode) first
            o = np.zeros((B, N), np.float32)
            KP.matmul(fmt, packed, x_q[:B], x_s[:B], x_m[:B], o, 2)
            out[f"{fmt}:{N}x{K}:{B}"] = [bool(np.array_equal(o, want[:B])), o.view(np.uint32).sum(dtype=np.uint64).item()]
print(json.dumps(out))
"""


@pytest.mark.cold
def test_every_isa_variant_gives_the_same_bits(tmp_path):
    """Each variant this CPU runs, compiled in a process of its own (own numba cache; the 256-bit
    ones for a target without AVX-512, as on the CPUs that run them), equals the reference and the
    others bit for bit."""
    results = {}
    for isa in KP.ISAS:
        env = dict(os.environ, CPULLM_KQ_PANELS_ISA=isa, NUMBA_CACHE_DIR=str(tmp_path / isa))
        if isa in numba_setup.RESTRICTED_TARGETS:   # compiled as for a CPU without AVX-512
            env.update(numba_setup.restricted_target_env(isa))
        r = subprocess.run([sys.executable, "-c", _VARIANT, isa], env=env, capture_output=True, text=True,
                           timeout=900)
        assert r.returncode == 0, r.stderr[-2000:]
        results[isa] = json.loads(r.stdout.strip().splitlines()[-1])
    for isa, res in results.items():
        assert all(ok for ok, _ in res.values()), (isa, res)
        assert res == results[KP.ISAS[0]], (isa, res, results[KP.ISAS[0]])
