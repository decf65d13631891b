"""How Gemma checkpoints are given tools and write a tool call (FamilySpec ``tool_formats``).

Gemma's chat templates have no tool format (they ignore ``tools`` and accept only alternating
user and model turns), so this plugin chooses one, documented in the plugin's README: the tools
are described in the system text (which Gemma's template puts before the first user turn), a call
is one JSON object in ``<tool_call>`` tags, ``<tool_call>{"name": "get_weather", "arguments":
{"city": "Paris"}}</tool_call>``, earlier calls are written back as that text and a tool's
result comes back as a user turn, ``<tool_response name="get_weather">...</tool_response>``.
"""
from __future__ import annotations

import json

from cpullm.plugin import WS, MalformedCall, ToolFormat, json_rule, lark_string, object_schema, parse_json_call

TRIGGER, END = "<tool_call>", "</tool_call>"


def parse_call(text: str, tools: dict):
    close = text.find(END, len(TRIGGER))
    if close < 0:
        head = text[len(TRIGGER):].lstrip()
        if head and not head.startswith("{"):
            raise MalformedCall("a <tool_call> that does not hold a JSON object")
        return None, 0
    return parse_json_call(text[len(TRIGGER):close].strip(), tools), close + len(END)


def call_body(tools: dict) -> str:
    names = [f"fn_{i}" for i in range(len(tools))]
    rules = [f"call_body: {WS} ({' | '.join(names)}) {WS} {lark_string(END)}"]
    for rule, (name, params) in zip(names, tools.items()):
        schema = {"type": "object",
                  "properties": {"name": {"const": name}, "arguments": object_schema(params)},
                  "required": ["name", "arguments"], "additionalProperties": False}
        rules.append(f"{rule}: {json_rule(schema)}")
    return "\n".join(rules)


def describe_tools(tools: list) -> str:
    listed = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    return ("You can call these tools (JSON descriptions, one per line):\n" + listed +
            "\n\nTo call a tool, answer with only this, once per call:\n"
            '<tool_call>{"name": "<tool name>", "arguments": {<arguments as JSON>}}</tool_call>\n'
            "The results come back in <tool_response> tags; then answer the user.")


def write_call(call) -> str:
    return f"{TRIGGER}{json.dumps({'name': call.name, 'arguments': call.arguments}, ensure_ascii=False)}{END}"


def write_result(content: str, name: str | None) -> str:
    label = f' name="{name}"' if name else ""
    return f"<tool_response{label}>{content}</tool_response>"


TOOL_CALL_JSON = ToolFormat(
    name="gemma.tool_call_json", trigger=TRIGGER, parse_call=parse_call, call_body=call_body,
    in_template=False, describe_tools=describe_tools, write_call=write_call, write_result=write_result,
    description='chosen by cpullm (Gemma has none): <tool_call>{"name": ..., "arguments": {...}}</tool_call>')
