"""The execution cache (cpullm.compile.cache_format): HIT/MISS, every key input, damage detection,
atomic and concurrent writes, a writer killed mid-write, ``cpullm cache ls | clear``."""
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import cpullm
from cpullm.compile import cache_format
from cpullm.loading import plugins
from cpullm.cli import main
from test_cache_family import LLAMA, llama_dir  # noqa: F401  (fixture)

IDS = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]


@pytest.fixture
def model_dir(llama_dir, tmp_path):
    """A private copy (tests change its files)."""
    return Path(shutil.copytree(llama_dir, tmp_path / "model"))


@pytest.fixture
def cache_dir(tmp_path):
    return tmp_path / "cache"


@pytest.fixture
def loud(monkeypatch):
    monkeypatch.setenv("CPULLM_QUIET", "0")


def load(model_dir, cache_dir, **kw):
    return cpullm.load(model_dir, cache_dir=cache_dir, **kw)


def entries(cache_dir):
    return cache_format.list_entries(cache_dir)


def test_miss_then_hit_same_logits(model_dir, cache_dir):
    a = load(model_dir, cache_dir)
    assert a.cache_status == "MISS (no entry)"
    b = load(model_dir, cache_dir)
    assert b.cache_status == "HIT" and b.info()["cache"] == "HIT"
    assert isinstance(b.load_s, float) and b.load_s > 0
    assert np.array_equal(a.logits(IDS), b.logits(IDS))
    [e] = entries(cache_dir)
    assert e["valid"] and e["model"] == str(model_dir.resolve()) and e["quant"] == "int8"
    manifest = json.loads((Path(e["path"]) / "manifest.json").read_text())
    for k in ("format_version", "cpullm_version", "plugin_version", "config_sha", "weights_identity",
              "quant", "graph_sha", "kernels_version", "numba_version", "cpu"):
        assert k in manifest["inputs"], k
    assert sorted(p.name for p in Path(e["path"]).iterdir()) == sorted(
        ["manifest.json", "last_used"] + [f"{n}.bin" for n in cache_format.ARRAY_NAMES])


def test_no_cache_is_off_and_equal(model_dir, cache_dir):
    a = load(model_dir, cache_dir, use_cache=False)
    assert a.cache_status == "OFF" and not entries(cache_dir)
    b = load(model_dir, cache_dir)
    assert np.array_equal(a.logits(IDS), b.logits(IDS))


def test_hit_does_no_quantization_and_no_compilation(model_dir, cache_dir, monkeypatch):
    ref = load(model_dir, cache_dir).logits(IDS)

    def boom(*a, **k):
        raise AssertionError("a HIT must not quantize, compile or read checkpoint tensors")

    import cpullm.compile.compiler
    import cpullm_kernels.rows.q8
    import cpullm.model
    from cpullm.loading.weightmap import ResolvedWeights
    monkeypatch.setattr(cpullm.model, "compile_graph", boom)
    monkeypatch.setattr(cpullm.compile.compiler, "compile_graph", boom)
    monkeypatch.setattr(cpullm_kernels.rows.q8, "quantize_weight_q8", boom)
    monkeypatch.setattr(ResolvedWeights, "get", boom)
    m = load(model_dir, cache_dir)
    assert m.cache_status == "HIT"
    assert np.array_equal(m.logits(IDS), ref)


@pytest.mark.parametrize("mmap", [True, False])
def test_mmap_and_read_give_identical_logits(model_dir, cache_dir, mmap):
    ref = load(model_dir, cache_dir, use_cache=False).logits(IDS)
    miss = load(model_dir, cache_dir, mmap=mmap)
    hit = load(model_dir, cache_dir, mmap=mmap)
    assert miss.cache_status.startswith("MISS") and hit.cache_status == "HIT"
    assert hit.info()["memory"]["weights_mapped"] is mmap
    assert np.array_equal(miss.logits(IDS), ref)
    assert np.array_equal(hit.logits(IDS), ref)
    assert not hit.program.arrays["wq"].flags.writeable


# ---- every key input ---------------------------------------------------------------------------
def _change_weights(model_dir, monkeypatch):
    f = model_dir / "model.safetensors"
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))      # the file was replaced


def _change_config(model_dir, monkeypatch):
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-6
    (model_dir / "config.json").write_text(json.dumps(cfg))


def _change_cpullm_version(model_dir, monkeypatch):
    monkeypatch.setattr(cpullm, "__version__", "99.0.0")


