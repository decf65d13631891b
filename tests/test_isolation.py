"""Reliability, round three: a request's own failure never harms the requests beside it, and
vocabularies that would make the tokenizer rebuild explode are refused before allocating.

Each test reproduces an attack from issue 41: a prompt using a token whose embedding row holds
NaN, sampled at a temperature (non-finite logits); a prompt with an id beyond the embedding; a
SentencePiece GGUF vocabulary without merges whose tokens are 'a' * k.
"""
from __future__ import annotations

import json
import struct
import threading
import tracemalloc

import numpy as np
import pytest

import cpullm
from cpullm.loading import gguf_vocab as gv
from cpullm.errors import ConversionError, PromptError, SamplingError
from cpullm.generate.sampling import Sampler, SamplingParams
from cpullm.testing import make_random_checkpoint
from tiny_configs import SMOLLM2_LIKE

NAN_TOKEN = 7


def _poison_embedding_row(model_dir, row: int) -> None:
    """Write NaN (bf16 0x7FC0) over one row of the checkpoint's embedding table, in place."""
    path = model_dir / "model.safetensors"
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8: 8 + n])
    name = next(k for k in header if "embed_tokens" in k)
    rows, width = header[name]["shape"]
    start = 8 + n + header[name]["data_offsets"][0] + row * width * 2
    with open(path, "r+b") as fh:
        fh.seek(start)
        fh.write(struct.pack("<H", 0x7FC0) * width)


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory):
    # untied: the NaN row is reached only by prompts holding the token (a tied lm_head would put
    # a NaN logit in every sequence, each of which then fails on its own)
    d = make_random_checkpoint(dict(SMOLLM2_LIKE, model_type="llama", tie_word_embeddings=False),
                               tmp_path_factory.mktemp("nan"), seed=5)
    _poison_embedding_row(d, NAN_TOKEN)
    return cpullm.load(d, quant="f32", threads=2, n_ctx=256, max_chunk=16)


VICTIM = [40, 41, 42, 43, 44, 45]


def test_a_sequence_with_nan_logits_fails_alone(poisoned):
    m = poisoned
    alone = list(m.generate_ids(VICTIM, 60, ignore_eos=True))
    with m.engine(parallel=2, prefix_cache_bytes=0) as eng:
        victim = eng.submit(VICTIM, 60, stop_ids=())
        attacker = eng.submit([50, NAN_TOKEN, 51], 20, temperature=0.8, seed=1, stop_ids=())
        with pytest.raises(SamplingError, match="non-finite"):
            attacker.result()
        assert attacker.seq.stats.stop_reason == "failed"
        assert victim.result() == list(alone)             # every token, the same as alone
        assert victim.error is None and victim.seq.stats.stop_reason == "length"
        again = eng.submit(VICTIM, 8, stop_ids=())        # the engine keeps serving
        assert again.result() == list(alone[:8])


def test_prompt_ids_beyond_the_embedding_are_refused_at_submit(poisoned):
    rows = poisoned.program.meta.get("embed_rows") or poisoned.program.meta["vocab"]
    with poisoned.engine(parallel=2, prefix_cache_bytes=0) as eng:
        victim = eng.submit(VICTIM, 20, stop_ids=())
        for bad in ([1, rows], [-1, 2]):
            with pytest.raises(PromptError, match=f"embedding has {rows} rows"):
                eng.submit(bad, 4)
        assert len(victim.result()) == 20 and victim.error is None
    with pytest.raises(PromptError, match="embedding"):
        poisoned.generate_batch([[1, 2], [3, rows + 4]], 4)


def test_sampler_refuses_non_finite_logits_in_one_line():
    s = Sampler(SamplingParams(temperature=0.8, seed=0))
    for bad in (np.array([0.0, np.nan, 1.0]), np.array([0.0, np.inf]), np.full(3, -np.inf)):
        with pytest.raises(SamplingError) as e:
            s(bad)
        assert "\n" not in str(e.value)
    assert s(np.array([0.0, -np.inf, 1.0])) in (0, 2)    # a masked token is fine


@pytest.mark.parametrize("t", [5e-324, 1e-4, float("inf"), float("nan"), -1.0])
def test_temperatures_that_overflow_the_sampler_are_refused(t):
    with pytest.raises(SamplingError, match="temperature"):
        SamplingParams(temperature=t).validate()
    SamplingParams(temperature=1e-3).validate()
    SamplingParams(temperature=0.0).validate()


# ---------------------------------------------------------------------------------------------
# SentencePiece GGUF without merges: rebuilding them is bounded before allocating
# ---------------------------------------------------------------------------------------------

