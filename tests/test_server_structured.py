"""``cpullm serve``: constrained output through OpenAI's ``response_format`` and the peers'
spellings (llama.cpp, vLLM, Ollama), log-probabilities in OpenAI's answer shapes (whole and
streamed), presence/frequency penalties and logit_bias, ``n`` choices (whole and streamed); bad
constraints are 400s naming the field.
Against the tiny random chat model (byte-level tokenizer): its text is noise unless constrained."""
from __future__ import annotations

import json
import re

import httpx
import pytest

pytest.importorskip("llguidance", reason="llguidance (cpullm[structured]) is not installed")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed")
pytest.importorskip("uvicorn")

from test_server_support import shared_server  # noqa: E402

HI = [{"role": "user", "content": "Hello there"}]
CHAT, COMP = "/v1/chat/completions", "/v1/completions"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 1,
                                                                           "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def url():
    return shared_server().url


def _post(url, path, body, stream=False):
    body = {"max_tokens": 40, "temperature": 0, **body}
    if stream:
        with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as r:
            assert r.status_code == 200, r.read()
            return [json.loads(line[6:]) for line in r.iter_lines()
                    if line.startswith("data: ") and line != "data: [DONE]"]
    r = httpx.post(url + path, json=body, timeout=120)
    return r


@pytest.mark.parametrize("fields,check", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
    ({"response_format": {"type": "json_object"}}, "object"),
    ({"json_schema": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
    ({"guided_json": json.dumps(SCHEMA)}, lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
    ({"format": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
    ({"format": "json"}, "object"),
    ({"guided_regex": "[a-c]{3}-[0-9]"}, lambda t: re.fullmatch("[a-c]{3}-[0-9]", t) or 1 / 0),
    ({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green") or 1 / 0),
    ({"grammar": 'root ::= "x" [0-9] [0-9]'}, lambda t: re.fullmatch("x[0-9]{2}", t) or 1 / 0),
    ({"guided_grammar": 'start: "y" /[0-9]/'}, lambda t: re.fullmatch("y[0-9]", t) or 1 / 0),
    ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down") or 1 / 0),
])
def test_every_spelling_constrains_the_answer(url, fields, check):
    r = _post(url, CHAT, {"messages": HI, **fields})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    if check == "object":       # any JSON object: the random model's keys may run past max_tokens
        _object_or_prefix(ch["message"]["content"], ch["finish_reason"])
    else:
        check(ch["message"]["content"])
        assert ch["finish_reason"] == "stop"
    r = _post(url, COMP, {"prompt": "Say:", **fields, "temperature": 0.9, "seed": 3})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    if check == "object":
        _object_or_prefix(ch["text"], ch["finish_reason"])
    else:
        check(ch["text"])


def _object_or_prefix(text, finish):
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert finish == "length" and text.startswith("{")


def test_a_streamed_constrained_answer(url):
    chunks = _post(url, CHAT, {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA}}}, stream=True)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    jsonschema.validate(json.loads(text), SCHEMA)


def test_cannot_finish_within_max_tokens_is_length(url):
    r = _post(url, CHAT, {"messages": HI, "guided_regex": "[a-z]{50}", "max_tokens": 5})
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "length" and re.fullmatch("[a-z]{5}", ch["message"]["content"])


@pytest.mark.parametrize("fields,param,part", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
     "response_format", "json schema"),
    ({"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
    ({"grammar": 'root ::= "a" nowhere'}, "grammar", "nowhere"),
    ({"guided_choice": "red"}, "guided_choice", "list of strings"),
    ({"format": "yaml"}, "format", "format must be"),
    ({"response_format": {"type": "xml"}}, "response_format", "response_format must be"),
    ({"guided_regex": "a", "json_schema": SCHEMA}, "guided_regex", "both constrain"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"guided_regex": "(a{1000}){1000}"}, "guided_regex", "repeats too much"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"presence_penalty": 3}, "presence_penalty", "[-2.0, 2.0]"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    ({"top_logprobs": 2}, "top_logprobs", "needs logprobs"),
])
def test_bad_constraints_and_sampling_fields_are_400s(url, fields, param, part):
    r = _post(url, CHAT, {"messages": HI, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and part in err["message"], err


def test_chat_logprobs_whole_and_streamed(url):
    body = {"messages": HI, "logprobs": True, "top_logprobs": 3, "max_tokens": 6}
    r = _post(url, CHAT, body).json()
    lp = r["choices"][0]["logprobs"]["content"]
    assert len(lp) == r["usage"]["completion_tokens"] == 6
    for e in lp:
        assert e["logprob"] <= 0 and len(e["top_logprobs"]) == 3
        assert e["top_logprobs"][0]["logprob"] >= e["logprob"] - 1e-9      # greedy: the best one
        assert e["bytes"] == list(e["token"].encode())
    chunks = _post(url, CHAT, body, stream=True)
    streamed = [e for c in chunks if c["choices"] and c["choices"][0].get("logprobs")
                for e in c["choices"][0]["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in lp]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in lp])
    plain = _post(url, CHAT, {"messages": HI, "max_tokens": 6}).json()
    assert plain["choices"][0]["logprobs"] is None
    assert plain["choices"][0]["message"]["content"] == r["choices"][0]["message"]["content"]


def test_completion_logprobs_and_constrained_logprobs(url):
    r = _post(url, COMP, {"prompt": "abc", "logprobs": 2, "max_tokens": 4}).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    assert "".join(lp["tokens"]) == r["choices"][0]["text"] and lp["text_offset"][0] == 0
    # a forced answer: every token is the only one allowed, log-probability 0
    r = _post(url, CHAT, {"messages": HI, "guided_choice": ["forced"], "logprobs": True}).json()
    assert r["choices"][0]["message"]["content"] == "forced"
    assert all(e["logprob"] == pytest.approx(0.0, abs=1e-6) for e in r["choices"][0]["logprobs"]["content"])


def test_logit_bias_and_penalties_change_the_answer(url):
    from cpullm.loading.tokenize import Tokenizer
    from test_server_support import chat_model_dir
    tid = Tokenizer(chat_model_dir()).encode("x", add_special_tokens=False)[0]
    r = _post(url, COMP, {"prompt": "abc", "max_tokens": 5, "logit_bias": {str(tid): 100}}).json()
    assert r["choices"][0]["text"] == "xxxxx"
    # +20 wins every step alone; presence + frequency (2 + 2 per use) overtake it by the 10th
    biased = {"prompt": "abc", "max_tokens": 12, "logit_bias": {str(tid): 20}}
    assert _post(url, COMP, biased).json()["choices"][0]["text"] == "x" * 12
    r = _post(url, COMP, {**biased, "presence_penalty": 2.0, "frequency_penalty": 2.0}).json()
    assert r["choices"][0]["text"].startswith("xxxx") and r["choices"][0]["text"] != "x" * 12


def test_n_choices_whole_and_streamed(url):
    body = {"messages": HI, "max_tokens": 6, "temperature": 1.0, "seed": 11}
    one = _post(url, CHAT, body).json()
    r = _post(url, CHAT, {**body, "n": 3}).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    texts = [c["message"]["content"] for c in r["choices"]]
    assert texts[0] == one["choices"][0]["message"]["content"]      # choice 0 keeps the request's seed
    assert len(set(texts)) > 1                                       # the others draw their own
    assert r["usage"]["completion_tokens"] == 18 and r["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    chunks = _post(url, CHAT, {**body, "n": 2, "stream_options": {"include_usage": True}}, stream=True)
    got = {0: "", 1: ""}
    finished = set()
    for c in chunks:
        for ch in c["choices"]:
            got[ch["index"]] += ch["delta"].get("content") or ""
            if ch["finish_reason"]:
                finished.add(ch["index"])
    assert finished == {0, 1} and got[0] == texts[0]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    # constrained: every choice is constrained, each with its own copy
    r = _post(url, COMP, {"prompt": "Pick:", "n": 4, "temperature": 1.0, "seed": 2, "guided_choice": ["ab", "cd"]})
    assert all(c["text"] in ("ab", "cd") for c in r.json()["choices"])


def test_n_choices_share_the_prompt_through_the_prefix_cache(url):
    words = " ".join(f"w{i}" for i in range(90))             # a prompt of well over one 64-token block
    before = httpx.get(url + "/health").json()["prefix_cache"]["prefilled_tokens"]
    r = _post(url, COMP, {"prompt": words, "n": 3, "max_tokens": 2, "temperature": 1.0}).json()
    after = httpx.get(url + "/health").json()["prefix_cache"]["prefilled_tokens"]
    n_prompt = r["usage"]["prompt_tokens"]
    assert n_prompt > 128 and after - before < 2 * n_prompt
