"""A chat request's tools and reasoning: the request checked, the template's inputs planned, and
how the answer is read and constrained.

The server's chat endpoint and :meth:`cpullm.model.Model.chat` take the same fields (``tools``,
``tool_choice``, ``parallel_tool_calls``, ``reasoning_effort``, ``chat_template_kwargs``):
:func:`tool_request` checks the tools and the choice, :func:`plan_chat` picks the model's tool and
reasoning formats (its plugin's, for its template) and writes the conversation for the template,
and :meth:`ChatPlan.answer` gives the :class:`ChatAnswer` that reads the answer's text and the
constraint (a tool-call grammar, :mod:`cpullm.generate.constraints`) a forced call needs. A wrong field
raises :class:`cpullm.errors.ApiError` naming it, which the server answers as a 400.
"""
from __future__ import annotations

import re

from ..errors import ApiError, CpullmError
from ..limits import quoted
from ..toolcalls import MAX_TOOLS


class ChatAnswer:
    """How a chat answer is read: the declared tools (name -> parameter schema) and the
    model's tool format, its reasoning format and whether the prompt opened the thinking."""

    def __init__(self, tools: dict | None = None, fmt=None, reasoning=None, thinking: bool = False,
                 parallel: bool = True):
        self.tools, self.fmt, self.reasoning, self.thinking = tools or {}, fmt, reasoning, thinking
        self.parallel = parallel

    def parser(self):
        from ..toolcalls import AnswerParser
        return AnswerParser(self.fmt, self.tools, self.reasoning, self.thinking,
                            max_calls=0 if self.parallel else 1)


_TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def tool_request(body: dict):
    """(tools or None, tool_choice, parallel_tool_calls) checked: tool_choice is "auto", "none",
    "required" or ("named", name)."""
    from ..toolcalls import MAX_TOOLS

    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise ApiError("tools must be a list of {\"type\": \"function\", \"function\": {...}}",
                           param="tools", code="invalid_type")
        if len(tools) > MAX_TOOLS:
            raise ApiError(f"tools takes at most {MAX_TOOLS} tools, got {len(tools)}", param="tools",
                           code="invalid_value")
        seen = set()
        for i, t in enumerate(tools):
            where = f"tools[{i}]"
            if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
                kind = t.get("type") if isinstance(t, dict) else type(t).__name__
                raise ApiError(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\", "
                               f"\"parameters\"}}}} (got type {quoted(kind)}); only function tools are "
                               "served", param="tools", code="invalid_value")
            fn = t["function"]
            name = fn.get("name")
            if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
                raise ApiError(f"{where}.function.name must be 1-64 letters, digits, '_', '-' or '.', "
                               f"got {quoted(name)}", param="tools", code="invalid_value")
            if name in seen:
                raise ApiError(f"{where}.function.name {name!r} is declared twice; give each tool its "
                               "own name", param="tools", code="invalid_value")
            seen.add(name)
            params = fn.get("parameters")
            if params is not None and not isinstance(params, dict):
                raise ApiError(f"{where}.function.parameters must be a JSON schema object",
                               param="tools", code="invalid_type")
            if fn.get("strict") not in (None, True, False):
                raise ApiError(f"{where}.function.strict must be true or false", param="tools",
                               code="invalid_type")
        if not tools:
            tools = None
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise ApiError("tool_choice must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                           "\"function\": {\"name\": ...}}", param="tool_choice", code="invalid_value")
        if name not in {t["function"]["name"] for t in tools or ()}:
            raise ApiError(f"tool_choice names {name!r}, which is not in tools; declare it in tools",
                           param="tool_choice", code="invalid_value")
        choice = ("named", name)
    elif choice not in ("auto", "none", "required"):
        raise ApiError(f"tool_choice must be \"auto\", \"none\", \"required\" or {{\"type\": \"function\", "
                       f"\"function\": {{\"name\": ...}}}}, got {quoted(choice)}", param="tool_choice",
                       code="invalid_value")
    elif choice == "required" and not tools:
        raise ApiError("tool_choice \"required\" needs tools: declare at least one", param="tool_choice",
                       code="invalid_value")
    parallel = body.get("parallel_tool_calls")
    if parallel is None:
        parallel = True
    elif not isinstance(parallel, bool):
        raise ApiError(f"parallel_tool_calls must be true or false, got {quoted(parallel)}",
                       param="parallel_tool_calls", code="invalid_type")
    return tools, choice, parallel


