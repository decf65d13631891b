"""Constrained decoding (cpullm.generate.constraints) and the per-sequence logits pipeline (cpullm.generate.sampling):
constraints on tiny tokenizers of each kind (byte-level BPE, SentencePiece-style with byte
fallback, a GGUF SentencePiece vocabulary through cpullm.loading.gguf_vocab), bad and oversized specs refused with a named error, the sampling surface (logit_bias,
presence/frequency penalties, logits processors, log-probabilities), and constrained generation
on a tiny random model: the output matches, alone and batched with free sequences alike."""
import json
import re
import sys

import numpy as np
import pytest

pytest.importorskip("llguidance", reason="llguidance (cpullm[structured]) is not installed")

import cpullm
from cpullm.generate import constraints as C
from cpullm.errors import ConstraintError, MissingDependencyError, SamplingError
from cpullm.generate.sampling import Sampler, SamplingParams, top_logprobs
from cpullm.generate.scheduler import Scheduler
from cpullm.generate.sequence import Sequence
from cpullm.testing import make_random_checkpoint
from cpullm.loading.tokenize import Tokenizer
from tiny_configs import SMOLLM2_LIKE


# ---- tiny tokenizers --------------------------------------------------------------------------------
def _byte_level():
    from tokenizers import Tokenizer as HF, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    for w in ('{"', '":', 'name', 'age', '"}', 'yes', 'no', '<eos>'):   # multi-byte tokens too (ASCII
        vocab[w] = len(vocab)                                               # maps to itself)
    tok = HF(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    return Tokenizer.from_objects(tok, {"eos_token": "<eos>"})


def _sentencepiece_like():
    from tokenizers import Tokenizer as HF, decoders, models, pre_tokenizers
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for w in ("▁yes", "▁no", "▁", "a", "b", "1", "2", "{", "}", '"', ":"):
        vocab[w] = len(vocab)
    tok = HF(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return Tokenizer.from_objects(tok, {"eos_token": "</s>"})


def _gguf_vocabulary():
    """A SentencePiece vocabulary as a GGUF's metadata holds it, through cpullm.loading.gguf_vocab."""
    from cpullm.loading.gguf_vocab import build_tokenizer
    toks = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + \
        ["▁yes", "▁no", "▁", "y", "e", "s", "n", "o", "{", "}", '"', ":", "1", "2"]
    meta = {"general.architecture": "llama", "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": toks,
            "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * (len(toks) - 259),
            "tokenizer.ggml.scores": [0.0] * len(toks), "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0}
    tok, config, _ = build_tokenizer(meta)
    return Tokenizer.from_objects(tok, config)


TOKENIZERS = {"byte_level": _byte_level, "sentencepiece": _sentencepiece_like, "gguf": _gguf_vocabulary}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def tok(request):
    return TOKENIZERS[request.param]()


def _char_ids(tokenizer, text):
    """One token per character (its byte-level, SentencePiece or byte-fallback spelling)."""
    ids = []
    for ch in text:
        names = ["Ġ", "▁", "<0x20>"] if ch == " " else [ch, f"<0x{ord(ch):02X}>"]
        ids.append(next(i for i in map(tokenizer.token_to_id, names) if i is not None))
    return ids


def _walk(cons, tokenizer, seed=0, limit=200):
    """Random allowed tokens until the constraint is finished or accepts and EOS is drawn."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(limit):
        ok = np.nonzero(cons.allowed())[0]
        assert ok.size, "the mask allows nothing"
        t = int(rng.choice(ok))
        if t == tokenizer.eos_token_id:
            assert cons.accepting
            break
        assert cons.consume(t)
        out.append(t)
        if cons.finished:
            break
    return tokenizer.decode(out)


@pytest.mark.parametrize("seed", range(3))
def test_regex_choice_json_and_grammars_hold_on_each_tokenizer(tok, seed):
    c = C.build_constraint({"regex": r"[ab]{2,5}-[0-9]{1,3}"}, tok)
    ok = c.allowed()
    assert [c.allows(t) for t in range(ok.size + 40)] == list(ok) + [False] * 40
    text = _walk(c, tok, seed)
    assert re.fullmatch(r"[ab]{2,5}-[0-9]{1,3}", text), text
    assert _walk(C.build_constraint({"choice": ["yes", "no", "maybe so"]}, tok), tok, seed) in \
        ("yes", "no", "maybe so")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "age"], "additionalProperties": False}
    got = json.loads(_walk(C.build_constraint({"json_schema": schema}, tok), tok, seed, limit=400))
    assert set(got) == {"name", "age"} and 0 <= got["age"] <= 99 and len(got["name"]) <= 5
    obj = C.build_constraint({"json_object": True}, tok)
    assert not obj.allowed()[_char_ids(tok, "[")[0]]
    for t in _char_ids(tok, '{"a": [1, "b"]}'):
        assert obj.allowed()[t] and obj.consume(t)
    assert obj.accepting and obj.allowed()[tok.eos_token_id]
    gbnf = 'root ::= "x" digit digit\ndigit ::= [0-9]'
    assert re.fullmatch(r"x[0-9]{2}", _walk(C.build_constraint({"gbnf": gbnf}, tok), tok, seed))
    lark = 'start: "p" NUM\nNUM: /[1-3]+/'
    assert re.fullmatch(r"p[1-3]+", _walk(C.build_constraint({"lark": lark}, tok), tok, seed))


@pytest.mark.parametrize("spec,words", [
    ({"json_schema": {"type": "wat"}}, "json schema"),
    ({"json_schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}, "nope"),
    ({"json_schema": [1]}, "JSON object"),
    ({"regex": "a(b"}, "unclosed group"),
    ({"regex": ""}, "empty"),
    ({"lark": "start: foo"}, "unknown name"),
    ({"gbnf": 'root ::= "a" undefined_rule'}, "undefined_rule"),
    ({"choice": []}, "non-empty list"),
    ({"choice": ["a", 3]}, "choice[1]"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"sql": "x"}, "exactly one"),
    ({"regex": "a" * 20000}, "bytes"),
    ({"choice": [str(i) for i in range(5000)]}, "allowed"),
    ({"json_schema": {"enum": list(range(5000))}}, "enum"),
])
def test_bad_specs_are_refused_with_a_named_error(tok, spec, words):
    with pytest.raises(ConstraintError) as e:
        C.build_constraint(spec, tok)
    assert words.lower() in str(e.value).lower(), str(e.value)
    assert "\n" not in str(e.value)


def test_deep_schema_and_pathological_regex_are_bounded(tok):
    deep = {"type": "string"}
    for _ in range(200):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ConstraintError, match="deeper"):
        C.build_constraint({"json_schema": deep}, tok)
    # nested counts that write out to a million characters: refused before llguidance parses them
    with pytest.raises(ConstraintError, match="repeats too much"):
        C.build_constraint({"regex": "(a{1000}){1000}"}, tok)
    assert C.regex_expansion(r"\d{4}-\d{2}-[0-9]{2}") == 10
    assert C.regex_expansion("(ab|c){3}x") == 10
    # a regex whose DFA would explode is fine: llguidance's lexer is lazy
    assert re.fullmatch("(a|b)*a(a|b){40}", _walk(C.build_constraint({"regex": "(a|b)*a(a|b){40}"}, tok), tok))


def test_missing_llguidance_names_the_extra(monkeypatch, tok):
    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(MissingDependencyError, match=r"cpullm\[structured\]"):
        C.build_constraint({"regex": "a"}, tok)


# ---- the sampling surface ----------------------------------------------------------------------------
def test_logit_bias_penalties_and_processors_in_order():
    x = np.array([1.0, 2.0, 3.0, 0.5])
    s = Sampler(SamplingParams(logit_bias={"0": 100}).check_surface(4))
    assert s(x) == 0
    s = Sampler(SamplingParams(presence_penalty=1.0, frequency_penalty=0.6))
    s.note(2)
    s.note(2)
    got = s.process(x, history=[2, 2])
    assert got[2] == pytest.approx(3.0 - 1.0 - 1.2) and got[1] == 2.0
    seen = []

    def ban_one(ids, logits):
        seen.append(list(ids))
        logits[1] = -np.inf
        return logits
    s = Sampler(SamplingParams(logit_bias={2: -100}), [ban_one])
    assert s(x, history=[7, 8]) == 0 and seen == [[7, 8]]
    with pytest.raises(SamplingError, match="presence_penalty"):
        SamplingParams(presence_penalty=3).check_surface()
    with pytest.raises(SamplingError, match="not in"):
        SamplingParams(logit_bias={"9": 1}).check_surface(4)
    with pytest.raises(SamplingError, match="logprobs"):
        SamplingParams(logprobs=21).check_surface()


def test_logprobs_come_from_the_processed_logits():
    x = np.log(np.array([0.5, 0.25, 0.125, 0.125]))
    lp, top = top_logprobs(x, 1, 2)
    assert lp == pytest.approx(np.log(0.25)) and [t for t, _ in top] == [0, 1]
    masked = x.copy()
    masked[0] = -np.inf                      # a mask renormalizes over what is allowed
    lp, top = top_logprobs(masked, 1, 5)
    assert lp == pytest.approx(np.log(0.5)) and len(top) == 3


# ---- on a tiny random model -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = make_random_checkpoint(dict(SMOLLM2_LIKE, model_type="llama"), tmp_path_factory.mktemp("cons"), seed=3)
    return cpullm.load(d, quant="int8", threads=2, n_ctx=128, max_chunk=16)


REGEX = r"(ab|ba){1,3}-[0-9]{2}"   # at most 9 bytes: ends before max_tokens


def test_constrained_generation_matches_alone_and_batched(tiny):
    prompts = [[5, 9, 33, 17], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [40]]
    alone = [list(tiny.generate_ids(p, 24, regex=REGEX)) for p in prompts]
    for toks in alone:
        assert re.fullmatch(REGEX, tiny.tokenizer.decode(toks)), tiny.tokenizer.decode(toks)
    free_alone = list(tiny.generate_ids(prompts[0], 12))
    # constrained and free sequences share the decode batch: each keeps its alone tokens
    sch = Scheduler(tiny.forward, slots=4, prefill_chunk=16)
    seqs = [sch.add(Sequence(p, 24, SamplingParams(), stop_ids=tiny.eos_token_ids,
                             constraint=tiny.constraint({"regex": REGEX}))) for p in prompts]
    free = sch.add(Sequence(prompts[0], 12, SamplingParams(), stop_ids=tiny.eos_token_ids))
    sch.run_until_idle()
    assert [s.generated for s in seqs] == alone
    assert free.generated == free_alone
    assert all(s.stats.stop_reason == "stop" for s in seqs)
    texts = tiny.generate_batch(["ab", "cd"], 24, choice=["alpha", "beta"], temperature=0.8, seed=1)
    assert all(t in ("alpha", "beta") for t in texts)


def test_a_constraint_that_cannot_finish_ends_with_length(tiny):
    stats = cpullm.generate.generate.GenerationStats()
    text = "".join(tiny.generate([5, 6], 4, regex="[a-z]{10}", stats=stats))
    assert stats.stop_reason == "length" and re.fullmatch("[a-z]{4}", text)


def test_stream_events_carry_logprobs(tiny):
    events = list(tiny.generate_stream([3, 4, 5], 6, logprobs=3, choice=["abcdef"]))
    assert "".join(e.text for e in events) == "abcdef"
    for e in events:
        assert e.logprob == pytest.approx(0.0, abs=1e-6)         # forced: the only allowed token
        assert len(e.top_logprobs) == 1
    free = list(tiny.generate_stream([3, 4, 5], 5, logprobs=2, temperature=0.7, seed=4, presence_penalty=1.5))
    assert all(e.logprob <= 0 and len(e.top_logprobs) == 2 for e in free)
    assert all(e.top_logprobs[0][1] >= e.logprob for e in free)


# ---- cpullm run's flags ------------------------------------------------------------------------------------
def test_run_flags_read_and_check_their_files(tmp_path):
    import argparse

    from cpullm.cli.commands.run import add_constraint_options, constraint_spec
    p = argparse.ArgumentParser()
    add_constraint_options(p)
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object"}')
    assert constraint_spec(p.parse_args(["--json-schema", str(schema)])) == {"json_schema": {"type": "object"}}
    gbnf = tmp_path / "g.gbnf"
    gbnf.write_text('root ::= "a"')
    assert constraint_spec(p.parse_args(["--grammar", str(gbnf)])) == {"grammar": 'root ::= "a"'}
    assert constraint_spec(p.parse_args(["--choice", "red,green"])) == {"choice": ["red", "green"]}
    assert constraint_spec(p.parse_args(["--regex", "[0-9]+"])) == {"regex": "[0-9]+"}
    assert constraint_spec(p.parse_args([])) is None
    schema.write_text("{not json")
    with pytest.raises(ConstraintError, match="not valid JSON"):
        constraint_spec(p.parse_args(["--json-schema", str(schema)]))
    with pytest.raises(ConstraintError, match="missing.json"):
        constraint_spec(p.parse_args(["--json-schema", str(tmp_path / "missing.json")]))
    with pytest.raises(SystemExit):         # one constraint at a time
        p.parse_args(["--regex", "a", "--choice", "a"])
