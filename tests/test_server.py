"""``cpullm serve``: a real server on 127.0.0.1 (free port) driven with the official openai client
and raw HTTP: answers, streaming, usage, sampling fields, concurrency, disconnects, errors, auth."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

from test_server_support import (ServerProcess, chat_model_dir, cli_env, make_chat_model,  # noqa: E402
                                  shared_server)

MODEL = "tinychat"
HI = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def server():
    return shared_server()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def local():
    """The same model through the Python API, for exact comparisons."""
    import cpullm
    return cpullm.load(chat_model_dir(), threads=1, n_ctx=512)


def _greedy_chat(local, messages, n):
    from cpullm.generate.chat import chat_prompt_ids
    ids = chat_prompt_ids(local, messages)
    return ids, "".join(local.generate(ids, max_new_tokens=n, temperature=0.0))


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    h = httpx.get(server.url + "/health").json()
    assert h["status"] == "ok" and h["model"] == MODEL and h["n_ctx"] == 512
    assert h["parallel"] >= 2 and h["kv_bytes_per_stream"] > 0      # 2 threads: 4 per thread, at most 8
    assert h["kv_bytes_planned"] == h["parallel"] * h["kv_bytes_per_stream"] and h["kv_dtype"] == "f16"
    pc = h["prefix_cache"]
    assert pc["budget_bytes"] > 0 and 0 <= pc["bytes"] <= pc["budget_bytes"] and pc["block_tokens"] == 64


def test_a_request_sent_during_a_stream_is_answered_like_alone(server, client):
    """A short request sent while a long stream runs gets the text it gets alone, and the stream
    too (that the short one joins the running decode steps, counted in steps, is
    test_scheduler's test_a_request_submitted_mid_stream_joins_the_running_decode)."""
    short = dict(model=MODEL, prompt="Hi", max_tokens=3, temperature=0)
    want_short = client.completions.create(**short).choices[0].text
    long = dict(model=MODEL, prompt="Once", max_tokens=200, temperature=0)
    want_long = client.completions.create(**long).choices[0].text
    pieces, started, done = [], threading.Event(), threading.Event()

    def long_stream():
        for c in client.completions.create(**long, stream=True):
            pieces.append(c.choices[0].text if c.choices else "")
            if len(pieces) >= 3:
                started.set()
        started.set()
        done.set()
    t = threading.Thread(target=long_stream)
    t.start()
    assert started.wait(120)
    assert client.completions.create(**short).choices[0].text == want_short
    t.join(120)
    assert done.is_set() and "".join(pieces) == want_long


def test_chat_completion_matches_the_python_api(client, local):
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=8, temperature=0)
    ids, text = _greedy_chat(local, HI, 8)
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == text
    assert c.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 8, len(ids) + 8)


def test_chat_streaming_equals_non_streaming(client):
    kw = dict(model=MODEL, messages=HI, max_tokens=10, temperature=0)
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert len({c.id for c in chunks}) == 1


def test_completions_text_and_token_ids(client, local):
    prompt = "The capital of France is"
    want = "".join(local.generate(prompt, max_new_tokens=6, temperature=0.0))
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == want
    assert r.usage.prompt_tokens == len(local.tokenizer.encode(prompt)) and r.usage.completion_tokens == 6
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want
    ids = local.tokenizer.encode(prompt)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert r.choices[0].text == want


def test_stop_strings(client):
    full = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=24, temperature=0).choices[0].text
    stop = next(full[i:i + 2] for i in range(3, len(full) - 2) if full[i:i + 2].strip())
    r = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == full[:full.find(stop)]
    assert r.choices[0].finish_reason == "stop"
    s = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=24, temperature=0, stop=stop,
                                  stream=True)
    assert "".join(c.choices[0].text for c in s) == full[:full.find(stop)]


def test_seed_temperature_top_p(client):
    kw = dict(model=MODEL, messages=HI, max_tokens=12, temperature=1.0, top_p=0.9, seed=1234)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b                                   # same seed, same sample
    greedy = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=12, temperature=0)
    assert greedy.choices[0].message.content == client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=12, temperature=0, seed=99).choices[0].message.content


def test_concurrent_clients_get_their_own_answers(client, local):
    prompts = [[{"role": "user", "content": f"question number {i} " * (i + 1)}] for i in range(6)]
    want = [_greedy_chat(local, p, 12)[1] for p in prompts]
    got = [None] * len(prompts)
    errors = []

    def ask(i):
        try:
            if i % 2:
                s = client.chat.completions.create(model=MODEL, messages=prompts[i], max_tokens=12,
                                                   temperature=0, stream=True)
                got[i] = "".join(c.choices[0].delta.content or "" for c in s if c.choices)
            else:
                got[i] = client.chat.completions.create(model=MODEL, messages=prompts[i], max_tokens=12,
                                                        temperature=0).choices[0].message.content
        except Exception as exc:       # reported below
            errors.append(exc)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and got == want


