"""Helpers shared by the chat, server and web tests (no tests here): a tiny random-weight chat
model and a real ``cpullm serve`` subprocess on a free loopback port."""
from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

# ChatML, as SmolLM2-Instruct writes it (default system prompt when none is given)
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
          "Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")


def make_chat_model(out_dir, chat_template: str | None = CHATML, seed: int = 0) -> Path:
    """A tiny random Llama checkpoint (byte-level tokenizer) with ``chat_template`` in
    tokenizer_config.json. Its EOS id is outside the vocabulary, so answers always run to
    max_tokens: deterministic lengths for protocol tests."""
    from cpullm.testing import make_random_checkpoint
    from tiny_configs import SMOLLM2_LIKE

    cfg = dict(SMOLLM2_LIKE, model_type="llama", eos_token_id=10**6, max_position_embeddings=1024)
    out = make_random_checkpoint(cfg, out_dir, seed=seed)
    tc = {"chat_template": chat_template} if chat_template else {}
    (out / "tokenizer_config.json").write_text(json.dumps(tc))
    return out


_TMP = []


def _tmpdir(prefix: str) -> Path:
    d = Path(tempfile.mkdtemp(prefix=prefix))
    _TMP.append(d)
    return d


@atexit.register
def _cleanup():
    for s in list(_SERVERS):
        s.stop()
    for d in _TMP:
        shutil.rmtree(d, ignore_errors=True)


_MODELS: dict = {}


def chat_model_dir() -> Path:
    """The session's tiny chat model (built once)."""
    if "chat" not in _MODELS:
        _MODELS["chat"] = make_chat_model(_tmpdir("cpullm-chatmodel-") / "tinychat")
    return _MODELS["chat"]


def cli_env() -> dict:
    env = dict(os.environ)
    env.setdefault("CPULLM_QUIET", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


_SERVERS: list = []


class ServerProcess:
    """``python -m cpullm.cli serve MODEL --port 0 ...`` with its output in a log file."""

    def __init__(self, model_dir, *extra, ctx: int = 512, timeout: float = 180.0):
        self.log_path = _tmpdir("cpullm-serve-") / "serve.log"
        self.log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "cpullm.cli", "serve", str(model_dir), "--port", "0",
               "--threads", "1", "--ctx", str(ctx), *map(str, extra)]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=cli_env(),
                                     start_new_session=True)
        _SERVERS.append(self)
        self.url = self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"cpullm serve exited ({self.proc.returncode}):\n{self.output()}")
            m = re.search(r"serving \S+ at (http://127\.0\.0\.1:\d+)/", self.output())
            if m:
                url = m.group(1)
                try:
                    if httpx.get(url + "/health", timeout=10).status_code == 200:
                        return url
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"cpullm serve did not start in {timeout}s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=30).json()

    def wait_idle(self, timeout: float = 60.0, requests: int = 0) -> dict:
        """Health once at least ``requests`` generations were submitted and nothing runs or
        waits (a liveness bound, not a speed check)."""
        deadline = time.monotonic() + timeout
        while True:
            h = self.health()
            if h["active"] == 0 and h["queued"] == 0 and h["requests"] >= requests:
                return h
            if time.monotonic() > deadline:
                raise AssertionError(f"server still busy after {timeout}s: {h}")
            time.sleep(0.05)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self in _SERVERS:
            _SERVERS.remove(self)
        self.log.close() if not self.log.closed else None
        return self.proc.returncode


_SHARED: dict = {}


def shared_server() -> ServerProcess:
    """One server on the tiny chat model for the whole session (request body limit 64 KiB)."""
    s = _SHARED.get("server")
    if s is None or s.proc.poll() is not None:
        s = _SHARED["server"] = ServerProcess(chat_model_dir(), "--max-request-bytes", 65536,
                                              "--model-name", "tinychat")
    return s
