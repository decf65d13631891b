"""cpu_execution.cache: the compiled ExecutionProgram on disk, mapped back on the next load.

Layout (one directory per key under ``<root>/exec/``)::

    <key>/manifest.json      format version, every key input, program meta, array table, checksums
    <key>/<name>.bin         raw little-endian arrays (I, F, wq, ws, wf), mmapped back read-only
    <key>/last_used          touched on every HIT (its mtime is "last used")

No pickle. A new entry is written under a temporary name in the same directory and moved into
place with ``os.replace``; a reader only trusts a directory with a complete manifest whose format
version matches and whose checksums agree. A damaged or foreign entry is rebuilt with a notice.
The root is ``cache_dir``, else ``$CPULLM_CACHE_DIR``, else ``~/.cache/cpullm``.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import time
import uuid
from pathlib import Path

import numpy as np
from numba import njit, prange

from . import __version__
from .compiler import Program
from .errors import CacheError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_STALE_TMP_S = 3600


def cache_root(cache_dir=None) -> Path:
    root = cache_dir or os.environ.get("CPULLM_CACHE_DIR") or Path.home() / ".cache" / "cpullm"
    return Path(os.path.expanduser(str(root)))


def exec_dir(cache_dir=None) -> Path:
    return cache_root(cache_dir) / "exec"


@njit(cache=True, parallel=True)
def _checksum_words(words):
    """A position-dependent 64-bit sum over uint64 words, computed in 64 parallel lanes."""
    lanes = 64
    n = words.size
    acc = np.zeros(lanes, np.uint64)
    for lane in prange(lanes):
        s = np.uint64(0x9E3779B97F4A7C15) * np.uint64(lane + 1)
        for i in range(lane, n, lanes):
            s = (s ^ words[i]) * np.uint64(0x100000001B3) + np.uint64(i)
        acc[lane] = s
    return acc


def checksum(arr: np.ndarray) -> str:
    """Checksum of an array's bytes; any flipped bit or truncation changes it."""
    raw = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    n8 = raw.size // 8 * 8
    words = raw[:n8].view(np.uint64)
    h = hashlib.blake2b(_checksum_words(words).tobytes(), digest_size=16)
    h.update(raw[n8:].tobytes())
    h.update(str(raw.size).encode())
    return h.hexdigest()


def cpu_features() -> str:
    try:
        import llvmlite.binding as llvm
        return f"{llvm.get_host_cpu_name()}:{llvm.get_host_cpu_features().flatten()}"
    except Exception:  # pragma: no cover - llvmlite always present with numba
        return platform.processor()


def cache_key_inputs(*, config, family, graph, weights, store, quant, n_ctx, max_chunk, kernels) -> dict:
    """Everything that, when it changes, must give a new entry."""
    import numba

    from .compiler import graph_hash
    from .kernels import KERNELS_VERSION

    clean_config = {k: v for k, v in config.items() if not k.startswith("_")}
    return {
        "format_version": FORMAT_VERSION,
        "cpullm_version": __version__,
        "plugin": family.plugin,
        "plugin_version": family.plugin_version,
        "family": family.name,
        "config_sha": hashlib.sha256(json.dumps(clean_config, sort_keys=True).encode()).hexdigest(),
        "weights_identity": store.identity(),
        "weight_map_sha": hashlib.sha256(json.dumps(weights.fingerprint()).encode()).hexdigest(),
        "graph_sha": graph_hash(graph),
        "quant": quant,
        "n_ctx": n_ctx,
        "max_chunk": max_chunk,
        "kernels_version": KERNELS_VERSION,
        "plugin_kernels": sorted([k.name, k.version, k.plugin] for k in kernels),
        "numba_version": numba.__version__,
        "numpy_version": np.__version__,
        "cpu": cpu_features(),
    }


def key_of(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:32]


def write_entry(root: Path, key: str, program: Program, inputs: dict, model_dir) -> Path:
    """Write atomically; if another process won the race, keep its entry."""
    root.mkdir(parents=True, exist_ok=True)
    _sweep_stale_tmp(root)
    final = root / key
    tmp = root / f".tmp-{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        table = {}
        for name, arr in program.arrays.items():
            arr = np.ascontiguousarray(arr)
            with open(tmp / f"{name}.bin", "wb") as fh:
                arr.reshape(-1).view(np.uint8).tofile(fh)
                fh.flush()
                os.fsync(fh.fileno())
            table[name] = {"dtype": arr.dtype.str, "shape": list(arr.shape), "checksum": checksum(arr)}
        manifest = {"format_version": FORMAT_VERSION, "key": key, "inputs": inputs,
                    "model_dir": str(Path(model_dir).resolve()), "created": time.time(),
                    "arrays": table, "program_meta": program.meta}
        with open(tmp / MANIFEST, "w") as fh:
            json.dump(manifest, fh)
            fh.flush()
            os.fsync(fh.fileno())
        (tmp / "last_used").touch()
        try:
            os.replace(tmp, final)
        except OSError:
            if _read_manifest(final) is None:     # not a concurrent winner: a broken leftover
                shutil.rmtree(final, ignore_errors=True)
                os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _sweep_stale_tmp(root: Path):
    now = time.time()
    for p in root.glob(".tmp-*"):
        try:
            if now - p.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


