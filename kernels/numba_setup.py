"""Process-wide numba settings, applied before the first kernel compiles (baseline version)."""
from __future__ import annotations

import os


import numba  # noqa: E402

_configured = None


def physical_cores() -> int:
    try:
        cores = set()
        with open("/proc/cpuinfo") as fh:
            phys = core = None
            for line in fh:
                if line.startswith("physical id"):
                    phys = line.split(":")[1].strip()
                elif line.startswith("core id"):
                    core = line.split(":")[1].strip()
                    cores.add((phys, core))
        if cores:
            return len(cores)
    except OSError:
        pass
    return os.cpu_count() or 1


def configure(threads: int | None = None) -> int:
    """Set numba's thread count once per process; returns it."""
    global _configured
    n = int(threads or physical_cores())
    n = max(1, min(n, numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(n)
    _configured = n
    return n
