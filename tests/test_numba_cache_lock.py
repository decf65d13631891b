"""Two processes compiling different signatures of one cached numba function into one cache
directory at the same time (what a cold start's two compile processes do) leave a cache whose
every entry loads the right machine code (cpullm_kernels.setup.numba_cache_lock)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from cpullm_kernels.setup import numba_cache_lock

MODULE = textwrap.dedent('''
    from numba import njit

    @njit(cache=True)
    def describe(x):
        return x * 2 + 1
''')

COMPILE = textwrap.dedent('''
    import json, sys, time
    import cpullm_kernels                  # installs the cache lock
    import numpy as np
    from numba import types
    sys.path.insert(0, sys.argv[1])
    from numba.core.caching import IndexDataCacheFile
    slow_load = IndexDataCacheFile._load_index
    def _load_index(self):                 # widen the window between reading and writing the index
        overloads = slow_load(self)
        time.sleep(0.05)
        return overloads
    IndexDataCacheFile._load_index = _load_index
    import shared_kernel
    start = float(sys.argv[2])
    while time.time() < start:             # both processes begin together
        time.sleep(0.001)
    sigs = {"a": [types.int8, types.int16, types.int32, types.int64, types.uint8, types.uint16],
            "b": [types.float32, types.float64, types.uint32, types.uint64, types.complex64, types.complex128]}
    for t in sigs[sys.argv[3]]:
        shared_kernel.describe.compile((t,))
    print(json.dumps(len(shared_kernel.describe.signatures)))
''')

LOAD = textwrap.dedent('''
    import json, sys
    import cpullm_kernels
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    import shared_kernel
    values = [np.int8(3), np.int16(3), np.int32(3), np.int64(3), np.uint8(3), np.uint16(3),
              np.float32(3), np.float64(3), np.uint32(3), np.uint64(3), np.complex64(3), np.complex128(3)]
    out = [complex(shared_kernel.describe(v)).real for v in values]
    print(json.dumps({"out": out, "hits": sum(shared_kernel.describe.stats.cache_hits.values()),
                      "misses": sum(shared_kernel.describe.stats.cache_misses.values())}))
''')


def test_the_lock_is_installed_on_posix():
    assert numba_cache_lock.INSTALLED == (os.name == "posix")


@pytest.mark.cold
def test_two_processes_writing_one_cache_leave_every_entry_loadable(tmp_path):
    if not numba_cache_lock.INSTALLED:
        import pytest
        pytest.skip("no fcntl on this platform: the cold start keeps shared kernels in one process")
    src = tmp_path / "src"
    src.mkdir()
    (src / "shared_kernel.py").write_text(MODULE)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    start = time.time() + 3.0
    procs = [subprocess.Popen([sys.executable, "-c", COMPILE, str(src), str(start), side], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for side in ("a", "b")]
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-2000:]
    r = subprocess.run([sys.executable, "-c", LOAD, str(src)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["out"] == [7.0] * 12
    assert res["hits"] == 12 and res["misses"] == 0      # all twelve came from the shared cache
