"""cpu_execution.cache: the compiled ExecutionProgram on disk, mapped back on the next load.

Layout (one directory per key under ``<root>/exec/``)::

    <key>/manifest.json      format version, every key input, program meta, array table,
                             per-array checksums and a checksum of the manifest itself
    <key>/<name>.bin         raw little-endian arrays (I, F, wq, ws, wf), mmapped back read-only
    <key>/last_used          touched on every HIT (its mtime is "last used")

No pickle: arrays are raw bytes described by (dtype, shape) from a fixed set, the rest is JSON.

Writes are atomic. A new entry is written under ``.tmp.<key>.<host>.<pid>.<rand>`` in the same
directory (arrays fsynced, the manifest last), then moved into place with one ``os.replace``. On a
MISS the build itself writes the weight arrays into that directory as it packs them (streams:
compile_graph's ``workdir``), so they are never whole in memory. A
reader only trusts a directory named ``<key>`` whose manifest parses, carries this format version
and this key, agrees with its own checksum, was built for exactly the inputs of this load, and
whose arrays have the recorded sizes and checksums. Anything else (a truncated file, a flipped
bit, an entry from another version or machine) is moved aside and rebuilt with a one-line notice.
Two processes building the same key both succeed: the first rename wins, the loser keeps the
winner's entry. A process killed mid-write leaves only a ``.tmp.*`` directory, which is never
read and is swept once its process is gone (or after an hour).

The root is ``cache_dir``, else ``$CPULLM_CACHE_DIR``, else ``~/.cache/cpullm``.

The cache is untrusted input. It is used only when its root and ``exec/`` directory belong to the
user and no one else can write to them (else the load compiles without it and says why); every
entry is a real directory, every file in it a regular file (not a symlink, not a FIFO: opened
with O_NOFOLLOW | O_NONBLOCK) of exactly the size the manifest states, checked on the open file
descriptor that is then mapped, so a short file can never be mapped past its end.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import socket
import stat
import time
import uuid
from pathlib import Path

import numpy as np
from numba import njit

from .. import limits
from .compiler import Program
from ..errors import CacheError

FORMAT_VERSION = 5          # 4: wq may hold raw ggml blocks (meta block_bytes); 5: q8 weights in panels
MANIFEST = "manifest.json"
ARRAY_NAMES = ("I", "F", "wq", "ws", "wf")
_DTYPES = {"<i8", "<f8", "|i1", "<u2", "<f4"}
_META_KEYS = ("first_head", "vocab", "arena_floats", "state_floats", "state_regions", "max_chunk",
              "n_ctx", "head_rows", "logits_offset", "max_k", "external", "groups")
_STALE_TMP_S = 3600
_LANES = 256
# Test hook only: seconds to sleep inside write_entry after the first array, so a test can kill
# the writing process mid-write. Never set it otherwise.
_TEST_WRITE_DELAY_ENV = "CPULLM_TEST_CACHE_WRITE_DELAY"


def cache_root(cache_dir=None) -> Path:
    root = cache_dir or os.environ.get("CPULLM_CACHE_DIR") or Path.home() / ".cache" / "cpullm"
    return Path(os.path.expanduser(str(root)))


def exec_dir(cache_dir=None) -> Path:
    return cache_root(cache_dir) / "exec"


def unsafe_root_reason(root: Path) -> str | None:
    """Why the cache under ``root`` must not be trusted, or None when it is safe.

    ``root`` and ``root/exec`` (those that exist) must be directories owned by this user that no
    one else can write to: not writable by others, and group-writable only when the group is the
    user's own primary group (the per-user group of a umask-002 system). Otherwise another account
    could plant a forged entry.
    """
    if not hasattr(os, "geteuid"):   # pragma: no cover - no POSIX ownership to check
        return None
    for path, follow in ((root, True), (root / "exec", False)):
        try:
            st = os.stat(path) if follow else os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):   # nothing there to trust; writing fails with its own notice
            continue
        except OSError as exc:
            return f"unreadable ({path}: {exc.strerror})"
        if not stat.S_ISDIR(st.st_mode):   # holds no entries; writing there fails with its own notice
            continue
        if st.st_uid != os.geteuid():
            return f"owned by another user (uid {st.st_uid}: {path})"
        if st.st_mode & stat.S_IWOTH or (st.st_mode & stat.S_IWGRP and st.st_gid != os.getegid()):
            return f"writable by other users (mode {stat.filemode(st.st_mode)}: {path})"
    return None


# ---- checksums --------------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def _lane_hashes(words, n_lanes, lane0, lane1, out):
    """Order-dependent 64-bit hashes of runs lane0 .. lane1 - 1 of ``n_lanes`` contiguous runs of
    uint64 words, four interleaved chains per run, into out[4 lane0: 4 lane1]. Each step
    ``s = (s ^ w) * P`` is a bijection of s, so any change of any word changes that chain's result.
    Serial and without the GIL: :func:`_all_lane_hashes` splits the lanes over threads (a prange
    version took 1.6 s of CPU to compile, this one 0.5, on a cold start's critical path)."""
    n = words.size
    per = (n + n_lanes - 1) // n_lanes
    p = np.uint64(0x100000001B3)
    for lane in range(lane0, lane1):
        a = min(n, lane * per)
        b = min(n, a + per)
        s0 = np.uint64(0x9E3779B97F4A7C15) * np.uint64(4 * lane + 1)
        s1 = np.uint64(0x9E3779B97F4A7C15) * np.uint64(4 * lane + 2)
        s2 = np.uint64(0x9E3779B97F4A7C15) * np.uint64(4 * lane + 3)
        s3 = np.uint64(0x9E3779B97F4A7C15) * np.uint64(4 * lane + 4)
        i = a
        while i + 4 <= b:
            s0 = (s0 ^ words[i]) * p
            s1 = (s1 ^ words[i + 1]) * p
            s2 = (s2 ^ words[i + 2]) * p
            s3 = (s3 ^ words[i + 3]) * p
            i += 4
        while i < b:
            s0 = (s0 ^ words[i]) * p
            i += 1
        out[4 * lane] = s0
        out[4 * lane + 1] = s1
        out[4 * lane + 2] = s2
        out[4 * lane + 3] = s3


_THREADED_WORDS = 1 << 17
"""Arrays of fewer uint64 words (1 MiB) are hashed on the calling thread alone."""


def _all_lane_hashes(words: np.ndarray) -> np.ndarray:
    """The :data:`_LANES` lane hashes of ``words``, split over as many threads as numba's
    thread count on the calling thread (the count the caller set)."""
    import numba
    out = np.zeros(_LANES * 4, np.uint64)
    parts = max(1, min(numba.get_num_threads(), _LANES)) if words.size >= _THREADED_WORDS else 1
    bounds = [_LANES * p // parts for p in range(parts + 1)]
    futures = []
    if parts > 1:
        from cpullm_kernels.rows.q8 import worker_pool
        pool = worker_pool(parts - 1)
        futures = [pool.submit(_lane_hashes, words, _LANES, bounds[p], bounds[p + 1], out) for p in range(1, parts)]
    _lane_hashes(words, _LANES, bounds[0], bounds[1], out)
    for f in futures:
        f.result()
    return out


def checksum(arr: np.ndarray) -> str:
    """Checksum of an array's bytes (memory bandwidth bound, parallel); any flipped bit, swapped
    block or truncation changes it. For damage detection, not against an adversary."""
    raw = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    n8 = raw.size // 8 * 8
    h = hashlib.blake2b(digest_size=16)
    if n8:
        words = raw[:n8].view(np.uint64)
        words.flags.writeable = False      # one compiled specialization for fresh and mapped arrays
        h.update(_all_lane_hashes(words).tobytes())
    h.update(raw[n8:].tobytes())
    h.update(str(raw.size).encode())
    return h.hexdigest()


def _json_default(x):
    """numpy scalars and arrays in program meta become plain JSON numbers and lists."""
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"{type(x).__name__} is not JSON-serializable")


def json_sha(obj) -> str:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=_json_default)
    return hashlib.sha256(text.encode()).hexdigest()