def _change_plugin_version(model_dir, monkeypatch):
    fam = plugins.discover().family_for(LLAMA)
    monkeypatch.setattr(fam, "plugin_version", "99.0.0")


def _change_format_version(model_dir, monkeypatch):
    monkeypatch.setattr(cache_format, "FORMAT_VERSION", cache_format.FORMAT_VERSION + 1)


def _change_kernels_version(model_dir, monkeypatch):
    import cpullm_kernels
    monkeypatch.setattr(cpullm_kernels, "KERNELS_VERSION", "99")


def _change_numba_version(model_dir, monkeypatch):
    import numba
    monkeypatch.setattr(numba, "__version__", "99.0.0")


def _change_cpu(model_dir, monkeypatch):
    monkeypatch.setattr(cache_format, "cpu_features", lambda: "othercpu:+avx512f")


CHANGES = {
    "weights_identity": _change_weights,
    "config_sha": _change_config,
    "cpullm_version": _change_cpullm_version,
    "plugin_version": _change_plugin_version,
    "format_version": _change_format_version,
    "kernels_version": _change_kernels_version,
    "numba_version": _change_numba_version,
    "cpu": _change_cpu,
}


@pytest.mark.parametrize("key", sorted(CHANGES))
def test_key_input_change_rebuilds(model_dir, cache_dir, monkeypatch, key):
    assert load(model_dir, cache_dir).cache_status == "MISS (no entry)"
    assert load(model_dir, cache_dir).cache_status == "HIT"
    CHANGES[key](model_dir, monkeypatch)
    m = load(model_dir, cache_dir)
    assert m.cache_status.startswith("MISS (changed: ") and key in m.cache_status, m.cache_status
    assert load(model_dir, cache_dir).cache_status == "HIT"
    # an entry built from weight files that changed can never be used again: it is removed
    assert len(entries(cache_dir)) == (1 if key == "weights_identity" else 2)


def test_quant_change_rebuilds(model_dir, cache_dir):
    load(model_dir, cache_dir, quant="int8")
    m = load(model_dir, cache_dir, quant="f32")
    assert m.cache_status.startswith("MISS (changed: ") and "quant" in m.cache_status
    assert load(model_dir, cache_dir, quant="f32").cache_status == "HIT"
    assert load(model_dir, cache_dir, quant="int8").cache_status == "HIT"
    assert sorted(e["quant"] for e in entries(cache_dir)) == ["f32", "int8"]


def test_cache_dir_env_and_option(model_dir, tmp_path, monkeypatch):
    env_root = tmp_path / "from_env"
    monkeypatch.setenv("CPULLM_CACHE_DIR", str(env_root))
    assert cpullm.load(model_dir).cache_status.startswith("MISS")
    assert len(cache_format.list_entries()) == 1 and (env_root / "exec").is_dir()
    opt_root = tmp_path / "from_option"
    assert cpullm.load(model_dir, cache_dir=opt_root).cache_status.startswith("MISS")
    assert len(cache_format.list_entries(opt_root)) == 1
    monkeypatch.delenv("CPULLM_CACHE_DIR")
    assert cache_format.cache_root() == Path.home() / ".cache" / "cpullm"


def test_unwritable_cache_dir_still_runs(model_dir, tmp_path, loud, capfd):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    m = load(model_dir, blocker)
    assert m.cache_status.startswith("MISS") and m.logits(IDS).shape[0] == len(IDS)
    err = capfd.readouterr().err
    assert "could not write the execution cache" in err and "--cache-dir" in err


# ---- damage -----------------------------------------------------------------------------------
def _entry(cache_dir) -> Path:
    [e] = entries(cache_dir)
    return Path(e["path"])


def _truncate(entry):
    f = entry / "wq.bin"
    f.write_bytes(f.read_bytes()[:-7])


def _flip_bit(entry):
    f = entry / "wq.bin"
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0x10
    f.write_bytes(bytes(b))


def _flip_manifest(entry):
    f = entry / "manifest.json"
    m = json.loads(f.read_text())
    m["program_meta"]["arena_floats"] += 1          # a corrupted number, valid JSON
    f.write_text(json.dumps(m))


def _foreign(entry):
    """A complete, self-consistent entry built for other inputs, under this key."""
    f = entry / "manifest.json"
    m = json.loads(f.read_text())
    m.pop("manifest_sha")
    m["inputs"]["quant"] = "f32"
    m["manifest_sha"] = cache_format.json_sha(m)
    f.write_text(json.dumps(m))


