"""The f32 decode-batch LINEAR (cpullm_kernels.rows.batch_linear): its numpy reference, and a row's
result independent of the other rows of the batch (batch invariance)."""
import numpy as np

from cpullm_kernels.rows import batch_linear as bl

RNG = np.random.default_rng(28)


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
