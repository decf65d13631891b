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

from cpullm.plugin import ToolFormat, parse_tagged_json_call, tagged_json_call_body

TRIGGER, END = "<tool_call>", "</tool_call>"


def parse_call(text: str, tools: dict):
    return parse_tagged_json_call(text, tools, TRIGGER, END)


def call_body(tools: dict) -> str:
    return tagged_json_call_body(tools, END)


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
