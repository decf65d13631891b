"""Chat templates and conversations.

The template comes from the model directory, as transformers finds it: a sidecar
``chat_template.jinja`` (what transformers 5 ``save_pretrained`` writes), else
``tokenizer_config.json`` ``chat_template`` (a string, or a list of ``{"name", "template"}``:
``tool_use`` when tools are given and it exists, else ``default``), else a processor's
``chat_template.json``.

Templates are untrusted code shipped with a checkpoint. They render in jinja2's
``ImmutableSandboxedEnvironment`` (no ``_``-prefixed attributes, no internal attributes of
functions, frames or types, no mutation of lists and dicts, bounded ``range``), with the helpers
transformers provides (``raise_exception``, ``strftime_now``, the ``tojson`` filter, the
``{% generation %}`` tag, ``loopcontrols``) and the variables templates read (``messages``,
``bos_token``, ``eos_token``, ``add_generation_prompt``, ``tools``, plus any extra keyword such
as ``enable_thinking``). Reaching for an internal attribute stops the render at once. Repetition
(``*``), powers, integer arguments to calls and filters, format widths and the rendered size are
bounded, so a hostile template cannot exhaust memory either. Every failure is a
``ChatTemplateError`` naming the cause.
"""
from __future__ import annotations

import datetime
import functools
import json
import operator
import re
from pathlib import Path

from .errors import ChatTemplateError, ContextOverflowError

MAX_RENDERED_CHARS = 8 * 2**20        # a rendered prompt longer than this is a runaway template
MAX_REPEAT = 2**20                    # 'x' * n / [..] * n: at most this many items or characters
MAX_POWER_BITS = 4096                 # a ** b: the result's size


# ---- finding the template ------------------------------------------------------------------
def find_template(model_dir: Path, config: dict | None = None, name: str | None = None,
                  tools=None) -> str | None:
    """The model's chat template text, or None when it has none.

    ``name`` picks one of a named list; without it, ``tool_use`` when ``tools`` are given and the
    list has one, else ``default`` (else the first)."""
    model_dir = Path(model_dir)
    sidecar = model_dir / "chat_template.jinja"
    if sidecar.is_file():
        return sidecar.read_text(encoding="utf-8")
    if config is None:
        cfg = model_dir / "tokenizer_config.json"
        try:
            config = json.loads(cfg.read_text(encoding="utf-8")) if cfg.is_file() else {}
        except (json.JSONDecodeError, UnicodeDecodeError):
            config = {}
    tpl = config.get("chat_template")
    if isinstance(tpl, list):
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        if name is not None:
            if name not in named:
                raise ChatTemplateError(f"the model has no chat template named {name!r} "
                                        f"(it has: {', '.join(map(str, named))})")
            tpl = named[name]
        elif tools is not None and "tool_use" in named:
            tpl = named["tool_use"]
        else:
            tpl = named.get("default") or next(iter(named.values()), None)
    if tpl is None:
        side = model_dir / "chat_template.json"
        if side.is_file():
            try:
                tpl = json.loads(side.read_text(encoding="utf-8")).get("chat_template")
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
                tpl = None
    return tpl if isinstance(tpl, str) and tpl.strip() else None


def has_template(model) -> bool:
    return find_template(model.model_dir, model.tokenizer.config) is not None


def require_template(model, tools=None) -> str:
    """The template of ``model`` (a Model, or a model directory before loading), or a
    ChatTemplateError saying it has none and what to do."""
    if isinstance(model, (str, Path)):
        model_dir, config = Path(model), None
    else:
        model_dir, config = model.model_dir, model.tokenizer.config
    tpl = find_template(model_dir, config, tools=tools)
    if tpl is None:
        raise ChatTemplateError(
            f"{model_dir} has no chat template (neither chat_template.jinja nor "
            "tokenizer_config.json 'chat_template'), so it cannot hold a conversation: it is "
            "probably a base model. Use plain completion (`cpullm run` without --chat, or "
            "/v1/completions), or add the instruct model's chat_template.jinja to the directory")
    return tpl


# ---- the sandbox -----------------------------------------------------------------------------
def _raise_exception(message="the template raised an error"):
    raise ChatTemplateError(f"the model's chat template rejected the conversation: {message}")


def _strftime_now(fmt="%d %b %Y"):
    return datetime.datetime.now().strftime(str(fmt))


def _tojson(value, indent=None, separators=None, sort_keys=False, ensure_ascii=False):
    # transformers' tojson: plain json.dumps (jinja's own escapes HTML, which prompts must not)
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys,
                      ensure_ascii=ensure_ascii)


