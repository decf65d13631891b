"""Tool calls and reasoning in a model's answer: what a plugin declares, and the generic parsing.

How a checkpoint writes a tool call, and whether it thinks before it answers, is the knowledge
of its family's plugin: :class:`cpullm.loading.family.FamilySpec` lists candidate :class:`ToolFormat`
and :class:`ReasoningFormat` objects, and the first whose ``detect(chat_template)`` accepts the
model's template applies (checkpoints of one family differ: SmolLM2's plain ChatML has no tool
calls, a Llama 3.2 template asks for JSON calls). This module holds what is generic:

* :class:`AnswerParser` turns the answer's text, piece by piece, into events: ``content``,
  ``reasoning`` (the text between the format's start and end tags) and ``tool_call`` (a complete
  :class:`ToolCall`). Text before a call's trigger is content at once; from the trigger on the
  text is held until the format's ``parse_call`` returns a complete call. A call that is
  malformed, names a tool that was not declared, or is cut off comes back as content, with a
  warning in the log: never an error for the client.
* The fallback every model gets when tools are given: a fenced JSON block
  (```` ```json {"name": ..., "arguments": {...}} ``` ````, what small coder models write instead
  of their template's format) naming a declared tool is a call too.
* :func:`call_grammar` builds the Lark grammar (llguidance's dialect, with ``%json`` schemas)
  that constrains an answer to calls of the declared tools: every answer a call (``required`` /
  a named function), or free text until the trigger and a constrained call from there
  (``auto``, llguidance's lazy lexemes). :func:`thinking_prefix` lets a thinking model think
  freely before a constrained answer.
"""
from __future__ import annotations

import json
import logging
import re
import uuid
from typing import Callable

import attrs

JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}

log = logging.getLogger("cpullm.toolcalls")

WS = "/[ \\t\\r\\n]{0,4}/"
"""Whitespace between a call's parts in a grammar (Lark): a few characters at most, so a model
that would rather stop than close the call cannot pad it with spaces until max_tokens."""
MAX_TOOLS = 128                   # declared tools per request
MAX_CALL_CHARS = 256 * 1024       # a call's text held while waiting for its end
FENCE = "```"


