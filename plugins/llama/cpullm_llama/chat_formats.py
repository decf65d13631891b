"""How Llama 3.x checkpoints write a tool call (FamilySpec ``tool_formats``): the Llama 3.1-3.3
templates ask for a bare JSON object that opens the answer,
``{"name": "get_weather", "parameters": {"city": "Paris"}}``, and write earlier calls back the
same way. Templates without tools (SmolLM2's ChatML) get no format: a call there is read only
from a fenced JSON block (the core's fallback).
"""
from __future__ import annotations

import json

from cpullm.plugin import WS, MalformedCall, ToolFormat, json_rule, lark_string, object_schema, parse_json_call



def parse_call(text: str, tools: dict):
    """The first JSON object of ``text`` (which starts with "{") as a call, once it is complete."""
    try:
        value, end = json.JSONDecoder().raw_decode(text)
    except ValueError:
        depth, in_str, esc = 0, False, False        # incomplete, or not JSON at all?
        for ch in text:
            if in_str:
                esc, in_str = (False, in_str) if esc else (ch == "\\", ch != '"')
            elif ch == '"':
                in_str = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    raise MalformedCall("the answer's JSON object does not parse") from None
        return None, 0
    return parse_json_call(json.dumps(value), tools), end


def call_body(tools: dict) -> str:
    """After the opening "{": ``"name": "<tool>", "parameters": {...}}`` for a declared tool."""
    names = [f"fn_{i}" for i in range(len(tools))]
    rules = [f"call_body: {' | '.join(names)}"]
    for rule, (name, params) in zip(names, tools.items()):
        parts = [WS, lark_string('"name"'), WS, '":"', WS, lark_string(json.dumps(name)), WS, '","', WS,
                 lark_string('"parameters"'), WS, '":"', WS, json_rule(object_schema(params)), WS, '"}"']
        rules.append(f"{rule}: {' '.join(parts)}")
    return "\n".join(rules)


def _json_call_template(template: str) -> bool:
    return '"parameters"' in template and "tool_call" in template


LLAMA3_JSON = ToolFormat(
    name="llama.json_call", trigger="{", parse_call=parse_call, call_body=call_body,
    detect=_json_call_template, at_start=True,
    description='Llama 3.x: {"name": ..., "parameters": {...}} opening the answer')
