"""``cpullm serve`` against the abuses of issue 41: prefix-cache statistics and reuse across
tenants (API keys), headers over 16 KiB in one read, a client that hangs up while sending its
body, the "no chat template" error revealing the model's path, a non-ASCII API key."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

from test_server_support import ServerProcess, _tmpdir, cli_env, make_chat_model  # noqa: E402

KEYS = ("tenant-a-key", "tenant-b-key")
PROMPT = list(range(30, 90))        # 60 tokens: three whole 16-token blocks


@pytest.fixture(scope="module")
def server():
    d = make_chat_model(_tmpdir("cpullm-r3-") / "basemodel", chat_template=None)
    keyfile = _tmpdir("cpullm-r3-keys-") / "keys"
    keyfile.write_text("\n".join(KEYS) + "\n")
    s = ServerProcess(d, "--tenant-keys-file", keyfile, "--model-name", "m", "--prefill-chunk", 16,
                      "--parallel", 2)
    s.model_dir = d
    yield s
    s.stop()


def _auth(key):
    return {"authorization": f"Bearer {key}"}


def _complete(server, key, **extra):
    r = httpx.post(server.url + "/v1/completions", headers=_auth(key), timeout=120,
                   json={"model": "m", "prompt": PROMPT, "max_tokens": 2, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def _hits(server) -> int:
    return httpx.get(server.url + "/health", headers=_auth(KEYS[0]), timeout=30).json()["prefix_cache"]["hits"]


def test_prefix_cache_statistics_need_a_key(server):
    assert "prefix_cache" not in httpx.get(server.url + "/health", timeout=30).json()
    assert "prefix_cache" not in httpx.get(server.url + "/health", headers=_auth("wrong"), timeout=30).json()
    assert "hits" in httpx.get(server.url + "/health", headers=_auth(KEYS[1]), timeout=30).json()["prefix_cache"]


def test_tenants_never_reuse_each_others_prefixes(server):
    a = _complete(server, KEYS[0])
    h0 = _hits(server)
    assert _complete(server, KEYS[0])["choices"] == a["choices"]
    h1 = _hits(server)
    assert h1 == h0 + 1                              # the same tenant reuses its prefix
    b = _complete(server, KEYS[1])
    assert _hits(server) == h1                       # the other tenant does not: no hit to time
    assert b["choices"][0]["text"] == a["choices"][0]["text"]      # and the answer is the same
    _complete(server, KEYS[0], cache_salt="private")
    assert _hits(server) == h1                       # a salt of its own: apart even from its tenant
    _complete(server, KEYS[0], cache_salt="private")
    assert _hits(server) == h1 + 1


def test_headers_over_16_kib_in_one_read_are_refused(server):
    host, port = server.url.rsplit("/", 1)[1].split(":")
    filler = "".join(f"X-Fill-{i}: {'a' * 1000}\r\n" for i in range(100))      # ~100 KB
    raw = (f"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n{filler}\r\n").encode()
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(raw)
        reply = s.recv(65536).decode("latin-1")
    assert reply.startswith("HTTP/1.1 431"), reply[:200]


def test_client_hanging_up_while_sending_its_body_is_counted_and_not_logged(server):
    host, port = server.url.rsplit("/", 1)[1].split(":")
    before = httpx.get(server.url + "/health", headers=_auth(KEYS[0]), timeout=30).json()
    for _ in range(5):
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEYS[0]}\r\n"
                       "Content-Type: application/json\r\nContent-Length: 5000\r\n\r\n{\"model\": ").encode())
            time.sleep(0.2)
    deadline = time.monotonic() + 30
    while True:
        after = httpx.get(server.url + "/health", headers=_auth(KEYS[0]), timeout=30).json()
        if after["cancelled"] >= before["cancelled"] + 5 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert after["cancelled"] == before["cancelled"] + 5
    assert "Traceback" not in server.output()


def test_no_chat_template_error_names_the_model_id_not_its_path(server):
    r = httpx.post(server.url + "/v1/chat/completions", headers=_auth(KEYS[0]), timeout=60,
                   json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "has no chat template" in message and "`m`" in message
    assert str(server.model_dir) not in message and "/tmp" not in message


@pytest.mark.parametrize("key", ["clé-secrète", "two words", "tab\tkey"])
def test_an_api_key_no_client_could_send_is_refused_at_start(key, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "cpullm.cli", "serve", str(tmp_path), "--api-key", key],
                          capture_output=True, text=True, env=cli_env(), timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("cpullm: error: API key 1 must be")
