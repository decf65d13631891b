"""INT8 (q8 block-32) linear kernels vs their numpy references, plus a codegen guard.

Sizes are deliberately odd: N not a multiple of anything, K not a multiple of 32, T = 1 and 37.
"""
import numba
import numpy as np
import pytest
from numba import njit

from cpullm.kernels import numba_setup, q8

RNG = np.random.default_rng(20240601)

NK = [(1, 1), (3, 31), (5, 32), (37, 33), (64, 100), (101, 896), (257, 1000)]
MATVECS = [q8._matvec_q8_generic] + ([q8._matvec_q8_avx2] if q8.HAVE_AVX2 else [])


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
    for hardware in (q8._HALF_IN_HARDWARE, not q8._HALF_IN_HARDWARE):
        monkeypatch.setattr(q8, "_HALF_IN_HARDWARE", hardware)

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


# ---- matvec ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kernel", MATVECS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("N,K", NK + [(1001, 4864)])
def test_matvec_q8_matches_reference(kernel, N, K):
    w_q, w_s = q8.quantize_weight_q8(_w(N, K))
    x_q, x_s = _q_act(RNG.standard_normal(K).astype(np.float32))
    out = np.full(N, np.nan, np.float32)
    kernel(w_q, w_s, x_q, x_s, out)
    ref = q8.matvec_q8_ref(w_q, w_s, x_q, x_s)
    terms = (np.abs(w_q.astype(np.float64) * np.repeat(q8.scale_values(w_s), 32, 1))
             @ np.abs(x_q * np.repeat(x_s, 32).astype(np.float64)))
    _close(out, ref, terms)


@njit
def _avx2_rows_routine(w_q, w_s, x_q, x_s, out):
    for n in range(w_q.shape[0]):
        out[n] = q8._q8_row_dot_avx2_rows(w_q, w_s, x_q, x_s, n)


@njit
def _generic_rows_routine(w_q, w_s, x_q, x_s, out):
    for n in range(w_q.shape[0]):
        out[n] = q8._q8_row_dot_generic_rows(w_q, w_s, x_q, x_s, n)


# every path through the row routine: groups of 8 blocks, a group of 4, a pair loop, an odd block
@pytest.mark.parametrize("nblocks", list(range(1, 22)) + [28, 152])
def test_matvec_q8_every_block_count_matches_reference_and_the_rows_variant(nblocks):
    N, K = 19, 32 * nblocks - (nblocks % 3)
    w_q, w_s = q8.quantize_weight_q8(_w(N, K))
    x_q, x_s = _q_act(RNG.standard_normal(K).astype(np.float32) * 3)
    ref = q8.matvec_q8_ref(w_q, w_s, x_q, x_s)
    terms = (np.abs(w_q.astype(np.float64) * np.repeat(q8.scale_values(w_s), 32, 1))
             @ np.abs(x_q * np.repeat(x_s, 32).astype(np.float64)))
    pairs = [(q8._matvec_q8_generic, _generic_rows_routine)]
    if q8.HAVE_AVX2:
        pairs.append((q8._matvec_q8_avx2, _avx2_rows_routine))
    for kernel, rows_routine in pairs:
        out, rows = np.full(N, np.nan, np.float32), np.full(N, np.nan, np.float32)
        kernel(w_q, w_s, x_q, x_s, out)
        _close(out, ref, terms)
        rows_routine(w_q, w_s, x_q, x_s, rows)
        # the head screen's exact rows must equal the matvec's logits bit for bit
        assert np.array_equal(out, rows), kernel.__name__


def test_matvec_q8_is_the_avx2_kernel_on_avx2_hosts():
    assert q8.matvec_q8 is (q8._matvec_q8_avx2 if q8.HAVE_AVX2 else q8._matvec_q8_generic)


