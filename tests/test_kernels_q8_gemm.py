"""The W8A16 GEMM (cpullm_kernels.tiles.q8_gemm, whose micro-kernel kquant_gemm runs) on q8 weights:
matmul_w8a16 vs its numpy reference, its agreement with the q8 LINEAR (q8_panels), the packed
layout, and a codegen guard.

Shapes are deliberately awkward: N not a multiple of the 64- or 16-row panel (nor of 16), K not
a multiple of 32 and spanning several packed chunks (1024 values) plus a partial one, T
not a multiple of the 3- or 4-row register tile.
"""
import os
import subprocess
import sys

import numba
import numpy as np
import pytest

from cpullm_kernels.setup import numba_setup
from cpullm_kernels.rows import q8
from cpullm_kernels.tiles import q8_gemm
from cpullm_kernels.panels import q8_panels

RNG = np.random.default_rng(20261201)
VNNI = pytest.mark.skipif(q8_gemm.GEMM_ISA is None, reason="this CPU lacks AVX2+FMA+F16C (the kernel cannot run here)")

SHAPES = [(1, 1, 1), (2, 17, 33), (3, 64, 256), (4, 65, 257), (5, 100, 900), (37, 129, 896), (64, 300, 1000), (6, 45, 2500)]


def _w(N, K):
    w = RNG.standard_normal((N, K)).astype(np.float32)
    if N > 3 and K > 40:
        w[1, :40] = 0.0            # an all-zero block (scale 0)
        w[2, 7] = 60.0             # an outlier
    return w


def _x(T, K):
    x = RNG.standard_normal((T, K)).astype(np.float32)
    if T > 1 and K > 40:
        x[1, 3] = 500.0            # an activation outlier inside one block
    return x


def _bound(x, w_q, w_s):
    """float32 accumulation tolerance: relative to the sum of absolute terms."""
    w = np.abs(q8.dequantize_weight_q8_ref(w_q, w_s)[:, :x.shape[1]]).astype(np.float64)
    return 2e-6 * (np.abs(x).astype(np.float64) @ w.T).max() + 1e-30


@VNNI
@pytest.mark.parametrize("T,N,K", SHAPES)
def test_w8a16_matches_reference(T, N, K):
    w_q, w_s = q8.quantize_weight_q8(_w(N, K))
    x = _x(T, K)
    out = np.full((T, N), np.nan, np.float32)
    q8_gemm.matmul_w8a16(x, w_q, w_s, out)
    ref = q8_gemm.matmul_w8a16_ref(x, w_q, w_s)
    assert np.isfinite(out).all()
    assert np.abs(out - ref).max() <= _bound(x, w_q, w_s)


@VNNI
def test_w8a16_reuses_its_activation_scratch_without_stale_values():
    # a large product fills the kept int16 scratch; smaller ones after it (padding rows of the
    # register tile included) must read none of those values
    results = []
    for T, N, K in [(64, 300, 1000), (5, 100, 900), (4, 65, 257), (64, 300, 1000)]:
        w_q, w_s = q8.quantize_weight_q8(_w(N, K))
        x = _x(T, K)
        out = np.empty((T, N), np.float32)
        q8_gemm.matmul_w8a16(x, w_q, w_s, out)
        assert np.abs(out - q8_gemm.matmul_w8a16_ref(x, w_q, w_s)).max() <= _bound(x, w_q, w_s)
        results.append(q8._SCRATCH.q)
    assert all(q is results[0] for q in results)      # grown once, then kept


@VNNI
def test_w8a16_rows_agree_with_the_q8_linear():
    # the same int16 activation blocks x q8 weights as the runtime's q8 LINEAR (q8_panels)
    T, N, K = 7, 200, 600
    w_q, w_s = q8.quantize_weight_q8(_w(N, K))
    x = _x(T, K)
    out = np.empty((T, N), np.float32)
    q8_gemm.matmul_w8a16(x, w_q, w_s, out)
    wp, sp = q8_panels.pack_panels(w_q, w_s)
    rows = np.empty((T, N), np.float32)
    q8_panels.matmul_panels(x, wp, sp, N, rows)
    for t in range(T):
        assert np.abs(out[t] - rows[t]).max() <= _bound(x[t:t + 1], w_q, w_s)


@VNNI
def test_w8a16_writes_into_a_strided_view_and_nothing_else():
    # full panels sum straight into the view over several K chunks; its old contents (NaN) must
    # not leak into the result
    T, N, K = 5, 150, 2 * q8_gemm.KC_BLOCKS * 32 + 100
    w_q, w_s = q8.quantize_weight_q8(_w(N, K))
    x = _x(T, K)
    big = np.full((T, N + 30), -7.0, np.float32)
    big[:, 10:10 + N] = np.nan
    q8_gemm.matmul_w8a16(x, w_q, w_s, big[:, 10:10 + N])
    assert (big[:, :10] == -7.0).all() and (big[:, 10 + N:] == -7.0).all()
    assert np.abs(big[:, 10:10 + N] - q8_gemm.matmul_w8a16_ref(x, w_q, w_s)).max() <= _bound(x, w_q, w_s)


