"""Decode-batch LINEAR kernels: numpy references, and bit-identity with one-row decode (the basis
of batch invariance: a row's result may not depend on the other rows of the batch)."""
import numpy as np
import pytest

from cpullm.kernels import batch_linear as bl
from cpullm.kernels import q8

RNG = np.random.default_rng(28)
SHAPES = [(5, 33), (37, 100), (101, 896), (9, 4864)]       # the last: long rows (LONG_ROW_K)


def _scratch(B, Kp):
    return np.zeros((B, Kp), np.int16), np.zeros((B, Kp // 32), np.float32)


@pytest.mark.parametrize("N,K", SHAPES)
def test_linear_rows_q8_matches_reference(N, K):
    w_q, w_s = q8.quantize_weight_q8(RNG.standard_normal((N, K)).astype(np.float32))
    x = RNG.standard_normal((6, K)).astype(np.float32)
    out = np.zeros((6, N), np.float32)
    bl.linear_rows_q8(x, w_q, w_s, out, *_scratch(8, w_q.shape[1]))
    ref = bl.linear_rows_q8_ref(x, w_q, w_s)
    assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max()


@pytest.mark.parametrize("N,K", SHAPES)
def test_linear_rows_q8_row_equals_decode_matvec_whatever_the_batch(N, K):
    w_q, w_s = q8.quantize_weight_q8(RNG.standard_normal((N, K)).astype(np.float32))
    Kp = w_q.shape[1]
    x = RNG.standard_normal((7, K)).astype(np.float32) * np.arange(1, 8, dtype=np.float32)[:, None]
    xq, xs = np.zeros(Kp, np.int16), np.zeros(Kp // 32, np.float32)
    for B in (1, 3, 7):
        out = np.zeros((B, N), np.float32)
        bl.linear_rows_q8(x[:B], w_q, w_s, out, *_scratch(B, Kp))
        for t in range(B):
            one = np.zeros(N, np.float32)
            q8.quantize_act_q16(x[t], xq, xs)
            q8.matvec_q8(w_q, w_s, xq, xs, one)
            np.testing.assert_array_equal(out[t], one)


def test_linear_rows_f32_reference_and_row_independence():
    w = RNG.standard_normal((37, 100)).astype(np.float32)
    x = RNG.standard_normal((5, 100)).astype(np.float32)
    full = np.zeros((5, 37), np.float32)
    bl.linear_rows_f32(x, w, full)
    assert np.abs(full - bl.linear_rows_f32_ref(x, w)).max() <= 1e-4
    for t in range(5):
        one = np.zeros((1, 37), np.float32)
        bl.linear_rows_f32(x[t:t + 1], w, one)
        np.testing.assert_array_equal(one[0], full[t])


def test_linear_rows_q8_rejects_bad_shapes():
    w_q, w_s = q8.quantize_weight_q8(np.ones((4, 32), np.float32))
    with pytest.raises(ValueError):
        bl.linear_rows_q8(np.ones((2, 32), np.float32), w_q, w_s, np.zeros((2, 5), np.float32), *_scratch(2, 32))


# ---- the multi-row kernels of every ISA this CPU runs, against the one-row decode of the same ----
# ISA family (the generic routine sums other lanes than the x86 ones, so it has its own matvec)

ISA_PARAMS = [pytest.param(isa, id=isa) for isa in bl.ROWS_Q8_KERNELS]
ONE_ROW_MATVEC = {"generic": q8._matvec_q8_generic, "avx2": q8._matvec_q8_avx2, "vnni": q8._matvec_q8_avx2}
# awkward shapes: K not a multiple of 32, an odd block count, fewer than 4 / 8 blocks, more than one
# factor chunk (bl.FACTOR_CHUNK) with an odd tail, long rows (the L2-prefetch branch)
ROW_SHAPES = [(3, 20), (7, 96), (11, 160), (23, 900), (5, 32 * (bl.FACTOR_CHUNK + 1) + 7), (6, 4864)]
BATCHES = [1, 2, 3, 5, 8, 9, 13, 16]          # every tile count and tile size up to 2 x 8


def _quantized_batch(B, K, Kp):
    x = RNG.standard_normal((B, K)).astype(np.float32) * RNG.uniform(0.01, 50, (B, 1)).astype(np.float32)
    x_q, x_s = _scratch(B, Kp)
    bl._quantize_rows(x, x_q, x_s)
    return x, x_q, x_s


@pytest.mark.parametrize("isa", ISA_PARAMS)
@pytest.mark.parametrize("N,K", ROW_SHAPES)
def test_multi_row_kernel_equals_one_row_decode_bit_for_bit(isa, N, K):
    w_q, w_s = q8.quantize_weight_q8(RNG.standard_normal((N, K)).astype(np.float32))
    Kp = w_q.shape[1]
    for B in BATCHES:
        _, x_q, x_s = _quantized_batch(B, K, Kp)
        wide = np.full((B, N + 5), np.nan, np.float32)      # out as a strided view, as core/batch.py passes it
        bl.ROWS_Q8_KERNELS[isa](w_q, w_s, x_q, x_s, wide[:, 2:N + 2])
        assert np.isnan(wide[:, :2]).all() and np.isnan(wide[:, N + 2:]).all()
        for t in range(B):
            one = np.zeros(N, np.float32)
            ONE_ROW_MATVEC[isa](w_q, w_s, x_q[t], x_s[t], one)
            np.testing.assert_array_equal(wide[t, 2:N + 2], one, err_msg=f"{isa} B={B} row {t}")


@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_multi_row_kernel_matches_numpy_reference(isa):
    N, K = 29, 4900
    w_q, w_s = q8.quantize_weight_q8(RNG.standard_normal((N, K)).astype(np.float32))
    x, x_q, x_s = _quantized_batch(11, K, w_q.shape[1])
    out = np.zeros((11, N), np.float32)
    bl.ROWS_Q8_KERNELS[isa](w_q, w_s, x_q, x_s, out)
    ref = bl.linear_rows_q8_ref(x, w_q, w_s)
    assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max()


def test_linear_rows_q8_uses_the_best_multi_row_kernel():
    assert bl._rows_q8 is bl.ROWS_Q8_KERNELS[bl.ROWS_Q8_ISA]
    assert bl.ROWS_Q8_ISA == ("vnni" if bl.HAVE_VNNI else "avx2" if q8.HAVE_AVX2 else "generic")
    if q8.HAVE_AVX2:
        assert "avx2" in bl.ROWS_Q8_KERNELS


@pytest.mark.skipif(not bl.HAVE_VNNI, reason="AVX-512 VNNI host only")
def test_vnni_multi_row_codegen():
    import numba
    k = bl._rows_q8_vnni
    fresh = numba.njit(**{o: v for o, v in k.targetoptions.items() if o != "nopython"})(k.py_func)
    w_q, w_s = q8.quantize_weight_q8(RNG.standard_normal((16, 256)).astype(np.float32))
    _, x_q, x_s = _quantized_batch(8, 256, 256)
    fresh(w_q, w_s, x_q, x_s, np.zeros((8, 16), np.float32))
    asm = fresh.inspect_asm(fresh.signatures[0])
    for insn in ("vpdpwssd", "vpmaddwd", "vpmovsxbw", "vcvtdq2ps", "prefetcht0", "prefetcht1"):
        assert insn in asm, f"{insn} missing from the VNNI multi-row kernel"
    # each FMA takes its block factor as an embedded broadcast from the factor buffer (no shuffle
    # per (row, block)), and no scale reaches vcvtph2ps through a merging vpinsrw
    assert "{1to8}" in asm and "vpinsrw" not in asm
