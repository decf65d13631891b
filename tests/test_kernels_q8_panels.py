"""The q8 panel kernels (cpullm_kernels.panels.q8_panels): layout, the numpy reference bit for bit, batch
invariance, and every ISA variant this CPU runs."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from cpullm_kernels.setup import numba_setup
from cpullm_kernels.rows import q8
from cpullm_kernels.panels import q8_panels as qp

SHAPES = [(1, 32), (16, 64), (64, 96), (100, 200), (130, 4864), (257, 896)]


def _weights(N, K, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((N, K)).astype(np.float32) * rng.uniform(0.01, 3, (N, 1)).astype(np.float32)
    return q8.quantize_weight_q8(w)


def _acts(B, K, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, K)).astype(np.float32)
    x[:, ::7] *= 40                                         # outliers: int16 blocks of unequal scale
    Kp = q8.padded_k(K)
    x_q, x_s = np.zeros((B, Kp), np.int16), np.zeros((B, Kp // 32), np.float32)
    for t in range(B):
        q8.quantize_act_q16(x[t], x_q[t], x_s[t])
    return x, x_q, x_s


@pytest.mark.parametrize("N,K", SHAPES)
def test_pack_round_trip_and_padding(N, K):
    w_q, w_s = _weights(N, K)
    wp, sp = qp.pack_panels(w_q, w_s)
    Np = qp.padded_rows(N)
    assert Np % qp.ROW_ALIGN == 0 and Np >= N
    assert wp.size == Np * w_q.shape[1] and sp.size == Np * w_s.shape[1]
    q2, s2 = qp.unpack_panels(wp, sp, N, w_q.shape[1])
    assert np.array_equal(q2, w_q) and np.array_equal(s2, w_s)
    rows = qp.dequantized_rows(wp, sp, w_q.shape[1], N // 3, N)
    assert np.array_equal(rows, q8.dequantize_weight_q8_ref(w_q, w_s)[N // 3:].astype(np.float64))
    K = min(K, w_q.shape[1])
    for n in (0, N // 2, N - 1):                           # an embedding row read from the panels
        out = np.zeros(K, np.float32)
        qp.scaled_row_into(wp, sp, w_q.shape[1], n, np.float32(2.0), out)
        assert np.array_equal(out, (q8.dequantize_weight_q8_ref(w_q[n:n + 1], w_s[n:n + 1])[0, :K] * 2).astype(np.float32))


@pytest.mark.parametrize("N,K", SHAPES)
def test_kernel_equals_reference_and_float64(N, K):
    w_q, w_s = _weights(N, K)
    wp, sp = qp.pack_panels(w_q, w_s)
    for B in (1, 3, 8, 13):
        _, x_q, x_s = _acts(B, K, seed=B)
        out = np.full((B, N), np.nan, np.float32)
        qp.panels_matmul(wp, sp, N, x_q, x_s, out, 2)
        assert np.array_equal(out, qp.panels_matmul_ref(wp, sp, N, x_q, x_s))
        exact = np.stack([q8.matvec_q8_ref(w_q, w_s, x_q[t], x_s[t]) for t in range(B)])
        assert np.allclose(out, exact, rtol=1e-5, atol=1e-5 * np.abs(exact).max())


def test_many_matrices_at_once_give_each_matrix_s_own_numbers():
    """panels_matmul_many: several matrices, each on its own rows into its own rows and columns
    of one output, bit for bit what panels_matmul gives each alone (the routed experts' path)."""
    K, sizes = 320, (64, 128, 64)
    packed = [qp.pack_panels(*_weights(N, K, seed=N)) for N in sizes]
    wq = np.concatenate([wp for wp, _ in packed])
    ws = np.concatenate([sp for _, sp in packed])
    _, x_q, x_s = _acts(7, K, seed=3)
    # (first row of x, rows, first row of out, column): matrix 1 reads matrix 0's rows, writes beside it
    spans = [(0, 3, 2, 0), (0, 3, 2, 64), (3, 4, 5, 0)]
    table, w_off, s_off = [], 0, 0
    for (wp, sp), N, span in zip(packed, sizes, spans):
        table.append([w_off, s_off, N, *span])
        w_off, s_off = w_off + wp.size, s_off + sp.size
    out = np.full((9, 192), np.nan, np.float32)
    qp.panels_matmul_many(wq, ws, np.array(table, np.int64), x_q, x_s, out, 2)
    for (wp, sp), N, (r0, nr, o0, col0) in zip(packed, sizes, spans):
        alone = np.empty((nr, N), np.float32)
        qp.panels_matmul(wp, sp, N, x_q[r0: r0 + nr], x_s[r0: r0 + nr], alone, 2)
        assert np.array_equal(out[o0: o0 + nr, col0: col0 + N], alone)
    with pytest.raises(ValueError, match="outside"):
        qp.panels_matmul_many(wq, ws, np.array([[0, 0, 64, 5, 4, 6, 0]], np.int64), x_q, x_s, out, 2)


def test_every_row_is_independent_of_the_batch_and_the_threads():
    N, K = 200, 4864                                         # long rows: the L2-prefetch tiles too
    w_q, w_s = _weights(N, K)
    wp, sp = qp.pack_panels(w_q, w_s)
    _, x_q, x_s = _acts(17, K)
    alone = np.zeros((17, N), np.float32)
    for t in range(17):
        qp.panels_matmul(wp, sp, N, x_q[t:t + 1], x_s[t:t + 1], alone[t:t + 1], 1)
    for B in range(1, 18):                                   # every tile, and 8 + each rest
        for threads in (1, 2):
            out = np.zeros((B, N), np.float32)
            qp.panels_matmul(wp, sp, N, x_q[:B], x_s[:B], out, threads)
            assert np.array_equal(out, alone[:B]), (B, threads)
    for n in (0, 15, 16, 199):                               # the head screen's exact rows
        assert qp.panel_row_dot(wp, sp, n, x_q[3], x_s[3]) == alone[3, n]


def test_strided_output_and_prefill_entry_point():
    N, K = 100, 200
    w_q, w_s = _weights(N, K)
    wp, sp = qp.pack_panels(w_q, w_s)
    x, x_q, x_s = _acts(5, K)
    arena = np.zeros((5, 160), np.float32)                   # rows of a wider buffer, as the executor's
    qp.matmul_panels(x, wp, sp, N, arena)
    want = np.zeros((5, N), np.float32)
    qp.panels_matmul(wp, sp, N, x_q, x_s, want, 2)
    assert np.array_equal(arena[:, :N], want) and not arena[:, N:].any()


def test_prefill_chunks_of_rows_give_the_unchunked_values(monkeypatch):
    """A prefill whose int16 rows exceed ACT_CHUNK_BYTES runs in chunks of rows: the same values
    as one pass (rows are independent), the last chunk short, the output rows of a wider buffer."""
    N, K = 130, 256
    w_q, w_s = _weights(N, K)
    wp, sp = qp.pack_panels(w_q, w_s)
    x, x_q, x_s = _acts(29, K)
    want = np.zeros((29, N), np.float32)
    qp.panels_matmul(wp, sp, N, x_q, x_s, want, 2)
    monkeypatch.setattr(qp, "ACT_CHUNK_BYTES", 12 * 2 * K)         # chunks of 12, 12 and 5 rows
    assert qp.act_chunk_rows(K) == 12
    arena = np.full((29, 192), 7.0, np.float32)
    qp.matmul_panels(x, wp, sp, N, arena)
    assert np.array_equal(arena[:, :N], want) and (arena[:, N:] == 7.0).all()
    assert np.array_equal(want, qp.panels_matmul_ref(wp, sp, N, x_q, x_s))


def test_bad_shapes_are_refused():
    w_q, w_s = _weights(64, 64)
    wp, sp = qp.pack_panels(w_q, w_s)
    _, x_q, x_s = _acts(2, 64)
    with pytest.raises(ValueError):
        qp.panels_matmul(wp[:-32], sp, 64, x_q, x_s, np.zeros((2, 64), np.float32), 2)
    with pytest.raises(ValueError):
        qp.panels_matmul(wp, sp, 64, x_q, x_s, np.zeros((2, 63), np.float32), 2)
    with pytest.raises(ValueError):
        qp.panels_matmul(wp, sp, 64, x_q[:, :32], x_s[:, :1], np.zeros((2, 64), np.float32), 2)


@pytest.mark.parametrize("N,K", SHAPES)
def test_the_one_row_kernel_gives_the_many_row_kernel_s_bits(N, K):
    """panels_matvec (decode's kernel: the one-row tile alone) equals panels_matmul on one row, bit
    for bit, on every thread count, full and partial groups of rows; it refuses a second row."""
    w_q, w_s = _weights(N, K)
    wp, sp = qp.pack_panels(w_q, w_s)
    _, x_q, x_s = _acts(1, K, seed=N)
    want = np.zeros((1, N), np.float32)
    qp.panels_matmul(wp, sp, N, x_q, x_s, want, 2)
    assert np.array_equal(want, qp.panels_matmul_ref(wp, sp, N, x_q, x_s))
    for threads in (1, 2, 3):
        got = np.full((1, N + 5), np.nan, np.float32)
        qp.panels_matvec(wp, sp, N, x_q, x_s, got, threads)
        assert np.array_equal(got[:, :N], want) and np.isnan(got[:, N:]).all()
    _, x_q2, x_s2 = _acts(2, K)
    with pytest.raises(ValueError, match="one row"):
        qp.panels_matvec(wp, sp, N, x_q2, x_s2, np.zeros((2, N), np.float32), 2)


_VARIANT = """
import json, sys
import numpy as np
from cpullm_kernels.rows import q8
from cpullm_kernels.panels import q8_panels as qp
assert qp.ISA == sys.argv[1], qp.ISA
rng = np.random.default_rng(5)
out = {}
for N, K in ((130, 4864), (257, 896)):
    w_q, w_s = q8.quantize_weight_q8(rng.standard_normal((N, K)).astype(np.float32))
    wp, sp = qp.pack_panels(w_q, w_s)
    for B in (*range(1, 9), 11):        # every register tile of every variant
        x = rng.standard_normal((B, K)).astype(np.float32)
        Kp = w_q.shape[1]
        x_q, x_s = np.zeros((B, Kp), np.int16), np.zeros((B, Kp // 32), np.float32)
        for t in range(B):
            q8.quantize_act_q16(x[t], x_q[t], x_s[t])
        o = np.zeros((B, N), np.float32)
        qp.matmul_panels(x, wp, sp, N, o)
        ok = bool(np.array_equal(o, qp.panels_matmul_ref(wp, sp, N, x_q, x_s)))
        if B == 1:                      # the one-row kernel, the same tile
            o1 = np.zeros((1, N), np.float32)
            qp.panels_matvec(wp, sp, N, x_q, x_s, o1, 2)
            ok = ok and bool(np.array_equal(o1, o))
        out[f"{N}x{K}:{B}"] = [ok, o.view(np.uint32).sum(dtype=np.uint64).item()]
print(json.dumps(out))
"""


@pytest.mark.cold
def test_every_isa_variant_gives_the_same_bits(tmp_path):
    """Each variant this CPU runs, compiled in a process of its own (own numba cache; the 256-bit
    ones for a target without AVX-512, as on the CPUs that run them), equals the reference and the
    others bit for bit."""
    results = {}
    for isa in qp.ISAS:
        env = dict(os.environ, CPULLM_Q8_PANELS_ISA=isa, NUMBA_CACHE_DIR=str(tmp_path / isa))
        if isa in numba_setup.RESTRICTED_TARGETS:   # compiled as for a CPU without AVX-512
            env.update(numba_setup.restricted_target_env(isa))
        r = subprocess.run([sys.executable, "-c", _VARIANT, isa], env=env, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        results[isa] = json.loads(r.stdout.strip().splitlines()[-1])
    for isa, res in results.items():
        assert all(ok for ok, _ in res.values()), (isa, res)
        assert res == results[qp.ISAS[0]], (isa, res, results[qp.ISAS[0]])


def test_restricted_targets_drop_every_wider_extension():
    """The lesser targets the variant tests and benchmarks/isa.py compile for: no AVX-512, AMX or
    AVX10 feature on, AVX-VNNI only for "avxvnni", AVX2 / FMA / F16C kept."""
    with pytest.raises(ValueError):
        numba_setup.restricted_target_env("sse2")
    for isa, name in numba_setup.RESTRICTED_TARGETS.items():
        try:
            env = numba_setup.restricted_target_env(isa)
        except ValueError:
            continue                         # this CPU cannot run that target
        on = {f[1:] for f in env["NUMBA_CPU_FEATURES"].split(",") if f.startswith("+")}
        assert env["NUMBA_CPU_NAME"] == name
        assert {"avx2", "fma", "f16c"} <= on
        assert not any(f.startswith(("avx512", "amx", "avx10")) for f in on), on
        assert ("avxvnni" in on) == (isa == "avxvnni")
