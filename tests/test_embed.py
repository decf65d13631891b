"""Embeddings: a Qwen3-Embedding-shaped tiny checkpoint (sentence-transformers modules.json with
last-token pooling) against transformers' final-norm hidden states, the pooling read from the
checkpoint, what is refused, and the server's /v1/embeddings."""
from __future__ import annotations

import base64
import json
import shutil

import numpy as np
import pytest

pytest.importorskip("transformers")

import cpullm  # noqa: E402
from cpullm.errors import PromptError, UnsupportedConfigError  # noqa: E402
from hf_reference import hf_model, save_tiny  # noqa: E402
from cpullm_qwen.tiny_configs import QWEN3  # noqa: E402

# Qwen3-0.6B's structure (heads x head_dim != hidden, GQA, q/k norm, tied), as a transformers config
QWEN3_LIKE = {k: v for k, v in QWEN3.items() if k not in ("model_type", "architectures")}

TEXTS = ["the cat sat on the mat", "a dog ran in the park", "stock prices fell sharply today"]


def _sentence_transformers_files(d, pooling_key: str = "pooling_mode_lasttoken", extra=()):
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
               *extra]
    (d / "modules.json").write_text(json.dumps(modules))
    (d / "1_Pooling").mkdir(exist_ok=True)
    cfg = {"word_embedding_dimension": 64, **{k: k == pooling_key for k in (
        "pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens",
        "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_lasttoken")}}
    (d / "1_Pooling" / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def qwen3_embedding(tmp_path_factory):
    from transformers import Qwen3Config

    d = save_tiny(Qwen3Config(**QWEN3_LIKE), tmp_path_factory.mktemp("embed") / "qwen3-embedding", seed=11)
    _sentence_transformers_files(d)
    return d


@pytest.fixture(scope="module")
def model(qwen3_embedding):
    return cpullm.load(qwen3_embedding, quant="f32", threads=1, n_ctx=128)


def _reference(model_dir, ids_list, pooling: str) -> np.ndarray:
    """transformers' hidden states after the final norm (Qwen3Model's output), pooled, normalized."""
    import torch

    hf = hf_model(model_dir)
    out = []
    with torch.no_grad():
        for ids in ids_list:
            h = hf.model(torch.tensor([ids])).last_hidden_state[0].double().numpy()
            v = {"last": h[-1], "cls": h[0], "mean": h.mean(axis=0)}[pooling]
            out.append(v / np.linalg.norm(v))
    return np.stack(out)


def _cosines(a, b):
    return np.sum(a * b, axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_embeddings_equal_transformers(model, qwen3_embedding):
    ids = [model.tokenizer.encode(t) for t in TEXTS]
    got = model.embed(TEXTS)                                      # pooling from modules.json: last
    assert got.shape == (3, 64) and got.dtype == np.float32
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert _cosines(got, _reference(qwen3_embedding, ids, "last")).min() >= 0.9999
    for pooling in ("mean", "cls"):
        assert _cosines(model.embed(TEXTS, pooling=pooling),
                        _reference(qwen3_embedding, ids, pooling)).min() >= 0.9999
    assert np.array_equal(model.embed(ids), got)                  # token ids give the same
    assert np.array_equal(model.embed(TEXTS[0]), got[:1])         # one string: one row


def test_gemma3_embeddings_equal_transformers(tmp_path):
    """Another family's conventions (scaled embedding, (1 + w) norms, sliding windows) through
    the same cut at the lm_head's input."""
    from transformers import Gemma3TextConfig

    from cpullm_gemma.tiny_configs import GEMMA3_270M_LIKE
    d = save_tiny(Gemma3TextConfig(**GEMMA3_270M_LIKE), tmp_path / "gemma3", seed=5)
    m = cpullm.load(d, quant="f32", threads=1, n_ctx=64)
    texts = [t * 2 for t in TEXTS]                                  # beyond the 12-token window
    ids = [m.tokenizer.encode(t) for t in texts]
    assert min(map(len, ids)) > 12
    for pooling in ("last", "mean"):
        assert _cosines(m.embed(texts, pooling=pooling), _reference(d, ids, pooling)).min() >= 0.9999


def test_embedding_leaves_generation_alone(model):
    before = "".join(model.generate("hello", max_tokens=4))
    model.embed(TEXTS)
    assert "".join(model.generate("hello", max_tokens=4)) == before


def test_unnormalized_and_refused_arguments(model):
    raw = model.embed(TEXTS[:1], normalize=False)
    assert not np.isclose(np.linalg.norm(raw), 1.0)
    with pytest.raises(PromptError, match="pooling must be one of"):
        model.embed(TEXTS, pooling="max")
    with pytest.raises(PromptError, match="does not declare Matryoshka"):
        model.embed(TEXTS, dimensions=32)
    with pytest.raises(PromptError, match="empty"):
        model.embed([""])
    with pytest.raises(PromptError, match="outside the vocabulary"):
        model.embed([[1, 10 ** 6]])


def test_matryoshka_dimensions(qwen3_embedding, tmp_path):
    d = tmp_path / "mrl"
    shutil.copytree(qwen3_embedding, d)
    (d / "config_sentence_transformers.json").write_text(json.dumps({"matryoshka_dimensions": [16, 32]}))
    m = cpullm.load(d, quant="f32", threads=1, n_ctx=64)
    full = m.embed(TEXTS, normalize=False)
    cut = m.embed(TEXTS, dimensions=32)
    expect = full[:, :32] / np.linalg.norm(full[:, :32], axis=1, keepdims=True)
    assert cut.shape == (3, 32) and np.allclose(cut, expect, atol=1e-6)
    with pytest.raises(PromptError, match="16, 32, 64"):
        m.embed(TEXTS, dimensions=24)


def test_unsupported_recipes_are_refused(qwen3_embedding, tmp_path):
    from cpullm.generate.embed import checkpoint_spec

    d = tmp_path / "dense"
    d.mkdir()
    _sentence_transformers_files(d, extra=[{"idx": 3, "name": "3", "path": "3_Dense",
                                            "type": "sentence_transformers.models.Dense"}])
    with pytest.raises(UnsupportedConfigError, match="Dense"):
        checkpoint_spec(d, {})
    _sentence_transformers_files(d, pooling_key="pooling_mode_max_tokens")
    with pytest.raises(UnsupportedConfigError, match="pooling_mode_max_tokens"):
        checkpoint_spec(d, {})
    _sentence_transformers_files(d, pooling_key="pooling_mode_mean_tokens")
    assert checkpoint_spec(d, {}).pooling == "mean" and checkpoint_spec(d, {}).normalize


def test_bidirectional_attention_is_refused_at_load(qwen3_embedding, tmp_path):
    d = tmp_path / "bidir"
    shutil.copytree(qwen3_embedding, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "use_bidirectional_attention": True}))
    with pytest.raises(UnsupportedConfigError, match="bidirectional attention"):
        cpullm.load(d, quant="f32", threads=1, n_ctx=64)


