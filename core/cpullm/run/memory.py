"""Where the memory goes: packed weights, KV cache (now and at full context), per-layer state,
activation arena, process RSS; and mlock for keeping the weights resident."""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap as _mmap
import resource
import sys

import numpy as np


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def peak_rss_bytes() -> int:
    """Peak resident set size of this process: VmHWM where /proc has it (getrusage's maxrss lags
    the current RSS on Linux), else ru_maxrss (Linux reports KiB, macOS bytes)."""
    hwm = _status_kib("VmHWM")
    if hwm is not None:
        return max(hwm, current_rss_bytes())
    ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return max(int(ru if sys.platform == "darwin" else ru * 1024), current_rss_bytes())


def current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as fh:
            pages = int(fh.read().split()[1])
        return pages * resource.getpagesize()
    except OSError:
        return 0


def locked_bytes() -> int:
    """Bytes this process has locked in RAM (VmLck), 0 where unknown."""
    return _status_kib("VmLck") or 0


def is_mapped(arr) -> bool:
    """Whether the array's memory is a file mapping (the execution cache, mmapped)."""
    base = arr
    while base is not None:
        if isinstance(base, (np.memmap, _mmap.mmap)):
            return True
        base = getattr(base, "base", None)
    return False


def _layer_kind(reg: dict) -> str:
    if reg["kind"] != "kv":
        return "linear_attention"
    return "sliding_window" if reg.get("window") else "full_attention"


def _screen_bytes(program) -> int:
    sc = program.meta.get("head_screen")
    if not sc:
        return 0
    n = int(program.meta["vocab"])
    return n * (int(sc["q_cols"]) + 2 * int(sc["s_cols"]) + 12)


def memory_report(model) -> dict:
    """Bytes by purpose, from the program's real arrays and its state plan.

    weights_bytes       packed weights as the kernels read them (wq int8, ws scales, wf float32)
    head_screen_bytes   the part of weights_bytes that is greedy decoding's lm_head screen
    program_bytes       instruction tables (I, F)
    kv_bytes            keys and values the lone sequence (generate) holds now (its positions,
                        capped by each ring)
    kv_dtype            their storage format, "f16", "f32" or "q8_0" (cpullm.compile.kvformat)
    kv_bytes_max        keys and values at the full context (rings at their capacity)
    linear_state_bytes  fixed-size linear-attention states (conv history + recurrent state)
    state_bytes         the whole state array (KV caches + linear states + alignment)
    layers              per layer: kind, bytes allocated, bytes in use now
    arena_bytes         activation arena (every intermediate of a prefill chunk)
    rss / peak_rss / locked bytes of the process
    """
    from ..compile.kvformat import position_bytes
    prog, ex = model.program, model.executor
    position = model.slot.position          # the lone sequence's (generate's) tokens held now
    a = prog.arrays
    weights = int(a["wq"].nbytes + a["ws"].nbytes + a["wf"].nbytes)
    kv_now = kv_max = linear = 0
    layers = []
    for reg in prog.meta["state_regions"]:
        nbytes = int(reg["floats"]) * 4
        if reg["kind"] == "kv":
            rows = min(position, reg["cap"])
            now = rows * position_bytes(reg)
            kv_max += nbytes
            kv_now += now
        else:
            now = nbytes
            linear += nbytes
        layers.append({"layer": reg.get("layer"), "node": reg["node"], "kind": _layer_kind(reg),
                       "bytes": nbytes, "bytes_now": now})
    program = int(a["I"].nbytes + a["F"].nbytes)
    arena, state = int(ex.arena.nbytes), int(model.forward.state_floats) * 4
    return {
        "weights_bytes": weights,
        "weights_mapped": is_mapped(a["wq"]),
        "head_screen_bytes": _screen_bytes(prog),
        "program_bytes": program,
        "kv_bytes": kv_now,
        "kv_bytes_max": kv_max,
        "kv_dtype": prog.meta.get("kv_dtype", "f32"),
        "linear_state_bytes": linear,
        "state_bytes": state,
        "arena_bytes": arena,
        "scratch_bytes": int(ex.xq.nbytes + ex.xs.nbytes + ex.tokens.nbytes + ex.rt.nbytes),
        "total_bytes": weights + program + state + arena,
        "n_past": int(position),
        "n_ctx": int(ex.n_ctx),
        "layers": layers,
        "rss_bytes": current_rss_bytes(),
        "peak_rss_bytes": peak_rss_bytes(),
        "locked_bytes": locked_bytes(),
    }


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def mlock_arrays(arrays, warn) -> bool:
    """Lock the arrays' pages in RAM (mapped or not). When the system refuses (RLIMIT_MEMLOCK,
    no privilege), undo the partial lock, warn once with the fix, and return False; never raise."""
    arrays = [np.asarray(a) for a in arrays if np.asarray(a).nbytes]
    total = sum(a.nbytes for a in arrays)
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        mlock, munlock = libc.mlock, libc.munlock
    except (OSError, AttributeError):
        warn("--mlock is not supported on this system; continuing without locking the weights")
        return False
    mlock.argtypes = munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    done = []
    for arr in arrays:
        addr = arr.__array_interface__["data"][0]
        if mlock(addr, arr.nbytes) != 0:
            err = ctypes.get_errno()
            for a in done:
                munlock(a.__array_interface__["data"][0], a.nbytes)
            soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
            limit = "unlimited" if soft == resource.RLIM_INFINITY else _fmt(soft)
            warn(f"--mlock: the system refused to lock {_fmt(total)} of weights in RAM "
                 f"({'limit reached' if err in (12, 1, 11) else 'errno ' + str(err)}; "
                 f"RLIMIT_MEMLOCK is {limit}); raise it with `ulimit -l unlimited` (or a memlock "
                 f"line in /etc/security/limits.conf) or run without --mlock. Continuing unlocked")
            return False
        done.append(arr)
    return True


