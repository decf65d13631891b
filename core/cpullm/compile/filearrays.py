"""Program arrays written straight to files and mapped back: the build streams into them.

A program's weight blobs grow piece by piece (``compile_graph`` packs one matrix, one row block
at a time). Kept in memory they cost their bytes twice when joined into one array (4.3x the
final INT8 weights at the peak of a 1.24B build, with the float32 scratch and the mapped bf16
source); written to a file as they come, the bytes leave the process at once (page cache, not
RSS) and come back as one read-only mapping, paged in only when something reads them.

:class:`FileBlob` has the interface of ``compiler._Blob`` (``add``, ``extend``, ``pad``,
``build``, ``size``); :func:`append_mapped` grows an array built here by appending to its file.
"""
from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

ALIGN = 16          # elements: every add() starts at a multiple of this (as compiler._Blob does)


class FileMap(mmap.mmap):
    """A read-only file mapping that remembers its file (the base of the arrays built here)."""

    path: str = ""


def map_file(path, dtype) -> np.ndarray:
    """The whole file as one read-only flat array of ``dtype`` (a FileMap underneath)."""
    path = str(path)
    dtype = np.dtype(dtype)
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            return np.zeros(0, dtype)
        fm = FileMap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    fm.path = path
    return np.frombuffer(fm, dtype=dtype, count=size // dtype.itemsize)


def backing_path(arr: np.ndarray) -> str | None:
    """The file ``arr`` maps whole (an array from :func:`map_file`), else None."""
    base = arr
    while base is not None and not isinstance(base, FileMap):
        base = getattr(base, "base", None)
        if isinstance(base, memoryview):
            base = base.obj
    if base is None or not base.path:
        return None
    if arr.nbytes != len(base) or arr.__array_interface__["data"][0] != _address(base):
        return None
    return base.path


def _address(fm: FileMap) -> int:
    return np.frombuffer(fm, np.uint8, count=1).__array_interface__["data"][0]


def release(arr: np.ndarray) -> None:
    """Drop this process's resident pages of a mapped array (they stay in the page cache): a
    second mapping of the same file then does not count its bytes twice in RSS."""
    base = arr
    while base is not None and not isinstance(base, mmap.mmap):
        base = getattr(base, "base", None)
        if isinstance(base, memoryview):
            base = base.obj
    if base is not None and hasattr(base, "madvise") and len(base):
        try:
            base.madvise(mmap.MADV_DONTNEED)
        except (OSError, ValueError):
            pass


class FileBlob:
    """Append-only flat array of one dtype, written to ``path`` as it grows."""

    def __init__(self, path, dtype):
        self.path, self.dtype, self.size = Path(path), np.dtype(dtype), 0
        self._fh = open(self.path, "wb")

    def extend(self, arr: np.ndarray) -> int:
        """Append ``arr``'s values right after the last ones; returns their element offset."""
        arr = np.ascontiguousarray(arr, dtype=self.dtype).reshape(-1)
        off = self.size
        self._fh.write(memoryview(arr).cast("B"))
        self.size += arr.size
        return off

    def pad(self) -> None:
        """Zero-fill up to the next multiple of ALIGN elements."""
        n = (-self.size) % ALIGN
        if n:
            self.extend(np.zeros(n, self.dtype))

    def add(self, arr: np.ndarray) -> int:
        off = self.extend(arr)
        self.pad()
        return off

    def build(self) -> np.ndarray:
        """Close the file and map it back (16 zeros for an empty blob, as compiler._Blob)."""
        if self.size == 0:
            self.extend(np.zeros(ALIGN, self.dtype))
        self._fh.close()
        return map_file(self.path, self.dtype)

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()


def append_mapped(base: np.ndarray, arr: np.ndarray, align: int) -> tuple[np.ndarray, int]:
    """``base`` (from :func:`map_file`) with zeros up to a multiple of ``align`` elements and
    ``arr`` appended, written to its file and mapped again; (new array, offset of ``arr``).
    The old mapping's pages are released (the caller drops the old array)."""
    path = backing_path(base)
    if path is None:
        raise ValueError("append_mapped needs an array mapped by cpullm.compile.filearrays.map_file")
    start = (base.size + align - 1) // align * align
    arr = np.ascontiguousarray(arr, dtype=base.dtype).reshape(-1)
    with open(path, "ab") as fh:
        fh.write(np.zeros(start - base.size, base.dtype).tobytes())
        fh.write(memoryview(arr).cast("B"))
    release(base)
    return map_file(path, base.dtype), start
