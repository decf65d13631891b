"""Where the memory goes: packed weights, KV cache (now and at full context), linear-attention
state, activation arena, process peak RSS; and mlock for keeping weights resident."""
from __future__ import annotations

import ctypes
import ctypes.util
import resource
import sys

import numpy as np


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports KiB)."""
    ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(ru if sys.platform == "darwin" else ru * 1024)


def current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as fh:
            pages = int(fh.read().split()[1])
        return pages * resource.getpagesize()
    except OSError:
        return 0


def memory_report(model) -> dict:
    """Bytes by purpose, from the program's real arrays and state plan."""
    prog, ex = model.program, model.executor
    a = prog.arrays
    weights = int(a["wq"].nbytes + a["ws"].nbytes + a["wf"].nbytes)
    kv_max = linear = 0
    kv_now = 0
    for reg in prog.meta["state_regions"]:
        nbytes = reg["floats"] * 4
        if reg["kind"] == "kv":
            kv_max += nbytes
            used_rows = min(ex.n_past, reg["cap"])
            kv_now += 2 * reg["n_kv_heads"] * used_rows * reg["head_dim"] * 4
        else:
            linear += nbytes
    return {
        "weights_bytes": weights,
        "kv_bytes": kv_now,
        "kv_bytes_max": kv_max,
        "linear_state_bytes": linear,
        "arena_bytes": int(ex.arena.nbytes),
        "program_bytes": int(a["I"].nbytes + a["F"].nbytes),
        "peak_rss_bytes": peak_rss_bytes(),
        "rss_bytes": current_rss_bytes(),
    }


def mlock_arrays(arrays, warn) -> bool:
    """Lock the arrays' pages in RAM; warn (never fail) when the system limit refuses."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    ok = True
    for arr in arrays:
        arr = np.asarray(arr)
        if arr.nbytes == 0:
            continue
        addr = arr.__array_interface__["data"][0]
        if libc.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(arr.nbytes)) != 0:
            err = ctypes.get_errno()
            soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
            warn(f"mlock refused (errno {err}); weights may be swapped out. Raise the limit "
                 f"(ulimit -l, now {soft} bytes) or run without --mlock")
            ok = False
            break
    return ok