def test_merges_rebuild_of_a_cubic_vocabulary_is_refused_before_allocating():
    tokens = ["<unk>", "<bos>", "<eos>"] + ["a" * k for k in range(1, 2046)]
    meta = {"general.architecture": "gemma3", "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [3, 3, 3] + [1] * 2045,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0}
    tracemalloc.start()
    try:
        with pytest.raises(ConversionError, match="no merges") as e:
            gv.build_tokenizer(meta)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "\n" not in str(e.value)
    assert peak < 64 << 20, peak            # the 3.5 GB of candidates are never built


def test_merges_rebuild_of_an_ordinary_vocabulary_still_works():
    vocab = {"a": 0, "b": 1, "ab": 2, "abb": 3, "bb": 4}
    assert gv.merges_from_vocab(vocab, {t: -i for t, i in vocab.items()})[0] == ("a", "b")


# ---------------------------------------------------------------------------------------------
# The same attacks through `cpullm serve`: the attacker gets a 4xx (or an error event), the
# victim streaming beside it gets every token
# ---------------------------------------------------------------------------------------------

EMBED_ROWS = 200        # fewer rows than the byte-level tokenizer's 256+ ids: text can reach past them


@pytest.fixture(scope="module")
def hostile_server(tmp_path_factory):
    pytest.importorskip("uvicorn")
    from test_server_support import ServerProcess

    cfg = dict(SMOLLM2_LIKE, model_type="llama", tie_word_embeddings=False, vocab_size=EMBED_ROWS,
               bos_token_id=1, eos_token_id=10**6, max_position_embeddings=1024)
    d = make_random_checkpoint(cfg, tmp_path_factory.mktemp("hostile-serve"), seed=5)
    _poison_embedding_row(d, NAN_TOKEN)
    s = ServerProcess(d, "--parallel", 2, "--model-name", "m", "--prefix-cache", 0, "--quant", "f32")
    yield s
    s.stop()


def _post(url, body, **kw):
    import httpx
    return httpx.post(url + "/v1/completions", json=body, timeout=120, **kw)


def _stream_events(url, body) -> list:
    import httpx
    events = []
    with httpx.stream("POST", url + "/v1/completions", json=dict(body, stream=True), timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return events


def test_served_attacks_fail_only_the_attacker(hostile_server):
    url = hostile_server.url
    victim_body = {"model": "m", "prompt": VICTIM, "max_tokens": 300, "temperature": 0}
    alone = _post(url, victim_body).json()["choices"][0]["text"]
    got = {}
    victim = threading.Thread(target=lambda: got.setdefault("events", _stream_events(url, victim_body)))
    victim.start()
    try:
        r = _post(url, {"model": "m", "prompt": [50, NAN_TOKEN, 51], "max_tokens": 20, "temperature": 0.8})
        assert r.status_code == 400 and "non-finite" in r.json()["error"]["message"], r.text
        streamed = _stream_events(url, {"model": "m", "prompt": [NAN_TOKEN], "max_tokens": 20, "temperature": 0.8})
        assert "non-finite" in streamed[-2]["error"]["message"] and streamed[-1] == "[DONE]"
        r = _post(url, {"model": "m", "prompt": "   ", "max_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert f"embedding has {EMBED_ROWS} rows" in r.json()["error"]["message"]
    finally:
        victim.join(timeout=300)
    events = got["events"]
    assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1])
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == alone
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    h = hostile_server.health()
    assert h["failed"] == 2 and "Traceback" not in hostile_server.output()     # the 400 never ran


# ---------------------------------------------------------------------------------------------
# The CLI: sampling values refused on one line; `run` keeps model text from driving the terminal
# ---------------------------------------------------------------------------------------------

CONTROL = __import__("re").compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


@pytest.mark.parametrize("t", ["5e-324", "1e-5", "inf"])
def test_run_refuses_a_temperature_that_overflows_on_one_line(t, tmp_path, capsys):
    from cpullm.cli import main
    assert main(["run", str(tmp_path), "-p", "hi", "--temperature", t]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cpullm: error: temperature must be"), err


def test_run_filters_control_characters_from_model_text(tmp_path, capfd):
    from cpullm.cli import main
    d = make_random_checkpoint(dict(SMOLLM2_LIKE, model_type="llama", eos_token_id=10**6),
                               tmp_path / "m", seed=11)
    raw = cpullm.load(d, quant="f32").generate("hello", 200, temperature=1.0, seed=4)
    assert CONTROL.search("".join(raw))                 # the model does write control characters
    assert main(["run", str(d), "-p", "hello", "-n", "200", "--temperature", "1", "--seed", "4",
                 "--quant", "f32"]) == 0
    out = capfd.readouterr().out
    assert out.strip() and not CONTROL.search(out)


def test_chat_session_survives_non_finite_logits(tmp_path):
    """A chat turn whose text reaches the NaN row fails with one line; the session goes on."""
    import subprocess
    import sys

    from test_server_support import CHATML, cli_env

    d = make_random_checkpoint(dict(SMOLLM2_LIKE, model_type="llama", tie_word_embeddings=False,
                                    eos_token_id=10**6), tmp_path / "m", seed=5)
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    _poison_embedding_row(d, NAN_TOKEN)
    tok = cpullm.load(d, quant="f32").tokenizer
    assert NAN_TOKEN in tok.encode("a ( b") and NAN_TOKEN not in tok.encode("hello there")
    proc = subprocess.run([sys.executable, "-m", "cpullm.cli", "chat", str(d), "--quant", "f32", "-n", "4",
                           "--temperature", "0.8", "--no-stats"], input="a ( b\nhello there\n/exit\n",
                          capture_output=True, text=True, env={**cli_env(), "CPULLM_CACHE_DIR": str(tmp_path / "c")},
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    errors = [x for x in proc.stderr.splitlines() if "error:" in x]
    assert len(errors) == 1 and "non-finite logits" in errors[0], proc.stderr[-2000:]
    # piped stdin: no ">>>" prompts; the turn after the error was still answered
    assert proc.stdout.strip(), proc.stdout
