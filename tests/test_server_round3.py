"""``cpullm serve`` against the abuses of issue 41: prefix-cache statistics and reuse across
tenants (API keys), headers over 16 KiB in one read, a client that hangs up while sending its
body, the "no chat template" error revealing the model's path, a non-ASCII API key."""
from __future__ import annotations

import json
import select
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


def test_headers_over_16_kib_in_pieces_get_the_same_431(server):
    # h11 stops buffering an incomplete head at 16 KiB; the answer must not depend on how the
    # bytes were cut
    host, port = server.url.rsplit("/", 1)[1].split(":")
    filler = "".join(f"X-Fill-{i}: {'a' * 1000}\r\n" for i in range(30)).encode()     # ~30 KB
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        reply = b""
        for i in range(0, len(filler), 4096):
            if select.select([s], [], [], 0.05)[0]:
                break                  # answered mid-head: more bytes would only reset the reply
            s.sendall(filler[i:i + 4096])
        while chunk := s.recv(65536):
            reply += chunk
    head, _, body = reply.decode("latin-1").partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 431"), head
    assert json.loads(body)["error"]["code"] == "headers_too_large"


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


# ---------------------------------------------------------------------------------------------
# Overload: a bounded queue, 429 + Retry-After beyond it, slow readers harm nobody
# ---------------------------------------------------------------------------------------------

SLOTS = 2


@pytest.fixture(scope="module")
def busy_server():
    from test_server_bounds import _long_model
    s = ServerProcess(_long_model(), "--parallel", SLOTS, "--queue", SLOTS, "--model-name", "m",
                      "--max-tokens-cap", 8000, ctx=8192)
    yield s
    s.stop()


def _raw_stream_that_never_reads(server, max_tokens: int) -> socket.socket:
    """A streaming request whose client then reads nothing (a slow reader)."""
    host, port = server.url.rsplit("/", 1)[1].split(":")
    body = json.dumps({"model": "m", "prompt": [5, 6, 7], "max_tokens": max_tokens, "stream": True,
                       "temperature": 0}).encode()
    s = socket.create_connection((host, int(port)), timeout=30)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return s


def _wait_for(server, pred, timeout=60):
    deadline = time.monotonic() + timeout
    while True:
        h = server.health()
        if pred(h):
            return h
        assert time.monotonic() < deadline, h
        time.sleep(0.02)


def test_past_the_queue_requests_get_429_with_retry_after_at_once(busy_server):
    s = busy_server
    hogs = [_raw_stream_that_never_reads(s, 7900) for _ in range(SLOTS)]
    try:
        _wait_for(s, lambda h: h["active"] == SLOTS)
        import concurrent.futures as cf
        waiting = cf.ThreadPoolExecutor(SLOTS)
        queued = [waiting.submit(httpx.post, s.url + "/v1/completions", timeout=300,
                                 json={"model": "m", "prompt": [9, i], "max_tokens": 4}) for i in range(SLOTS)]
        _wait_for(s, lambda h: h["queued"] == SLOTS)
        r = httpx.post(s.url + "/v1/completions", json={"model": "m", "prompt": [1], "max_tokens": 4}, timeout=60)
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "rate_limit_exceeded"
    finally:
        for h in hogs:
            h.close()                       # the hogs leave: their slots free
    assert all(f.result().status_code == 200 for f in queued)
    waiting.shutdown()


def test_five_times_more_clients_than_slots_are_answered_or_refused_cleanly(busy_server):
    """5x more concurrent clients than slots, in rounds, beside two slow readers: each request
    is answered (the same text as alone, greedy) or refused with 429 + Retry-After; memory stays
    bounded and the server answers afterwards."""
    import concurrent.futures as cf

    s = busy_server
    clients, rounds = 5 * SLOTS, 3
    bodies = [{"model": "m", "prompt": [20 + i, 30 + i, 40], "max_tokens": 24, "temperature": 0}
              for i in range(clients)]
    alone = [httpx.post(s.url + "/v1/completions", json=b, timeout=120).json()["choices"][0]["text"]
             for b in bodies]
    rss0 = s.rss_bytes()
    slow = [_raw_stream_that_never_reads(s, 400) for _ in range(2)]
    outcomes = {200: 0, 429: 0}
    try:
        with cf.ThreadPoolExecutor(clients) as pool:
            for _ in range(rounds):
                for i, r in enumerate(pool.map(lambda b: httpx.post(s.url + "/v1/completions", json=b,
                                                                    timeout=300), bodies)):
                    assert r.status_code in (200, 429), r.text
                    outcomes[r.status_code] += 1
                    if r.status_code == 200:
                        assert r.json()["choices"][0]["text"] == alone[i]
                    else:
                        assert r.headers["retry-after"] and r.json()["error"]["code"] == "rate_limit_exceeded"
        peak = s.rss_bytes()
    finally:
        for c in slow:
            c.close()
    assert outcomes[200] + outcomes[429] == clients * rounds and outcomes[200] >= rounds
    assert peak - rss0 < 64 << 20, (rss0, peak)         # queued pieces are bounded per request
    h = s.wait_idle(timeout=120)
    assert h["queued"] == 0 and "Traceback" not in s.output()
    assert httpx.post(s.url + "/v1/completions", json=bodies[0], timeout=120).json()["choices"][0]["text"] == alone[0]