def test_disconnect_mid_stream_stops_the_generation(server, client):
    before = server.wait_idle()
    # the rest of the context (512 - 159 prompt tokens): on a loaded host the tiny model can write
    # 300 tokens before the server sees the client leave
    body = {"model": MODEL, "messages": HI, "max_tokens": 350, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            events = 0
            for line in r.iter_lines():
                events += line.startswith("data: ")
                if events == 3:
                    break                       # leave mid-answer: the connection closes
    after = server.wait_idle()
    assert after["cancelled"] == before["cancelled"] + 1
    assert 0 < after["generated_tokens"] - before["generated_tokens"] < 350
    # the slot is free: the next request is answered in full
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3


def test_disconnect_while_waiting_for_a_full_answer(server):
    before = server.wait_idle()
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 400, "temperature": 0}).encode()
    host, port = server.url.rsplit("/", 1)[1].split(":")
    with socket.create_connection((host, int(port))) as sock:     # send the request, then hang up
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    after = server.wait_idle(requests=before["requests"] + 1)
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["generated_tokens"] - before["generated_tokens"] < 350


# ---- bad requests -----------------------------------------------------------------------------------------
CHAT, COMP = "/v1/chat/completions", "/v1/completions"
BAD = [
    # (path, body (dict = JSON, bytes = raw), status, code, param, message part)
    (CHAT, b'{"messages": [', 400, "invalid_json", None, "not valid JSON"),
    (CHAT, b"[1, 2]", 400, "invalid_json", None, "must be a JSON object"),
    (CHAT, b"\xff\xfe", 400, "invalid_json", None, "not UTF-8"),
    (CHAT, b"[" * 50000, 400, "invalid_json", None, "not valid JSON"),
    (CHAT, {"model": MODEL}, 400, "missing_required_parameter", "messages", "messages is required"),
    (CHAT, {"messages": []}, 400, "invalid_value", "messages", "non-empty list"),
    (CHAT, {"messages": "hello"}, 400, "invalid_value", "messages", "non-empty list"),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400, "invalid_value", "messages", "role must be"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "invalid_value", "messages", "must be a string"),
    (CHAT, {"messages": HI, "max_tokens": 0}, 400, "invalid_value", "max_tokens", ">= 1"),
    (CHAT, {"messages": HI, "max_tokens": -3}, 400, "invalid_value", "max_tokens", ">= 1"),
    (CHAT, {"messages": HI, "max_tokens": "5"}, 400, "invalid_type", "max_tokens", "integer"),
    (CHAT, {"messages": HI, "max_completion_tokens": 0}, 400, "invalid_value", "max_completion_tokens", ">= 1"),
    (CHAT, {"messages": HI, "temperature": "hot"}, 400, "invalid_type", "temperature", "number"),
    (CHAT, {"messages": HI, "temperature": -1}, 400, "invalid_value", "temperature", "[0.0, 2.0]"),
    (CHAT, {"messages": HI, "top_p": 0}, 400, "invalid_value", "top_p", "(0.0, 1.0]"),
    (CHAT, {"messages": HI, "seed": "x"}, 400, "invalid_type", "seed", "integer"),
    (CHAT, {"messages": HI, "stream": "yes"}, 400, "invalid_type", "stream", "true or false"),
    (CHAT, {"messages": HI, "stop": 5}, 400, "invalid_type", "stop", "string or a list"),
    (CHAT, {"messages": HI, "n": 9}, 400, "invalid_value", "n", "at most 8"),
    (CHAT, {"model": "gpt-4o", "messages": HI}, 404, "model_not_found", "model", "`gpt-4o` does not exist"),
    (CHAT, {"model": 7, "messages": HI}, 400, "invalid_type", "model", "string"),
    (CHAT, {"messages": [{"role": "user", "content": "long " * 120}]}, 400, "context_length_exceeded",
     "messages", "maximum context length is 512"),
    (CHAT, {"messages": HI, "max_tokens": 500}, 400, "context_length_exceeded", "max_tokens", "lower max_tokens"),
    (COMP, {"model": MODEL}, 400, "missing_required_parameter", "prompt", "prompt is required"),
    (COMP, {"prompt": ""}, 400, "invalid_value", "prompt", "empty"),
    (COMP, {"prompt": 5}, 400, "invalid_type", "prompt", "non-empty string"),
    (COMP, {"prompt": [10**7]}, 400, "invalid_value", "prompt", "token ids must be in"),
    (COMP, {"prompt": ["a", "b"]}, 400, "unsupported_parameter", "prompt", "batched"),
    (COMP, {"prompt": "hi", "echo": True}, 400, "unsupported_parameter", "echo", "not supported"),
]