def _length(v):
    try:
        return len(v)
    except TypeError:
        return None


def _bounded_mul(left, right):
    for seq, n in ((left, right), (right, left)):
        if isinstance(n, int) and not isinstance(seq, (int, float)) and _length(seq) is not None:
            if _length(seq) * max(n, 0) > MAX_REPEAT:
                raise ChatTemplateError(f"the chat template tried to build a sequence of "
                                        f"{_length(seq) * n} items (limit {MAX_REPEAT})")
    return operator.mul(left, right)


_PERCENT_WIDTH = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(?:\d{7,}|\d*\.\d{7,})")
_BRACE_WIDTH = re.compile(r"\{[^{}]*:[^{}]*\d{7,}[^{}]*\}")


def _check_args(args, kwargs) -> None:
    """No call from a template gets an integer over MAX_REPEAT ('x'.ljust(10**10), center(...))."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_REPEAT:
            raise ChatTemplateError(f"the chat template passed {a} to a function (limit {MAX_REPEAT})")


def _check_format(fmt, brace: bool) -> None:
    if isinstance(fmt, str) and (_BRACE_WIDTH if brace else _PERCENT_WIDTH).search(fmt):
        raise ChatTemplateError("the chat template used a format width over a million characters")


def _bounded_filter(f):
    skip = 2 if getattr(f, "jinja_pass_arg", None) is not None else 1   # (context,) value, args

    @functools.wraps(f)
    def bounded(*args, **kwargs):
        _check_args(args[skip:], kwargs)
        return f(*args, **kwargs)
    return bounded


def _environment_format(fmt):
    """The ``format`` filter: its arguments are values, so only the format string is checked."""
    @functools.wraps(fmt)
    def bounded(value, *args, **kwargs):
        _check_format(value, brace=False)
        return fmt(value, *args, **kwargs)
    return bounded


def _bounded_pow(left, right):
    if isinstance(left, int) and isinstance(right, int) and right > 0 and \
            abs(left) > 1 and right * abs(left).bit_length() > MAX_POWER_BITS:
        raise ChatTemplateError("the chat template tried to compute an enormous power")
    return operator.pow(left, right)


@functools.lru_cache(maxsize=1)
def _environment():
    from jinja2 import nodes
    from jinja2.exceptions import SecurityError
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers marks assistant tokens with
        it); rendering only needs the body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    class Env(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "%"])

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
            _check_args(args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

        def wrap_str_format(self, value):
            fmt = super().wrap_str_format(value)       # 'str'.format / format_map, sandboxed
            if fmt is None:
                return None
            _check_format(value.__self__, brace=True)

            @functools.wraps(fmt)
            def checked(*args, **kwargs):
                _check_args(args, kwargs)
                for a in args:                          # format_map({'w': 10**9})
                    if isinstance(a, dict):
                        _check_args((), a)
                return fmt(*args, **kwargs)
            return checked

        def unsafe_undefined(self, obj, attribute):
            # jinja would return an Undefined that renders as "" and fails only when used further;
            # a template that reaches for internals is stopped at once, and says so.
            raise SecurityError(f"access to attribute {attribute!r} of a "
                                f"{type(obj).__name__!r} object is unsafe")

        def call_binop(self, context, op, left, right):
            if op == "*":
                return _bounded_mul(left, right)
            if op == "**":
                return _bounded_pow(left, right)
            if op == "%":
                _check_format(left, brace=False)
            return super().call_binop(context, op, left, right)

    env = Env(trim_blocks=True, lstrip_blocks=True,
              extensions=["jinja2.ext.loopcontrols", GenerationTag])
    env.filters["tojson"] = _tojson
    for name, f in list(env.filters.items()):
        env.filters[name] = _bounded_filter(f)
    env.filters["format"] = _environment_format(env.filters["format"].__wrapped__)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    from jinja2 import TemplateError
    try:
        return _environment().from_string(template)
    except TemplateError as exc:
        raise ChatTemplateError(f"the model's chat template is not valid jinja: {exc}") from None


def render_template(template: str, messages: list[dict], *, bos_token: str | None = None,
                    eos_token: str | None = None, add_generation_prompt: bool = True,
                    tools=None, **extra) -> str:
    """Render ``messages`` with ``template`` in the sandbox. Every failure is a ChatTemplateError."""
    from jinja2 import TemplateError
    from jinja2.exceptions import SecurityError

    tpl = _compile(template)
    try:
        out, size = [], 0
        for chunk in tpl.generate(messages=messages, bos_token=bos_token or "",
                                  eos_token=eos_token or "",
                                  add_generation_prompt=add_generation_prompt, tools=tools, **extra):
            size += len(chunk)
            if size > MAX_RENDERED_CHARS:
                raise ChatTemplateError(f"the chat template produced more than {MAX_RENDERED_CHARS} "
                                        "characters; it is broken or hostile")
            out.append(chunk)
        return "".join(out)
    except ChatTemplateError:
        raise
    except SecurityError as exc:
        raise ChatTemplateError(f"the chat template tried an unsafe operation and was stopped: {exc}") from None
    except TemplateError as exc:
        raise ChatTemplateError(f"the chat template failed to render: {exc}") from None
    except RecursionError:
        raise ChatTemplateError("the chat template recursed too deeply") from None
    except MemoryError:
        raise ChatTemplateError("the chat template ran out of memory") from None
    except Exception as exc:      # a template calling a filter with bad types, dividing by 0, ...
        raise ChatTemplateError(f"the chat template failed to render: {type(exc).__name__}: {exc}") from None


# ---- messages ----------------------------------------------------------------------------------
ROLES = ("system", "developer", "user", "assistant", "tool")


def check_messages(messages) -> list[dict]:
    """Validate an OpenAI-style message list; text-part lists are joined into a string (this
    runtime is text-only). Raises ChatTemplateError naming the offending message."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ChatTemplateError(f"{where} must be an object with 'role' and 'content'")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise ChatTemplateError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") not in ("text", "input_text") \
                        or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ChatTemplateError(f"{where}.content[{j}] is a {kind!r} part; only text "
                                            "parts ({'type': 'text', 'text': ...}) are supported")
                parts.append(part["text"])
            content = "".join(parts)
        elif content is None:
            if role != "assistant" or not m.get("tool_calls"):
                raise ChatTemplateError(f"{where}.content is missing: give the message text")
        elif not isinstance(content, str):
            raise ChatTemplateError(f"{where}.content must be a string or a list of text parts, "
                                    f"not {type(content).__name__}")
        msg = dict(m)
        msg["content"] = content
        out.append(msg)
    return out


