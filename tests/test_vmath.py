"""exp_f32 / tanh_f32 (cpullm_kernels.ops.vmath) against numpy in float64, and their codegen."""
import re

import numba
import numpy as np
import pytest

from cpullm_kernels.rows import q8
from cpullm_kernels.ops import vmath


def test_exp_f32_relative_error_over_the_whole_range():
    x = np.linspace(-87.33, 88.37, 2_000_001, dtype=np.float32)
    x = np.concatenate([x, np.float32([0.0, -0.0, 1e-30, -1e-30, 0.5, -0.5, 1.0, -1.0, 10.0, -10.0])])
    got = np.empty_like(x)
    vmath.exp_array(x, got)
    ref = np.exp(x.astype(np.float64))
    assert (np.abs(got - ref) / ref).max() < 4e-7


def test_exp_f32_clamps_outside_the_range():
    x = np.float32([-1e4, -200.0, -88.0, 89.0, 200.0, 1e4])
    got = np.empty_like(x)
    vmath.exp_array(x, got)
    assert np.isfinite(got).all()
    assert (got[:3] < 1.2e-38).all() and (got[:3] >= 0).all()
    assert (got[3:] > 2e38).all()


def test_tanh_f32_absolute_error():
    x = np.concatenate([np.linspace(-30, 30, 600_001, dtype=np.float32), np.float32([0.0, 1e-6, -1e-6])])
    got = np.empty_like(x)
    vmath.tanh_array(x, got)
    assert np.abs(got - np.tanh(x.astype(np.float64))).max() < 3e-7
    assert (np.abs(got) <= 1.0).all()


@pytest.mark.skipif(not q8.HAVE_AVX2, reason="x86 AVX2 host only")
@pytest.mark.parametrize("kernel", [vmath.exp_array, vmath.tanh_array], ids=lambda f: f.__name__)
def test_loops_over_them_vectorize(kernel):
    x = np.linspace(-5, 5, 256, dtype=np.float32)
    fresh = numba.njit(**{k: v for k, v in kernel.targetoptions.items() if k != "nopython"})(kernel.py_func)
    fresh(x, np.empty_like(x))
    asm = fresh.inspect_asm(fresh.signatures[0])
    assert re.search(r"vfmadd\w+ps\s+[^\n]*%[yz]mm", asm), "exp polynomial not vectorized"   # 8 or 16 lanes
    assert "expf" not in asm and "tanhf" not in asm


def _x_over_every_range():
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.uniform(-120, 120, 1 << 18), rng.standard_normal(1 << 18) * 4,
                        [0.0, -0.0, 1e-30, -1e-30, 0.5, -0.5, 88.376, 88.38, -87.336, -87.34, np.inf, -np.inf]])
    return np.concatenate([x, np.zeros(-x.size % 16)]).astype(np.float32)


def test_exp_f32_ir_is_exp_f32_bit_for_bit():
    """The IR form (vectors in the attention softmax) against exp_f32 in a numba loop compiled with
    the attention kernels' flags, which is what it replaced there."""
    from cpullm_kernels.attention.attention import _NO_REASSOC

    @numba.njit(fastmath=_NO_REASSOC)
    def loop(x, out):
        for i in range(x.size):
            out[i] = vmath.exp_f32(x[i])
    x = _x_over_every_range()
    want, got = np.empty_like(x), np.empty_like(x)
    loop(x, want)
    vmath.exp_array_ir(x, got)
    assert np.array_equal(want.view(np.int32), got.view(np.int32))


def test_tanh_f32_ir_absolute_error():
    x = np.concatenate([np.linspace(-30, 30, 600_000, dtype=np.float32), np.float32([0.0, 1e-6, -1e-6, 5.0] + [0.0] * 12)])
    got = np.empty_like(x)
    vmath.tanh_array_ir(x, got)
    assert np.abs(got - np.tanh(x.astype(np.float64))).max() < 3e-7
    assert (np.abs(got) <= 1.0).all()
