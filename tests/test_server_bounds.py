"""``cpullm serve`` under hostile and greedy clients: lone surrogates and overflowing sampling
values are 400s; answers are capped in tokens and time; slow headers and bodies do not hold a
connection; a hostile chat template is refused (plain completion still works) and its render
stops when the client leaves or the server stops; SIGINT answers every waiting client with the
503 JSON error and ends streams with an error event. Every wait here is a liveness bound."""
from __future__ import annotations

import argparse
import json
import os
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

from test_server_support import CHATML, ServerProcess, _tmpdir, shared_server  # noqa: E402

HI = [{"role": "user", "content": "Hello there"}]
SPIN = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def _long_model(chat_template: str | None = CHATML) -> Path:
    """The tiny random Llama with an 8192-token context, so one answer can run for seconds."""
    from cpullm.testing import make_random_checkpoint
    from tiny_configs import SMOLLM2_LIKE

    cfg = dict(SMOLLM2_LIKE, model_type="llama", eos_token_id=10**6, max_position_embeddings=8192)
    out = make_random_checkpoint(cfg, _tmpdir("cpullm-long-") / "longchat", seed=0)
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": chat_template}))
    return out


def _hostile_model() -> Path:
    from test_server_support import make_chat_model
    return make_chat_model(_tmpdir("cpullm-hostile-") / "hostile", chat_template=SPIN)


def _post(url, path, body, timeout=120, **kw):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=content, timeout=timeout,
                      headers={"content-type": "application/json", **kw.pop("headers", {})}, **kw)


def _error(r, status, code, param=None, part=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    if part is not None:
        assert part in err["message"], err
    return err


def _host_port(server):
    host, port = server.url.rsplit("/", 1)[1].split(":")
    return host, int(port)


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def _render_workers(pid: int) -> list[int]:
    found = []
    for c in _children(pid):
        try:
            if b"template_sandbox.py" in Path(f"/proc/{c}/cmdline").read_bytes():
                found.append(c)
        except OSError:
            pass
    return found


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout} s")


# ---- request validation (the shared server) ----------------------------------------------------------
@pytest.mark.parametrize("path,raw,param", [
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}', "messages"),
    ("/v1/completions", b'{"prompt": "a\\udc00b", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": "ab", "stop": ["\\ud83d"], "max_tokens": 2}', "stop"),
])
def test_lone_surrogates_are_400s(path, raw, param):
    _error(_post(shared_server().url, path, raw), 400, "invalid_value", param, "lone UTF-16 surrogate")


@pytest.mark.parametrize("field,value", [
    ("temperature", 5e-324), ("temperature", 1e-300), ("repetition_penalty", 5e-324),
    ("repetition_penalty", 1e300),
])
def test_sampling_values_that_overflow_are_400s(field, value):
    server = shared_server()
    r = _post(server.url, "/v1/completions", {"prompt": "hi", "max_tokens": 3, field: value})
    _error(r, 400, "invalid_value", field)
    assert server.health()["failed"] == 0


def test_slow_and_silent_connections_are_closed():
    """uvicorn alone keeps both forever; the header deadline (default 10 s) closes them."""
    server = shared_server()
    silent = socket.create_connection(_host_port(server))
    slow = socket.create_connection(_host_port(server))
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    closed_after = None
    t0 = time.monotonic()
    try:
        slow.settimeout(0.5)
        for i in range(120):                                   # one byte per half second
            try:
                slow.sendall(head[i % len(head):i % len(head) + 1])
                if slow.recv(1024) == b"":
                    closed_after = time.monotonic() - t0
                    break
            except socket.timeout:
                continue
            except OSError:
                closed_after = time.monotonic() - t0
                break
        silent.settimeout(30)
        assert silent.recv(1024) == b""                         # closed, nothing sent
    finally:
        slow.close()
        silent.close()
    assert closed_after is not None, "a client trickling its headers held the connection for 60 s"
    assert httpx.get(server.url + "/health").status_code == 200


# ---- caps, template refusal, body timeout (a server on a model with a hostile template) -------------------
@pytest.fixture(scope="module")
def hostile():
    s = ServerProcess(_hostile_model(), "--template-timeout", 2, "--max-tokens-cap", 7,
                      "--header-timeout", 2, "--body-timeout", 2)
    yield s
    assert s.stop() == 0


