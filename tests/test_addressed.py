"""Calls through a kernel's address (cpullm_kernels.setup.addressed): the same results and errors
as a linked call, bound on first use or ahead of time, from a parallel kernel after ``ensure``,
and from a caller loaded from numba's cache in a new process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

_MODULE = textwrap.dedent('''
    import numpy as np
    from numba import njit, prange, types
    from cpullm_kernels.setup.addressed import Addressed

    F32 = types.Array(types.float32, 1, "C")

    @njit(cache=True)
    def scaled_sum(x, out, k):
        if k < 0:
            raise ValueError("scaled_sum: k must be >= 0")
        s = 0.0
        for i in range(x.shape[0]):
            out[i] = x[i] * k
            s += out[i]
        return s

    SCALED_SUM = Addressed(scaled_sum, types.float64, [(F32, F32, types.int64), (F32, F32, types.float64)])
    scaled_sum_at, scaled_sum_ready = SCALED_SUM.call, SCALED_SUM.ensure

    @njit(cache=True)
    def linked(x, out, k):
        return scaled_sum(x, out, k) + scaled_sum(x, out, k + 1)

    @njit(cache=True)
    def by_address(x, out, k):
        return scaled_sum_at(x, out, k) + scaled_sum_at(x, out, k + 1)

    @njit(cache=True, parallel=True)
    def parallel_rows(x, out, n):
        scaled_sum_ready(x, out, np.int64(0))          # bind here, not in a worker thread
        tot = np.zeros(n)
        for r in prange(n):
            tot[r] = scaled_sum_at(x[r * 4: r * 4 + 4], out[r * 4: r * 4 + 4], np.int64(r))
        return tot.sum()
''')

_RUN = textwrap.dedent('''
    import json, sys
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    import addressed_demo as m
    from numba import types
    x = np.arange(12, dtype=np.float32)
    out = np.zeros(12, np.float32)
    res = {"linked": m.linked(x, out, 2), "by_address": m.by_address(x, out, 2),
           "literal_float": m.by_address(x, out, np.float32(2.0)),
           "parallel": m.parallel_rows(x, out, 3),
           "cached_callers": sorted(str(k) for k in m.by_address.stats.cache_hits)}
    try:
        m.by_address(x, out, -5)
    except ValueError as e:
        res["error"] = str(e)
    print(json.dumps(res))
''')


def _run(tmp_path, cache):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache))
    r = subprocess.run([sys.executable, "-c", _RUN, str(tmp_path)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_call_through_the_address_is_the_linked_call(tmp_path):
    (tmp_path / "addressed_demo.py").write_text(_MODULE)
    cache = tmp_path / "numba-cache"
    first = _run(tmp_path, cache)
    assert first["by_address"] == first["linked"] == sum(range(12)) * 2 + sum(range(12)) * 3
    assert first["literal_float"] == sum(range(12)) * 2.0 + sum(range(12)) * 3.0
    assert first["parallel"] == sum(sum(range(r * 4, r * 4 + 4)) * r for r in range(3))
    assert first["error"] == "scaled_sum: k must be >= 0"          # the callee's exception, as linked
    assert first["cached_callers"] == []
    again = _run(tmp_path, cache)                                  # every caller loaded from the cache
    assert again["cached_callers"] and {k: again[k] for k in first if k != "cached_callers"} == {
        k: first[k] for k in first if k != "cached_callers"}


def test_only_declared_signatures_type():
    import numpy as np
    from numba import njit, types
    from numba.core.errors import TypingError
    from cpullm_kernels.setup.addressed import Addressed

    @njit
    def twice(x):
        return x * 2

    TWICE = Addressed(twice, types.int64, [(types.int64,)])
    twice_at = TWICE.call

    @njit
    def caller(x):
        return twice_at(x)

    assert caller(np.int32(4)) == 8                     # int32 widens to the declared int64
    with pytest.raises(TypingError, match="not one of its declared signatures"):
        caller(1.5)
    with pytest.raises(ValueError, match="declared twice"):
        Addressed(twice, types.int64, [(types.int64,), (types.int64,)])
    assert TWICE.bound((types.int64,))                  # bound by the first call