@attrs.define(frozen=True)
class ToolCall:
    """One parsed call: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict

    def openai(self, call_id: str | None = None) -> dict:
        """OpenAI's ``tool_calls[i]`` object (arguments as a JSON string)."""
        return {"id": call_id or new_call_id(), "type": "function",
                "function": {"name": self.name,
                             "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class MalformedCall(ValueError):
    """A call's text that cannot be a call (raised by a format's ``parse_call``)."""


@attrs.define
class ToolFormat:
    """How a model writes a tool call (a FamilySpec's ``tool_formats`` entry).

    name        unique, prefixed with the plugin's name ("qwen.hermes_json")
    trigger     the text that starts a call ("<tool_call>"); when it is a single token of the
                vocabulary the model usually writes it as that token, but its text is what is
                matched, so a call spelled out in ordinary tokens is recognized too
    parse_call  ``(text, tools) -> (ToolCall | None, end)``: ``text`` starts with the trigger;
                return the first call and the index just past it when the call is complete,
                ``(None, 0)`` while more text is needed, raise :class:`MalformedCall` when it can
                no longer become a call. ``tools`` maps declared names to their parameter
                schemas (to convert a value written as text)
    call_body   ``(tools) -> str``: Lark rules (llguidance's dialect) defining ``call_body``, the
                text of one call *after* the trigger, restricted to the declared tools
                (``tools``: name -> parameter schema; :func:`json_rule` writes a schema as
                ``%json``). The core prefixes the trigger and repeats calls as asked
    detect      ``(chat_template: str) -> bool``: whether a checkpoint with this template writes
                calls this way (default: always)
    at_start    calls may only open the answer (Llama 3.x's bare JSON calls): text first means
                no call
    in_template False for a format the chat template knows nothing about (a family without a
                native format): then the core writes the conversation for the template with
                the three functions below
    describe_tools  ``(tools: list of OpenAI tool objects) -> str``: the instructions added to
                the system message (or a new one) when ``in_template`` is False
    write_call  ``(ToolCall) -> str``: an earlier assistant call as the model writes it
    write_result ``(content: str, name: str | None) -> str``: a tool result, sent as a user turn
    description one line for the docs
    """

    name: str
    trigger: str
    parse_call: Callable
    call_body: Callable
    detect: Callable = lambda template: True
    at_start: bool = False
    in_template: bool = True
    describe_tools: Callable | None = None
    write_call: Callable | None = None
    write_result: Callable | None = None
    description: str = ""


@attrs.define
class ReasoningFormat:
    """How a model that thinks marks its thinking (a FamilySpec's ``reasoning_formats`` entry).

    name     unique, prefixed with the plugin's name ("qwen.think")
    start    the tag that opens the thinking ("<think>"); a template may already end the prompt
             with it, then the answer starts inside the thinking
    end      the tag that closes it ("</think>")
    detect   ``(chat_template: str) -> bool``: whether a checkpoint with this template thinks
    switch   the template variable that turns thinking on and off ("enable_thinking"), or None
             when the template has none (then ``enable_thinking`` / ``reasoning_effort`` are
             refused)
    efforts  ``reasoning_effort`` value -> template variables it sets (e.g. ``{"none":
             {"enable_thinking": False}}``); a value not listed is refused with the list
    """

    name: str
    start: str = "<think>"
    end: str = "</think>"
    detect: Callable = lambda template: True
    switch: str | None = "enable_thinking"
    efforts: dict = attrs.field(factory=dict)


def check_formats(formats, kind: type, field: str) -> tuple:
    """A FamilySpec field's formats as a tuple, each of type ``kind`` (else TypeError)."""
    formats = tuple(formats or ())
    for f in formats:
        if not isinstance(f, kind):
            raise TypeError(f"FamilySpec.{field} entries must be cpullm.toolcalls.{kind.__name__}, "
                            f"not {type(f).__name__}")
    return formats


def select(formats, template: str | None):
    """The first format whose ``detect`` accepts ``template``; None without a template or match.
    A plugin's detect that raises counts as no match (logged)."""
    if not template:
        return None
    for f in formats:
        try:
            if f.detect(template):
                return f
        except Exception as exc:                       # a plugin bug must not fail a request
            log.warning("format %s: detect failed (%s: %s)", f.name, type(exc).__name__, exc)
    return None


def formats_of(model, template: str | None) -> tuple:
    """(ToolFormat | None, ReasoningFormat | None) of ``model``'s family for its template."""
    fam = model.family
    return (select(getattr(fam, "tool_formats", ()), template),
            select(getattr(fam, "reasoning_formats", ()), template))


def messages_for_template(messages: list[dict], tools, fmt: ToolFormat | None) -> list[dict]:
    """The conversation as the chat template should see it. Unchanged when the template writes
    tools itself; for a format the template does not know (``in_template`` False): the tools'
    description joins the system message, earlier calls become the assistant's text and tool
    results become user turns, so a template that only alternates user and assistant renders it."""
    if fmt is None or fmt.in_template:
        return messages
    out = []
    for m in messages:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            parts = [m["content"]] if m.get("content") else []
            for tc in m["tool_calls"]:
                fn = tc.get("function") or {}
                args = fn.get("arguments")
                try:
                    args = json.loads(args) if isinstance(args, str) else (args or {})
                except ValueError:
                    args = {}
                parts.append(fmt.write_call(ToolCall(str(fn.get("name", "")), args if isinstance(args, dict) else {})))
            out.append({"role": "assistant", "content": "\n".join(parts)})
        elif role == "tool":
            text = fmt.write_result(m.get("content") or "", m.get("name"))
            if out and out[-1]["role"] == "user" and out[-1].get("_tool_results"):
                out[-1] = dict(out[-1], content=out[-1]["content"] + "\n" + text)
            else:
                out.append({"role": "user", "content": text, "_tool_results": True})
        else:
            out.append(m)
    out = [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]
    if tools:
        text = fmt.describe_tools(tools)
        if out and out[0].get("role") in ("system", "developer"):
            out[0] = dict(out[0], content=f"{out[0].get('content') or ''}\n\n{text}".strip())
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


# ---- declared tools ---------------------------------------------------------------------------
def tool_schemas(tools) -> dict:
    """``{name: parameters schema}`` of OpenAI ``tools`` (already checked by the caller)."""
    out = {}
    for t in tools or ():
        fn = t.get("function") or {}
        params = fn.get("parameters")
        out[fn["name"]] = params if isinstance(params, dict) else {"type": "object", "properties": {}}
    return out


def json_rule(schema: dict) -> str:
    """A JSON schema as an llguidance ``%json`` item, laid out as constrained JSON is everywhere
    (:data:`JSON_OPTIONS`: one line, ``", "`` and ``": "``, no free whitespace
    a model could pad forever); a schema's own ``x-guidance`` wins."""
    if isinstance(schema, dict) and "x-guidance" not in schema:
        schema = {"x-guidance": dict(JSON_OPTIONS), **schema}
    return "%json " + json.dumps(schema, ensure_ascii=False)


def lark_string(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def object_schema(params: dict) -> dict:
    """A tool's parameter schema as a call must satisfy it: an object (an absent type means one)."""
    schema = dict(params or {})
    schema.setdefault("type", "object")
    return schema


def _never(text: str) -> bool:
    return False


def use_special_tokens(grammar: str, is_special) -> str:
    """``grammar`` with each quoted literal that is exactly one special token of the vocabulary
    (as the constraint engine sees it: ``is_special(text)``) written as a reference to that token
    (``"<tool_call>"`` -> ``<tool_call>``): such a token's text is not matched byte by byte, and
    the model writes the token, not its spelling. ``%json`` schemas are left as they are."""
    def fix(part: str) -> str:
        return re.sub(r'"(<[^"<>\s\\]{1,64}>)"', lambda m: m.group(1) if is_special(m.group(1)) else m.group(0), part)
    out = []
    for line in grammar.split("\n"):
        head, sep, rest = line.partition("%json ")
        out.append(fix(head) + sep + rest)
    return "\n".join(out)


def call_grammar(fmt: ToolFormat, tools: dict, mode: str, parallel: bool, is_special=_never,
                 answer_schema: dict | None = None) -> str:
    """The Lark grammar an answer must match.

    ``mode``: "required" (the answer is one call, or several with ``parallel``, and nothing
    else) or "auto" (any text; once the trigger appears, a call of a declared tool must follow:
    llguidance's lazy lexeme ends the free text at the trigger, or, when the trigger is a special
    token (``is_special``), the free text simply cannot contain it). ``answer_schema`` (auto
    only): an answer that is not a call must be JSON of this schema (``response_format``)."""
    body = fmt.call_body(tools)
    trigger = lark_string(fmt.trigger)
    if mode == "auto" and answer_schema is not None:
        calls = "call (SEP call)*" if parallel else "call"
        grammar = (f"start: answer_json | {calls} SEP\nanswer_json: {json_rule(answer_schema)}\n"
                   f"call: {trigger} call_body\nSEP: {WS}\n{body}\n")
    elif mode == "required":
        calls = "call (SEP call)*" if parallel else "call"
        grammar = f"start: {calls} SEP\ncall: {trigger} call_body\nSEP: {WS}\n{body}\n"
    elif mode != "auto":
        raise ValueError(f"mode must be 'required' or 'auto', not {mode!r}")
    elif fmt.at_start:                 # a call opens the answer, or the answer is text
        first = re.escape(fmt.trigger[:1]) if fmt.trigger else ""
        free = f"/([^{first}\\s](.|\\n)*)?/" if first else "/(.|\\n)*/"
        grammar = (f"start: call SEP | FREE\ncall: {trigger} call_body\nSEP: {WS}\n"
                   f"FREE: {free}\n{body}\n")
    elif is_special(fmt.trigger):
        calls = "*" if parallel else "?"
        grammar = f"start: TEXT ({trigger} call_body TEXT){calls}\nTEXT: /(.|\\n)*/\n{body}\n"
    else:
        calls = "(pre call_body)*" if parallel else "(pre call_body)?"
        grammar = f"start: {calls} TEXT\npre[lazy]: TEXT {trigger}\nTEXT: /(.|\\n)*/\n{body}\n"
    return use_special_tokens(grammar, is_special)


def thinking_prefix(reasoning: ReasoningFormat, opened: bool, is_special=_never) -> str:
    """Lark rules for free thinking before a constrained answer: rule ``thought`` (the thinking
    and its end tag; with ``opened`` the prompt already opened it). Use ``start: thought answer``."""
    start, end = lark_string(reasoning.start), lark_string(reasoning.end)
    ws = WS
    if is_special(reasoning.end):      # free text cannot hold the special end token: no laziness
        text = f"THOUGHT_TEXT {end} {ws}\nTHOUGHT_TEXT: /(.|\\n)*/"
        rules = (f"thought: {text}\n" if opened else
                 f"thought: ({ws} {start} thought_text)?\nthought_text: {text}\n")
    elif opened:
        rules = f"thought[lazy]: /(.|\\n)*/ {end} {ws}\n"
    else:
        rules = f"thought: ({ws} {start} thought_text)?\nthought_text[lazy]: /(.|\\n)*/ {end} {ws}\n"
    return use_special_tokens(rules, is_special)


def with_thinking(grammar: str, reasoning: ReasoningFormat | None, opened: bool, is_special=_never) -> str:
    """``grammar`` (whose rule is ``start``) preceded by free thinking when the model thinks."""
    if reasoning is None:
        return grammar
    renamed = re.sub(r"(?m)^start:", "answer:", grammar, count=1)
    return f"start: thought answer\n{thinking_prefix(reasoning, opened, is_special)}{renamed}"


def opens_thinking(prompt_text: str, reasoning: ReasoningFormat | None) -> bool:
    """Whether the rendered prompt ends inside an open thinking block (templates that put
    ``<think>\\n`` in the generation prompt): the answer then starts with thinking."""
    if reasoning is None:
        return False
    tail = prompt_text[-4096:]
    i = tail.rfind(reasoning.start)
    return i >= 0 and tail.find(reasoning.end, i) < 0


# ---- parsing the answer -------------------------------------------------------------------------
def _held(text: str, marks) -> int:
    """How many trailing characters of ``text`` could be the start of one of ``marks``."""
    best = 0
    for m in marks:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


def _fenced_calls(block: str, tools: dict) -> list[ToolCall] | None:
    """The calls in a fenced block ```` ```json ... ``` ```` when it holds one call object (or a
    list of them) naming declared tools; None when it is ordinary code."""
    inner = block[len(FENCE):-len(FENCE)]
    first_line, _, rest = inner.partition("\n")
    if first_line.strip() not in ("", "json", "JSON", "tool_call", "tool_code"):
        return None
    try:
        value = json.loads(rest if first_line.strip() else inner)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        call = _call_object(item, tools)
        if call is None:
            return None
        calls.append(call)
    return calls or None


def _call_object(item, tools: dict) -> ToolCall | None:
    """``{"name": ..., "arguments" | "parameters": {...}}`` naming a declared tool, as a call."""
    if not isinstance(item, dict) or item.get("name") not in tools:
        return None
    args = item.get("arguments", item.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return ToolCall(item["name"], args) if isinstance(args, dict) else None


def parse_json_call(text: str, tools: dict) -> ToolCall:
    """A call written as one JSON object (``name`` and ``arguments`` or ``parameters``) that
    names a declared tool; :class:`MalformedCall` otherwise. For the plugins' formats."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise MalformedCall(f"the call is not JSON ({exc})") from None
    call = _call_object(value, tools)
    if call is None:
        raise MalformedCall("the call is not {\"name\": <declared tool>, \"arguments\": {...}}")
    return call


def parse_tagged_json_call(text: str, tools: dict, start: str, end: str):
    """A ToolFormat's ``parse_call`` for one JSON call (``{"name": ..., "arguments": {...}}``)
    between ``start`` and ``end`` tags, as Qwen2.5 / Qwen3 write it and cpullm's Gemma format:
    ``text`` starts with ``start``. (call, index past ``end``) once the end tag came, (None, 0)
    before; :class:`MalformedCall` when what follows the tag cannot be a JSON object."""
    close = text.find(end, len(start))
    if close < 0:
        head = text[len(start):].lstrip()
        if head and not head.startswith("{"):
            raise MalformedCall(f"a {start} that does not hold a JSON object")
        return None, 0
    return parse_json_call(text[len(start):close].strip(), tools), close + len(end)


def tagged_json_call_body(tools: dict, end: str) -> str:
    """A ToolFormat's ``call_body`` for :func:`parse_tagged_json_call`'s calls: one JSON object
    naming a declared tool with its parameters' schema, then the ``end`` tag."""
    names = [f"fn_{i}" for i in range(len(tools))]
    rules = [f"call_body: {WS} ({' | '.join(names)}) {WS} {lark_string(end)}"]
    for rule, (name, params) in zip(names, tools.items()):
        schema = {"type": "object",
                  "properties": {"name": {"const": name}, "arguments": object_schema(params)},
                  "required": ["name", "arguments"], "additionalProperties": False}
        rules.append(f"{rule}: {json_rule(schema)}")
    return "\n".join(rules)


class AnswerParser:
    """Splits an answer's text into content, reasoning and tool calls, as it streams.

    ``push(piece)`` and ``finish()`` return lists of events ``(kind, value)``: ("content", str),
    ("reasoning", str), ("tool_call", ToolCall). ``tools`` (name -> parameter schema) enables
    tool-call parsing with ``fmt`` (the model's ToolFormat, or None) and the fenced-JSON fallback;
    ``reasoning`` with ``thinking`` (the prompt ended inside an open thinking block) enables
    reasoning. ``max_calls`` (1 for ``parallel_tool_calls`` false; 0: no limit): text after that
    many calls is content. Nothing is dropped: text that is not a valid call comes back as
    content."""

    def __init__(self, fmt: ToolFormat | None = None, tools: dict | None = None,
                 reasoning: ReasoningFormat | None = None, thinking: bool = False, max_calls: int = 0):
        self.max_calls = max_calls
        self.fmt = fmt if tools else None
        self.tools = tools or {}
        self.strip = bool(tools) or reasoning is not None   # plain text keeps its leading spaces
        self.fallback = bool(tools)
        self.reasoning = reasoning
        self.state = "reasoning" if (reasoning is not None and thinking) else "content"
        self.buf = ""
        self.started = False              # content other than whitespace was emitted
        self.pending_ws = ""              # whitespace held until content follows it
        self.calls = 0
        self.malformed: str | None = None   # why a call came back as text

    # -- helpers
    def _content(self, text: str, out: list) -> None:
        if not text:
            return
        if not self.strip:
            self.started = True
        elif not self.started:
            text = (self.pending_ws + text).lstrip()
            self.pending_ws = ""
            if not text:
                return
            self.started = True
        elif self.calls and not text.strip():
            self.pending_ws += text                     # whitespace between calls: not content
            return
        else:
            text, self.pending_ws = self.pending_ws + text, ""
        out.append(("content", text))

    def _triggers(self) -> list[str]:
        marks = []
        if self.max_calls and self.calls >= self.max_calls:
            return marks
        if self.fmt is not None and (not self.fmt.at_start or not self.started):
            marks.append(self.fmt.trigger)
        if self.fallback:
            marks.append(FENCE)
            if not self.started and not self.calls and (self.fmt is None or self.fmt.trigger != "{"):
                marks.append("{")                       # a bare JSON call as the whole answer
        if self.reasoning is not None and not self.started and not self.calls:
            marks.append(self.reasoning.start)
        return [m for m in marks if m]

    def _fail(self, why: str, out: list) -> None:
        """The held text is not a call: it is content from here on."""
        self.malformed = why
        log.warning("a tool call in the answer is malformed (%s); returned as text", why)
        text, self.buf, self.state = self.buf, "", "text"
        self._content(text, out)

    # -- the state machine
    def push(self, piece: str) -> list:
        out: list = []
        self.buf += piece
        self._run(out, final=False)
        return out

    def finish(self) -> list:
        out: list = []
        self._run(out, final=True)
        if self.buf:
            if self.state == "call":
                self._fail("the answer ended inside the call", out)
            elif self.state == "bare":
                self._step_bare(out, final=True)
            elif self.state == "fence":
                text, self.buf = self.buf, ""
                self._content(text, out)
            elif self.state == "reasoning":
                out.append(("reasoning", self.buf))
                self.buf = ""
            else:
                text, self.buf = self.buf, ""
                self._content(text, out)
        return out

    def _run(self, out: list, final: bool) -> None:
        while self.buf:
            before = (self.state, len(self.buf))
            getattr(self, "_step_" + self.state)(out, final)
            if (self.state, len(self.buf)) == before:
                return                                   # waiting for more text

    def _step_text(self, out, final):
        text, self.buf = self.buf, ""
        self._content(text, out)

    def _step_reasoning(self, out, final):
        end = self.reasoning.end
        i = self.buf.find(end)
        if i >= 0:
            if i:
                out.append(("reasoning", self.buf[:i]))
            self.buf = self.buf[i + len(end):]
            self.state = "content"
            return
        keep = 0 if final else _held(self.buf, [end])
        if len(self.buf) > keep:
            out.append(("reasoning", self.buf[:len(self.buf) - keep]))
            self.buf = self.buf[len(self.buf) - keep:]

    def _step_content(self, out, final):
        marks = self._triggers()
        hits = [(self.buf.find(m), m) for m in marks if m in self.buf]
        if self.reasoning is not None and not self.started and not self.calls:
            stripped = self.buf.lstrip()
            if stripped.startswith(self.reasoning.start):
                self.buf = stripped[len(self.reasoning.start):]
                self.state = "reasoning"
                return
            hits = [(i, m) for i, m in hits if m != self.reasoning.start]
        if not self.started:
            # a bare call opens the answer: only where the text starts, not inside it
            at_start = {"{"} | ({self.fmt.trigger} if self.fmt is not None and self.fmt.at_start else set())
            hits = [(i, m) for i, m in hits if m not in at_start or not self.buf[:i].strip()]
        if hits:
            i, mark = min(hits)
            self._content(self.buf[:i], out)
            self.buf = self.buf[i:]
            if self.fmt is not None and mark == self.fmt.trigger:
                self.state = "call"
            else:
                self.state = "fence" if mark == FENCE else "bare"
            return
        keep = 0 if final else _held(self.buf, marks)
        if not self.started and not final and not self.buf.strip() and (self.fallback or self.fmt):
            keep = len(self.buf)                         # only whitespace so far: wait
        if len(self.buf) > keep:
            self._content(self.buf[:len(self.buf) - keep], out)
            self.buf = self.buf[len(self.buf) - keep:]

    def _step_call(self, out, final):
        try:
            call, end = self.fmt.parse_call(self.buf, self.tools)
        except MalformedCall as exc:
            self._fail(str(exc), out)
            return
        except Exception as exc:                         # a plugin bug: the text stays text
            self._fail(f"{self.fmt.name} failed: {type(exc).__name__}: {exc}", out)
            return
        if call is None:
            if len(self.buf) > MAX_CALL_CHARS:
                self._fail(f"no complete call within {MAX_CALL_CHARS} characters", out)
            return
        if call.name not in self.tools:
            self._fail(f"the call names {call.name!r}, which is not a declared tool", out)
            return
        out.append(("tool_call", call))
        self.calls += 1
        self.buf = self.buf[end:]
        self.state = "content"

    def _step_bare(self, out, final):
        """A JSON object opening the answer: a call when it names a declared tool and nothing
        but whitespace follows it."""
        try:
            value, end = json.JSONDecoder().raw_decode(self.buf)
        except ValueError:
            if final or len(self.buf) > MAX_CALL_CHARS:
                text, self.buf, self.state = self.buf, "", "text"
                self._content(text, out)
            return
        call = _call_object(value, self.tools)
        if call is None or self.buf[end:].strip():
            text, self.buf, self.state = self.buf, "", "text"
            self._content(text, out)
            return
        if not final:
            return                                       # text may still follow the object
        out.append(("tool_call", call))
        self.calls += 1
        self.buf, self.state = "", "content"

    def _step_fence(self, out, final):
        close = self.buf.find(FENCE, len(FENCE))
        if close < 0:
            if len(self.buf) > MAX_CALL_CHARS:
                text, self.buf, self.state = self.buf, "", "text"
                self._content(text, out)
            return
        block, self.buf = self.buf[:close + len(FENCE)], self.buf[close + len(FENCE):]
        calls = _fenced_calls(block, self.tools)
        self.state = "content"
        if calls is None:
            self._content(block, out)
            return
        if self.max_calls and self.calls + len(calls) > self.max_calls:
            self._content(block, out)                  # more calls than allowed: text
            return
        for call in calls:
            out.append(("tool_call", call))
            self.calls += 1


@attrs.define
class Answer:
    """A whole answer, parsed: what :func:`parse_answer` returns."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list = attrs.field(factory=list)

    def message(self) -> dict:
        """The OpenAI assistant message: content (None when only calls), reasoning_content
        when the model thought, tool_calls when it called."""
        content = self.content.rstrip() if self.tool_calls else self.content
        msg = {"role": "assistant", "content": content if (content or not self.tool_calls) else None}
        if self.reasoning.strip():
            msg["reasoning_content"] = self.reasoning.strip()
        if self.tool_calls:
            msg["tool_calls"] = [c.openai() for c in self.tool_calls]
        return msg


def collect(events, answer: Answer | None = None) -> Answer:
    """Add parser events to an :class:`Answer`."""
    answer = answer if answer is not None else Answer()
    for kind, value in events:
        if kind == "content":
            answer.content += value
        elif kind == "reasoning":
            answer.reasoning += value
        else:
            answer.tool_calls.append(value)
    return answer


def parse_answer(text: str, parser: AnswerParser) -> Answer:
    """A whole answer's text through ``parser``."""
    answer = collect(parser.push(text))
    return collect(parser.finish(), answer)
