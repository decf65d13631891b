"""The Python API and the server in the peers' shapes: ``max_tokens`` (``max_new_tokens`` kept as
an alias) and llama.cpp's ``POST /tokenize`` / ``/detokenize``."""
from __future__ import annotations

import pytest

import cpullm
from cpullm.errors import PromptError

from test_server_support import chat_model_dir  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return cpullm.load(chat_model_dir(), threads=1, n_ctx=128)


def test_max_tokens_and_its_alias(model):
    a = "".join(model.generate("hello", max_tokens=4))
    b = "".join(model.generate("hello", max_new_tokens=4))
    c = "".join(model.generate("hello", 4))
    assert a == b == c
    ids = model.tokenizer.encode("hello")
    assert list(model.generate_ids(ids, max_tokens=3, ignore_eos=True)) == \
        list(model.generate_ids(ids, max_new_tokens=3, ignore_eos=True))
    assert len(list(model.generate_ids(ids, max_tokens=3, ignore_eos=True))) == 3
    assert model.generate_batch([ids], max_tokens=3, ignore_eos=True) == \
        model.generate_batch([ids], max_new_tokens=3, ignore_eos=True)
    assert model.generate("hello", max_tokens=2, max_new_tokens=2) is not None   # agreeing is fine
    for call in (lambda: model.generate("hello", max_tokens=2, max_new_tokens=3),
                 lambda: model.generate_ids(ids, max_tokens=2, max_new_tokens=3),
                 lambda: model.generate_batch([ids], max_tokens=2, max_new_tokens=3)):
        with pytest.raises(PromptError, match="disagree"):
            call()


def test_engine_submit_takes_max_tokens(model):
    engine = model.engine(parallel=1)
    try:
        ids = model.tokenizer.encode("hello")
        req = engine.submit(ids, max_tokens=3, stop_ids=())
        assert len(list(req)) == 3
        with pytest.raises(PromptError, match="disagree"):
            engine.submit(ids, max_tokens=3, max_new_tokens=4)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def client(model):
    starlette = pytest.importorskip("starlette")  # noqa: F841
    from starlette.testclient import TestClient

    from cpullm.serve import create_app
    app = create_app(model, model_id="tiny", api_key="k", parallel=1)
    with TestClient(app) as c:
        c.headers["Authorization"] = "Bearer k"
        yield c


def test_tokenize_and_detokenize_round_trip(client, model):
    text = "Hello world, hello tokens"
    r = client.post("/tokenize", json={"content": text})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    assert ids == model.tokenizer.encode(text, add_special_tokens=False)
    assert client.post("/tokenize", json={"content": text, "add_special": True}).json()["tokens"] == \
        model.tokenizer.encode(text, add_special_tokens=True)
    pieces = client.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids and "".join(p["piece"] for p in pieces) == \
        model.tokenizer.decode(ids)
    r = client.post("/detokenize", json={"tokens": ids})
    assert r.status_code == 200 and r.json() == {"content": model.tokenizer.decode(ids)}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "content"),
    ("/tokenize", {"content": 3}, "content"),
    ("/tokenize", {"content": "x", "add_special": "yes"}, None),
    ("/tokenize", {"content": "x", "parse_special": True}, "parse_special"),   # nothing ignored
    ("/tokenize", {"content": "x" * (2 ** 20 + 1)}, "content"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [10 ** 9]}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "other"}, "model"),
])
def test_token_routes_refuse_bad_requests(client, path, body, param):
    r = client.post(path, json=body)
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert err["message"] and (param is None or err["param"] == param)


def test_token_routes_need_the_api_key(client):
    for path, body in (("/tokenize", {"content": "x"}), ("/detokenize", {"tokens": [1]})):
        r = client.post(path, json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
