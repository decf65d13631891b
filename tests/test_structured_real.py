"""Constrained decoding on a real model (Qwen2.5-Coder-0.5B-Instruct, INT8, its 152k byte-level BPE
vocabulary): 20 different JSON schemas answered and checked with the ``jsonschema`` package, a
regex, a GBNF grammar and a choice; constrained greedy tokens identical alone and batched with
free sequences; bad schemas refused with a named error."""
from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("llguidance", reason="llguidance (cpullm[structured]) is not installed")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed")

import cpullm  # noqa: E402
from cpullm.errors import ConstraintError  # noqa: E402
from realmodels import real_model_dir  # noqa: E402

pytestmark = pytest.mark.slow

S = {"type": "string", "maxLength": 24}
I = {"type": "integer", "minimum": 0, "maximum": 1000}


def obj(props, required=None):
    return {"type": "object", "properties": props, "required": list(required or props),
            "additionalProperties": False}


SCHEMAS = [
    ("a person", obj({"name": S, "age": I})),
    ("a city", obj({"city": S, "country": S, "population": I})),
    ("a yes/no answer to: is water wet?", obj({"answer": {"type": "boolean"}})),
    ("a color", obj({"color": {"enum": ["red", "green", "blue"]}})),
    ("three fruits", obj({"fruits": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}})),
    ("a point", obj({"x": {"type": "number"}, "y": {"type": "number"}})),
    ("a book", obj({"title": S, "year": {"type": "integer", "minimum": 1400, "maximum": 2030}})),
    ("a todo item", obj({"task": S, "done": {"type": "boolean"}, "priority": {"enum": ["low", "high"]}})),
    ("a user with an address", obj({"user": S, "address": obj({"street": S, "zip": {"type": "string",
                                                                                      "pattern": "^[0-9]{5}$"}})})),
    ("a date", obj({"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}})),
    ("a temperature", obj({"celsius": {"type": "number", "minimum": -50, "maximum": 60}})),
    ("a list of two numbers", {"type": "array", "items": I, "minItems": 2, "maxItems": 2}),
    ("a sentiment", obj({"label": {"enum": ["positive", "negative", "neutral"]},
                         "score": {"type": "number", "minimum": 0, "maximum": 1}})),
    ("a product", obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}, "price": {"type": "number"}})),
    ("an optional nickname", obj({"name": S, "nickname": S}, required=["name"])),
    ("a version", obj({"major": I, "minor": I, "patch": I})),
    ("a language", {"anyOf": [obj({"lang": {"const": "python"}}), obj({"lang": {"const": "rust"}})]}),
    ("tags", obj({"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}})),
    ("a nullable note", obj({"note": {"type": ["string", "null"], "maxLength": 20}})),
    ("a matrix", obj({"rows": {"type": "array", "maxItems": 2,
                               "items": {"type": "array", "items": I, "minItems": 1, "maxItems": 2}}})),
]


@pytest.fixture(scope="module")
def qwen():
    return cpullm.load(real_model_dir("qwen2.5-coder-0.5b-instruct"), quant="int8", threads=2, n_ctx=512)


def _prompt(what):
    return f"Reply with JSON only: {what}."


def test_twenty_schemas_validate(qwen):
    assert len({json.dumps(s, sort_keys=True) for _, s in SCHEMAS}) == 20
    texts = qwen.generate_batch([_prompt(w) for w, _ in SCHEMAS], 96, chat=True, parallel=8,
                                sampling=[{"json_schema": s} for _, s in SCHEMAS])
    for (what, schema), text in zip(SCHEMAS, texts):
        jsonschema.validate(json.loads(text), schema)


def test_regex_grammar_and_choice(qwen):
    t = "".join(qwen.generate("What is today's date?", 20, chat=True, regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}"))
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", t)
    t = "".join(qwen.generate("Is the sky blue?", 8, chat=True, grammar='root ::= ("yes" | "no") "."'))
    assert t in ("yes.", "no.")
    t = "".join(qwen.generate("Pick a primary color.", 8, chat=True, choice=["red", "yellow", "blue"],
                              temperature=0.7, seed=1))
    assert t in ("red", "yellow", "blue")


def test_constrained_greedy_tokens_are_batch_invariant(qwen):
    picked = SCHEMAS[:3]
    alone = [list(qwen.generate_ids(qwen._prompt_ids(_prompt(w), chat=True), 64, json_schema=s)) for w, s in picked]
    free = qwen._prompt_ids("Write a haiku about the sea.", chat=True)
    free_alone = list(qwen.generate_ids(free, 16))
    got = qwen.generate_batch([qwen._prompt_ids(_prompt(w), chat=True) for w, _ in picked] + [free], 64,
                              parallel=4, sampling=[{"json_schema": s} for _, s in picked] + [{}])
    assert got[:3] == alone
    assert got[3][:16] == free_alone


def test_bad_schemas_are_refused_on_the_real_vocabulary(qwen):
    with pytest.raises(ConstraintError, match="json schema"):
        qwen.constraint({"json_schema": {"type": "object", "properties": {"a": {"type": "bogus"}}}})
    with pytest.raises(ConstraintError, match="enum"):
        qwen.constraint({"json_schema": {"enum": [str(i) for i in range(10000)]}})