@pytest.fixture(scope="module")
def client(model):
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from cpullm.serve import create_app
    with TestClient(create_app(model, model_id="emb", api_key="k", parallel=1)) as c:
        c.headers["Authorization"] = "Bearer k"
        yield c


def test_openai_embeddings_route(client, model):
    r = client.post("/v1/embeddings", json={"model": "emb", "input": TEXTS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "emb"
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    got = np.array([d["embedding"] for d in body["data"]], np.float32)
    assert np.allclose(got, model.embed(TEXTS), atol=1e-6)
    n_tokens = sum(len(model.tokenizer.encode(t)) for t in TEXTS)
    assert body["usage"] == {"prompt_tokens": n_tokens, "total_tokens": n_tokens}
    r = client.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"})
    vec = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), "<f4")
    assert np.allclose(vec, got[0], atol=1e-6)
    ids = model.tokenizer.encode(TEXTS[1])
    r = client.post("/v1/embeddings", json={"input": [ids]})
    assert np.allclose(r.json()["data"][0]["embedding"], got[1], atol=1e-6)


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": "x", "dimensions": 8}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "pooling": "max"}, "pooling"),
    ({"input": "x", "user": 3}, "user"),
    ({"input": "x", "truncate": True}, "truncate"),
    ({"input": [[1, -2]]}, "input"),
    ({"input": "x", "model": "other"}, "model"),
])
def test_embeddings_route_refuses_bad_requests(client, body, param):
    r = client.post("/v1/embeddings", json=body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param


def test_embed_command_writes_one_json_line_per_input_line(qwen3_embedding, model, monkeypatch, capsys):
    import io
    import sys

    from cpullm.cli import main
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("\n".join(TEXTS).encode() + b"\n")))
    assert main(["embed", str(qwen3_embedding), "--quant", "f32", "-t", "1", "-c", "128"]) == 0
    lines = capsys.readouterr().out.splitlines()
    got = np.array([json.loads(ln)["embedding"] for ln in lines], np.float32)
    assert [json.loads(ln)["index"] for ln in lines] == [0, 1, 2]
    assert np.allclose(got, model.embed(TEXTS), atol=1e-6)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"one\n\nthree\n")))
    assert main(["embed", str(qwen3_embedding), "--quant", "f32", "-t", "1", "-c", "128"]) == 2
    assert "stdin line 2 is empty" in capsys.readouterr().err


@pytest.mark.slow
def test_retrieval_with_a_real_model():
    """A real model's embeddings put a question nearer its answer than the unrelated texts."""
    from realmodels import real_gguf_path

    m = cpullm.load(real_gguf_path("qwen2.5-coder-0.5b-instruct"), threads=2, n_ctx=256)
    docs = ["Paris is the capital and largest city of France.",
            "Photosynthesis turns light, water and carbon dioxide into sugar in plants.",
            "def add(a, b):\n    return a + b"]
    queries = ["What is the capital of France?", "How do plants make sugar from sunlight?",
               "a Python function that sums two numbers"]
    d, q = m.embed(docs, pooling="mean"), m.embed(queries, pooling="mean")
    assert list(np.argmax(q @ d.T, axis=1)) == [0, 1, 2]
