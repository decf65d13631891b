"""Make numba's on-disk kernel cache safe for two processes that compile at the same time.

numba keeps, per jitted function, an index file (signature -> data file name) and numbered data
files. Saving a new signature reads the index, takes the first unused number, writes the index,
then the data, with no lock. Two processes that compile different signatures of one function at
once (say a shared helper such as the activation quantizer, called by kernels compiled in each)
can both pick number 1: one index entry then points at the other signature's machine code, and a
later load runs it with the wrong argument types.

:func:`install` wraps the save and load of numba's index/data cache file in an ``flock`` on one
lock file per cache directory, and writes the data before the index, so a number is never given
twice and an index entry never points at a missing file. With it installed the cold-start
compile (:mod:`cpullm_kernels.setup.warmup`) can hand any kernel group to its child process; without
it (no ``fcntl``, or numba's internals moved) the warm-up keeps the groups that share helpers in
one process, as before. ``INSTALLED`` says which.
"""
from __future__ import annotations

import contextlib
import itertools
import os

INSTALLED = False
LOCK_NAME = ".cpullm-cache.lock"


@contextlib.contextmanager
def _locked(directory: str, exclusive: bool):
    import fcntl
    try:
        fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:            # unwritable cache directory: numba itself will not save there either
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)           # closing releases the lock


def install() -> bool:
    """Patch numba's IndexDataCacheFile (idempotent). Returns :data:`INSTALLED`."""
    global INSTALLED
    if INSTALLED:
        return True
    try:
        import fcntl  # noqa: F401  (POSIX only)
        from numba.core.caching import IndexDataCacheFile as cache_file
        if not all(hasattr(cache_file, n) for n in ("_load_index", "_save_index", "_load_data",
                                                    "_save_data", "_data_name")):
            return False
    except ImportError:
        return False

    def save(self, key, data):
        with _locked(self._cache_path, exclusive=True):
            overloads = self._load_index()
            data_name = overloads.get(key)
            if data_name is None:
                used = set(overloads.values())
                data_name = next(n for n in (self._data_name(i) for i in itertools.count(1)) if n not in used)
                self._save_data(data_name, data)      # data first: no entry points at a missing file
                overloads[key] = data_name
                self._save_index(overloads)
            else:
                self._save_data(data_name, data)

    def load(self, key):
        with _locked(self._cache_path, exclusive=False):
            data_name = self._load_index().get(key)
            if data_name is None:
                return None
            try:
                return self._load_data(data_name)
            except OSError:
                return None

    cache_file.save = save
    cache_file.load = load
    INSTALLED = True
    return True


__all__ = ["INSTALLED", "install"]
