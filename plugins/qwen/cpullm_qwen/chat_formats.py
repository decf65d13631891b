"""How Qwen checkpoints write tool calls and thinking (FamilySpec ``tool_formats`` /
``reasoning_formats``), as their chat templates show the model:

* Qwen2.5 and Qwen3 (``HERMES``): one JSON object per call inside tags,
  ``<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>``,
  several calls one after another.
* Qwen3.5 (``XML``): function and parameter tags, a string value written as it is, any other
  value as JSON::

      <tool_call>
      <function=get_weather>
      <parameter=city>
      Paris
      </parameter>
      </function>
      </tool_call>

* Thinking (``THINK``, Qwen3 and Qwen3.5 templates): ``<think>...</think>`` before the answer;
  the templates' ``enable_thinking`` variable turns it off (Qwen3 writes an empty block into the
  prompt, Qwen3.5 opens the block in the prompt when it is on).
"""
from __future__ import annotations

import json
import re

from cpullm.plugin import (WS, MalformedCall, ReasoningFormat, ToolCall, ToolFormat, json_rule,
                            lark_string, parse_tagged_json_call, tagged_json_call_body)

TRIGGER = "<tool_call>"
END = "</tool_call>"


def _tagged(text: str):
    """(inner text, end index) of ``<tool_call>...</tool_call>`` at the start of ``text``;
    None while the end tag has not come."""
    close = text.find(END, len(TRIGGER))
    if close < 0:
        return None
    return text[len(TRIGGER):close], close + len(END)


# ---- Qwen2.5 / Qwen3: JSON in <tool_call> tags ------------------------------------------------
def parse_hermes(text: str, tools: dict):
    return parse_tagged_json_call(text, tools, TRIGGER, END)


def hermes_body(tools: dict) -> str:
    return tagged_json_call_body(tools, END)


def _hermes_template(template: str) -> bool:
    return TRIGGER in template and "<function=" not in template


HERMES = ToolFormat(
    name="qwen.hermes_json", trigger=TRIGGER, parse_call=parse_hermes, call_body=hermes_body,
    detect=_hermes_template,
    description='Qwen2.5 / Qwen3: <tool_call>{"name": ..., "arguments": {...}}</tool_call>')


# ---- Qwen3.5: function / parameter tags ---------------------------------------------------------
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*\Z", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def _is_string(schema) -> bool:
    t = schema.get("type") if isinstance(schema, dict) else None
    return t == "string" or (isinstance(t, list) and t == ["string"])


def parse_xml(text: str, tools: dict):
    found = _tagged(text)
    if found is None:
        head = text[len(TRIGGER):].lstrip()
        if head and not ("<function=".startswith(head[:10]) or head.startswith("<function=")):
            raise MalformedCall("a <tool_call> that does not hold a <function=...> block")
        return None, 0
    inner, end = found
    m = _FUNCTION.match(inner)
    if m is None:
        raise MalformedCall("a <tool_call> that is not one <function=NAME>...</function> block")
    name = m.group(1).strip()
    if name not in tools:
        raise MalformedCall(f"the call names {name!r}, which is not a declared tool")
    props = (tools[name] or {}).get("properties") or {}
    args = {}
    for pname, raw in _PARAMETER.findall(m.group(2)):
        pname = pname.strip()
        if _is_string(props.get(pname)):
            args[pname] = raw
            continue
        try:
            args[pname] = json.loads(raw)
        except ValueError:
            args[pname] = raw                    # a value the schema does not type: its text
    return ToolCall(name, args), end


def xml_body(tools: dict) -> str:
    names = [f"fn_{i}" for i in range(len(tools))]
    rules = [f"call_body: {WS} ({' | '.join(names)}) {WS} {lark_string(END)}"]
    for i, (rule, (name, params)) in enumerate(zip(names, tools.items())):
        props = (params or {}).get("properties") or {}
        required = set((params or {}).get("required") or ())
        items = []
        for j, (pname, pschema) in enumerate(props.items()):
            prule = f"p_{i}_{j}"
            head = lark_string(f"<parameter={pname}>\n")
            tail = lark_string("\n</parameter>\n")
            if _is_string(pschema):
                rules.append(f"{prule}: {head} v_{i}_{j}")
                rules.append(f"v_{i}_{j}[lazy]: /(.|\\n)*/ {tail}")
            else:
                rules.append(f"{prule}: {head} {json_rule(pschema if isinstance(pschema, dict) else {})} {tail}")
            items.append(prule if pname in required else f"{prule}?")
        opening = lark_string(f"<function={name}>\n")
        rules.append(f"{rule}: {opening} {' '.join(items)} {lark_string('</function>')}")
    return "\n".join(rules)


XML = ToolFormat(
    name="qwen.function_tags", trigger=TRIGGER, parse_call=parse_xml, call_body=xml_body,
    detect=lambda template: "<function=" in template and "<parameter=" in template,
    description="Qwen3.5: <tool_call><function=NAME><parameter=ARG>value</parameter></function></tool_call>")


# ---- thinking -------------------------------------------------------------------------------------
THINK = ReasoningFormat(
    name="qwen.think", start="<think>", end="</think>",
    detect=lambda template: "<think>" in template,
    switch="enable_thinking",
    efforts={"none": {"enable_thinking": False}, "medium": {"enable_thinking": True}})