def test_a_hostile_template_is_refused_and_completions_still_work(hostile):
    r = _post(hostile.url, "/v1/chat/completions", {"messages": HI, "max_tokens": 2})
    err = _error(r, 400, "chat_template_error", "messages", "exceeded 2 s")
    assert "/v1/completions" in err["message"]
    r = _post(hostile.url, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert _post(hostile.url, "/v1/chat/completions", {"messages": HI}).status_code == 400
    assert hostile.health()["failed"] == 0


def test_max_tokens_is_capped_and_the_limits_are_reported(hostile):
    for body in ({"prompt": "hi"}, {"prompt": "hi", "max_tokens": 300}):
        r = _post(hostile.url, "/v1/completions", body).json()
        assert r["usage"]["completion_tokens"] == 7 and r["choices"][0]["finish_reason"] == "length"
    limits = hostile.health()["limits"]
    assert limits["max_tokens_cap"] == 7 and limits["template_timeout_s"] == 2
    assert limits["request_timeout_s"] == 300 and limits["body_timeout_s"] == 2
    card = httpx.get(hostile.url + "/v1/models").json()["data"][0]
    assert card["max_tokens_cap"] == 7 and card["request_timeout_s"] == 300


def test_a_body_that_never_arrives_gets_408(hostile):
    with socket.create_connection(_host_port(hostile), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\":")
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


# ---- generation time limit and the API key from a file ---------------------------------------------------------
@pytest.fixture(scope="module")
def long_model():
    return _long_model()


def test_generation_time_is_capped_and_the_key_comes_from_a_file(long_model, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("file-held-key\n")
    s = ServerProcess(long_model, "--request-timeout", 0.3, "--max-tokens-cap", 8000,
                      "--api-key-file", key_file, ctx=8192)
    try:
        assert b"file-held-key" not in Path(f"/proc/{s.pid}/cmdline").read_bytes()
        assert _post(s.url, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 401
        auth = {"authorization": "Bearer file-held-key"}
        r = _post(s.url, "/v1/completions", {"prompt": "hi", "max_tokens": 8000}, headers=auth).json()
        assert r["choices"][0]["finish_reason"] == "length"
        assert 0 < r["usage"]["completion_tokens"] < 8000
        assert s.health()["timed_out"] == 1
    finally:
        assert s.stop() == 0


def test_api_key_sources(tmp_path, monkeypatch):
    from cpullm.cli.commands.serve import api_key
    from cpullm.errors import ConfigError

    monkeypatch.setenv("CPULLM_API_KEY", "from-env")
    ns = lambda key=None, path=None: argparse.Namespace(api_key=key, api_key_file=path)  # noqa: E731
    assert api_key(ns()) == "from-env"
    assert api_key(ns("flag")) == "flag"
    (tmp_path / "k").write_text("  from-file \nsecond line\n")
    assert api_key(ns(path=tmp_path / "k")) == "from-file"
    for bad, part in ((ns("flag", tmp_path / "k"), "not both"), (ns(path=tmp_path / "none"), "cannot read"),
                      (ns(path=tmp_path), "cannot read")):
        with pytest.raises(ConfigError, match=part):
            api_key(bad)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="first line must hold the key"):
        api_key(ns(path=tmp_path / "empty"))


# ---- shutdown with requests in flight --------------------------------------------------------------------
def test_sigint_answers_waiting_clients_and_ends_streams(long_model):
    s = ServerProcess(long_model, "--max-tokens-cap", 8000, "--parallel", 1, "--shutdown-timeout", 0, ctx=8192)
    events, waiting = [], {}
    first = threading.Event()

    def stream():
        with httpx.stream("POST", s.url + "/v1/completions", timeout=120,
                          json={"prompt": "hi", "max_tokens": 8000, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first.set()

    def wait_in_line():
        waiting["r"] = _post(s.url, "/v1/completions", {"prompt": "hi", "max_tokens": 5})

    streamer = threading.Thread(target=stream)
    streamer.start()
    assert first.wait(120), "the stream did not start"
    waiter = threading.Thread(target=wait_in_line)
    waiter.start()
    _wait_for(lambda: s.health()["queued"] == 1, 60, "the second request waiting in line")
    s.proc.send_signal(2)                                     # SIGINT, as Ctrl-C
    streamer.join(60)
    waiter.join(60)
    assert s.proc.wait(60) == 0
    log = s.output()
    s.stop()
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["error"]["code"] == "server_shutting_down", events[-3:]
    _error(waiting["r"], 503, "server_shutting_down")
    assert waiting["r"].headers["content-type"].startswith("application/json")
    assert "Traceback" not in log and "Exception in ASGI" not in log, log


# ---- a render in flight: the client leaves, or the server stops ------------------------------------------
def test_a_render_stops_when_its_client_leaves_and_on_sigint():
    s = ServerProcess(_hostile_model(), "--template-timeout", 120)
    try:
        body = json.dumps({"messages": HI, "max_tokens": 2}).encode()
        with socket.create_connection(_host_port(s)) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            _wait_for(lambda: _render_workers(s.pid), 60, "the render worker")
            time.sleep(0.5)
        _wait_for(lambda: not _render_workers(s.pid), 60, "the render to stop after the client left")
        h = s.wait_idle(requests=1)
        assert h["cancelled"] == 1 and h["generated_tokens"] == 0     # nothing was generated for it

        answer = {}
        t = threading.Thread(target=lambda: answer.update(r=_post(s.url, "/v1/chat/completions", body)))
        t.start()
        _wait_for(lambda: _render_workers(s.pid), 60, "the render worker")
        s.proc.send_signal(2)
        assert s.proc.wait(60) == 0                           # not held by the 120 s render
        t.join(60)
        _error(answer["r"], 503, "server_shutting_down")
        assert "Traceback" not in s.output()
    finally:
        s.stop()
