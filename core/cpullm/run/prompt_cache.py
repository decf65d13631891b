"""Prompt cache: save the per-layer state after a prompt; restore it when a later prompt starts
with the same tokens, so only the rest is prefilled (``cpullm run --prompt-cache FILE``,
``model.use_prompt_cache(path)`` / ``model.save_prompt_cache()``).

What can be restored depends on the layer kind:

* full attention: position p lives in slot p, so the keys and values of any prefix are exact.
  The file holds positions [0, n) of the prompt; a new prompt sharing its first k tokens reuses
  min(k, len(new) - 1) of them (one token always runs, to produce logits).
* sliding-window attention (a ring of ``cap`` slots, position p in slot p % cap) and linear
  attention (a fixed-size recurrent state): the state after k tokens cannot be derived from the
  state after n > k tokens. So the file holds their state after ``at = n - 1`` prompt tokens
  (recorded while the prompt is prefilled: the prefill is split there), and the reuse point of a
  model with such layers is exactly ``at``: a new prompt that repeats the saved one reruns its
  last token, one that extends it prefills from that last token on. A ring that has not wrapped
  yet still holds every position, so a model with only ring and full layers can also reuse a
  shorter common prefix.

File layout (little endian; no pickle)::

    b"CPULLMPC"  u32 version  u32 0  u64 header length  | header JSON | pad to 64 |
    arrays (each at a 64-byte aligned offset from the data start; keys and values in the KV
    cache's format, float16, float32 or q8_0 (int8 rows of head_dim values and the bytes of
    their float32 scales, one per 32 values, cpullm.compile.kvformat.read_positions), other
    state float32)

The header names the model (family, config hash, weight files, quant) and the runtime (versions,
KV format, graph hash, CPU), the prompt tokens, and per state region its node, kind, positions
held, array dtype and checksum; it carries a checksum of itself. A file for another model,
quant or KV cache type (``--cache-type``: never converted, the numbers would differ) is refused
with a CacheError naming the fix; a stale (other version), damaged or truncated one is ignored with a notice and
rewritten on save. Writes go to a temporary file in the same directory, then ``os.replace``.
"""
from __future__ import annotations

import json
import os
import struct
import time
import uuid
from pathlib import Path

import numpy as np

from .. import limits
from ..errors import CacheError
from ..compile.kvformat import KV_DTYPES, q8_row_bytes, region_format

MAGIC = b"CPULLMPC"
VERSION = 3      # 2: KV arrays stored in the model's KV format (entry "dtype"), kv_dtype in the identity;
# 3: q8_0 rows carry a float32 scale per 32 values (version 2's had one per row: such a file is stale)
_PREFIX = struct.Struct("<8sIIQ")
_ALIGN = 64
_MAX_HEADER = 256 * 1024 * 1024
# identity keys whose mismatch means "another model": the file is refused
MODEL_KEYS = ("family", "model_type", "config_sha", "weight_files", "quant")


_DTYPES = {"f16": np.float16, "f32": np.float32, "q8_0": np.int8}


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def model_identity(model) -> dict:
    """What a saved state depends on. ``MODEL_KEYS`` say which model; the rest which runtime
    produced the numbers (a mismatch there makes the file stale, not foreign)."""
    from ..compile.cache_format import config_sha, cpu_features, versions
    from ..compile.compiler import graph_hash
    from ..loading.tensors import TensorStore

    if Path(model.model_dir).is_file():          # a GGUF file run as it is
        from ..loading.gguf_model import GGUFStore
        files = GGUFStore(model.model_dir).identity()
    else:
        files = TensorStore(model.model_dir).identity()
    v = versions()
    return {
        "family": model.family.name,
        "model_type": model.config.get("model_type"),
        "config_sha": config_sha(model.config),
        "weight_files": sorted([f[0], f[1]] for f in files),
        "quant": model.quant,
        "kv_dtype": getattr(model, "kv_dtype", "f32"),   # another format's file is refused
        "weight_mtimes": sorted([f[0], f[2]] for f in files),
        "plugin": model.family.plugin,
        "plugin_version": model.family.plugin_version,
        "graph_sha": graph_hash(model.graph),
        "kernels_version": v["kernels_version"],
        "plugin_kernels": sorted(model.program.meta.get("external", {}).values()),
        "cpullm_version": v["cpullm_version"],
        "numba_version": v["numba_version"],
        "cpu": cpu_features(),
    }