@VNNI
def test_w8a16_extreme_values_do_not_overflow():
    # every weight +-127 and every activation at +-32767 after quantization: the int32 block
    # sums reach 32 * 127 * 32767 and must stay exact
    T, N, K = 4, 64, 512
    w = np.where(RNG.random((N, K)) < 0.5, -1.0, 1.0).astype(np.float32)
    w[:, ::2] = 1.0
    x = np.ones((T, K), np.float32) * 3.0
    w_q, w_s = q8.quantize_weight_q8(w)
    out = np.empty((T, N), np.float32)
    q8_gemm.matmul_w8a16(x, w_q, w_s, out)
    assert np.abs(w_q).min() == 127
    x_q, x_s = q8.quantize_act_q16_ref(x[0], w_q.shape[1])
    assert np.abs(x_q).min() == 32767
    np.testing.assert_allclose(out, q8_gemm.matmul_w8a16_ref(x, w_q, w_s), rtol=1e-6)


@VNNI
def test_pack_layout():
    # the packed chunk is the documented interleave of sign-extended weights and float scales
    N, K = 90, 320                      # the last panel partial (26 of 64 or 10 of 16 rows), 10 blocks
    w_q, w_s = q8.quantize_weight_q8(_w(N, K))
    NR, KC = q8_gemm.NR, q8_gemm.KC_BLOCKS
    n0, b0, nblk = N // NR * NR, 8, 2
    assert 0 < N - n0 < NR
    wp = np.full(KC * 16 * 2 * NR, 99, np.int16)
    sp = np.full(KC * NR, 99.0, np.float32)
    q8_gemm._pack_chunk(w_q, w_s, n0, b0, nblk, wp, sp)
    scales = q8.scale_values(w_s)
    for bb in range(nblk):
        for r in range(NR):             # row n0 + r of the panel
            n = n0 + r
            for p in range(16):
                for e in range(2):
                    want = w_q[n, 32 * (b0 + bb) + 2 * p + e] if n < N else 0
                    assert wp[(bb * 16 + p) * 2 * NR + 2 * r + e] == want
            assert sp[bb * NR + r] == (scales[n, b0 + bb] if n < N else 0.0)


@VNNI
def test_w8a16_rejects_bad_shapes():
    w_q, w_s = q8.quantize_weight_q8(_w(10, 64))
    with pytest.raises(ValueError):
        q8_gemm.matmul_w8a16(np.zeros((5, 65), np.float32), w_q, w_s, np.zeros((5, 10), np.float32))
    with pytest.raises(ValueError):
        q8_gemm.matmul_w8a16(np.zeros((5, 64), np.float32), w_q, w_s, np.zeros((5, 11), np.float32))


@VNNI
def test_w8a16_codegen_uses_the_integer_dot_instructions():
    # numba cannot show cached code: compile the driver afresh and read its assembly
    fresh = numba.njit(parallel=True)(q8_gemm._gemm_panels.py_func)
    w_q, w_s = q8.quantize_weight_q8(_w(70, 300))
    Tp = -(-5 // q8_gemm.TR) * q8_gemm.TR          # 5 rows, padded to whole register tiles
    x_q, x_s = np.zeros((Tp, 320), np.int16), np.zeros((Tp, 10), np.float32)
    fresh(x_q, x_s, w_q, w_s, 5, np.zeros((5, 70), np.float32), 2)
    asm = fresh.inspect_asm(fresh.signatures[0])
    dot, reg = {"avx512vnni": ("vpdpwssd", "zmm"), "avxvnni": ("vpdpwssd", "ymm")}.get(q8_gemm.GEMM_ISA,
                                                                                   ("vpmaddwd", "ymm"))
    assert dot in asm and reg in asm, f"the W8A16 tile lost its {dot} code"
    assert asm.count(dot) >= 16 * q8_gemm.TR * q8_gemm.V, "the 16-step block loop is not unrolled"
    assert "vpermt2d" in asm or "vpermi2d" in asm or "vshufi" in asm or "vpunpck" in asm, "pack transpose scalarized"


_VARIANT = """
import sys
import numpy as np
from cpullm_kernels.rows import q8
from cpullm_kernels.tiles import q8_gemm
assert q8_gemm.GEMM_ISA == sys.argv[1], q8_gemm.GEMM_ISA
rng = np.random.default_rng(7)
outs = {}
for T, N, K in ((13, 130, 1100), (37, 64, 2048)):
    w_q, w_s = q8.quantize_weight_q8(rng.standard_normal((N, K)).astype(np.float32))
    x = rng.standard_normal((T, K)).astype(np.float32)
    o = np.zeros((T, N), np.float32)
    q8_gemm.matmul_w8a16(x, w_q, w_s, o)
    outs[f"o{T}"] = o
np.savez(sys.argv[2], **outs)
"""


@pytest.mark.cold
@VNNI
@pytest.mark.parametrize("isa", sorted(numba_setup.RESTRICTED_TARGETS))
def test_every_lesser_target_gives_the_same_bits(isa, tmp_path):
    """The 256-bit variants (AVX2, AVX-VNNI), each compiled in a process of its own for a target
    without AVX-512 (as on the CPUs that run them), equal this process's variant bit for bit."""
    try:
        target = numba_setup.restricted_target_env(isa)
    except ValueError as e:
        pytest.skip(str(e))
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"), **target)
    r = subprocess.run([sys.executable, "-c", _VARIANT, isa, str(tmp_path / "out.npz")], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    got = np.load(tmp_path / "out.npz")
    rng = np.random.default_rng(7)
    for T, N, K in ((13, 130, 1100), (37, 64, 2048)):
        w_q, w_s = q8.quantize_weight_q8(rng.standard_normal((N, K)).astype(np.float32))
        x = rng.standard_normal((T, K)).astype(np.float32)
        o = np.zeros((T, N), np.float32)
        q8_gemm.matmul_w8a16(x, w_q, w_s, o)
        assert np.array_equal(got[f"o{T}"], o), (isa, T)
