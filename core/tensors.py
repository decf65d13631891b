"""TensorStore: memory-mapped safetensors shards with strict header validation.

Nothing is read until a tensor is asked for; ``get(name)`` returns float32 (bf16 and f16 are
widened), ``raw(name)`` the stored view without a copy.
"""
from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import numpy as np

from .errors import CheckpointError, ModelNotFoundError

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
_MAX_HEADER = 100 * 1024 * 1024


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
    """One mapped .safetensors file."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self._fh = open(path, "rb")
        except OSError as exc:
            raise CheckpointError(f"cannot open {path}: {exc}") from None
        size = path.stat().st_size
        if size < 8:
            raise CheckpointError(f"{path} is truncated ({size} bytes): re-download the checkpoint")
        (hlen,) = struct.unpack("<Q", self._fh.read(8))
        if hlen > min(_MAX_HEADER, size - 8):
            raise CheckpointError(
                f"{path}: header length {hlen} runs past the end of the file ({size} bytes); "
                "the file is truncated or not safetensors: re-download it")
        try:
            header = json.loads(self._fh.read(hlen).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{path}: header is not valid JSON ({exc}); re-download the file") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: header is not a JSON object")
        self.metadata = header.pop("__metadata__", {}) or {}
        self.data_start = 8 + hlen
        data_len = size - self.data_start
        self.entries: dict[str, _Entry] = {}
        spans = []
        for name, info in header.items():
            try:
                dtype, shape, (begin, end) = info["dtype"], list(info["shape"]), info["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry") from None
            if dtype not in _DTYPES:
                raise CheckpointError(
                    f"{path}: tensor {name!r} has unknown dtype {dtype!r} "
                    f"(known: {', '.join(sorted(_DTYPES))}); convert the checkpoint to bf16/f16/f32")
            if any((not isinstance(d, int)) or d < 0 for d in shape):
                raise CheckpointError(f"{path}: tensor {name!r} has an invalid shape {shape}")
            if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
                raise CheckpointError(f"{path}: tensor {name!r} has invalid data offsets {begin}..{end}")
            if end > data_len:
                raise CheckpointError(
                    f"{path}: tensor {name!r} ends at byte {end} but the data section holds only "
                    f"{data_len} bytes; the file is truncated: re-download it")
            nbytes = int(np.prod(shape, dtype=np.int64)) * _DTYPES[dtype][1]
            if nbytes != end - begin:
                raise CheckpointError(
                    f"{path}: tensor {name!r} shape {shape} x {dtype} needs {nbytes} bytes but its "
                    f"offsets span {end - begin}; the file is damaged")
            spans.append((begin, end, name))
            self.entries[name] = _Entry(self, dtype, tuple(shape), begin, end)
        spans.sort()
        for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
            if b1 < e0:
                raise CheckpointError(f"{path}: tensors {n0!r} and {n1!r} overlap; the file is damaged")
        self._mm = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ) if size else None

    def array(self, e: _Entry) -> np.ndarray:
        np_dtype, _ = _DTYPES[e.dtype]
        count = int(np.prod(e.shape, dtype=np.int64))
        arr = np.frombuffer(self._mm, dtype=np_dtype, count=count, offset=self.data_start + e.start)
        return arr.reshape(e.shape)

    def close(self):
        # Views handed out keep the mapping alive; closing is best effort.
        try:
            self._fh.close()
        except OSError:
            pass


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
                    raise CheckpointError(f"tensor {name!r} appears in two shards ({shard.path.name})")
                self._entries[name] = e

    def _shard_files(self) -> list[Path]:
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index} is not a valid safetensors index ({exc})") from None
            names = sorted(set(weight_map.values()))
            missing = [n for n in names if not (self.dir / n).is_file()]
            if missing:
                raise CheckpointError(
                    f"{index} lists shards that are missing: {', '.join(missing)}; download them")
            return [self.dir / n for n in names]
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(
                f"no .safetensors files in {self.dir}; cpullm reads Hugging Face safetensors "
                "checkpoints (convert a .gguf with `cpullm convert FILE.gguf OUT_DIR`)")
        return files

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

    def nbytes(self) -> int:
        return sum(e.end - e.start for e in self._entries.values())

    def identity(self) -> list:
        """File identity for cache keys: (name, size, mtime_ns) of every shard."""
        out = []
        for s in self.shards:
            st = s.path.stat()
            out.append([s.path.name, st.st_size, st.st_mtime_ns])
        return out