def _header_sha(header: dict) -> str:
    from ..compile.cache_format import json_sha
    return json_sha({k: v for k, v in header.items() if k != "header_sha"})


def _common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def fh_reopen(path: Path, size: int):
    """``path`` opened again for its arrays, still a regular file of ``size`` bytes."""
    fh, now = limits.open_regular(path)
    if now != size:
        fh.close()
        raise OSError(f"it changed size while being read ({size} -> {now} bytes)")
    return fh


def _nat(v) -> bool:
    return limits.is_int(v) and 0 <= v <= limits.MAX_TENSOR_ELEMENTS


def _header_problem(h: dict) -> str | None:
    """What is wrong with a header's fields (types, ranges, shapes against their sizes), or None:
    every value the loader and a restore use is checked here, before any is used."""
    tokens = h.get("tokens")
    if not isinstance(tokens, list) or len(tokens) > limits.MAX_CONTEXT or \
            not all(limits.is_int(t) and 0 <= t < limits.MAX_VOCAB for t in tokens):
        return "tokens is not a list of token ids"
    if not _nat(h.get("kv_len")) or not _nat(h.get("data_bytes")):
        return "kv_len or data_bytes is not a size"
    if h.get("at") is not None and not (_nat(h["at"]) and h["at"] <= len(tokens)):
        return "at is not a position of the tokens"
    regions = h.get("regions")
    if not isinstance(regions, list) or len(regions) > limits.MAX_TENSORS:
        return "regions is not a list"
    nodes = set()
    for r in regions:
        if not isinstance(r, dict) or not isinstance(r.get("node"), str) or r["node"] in nodes:
            return "a region is not an object with a unique node name"
        nodes.add(r["node"])
        shape = r.get("shape")
        if not isinstance(r.get("kind"), str):
            return f"region {limits.shown(r['node'])} has no kind"
        if not isinstance(r.get("dtype"), str) or r["dtype"] not in _DTYPES or not isinstance(r.get("checksum"), str):
            return f"region {limits.shown(r['node'])} has a bad dtype or checksum"
        if not isinstance(shape, list) or len(shape) > limits.MAX_DIMS or not all(_nat(d) for d in shape) \
                or limits.checked_product(shape) is None:
            return f"region {limits.shown(r['node'])} has a bad shape"
        if not _nat(r.get("offset")) or not (_nat(r.get("lo")) and _nat(r.get("hi")) and r["lo"] <= r["hi"]):
            return f"region {limits.shown(r['node'])} has a bad offset or position range"
        if r["kind"] == "kv":
            if not all(_nat(r.get(k)) for k in ("n_kv_heads", "head_dim", "window")) or \
                    shape != [2, r["n_kv_heads"], r["hi"] - r["lo"],
                              q8_row_bytes(r["head_dim"]) if r["dtype"] == "q8_0" else r["head_dim"]]:
                return f"region {limits.shown(r['node'])}: shape does not hold its keys and values"
        elif not _nat(r.get("floats")) or shape != [r["floats"]]:
            return f"region {limits.shown(r['node'])}: shape does not match its floats"
    return None


def _compatible(reg: dict, saved: dict) -> bool:
    if reg["kind"] != saved.get("kind"):
        return False
    if reg["kind"] == "kv":
        return all(reg[k] == saved.get(k) for k in ("n_kv_heads", "head_dim", "window")) and \
            saved.get("dtype") == region_format(reg)
    return reg["floats"] == saved.get("floats")