def _check_error(r, status, code=None, param=None, part=None):
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    if code is not None:
        assert err["code"] == code, err
    assert err["param"] == param, err
    if part is not None:
        assert part in err["message"], err
    return err


@pytest.mark.parametrize("path,body,status,code,param,part", BAD,
                         ids=[f"{i}-{b[1] if isinstance(b, tuple) else ''}" for i, b in enumerate(BAD)])
def test_bad_requests_get_openai_errors(server, path, body, status, code, param, part):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=content, headers={"content-type": "application/json"}, timeout=60)
    _check_error(r, status, code, param, part)


def test_protocol_errors(server):
    u = server.url
    _check_error(httpx.post(u + CHAT, content=b"{}", headers={"content-type": "text/plain"}), 415,
                 "unsupported_media_type", part="Content-Type: application/json")
    big = json.dumps({"messages": [{"role": "user", "content": "x" * 70000}]}).encode()
    _check_error(httpx.post(u + CHAT, content=big, headers={"content-type": "application/json"}), 413,
                 "request_too_large", part="--max-request-bytes")

    def chunks():                                      # no Content-Length: counted while reading
        for _ in range(20):
            yield b" " * 4096
    _check_error(httpx.post(u + CHAT, content=chunks(), headers={"content-type": "application/json"}), 413,
                 "request_too_large")
    _check_error(httpx.get(u + CHAT), 405, "method_not_allowed")
    _check_error(httpx.get(u + "/v1/nothing"), 404, "unknown_url", part="Endpoints:")
    _check_error(httpx.get(u + "/v1/models/other"), 404, "model_not_found", "model")
    _check_error(httpx.get(u + "/health", headers={"host": "evil.example:80"}), 400, "invalid_host")
    assert httpx.get(u + "/health", headers={"host": "localhost"}).status_code == 200


def test_client_errors_surface_in_the_openai_client(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=0)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=HI, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=MODEL, prompt="word " * 200, max_tokens=1)


def test_server_survives_the_bad_requests(server, client):
    h = server.wait_idle()
    assert h["failed"] == 0 and h["status"] == "ok"
    assert client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2).usage.completion_tokens == 2


# ---- API key, a model without a chat template, the command line --------------------------------------------
@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    d = make_chat_model(tmp_path_factory.mktemp("base") / "base-model", chat_template=None, seed=1)
    s = ServerProcess(d, "--api-key", "s3cret-key")
    yield s
    assert s.stop() == 0


def test_api_key(keyed):
    bad = openai.OpenAI(base_url=keyed.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.post(keyed.url + COMP, json={"prompt": "hi", "max_tokens": 1})
    err = _check_error(r, 401, "invalid_api_key", part="Authorization: Bearer")
    assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.post(keyed.url + COMP, json={"prompt": "hi"}, headers={"authorization": "Basic s3cret-key"}).status_code == 401
    assert err
    good = openai.OpenAI(base_url=keyed.url + "/v1", api_key="s3cret-key", max_retries=0)
    assert good.models.list().data[0].id == "base-model"
    assert good.completions.create(model="base-model", prompt="hi", max_tokens=2).usage.completion_tokens == 2
    assert httpx.get(keyed.url + "/health").status_code == 200           # open: runs nothing
    assert httpx.get(keyed.url + "/").status_code == 200


def test_chat_on_a_model_without_template_is_a_clear_error(keyed):
    good = openai.OpenAI(base_url=keyed.url + "/v1", api_key="s3cret-key", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="has no chat template.*completions") as info:
        good.chat.completions.create(model="base-model", messages=HI, max_tokens=2)
    assert info.value.body["code"] == "chat_template_error"


def _cli(*args, timeout=180):
    return subprocess.run([sys.executable, "-m", "cpullm.cli", *map(str, args)], capture_output=True,
                          text=True, env=cli_env(), timeout=timeout)


def test_serve_cli_help_and_errors(server, tmp_path):
    h = _cli("serve", "--help")
    assert h.returncode == 0
    for opt in ("--host", "--port", "--api-key", "--max-request-bytes", "127.0.0.1"):
        assert opt in h.stdout
    r = _cli("serve", tmp_path / "missing")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "does not exist" in r.stderr
    port = server.url.rsplit(":", 1)[1]
    r = _cli("serve", chat_model_dir(), "--port", port, "--threads", "1", "--ctx", "512")
    assert r.returncode == 2 and "cannot listen on 127.0.0.1:" in r.stderr and "--port" in r.stderr
    assert r.stderr.strip().count("\n") == 0