def _old_format(entry):
    f = entry / "manifest.json"
    m = json.loads(f.read_text())
    m["format_version"] = 1
    f.write_text(json.dumps(m))


def _missing_file(entry):
    (entry / "ws.bin").unlink()


def _partial_dir(entry):
    """What a non-atomic writer killed early would leave: arrays, no manifest."""
    (entry / "manifest.json").unlink()


DAMAGE = {"truncated": (_truncate, "truncated"), "bit flip": (_flip_bit, "checksum"),
          "manifest bit": (_flip_manifest, "checksum"), "foreign": (_foreign, "foreign"),
          "old format": (_old_format, "format version"), "missing file": (_missing_file, "missing"),
          "partial": (_partial_dir, "manifest missing")}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damaged_entry_is_detected_and_rebuilt(model_dir, cache_dir, loud, capfd, kind):
    damage, word = DAMAGE[kind]
    ref = load(model_dir, cache_dir).logits(IDS)
    damage(_entry(cache_dir))
    capfd.readouterr()
    m = load(model_dir, cache_dir)
    assert m.cache_status.startswith("MISS (damaged entry: ") and word in m.cache_status, m.cache_status
    err = capfd.readouterr().err
    notices = [line for line in err.splitlines() if "execution cache entry" in line]
    assert len(notices) == 1 and "rebuilding" in notices[0] and word in notices[0]
    assert np.array_equal(m.logits(IDS), ref)
    assert load(model_dir, cache_dir).cache_status == "HIT"
    assert len(entries(cache_dir)) == 1


def test_checksum_sees_every_change():
    rng = np.random.default_rng(0)
    a = rng.integers(-128, 127, size=100_003, dtype=np.int8)
    c = cache_format.checksum(a)
    assert c == cache_format.checksum(a.copy())
    for i in (0, 7, 8, 50_000, 100_002):
        b = a.copy()
        b[i] ^= 1
        assert cache_format.checksum(b) != c
    assert cache_format.checksum(a[:-1]) != c
    w = a[:100_000].view(np.uint64).copy()
    w[[10, 11]] = w[[11, 10]]                       # two words swapped
    assert cache_format.checksum(w) != cache_format.checksum(a[:100_000])


