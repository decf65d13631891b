"""TensorStore: memory-mapped safetensors shards with strict header validation.

Nothing is read until a tensor is asked for; ``get(name)`` returns float32 (bf16 and f16 are
widened), ``raw(name)`` the stored view without a copy.
"""
from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

import numpy as np

from ..errors import CheckpointError, ModelNotFoundError
from ..limits import (MAX_DIMS, MAX_SAFETENSORS_HEADER, MAX_SHARDS, MAX_TENSOR_ELEMENTS, MAX_TENSORS,
                     checked_product, inside, is_int, open_regular, parse_json, one_line, read_json_file, shown)

# safetensors dtype -> (numpy dtype of the stored bytes, itemsize)
_DTYPES = {
    "F32": (np.float32, 4),
    "F16": (np.float16, 2),
    "BF16": (np.uint16, 2),   # widened to f32 by bit shift
    "F64": (np.float64, 8),
    "I64": (np.int64, 8),
    "I32": (np.int32, 4),
    "I16": (np.int16, 2),
    "I8": (np.int8, 1),
    "U8": (np.uint8, 1),
    "BOOL": (np.bool_, 1),
}


def bf16_to_f32(raw: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """(…) uint16 holding bf16 bits -> (…) float32, written into ``out`` (float32, same shape) or
    one new array: no temporaries (fresh memory is what this costs; on some VMs tens of ms per MB
    the first time it is touched)."""
    out = np.empty(raw.shape, np.float32) if out is None else out
    np.left_shift(raw, np.uint32(16), out=out.view(np.uint32), dtype=np.uint32)
    return out


class _Entry:
    __slots__ = ("file", "dtype", "shape", "start", "end")

    def __init__(self, file, dtype, shape, start, end):
        self.file, self.dtype, self.shape, self.start, self.end = file, dtype, shape, start, end


class _Shard:
    """One mapped .safetensors file, its header validated before anything is mapped or allocated."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self._fh, size = open_regular(path)
        except OSError as exc:
            raise CheckpointError(f"cannot open {path}: {exc.strerror or exc}") from None
        try:
            header, hlen = self._read_header(size)
            self._index(header, size - 8 - hlen)
            self.data_start = 8 + hlen
            self._mm = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        except BaseException:
            self._fh.close()
            raise

    def _read_header(self, size: int) -> tuple[dict, int]:
        path = self.path
        if size < 8:
            raise CheckpointError(f"{path} is truncated ({size} bytes): re-download the checkpoint")
        (hlen,) = struct.unpack("<Q", self._fh.read(8))
        if hlen > size - 8:
            raise CheckpointError(
                f"{path}: header length {hlen} runs past the end of the file ({size} bytes); "
                "the file is truncated or not safetensors: re-download it")
        if hlen > MAX_SAFETENSORS_HEADER:
            raise CheckpointError(f"{path}: header of {hlen} bytes is larger than the "
                                  f"{MAX_SAFETENSORS_HEADER} cpullm reads; the file is damaged or not safetensors")
        try:
            header = parse_json(self._fh.read(hlen))
        except ValueError as exc:
            raise CheckpointError(f"{path}: header is not valid JSON ({exc}); re-download the file") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict):
            raise CheckpointError(f"{path}: __metadata__ is not a JSON object; the file is damaged")
        self.metadata = metadata
        if len(header) > MAX_TENSORS:
            raise CheckpointError(f"{path}: header lists {len(header)} tensors, more than the "
                                  f"{MAX_TENSORS} cpullm reads; the file is damaged")
        return header, hlen

    def _index(self, header: dict, data_len: int) -> None:
        """Check every entry (dtype, shape, offsets inside the data, no overlap) into ``entries``."""
        path = self.path
        self.entries: dict[str, _Entry] = {}
        spans = []
        for name, info in header.items():
            try:
                dtype, shape, (begin, end) = info["dtype"], list(info["shape"]), info["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{path}: tensor {shown(name)} has a malformed header entry") from None
            if not isinstance(dtype, str) or dtype not in _DTYPES:
                raise CheckpointError(
                    f"{path}: tensor {shown(name)} has unknown dtype {str(dtype)[:20]!r} "
                    f"(known: {', '.join(sorted(_DTYPES))}); convert the checkpoint to bf16/f16/f32")
            count = checked_product(shape) if len(shape) <= MAX_DIMS else None
            if count is None:
                raise CheckpointError(
                    f"{path}: tensor {shown(name)} has an invalid shape {str(shape)[:80]} (at most {MAX_DIMS} "
                    f"non-negative integer dimensions, at most {MAX_TENSOR_ELEMENTS} elements); the file is damaged")
            if not (is_int(begin) and is_int(end) and 0 <= begin <= end):
                raise CheckpointError(f"{path}: tensor {shown(name)} has invalid data offsets "
                                      f"{str(begin)[:24]}..{str(end)[:24]}")
            if end > data_len:
                raise CheckpointError(
                    f"{path}: tensor {shown(name)} ends at byte {end} but the data section holds only "
                    f"{data_len} bytes; the file is truncated: re-download it")
            nbytes = count * _DTYPES[dtype][1]
            if nbytes != end - begin:
                raise CheckpointError(
                    f"{path}: tensor {shown(name)} shape {shape} x {dtype} needs {nbytes} bytes but its "
                    f"offsets span {end - begin}; the file is damaged")
            spans.append((begin, end, name))
            self.entries[name] = _Entry(self, dtype, tuple(shape), begin, end)
        spans.sort()
        for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
            if b1 < e0:
                raise CheckpointError(f"{path}: tensors {shown(n0)} and {shown(n1)} overlap; the file is damaged")

    def array(self, e: _Entry) -> np.ndarray:
        np_dtype, _ = _DTYPES[e.dtype]
        count = (e.end - e.start) // _DTYPES[e.dtype][1]
        arr = np.frombuffer(self._mm, dtype=np_dtype, count=count, offset=self.data_start + e.start)
        return arr.reshape(e.shape)

    def release(self, start: int, end: int) -> None:
        """MADV_DONTNEED the whole pages inside data bytes ``start:end`` (a partial page at either
        end may hold a neighbour's bytes; it stays)."""
        if self._mm is None or not hasattr(self._mm, "madvise") or end <= start:
            return
        a = -(-(self.data_start + start) // mmap.PAGESIZE) * mmap.PAGESIZE
        b = (self.data_start + end) // mmap.PAGESIZE * mmap.PAGESIZE
        if b > a:
            try:
                self._mm.madvise(mmap.MADV_DONTNEED, a, b - a)
            except (OSError, ValueError):
                pass

    def close(self):
        # Views handed out keep the mapping alive; closing is best effort.
        try:
            self._fh.close()
        except OSError:
            pass


def _is_file(path: Path) -> bool:
    """Whether ``path`` is a regular file; False also for a name the OS refuses (too long, ...)."""
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


class TensorStore:
    """All tensors of a checkpoint directory (single file or sharded with an index)."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        if not self.dir.is_dir():
            raise ModelNotFoundError(f"model directory {self.dir} does not exist")
        files = self._shard_files()
        self.shards = [_Shard(f) for f in files]
        self._entries: dict[str, _Entry] = {}
        for shard in self.shards:
            for name, e in shard.entries.items():
                if name in self._entries:
                    raise CheckpointError(f"tensor {shown(name)} appears in two shards ({shard.path.name})")
                self._entries[name] = e

    def _shard_files(self) -> list[Path]:
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            return [self._checked_shard(self.dir / n, index) for n in self._index_shards(index)]
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(
                f"no .safetensors files in {self.dir}; cpullm reads Hugging Face safetensors "
                "checkpoints (convert a .gguf with `cpullm convert FILE.gguf OUT_DIR`)")
        if len(files) > MAX_SHARDS:
            raise CheckpointError(f"{self.dir} holds {len(files)} safetensors files, more than the "
                                  f"{MAX_SHARDS} cpullm reads")
        return [self._checked_shard(f, None) for f in files]

    def _index_shards(self, index: Path) -> list[str]:
        """The shard names listed by model.safetensors.index.json (validated, sorted)."""
        try:
            weight_map = read_json_file(index)["weight_map"]
        except OSError as exc:
            raise CheckpointError(f"cannot read {index} ({exc.strerror or exc}); restore it from the checkpoint") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index ({type(exc).__name__}: "
                                  f"{str(exc)[:80]}); restore it from the checkpoint") from None
        if not isinstance(weight_map, dict) or len(weight_map) > MAX_TENSORS:
            raise CheckpointError(f"{index}: weight_map must be an object of at most {MAX_TENSORS} "
                                  "tensor -> shard file entries; restore it from the checkpoint")
        bad = [n for n in weight_map.values()
               if not (isinstance(n, str) and 0 < len(n) <= 1024 and "\0" not in n)]
        if bad:
            raise CheckpointError(f"{index}: shard names must be file names, got {str(bad[0])[:40]!r}; "
                                  "restore it from the checkpoint")
        names = set(weight_map.values())
        if len(names) > MAX_SHARDS:
            raise CheckpointError(f"{index} names {len(names)} shard files, more than the {MAX_SHARDS} "
                                  "cpullm reads; the index is damaged")
        outside = sorted(n for n in names if Path(n).is_absolute() or ".." in Path(n).parts)
        if outside:
            raise CheckpointError(f"{index} names shard files outside the model directory "
                                  f"({', '.join(shown(n) for n in outside[:3])}); refusing to read "
                                  "them: the index is damaged or hostile")
        missing = sorted(n for n in names if not _is_file(self.dir / n))
        if missing:
            raise CheckpointError(
                f"{index} lists shards that are missing: {', '.join(one_line(n, 60) for n in missing[:8])}; download them")
        return sorted(names)

    def _checked_shard(self, path: Path, index: Path | None) -> Path:
        """``path`` if it resolves inside the model directory (a symlink may not lead out of it,
        except into the blob store of a Hugging Face cache snapshot the directory belongs to)."""
        if not inside(path, self._allowed_root()):
            source = f"{index} names" if index else "found"
            raise CheckpointError(f"{source} {path.name!r}, which leads outside the model directory "
                                  f"{self.dir} (a symlink to {os.path.realpath(path)}); refusing to read it. "
                                  "Copy the real file into the model directory")
        return path

    def _allowed_root(self) -> Path:
        """The tree shard files may resolve into: the model directory, or for a Hugging Face cache
        snapshot (``<repo>/snapshots/<rev>/``, whose files link to ``<repo>/blobs/``) the repo."""
        real = Path(os.path.realpath(self.dir))
        if real.parent.name == "snapshots" and (real.parent.parent / "blobs").is_dir():
            return real.parent.parent
        return real

    # -- queries ---------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple:
        return self._entries[name].shape

    def dtype(self, name: str) -> str:
        return self._entries[name].dtype

    def raw(self, name: str) -> np.ndarray:
        """The stored array (bf16 as uint16 bits), a zero-copy view into the mapping."""
        e = self._entries[name]
        return e.file.array(e)

    def get(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        """The tensor as float32: a new array unless stored as f32, or written into ``out``
        (float32, the tensor's shape) and returned."""
        e = self._entries[name]
        arr = e.file.array(e)
        if out is None:
            if e.dtype == "BF16":
                return bf16_to_f32(arr)
            if e.dtype == "F32":
                return arr
            return arr.astype(np.float32)
        if out.dtype != np.float32 or out.shape != arr.shape:
            raise ValueError(f"{name}: out must be float32 {arr.shape}, got {out.dtype} {out.shape}")
        if e.dtype == "BF16":
            return bf16_to_f32(arr, out)
        out[...] = arr
        return out

    def get_rows(self, name: str, r0: int, r1: int, out: np.ndarray) -> np.ndarray:
        """Rows ``r0:r1`` (first axis) of the tensor as float32, written into ``out``; the mapped
        source pages of those rows are released once read (:meth:`release`)."""
        e = self._entries[name]
        arr = e.file.array(e)[r0:r1]
        if out.dtype != np.float32 or out.shape != arr.shape:
            raise ValueError(f"{name}[{r0}:{r1}]: out must be float32 {arr.shape}, got {out.dtype} {out.shape}")
        if e.dtype == "BF16":
            bf16_to_f32(arr, out)
        else:
            out[...] = arr
        row_bytes = (e.end - e.start) // max(1, e.shape[0]) if e.shape else 0
        e.file.release(e.start + r0 * row_bytes, e.start + r1 * row_bytes)
        return out

    def release(self, name: str) -> None:
        """Drop this process's resident pages of the tensor's mapping (MADV_DONTNEED: the file
        stays in the page cache, a later read faults them back in). Reading a whole checkpoint
        through the mapping would otherwise keep all of it in RSS until the load returns: 2
        bytes a parameter of bf16 next to the 1.06 of the INT8 program being built."""
        e = self._entries[name]
        e.file.release(e.start, e.end)

    def nbytes(self) -> int:
        return sum(e.end - e.start for e in self._entries.values())

    def identity(self) -> list:
        """File identity for cache keys: (name, size, mtime_ns) of every shard."""
        out = []
        for s in self.shards:
            st = s.path.stat()
            out.append([s.path.name, st.st_size, st.st_mtime_ns])
        return out
