"""A bounded soak of ``cpullm serve``: a few hundred mixed short requests from concurrent clients,
some leaving mid-stream. Every request is answered correctly, nothing is left running, the answer
to a fixed request does not change, and the server's RSS stays flat after warm-up."""
from __future__ import annotations

import json
import random
import threading
import time

import httpx
import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

from test_server_support import shared_server  # noqa: E402

N_REQUESTS = 300
CLIENTS = 8
BUDGET_S = 55.0                  # a bound on the whole soak, not a speed claim
RSS_TOLERANCE = 24 * 2**20


def _one(http: httpx.Client, url: str, kind: str, i: int) -> str:
    """Run one request of ``kind``; raise AssertionError if its answer is wrong."""
    hi = [{"role": "user", "content": f"soak {i}"}]
    if kind == "chat":
        r = http.post(url + "/v1/chat/completions", json={"model": "tinychat", "messages": hi,
                                                           "max_tokens": 2, "temperature": 0.5, "seed": i})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 2
    elif kind == "stream":
        with http.stream("POST", url + "/v1/completions",
                         json={"prompt": f"soak {i}", "max_tokens": 3, "stream": True}) as r:
            assert r.status_code == 200
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
    elif kind == "leave":
        with http.stream("POST", url + "/v1/chat/completions",
                         json={"messages": hi, "max_tokens": 60, "stream": True}) as r:
            assert r.status_code == 200
            for ln in r.iter_lines():
                if ln.startswith("data: ") and '"content"' in ln:
                    break                                # gone after the first piece
    elif kind == "meta":
        path = "/health" if i % 2 else "/v1/models"
        r = http.get(url + path)
        assert r.status_code == 200 and r.json()
    elif kind == "bad":
        body = [b'{"messages": [', json.dumps({"messages": hi, "max_tokens": 0}).encode(),
                json.dumps({"model": "other", "messages": hi}).encode()][i % 3]
        r = http.post(url + "/v1/chat/completions", content=body,
                      headers={"content-type": "application/json"})
        assert r.status_code in (400, 404) and set(r.json()["error"]) == {"message", "type", "param", "code"}
    return kind


def _run(url: str, kinds: list[str], deadline: float) -> tuple[dict, list]:
    done: dict = {}
    errors: list = []
    lock = threading.Lock()
    work = list(enumerate(kinds))

    def client():
        with httpx.Client(timeout=60) as http:
            while time.monotonic() < deadline:
                with lock:
                    if not work:
                        return
                    i, kind = work.pop()
                try:
                    _one(http, url, kind, i)
                    with lock:
                        done[kind] = done.get(kind, 0) + 1
                except Exception as exc:       # collected and reported
                    with lock:
                        errors.append((kind, i, repr(exc)))

    threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(1.0, deadline - time.monotonic() + 5))
    return done, errors


def test_soak_mixed_concurrent_requests():
    server = shared_server()
    url = server.url
    start = time.monotonic()
    deadline = start + BUDGET_S
    fixed = {"model": "tinychat", "messages": [{"role": "user", "content": "fixed"}], "max_tokens": 6,
             "temperature": 0}
    reference = httpx.post(url + "/v1/chat/completions", json=fixed, timeout=60).json()
    rng = random.Random(0)
    mix = ["chat"] * 30 + ["stream"] * 20 + ["leave"] * 15 + ["meta"] * 15 + ["bad"] * 20
    warm = [rng.choice(mix) for _ in range(40)]
    done, errors = _run(url, warm, deadline)
    assert not errors, errors[:5]
    server.wait_idle()
    rss_warm = server.rss_bytes()
    before = server.health()

    kinds = [rng.choice(mix) for _ in range(N_REQUESTS)]
    done, errors = _run(url, kinds, deadline)
    assert not errors, errors[:5]
    assert sum(done.values()) == N_REQUESTS, f"only {done} finished within {BUDGET_S}s"
    after = server.wait_idle()
    rss_end = server.rss_bytes()

    generations = sum(kinds.count(k) for k in ("chat", "stream", "leave"))
    assert after["requests"] - before["requests"] == generations
    assert (after["completed"] + after["cancelled"] + after["failed"]) == after["requests"]
    assert after["failed"] == 0
    assert after["queued"] == 0 and after["active"] == 0
    # the model's state is intact: the fixed request gets the same answer
    again = httpx.post(url + "/v1/chat/completions", json=fixed, timeout=60).json()
    assert again["choices"][0]["message"]["content"] == reference["choices"][0]["message"]["content"]
    grew = rss_end - rss_warm
    print(f"soak: {N_REQUESTS} requests {done} in {time.monotonic() - start:.1f}s; RSS "
          f"{rss_warm / 2**20:.1f} -> {rss_end / 2**20:.1f} MiB; cancelled "
          f"{after['cancelled'] - before['cancelled']}")
    assert grew <= max(RSS_TOLERANCE, rss_warm * 0.10), \
        f"RSS grew from {rss_warm / 2**20:.1f} MiB to {rss_end / 2**20:.1f} MiB over {N_REQUESTS} requests"