class ChatPlan:
    """What a chat request sends to the template and how its answer is read and constrained."""

    def __init__(self, messages, template_tools, template_kwargs, tools, choice, parallel, fmt,
                 reasoning, strict):
        self.messages, self.template_tools, self.template_kwargs = messages, template_tools, template_kwargs
        self.tools, self.choice, self.parallel = tools, choice, parallel
        self.fmt, self.reasoning, self.strict = fmt, reasoning, strict

    def answer(self, model, prompt_text: str, answer_spec: dict | None = None):
        """(ChatAnswer, constraint or None) once the prompt is rendered. ``answer_spec``: the
        request's own constraint spec (response_format or a peer's spelling): under "auto" an
        answer that is not a call must match it (JSON kinds only); a forced call makes it moot."""
        from ..toolcalls import call_grammar, opens_thinking, tool_schemas, with_thinking

        schemas = tool_schemas(self.tools) if self.tools and self.choice != "none" else {}
        if isinstance(self.choice, tuple):
            schemas = {self.choice[1]: schemas[self.choice[1]]}
        opened = opens_thinking(prompt_text, self.reasoning)
        answer = ChatAnswer(schemas, self.fmt, self.reasoning, opened, self.parallel)
        must = self.choice == "required" or isinstance(self.choice, tuple) or self.strict
        if not schemas or self.fmt is None:
            if must and schemas:
                raise ApiError("this model's chat template has no tool-call format its plugin knows, so "
                               "a call cannot be constrained: send tool_choice \"auto\" (calls are then "
                               "read from fenced JSON blocks) and no strict tools", param="tool_choice",
                               code="unsupported_parameter")
            return answer, None
        mode = "required" if self.choice == "required" or isinstance(self.choice, tuple) else "auto"
        is_special = special_token_test(model)
        if is_special is None:                      # constrained decoding is not installed
            return answer, build_tool_constraint(model, "", required=must)
        answer_schema = None
        if mode == "auto" and answer_spec:
            kind, value = next(iter(answer_spec.items()))
            if kind not in ("json_schema", "json_object"):
                raise ApiError(f"tools under tool_choice \"auto\" combine only with a JSON answer format "
                               f"(response_format json_schema / json_object), not a {kind} constraint: "
                               "send tool_choice \"none\" or \"required\", or drop the constraint",
                               param="tools", code="unsupported_parameter")
            answer_schema = value if kind == "json_schema" else {"type": "object"}
        grammar = with_thinking(call_grammar(self.fmt, schemas, mode, self.parallel, is_special, answer_schema),
                                self.reasoning, opened, is_special)
        return answer, build_tool_constraint(model, grammar, required=must)


def special_token_test(model):
    """``text -> bool``: whether ``text`` is one token of ``model``'s vocabulary that the
    constraint engine treats as special (matched as that token, not as bytes); None when
    constrained decoding is not installed."""
    from . import constraints

    if not constraints.available():
        return None
    table = constraints.token_table(model.tokenizer, model.logits_size, model.eos_token_ids)
    tok = model.tokenizer

    def is_special(text: str) -> bool:
        i = tok.token_to_id(text)
        return i is not None and 0 <= i < table.vocab_size and bool(table.is_special_token(i))
    return is_special


def build_tool_constraint(model, grammar: str, required: bool):
    """The constraint of a tool-call grammar (:mod:`cpullm.generate.constraints`, the ``lark`` kind), or
    None when constrained decoding is not installed and the request does not need it."""
    from . import constraints

    if not constraints.available():
        if required:
            raise ApiError("tool_choice \"required\", a named function and strict tools need constrained "
                           f"decoding, which this installation lacks: {constraints.INSTALL_HINT}, or send "
                           "tool_choice \"auto\" and no strict tools", param="tool_choice",
                           code="unsupported_parameter")
        return None
    try:
        return model.constraint({"lark": grammar})
    except CpullmError as exc:
        raise ApiError(f"the tools' parameter schemas cannot be enforced: {exc}", param="tools",
                       code="invalid_value") from None


def plan_chat(model, body: dict, messages: list[dict], tools, choice, parallel, extra: dict) -> ChatPlan:
    """The template's inputs and the answer's reading for a chat request: the model's tool and
    reasoning formats (its plugin's, for its template), ``enable_thinking`` and
    ``reasoning_effort`` checked against them."""
    from .chat import arguments_as_objects, require_template
    from ..toolcalls import formats_of, messages_for_template

    template = require_template(model, tools=tools)
    fmt, reasoning = formats_of(model, template)
    kwargs = dict(extra)
    switch = reasoning.switch if reasoning is not None else None
    supported = switch is not None and switch in template
    if "enable_thinking" in kwargs:
        if not supported or switch != "enable_thinking":
            raise ApiError("chat_template_kwargs.enable_thinking is not supported: this model's chat "
                           "template has no thinking switch (remove it)", param="chat_template_kwargs",
                           code="unsupported_parameter")
        if not isinstance(kwargs["enable_thinking"], bool):
            raise ApiError("chat_template_kwargs.enable_thinking must be true or false",
                           param="chat_template_kwargs", code="invalid_type")
    effort = body.get("reasoning_effort")
    if effort is not None:
        if not supported:
            raise ApiError(f"reasoning_effort={quoted(effort)} is not supported: this model does not "
                           "think (remove reasoning_effort)", param="reasoning_effort",
                           code="unsupported_parameter")
        if effort not in reasoning.efforts:
            raise ApiError(f"reasoning_effort={quoted(effort)} is not supported by this model's template, "
                           f"which can only turn thinking on or off: send one of "
                           f"{', '.join(map(repr, reasoning.efforts))}", param="reasoning_effort",
                           code="unsupported_parameter")
        kwargs.update(reasoning.efforts[effort])
    strict = any(t["function"].get("strict") is True for t in tools or ())
    active = tools if choice != "none" else None
    history = arguments_as_objects(messages)
    if fmt is not None and not fmt.in_template:
        history, template_tools = messages_for_template(history, active, fmt), None
    else:
        template_tools = active
    return ChatPlan(history, template_tools, kwargs, tools, choice, parallel, fmt,
                    reasoning, strict and choice != "none")