def test_matvec_q8_extreme_values_do_not_overflow():
    # |w| = 127, |x| = 32767 everywhere: each int32 lane sums 4 products of 127 * 32767
    N, K = 9, 96
    w_q = np.full((N, K), 127, np.int8)
    w_q[:, 1::2] = -127
    w_q[1] = -w_q[1]
    w_q[2, :] = -127
    x_q = np.full(K, 32767, np.int16)
    x_q[1::2] = -32767
    w_s = np.full((N, K // 32), np.float16(1.0).view(np.uint16), np.uint16)
    x_s = np.ones(K // 32, np.float32)
    for kernel in MATVECS:
        out = np.zeros(N, np.float32)
        kernel(w_q, w_s, x_q, x_s, out)
        np.testing.assert_array_equal(out, q8.matvec_q8_ref(w_q, w_s, x_q, x_s).astype(np.float32))


@njit(cache=False)
def _interpreter_like(wq_flat, ws_flat, x, xq_buf, xs_buf, out, N, Kp, reps):
    # the interpreter pattern: a non-parallel njit function slicing flat buffers and calling
    # the (parallel) kernels
    w = wq_flat[:N * Kp].reshape(N, Kp)
    s = ws_flat[:N * (Kp // 32)].reshape(N, Kp // 32)
    for _ in range(reps):
        q8.quantize_act_q16(x, xq_buf[:Kp], xs_buf[:Kp // 32])
        q8.matvec_q8(w, s, xq_buf[:Kp], xs_buf[:Kp // 32], out)


def test_matvec_q8_from_a_serial_njit_caller_with_flat_buffers():
    N, K = 77, 300
    w_q, w_s = q8.quantize_weight_q8(_w(N, K))
    Kp = w_q.shape[1]
    wq_flat = np.concatenate([w_q.ravel(), np.zeros(100, np.int8)])
    ws_flat = np.concatenate([w_s.ravel(), np.zeros(10, np.uint16)])
    x = RNG.standard_normal(K).astype(np.float32)
    xq_buf = np.zeros(4096, np.int16)
    xs_buf = np.zeros(128, np.float32)
    out = np.zeros(N, np.float32)
    _interpreter_like(wq_flat, ws_flat, x, xq_buf, xs_buf, out, N, Kp, 2)
    x_q, x_s = q8.quantize_act_q16_ref(x)
    ref = q8.matvec_q8_ref(w_q, w_s, x_q, x_s)
    assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max()


def test_matvec_q8_rejects_bad_shapes():
    w_q, w_s = q8.quantize_weight_q8(_w(8, 64))
    x_q, x_s = _q_act(RNG.standard_normal(64).astype(np.float32))
    with pytest.raises(ValueError):
        q8.matvec_q8(w_q, w_s, x_q[:32], x_s[:1], np.zeros(8, np.float32))
    with pytest.raises(ValueError):
        q8.matvec_q8(w_q, w_s, x_q, x_s, np.zeros(7, np.float32))


@pytest.mark.parametrize("N,K", NK)
def test_matvec_f32_matches_reference(N, K):
    w = _w(N, K)
    x = RNG.standard_normal(K).astype(np.float32)
    out = np.full(N, np.nan, np.float32)
    q8.matvec_f32(w, x, out)
    _close(out, q8.matvec_f32_ref(w, x), np.abs(w).astype(np.float64) @ np.abs(x))


# ---- matmul (prefill) --------------------------------------------------------------------------

@pytest.mark.parametrize("T", [1, 37])
@pytest.mark.parametrize("N,K", [(1, 1), (37, 33), (101, 896), (1500, 900)])
def test_matmul_q8_sgemm_matches_reference(T, N, K):
    w_q, w_s = q8.quantize_weight_q8(_w(N, K))
    x = RNG.standard_normal((T, K)).astype(np.float32)
    out = np.full((T, N), np.nan, np.float32)
    q8.matmul_q8_sgemm(x, w_q, w_s, out)
    w = q8.dequantize_weight_q8_ref(w_q, w_s)[:, :K].astype(np.float64)
    _close(out, q8.matmul_q8_ref(x, w_q, w_s), np.abs(x) @ np.abs(w).T)


def test_matmul_q8_sgemm_equals_dequantized_sgemm_row_by_row():
    # the sgemm path's numerics are weights-only INT8: equal to the f32 path on dequantized weights
    N, K, T = 300, 200, 5
    w_q, w_s = q8.quantize_weight_q8(_w(N, K))
    x = RNG.standard_normal((T, K)).astype(np.float32)
    out = np.empty((T, N), np.float32)
    q8.matmul_q8_sgemm(x, w_q, w_s, out)
    out2 = np.empty((T, N), np.float32)
    q8.matmul_f32(x, np.ascontiguousarray(q8.dequantize_weight_q8(w_q, w_s)[:, :K]), out2)
    np.testing.assert_allclose(out, out2, rtol=1e-5, atol=1e-4)


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


def _matvec_args(N=64, K=256):
    w_q, w_s = q8.quantize_weight_q8(_w(N, K))
    x_q, x_s = _q_act(RNG.standard_normal(K).astype(np.float32))
    return w_q, w_s, x_q, x_s, np.zeros(N, np.float32)


@pytest.mark.skipif(not q8.HAVE_AVX2, reason="x86 AVX2 host only")
def test_matvec_q8_avx2_codegen_is_vectorized():
    import re

    asm = _fresh_asm(q8._matvec_q8_avx2, *_matvec_args())
    for insn in ("vpmovsxbw", "vpmaddwd", "vcvtdq2ps", "vcvtph2ps", "vfmadd", "prefetcht0"):
        assert insn in asm, f"{insn} missing: the q8 matvec lost its vector code"
    assert "ymm" in asm
    # rows of LONG_ROW_K or more prefetch their stream into L2 (q8.matvec_q8's docstring)
    assert "prefetcht1" in asm, "the long-row branch lost its L2 prefetch"
    if "f16c" in numba_setup.HOST_FEATURES:
        # the block scale reaches vcvtph2ps through vmovd, never vpinsrw (which merges into a
        # register LLVM picks, the FMA accumulator, and chains the blocks: q8._ir_half_to_float_fresh)
        assert "vpinsrw" not in asm and "vmovd" in asm
        # a group's 8 block factors are converted together (q8._define_row_dot)
        assert re.search(r"vcvtph2psx?\s+[^\n]*%ymm", asm), "block factors no longer converted 8 at a time"


@pytest.mark.skipif(not q8.HAVE_AVX2, reason="x86 AVX2 host only")
def test_other_kernels_codegen_is_vectorized():
    import re

    asm = _fresh_asm(q8._matvec_q8_generic, *_matvec_args())
    assert re.search(r"vpmulld|vpmaddwd", asm) and re.search(r"%[yz]mm", asm)
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
    from cpullm.kernels import numba_setup

    assert numba_setup.configured_threads() >= 1
    assert numba.get_num_threads() >= 1
