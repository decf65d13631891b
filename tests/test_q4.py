"""cpullm's q4 quantizer (Q4_K blocks): layout checked by the gguf package's dequantizer, error
against llama.cpp's own Q4_K quantizer, padding, edge blocks, and the kernels on its output."""
import ctypes
import os

import numpy as np
import pytest

from cpullm_kernels.rows import gguf_blocks as gb
from cpullm_kernels.rows import kquant as kq
from cpullm_kernels.rows import q4

_KINDS = ("normal", "student_t3", "skewed")


def _weights(kind, N, K):
    """The same matrix for the same arguments, whatever tests ran before (or were skipped)."""
    rng = np.random.default_rng([20261206, _KINDS.index(kind), N, K])
    if kind == "normal":
        w = rng.standard_normal((N, K))
    elif kind == "student_t3":                   # heavy tails, as real weight rows have
        w = rng.standard_t(3, (N, K))
    else:                                        # skewed blocks: the min matters
        w = rng.standard_normal((N, K)) + 0.7 * np.abs(rng.standard_normal((N, K)))
    return (0.02 * w).astype(np.float32)


def _ggml_quantizer(fmt):
    """llama.cpp's own quantizer of ``fmt`` (no imatrix) through its shared library, or None."""
    try:
        import llama_cpp
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so")
    if not os.path.exists(path):
        return None
    lib = ctypes.CDLL(path)
    fn = lib.ggml_quantize_chunk
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_void_p]

    def quantize(w):
        w = np.ascontiguousarray(w, np.float32)
        out = np.zeros((w.shape[0], fmt.row_bytes(w.shape[1])), np.uint8)
        fn(fmt.ggml_type, w.ctypes.data, out.ctypes.data, 0, w.shape[0], w.shape[1], None)
        return out
    return quantize


def _rmse(a, b):
    return float(np.sqrt(np.mean((a.astype(np.float64) - b) ** 2)))


