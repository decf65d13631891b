"""Where models and caches live, and finding a model by path or store name (never downloading:
fetching is the store's, :mod:`cpullm.store`).

A model is a checkpoint directory (config.json and safetensors), a GGUF file, or an entry of the
model store: a directory under :func:`models_dir` holding either.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import ModelNotFoundError


def models_dir() -> Path:
    """The store root: ``$CPULLM_MODELS_DIR``, else ``~/.cache/cpullm/models``."""
    root = os.environ.get("CPULLM_MODELS_DIR") or Path.home() / ".cache" / "cpullm" / "models"
    return Path(os.path.expanduser(str(root)))


def exec_cache_root() -> Path:
    """The execution-cache root: ``$CPULLM_CACHE_DIR``, else ``~/.cache/cpullm``."""
    root = os.environ.get("CPULLM_CACHE_DIR") or Path.home() / ".cache" / "cpullm"
    return Path(os.path.expanduser(str(root)))


def servers_dir() -> Path:
    """Where running servers leave their state files (``cpullm ps``): ``<cache root>/servers``."""
    return exec_cache_root() / "servers"


def store_dir_name(name: str) -> str:
    """The directory name of a store entry: ``org/name`` -> ``org--name``."""
    return name.strip().replace("/", "--")


def gguf_in_dir(path: Path) -> Path | None:
    """The one ``*.gguf`` file of a directory without config.json (a store entry kept as GGUF)."""
    try:
        if (path / "config.json").exists():
            return None
        found = [p for p in path.glob("*.gguf") if p.is_file()]
    except OSError:
        return None
    return found[0] if len(found) == 1 else None


def is_complete_model_dir(path: Path) -> bool:
    """A model directory with config.json and its safetensors weights, or a store entry holding
    one GGUF file (run as it is)."""
    return ((path / "config.json").is_file() and (
        any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file())) \
        or gguf_in_dir(path) is not None


def resolve_model(name_or_path: str | os.PathLike, known_names: tuple[str, ...] = ()) -> Path:
    """A model directory or GGUF file from a path or a store name; never downloads.

    Raises ModelNotFoundError naming the fix: a correct path, or ``cpullm pull NAME`` (with the
    names the store can fetch, ``known_names``, when given)."""
    from .gguf_model import is_gguf_file
    text = str(name_or_path)
    p = Path(os.path.expanduser(text))
    if p.is_dir():
        return p
    if p.exists():
        if is_gguf_file(p):
            return p
        raise ModelNotFoundError(f"{p} is a file but not a GGUF file; give a model directory "
                                 "(config.json + *.safetensors) or a .gguf file")
    root = models_dir()
    for candidate in dict.fromkeys((text.strip(), text.strip().lower(), store_dir_name(text))):
        if candidate and not candidate.startswith((".", "_")) and is_complete_model_dir(root / candidate):
            return root / candidate
    if text.strip().lower() in known_names or ("/" in text.strip() and not p.is_absolute()):
        raise ModelNotFoundError(f"model {text!r} is not in the store ({root}); fetch it with "
                                 f"`cpullm pull {text.strip()}`")
    fetchable = (f"pull one of: {', '.join(known_names)}" if known_names
                 else "fetch one with `cpullm pull NAME` (`cpullm pull --help` lists them)")
    raise ModelNotFoundError(f"no model directory or store model named {text!r}; give a path to a model "
                             f"directory, a name from `cpullm list`, or {fetchable}")


__all__ = ["exec_cache_root", "gguf_in_dir", "is_complete_model_dir", "models_dir", "resolve_model",
           "servers_dir", "store_dir_name"]