# ---- key ----------------------------------------------------------------------------------------
def cpu_features() -> str:
    try:
        import llvmlite.binding as llvm
        return f"{llvm.get_host_cpu_name()}:{llvm.get_host_cpu_features().flatten()}"
    except Exception:  # pragma: no cover - llvmlite always present with numba
        return platform.processor()


def versions() -> dict:
    """Version sources, read at call time (so a test can monkeypatch each one)."""
    import sys

    import numba

    import cpullm_kernels as kernels

    return {"cpullm_version": sys.modules["cpullm"].__version__,
            "kernels_version": kernels.KERNELS_VERSION,
            "numba_version": numba.__version__,
            "numpy_version": np.__version__}


def config_sha(config: dict) -> str:
    clean = {k: v for k, v in config.items() if not k.startswith("_")}
    return hashlib.sha256(json.dumps(clean, sort_keys=True, default=str).encode()).hexdigest()


def cache_key_inputs(*, config, family, graph, weights, store, quant, n_ctx, max_chunk, kernels,
                     kv_dtype="f32") -> dict:
    """Everything that, when it changes, must give a new entry."""
    from .compiler import context_free, graph_hash
    from .kvformat import cache_key_name

    v = versions()
    return {
        "format_version": FORMAT_VERSION,
        "cpullm_version": v["cpullm_version"],
        "plugin": family.plugin,
        "plugin_version": family.plugin_version,
        "family": family.name,
        "config_sha": config_sha(config),
        "weights_identity": store.identity(),
        "weight_map_sha": hashlib.sha256(json.dumps(weights.fingerprint()).encode()).hexdigest(),
        "graph_sha": graph_hash(graph),
        "quant": quant,
        # one entry for every context length: the KV regions are sized at load (with_context)
        "n_ctx": "any" if context_free(graph) else n_ctx,
        "kv_dtype": cache_key_name(kv_dtype),   # the KV regions' layout and the ATTENTION rows' format column
        "max_chunk": max_chunk,
        "kernels_version": v["kernels_version"],
        "plugin_kernels": sorted([k.name, k.version, k.plugin] for k in kernels),
        "numba_version": v["numba_version"],
        "numpy_version": v["numpy_version"],
        "cpu": cpu_features(),
    }


