"""Tokenizer round trips, incremental detokenization, sampling, stop strings, the run CLI."""
import json

import numpy as np
import pytest

import cpullm
from cpullm.cli import main
from cpullm.errors import SamplingError
from cpullm.generate.sampling import Sampler, SamplingParams
from cpullm.testing import make_random_checkpoint
from cpullm.loading.tokenize import IncrementalDecoder, Tokenizer

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=300, rms_norm_eps=1e-5,
            max_position_embeddings=512, tie_word_embeddings=True, rope_theta=10000.0)
TEXT = "héllo wörld — 你好，世界 🤖🚀 \t\n  code: def f(x): return x**2"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_random_checkpoint(TINY, tmp_path_factory.mktemp("gen"), seed=3)


@pytest.fixture(scope="module")
def model(model_dir):
    return cpullm.load(model_dir, use_cache=False)


def test_tokenizer_round_trip(model_dir):
    tok = Tokenizer(model_dir)
    assert tok.decode(tok.encode(TEXT)) == TEXT


def test_incremental_decoder_never_emits_broken_utf8(model_dir):
    tok = Tokenizer(model_dir)
    ids = tok.encode(TEXT)                    # byte-level: multi-byte chars span several ids
    dec = IncrementalDecoder(tok)
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == TEXT
    assert all("\ufffd" not in p for p in pieces)


def test_greedy_is_argmax_and_deterministic():
    logits = np.array([0.1, 3.0, 2.9, -1.0], np.float32)
    assert Sampler(SamplingParams())(logits) == 1


def test_seed_reproducible_and_filters_respected():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(100).astype(np.float32) * 3
    s1 = Sampler(SamplingParams(temperature=1.0, seed=5))
    s2 = Sampler(SamplingParams(temperature=1.0, seed=5))
    assert [s1(logits) for _ in range(20)] == [s2(logits) for _ in range(20)]
    top3 = set(np.argsort(-logits)[:3].tolist())
    s = Sampler(SamplingParams(temperature=2.0, top_k=3, seed=1))
    assert {s(logits) for _ in range(200)} <= top3
    probs = np.exp(logits - logits.max()); probs /= probs.sum()
    order = np.argsort(-probs)
    nucleus = set(order[: int(np.searchsorted(np.cumsum(probs[order]), 0.5)) + 1].tolist())
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.5, seed=2))
    assert {s(logits) for _ in range(200)} <= nucleus
    s = Sampler(SamplingParams(temperature=1.0, min_p=0.5, seed=3))
    allowed = set(np.nonzero(probs >= 0.5 * probs.max())[0].tolist())
    assert {s(logits) for _ in range(200)} <= allowed


def test_repetition_penalty_discourages_history():
    logits = np.array([5.0, 4.9, 1.0], np.float32)
    assert Sampler(SamplingParams(repetition_penalty=1.5))(logits, history=[0]) == 1


@pytest.mark.parametrize("bad", [dict(temperature=-0.5), dict(top_p=1.5), dict(min_p=-0.1)])
def test_bad_params(bad):
    with pytest.raises(SamplingError):
        SamplingParams(**bad).validate()


def test_generate_text_matches_generate_ids(model):
    ids = model.tokenizer.encode("hello")
    toks = list(model.generate_ids(ids, max_new_tokens=12))
    text = "".join(model.generate(ids, max_new_tokens=12))
    assert toks and text == model.tokenizer.decode(toks, skip_special_tokens=True)


def test_same_seed_same_output(model):
    a = "".join(model.generate("abc", max_new_tokens=10, temperature=0.9, seed=11))
    b = "".join(model.generate("abc", max_new_tokens=10, temperature=0.9, seed=11))
    assert a == b


def test_stop_string_ends_generation(model):
    full = "".join(model.generate("abc", max_new_tokens=20))
    assert len(full) >= 4
    stop = full[2:4]
    cut = "".join(model.generate("abc", max_new_tokens=20, stop=[stop]))
    assert cut == full[: full.find(stop)]


def test_eos_from_config_and_generation_config(tmp_path):
    d = make_random_checkpoint(dict(TINY, eos_token_id=[5, 7]), tmp_path / "m")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    m = cpullm.load(d, use_cache=False)
    assert {5, 7, 9} <= set(m.eos_token_ids)


def test_cli_run_streams_and_summarises(model_dir, capsys):
    assert main(["run", str(model_dir), "-p", "hello", "-n", "5", "--no-cache"]) == 0
    out = capsys.readouterr()
    assert "prompt tokens" in out.err and "decode" in out.err and "tok/s" in out.err


def test_cli_run_json(model_dir, capsys):
    assert main(["run", str(model_dir), "-p", "hello", "-n", "5", "--json", "--quant", "f32", "--no-cache"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["quant"] == "f32" and res["prompt_tokens"] == 5 and "text" in res
    assert res["generated_tokens"] <= 5 and "decode_tps" in res


def test_families_json(capsys):
    assert main(["families", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    llama = [p for p in data["plugins"] if p["plugin"] == "cpullm-plugin-llama"]
    assert llama and llama[0]["families"][0]["model_types"] == ["llama"] and llama[0]["error"] is None


def test_info(model):
    info = model.info()
    assert info["family"] == "llama" and info["quant"] == "int8" and info["vocab"] == 300
    assert info["memory"]["weights_bytes"] > 0
