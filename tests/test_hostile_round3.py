"""Hostile files and faults of issue 41 (reliability, round three), one test per reproduction:
GGUF tensors that overlap, a GGUF truncated while it loads, a vocabulary longer than the
embedding, a full disk under convert and under the execution cache, forged prompt-cache and
execution-cache entries. Each is refused with one line (or, for the cache, rebuilt around)."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

import test_convert as tc  # noqa: E402
from test_convert import write_tiny_gguf  # noqa: E402

from cpullm.loading import gguf_file as gf  # noqa: E402
from cpullm.errors import ConversionError  # noqa: E402


def _offset_field(data: bytes, name: str) -> int:
    """Where the u64 data offset of tensor ``name`` sits in a GGUF header."""
    key = struct.pack("<Q", len(name)) + name.encode()
    pos = data.index(key) + len(key)
    n_dims = struct.unpack_from("<I", data, pos)[0]
    return pos + 4 + 8 * n_dims + 4


def test_gguf_tensors_whose_bytes_overlap_are_refused_naming_both(tmp_path):
    path = tmp_path / "overlap.gguf"
    write_tiny_gguf(path, "llama")
    tensors = gf.open_gguf(path).tensors
    a, b = tensors[1], tensors[2]
    data = bytearray(path.read_bytes())
    first = struct.unpack_from("<Q", data, _offset_field(data, a.name))[0]
    struct.pack_into("<Q", data, _offset_field(data, b.name), first + 32)   # b starts inside a
    path.write_bytes(bytes(data))
    with pytest.raises(ConversionError, match="overlap") as e:
        gf.open_gguf(path)
    assert a.name in str(e.value) and b.name in str(e.value)


def test_gguf_type_that_reads_into_the_next_tensor_is_refused(tmp_path):
    path = tmp_path / "widen.gguf"
    write_tiny_gguf(path, "llama")
    t = next(t for t in gf.open_gguf(path).tensors if t.tensor_type.name == "F16" or len(t.shape) == 2)
    data = bytearray(path.read_bytes())
    type_at = _offset_field(data, t.name) - 4
    struct.pack_into("<I", data, type_at, int(gguf.GGMLQuantizationType.F64))   # 8 bytes per element
    path.write_bytes(bytes(data))
    with pytest.raises(ConversionError, match="overlap|truncated"):
        gf.open_gguf(path)


_TRUNCATE_CHILD = r"""
import os, sys
from cpullm.loading.gguf_model import GGUFStore
from cpullm.errors import CpullmError
path = sys.argv[1]
store = GGUFStore(path)
os.truncate(path, os.path.getsize(path) // 2)      # someone truncates it while it loads
try:
    for name in store.names():
        store.get(name)
        store.blocks(name)
except CpullmError as exc:
    print("ERROR:", exc)
    sys.exit(2)
sys.exit(0)
"""


def test_gguf_truncated_while_it_loads_is_one_line_not_sigbus(tmp_path):
    path = tmp_path / "shrinks.gguf"
    write_tiny_gguf(path, "llama")
    proc = subprocess.run([sys.executable, "-c", _TRUNCATE_CHILD, str(path)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])    # -7 would be SIGBUS
    assert "truncated" in proc.stdout and "Traceback" not in proc.stderr


def test_gguf_vocabulary_longer_than_the_embedding_is_refused_naming_both(tmp_path):
    tokens, _ = tc.byte_level_vocab()
    path = tmp_path / "long-vocab.gguf"
    write_tiny_gguf(path, "llama", weights=tc.tiny_hf_weights("llama", 2, len(tokens) - 9, 0, True))
    from cpullm.loading.gguf_model import GGUFStore
    with pytest.raises(ConversionError) as e:
        GGUFStore(path)
    assert f"{len(tokens)} tokens" in str(e.value) and f"{len(tokens) - 9} rows" in str(e.value)


_FULL_DISK_CHILD = r"""
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)          # a write past the limit fails with EFBIG
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
from cpullm.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _run_with_file_limit(limit: int, argv: list[str], env_extra=None, timeout=300):
    env = {**os.environ, "CPULLM_QUIET": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, "-c", _FULL_DISK_CHILD, str(limit), *argv], capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_convert_onto_a_full_disk_is_one_line(tmp_path):
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, "llama")
    proc = _run_with_file_limit(20000, ["convert", str(path), str(tmp_path / "out")])
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr and lines[-1].startswith("cpullm: error:"), lines[-3:]
    assert "free some space" in lines[-1]
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_run_with_a_full_disk_under_the_execution_cache_builds_in_memory(tmp_path):
    from cpullm.testing import make_random_checkpoint
    from tiny_configs import SMOLLM2_LIKE

    d = make_random_checkpoint(dict(SMOLLM2_LIKE, model_type="llama"), tmp_path / "m", seed=1)
    cache = tmp_path / "cache"
    proc = _run_with_file_limit(32 << 10, ["run", str(d), "-p", "hello", "-n", "4"],
                                env_extra={"CPULLM_CACHE_DIR": str(cache), "CPULLM_QUIET": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "building in memory" in proc.stderr, proc.stderr[-3000:]
    assert proc.stdout.strip()
    exec_root = next(cache.rglob("exec"), None) or cache
    assert not [p for p in exec_root.rglob("*") if p.name.startswith(".tmp.")]   # nothing half-written left


def test_last_used_is_never_touched_through_a_symlink(tmp_path):
    from cpullm.compile.cache_format import touch_no_follow

    victim = tmp_path / "victim"
    victim.write_text("x")
    os.utime(victim, (1000, 1000))
    link = tmp_path / "last_used"
    link.symlink_to(victim)
    touch_no_follow(link)
    assert victim.stat().st_mtime == 1000 and link.is_symlink()
    plain = tmp_path / "plain"
    touch_no_follow(plain)
    assert plain.is_file()


# ---------------------------------------------------------------------------------------------
# Prompt-cache files with forged headers (checksum recomputed), and one that is a FIFO
# ---------------------------------------------------------------------------------------------

from test_cache_family import llama_dir  # noqa: E402,F401  (fixture)


def _saved_prompt_cache(model_dir, path: Path) -> Path:
    import cpullm
    m = cpullm.load(model_dir).use_prompt_cache(path)
    list(m.generate_ids(list(range(40, 60)), 2, ignore_eos=True))
    m.save_prompt_cache()
    return path


def _forge(path: Path, change) -> None:
    """Rewrite the file's header with ``change(header)`` applied and its checksum recomputed."""
    from cpullm.run import prompt_cache as pcm
    raw = path.read_bytes()
    magic, version, zero, hlen = pcm._PREFIX.unpack_from(raw)
    header = json.loads(raw[pcm._PREFIX.size: pcm._PREFIX.size + hlen])
    data = raw[pcm._align(pcm._PREFIX.size + hlen):]
    change(header)
    header["header_sha"] = pcm._header_sha(header)
    hb = json.dumps(header).encode()
    out = pcm._PREFIX.pack(magic, version, zero, len(hb)) + hb
    out += b"\0" * (pcm._align(len(out)) - len(out))
    path.write_bytes(out + data)


def _set(path, value):
    def change(h):
        target = h
        for p in path[:-1]:
            target = target[p]
        target[path[-1]] = value
    return change


FORGERIES = {
    "negative shape": _set(("regions", 0, "shape"), [2, -1, 3, 4]),
    "string offset": _set(("regions", 0, "offset"), "12"),
    "regions object": _set(("regions",), {"node": "x"}),
    "huge offset": _set(("regions", 0, "offset"), 2**62),
    "float tokens": _set(("tokens",), [1.5, 2]),
    "kv shape lies": _set(("regions", 0, "hi"), 10**6),
    "nested tokens": _set(("tokens",), [[[[1]]]]),
    "data bytes string": _set(("data_bytes",), "lots"),
    "at past the tokens": _set(("at",), 10**9),
}


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_forged_prompt_cache_header_is_a_miss_not_a_traceback(llama_dir, tmp_path, name, capfd):  # noqa: F811
    import cpullm
    pc = _saved_prompt_cache(llama_dir, tmp_path / "p.cache")
    _forge(pc, FORGERIES[name])
    m = cpullm.load(llama_dir).use_prompt_cache(pc)
    assert m.prompt_cache_status.startswith("MISS (damaged"), m.prompt_cache_status
    assert len(list(m.generate_ids(list(range(40, 60)), 2, ignore_eos=True))) == 2


def test_prompt_cache_nested_100000_deep_is_a_miss(llama_dir, tmp_path):  # noqa: F811
    import cpullm
    from cpullm.run import prompt_cache as pcm
    pc = tmp_path / "deep.cache"
    hb = b'{"regions": ' + b"[" * 100000 + b"]" * 100000 + b"}"
    pc.write_bytes(pcm._PREFIX.pack(pcm.MAGIC, pcm.VERSION, 0, len(hb)) + hb)
    m = cpullm.load(llama_dir).use_prompt_cache(pc)
    assert m.prompt_cache_status.startswith("MISS (damaged"), m.prompt_cache_status


def test_prompt_cache_that_is_a_fifo_does_not_block(llama_dir, tmp_path):  # noqa: F811
    import cpullm
    from cpullm.errors import CacheError
    fifo = tmp_path / "p.cache"
    os.mkfifo(fifo)
    with pytest.raises(CacheError, match="FIFO"):
        cpullm.load(llama_dir).use_prompt_cache(fifo)


# ---------------------------------------------------------------------------------------------
# Forged execution-cache entries (checksums recomputed): offsets and sizes are bounds-checked
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def cache_entry(tmp_path):
    import cpullm
    from cpullm.testing import make_random_checkpoint
    from tiny_configs import SMOLLM2_LIKE

    d = make_random_checkpoint(dict(SMOLLM2_LIKE, model_type="llama"), tmp_path / "m", seed=2)
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    cpullm.load(d, cache_dir=root, n_ctx=64)
    return d, root, next((root / "exec").iterdir())


def _reseal(entry: Path, change_meta=None, change_I=None):
    from cpullm.compile import cache_format
    m = json.loads((entry / "manifest.json").read_text())
    m.pop("manifest_sha")
    if change_meta:
        change_meta(m["program_meta"])
    if change_I:
        info = m["arrays"]["I"]
        I = np.fromfile(entry / "I.bin", dtype=info["dtype"]).reshape(info["shape"])
        change_I(I)
        I.tofile(entry / "I.bin")
        info["checksum"] = cache_format.checksum(I)
    m["manifest_sha"] = cache_format.json_sha(m)
    (entry / "manifest.json").write_text(json.dumps(m))


def _arena_column(I):
    from cpullm_kernels.program import program_table as P
    r = int(np.nonzero(I[:, P.COL_OP] == P.OP_GLU)[0][0])
    return r, P.GLU_OUT_OFF


FORGED_ENTRIES = {
    "arena_floats shrunk": dict(change_meta=lambda meta: meta.update(arena_floats=meta["arena_floats"] // 4)),
    "state_floats shrunk": dict(change_meta=lambda meta: meta.update(state_floats=16)),
    "output offset past the arena": dict(change_I=lambda I: I.__setitem__(_arena_column(I), 1 << 40)),
    "negative offset": dict(change_I=lambda I: I.__setitem__(_arena_column(I), -4096)),
    "unknown opcode": dict(change_I=lambda I: I.__setitem__((0, 0), 99)),
}


@pytest.mark.parametrize("name", sorted(FORGED_ENTRIES))
def test_forged_execution_cache_entry_is_refused_and_rebuilt(cache_entry, name, capfd):
    import cpullm
    from cpullm.compile import cache_format
    from cpullm.errors import CacheError

    d, root, entry = cache_entry
    _reseal(entry, **FORGED_ENTRIES[name])
    with pytest.raises(CacheError, match="outside|opcode"):
        cache_format.read_entry(entry)
    m = cpullm.load(d, cache_dir=root, n_ctx=64)          # a load rebuilds it and runs
    assert m.cache_status.startswith("MISS (damaged entry")
    assert len(list(m.generate_ids([1, 2, 3], 3, ignore_eos=True))) == 3


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_K", "Q6_K", "Q5_K"])
def test_programs_of_every_block_format_pass_the_bounds_check(write, fmt):
    """The load-time bounds check accepts what the compiler writes (GGUF blocks run as they are,
    panels included, and q4): no valid entry is ever rebuilt for it."""
    import cpullm
    from cpullm.compile.cache_format import check_program_bounds

    path = write(fmt)
    for quant in ("gguf", "q4"):
        m = cpullm.load(path, quant=quant, use_cache=False)
        check_program_bounds(m.program.arrays, m.program.meta)


from test_gguf_run import write  # noqa: E402,F401  (fixture)