def render_chat(model, messages: list[dict], add_generation_prompt: bool = True, tools=None,
                **extra) -> str:
    """Render ``messages`` with the model's template. A model without one gets an error that says
    so (run without ``--chat`` / ``chat=False``, or add a chat_template.jinja)."""
    tpl = require_template(model, tools=tools)
    tok = model.tokenizer
    return render_template(tpl, messages, bos_token=tok.bos_token, eos_token=tok.eos_token,
                           add_generation_prompt=add_generation_prompt, tools=tools, **extra)


def chat_prompt_ids(model, messages: list[dict], tools=None, **extra) -> list[int]:
    """Token ids of the rendered conversation, ready for an assistant answer. The template writes
    BOS itself when the model wants one, so no special tokens are added (as transformers'
    ``apply_chat_template(tokenize=True)``)."""
    text = render_chat(model, messages, add_generation_prompt=True, tools=tools, **extra)
    return model.tokenizer.encode(text, add_special_tokens=False)


class Conversation:
    """A system message and the (user, assistant) turns so far, kept within the model's context.

    ``prompt(user_text, reserve)`` renders the history plus the new message and drops the oldest
    turns until ``reserve`` tokens are left for the answer; ``dropped`` says how many went."""

    def __init__(self, model, system: str | None = None):
        self.model = model
        self.system = system or None
        self.turns: list[tuple[str, str]] = []

    def messages(self, user_text: str | None = None) -> list[dict]:
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        for u, a in self.turns:
            msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
        if user_text is not None:
            msgs.append({"role": "user", "content": user_text})
        return msgs

    def prompt(self, user_text: str, reserve: int) -> tuple[list[int], int]:
        """(prompt ids, turns dropped to make room). Raises ContextOverflowError when the new
        message alone (with the system message) leaves fewer than ``reserve`` tokens."""
        n_ctx = self.model.n_ctx
        reserve = max(1, min(int(reserve), n_ctx // 2))
        dropped = 0
        while True:
            ids = chat_prompt_ids(self.model, self.messages(user_text))
            if len(ids) + reserve <= n_ctx:
                return ids, dropped
            if not self.turns:
                raise ContextOverflowError(
                    f"this message takes {len(ids)} tokens with the chat template, leaving no room "
                    f"for an answer in the {n_ctx}-token context; shorten it"
                    f"{' or the system message' if self.system else ''}, or raise --ctx")
            self.turns.pop(0)
            dropped += 1

    def add(self, user_text: str, answer: str) -> None:
        self.turns.append((user_text, answer))

    def reset(self) -> None:
        self.turns.clear()