def available_bytes() -> int | None:
    """Memory the system can give this process without swapping (MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def state_plan(meta: dict) -> dict:
    """What a program's context costs, from its plan alone (before anything is allocated):
    KV bytes of full-attention and of sliding-window layers at the full context, linear-attention
    state, and the activation arena."""
    full = sliding = linear = 0
    for reg in meta["state_regions"]:
        nbytes = int(reg["floats"]) * 4
        if reg["kind"] != "kv":
            linear += nbytes
        elif reg.get("window"):
            sliding += nbytes
        else:
            full += nbytes
    return {"n_ctx": int(meta["n_ctx"]), "kv_dtype": meta.get("kv_dtype", "f32"),
            "kv_bytes_max": full + sliding, "kv_full_attention_bytes": full,
            "kv_sliding_window_bytes": sliding, "linear_state_bytes": linear,
            "state_bytes": int(meta["state_floats"]) * 4, "arena_bytes": int(meta["arena_floats"]) * 4}


def _smaller_kv_hint(kv_dtype: str) -> str:
    """The error's suggestion of a smaller KV format than ``kv_dtype`` (none for q8_0)."""
    if kv_dtype == "f32":
        return "; or halve the KV cache with float16 (--cache-type f16, kv_dtype='f16')"
    if kv_dtype == "f16":
        return "; or halve the KV cache again with 8 bits (--cache-type q8_0, kv_dtype='q8_0')"
    return ""


def check_plan_fits(meta: dict, available: int | None = None) -> dict:
    """The program's state plan (:func:`state_plan`); raise ContextMemoryError, naming a context
    that fits, when its KV cache, states and arena exceed the memory available now. They are
    zero pages until written, so without this check a context that does not fit would load and
    then fail (or be killed) only once a long prompt fills it."""
    from ..errors import ContextMemoryError
    plan = state_plan(meta)
    available = available_bytes() if available is None else available
    need = plan["state_bytes"] + plan["arena_bytes"]
    if available is not None and need > available:
        fixed = plan["linear_state_bytes"] + plan["arena_bytes"]
        per_token = max(1.0, (plan["kv_bytes_max"]) / max(1, plan["n_ctx"]))
        fits = int(max(0, 0.8 * available - fixed) / per_token)
        ctx = 1 << max(8, fits.bit_length() - 1) if fits >= 256 else 0
        raise ContextMemoryError(
            f"a {plan['n_ctx']}-token context needs {_fmt(need)} for its KV cache and activations "
            f"({_fmt(plan['kv_bytes_max'])} of KV), but only {_fmt(available)} of memory is available; "
            + (f"load with a smaller context (--ctx {ctx}, n_ctx={ctx})" if ctx else
               "free memory or use a machine with more RAM")
            + (_smaller_kv_hint(meta.get("kv_dtype", "f32")) if plan["kv_bytes_max"] else ""))
    return plan