def test_checksum_is_the_same_on_any_thread_count_and_sees_changes_in_each_threads_part():
    import numba
    rng = np.random.default_rng(1)
    a = rng.integers(0, 256, size=(cache_format._THREADED_WORDS * 8 * 3) + 5, dtype=np.uint8)   # threaded
    before = numba.get_num_threads()
    try:
        sums = set()
        for n in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)}):
            numba.set_num_threads(n)
            sums.add(cache_format.checksum(a))
        assert len(sums) == 1
        c = sums.pop()
        for i in (3, a.size // 2 + 1, a.size - 9):                  # the first, the last thread's part
            b = a.copy()
            b[i] ^= 0x80
            assert cache_format.checksum(b) != c
    finally:
        numba.set_num_threads(before)


# ---- concurrency and crashes --------------------------------------------------------------------
LOADER = textwrap.dedent("""
    import sys, cpullm
    m = cpullm.load(sys.argv[1], cache_dir=sys.argv[2])
    print(m.cache_status, float(m.logits([1, 2, 3])[-1].sum()), flush=True)
""")


def _spawn(model_dir, cache_dir, delay=None):
    env = dict(os.environ, CPULLM_QUIET="1")
    env.pop(cache_format._TEST_WRITE_DELAY_ENV, None)
    if delay:
        env[cache_format._TEST_WRITE_DELAY_ENV] = str(delay)
    return subprocess.Popen([sys.executable, "-c", LOADER, str(model_dir), str(cache_dir)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_processes_loading_at_once(model_dir, cache_dir):
    # both writers are slowed down inside write_entry, so their writes overlap
    procs = [_spawn(model_dir, cache_dir, delay=0.2) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    sums = {out.split()[-1] for out, _ in outs}
    assert len(sums) == 1
    [e] = entries(cache_dir)
    assert e["valid"]
    root = cache_format.exec_dir(cache_dir)
    assert [p.name for p in root.iterdir()] == [e["key"]]        # no temporary leftovers
    m = load(model_dir, cache_dir)
    assert m.cache_status == "HIT"
    assert str(float(m.logits([1, 2, 3])[-1].sum())) in sums


def test_write_race_keeps_the_winner_and_replaces_leftovers(model_dir, cache_dir):
    m = load(model_dir, cache_dir)
    entry = _entry(cache_dir)
    manifest = json.loads((entry / "manifest.json").read_text())
    created = manifest["created"]
    # a second writer of the same key loses the rename and keeps the winner's complete entry
    cache_format.write_entry(entry.parent, entry.name, m.program, manifest["inputs"], model_dir)
    assert json.loads((entry / "manifest.json").read_text())["created"] == created
    # a broken leftover under the key's name is moved aside and replaced
    _partial_dir(entry)
    cache_format.write_entry(entry.parent, entry.name, m.program, manifest["inputs"], model_dir)
    assert json.loads((entry / "manifest.json").read_text())["created"] > created
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]
    assert load(model_dir, cache_dir).cache_status == "HIT"


def test_writer_killed_mid_write_leaves_nothing_trusted(model_dir, cache_dir):
    p = _spawn(model_dir, cache_dir, delay=60)
    root = cache_format.exec_dir(cache_dir)
    deadline = time.time() + 90
    while time.time() < deadline:                         # wait until it is inside write_entry
        tmps = list(root.glob(".tmp.*")) if root.is_dir() else []
        if tmps and list(tmps[0].glob("*.bin")):
            break
        assert p.poll() is None, p.communicate()
        time.sleep(0.05)
    else:
        pytest.fail("the writer never started writing")
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    assert p.returncode == -signal.SIGKILL
    assert entries(cache_dir) == []                         # the half-written entry is invisible
    assert [x.name.startswith(".tmp.") for x in root.iterdir()] == [True]
    m = load(model_dir, cache_dir)
    assert m.cache_status == "MISS (no entry)"
    assert [x.name for x in root.iterdir()] == [entries(cache_dir)[0]["key"]]  # leftover swept
    assert load(model_dir, cache_dir).cache_status == "HIT"


# ---- cpullm cache ls | clear ---------------------------------------------------------------------
def test_cli_cache_ls_and_clear(model_dir, tmp_path, cache_dir, capsys):
    other = Path(shutil.copytree(model_dir, tmp_path / "other-model"))
    _change_config(other, None)                       # another model (same files would share a key)
    assert main(["cache", "ls", "--cache-dir", str(cache_dir)]) == 0
    assert "empty" in capsys.readouterr().out
    load(model_dir, cache_dir)
    load(model_dir, cache_dir, quant="f32")
    load(other, cache_dir)

    assert main(["cache", "ls", "--cache-dir", str(cache_dir)]) == 0
    out = capsys.readouterr().out
    keys = [e["key"] for e in entries(cache_dir)]
    assert all(k[:12] in out for k in keys) and "other-model" in out and "3 entries" in out
    assert main(["cache", "ls", "--json", "--cache-dir", str(cache_dir)]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert len(listed) == 3
    for e in listed:
        assert {"model", "key", "size_bytes", "created", "last_used"} <= set(e)
        assert e["size_bytes"] > 0 and e["created"] <= e["last_used"] + 1 and e["valid"]

    assert main(["cache", "clear", str(model_dir), "--cache-dir", str(cache_dir)]) == 0
    assert "removed 2 execution cache entries" in capsys.readouterr().out
    assert [e["model"] for e in entries(cache_dir)] == [str(other.resolve())]
    assert main(["cache", "clear", "no-such-model", "--cache-dir", str(cache_dir)]) == 2
    assert "no execution cache entry belongs to model 'no-such-model'" in capsys.readouterr().err
    assert main(["cache", "clear", "other-model", "--cache-dir", str(cache_dir)]) == 0  # by name
    assert entries(cache_dir) == []
    load(model_dir, cache_dir)
    assert main(["cache", "clear", "--cache-dir", str(cache_dir)]) == 0
    assert "removed 1 execution cache entry" in capsys.readouterr().out and entries(cache_dir) == []


def test_cli_run_reports_hit_and_miss(model_dir, cache_dir, capsys):
    argv = ["run", str(model_dir), "-p", "Hi", "-n", "2", "--json", "--cache-dir", str(cache_dir)]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["cache"] == "MISS (no entry)"
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["cache"] == "HIT"
    assert main(argv[:-2] + ["--no-cache"]) == 0
    assert json.loads(capsys.readouterr().out)["cache"] == "OFF"