class PromptCache:
    """A prompt-cache file attached to one model (see the module docstring)."""

    def __init__(self, model, path, load: bool = True):
        self.model = model
        self.path = Path(os.path.expanduser(str(path)))
        self.identity = model_identity(model)
        self.saved: dict | None = None        # the file's content, once read
        self.status = "MISS (no file)"
        self.reused = 0                       # prompt tokens restored by the last start()
        self._tokens: list[int] | None = None  # the sequence started by the last start()
        self._snap: dict | None = None        # {"at": n, "regions": {node: (lo, hi, array)}}
        self.split_at: int | None = None      # prompt position whose state the next prefill records
        if self.path.is_dir():
            raise CacheError(f"--prompt-cache {self.path} is a directory; give a file path")
        if not self.path.parent.is_dir():
            raise CacheError(f"--prompt-cache {self.path}: directory {self.path.parent} does not "
                             "exist; create it or give another path")
        if load:
            self._load()

    # ---- reading --------------------------------------------------------------------------
    def _stale(self, why: str):
        from ..notices import notice
        notice(f"prompt cache {self.path} is {why}; not using it (it will be rewritten)")
        self.saved = None
        self.status = f"MISS ({why})"

    def _load(self):
        from ..compile.cache_format import checksum

        self.saved = None
        try:     # without blocking on a FIFO, and only a regular file
            fh, size = limits.open_regular(self.path)
        except FileNotFoundError:
            self.status = "MISS (no file)"
            return
        except OSError as exc:
            raise CacheError(f"cannot read the prompt cache {self.path} ({exc.strerror or exc}); give "
                             "a regular file you can read and write, or another path") from None
        with fh:
            head = fh.read(_PREFIX.size)
            if len(head) < len(MAGIC) or head[:len(MAGIC)] != MAGIC:
                if size == 0:
                    self.status = "MISS (empty file)"
                    return
                raise CacheError(f"{self.path} is not a cpullm prompt cache; give a new file path "
                                 "for --prompt-cache (this file would be overwritten)")
            if len(head) < _PREFIX.size:
                return self._stale("truncated")
            _, version, _, hlen = _PREFIX.unpack(head)
            if version != VERSION:
                return self._stale(f"of format version {version}, not {VERSION}")
            if hlen > min(_MAX_HEADER, size - _PREFIX.size):
                return self._stale("truncated")
            try:
                header = limits.parse_json(fh.read(hlen))
            except ValueError:
                return self._stale("damaged (unreadable header)")
        if not isinstance(header, dict) or header.get("header_sha") != _header_sha(header):
            return self._stale("damaged (header checksum)")
        bad = _header_problem(header)
        if bad is not None:                 # a checksum proves nothing: it is in the file too
            return self._stale(f"damaged ({bad})")
        saved_id = header.get("identity") or {}
        if not isinstance(saved_id, dict):
            return self._stale("damaged (identity is not an object)")
        differs = [k for k in MODEL_KEYS if saved_id.get(k) != self.identity[k]]
        if differs:
            raise CacheError(
                f"{self.path} is a prompt cache for another model or quant (made for "
                f"{header.get('model_dir')}, quant {saved_id.get('quant')}; differs in: "
                f"{', '.join(differs)}); give another --prompt-cache file, or delete this one")
        if saved_id.get("kv_dtype") != self.identity["kv_dtype"]:
            kv = saved_id.get("kv_dtype")
            kv = kv if kv in KV_DTYPES else limits.shown(kv)
            raise CacheError(
                f"{self.path} was saved with KV cache type {kv}, this model runs "
                f"{self.identity['kv_dtype']}; load with --cache-type {kv} (kv_dtype={kv!r}), "
                "or give another --prompt-cache file")
        changed = sorted(k for k in self.identity if saved_id.get(k) != self.identity[k])
        if changed:
            return self._stale(f"stale (changed: {', '.join(changed)})")
        data_start = _align(_PREFIX.size + hlen)
        regions = {}
        if size != data_start + header["data_bytes"]:
            return self._stale("truncated")
        try:
            with fh_reopen(self.path, size) as fh:
                for reg in header["regions"]:
                    dtype = np.dtype(_DTYPES[reg["dtype"]])
                    count = limits.checked_product(reg["shape"])
                    if reg["offset"] + count * dtype.itemsize > header["data_bytes"]:
                        return self._stale("truncated")
                    fh.seek(data_start + reg["offset"])
                    arr = np.fromfile(fh, dtype, count).reshape(reg["shape"]) if count else \
                        np.zeros(reg["shape"], dtype)
                    if arr.size != count or checksum(arr) != reg["checksum"]:
                        return self._stale(f"damaged (state of {limits.shown(reg['node'])} fails its checksum)")
                    regions[reg["node"]] = (reg, arr)
        except (OSError, ValueError) as exc:
            return self._stale(f"unreadable ({limits.one_line(exc, 80)})")
        tokens, kv_len, at = list(header["tokens"]), header["kv_len"], header["at"]
        self.saved = {"tokens": tokens, "kv_len": kv_len, "at": at, "regions": regions}
        self.status = f"LOADED ({len(tokens)} saved tokens)"

    # ---- restoring --------------------------------------------------------------------------
    def _regions(self):
        return self.model.program.meta["state_regions"]

    def _needs_snapshot(self) -> bool:
        return any(r["kind"] != "kv" or r.get("window") for r in self._regions())

    def reuse_point(self, ids) -> int:
        """How many leading tokens of ``ids`` the saved state can stand in for (0: none)."""
        s = self.saved
        if s is None:
            return 0
        limit = min(_common_prefix(s["tokens"], ids), len(ids) - 1)
        hi, lo_min, fixed = limit, 0, None
        for reg in self._regions():
            got = s["regions"].get(reg["node"])
            if got is None or not _compatible(reg, got[0]):
                return 0
            info = got[0]
            if reg["kind"] != "kv":
                fixed = info["hi"]                          # the state after exactly `at` tokens
            else:
                hi = min(hi, info["hi"])
                if info["lo"] > 0:                         # a wrapped ring: the window must fit
                    lo_min = max(lo_min, info["lo"] + reg["window"] - 1)
        r = hi if fixed is None else (fixed if fixed <= hi else 0)
        return r if r >= lo_min else 0

    def _restore(self, forward, slot, r: int):
        for reg in self._regions():
            info, arr = self.saved["regions"][reg["node"]]
            if reg["kind"] == "kv":
                lo = max(info["lo"], r - reg["cap"])
                slot.write_kv(reg, lo, arr[:, :, lo - info["lo"]: r - info["lo"], :])
            else:
                slot.region(reg)[:] = arr
        forward.set_position(slot, r)

    def start(self, forward, slot, ids: list[int]) -> int:
        """In a fresh ``slot`` (:class:`cpullm.run.forward.Slot`): restore what the file allows for
        ``ids`` and arrange to record this prompt's state (the slot is the one :meth:`save`
        saves); returns the tokens restored (always < len(ids))."""
        self.split_at = None
        ids = [int(t) for t in ids]
        r = self.reuse_point(ids)
        if r > 0:
            self._restore(forward, slot, r)
            self.status = f"HIT (reused {r} of {len(ids)} prompt tokens)"
        elif self.saved is not None:
            c = _common_prefix(self.saved["tokens"], ids)
            self.status = (f"MISS (the prompt differs from the cached one at token {c})"
                           if c < len(self.saved["tokens"]) else
                           "MISS (the cached prompt is as long as this one; nothing to reuse)")
        self.reused = r
        self._tokens, self._snap = ids, None
        if self._needs_snapshot():
            at = len(ids) - 1
            if r == at:
                self._snapshot(slot, at)
            else:
                self.split_at = at           # the scheduler's prefill stops there to record it
        return r

    def snapshot_split(self, slot):
        """Called by the prompt prefill when ``slot`` reaches ``split_at``."""
        self._snapshot(slot, self.split_at)
        self.split_at = None

    def _snapshot(self, slot, at: int):
        """Record the ring and linear-attention state after ``at`` tokens."""
        regions = {}
        for reg in self._regions():
            if reg["kind"] != "kv":
                regions[reg["node"]] = (at, at, slot.region(reg).copy())
            elif reg.get("window"):
                lo = max(0, at - reg["cap"])
                regions[reg["node"]] = (lo, at, slot.read_kv(reg, lo, at))
        self._snap = {"at": at, "regions": regions}

    # ---- saving -------------------------------------------------------------------------------
    def save(self, slot, seq: list[int], path=None) -> Path:
        """Write the state of prompt ``seq`` held by ``slot`` (atomically)."""
        from ..compile.cache_format import checksum

        path = Path(os.path.expanduser(str(path))) if path is not None else self.path
        seq = [int(t) for t in seq]
        if not seq or slot is None or slot.position == 0:
            raise CacheError("there is no prompt state to save: run a prompt first "
                             "(model.generate(...)), then save_prompt_cache()")
        snap = self._snap
        if self._needs_snapshot() and (snap is None or self._tokens != seq):
            raise CacheError("this model has sliding-window or linear-attention layers, whose state "
                             "is recorded while the prompt runs: call model.use_prompt_cache(path) "
                             "before generate(), then save_prompt_cache()")
        kv_len = min(len(seq), slot.position)
        arrays, table, off = [], [], 0
        for reg in self._regions():
            if reg["kind"] == "kv" and not reg.get("window"):
                lo, hi, arr = 0, kv_len, slot.read_kv(reg, 0, kv_len)
            else:
                lo, hi, arr = snap["regions"][reg["node"]]
            dtype = region_format(reg) if reg["kind"] == "kv" else "f32"
            arr = np.ascontiguousarray(arr, dtype=_DTYPES[dtype])      # KV as the cache holds it
            entry = {"node": reg["node"], "kind": reg["kind"], "lo": int(lo), "hi": int(hi),
                     "shape": list(arr.shape), "dtype": dtype, "offset": off, "checksum": checksum(arr)}
            if reg["kind"] == "kv":
                entry.update(n_kv_heads=reg["n_kv_heads"], head_dim=reg["head_dim"], window=reg["window"])
            else:
                entry.update(floats=reg["floats"])
            table.append(entry)
            arrays.append((off, arr))
            off = _align(off + arr.nbytes)
        header = {"format": "cpullm prompt cache", "identity": self.identity,
                  "model_dir": str(Path(self.model.model_dir).resolve()), "created": time.time(),
                  "tokens": seq, "kv_len": kv_len, "at": snap["at"] if snap else None,
                  "regions": table, "data_bytes": off}
        header["header_sha"] = _header_sha(header)
        hbytes = json.dumps(header).encode()
        data_start = _align(_PREFIX.size + len(hbytes))
        tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}")
        try:
            with open(tmp, "wb") as fh:
                fh.write(_PREFIX.pack(MAGIC, VERSION, 0, len(hbytes)))
                fh.write(hbytes)
                for o, arr in arrays:
                    fh.seek(data_start + o)
                    arr.reshape(-1).view(np.uint8).tofile(fh)
                fh.truncate(data_start + off)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            raise CacheError(f"cannot write the prompt cache {path} ({exc}); give a writable path") from None
        finally:
            if tmp.exists():
                tmp.unlink()
        if path == self.path:           # later prompts in this process reuse what was just saved
            status = self.status
            self._load()
            self.status = status
        return path
