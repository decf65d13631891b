"""The request parser under mutated real requests: a seeded fuzz of the server's two generation
endpoints (values swapped for hostile ones at random places of real bodies, keys dropped or
added, bytes flipped, inserted and cut). Every answer is a success or a 4xx / 503 error whose
JSON message is one short line, each request ends within its timeout, the server prints no
traceback and still answers afterwards."""
from __future__ import annotations

import copy
import json
import random

import httpx
import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

from test_server_support import shared_server  # noqa: E402

CASES = 240
SEED = 20261204

CHAT = {"model": "tinychat", "max_tokens": 4, "temperature": 0.0,
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "Hello there"}],
        "stop": ["\n\n"], "top_p": 0.9, "seed": 3}
COMPLETION = {"model": "tinychat", "max_tokens": 4, "prompt": "Once upon a time", "temperature": 0.7,
              "top_k": 5, "seed": 1, "stream": False}
BODIES = [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)]

# Values a client can send in place of any other (JSON-representable or raw JSON text).
HOSTILE = [None, True, False, 0, -1, 1, 2 ** 63, -(2 ** 63) - 1, 10 ** 400, 1e308, -1e-320, 0.5,
           "", "x" * 5000, "\u202e\u0000", [], {}, [1, "a", None], {"role": 1}, [[[]]],
           {"content": [{"type": "image_url"}]}, ["\n\n"] * 40]
RAW_HOSTILE = ["NaN", "Infinity", "-Infinity", '"\\ud800"', '"\\udfff tail"', "[" * 3000 + "]" * 3000,
               '{"a": ' * 2000 + "1" + "}" * 2000, "1e999999", "-0", '"\\u0000"']


def _paths(obj, prefix=()):
    """Every (path) to a value inside a JSON object."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _set(obj, path, value):
    if not path:
        return value
    target = obj
    for p in path[:-1]:
        target = target[p]
    target[path[-1]] = value
    return obj


RAW_MARK = "\u0001RAW\u0001"


def _mutate(rng: random.Random, body: dict) -> bytes:
    kind = rng.randrange(5)
    b = copy.deepcopy(body)
    if kind == 0:                                        # a value swapped for a hostile one
        path = rng.choice(list(_paths(b)))
        b = _set(b, path, copy.deepcopy(rng.choice(HOSTILE)))
        return json.dumps(b).encode()
    if kind == 1:                                        # raw JSON text no json.dumps writes
        path = rng.choice([p for p in _paths(b) if p])
        raw = rng.choice(RAW_HOSTILE)
        b = _set(b, path, RAW_MARK)
        return json.dumps(b).replace(json.dumps(RAW_MARK), raw).encode()
    if kind == 2:                                        # a key dropped or an unknown one added
        keys = list(b)
        if rng.random() < 0.5 and keys:
            del b[rng.choice(keys)]
        else:
            b[rng.choice(["stream", "n", "logit_bias", "tools", "extra", "stream_options",
                          "response_format", "max_completion_tokens", "ignore_eos"])] = \
                copy.deepcopy(rng.choice(HOSTILE + [True, 2, {"type": "json_object"}]))
        return json.dumps(b).encode()
    data = bytearray(json.dumps(b).encode())
    for _ in range(rng.randint(1, 4)):                  # bytes flipped, inserted or cut
        i = rng.randrange(len(data))
        op = rng.randrange(3)
        if op == 0:
            data[i] = rng.randrange(256)
        elif op == 1:
            data[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 3)))
        else:
            del data[i: i + rng.randint(1, 8)]
    return bytes(data)


def _check_error(r: httpx.Response, case: int, sent: bytes) -> None:
    where = f"case {case}: {sent[:200]!r} -> {r.status_code}"
    assert r.status_code < 500 or r.status_code == 503, f"{where}: {r.text[:500]}"
    body = r.json()
    msg = body["error"]["message"]
    assert isinstance(msg, str) and msg and "\n" not in msg and len(msg) <= 1000, f"{where}: {msg!r}"
    assert "Traceback" not in msg, where


def test_mutated_requests_get_one_line_errors_or_answers():
    s = shared_server()
    rng = random.Random(SEED)
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=s.url, timeout=120) as client:
        for case in range(CASES):
            path, base = rng.choice(BODIES)
            sent = _mutate(rng, base)
            r = client.post(path, content=sent, headers={"Content-Type": "application/json"})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            if r.status_code >= 400:
                _check_error(r, case, sent)
            elif r.headers.get("content-type", "").startswith("text/event-stream"):
                events = [ln for ln in r.text.splitlines() if ln.startswith("data: ")]
                assert events and events[-1] == "data: [DONE]", f"case {case}: {r.text[-300:]}"
            else:
                assert r.json()["choices"], f"case {case}: {r.text[:300]}"
        # it still answers a plain request
        ok = client.post("/v1/completions", json=COMPLETION)
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] is not None
    assert "Traceback" not in s.output()
    # the mix reached both the parser's refusals and real answers
    assert sum(n for c, n in statuses.items() if c >= 400) >= CASES // 4, statuses
    assert statuses.get(200, 0) >= 10, statuses
