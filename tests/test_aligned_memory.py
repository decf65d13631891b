"""The memory the kernels load in 64-byte vectors starts on a 64-byte boundary: numpy's own
arrays of 128 KiB and more start 16 bytes into a page, so each such load straddled two cache
lines (cpullm.compile.aligned)."""
import numpy as np
import pytest

import cpullm
from cpullm.compile.aligned import aligned_zeros
from cpullm.run.executor import lazy_zeros
from cpullm.testing import make_random_checkpoint


@pytest.mark.parametrize("shape", [1, 17, 1 << 16, 1 << 20, (3, 40000), (2, 1 << 18)])
@pytest.mark.parametrize("dtype", [np.float32, np.int16, np.int64])
def test_aligned_zeros(shape, dtype):
    a = aligned_zeros(shape, dtype)
    assert a.ctypes.data % 64 == 0
    assert a.shape == ((shape,) if np.isscalar(shape) else shape) and a.dtype == dtype
    assert a.flags.c_contiguous and a.flags.writeable and not a.any()


@pytest.mark.parametrize("use_cache", [False, True])
def test_a_loaded_model_runs_on_aligned_memory(tmp_path, use_cache, monkeypatch):
    d = make_random_checkpoint(dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                    max_position_embeddings=512), tmp_path / "m", seed=1)
    monkeypatch.setenv("CPULLM_CACHE_DIR", str(tmp_path / "cache"))
    m = cpullm.load(d, use_cache=use_cache)
    ex = m.executor
    for name in ("arena", "xq", "xs", "wq", "ws", "wf"):
        assert getattr(ex, name).ctypes.data % 64 == 0, name
    table = m.forward.slots(3)[0].table
    assert table.ctypes.data % 64 == 0 and table.strides[0] % 64 == 0
    assert lazy_zeros(1000).ctypes.data % 64 == 0
