"""Prefill over raw GGUF blocks (cpullm_kernels.tiles.kquant_gemm): the numba dequantizer against the
numpy reference (bit for bit), the GEMM against the float64 reference, the few-rows path against
the decode kernel's reference, on every format and awkward shapes."""
import numpy as np
import pytest

from cpullm_kernels.rows import gguf_blocks as gb
from cpullm_kernels.rows import kquant as kq
from cpullm_kernels.tiles import kquant_gemm as kg
from cpullm_kernels.setup import numba_setup
from cpullm_kernels.tiles import q8_gemm

RNG = np.random.default_rng(20261205)
FORMATS = ["Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q5_K", "Q4_1", "Q5_0", "Q5_1"]


def _shapes(name):
    W = gb.FORMATS[name].block_weights
    # N = 1, odd N, N past one tile's rows split over two threads, K one block and several
    return [(1, W), (37, 3 * W), (301, 2 * W), (130, 4096 if W == 32 else 4096 + 256)]


@pytest.mark.parametrize("name", FORMATS)
def test_dequantize_equals_reference_bit_for_bit(name):
    fmt = gb.FORMATS[name]
    for N, K in _shapes(name):
        w = gb.random_blocks(name, N, K, RNG)
        got = kg.dequantize(fmt.ggml_type, w, K)
        want = gb.dequantize_ref(w, name, (N, K))
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_dequantize_rows_into_a_strided_tile():
    N, K = 40, 512
    w = gb.random_blocks("Q5_K", N, K, RNG)
    buf = np.full((16, K + 8), np.nan, np.float32)
    kg.dequantize_rows_into(kq.Q5_K, w, 10, 26, buf[:, :K])
    np.testing.assert_array_equal(buf[:, :K], gb.dequantize_ref(w, "Q5_K", (N, K))[10:26])
    assert np.isnan(buf[:, K:]).all()


def _paths(name):
    """(label, function, reference) of every T >= MIN_ROWS path that takes this format here."""
    paths = [("sgemm", kg.matmul_sgemm, kg.matmul_sgemm_ref)]
    if q8_gemm.GEMM_ISA is not None and gb.FORMATS[name].ggml_type in kg.INT_FORMATS:
        paths.append(("int", kg.matmul_int, kg.matmul_int_ref))
    return paths


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", FORMATS)
def test_matmul_paths_match_their_references(name, threads):
    fmt = gb.FORMATS[name]
    saved = numba_setup.configured_threads()
    numba_setup.configure(threads)
    try:
        for N, K in _shapes(name):
            w = gb.random_blocks(name, N, K, RNG)
            deq = np.abs(gb.dequantize_ref(w, name, (N, K))).astype(np.float64)
            for T in (3, 4, 37):
                x = RNG.standard_normal((T, K)).astype(np.float32)
                if T > 3:
                    x[1, 5] = 300.0                                        # an activation outlier
                terms = np.abs(x).astype(np.float64) @ deq.T
                for label, fn, ref_fn in _paths(name):
                    big = np.full((T, N + 5), np.nan, np.float32)      # out as a strided view
                    out = big[:, 2:N + 2]
                    fn(fmt.ggml_type, x, w, out)
                    ref = ref_fn(x, w, name, (N, K))
                    assert (np.abs(out - ref) <= 2e-6 * terms + 1e-30).all(), (label, N, K, T)
                    assert np.isnan(big[:, :2]).all() and np.isnan(big[:, N + 2:]).all()
    finally:
        numba_setup.configure(saved)


@pytest.mark.parametrize("name", FORMATS)
def test_matmul_dispatches_to_the_integer_gemm_where_it_runs(name):
    fmt = gb.FORMATS[name]
    N, K, T = 70, 2 * fmt.block_weights, 5
    w = gb.random_blocks(name, N, K, RNG)
    x = RNG.standard_normal((T, K)).astype(np.float32)
    out = np.empty((T, N), np.float32)
    kg.matmul(fmt.ggml_type, x, w, out)
    use_int = q8_gemm.GEMM_ISA is not None and fmt.ggml_type in kg.INT_FORMATS
    want = np.empty((T, N), np.float32)
    (kg.matmul_int if use_int else kg.matmul_sgemm)(fmt.ggml_type, x, w, want)
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("name", FORMATS)
def test_matmul_few_rows_is_decode_numerics(name):
    # T < MIN_ROWS: each row quantized to int8 blocks and run through the decode matvec
    fmt = gb.FORMATS[name]
    N, K = 45, 2 * fmt.block_weights
    w = gb.random_blocks(name, N, K, RNG)
    for T in range(1, kg.MIN_ROWS):
        x = RNG.standard_normal((T, K)).astype(np.float32)
        out = np.full((T, N), np.nan, np.float32)
        kg.matmul(fmt.ggml_type, x, w, out)
        for t in range(T):
            x_q, x_s, _ = kq.quantize_act_q8_ref(x[t])
            ref = kq.matvec_ref(w, name, (N, K), x_q, x_s)
            tol = 2e-6 * np.abs(gb.dequantize_ref(w, name, (N, K))).astype(np.float64) @ np.abs(x_q * np.repeat(x_s, 32))
            assert (np.abs(out[t] - ref) <= tol + 1e-30).all()


def test_matmul_rejects_bad_input():
    w = gb.random_blocks("Q4_K", 4, 256, RNG)
    x = np.zeros((5, 256), np.float32)
    with pytest.raises(ValueError):
        kg.matmul(kq.Q4_K, x, w, np.zeros((5, 3), np.float32))
    with pytest.raises(ValueError):
        kg.matmul(kq.Q6_K, x, w, np.zeros((5, 4), np.float32))
    with pytest.raises(ValueError):
        kg.matmul(9, x, w, np.zeros((5, 4), np.float32))
    with pytest.raises(ValueError):
        kg.dequantize(kq.Q4_K, w, 512)


@pytest.mark.skipif(q8_gemm.GEMM_ISA is None, reason="this CPU lacks AVX2+FMA+F16C (no integer GEMM here)")
def test_q6_k_integer_gemm_at_its_overflow_limit():
    # every int16 weight sc (q - 32) at 4096 (sc = -128, q = 0) against activations at their
    # largest (one sign per block): each block's int32 sum is 32 * 4096 * 16383, just below 2^31
    N, K, T = 70, 512, 4
    w = gb.random_blocks("Q6_K", N, K, RNG, scale=1e-3)
    b = w.reshape(-1, 210)
    b[:, 0:192] = 0
    b[:, 192:208] = 0x80
    x = np.where(np.arange(K) // 32 % 2 == 0, 1.0, -1.0).astype(np.float32) * np.ones((T, 1), np.float32)
    out = np.full((T, N), np.nan, np.float32)
    kg.matmul_int(kq.Q6_K, x, w, out)
    ref = kg.matmul_int_ref(x, w, "Q6_K", (N, K))
    terms = np.abs(x).astype(np.float64) @ np.abs(gb.dequantize_ref(w, "Q6_K", (N, K))).astype(np.float64).T
    assert (np.abs(out - ref) <= 2e-6 * terms).all()
