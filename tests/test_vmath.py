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
