"""GGUF block formats: the numpy reference dequantizers against the gguf package's own (an
independent implementation), on random blocks and awkward shapes."""
import numpy as np
import pytest

from cpullm_kernels.rows import gguf_blocks as gb

gguf_quants = pytest.importorskip("gguf.quants", reason="the gguf package is the independent oracle")
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402

RNG = np.random.default_rng(20261203)
FORMATS = list(gb.FORMATS)


def _shapes(fmt):
    W = gb.FORMATS[fmt].block_weights
    return [(1, W), (3, W), (1, 7 * W), (5, 3 * W), (2, 8192 if W == 32 else 8192 + 256)]


@pytest.mark.parametrize("name", FORMATS)
def test_sizes_match_ggml(name):
    f = gb.FORMATS[name]
    qtype = GGMLQuantizationType[name]
    assert f.ggml_type == int(qtype)
    assert GGML_QUANT_SIZES[qtype] == (f.block_weights, f.block_bytes)
    assert gb.block_format(f.ggml_type) is f and gb.block_format(name) is f


@pytest.mark.parametrize("name", FORMATS)
def test_reference_dequantizer_equals_gguf_package(name):
    qtype = GGMLQuantizationType[name]
    for N, K in _shapes(name):
        raw = gb.random_blocks(name, N, K, RNG)
        got = gb.dequantize_ref(raw, name, (N, K))
        want = gguf_quants.dequantize(raw, qtype)
        assert got.shape == (N, K) and got.dtype == np.float32
        assert want.shape == (N, K)
        assert np.isfinite(got).all()
        # both evaluate the same float32 products; allow one rounding of difference in order
        np.testing.assert_allclose(got, want, rtol=2e-7, atol=0)


@pytest.mark.parametrize("name", FORMATS)
def test_every_quant_value_is_reached(name):
    # all-ones scales, every byte value once: the dequantized values must cover the whole
    # quant range (a wrong shift or mask would miss values)
    f = gb.FORMATS[name]
    nblocks = 256
    raw = gb.random_blocks(name, nblocks, f.block_weights, RNG)
    want = gguf_quants.dequantize(raw, GGMLQuantizationType[name])
    np.testing.assert_allclose(gb.dequantize_ref(raw, name, raw.shape[:1] + (f.block_weights,)), want,
                               rtol=2e-7, atol=0)


def test_k_scales_mins_unpacks_six_bits():
    # sub-block 5's scale: low 4 bits from byte 9, top 2 from byte 1; its min: byte 9's high
    # nibble and byte 5's top 2 bits
    s = np.zeros((1, 12), np.uint8)
    s[0, 1] = 0b11_000000
    s[0, 5] = 0b10_000001
    s[0, 9] = 0b0110_1010
    sc, mn = gb.k_scales_mins(s)
    assert sc[0, 5] == 0b11_1010 and mn[0, 5] == 0b10_0110
    assert sc[0, 1] == 0 and mn[0, 1] == 1


def test_dequantize_ref_rejects_wrong_sizes():
    raw = gb.random_blocks("Q4_K", 2, 256, RNG)
    with pytest.raises(ValueError):
        gb.dequantize_ref(raw[:, :-1], "Q4_K", (2, 256))
    with pytest.raises(ValueError):
        gb.dequantize_ref(raw, "Q4_K", (1, 300))
    with pytest.raises(ValueError):
        gb.block_format("Q2_K")