@pytest.mark.parametrize("kind", ["normal", "student_t3", "skewed"])
def test_q4_layout_is_q4_k_and_error_is_small(kind):
    gguf_quants = pytest.importorskip("gguf.quants", reason="the gguf package is the independent oracle")
    from gguf import GGMLQuantizationType
    N, K = 64, 1024
    w = _weights(kind, N, K)
    blocks = q4.quantize_q4(w)
    assert blocks.shape == (N, K // 256 * 144) and blocks.dtype == np.uint8
    deq = q4.dequantize_q4_ref(blocks, N, K)
    np.testing.assert_allclose(gguf_quants.dequantize(blocks, GGMLQuantizationType.Q4_K), deq, rtol=2e-7, atol=0)
    # 16 levels over each block's range: the error is a small fraction of the weights' spread
    assert _rmse(deq, w) <= 0.1 * float(w.std())


@pytest.mark.parametrize("kind", ["normal", "student_t3", "skewed"])
def test_q4_error_no_worse_than_llama_cpp_q4_k(kind):
    ggml_quantize = _ggml_quantizer(gb.Q4_K)
    if ggml_quantize is None:
        pytest.skip("llama-cpp-python (its libggml-base) is not installed: no llama.cpp quantizer to compare with")
    N, K = 128, 2048
    w = _weights(kind, N, K)
    ours = q4.dequantize_q4_ref(q4.quantize_q4(w), N, K)
    theirs = gb.dequantize_ref(ggml_quantize(w), "Q4_K", (N, K))
    # both fit each sub-block of 32 weighting weight i by rms(sub-block) + |w_i|: compare that error
    sub = w.reshape(-1, 32)
    r = (np.sqrt((sub.astype(np.float64) ** 2).mean(axis=1, keepdims=True)) + np.abs(sub)).reshape(N, K)

    def weighted(d):
        return float(np.sqrt((r * (d.astype(np.float64) - w) ** 2).sum() / r.sum()))
    assert weighted(ours) <= 1.01 * weighted(theirs), (weighted(ours), weighted(theirs))   # measured 1.002-1.005
    assert _rmse(ours, w) <= 1.02 * _rmse(theirs, w), (_rmse(ours, w), _rmse(theirs, w))


def test_q4_pads_k_with_zero_weights():
    N, K = 5, 896
    w = _weights("normal", N, K)
    blocks = q4.quantize_q4(w)
    assert q4.padded_k(K) == 1024 and blocks.shape == (N, 4 * 144)
    full = gb.dequantize_ref(blocks, "Q4_K", (N, 1024))
    assert (full[:, K:] == 0).all()
    np.testing.assert_array_equal(full[:, :K], q4.dequantize_q4_ref(blocks, N, K))


def test_q4_edge_blocks():
    w = np.zeros((4, 256), np.float32)
    w[1] = 0.5                                   # a constant positive row: b = 0, a q = 0.5
    w[2] = -0.25                                 # a constant negative row: the min carries it
    w[3, ::2] = 3.0                              # two levels
    deq = q4.dequantize_q4_ref(q4.quantize_q4(w), 4, 256)
    assert (deq[0] == 0).all()
    np.testing.assert_allclose(deq[1:], w[1:], rtol=2e-3, atol=1e-3)


def test_q4_rejects_bad_input():
    with pytest.raises(ValueError):
        q4.quantize_q4(np.zeros(256, np.float32))
    with pytest.raises(ValueError):
        q4.quantize_q4(np.full((1, 256), np.nan, np.float32))
    with pytest.raises(ValueError):
        q4.quantize_q4(np.full((1, 256), 1e9, np.float32))


@pytest.mark.parametrize("fmt, K, seed", [("Q4_K", 768, 7), ("Q5_0", 640, 8)])
def test_q4_mix_blocks_run_through_the_matvec(fmt, K, seed):
    N = 33
    w = _weights("student_t3", N, K)
    blocks = {"Q4_K": q4.quantize_q4, "Q5_0": q4.quantize_q5_0}[fmt](w)
    x = np.random.default_rng(seed).standard_normal(K).astype(np.float32)
    x_q, x_s, x_m = np.empty(K, np.int8), np.empty(K // 32, np.float32), np.empty(K // 16, np.float32)
    kq.quantize_act_q8(x, x_q, x_s, x_m)
    out = np.full(N, np.nan, np.float32)
    kq.matvec(getattr(kq, fmt), blocks, x_q, x_s, x_m, out)
    ref = kq.matvec_ref(blocks, fmt, (N, K), x_q, x_s)
    terms = np.abs(gb.dequantize_ref(blocks, fmt, (N, K))).astype(np.float64) @ np.abs(x_q * np.repeat(x_s, 32))
    assert (np.abs(out - ref) <= 2e-6 * terms).all()
    # and the product is close to the float32 one (llama.cpp's own Q4_K of the Q4_K matrix: 0.133)
    assert np.abs(out - w @ x).max() <= 0.15 * np.abs(w @ x).max()


# ---- Q6_K (the tensors the q4 mix keeps at 6 bits) ---------------------------------------------

@pytest.mark.parametrize("kind", ["normal", "student_t3", "skewed"])
def test_q6_k_layout_and_error(kind):
    gguf_quants = pytest.importorskip("gguf.quants", reason="the gguf package is the independent oracle")
    from gguf import GGMLQuantizationType
    N, K = 64, 896                                   # padded to 1024
    w = _weights(kind, N, K)
    blocks = q4.quantize_q6_k(w)
    assert blocks.shape == (N, 4 * 210)
    full = gguf_quants.dequantize(blocks, GGMLQuantizationType.Q6_K)
    np.testing.assert_allclose(full[:, :K], q4.dequantize_q6_k_ref(blocks, N, K), rtol=2e-7, atol=0)
    assert (full[:, K:] == 0).all()
    # 64 levels per sub-block of 16 against q4's 16 per 32: about 4x finer (0.24-0.27x measured)
    q4_err = _rmse(q4.dequantize_q4_ref(q4.quantize_q4(w), N, K), w)
    assert _rmse(q4.dequantize_q6_k_ref(blocks, N, K), w) <= 0.3 * q4_err


@pytest.mark.parametrize("kind", ["normal", "student_t3", "skewed"])
def test_q6_k_error_no_worse_than_llama_cpp_q6_k(kind):
    ggml_quantize = _ggml_quantizer(gb.Q6_K)
    if ggml_quantize is None:
        pytest.skip("llama-cpp-python (its libggml-base) is not installed: no llama.cpp quantizer to compare with")
    N, K = 128, 2048
    w = _weights(kind, N, K)
    ours = _rmse(q4.dequantize_q6_k_ref(q4.quantize_q6_k(w), N, K), w)
    theirs = _rmse(gb.dequantize_ref(ggml_quantize(w), "Q6_K", (N, K)), w)
    assert ours <= 1.005 * theirs, (ours, theirs)


def test_q6_k_edge_rows_and_bad_input():
    w = np.zeros((3, 256), np.float32)
    w[1] = -0.5
    w[2, ::3] = 2.0
    deq = q4.dequantize_q6_k_ref(q4.quantize_q6_k(w), 3, 256)
    assert (deq[0] == 0).all()
    np.testing.assert_allclose(deq[1:], w[1:], rtol=1e-3, atol=1e-4)
    with pytest.raises(ValueError):
        q4.quantize_q6_k(np.full((1, 256), np.inf, np.float32))


# ---- Q5_0 / Q8_0 (the q4 mix's formats for rows that are not whole 256-weight super-blocks) ----

@pytest.mark.parametrize("fmt", ["Q5_0", "Q8_0"])
@pytest.mark.parametrize("kind", _KINDS)
def test_q5_0_and_q8_0_layout_error_and_grid_recovery(fmt, kind):
    """The gguf package (a port of ggml's reference quantizers) reads our blocks as we do; our
    error is no worse than its quantizer's; weights already on its grid (a dequantized GGUF
    tensor, as the store's converted models are) come back as the same blocks."""
    gguf_quants = pytest.importorskip("gguf.quants", reason="the gguf package is the independent oracle")
    from gguf import GGMLQuantizationType
    ours_q = {"Q5_0": q4.quantize_q5_0, "Q8_0": q4.quantize_q8_0}[fmt]
    qtype = getattr(GGMLQuantizationType, fmt)
    N, K = 48, 640
    w = _weights(kind, N, K)
    blocks = ours_q(w)
    assert blocks.shape == (N, gb.block_format(fmt).row_bytes(K))
    deq = gb.dequantize_ref(blocks, fmt, (N, K))
    np.testing.assert_array_equal(gguf_quants.dequantize(blocks, qtype), deq)
    theirs = gguf_quants.quantize(w, qtype)
    assert _rmse(deq, w) <= _rmse(gguf_quants.dequantize(theirs, qtype), w) * 1.0001
    assert _rmse(deq, w) < {"Q5_0": 0.06, "Q8_0": 0.006}[fmt] * float(np.abs(w).max())
    np.testing.assert_array_equal(ours_q(gguf_quants.dequantize(theirs, qtype)), theirs)


def test_q5_0_and_q8_0_edge_blocks_and_bad_input():
    w = np.zeros((3, 64), np.float32)
    w[1] = -0.5
    w[2, ::3] = 2.0
    for fmt, quantize in (("Q5_0", q4.quantize_q5_0), ("Q8_0", q4.quantize_q8_0)):
        deq = gb.dequantize_ref(quantize(w), fmt, (3, 64))
        assert (deq[0] == 0).all()
        np.testing.assert_allclose(deq[1:], w[1:], rtol=1e-3, atol=1e-4)
        for bad in (np.full((1, 64), np.nan, np.float32), np.ones((1, 40), np.float32),
                    np.full((1, 32), 1e6, np.float32), np.ones(64, np.float32)):
            with pytest.raises(ValueError):
                quantize(bad)
