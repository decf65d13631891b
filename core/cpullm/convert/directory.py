"""GGUF file -> Hugging Face model directory (``cpullm convert``; see :mod:`cpullm.convert`)."""
from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import uuid
from pathlib import Path
from typing import Any, Callable

from .. import limits
from ..errors import ConfigError, ConversionError
from ..loading.family import check_config
from ..loading.gguf_file import (PlannedTensor, arch_spec, build_config, f32_to_bf16_bits, hyperparameters,
                        materialize, open_gguf, plan_tensors, read_metadata)
from ..loading.gguf_vocab import build_tokenizer, generation_config

Progress = Callable[[str, float], None]



# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------

def safetensors_header(plan: list[PlannedTensor]) -> bytes:
    """The safetensors header (8-byte little-endian length + JSON padded to 8 bytes) for bf16 tensors."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for p in plan:
        header[p.hf_name] = {"dtype": "BF16", "shape": list(p.shape), "data_offsets": [offset, offset + p.nbytes]}
        offset += p.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors(path: Path, plan: list[PlannedTensor], progress: Progress | None = None) -> None:
    """Stream every planned tensor, dequantized and converted to bf16, into one safetensors file."""
    total = sum(p.nbytes for p in plan) or 1
    done = 0
    with open(path, "wb") as fh:
        fh.write(safetensors_header(plan))
        for p in plan:
            bits = f32_to_bf16_bits(materialize(p))
            fh.write(bits.tobytes())
            done += p.nbytes
            if progress:
                progress("converting tensors", 0.05 + 0.95 * done / total)


def _write_json(path: Path, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=2, ensure_ascii=False)
        fh.write("\n")


def _check_out_dir(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ConversionError(f"{out_dir} exists and is a file; choose another output directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise ConversionError(f"{out_dir} already exists and is not empty; choose another output "
                              "directory or pass overwrite=True (cpullm convert --overwrite)")


def _move_into_place(tmp: Path, out_dir: Path) -> None:
    """Rename the finished temporary directory to out_dir (replacing an empty or overwritten one)."""
    old = None
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(out_dir, old)
    try:
        os.replace(tmp, out_dir)
    except BaseException:
        if old is not None:
            os.replace(old, out_dir)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _convert_into(reader, meta: dict, tmp: Path, progress: Progress | None) -> None:
    """Write every output file of the conversion into the (empty) directory ``tmp``."""
    spec = arch_spec(meta.get("general.architecture"))
    hp = hyperparameters(meta, reader, spec)
    plan, tied = plan_tensors(reader, spec, hp)
    config = build_config(meta, reader, spec, hp, tied)
    try:   # the same checks a load runs: never write a config that cpullm itself would refuse
        check_config(config, "the converted config")
    except ConfigError as exc:
        raise ConversionError(f"{exc} (from the GGUF metadata)") from None
    if progress:
        progress("tokenizer", 0.02)
    tok, tok_config, tspec = build_tokenizer(meta, spec)
    tok.save(str(tmp / "tokenizer.json"))
    _write_json(tmp / "tokenizer_config.json", tok_config)
    _write_json(tmp / "generation_config.json", generation_config(tspec))
    _write_json(tmp / "config.json", config)
    write_safetensors(tmp / "model.safetensors", plan, progress)


_UNTRUSTED_DATA_ERRORS = (ValueError, TypeError, KeyError, IndexError, OverflowError, ZeroDivisionError,
                          RecursionError)


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *,
                 progress: Progress | None = None, overwrite: bool = False) -> Path:
    """Convert a GGUF file into a Hugging Face model directory; returns the directory.

    Writes config.json, model.safetensors (bf16), tokenizer.json, tokenizer_config.json and
    generation_config.json. The work happens in a hidden sibling directory that is renamed into
    place at the end, so a failed or interrupted conversion leaves nothing at ``out_dir``.
    ``progress(message, fraction)`` is called as the conversion advances.
    Raises ConversionError for an unsupported architecture or tensor type, a damaged file, or an
    existing non-empty ``out_dir`` (unless ``overwrite=True``).
    """
    out_dir = Path(os.path.expanduser(str(out_dir))).absolute()
    _check_out_dir(out_dir, overwrite)
    reader = open_gguf(gguf_path)
    if progress:
        progress("reading GGUF", 0.0)
    meta = read_metadata(reader)
    arch_spec(meta.get("general.architecture"))   # refuse an unsupported one before any work
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        try:
            _convert_into(reader, meta, tmp, progress)
        except _UNTRUSTED_DATA_ERRORS as exc:
            # every value is checked above; this keeps a combination no check foresaw from
            # ending in a traceback (the input is an untrusted file)
            raise ConversionError(f"{Path(gguf_path).name} cannot be converted: its metadata or tensors are "
                                  f"inconsistent ({type(exc).__name__}: {limits.one_line(exc, 160)})") from exc
        except MemoryError:
            raise ConversionError(f"not enough memory to convert {Path(gguf_path).name}") from None
        except OSError as exc:          # a full disk or quota, a file size limit, an I/O error
            why = exc.strerror or limits.one_line(exc, 120)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise ConversionError(f"cannot write the converted model into {out_dir.parent}: {why}; free "
                                      "some space there (a bf16 model takes about twice a Q8 GGUF's size) "
                                      "or give another output directory") from None
            raise ConversionError(f"converting {Path(gguf_path).name} failed: {why} "
                                  f"({limits.shown(exc.filename, 120)})") from None
        _check_out_dir(out_dir, overwrite)  # it may have appeared meanwhile
        _move_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if progress:
        progress("done", 1.0)
    return out_dir
