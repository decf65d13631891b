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
