"""q8 block-32 quantization, the exact q8 reference product and the f32 reference kernels vs
their numpy references, plus a codegen guard. (The q8 LINEAR: tests/test_kernels_q8_panels.py.)

Sizes are deliberately odd: N not a multiple of anything, K not a multiple of 32, T = 1 and 37.
"""
import numba
import numpy as np
import pytest
from numba import njit

from cpullm_kernels.rows import q8

from cpullm_kernels.rows import llvm_ir

RNG = np.random.default_rng(20240601)

NK = [(1, 1), (3, 31), (5, 32), (37, 33), (64, 100), (101, 896), (257, 1000)]


def _w(N, K, scale=1.0):
    w = (RNG.standard_normal((N, K)) * scale).astype(np.float32)
    if N > 2 and K > 40:
        w[1, :40] = 0.0                      # all-zero block: scale 0
        w[2, 5] = 50.0                       # outlier
    return w


def _q_act(x):
    Kp = q8.padded_k(x.size)
    x_q = np.full(Kp, 99, np.int16)          # garbage: padding must be overwritten
    x_s = np.full(Kp // 32, 99.0, np.float32)
    q8.quantize_act_q16(x, x_q, x_s)
    return x_q, x_s


def _close(got, ref, terms):
    """float32 accumulation error bound: relative to the sum of absolute terms."""
    tol = 1e-5 * (np.abs(terms).max() + 1e-30)
    assert np.abs(got.astype(np.float64) - ref).max() <= tol


# ---- quantization ------------------------------------------------------------------------------

@pytest.mark.parametrize("N,K", NK)
def test_quantize_weight_matches_reference_exactly(N, K):
    w = _w(N, K)
    w_q, w_s = q8.quantize_weight_q8(w)
    r_q, r_s = q8.quantize_weight_q8_ref(w)
    Kp = q8.padded_k(K)
    assert w_q.shape == (N, Kp) and w_q.dtype == np.int8 and w_q.flags.c_contiguous
    assert w_s.shape == (N, Kp // 32) and w_s.dtype == np.uint16
    np.testing.assert_array_equal(w_q, r_q)
    np.testing.assert_array_equal(w_s, r_s)
    assert np.abs(w_q.astype(np.int32)).max() <= 127
    assert (w_q[:, K:] == 0).all()
    # round-trip error is at most half a quantization step
    deq = q8.dequantize_weight_q8(w_q, w_s)[:, :K]
    step = np.repeat(q8.scale_values(w_s), 32, axis=1)[:, :K]
    assert (np.abs(deq - w) <= 0.5 * step * (1 + 1e-5) + 1e-30).all()


def test_quantize_rounds_half_to_even():
    v = np.zeros((1, 32), np.float32)
    v[0, :5] = [127.0, 2.5, 3.5, -2.5, 0.5]   # scale exactly 1
    w_q, w_s = q8.quantize_weight_q8(v)
    assert q8.scale_values(w_s)[0, 0] == 1.0
    assert list(w_q[0, :5]) == [127, 2, 4, -2, 0]
    np.testing.assert_array_equal(w_q, q8.quantize_weight_q8_ref(v)[0])


@pytest.mark.parametrize("amax", [127.0, 1.0, 3e-3, 1e-6, 0.1234567, 2.0 ** -14 * 127 * 0.999])
def test_weight_scales_are_binary16_rounded_up(amax):
    # the stored scale is the smallest binary16 >= amax / 127 (normal and subnormal range): the
    # largest value still quantizes to |q| <= 127 and is reproduced within half a step
    v = np.linspace(-amax, amax, 64, dtype=np.float32).reshape(1, 64)
    w_q, w_s = q8.quantize_weight_q8(v)
    d = q8.scale_values(w_s)[0]
    exact = np.float32(amax) / np.float32(127.0)
    h = np.float16(exact)
    want = h if np.float32(h) >= exact else np.nextafter(h, np.float16(np.inf))
    assert (d == np.float32(want)).all() and (d >= exact).all()
    assert np.abs(w_q.astype(np.int32)).max() <= 127
    deq = q8.dequantize_weight_q8(w_q, w_s)
    assert (np.abs(deq - v) <= 0.5 * d.max() * (1 + 1e-6)).all()


def test_half_to_float_matches_numpy_for_every_finite_bit_pattern(monkeypatch):
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    bits = bits[np.isfinite(bits.view(np.float16))]
    want = bits.view(np.float16).astype(np.float32)
    # the path this host uses, and the integer-IR path of hosts without F16C (chosen at codegen)
    for hardware in (llvm_ir.HALF_IN_HARDWARE, not llvm_ir.HALF_IN_HARDWARE):
        monkeypatch.setattr(llvm_ir, "HALF_IN_HARDWARE", hardware)

        @njit(cache=False)
        def convert(b, out):
            for i in range(b.size):
                out[i] = q8.half_to_float(b[i])
        got = np.empty(bits.size, np.float32)
        convert(bits, got)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_quantize_weight_accepts_other_float_dtypes():
    w = _w(7, 70).astype(np.float16)
    np.testing.assert_array_equal(q8.quantize_weight_q8(w)[0], q8.quantize_weight_q8_ref(w.astype(np.float32))[0])


@pytest.mark.parametrize("N,K", NK)
def test_dequantize_matches_reference(N, K):
    w_q, w_s = q8.quantize_weight_q8(_w(N, K))
    np.testing.assert_array_equal(q8.dequantize_weight_q8(w_q, w_s), q8.dequantize_weight_q8_ref(w_q, w_s))


@pytest.mark.parametrize("K", [1, 31, 32, 33, 100, 896, 4864])
def test_quantize_act_matches_reference_and_pads(K):
    x = RNG.standard_normal(K).astype(np.float32) * 3
    x_q, x_s = _q_act(x)
    r_q, r_s = q8.quantize_act_q16_ref(x)
    np.testing.assert_array_equal(x_q, r_q)
    np.testing.assert_array_equal(x_s, r_s)
    assert (x_q[K:] == 0).all() and np.abs(x_q.astype(np.int32)).max() == 32767
    # int16 blocks: every value within half a step of 1/32767 of its block's largest value
    step = np.repeat(x_s, 32)[:K].astype(np.float64)
    assert (np.abs(x_q[:K] * step - x) <= 0.501 * step).all()


def test_quantize_act_extra_padding_blocks_are_zero():
    x = RNG.standard_normal(40).astype(np.float32)
    x_q = np.full(128, 7, np.int16)
    x_s = np.full(4, 7.0, np.float32)
    q8.quantize_act_q16(x, x_q, x_s)
    r_q, r_s = q8.quantize_act_q16_ref(x, 128)
    np.testing.assert_array_equal(x_q, r_q)
    np.testing.assert_array_equal(x_s, r_s)
    assert (x_s[2:] == 0).all()


def test_quantize_act_rejects_bad_shapes():
    with pytest.raises(ValueError):
        q8.quantize_act_q16(np.zeros(40, np.float32), np.zeros(32, np.int16), np.zeros(1, np.float32))


# ---- matrix-vector products --------------------------------------------------------------------

@pytest.mark.parametrize("N,K", NK)
def test_matvec_q8_ref_is_the_product_of_the_dequantized_operands(N, K):
    # the reference every integer q8 kernel is checked against: exact block sums, then the scales
    w_q, w_s = q8.quantize_weight_q8(_w(N, K))
    x_q, x_s = _q_act(RNG.standard_normal(K).astype(np.float32))
    w = q8.dequantize_weight_q8_ref(w_q, w_s).astype(np.float64)
    x = x_q.astype(np.float64) * np.repeat(x_s, 32).astype(np.float64)
    ref = q8.matvec_q8_ref(w_q, w_s, x_q, x_s)
    np.testing.assert_allclose(ref, w @ x, rtol=1e-12, atol=1e-12 * (np.abs(w) @ np.abs(x)).max())


@pytest.mark.parametrize("N,K", NK)
def test_matvec_f32_matches_reference(N, K):
    w = _w(N, K)
    x = RNG.standard_normal(K).astype(np.float32)
    out = np.full(N, np.nan, np.float32)
    q8.matvec_f32(w, x, out)
    _close(out, q8.matvec_f32_ref(w, x), np.abs(w).astype(np.float64) @ np.abs(x))


# ---- matmul (f32 prefill) ----------------------------------------------------------------------

@pytest.mark.parametrize("T", [1, 37])
@pytest.mark.parametrize("N,K", [(1, 1), (37, 33), (101, 896)])
def test_matmul_f32_matches_reference(T, N, K):
    w = _w(N, K)
    x = RNG.standard_normal((T, K)).astype(np.float32)
    out = np.full((T, N), np.nan, np.float32)
    q8.matmul_f32(x, w, out)
    _close(out, q8.matmul_f32_ref(x, w), np.abs(x) @ np.abs(w).T.astype(np.float64))


# ---- codegen guard -----------------------------------------------------------------------------

def _fresh_asm(dispatcher, *args):
    """Assembly of a dispatcher's function, compiled afresh (numba cannot inspect cached code)."""
    fresh = numba.njit(**{k: v for k, v in dispatcher.targetoptions.items() if k != "nopython"})(dispatcher.py_func)
    fresh(*args)
    return fresh.inspect_asm(fresh.signatures[0])


@pytest.mark.skipif(not q8.HAVE_AVX2, reason="x86 AVX2 host only")
def test_quantize_and_f32_codegen_is_vectorized():
    import re

    x = RNG.standard_normal(256).astype(np.float32)
    asm = _fresh_asm(q8.quantize_act_q16, x, np.zeros(256, np.int16), np.zeros(8, np.float32))
    # 8 or 16 lanes (AVX2 / AVX-512 hosts; AVX-512 rounds with vrndscaleps)
    assert re.search(r"(vroundps|vrndscaleps)\s+\$4, %[yz]mm", asm), "activation quantization scalarized"
    assert (re.search(r"vmaxps\s+%[yz]mm", asm)
            or re.search(r"vcmpltps\s+%[yz]mm|vcmpgtps\s+%[yz]mm|vblendvps\s+%ymm|vblendmps\s+%zmm", asm))
    w = RNG.standard_normal((64, 256)).astype(np.float32)
    asm = _fresh_asm(q8.matvec_f32, w, x, np.zeros(64, np.float32))
    assert re.search(r"vfmadd\w+ps\s+[^\n]*%[yz]mm", asm), "f32 matvec scalarized"


def test_numba_setup_applied():
    from cpullm_kernels.setup import numba_setup

    assert numba_setup.configured_threads() >= 1
    assert numba.get_num_threads() >= 1