def _canonical(inputs: dict) -> dict:
    return json.loads(json.dumps(inputs, default=str))


def key_of(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:32]


# ---- writing --------------------------------------------------------------------------------------
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _fsync_dir(path: Path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def new_tmp_dir(root: Path, key: str) -> Path:
    """A fresh temporary entry directory (``.tmp.<key>.<host>.<pid>.<rand>``) under ``root``:
    a build can write its arrays straight into it (compile_graph's ``workdir``)."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = root / f".tmp.{key}.{_HOST}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def write_entry(root: Path, key: str, program: Program, inputs: dict, model_dir, tmp: Path | None = None) -> Path:
    """Write atomically; if another process won the race, keep its entry. ``tmp``: the
    temporary directory (:func:`new_tmp_dir`) the build already wrote some arrays into (as
    ``<name>.bin``, mapped by cpullm.compile.filearrays): those are synced and kept, not copied."""
    from .filearrays import backing_path

    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    sweep(root)
    final = root / key
    tmp = new_tmp_dir(root, key) if tmp is None else tmp
    try:
        table = {}
        delay = float(os.environ.get(_TEST_WRITE_DELAY_ENV) or 0)
        for name in ARRAY_NAMES:
            arr = program.arrays[name]
            path = tmp / f"{name}.bin"
            in_place = backing_path(arr) == str(path)
            arr = np.ascontiguousarray(arr)
            if arr.dtype.str not in _DTYPES:
                raise ValueError(f"array {name} has dtype {arr.dtype}, not storable")
            with open(path, "rb" if in_place else "wb") as fh:
                if not in_place:
                    arr.reshape(-1).view(np.uint8).tofile(fh)
                    fh.flush()
                os.fsync(fh.fileno())
            table[name] = {"dtype": arr.dtype.str, "shape": list(arr.shape), "checksum": checksum(arr)}
            if delay:
                time.sleep(delay)
        manifest = {"format_version": FORMAT_VERSION, "key": key, "inputs": _canonical(inputs),
                    "model_dir": str(Path(model_dir).resolve()), "created": time.time(),
                    "arrays": table,
                    "program_meta": json.loads(json.dumps(program.meta, default=_json_default))}
        manifest["manifest_sha"] = json_sha(manifest)
        with open(tmp / MANIFEST, "w") as fh:
            json.dump(manifest, fh)
            fh.flush()
            os.fsync(fh.fileno())
        touch_no_follow(tmp / "last_used")
        _fsync_dir(tmp)
        try:
            os.replace(tmp, final)
        except OSError:
            # The name is taken: by a concurrent writer's complete entry (keep it), or by a
            # broken leftover (move it aside, then take the name).
            if _read_manifest(final) is None:
                _discard(final)
                os.replace(tmp, final)
        _fsync_dir(root)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return True
    return True


def sweep(root: Path) -> int:
    """Remove leftovers: temporary directories of writers that are gone (same host) or that no one
    wrote to for an hour, and entries moved aside as damaged."""
    n = 0
    now = time.time()
    for p in list(root.glob(".tmp.*")) + list(root.glob(".trash.*")) if root.is_dir() else []:
        try:
            parts = p.name.split(".")
            dead = False
            if parts[1] == "tmp" and len(parts) >= 6 and parts[3] == _HOST and parts[4].isdigit():
                dead = not _pid_alive(int(parts[4]))
            if parts[1] == "trash" or dead or now - _last_write(p) > _STALE_TMP_S:
                shutil.rmtree(p, ignore_errors=True)
                n += 1
        except (OSError, IndexError):
            pass
    return n


def _last_write(path: Path) -> float:
    """The latest mtime of a temporary directory and its files: a build writes its arrays there
    for minutes, so a live writer's directory stays fresh however long it takes."""
    t = path.stat().st_mtime
    for f in path.iterdir() if path.is_dir() else []:
        try:
            t = max(t, f.stat().st_mtime)
        except OSError:
            pass
    return t


def _discard(entry: Path):
    """Move a bad entry out of the way atomically (readers never see it half deleted), then
    delete it."""
    trash = entry.parent / f".trash.{entry.name}.{uuid.uuid4().hex[:8]}"
    try:
        os.replace(entry, trash)
    except FileNotFoundError:
        return
    except OSError:
        trash = entry
    if trash.is_dir() and not trash.is_symlink():
        shutil.rmtree(trash, ignore_errors=True)
    else:
        try:
            trash.unlink()
        except OSError:
            pass


# ---- reading --------------------------------------------------------------------------------------
def _load_manifest_json(entry: Path):
    """The manifest's JSON, read as untrusted: a regular file (O_NOFOLLOW | O_NONBLOCK, so a
    FIFO cannot hang the load), bounded in size. None when it cannot be read or parsed."""
    try:
        return limits.read_json_file(entry / MANIFEST, follow_symlinks=False, allow_nan=True)
    except (OSError, ValueError):
        return None


def _read_manifest(entry: Path):
    """The parsed manifest if it is complete and self-consistent, else None."""
    m = _load_manifest_json(entry)
    if not isinstance(m, dict) or "manifest_sha" not in m:
        return None
    sha = m.pop("manifest_sha")
    return m if sha == json_sha(m) else None


def _check_manifest(m: dict, key: str):
    if m.get("format_version") != FORMAT_VERSION:
        raise CacheError(f"format version {m.get('format_version')} != {FORMAT_VERSION}")
    if m.get("key") != key:
        raise CacheError(f"manifest is for key {str(m.get('key'))[:12]}, not {key[:12]} (foreign entry)")
    arrays, meta = m.get("arrays"), m.get("program_meta")
    if not isinstance(arrays, dict) or sorted(arrays) != sorted(ARRAY_NAMES):
        raise CacheError("manifest array table is malformed")
    for name, info in arrays.items():
        shape = info.get("shape") if isinstance(info, dict) else None
        if (not isinstance(info, dict) or info.get("dtype") not in _DTYPES or not isinstance(shape, list)
                or len(shape) > limits.MAX_DIMS or limits.checked_product(shape) is None
                or not isinstance(info.get("checksum"), str)):
            raise CacheError(f"manifest entry for {name} is malformed")
    if not isinstance(meta, dict) or any(k not in meta for k in _META_KEYS):
        raise CacheError("manifest program meta is incomplete")
    sizes = [meta[k] for k in ("first_head", "vocab", "arena_floats", "state_floats", "max_chunk",
                               "n_ctx", "head_rows", "logits_offset", "max_k")]
    if not all(limits.is_int(v) and 0 <= v <= limits.MAX_TENSOR_ELEMENTS for v in sizes):
        raise CacheError("manifest program meta holds a size that is not a sane integer")


def read_entry(entry: Path, expect_inputs: dict | None = None, mmap: bool = True) -> Program:
    """Map an entry back (read-only arrays); raise CacheError naming what is wrong."""
    try:
        if not stat.S_ISDIR(os.lstat(entry).st_mode):
            raise CacheError("the entry is not a directory")
    except OSError as exc:
        raise CacheError(f"the entry cannot be read ({exc.strerror})") from None
    raw = _load_manifest_json(entry)
    if not isinstance(raw, dict):
        raise CacheError("manifest missing or unreadable")
    if raw.get("format_version") != FORMAT_VERSION:
        raise CacheError(f"format version {raw.get('format_version')} != {FORMAT_VERSION}")
    m = _read_manifest(entry)
    if m is None:
        raise CacheError("manifest fails its checksum (damaged)")
    _check_manifest(m, entry.name)
    if expect_inputs is not None and m.get("inputs") != _canonical(expect_inputs):
        raise CacheError("entry was built for other inputs (foreign entry)")
    arrays = {}
    for name in ARRAY_NAMES:
        info = m["arrays"][name]
        arr = _read_array(entry / f"{name}.bin", np.dtype(info["dtype"]), tuple(info["shape"]), mmap)
        if checksum(arr) != info["checksum"]:
            raise CacheError(f"{name}.bin fails its checksum (damaged)")
        arr.flags.writeable = False      # the same (read-only) array types however it was read
        arrays[name] = arr
    try:
        check_program_bounds(arrays, m["program_meta"])
    except (TypeError, ValueError, KeyError, IndexError, OverflowError) as exc:   # a field of a wrong type
        raise CacheError(f"the program meta is malformed ({type(exc).__name__})") from None
    touch_no_follow(entry / "last_used")
    return Program(arrays=arrays, meta=m["program_meta"])


def check_program_bounds(arrays: dict, meta: dict) -> None:
    """Every offset and size the kernels index with, checked against the arrays they index: an
    entry's checksums prove nothing against whoever can write the cache (they are recomputed),
    and the compiled kernels do not bounds-check. An arena or state operand must lie inside
    ``arena_floats`` / ``state_floats`` for every row a step runs, a float32 or int8 matrix
    inside ``wf`` / ``wq`` / ``ws``, an input no wider than the quantization scratch
    (``max_k``), every state region inside the state. Raises CacheError naming the first
    instruction that reaches out."""
    from cpullm_kernels.program import program_table as P

    I, F = arrays["I"], arrays["F"]
    if I.ndim != 2 or I.shape[1] != P.NI or I.dtype != np.int64 or F.shape != (I.shape[0], P.NF):
        raise CacheError("the instruction table has the wrong shape")
    arena, state = meta["arena_floats"], meta["state_floats"]
    body_rows, head_rows = max(1, meta["max_chunk"]), max(1, meta["head_rows"])
    nq, ns, nf = arrays["wq"].size, arrays["ws"].size, arrays["wf"].size
    sizes = {"wq": nq, "ws": ns, "wf": nf}
    regions = meta["state_regions"]
    if not isinstance(regions, list) or not all(
            isinstance(g, dict) and limits.is_int(g.get("offset")) and limits.is_int(g.get("floats"))
            and 0 <= g["offset"] and 0 <= g["floats"] and g["offset"] + g["floats"] <= state for g in regions):
        raise CacheError("a state region lies outside the state")
    region_at = {g["offset"]: g["floats"] for g in regions}
    if not limits.is_int(meta.get("embed_rows", 0)) or meta.get("embed_rows", 0) < 0:
        raise CacheError("the program meta's embed_rows is not a size")
    if meta["logits_offset"] + meta["vocab"] > arena:
        raise CacheError("the logits lie outside the arena")

    def fail(r, what):
        raise CacheError(f"instruction {r} reaches outside its arrays ({what})")

    def arena_ok(r, off, st, width, what, rows=None):
        rows = rows or (head_rows if I[r, P.COL_SECTION] == P.SECTION_HEAD else body_rows)
        if off < 0 or st < 0 or width < 0 or off + (rows - 1) * st + width > arena:
            fail(r, what)

    def inside(r, off, n, size, what):
        if off < 0 or n < 0 or off + n > size:
            fail(r, what)

    for r in range(I.shape[0]):
        row = [int(v) for v in I[r]]
        op = row[P.COL_OP]
        if row[P.COL_IMPL] == P.IMPL_PLUGIN_OP:
            continue                     # run from meta["plugin_ops"] by the plugin's own code
        if op == P.OP_LINEAR:
            K, N, kind, Kp = row[P.LINEAR_K], row[P.LINEAR_N], row[P.LINEAR_KIND], row[P.LINEAR_KP]
            arena_ok(r, row[P.LINEAR_X_OFF], row[P.LINEAR_X_ST], K, "input")
            arena_ok(r, row[P.LINEAR_OUT_OFF], row[P.LINEAR_OUT_ST], N, "output")
            _matrix_inside(r, kind, N, K, Kp, row[P.LINEAR_W_OFF], row[P.LINEAR_S_OFF], meta["max_k"], sizes,
                           inside, fail, "matrix")
            if row[P.LINEAR_BIAS_OFF] >= 0:
                inside(r, row[P.LINEAR_BIAS_OFF], N, nf, "bias")
        elif op == P.OP_EMBED:
            H = row[P.EMBED_WIDTH]
            arena_ok(r, row[P.EMBED_OUT_OFF], row[P.EMBED_OUT_ST], H, "output")
            n_rows = int(meta.get("embed_rows") or meta["vocab"])
            _matrix_inside(r, row[P.EMBED_KIND], n_rows, H, row[P.EMBED_KP], row[P.EMBED_W_OFF], row[P.EMBED_S_OFF],
                           None, sizes, inside, fail, "embedding")
        elif op in (P.OP_RMSNORM, P.OP_LAYERNORM):
            w = row[P.NORM_WIDTH]
            arena_ok(r, row[P.NORM_X_OFF], row[P.NORM_X_ST], w, "input")
            arena_ok(r, row[P.NORM_OUT_OFF], row[P.NORM_OUT_ST], w, "output")
            g = row[P.NORM_GROUP]
            if g <= 0 or w % g:
                fail(r, "norm group")
            if row[P.NORM_W_OFF] >= 0:
                inside(r, row[P.NORM_W_OFF], g if g != w else w, nf, "norm weight")
        elif op == P.OP_ROPE:
            w = row[P.ROPE_N_HEADS] * row[P.ROPE_HEAD_DIM]
            if not 0 <= row[P.ROPE_ROTARY_DIM] <= row[P.ROPE_HEAD_DIM]:
                fail(r, "rotary width")
            arena_ok(r, row[P.ROPE_X_OFF], row[P.ROPE_X_ST], w, "input")
            arena_ok(r, row[P.ROPE_OUT_OFF], row[P.ROPE_OUT_ST], w, "output")
            inside(r, row[P.ROPE_FREQ_OFF], row[P.ROPE_ROTARY_DIM] // 2, nf, "frequencies")
        elif op == P.OP_ATTENTION:
            nh, nkv, hd, cap = (row[P.ATTENTION_N_HEADS], row[P.ATTENTION_N_KV_HEADS],
                                row[P.ATTENTION_HEAD_DIM], row[P.ATTENTION_CAP])
            if nh <= 0 or nkv <= 0 or hd <= 0 or cap <= 0 or nh % nkv:
                fail(r, "heads")
            arena_ok(r, row[P.ATTENTION_Q_OFF], row[P.ATTENTION_Q_ST], nh * hd, "queries")
            arena_ok(r, row[P.ATTENTION_K_OFF], row[P.ATTENTION_K_ST], nkv * hd, "keys")
            arena_ok(r, row[P.ATTENTION_V_OFF], row[P.ATTENTION_V_ST], nkv * hd, "values")
            arena_ok(r, row[P.ATTENTION_OUT_OFF], row[P.ATTENTION_OUT_ST], nh * hd, "output")
            from .kvformat import format_name, region_floats
            fmt = format_name(row[P.ATTENTION_KV_FORMAT])
            if fmt is None or (fmt == "q8_0" and cap % 16):
                fail(r, "KV cache format")
            need = region_floats(nkv, cap, hd, fmt)
            if region_at.get(row[P.ATTENTION_CACHE_OFF], -1) < need:
                fail(r, "KV cache region")
        elif op == P.OP_GLU:
            w = row[P.GLU_WIDTH]
            arena_ok(r, row[P.GLU_GATE_OFF], row[P.GLU_GATE_ST], w, "gate")
            arena_ok(r, row[P.GLU_UP_OFF], row[P.GLU_UP_ST], w, "up")
            arena_ok(r, row[P.GLU_OUT_OFF], row[P.GLU_OUT_ST], w, "output")
        elif op in (P.OP_ADD, P.OP_SIGMOID_MUL):
            w = row[P.BINARY_WIDTH]
            arena_ok(r, row[P.BINARY_A_OFF], row[P.BINARY_A_ST], w, "first input")
            arena_ok(r, row[P.BINARY_B_OFF], row[P.BINARY_B_ST], w, "second input")
            arena_ok(r, row[P.BINARY_OUT_OFF], row[P.BINARY_OUT_ST], w, "output")
        elif op in (P.OP_SOFTCAP, P.OP_SCALE, P.OP_SELECT_ROWS):
            w = row[P.UNARY_WIDTH]           # SELECT_ROWS: the head's rows taken from a body value
            arena_ok(r, row[P.UNARY_X_OFF], row[P.UNARY_X_ST], w, "input",
                     rows=body_rows if op == P.OP_SELECT_ROWS else None)
            arena_ok(r, row[P.UNARY_OUT_OFF], row[P.UNARY_OUT_ST], w, "output")
        elif op == P.OP_GATED_DELTA:
            nk, dk, nv, dv = (row[P.GATED_DELTA_NK], row[P.GATED_DELTA_DK], row[P.GATED_DELTA_NV],
                              row[P.GATED_DELTA_DV])
            if min(nk, dk, nv, dv, row[P.GATED_DELTA_CONV_K]) <= 0:
                fail(r, "heads")
            arena_ok(r, row[P.GATED_DELTA_QKV_OFF], row[P.GATED_DELTA_QKV_ST], 2 * nk * dk + nv * dv, "qkv")
            arena_ok(r, row[P.GATED_DELTA_Z_OFF], row[P.GATED_DELTA_Z_ST], nv * dv, "z")
            arena_ok(r, row[P.GATED_DELTA_B_OFF], row[P.GATED_DELTA_B_ST], nv, "b")
            arena_ok(r, row[P.GATED_DELTA_A_OFF], row[P.GATED_DELTA_A_ST], nv, "a")
            arena_ok(r, row[P.GATED_DELTA_OUT_OFF], row[P.GATED_DELTA_OUT_ST], nv * dv, "output")
            if row[P.GATED_DELTA_STATE_OFF] not in region_at:
                fail(r, "recurrent state region")
            for c in (P.GATED_DELTA_CONV_W_OFF, P.GATED_DELTA_DT_OFF, P.GATED_DELTA_ALOG_OFF,
                      P.GATED_DELTA_NORM_OFF):
                inside(r, row[c], 1, nf, "parameters")
        elif op == P.OP_MOE:
            _check_moe(r, row, meta, arena_ok, inside, fail, nq, ns, nf)
        elif op in (P.OP_ACT, P.OP_POS_EMBED):
            w = row[P.UNARY_WIDTH]
            arena_ok(r, row[P.UNARY_X_OFF], row[P.UNARY_X_ST], w, "input")
            arena_ok(r, row[P.UNARY_OUT_OFF], row[P.UNARY_OUT_ST], w, "output")
            if op == P.OP_ACT and not 0 <= row[P.ACT_KIND] <= 3:
                fail(r, "activation kind")
            if op == P.OP_POS_EMBED:
                if not 0 <= row[P.POS_OFFSET] < row[P.POS_ROWS] or row[P.POS_ROWS] - row[P.POS_OFFSET] < meta["n_ctx"]:
                    fail(r, "position table rows")
                inside(r, row[P.POS_TABLE_OFF], row[P.POS_ROWS] * w, nf, "position table")
        else:
            fail(r, f"unknown opcode {op}")


def _check_moe(r, row, meta, arena_ok, inside, fail, nq, ns, nf) -> None:
    """A MOE row and its ``meta["moe"]`` entry (kernels.moe): operands in the arena, every expert
    matrix inside its blob as a LINEAR's would be, router and shared gate inside ``wf``."""
    from cpullm_kernels.program import moe as M
    from cpullm_kernels.program import program_table as P

    call = (meta.get("moe") or {}).get(str(r))
    prm = call.get("prm") if isinstance(call, dict) else None
    table = call.get("table") if isinstance(call, dict) else None
    if (not isinstance(prm, list) or len(prm) != M.NPRM or not all(type(v) is int for v in prm)
            or not isinstance(table, list)):
        fail(r, "routed experts entry")
    H, E, k, inter, S = (prm[c] for c in (M.PRM_H, M.PRM_E, M.PRM_K, M.PRM_I, M.PRM_SHARED_I))
    if (H != row[P.MOE_WIDTH] or not 0 < k <= E or inter <= 0 or S < 0 or len(table) != E + (S > 0)
            or prm[M.PRM_ROUTING] not in M.ROUTINGS.values() or prm[M.PRM_ACT] != P.GLU_ACT_SILU
            or (prm[M.PRM_X_OFF], prm[M.PRM_X_ST], prm[M.PRM_OUT_OFF], prm[M.PRM_OUT_ST])
            != (row[P.MOE_X_OFF], row[P.MOE_X_ST], row[P.MOE_OUT_OFF], row[P.MOE_OUT_ST])):
        fail(r, "routed experts sizes")
    arena_ok(r, row[P.MOE_X_OFF], row[P.MOE_X_ST], H, "input")
    arena_ok(r, row[P.MOE_OUT_OFF], row[P.MOE_OUT_ST], H, "output")
    inside(r, prm[M.PRM_ROUTER_OFF], E * H, nf, "router")
    if prm[M.PRM_SHARED_GATE_OFF] >= 0:
        inside(r, prm[M.PRM_SHARED_GATE_OFF], H, nf, "shared expert gate")
    for e, ex in enumerate(table):
        if not isinstance(ex, list) or len(ex) != M.NTABLE or not all(type(v) is int for v in ex):
            fail(r, "expert table")
        width = inter if e < E else S
        for c, N, K in ((M.TABLE_GATE, width, H), (M.TABLE_UP, width, H), (M.TABLE_DOWN, H, width)):
            kind, w_off, s_off, Kp = ex[c: c + 4]
            _matrix_inside(r, kind, N, K, Kp, w_off, s_off, meta["max_k"], {"wq": nq, "ws": ns, "wf": nf}, inside,
                           fail, "expert matrix")


def _matrix_inside(r, kind, N, K, Kp, w_off, s_off, max_k, sizes, inside, fail, what) -> None:
    """A stored matrix (N, K) of weight ``kind`` (cpullm_kernels.program.formats) is one its format
    can hold, every span of it inside its array (``sizes``: array -> elements), its rows no longer
    than the activations' scratch (``max_k``; None: an EMBED table, read by rows)."""
    from cpullm_kernels.program.formats import FORMATS
    fmt = FORMATS.get(kind)
    if fmt is None:
        fail(r, f"{what}: weight kind")
    spans = fmt.spans(N, K, Kp, w_off, s_off)
    if spans is None or (max_k is not None and Kp > max_k):
        fail(r, f"{what}: width or format")
    for name, off, n in spans:
        inside(r, off, n, sizes[name], f"{what} ({name})")


def touch_no_follow(path: Path) -> None:
    """Set ``path``'s times to now, creating it; a symlink there (planted to make cpullm touch
    another file) is left alone, as is any error: the time only orders ``cache clear``."""
    flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError:
        return
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.utime(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _read_array(path: Path, dtype: np.dtype, shape: tuple, mmap: bool) -> np.ndarray:
    """One array file: opened without following a symlink or blocking on a FIFO, its size checked
    on that open descriptor against the manifest's shape, then mapped (or read) from it: the
    mapping can never reach past the end of the file it was checked on."""
    count = limits.checked_product(shape)      # the manifest was checked: never None here
    name = path.name
    try:
        fh, size = limits.open_regular(path, follow_symlinks=False)
    except FileNotFoundError:
        raise CacheError(f"{name} is missing") from None
    except OSError as exc:
        raise CacheError(f"{name} cannot be read ({exc.strerror or exc})") from None
    with fh:
        if size != count * dtype.itemsize:
            raise CacheError(f"{name} has {size} bytes, expected {count * dtype.itemsize} (truncated)")
        try:
            if count == 0:
                return np.zeros(shape, dtype)
            if mmap:
                return np.asarray(np.memmap(fh, dtype=dtype, mode="r", shape=shape))
            return np.fromfile(fh, dtype=dtype, count=count).reshape(shape)
        except (OSError, ValueError) as exc:
            raise CacheError(f"{name} cannot be read ({exc})") from None


# ---- load -----------------------------------------------------------------------------------------
def _explain_miss(root: Path, inputs: dict, model_dir) -> tuple[str, list[Path]]:
    """Why there is no entry: the inputs that differ from the nearest entry of the same model
    directory, and the entries superseded for good (built from weight files that changed)."""
    here = str(Path(model_dir).resolve())
    canon = _canonical(inputs)
    best, superseded = None, []
    for p in root.iterdir() if root.is_dir() else []:
        if p.name.startswith(".") or not p.is_dir():
            continue
        m = _read_manifest(p)
        if not m or m.get("model_dir") != here or not isinstance(m.get("inputs"), dict):
            continue
        old = m["inputs"]
        changed = sorted(k for k in set(canon) | set(old) if old.get(k) != canon.get(k))
        if not changed:
            continue
        if "weights_identity" in changed or (changed == ["n_ctx"] and canon.get("n_ctx") == "any"):
            superseded.append(p)        # unusable for good, or one program per context: replaced
        if best is None or len(changed) < len(best):
            best = changed
    return ("changed: " + ", ".join(best) if best else "no entry"), superseded


def load_or_build(build, *, model_dir, config, family, graph, weights, store, quant, n_ctx,
                  max_chunk, kernels, cache_dir=None, use_cache=True, mmap=True, kv_dtype="f32"):
    """(program, "HIT" | "MISS (reason)"). A HIT runs neither the quantizer nor the compiler.
    An entry serves every context length (unless a RoPE scaling depends on it): the program
    read is resized to ``n_ctx`` by :func:`cpullm.compile.compiler.with_context`."""
    from .compiler import with_context
    from ..notices import notice

    inputs = cache_key_inputs(config=config, family=family, graph=graph, weights=weights, store=store,
                              quant=quant, n_ctx=n_ctx, max_chunk=max_chunk, kernels=kernels, kv_dtype=kv_dtype)
    key = key_of(inputs)
    unsafe = unsafe_root_reason(cache_root(cache_dir))
    if unsafe is not None:
        notice(f"ignoring the execution cache under {cache_root(cache_dir)}: it is {unsafe}; compiling "
               "without it (fix its owner or `chmod go-w` it, or set --cache-dir / CPULLM_CACHE_DIR "
               "to a directory of your own)")
        return build(), f"OFF (unsafe cache root: {unsafe})"
    root = exec_dir(cache_dir)
    entry = root / key
    reason, superseded = None, []
    if os.path.lexists(entry):
        try:
            return with_context(read_entry(entry, inputs, mmap=mmap), n_ctx), "HIT"
        except CacheError as exc:
            reason = f"damaged entry: {exc}"
            notice(f"execution cache entry {key[:12]} is unusable ({exc}); rebuilding it")
            _discard(entry)
    if reason is None:
        reason, superseded = _explain_miss(root, inputs, model_dir)
    try:     # the build writes its weight arrays straight into the entry-to-be (streams)
        tmp = new_tmp_dir(root, key)
    except OSError:
        tmp = None
    try:
        program = build(tmp)
    except OSError as exc:
        # the build streams its weights into the entry-to-be: a full disk (or quota, or file
        # size limit) there ends that, not the load; build in memory instead
        if tmp is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        notice(f"could not write the execution cache under {root} ({exc.strerror or exc}); building in "
               "memory and continuing without it (free space there, or set --cache-dir or "
               "CPULLM_CACHE_DIR to a writable directory)")
        return build(None), f"MISS ({reason}; not cached: {exc.strerror or exc})"
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        write_entry(root, key, program, inputs, model_dir, tmp=tmp)
        for old in superseded:         # built from weight files that no longer exist
            _discard(old)
        if mmap or tmp is not None:
            # run from the entry, so a MISS and a HIT behave the same; the build's own mappings
            # go first, or RSS would count the pages of both
            program = _drop(program)
            program = with_context(read_entry(root / key, inputs, mmap=mmap), n_ctx)
    except (OSError, CacheError, TypeError, ValueError) as exc:
        notice(f"could not write the execution cache under {root} ({exc}); continuing without it "
               f"(set --cache-dir or CPULLM_CACHE_DIR to a writable directory)")
        if program is None:
            program = build(None)
    return program, f"MISS ({reason})"


def _drop(program: Program) -> None:
    """Release a program's mapped arrays (their resident pages) and collect it."""
    import gc

    from .filearrays import release
    for arr in program.arrays.values():
        release(arr)
    program.arrays.clear()
    gc.collect()
    return None


# ---- listing / clearing ---------------------------------------------------------------------------
def _du(path: Path) -> int:
    total = 0
    for f in path.rglob("*"):
        try:
            if f.is_file():
                total += f.stat().st_size
        except OSError:
            pass
    return total


def list_entries(cache_dir=None) -> list[dict]:
    out = []
    root = exec_dir(cache_dir)
    for p in sorted(root.iterdir()) if root.is_dir() else []:
        if not p.is_dir() or p.name.startswith("."):
            continue
        m = _read_manifest(p)
        valid = m is not None
        if m is not None:
            try:
                _check_manifest(m, p.name)
            except CacheError:
                valid = False
        m = m or {}
        inputs = m.get("inputs") if isinstance(m.get("inputs"), dict) else {}
        lu = p / "last_used"
        try:
            last_used = lu.lstat().st_mtime
        except OSError:
            last_used = None
        out.append({"key": p.name, "model": m.get("model_dir"), "family": inputs.get("family"),
                    "quant": inputs.get("quant"), "n_ctx": inputs.get("n_ctx"),
                    "size_bytes": _du(p), "created": m.get("created"), "last_used": last_used,
                    "cpullm_version": inputs.get("cpullm_version"), "valid": valid, "path": str(p)})
    return out


def _matches(entry_model: str | None, model: str) -> bool:
    if not entry_model:
        return False
    p = Path(os.path.expanduser(model))
    if p.exists():
        return str(p.resolve()) == entry_model
    return Path(entry_model).name == model or entry_model == model


def clear(cache_dir=None, model: str | None = None) -> int:
    """Delete entries (all, or those of one model directory or name); returns how many."""
    n = 0
    root = exec_dir(cache_dir)
    for e in list_entries(cache_dir):
        if model is None or _matches(e["model"], model):
            _discard(Path(e["path"]))
            n += 1
    sweep(root)
    return n
