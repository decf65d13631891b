"""Limits on what an untrusted model file may declare, and safe readers for untrusted files.

A model directory, a GGUF file and the execution cache come from whoever published or wrote
them. Every size, count and offset read from them is checked against the file's size and against
the limits below *before* anything is allocated from it, so a 227-byte file cannot ask for
terabytes. The limits are generous: each is several times what the largest model cpullm targets
(about 4B parameters) needs, and far below what would exhaust memory on its own.

config.json's common keys are checked against them by cpullm.loading.family.check_config; a family whose
checkpoints name their keys their own way (GPT-2's ``n_embd``, ``n_layer``) declares them in
``FamilySpec.config_keys`` with the common key whose limit applies, or its own (lowest, highest).
"""
from __future__ import annotations

import errno
import json
import math
import os
import stat
from pathlib import Path
from typing import Any

# --- model shape (config.json, GGUF metadata) ----------------------------------------------------
MAX_LAYERS = 1024              # 4B models have 26-36; the largest open models about 130
MAX_HIDDEN = 65536             # hidden_size; 4B models use 2560-3072
MAX_INTERMEDIATE = 1 << 20     # intermediate_size: 16x the largest hidden size
MAX_HEADS = 1024               # num_attention_heads, num_key_value_heads
MAX_HEAD_DIM = 4096            # head_dim; real models use 64-256
MAX_VOCAB = 1 << 22            # 4M tokens; Gemma 3 has 262k
MAX_CONTEXT = 1 << 24          # max_position_embeddings / context_length (16M, beyond any 1M-context model)

# --- files ---------------------------------------------------------------------------------------
MAX_JSON_BYTES = 64 << 20      # config.json, index.json, manifests: real ones are < 1 MB
MAX_SAFETENSORS_HEADER = 32 << 20   # a 4B checkpoint's header is ~200 kB; 32 MB holds ~200k tensors
MAX_TENSORS = 1 << 18          # tensors per checkpoint or GGUF (a 4B model has ~400-900)
MAX_DIMS = 8                   # dimensions of one tensor
MAX_TENSOR_ELEMENTS = 1 << 40  # elements of one tensor (also keeps every byte count in int64)
MAX_SHARDS = 4096              # files named by a safetensors index

# --- GGUF metadata -------------------------------------------------------------------------------
MAX_GGUF_KV = 1 << 16          # metadata keys (real files have 20-50)
MAX_GGUF_ARRAY = 1 << 23       # elements of one metadata array (vocabulary, merges: < 1M)
MAX_GGUF_STRING = 64 << 20     # bytes of one metadata string (chat templates are < 64 kB)
MAX_GGUF_NESTING = 2           # arrays inside arrays (the format allows it; no real file uses it)


# --- output constraints (cpullm.generate.constraints: JSON schemas, regexes, grammars from requests) ---------
MAX_CONSTRAINT_BYTES = 256 << 10    # a JSON schema (serialized), Lark or GBNF grammar: real ones < 20 kB
MAX_REGEX_BYTES = 16 << 10          # one regular expression
MAX_REGEX_EXPANSION = 100_000       # its length with counted repetitions ({n,m}) written out
MAX_SCHEMA_DEPTH = 64               # nesting of a JSON schema's objects and arrays (OpenAI allows 10 levels)
MAX_ENUM_VALUES = 4096              # values of one enum / const list, and strings of a choice
MAX_SCHEMA_NODES = 50_000           # objects, arrays and values in one schema
MAX_CHOICE_BYTES = 4096             # one string of a choice list


def is_int(value: Any) -> bool:
    """A JSON/metadata integer (``True`` is not a count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite int or float (not bool, not NaN, not infinite)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def one_line(text: Any, width: int = 200) -> str:
    """``text`` as one line of at most ``width`` characters: a message quoting a library's error
    (which may span lines) still prints as the CLI's single error line."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= width else flat[:width - 3] + "..."


def quoted(value: Any) -> str:
    """A client's value quoted in an error message: JSON, one line, at most 80 characters."""
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError, RecursionError):
        text = repr(type(value))
    return one_line(text, 80)


def shown(value: Any, width: int = 60) -> str:
    """A value read from an untrusted file, quoted for an error message: repr (control characters
    escaped), one line, cut to ``width`` characters."""
    return one_line(repr(value), width)


def checked_product(dims, limit: int = MAX_TENSOR_ELEMENTS) -> int | None:
    """The product of a list of non-negative ints ``dims`` in exact integer arithmetic, or None
    when ``dims`` is not a list or tuple, a factor is not a non-negative int or the product exceeds ``limit`` (no int64 wrap-around:
    (2**32, 2**32) is 2**64, not 0)."""
    if not isinstance(dims, (list, tuple)):
        return None
    total = 1
    for d in dims:
        if not is_int(d) or d < 0:
            return None
        total *= d
        if total > limit:
            return None
    return total


def open_regular(path: Path, *, follow_symlinks: bool = True):
    """Open ``path`` read-only without blocking, and make sure it is a regular file.

    O_NONBLOCK keeps a FIFO from hanging the open; O_NOFOLLOW (when ``follow_symlinks`` is false)
    refuses a symlink. Returns ``(binary file object, size)``; raises OSError with a message that
    says what the path is instead (a FIFO, a device, a directory, a symlink).
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if not follow_symlinks:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_symlinks:
            raise OSError(errno.ELOOP, "is a symbolic link, not a regular file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"is {_file_kind(st.st_mode)}, not a regular file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb"), st.st_size
    except BaseException:
        os.close(fd)
        raise


def _file_kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def read_untrusted_bytes(path: Path, max_bytes: int, *, follow_symlinks: bool = True) -> bytes:
    """The whole of a regular file of at most ``max_bytes`` bytes (OSError otherwise)."""
    fh, size = open_regular(path, follow_symlinks=follow_symlinks)
    with fh:
        if size > max_bytes:
            raise OSError(errno.EFBIG, f"is {size} bytes, more than the {max_bytes} allowed")
        data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise OSError(errno.EFBIG, f"grew past the {max_bytes} bytes allowed while being read")
    return data


def parse_json(data: bytes | str, allow_nan: bool = False) -> Any:
    """json.loads that turns every way untrusted text can fail into ValueError (deep nesting
    raises RecursionError inside json). NaN and Infinity literals are refused unless
    ``allow_nan`` (they are not JSON, and a NaN epsilon poisons every forward pass)."""
    try:
        return json.loads(data, parse_constant=None if allow_nan else _refuse_constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 ({exc.reason} at byte {exc.start})") from None


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def read_json_file(path: Path, max_bytes: int = MAX_JSON_BYTES, *, follow_symlinks: bool = True,
                   allow_nan: bool = False) -> Any:
    """A small JSON file from an untrusted place: a regular file, bounded, parsed safely.

    Raises OSError (cannot open / not a regular file / too big) or ValueError (not JSON).
    """
    return parse_json(read_untrusted_bytes(path, max_bytes, follow_symlinks=follow_symlinks), allow_nan)


def inside(path: Path, root: Path) -> bool:
    """Whether ``path``, with every symlink resolved, lies inside ``root`` (also resolved)."""
    try:
        real = Path(os.path.realpath(path))
        base = Path(os.path.realpath(root))
    except (OSError, ValueError):
        return False
    return real == base or base in real.parents