def _read_manifest(entry: Path):
    try:
        m = json.loads((entry / MANIFEST).read_text())
        return m if isinstance(m, dict) else None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None


def read_entry(entry: Path, expect_inputs: dict | None = None, mmap: bool = True) -> Program:
    """Map an entry back; raise CacheError naming what is wrong."""
    m = _read_manifest(entry)
    if m is None:
        raise CacheError("manifest missing or unreadable")
    if m.get("format_version") != FORMAT_VERSION:
        raise CacheError(f"format version {m.get('format_version')} != {FORMAT_VERSION}")
    if expect_inputs is not None and m.get("inputs") != json.loads(json.dumps(expect_inputs, default=str)):
        raise CacheError("entry was built for other inputs (foreign entry)")
    arrays = {}
    for name, info in m["arrays"].items():
        path = entry / f"{name}.bin"
        dtype = np.dtype(info["dtype"])
        count = int(np.prod(info["shape"], dtype=np.int64))
        if not path.is_file() or path.stat().st_size != count * dtype.itemsize:
            raise CacheError(f"{name}.bin is missing or truncated")
        if count == 0:
            arr = np.zeros(info["shape"], dtype)
        elif mmap:
            arr = np.memmap(path, dtype=dtype, mode="r", shape=tuple(info["shape"]))
        else:
            arr = np.fromfile(path, dtype=dtype).reshape(info["shape"])
        if checksum(arr) != info["checksum"]:
            raise CacheError(f"{name}.bin fails its checksum (damaged)")
        arrays[name] = arr
    try:
        (entry / "last_used").touch()
    except OSError:
        pass
    return Program(arrays=arrays, meta=m["program_meta"])


def load_or_build(build, *, model_dir, config, family, graph, weights, store, quant, n_ctx,
                  max_chunk, kernels, cache_dir=None, use_cache=True, mmap=True):
    """(program, "HIT" | "MISS (reason)")."""
    from .model import notice

    inputs = cache_key_inputs(config=config, family=family, graph=graph, weights=weights, store=store,
                              quant=quant, n_ctx=n_ctx, max_chunk=max_chunk, kernels=kernels)
    key = key_of(inputs)
    root = exec_dir(cache_dir)
    entry = root / key
    reason = "no entry"
    if entry.exists():
        try:
            return read_entry(entry, inputs, mmap=mmap), "HIT"
        except CacheError as exc:
            reason = f"damaged entry: {exc}"
            notice(f"execution cache entry {key[:12]} is unusable ({exc}); rebuilding it")
            shutil.rmtree(entry, ignore_errors=True)
    else:
        stale = [p for p in root.glob("*") if p.is_dir() and not p.name.startswith(".")
                 and (_read_manifest(p) or {}).get("model_dir") == str(Path(model_dir).resolve())
                 and (_read_manifest(p) or {}).get("inputs", {}).get("quant") == quant]
        if stale:
            old = _read_manifest(stale[0])["inputs"]
            changed = sorted(k for k in inputs if json.dumps(old.get(k), default=str)
                             != json.dumps(inputs[k], default=str))
            reason = "changed: " + ", ".join(changed) if changed else reason
    program = build()
    try:
        write_entry(root, key, program, inputs, model_dir)
        if mmap:   # run from the mapped copy, so a MISS and a HIT behave the same
            program = read_entry(root / key, inputs, mmap=True)
    except OSError as exc:
        notice(f"could not write the execution cache under {root} ({exc}); continuing without it")
    return program, f"MISS ({reason})"


def list_entries(cache_dir=None) -> list[dict]:
    out = []
    root = exec_dir(cache_dir)
    for p in sorted(root.glob("*")) if root.is_dir() else []:
        if not p.is_dir() or p.name.startswith("."):
            continue
        m = _read_manifest(p) or {}
        size = sum(f.stat().st_size for f in p.iterdir() if f.is_file())
        lu = p / "last_used"
        out.append({"key": p.name, "model": m.get("model_dir"), "quant": m.get("inputs", {}).get("quant"),
                    "family": m.get("inputs", {}).get("family"), "size_bytes": size,
                    "created": m.get("created"),
                    "last_used": lu.stat().st_mtime if lu.exists() else None,
                    "valid": bool(m) and m.get("format_version") == FORMAT_VERSION, "path": str(p)})
    return out


def clear(cache_dir=None, model: str | None = None) -> int:
    """Delete entries (all, or those of one model directory); returns how many."""
    n = 0
    for e in list_entries(cache_dir):
        if model is None or (e["model"] and (e["model"] == str(Path(model).resolve())
                                             or Path(e["model"]).name == model)):
            shutil.rmtree(e["path"], ignore_errors=True)
            n += 1
    return n
