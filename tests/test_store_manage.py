"""Model management as Ollama users expect it: `cpullm list`, `show`, `rm` (never outside the
store), `ps` (servers' state files), and the store name as the server's model id."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("gguf")

from cpullm.compile import cache_format  # noqa: E402
from cpullm import store  # noqa: E402
from cpullm.cli import main  # noqa: E402
from cpullm.errors import StoreError  # noqa: E402
from cpullm.serve import running  # noqa: E402
from test_store import fake, tiny_gguf_bytes  # noqa: E402,F401  (fixtures)


def _program(cache, key: str, model_path, used: float) -> dict:
    """An execution-cache entry for ``model_path`` (its manifest and last_used mark)."""
    entry = cache / "exec" / key
    entry.mkdir(parents=True)
    manifest = {"model_dir": str(model_path.resolve()), "inputs": {"quant": "gguf", "n_ctx": 256}}
    manifest["manifest_sha"] = cache_format.json_sha(manifest)
    (entry / "manifest.json").write_text(json.dumps(manifest))
    (entry / "program.bin").write_bytes(b"\0" * 1000)
    (entry / "last_used").touch()
    os.utime(entry / "last_used", (used, used))
    return entry


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "exec-cache"
    monkeypatch.setenv("CPULLM_CACHE_DIR", str(d))
    return d


def test_list_shows_quantization_context_and_last_use(fake, cache, capsys):
    path = store.pull("tiny-single")
    store.pull("tiny-split")
    used = time.time() - 7200
    _program(cache, "k1", path / "tiny-single.gguf", used)
    by_name = {m["name"]: m for m in store.list_models()}
    m = by_name["tiny-single"]
    assert m["quantization"] == "Q8_0" and m["context"] and m["last_used"] == pytest.approx(used)
    assert m["exec_cache_bytes"] >= 1000 and by_name["tiny-split"]["last_used"] is None
    assert main(["list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["NAME", "FAMILY", "PARAMS", "QUANT", "SIZE", "LAST", "USED"]
    assert "2 hours ago" in out[1] and "Q8_0" in out[1] and out[2].endswith("never")
    assert main(["ls"]) == 0 and capsys.readouterr().out.splitlines() == out   # Ollama's alias


def test_show_names_architecture_template_files_and_programs(fake, cache, capsys):
    path = store.pull("tiny-single")
    _program(cache, "k1", path / "tiny-single.gguf", time.time())
    d = store.model_details("tiny-single")
    assert d["architectures"] == ["LlamaForCausalLM"] and d["params"] > 0
    assert [f["name"] for f in d["files"]] == ["tiny-single.gguf"] and len(d["programs"]) == 1
    assert main(["show", "tiny-single"]) == 0
    out = capsys.readouterr().out
    for label in ("architecture", "parameters", "quantization", "context", "chat template", "license",
                  "files", "compiled programs (1"):
        assert label in out
    assert main(["show", "nothing-like-it"]) == 2
    assert "no model named 'nothing-like-it'" in capsys.readouterr().err


def test_rm_deletes_the_model_its_download_and_its_programs(fake, cache, capsys):
    path = store.pull("tiny-single")
    keep = store.pull("tiny-split")
    mine = _program(cache, "k1", path / "tiny-single.gguf", time.time())
    other = _program(cache, "k2", keep / "tiny-split.gguf", time.time())
    download = fake.root / "_downloads" / "tiny-single.gguf"
    assert download.is_file()
    assert main(["rm", "tiny-single", "-y"]) == 0
    assert "deleted tiny-single" in capsys.readouterr().out
    assert not path.exists() and not download.exists() and not mine.exists()
    assert keep.exists() and other.exists()
    assert [m["name"] for m in store.list_models()] == ["tiny-split"]


def test_rm_asks_first_and_never_leaves_the_store(fake, cache, tmp_path, capsys, monkeypatch):
    store.pull("tiny-single")
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "config.json").write_text("{}")
    monkeypatch.setattr(sys, "stdin", open(os.devnull))          # not a terminal: no confirmation
    assert main(["rm", "tiny-single"]) == 2
    assert "add -y" in capsys.readouterr().err and (fake.root / "tiny-single").exists()
    for name in (str(outside), "../precious", "_downloads", ".", ".."):
        with pytest.raises(StoreError):
            store.remove_model(name)
    link = fake.root / "linked"
    link.symlink_to(outside)
    store.remove_model("linked")                                # only the link goes
    assert not link.exists() and (outside / "config.json").is_file()


def test_rm_checks_every_name_before_deleting_any(fake, cache, capsys):
    store.pull("tiny-single")
    assert main(["rm", "-y", "tiny-single", "missing"]) == 2
    assert (fake.root / "tiny-single").exists()


def test_ps_lists_live_servers_and_drops_stale_state(tmp_path):
    root = tmp_path / "servers"
    mine = running.write_state({"host": "127.0.0.1", "port": 9, "model": "m"}, root)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = root / f"serve-{dead.pid}.json"
    stale.write_text(json.dumps({"pid": dead.pid, "host": "127.0.0.1", "port": 9, "model": "gone"}))
    (root / "serve-junk.json").write_text("not json")
    found = running.running_servers(root, probe=True)
    assert [(s["pid"], s["model"], s["responding"]) for s in found] == [(os.getpid(), "m", False)]
    assert not stale.exists() and not (root / "serve-junk.json").exists() and mine.exists()
    running.remove_state(mine)
    assert running.running_servers(root) == []


def test_a_server_answers_to_its_store_name_and_is_listed_by_ps(fake, cache, monkeypatch):
    from test_server_support import ServerProcess, cli_env  # noqa: F401

    path = store.pull("tiny-single")
    server = ServerProcess("tiny-single", "--api-key", "k")
    try:
        auth = {"Authorization": "Bearer k"}
        models = httpx.get(server.url + "/v1/models", headers=auth, timeout=30).json()
        assert [m["id"] for m in models["data"]] == ["tiny-single"]
        for mid in ("tiny-single", "tiny-single.gguf"):
            r = httpx.post(server.url + "/v1/completions", headers=auth, timeout=120,
                           json={"model": mid, "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200, r.text
        r = httpx.post(server.url + "/v1/completions", headers=auth, timeout=30,
                       json={"model": "other", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 404
        [entry] = running.running_servers()
        assert entry["pid"] == server.pid and entry["model"] == "tiny-single" and entry["responding"]
        assert entry["model_path"] == str(path / "tiny-single.gguf")
    finally:
        server.stop()
    assert running.running_servers() == []               # the state file went with the server


def test_cp_stores_a_second_name_that_outlives_the_first(fake, cache, capsys):
    path = store.pull("tiny-single")
    assert main(["cp", "tiny-single", "mine/tiny"]) == 0
    copy = fake.root / "mine--tiny"
    assert (copy / "tiny-single.gguf").samefile(path / "tiny-single.gguf")     # no second copy
    assert [m["name"] for m in store.list_models()] == ["mine/tiny", "tiny-single"]
    assert main(["cp", "tiny-single", "mine/tiny"]) == 2
    assert "already has a model named" in capsys.readouterr().err
    with pytest.raises(StoreError):
        store.copy_model("tiny-single", "../outside")
    store.remove_model("tiny-single")
    assert (copy / "tiny-single.gguf").read_bytes() == fake.data
    assert store.resolve_model("mine/tiny") == copy