# ---------------------------------------------------------------------------------------------
# Graceful shutdown: SIGTERM stops accepting, refuses the waiting, lets the running finish
# ---------------------------------------------------------------------------------------------

def test_events_and_output_lines_stay_one_line_whatever_the_text(tmp_path):
    """A sampled token can decode to U+0085, U+2028 or U+2029, which JSON leaves raw but
    str.splitlines (httpx's iter_lines, JSONL readers) treats as line ends: escaped, not split."""
    from httpx._decoders import LineDecoder
    from cpullm.serve.jobs import OutputWriter
    from cpullm.serve.openai import json_text

    obj = {"choices": [{"text": "a\x85b\u2028c\u2029d\u00e9\u4e2d\n\x0b\x1c"}]}
    text = json_text(obj)
    assert text.splitlines() == [text] and json.loads(text) == obj and "\u00e9\u4e2d" in text
    event = f"data: {text}\n\n"
    assert [ln for ln in LineDecoder().decode(event) if ln] == [f"data: {text}"]
    out = tmp_path / "out.jsonl"
    w = OutputWriter(str(out))
    w.write(obj)
    w.write(obj)
    w.close()
    assert [json.loads(ln) for ln in out.read_text("utf-8").splitlines()] == [obj, obj]


def test_sigterm_lets_running_generations_finish_and_refuses_the_rest():
    import signal
    import threading
    from test_server_bounds import _long_model

    s = ServerProcess(_long_model(), "--parallel", 1, "--max-tokens-cap", 8000, "--shutdown-timeout", 300,
                      "--model-name", "m", ctx=8192)
    events, waiting, first = [], {}, threading.Event()

    def stream():
        with httpx.stream("POST", s.url + "/v1/completions", timeout=300,
                          json={"model": "m", "prompt": [5, 6], "max_tokens": 3000, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first.set()

    try:
        streamer = threading.Thread(target=stream)
        streamer.start()
        assert first.wait(120)
        waiter = threading.Thread(target=lambda: waiting.setdefault(
            "r", httpx.post(s.url + "/v1/completions", json={"model": "m", "prompt": [1], "max_tokens": 4},
                            timeout=120)))
        waiter.start()
        _wait_for(s, lambda h: h["queued"] == 1)
        s.proc.send_signal(signal.SIGTERM)
        waiter.join(120)
        r = waiting["r"]
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
        with pytest.raises(httpx.ConnectError):            # no longer accepting
            httpx.get(s.url + "/health", timeout=10)
        streamer.join(300)
        assert s.proc.wait(300) == 0
    finally:
        log = s.output()
        s.stop()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "Traceback" not in log


def test_sigterm_past_the_grace_period_ends_a_stream_with_an_error_event():
    import signal
    import threading
    from test_server_bounds import _long_model

    s = ServerProcess(_long_model(), "--parallel", 1, "--max-tokens-cap", 8000, "--shutdown-timeout", 1,
                      "--model-name", "m", ctx=8192)
    events, first = [], threading.Event()

    def stream():       # 8000 tokens: several seconds at the tiny model's speed, past the 1 s grace
        with httpx.stream("POST", s.url + "/v1/completions", timeout=300,
                          json={"model": "m", "prompt": [5, 6], "max_tokens": 8000, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first.set()

    try:
        streamer = threading.Thread(target=stream)
        streamer.start()
        assert first.wait(120)
        s.proc.send_signal(signal.SIGTERM)
        streamer.join(120)
        assert s.proc.wait(120) == 0
    finally:
        log = s.output()
        s.stop()
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "server_shutting_down"
    assert "Traceback" not in log
