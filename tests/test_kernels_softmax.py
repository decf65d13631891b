"""The attention softmax (cpullm_kernels.attention.attention._softmax_rows, LLVM IR vectors)
against a numpy float32 reference that adds in the kernel's documented order: the max, then
exp(s - max) of every column, summed in 16 lanes over whole blocks of 16, the lanes in order,
then the last columns one by one. Equal to the bit, so prefill, decode and the batched decode
agree whatever the row length."""
import numba
import numpy as np
import pytest

from cpullm_kernels.attention import attention as att
from cpullm_kernels.ops import vmath


@numba.njit(fastmath=att._NO_REASSOC)
def _rows(scores, width, nq, c0, c1, softcap, mx, tot):
    att._softmax_rows(scores, width, nq, c0, c1, softcap, mx, tot)


def _exp(x):
    pad = np.zeros(-x.size % 16 + x.size, np.float32)
    pad[: x.size] = x
    out = np.empty_like(pad)
    vmath.exp_array_ir(pad, out)
    return out[: x.size]


def _reference_row(row):
    m = row.max()
    e = _exp(row - m)
    n16 = row.size // 16 * 16
    lanes = np.zeros(16, np.float32)
    for i in range(0, n16, 16):
        lanes += e[i: i + 16]
    total = np.float32(0.0)
    for v in list(lanes) + list(e[n16:]):
        total = np.float32(total + v)
    return e, m, total


@pytest.mark.parametrize("c0", [0, 5, 15])
@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 31, 32, 33, 100, 257])
def test_rows_match_the_reference_bit_for_bit(n, c0):
    nq, width = 3, (c0 + n + 15) // 16 * 16
    rng = np.random.default_rng(n * 31 + c0)
    scores = (rng.standard_normal(nq * width + 32) * 6).astype(np.float32)
    before = scores.copy()
    mx, tot = np.zeros(nq, np.float32), np.zeros(nq, np.float32)
    _rows(scores, width, nq, c0, c0 + n, 0.0, mx, tot)
    for j in range(nq):
        e, m, total = _reference_row(before[j * width + c0: j * width + c0 + n])
        got = scores[j * width + c0: j * width + c0 + n]
        assert np.array_equal(got.view(np.int32), e.view(np.int32))
        assert mx[j] == m and tot[j].view(np.int32) == total.view(np.int32)
        outside = np.r_[j * width: j * width + c0, j * width + c0 + n: (j + 1) * width]
        assert np.array_equal(scores[outside], before[outside]), "wrote outside its columns"


def test_softcap_then_softmax():
    n, cap = 45, 30.0
    scores = (np.random.default_rng(3).standard_normal(48) * 60).astype(np.float32)
    before = scores.copy()
    mx, tot = np.zeros(1, np.float32), np.zeros(1, np.float32)
    _rows(scores, 48, 1, 0, n, cap, mx, tot)
    capped = cap * np.tanh(before[:n].astype(np.float64) / cap)
    want = np.exp(capped - capped.max())
    np.testing.assert_allclose(scores[:n], want, rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(tot[0], want.sum(), rtol=1e-5)
    assert abs(mx[0] - capped.max()) < 1e-4
