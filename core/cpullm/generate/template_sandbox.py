"""The chat-template sandbox, and the worker process that renders in it.

A chat template is code shipped with a checkpoint, so it runs twice removed from the runtime:

1. In jinja2's ``ImmutableSandboxedEnvironment`` (no ``_``-prefixed attributes, no internal
   attributes of functions, frames or types, no mutation of lists and dicts, bounded ``range``),
   with the helpers transformers provides (``raise_exception``, ``strftime_now``, the ``tojson``
   filter, the ``{% generation %}`` tag, ``loopcontrols``). Reaching for an internal attribute
   stops the render at once. Repetition (``*``), powers, integer arguments to calls and filters,
   format widths (also the ones ``str.format`` expands from nested fields and ``%*d`` takes from
   its arguments) and the rendered size are bounded, so the common bombs get a precise message.
2. In a separate process (``cpullm.generate.chat`` starts this file as ``python -I template_sandbox.py``)
   with an address-space limit, no environment variables, no command-line arguments, and a
   parent that kills it when a render overruns its time: whatever the sandbox misses (a loop of
   10^10 steps, a string doubled 40 times) costs that process, never the server.

jinja2 older than 3.1.6 is refused: 3.1.5's sandbox has a known escape (CVE-2025-27516, through
the ``attr`` filter and ``str.format``) and 3.1.4 lacks the ``wrap_str_format`` hook the width
guard overrides, so the guard would silently never run.

This module imports only the standard library and jinja2 (the worker starts without numpy or
numba). Wire format between parent and worker: frames of an 8-byte big-endian length and an
ASCII JSON object.
"""
from __future__ import annotations

import datetime
import functools
import json
import operator
import os
import re
import struct
import sys
import threading

MIN_JINJA2 = (3, 1, 6)
MAX_RENDERED_CHARS = 8 * 2**20        # a rendered prompt longer than this is a runaway template
MAX_REPEAT = 2**20                    # 'x' * n / [..] * n / widths: at most this many items or characters
MAX_POWER_BITS = 4096                 # a ** b: the result's size
FRAME_HEADER = struct.Struct(">Q")


class SandboxError(Exception):
    """A template failed in the sandbox; ``kind`` tells the parent which error to raise."""
    kind = "template"


class Rejected(SandboxError):
    """The template called ``raise_exception`` (it refuses the conversation)."""
    kind = "rejected"


# ---- the installed jinja2 -------------------------------------------------------------------------
def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for p in text.split(".")[:3]:
        digits = re.match(r"\d+", p)
        parts.append(int(digits.group()) if digits else 0)
    return tuple(parts)


def jinja2_problem() -> str | None:
    """Why the installed jinja2 must not render untrusted templates, or None when it may."""
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:
        return f"jinja2 is not importable ({exc})"
    version = getattr(jinja2, "__version__", "0")
    if _version_tuple(version) < MIN_JINJA2:
        return (f"jinja2 {version} is installed and its sandbox has a known escape "
                "(CVE-2025-27516; older releases also lack the str.format hook cpullm's width "
                "guard needs)")
    if not hasattr(ImmutableSandboxedEnvironment, "wrap_str_format"):
        return (f"jinja2 {version} has no SandboxedEnvironment.wrap_str_format, the hook cpullm's "
                "format-width guard overrides")
    return None


# ---- bounds -----------------------------------------------------------------------------------------
def _raise_exception(message="the template raised an error"):
    raise Rejected(f"the model's chat template rejected the conversation: {message}")


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
                raise SandboxError(f"the chat template tried to build a sequence of "
                                   f"{_length(seq) * n} items (limit {MAX_REPEAT})")
    return operator.mul(left, right)


def _bounded_pow(left, right):
    if isinstance(left, int) and isinstance(right, int) and right > 0 and \
            abs(left) > 1 and right * abs(left).bit_length() > MAX_POWER_BITS:
        raise SandboxError("the chat template tried to compute an enormous power")
    return operator.pow(left, right)


_PERCENT_WIDTH = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(?:\d{7,}|\d*\.\d{7,})")
_PERCENT_STAR = re.compile(r"%[-#0 +]*(?:\*|\d*\.\*)")
_BRACE_WIDTH = re.compile(r"\{[^{}]*:[^{}]*\d{7,}[^{}]*\}")
_DIGIT_RUN = re.compile(r"\d+")
WIDTH_ERROR = "the chat template used a format width over a million characters"


def _check_args(args, kwargs) -> None:
    """No call from a template gets an integer over MAX_REPEAT ('x'.ljust(10**10), center(...))."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_REPEAT:
            raise SandboxError(f"the chat template passed {a} to a function (limit {MAX_REPEAT})")


def _check_format(fmt, brace: bool) -> None:
    if isinstance(fmt, str) and (_BRACE_WIDTH if brace else _PERCENT_WIDTH).search(fmt):
        raise SandboxError(WIDTH_ERROR)


def _check_percent(fmt, values) -> None:
    """``fmt % values``: the format's own widths, and ``*`` widths taken from ``values``."""
    _check_format(fmt, brace=False)
    if isinstance(fmt, str) and _PERCENT_STAR.search(fmt):
        items = values if isinstance(values, tuple) else (values,)
        if any(isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_REPEAT for v in items):
            raise SandboxError(WIDTH_ERROR)


def _check_spec(spec: str) -> None:
    """A ``str.format`` field's spec after nested fields were expanded ('{0:{1}}' with '9999999')."""
    if any(len(run) > 6 and int(run) > MAX_REPEAT for run in _DIGIT_RUN.findall(spec)):
        raise SandboxError(WIDTH_ERROR)


def _bounded_filter(f):
    skip = 2 if getattr(f, "jinja_pass_arg", None) is not None else 1   # (context,) value, args

    @functools.wraps(f)
    def bounded(*args, **kwargs):
        _check_args(args[skip:], kwargs)
        return f(*args, **kwargs)
    return bounded


def _format_filter(fmt):
    """The ``format`` filter: its arguments are values, so only the format string (and ``*``
    widths) are checked."""
    @functools.wraps(fmt)
    def bounded(value, *args, **kwargs):
        _check_percent(value, args)
        return fmt(value, *args, **kwargs)
    return bounded


@functools.lru_cache(maxsize=1)
def environment():
    """The sandboxed jinja2 environment with transformers' helpers and the bounds above."""
    problem = jinja2_problem()
    if problem is not None:
        raise RuntimeError(problem)
    from jinja2 import nodes
    from jinja2.exceptions import SecurityError
    from jinja2.ext import Extension
    from jinja2.sandbox import (ImmutableSandboxedEnvironment, SandboxedEscapeFormatter,
                                SandboxedFormatter)
    from markupsafe import Markup

    class SpecCheck:
        def format_field(self, value, format_spec):
            _check_spec(format_spec)
            return super().format_field(value, format_spec)

    class BoundedFormatter(SpecCheck, SandboxedFormatter):
        pass

    class BoundedEscapeFormatter(SpecCheck, SandboxedEscapeFormatter):
        pass

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
            """'str'.format / format_map: jinja's sandboxed field lookup, plus a bound on every
            field's width and precision after nested fields are expanded."""
            if super().wrap_str_format(value) is None:     # not a str's format method
                return None
            text = value.__self__
            _check_format(text, brace=True)
            formatter = (BoundedEscapeFormatter(self, escape=text.escape) if isinstance(text, Markup)
                         else BoundedFormatter(self))
            is_map = value.__name__ == "format_map"

            def bounded_format(*args, **kwargs):
                if is_map:
                    if kwargs or len(args) != 1:
                        raise TypeError("format_map() takes exactly one mapping")
                    args, kwargs = (), args[0]
                return type(text)(formatter.vformat(text, args, kwargs))
            return bounded_format

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
                _check_percent(left, right)
            return super().call_binop(context, op, left, right)

    env = Env(trim_blocks=True, lstrip_blocks=True,
              extensions=["jinja2.ext.loopcontrols", GenerationTag])
    env.filters["tojson"] = _tojson
    for name, f in list(env.filters.items()):
        env.filters[name] = _bounded_filter(f)
    env.filters["format"] = _format_filter(env.filters["format"].__wrapped__)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    from jinja2 import TemplateError
    try:
        return environment().from_string(template)
    except TemplateError as exc:
        raise SandboxError(f"the model's chat template is not valid jinja: {exc}") from None


def render(template: str, variables: dict) -> str:
    """Render in this process's sandbox. Raises SandboxError (a template fault, with the message
    for the user) or MemoryError."""
    from jinja2 import TemplateError
    from jinja2.exceptions import SecurityError

    tpl = _compile(template)
    try:
        out, size = [], 0
        for chunk in tpl.generate(**variables):
            size += len(chunk)
            if size > MAX_RENDERED_CHARS:
                raise SandboxError(f"the chat template produced more than {MAX_RENDERED_CHARS} "
                                   "characters; it is broken or hostile")
            out.append(chunk)
        return "".join(out)
    except (SandboxError, MemoryError):
        raise
    except SecurityError as exc:
        raise SandboxError(f"the chat template tried an unsafe operation and was stopped: {exc}") from None
    except TemplateError as exc:
        raise SandboxError(f"the chat template failed to render: {exc}") from None
    except RecursionError:
        raise SandboxError("the chat template recursed too deeply") from None
    except Exception as exc:      # a template calling a filter with bad types, dividing by 0, ...
        raise SandboxError(f"the chat template failed to render: {type(exc).__name__}: {exc}") from None


# ---- the worker process -------------------------------------------------------------------------------
def encode_frame(obj) -> bytes:
    body = json.dumps(obj, ensure_ascii=True, separators=(",", ":")).encode("ascii")
    return FRAME_HEADER.pack(len(body)) + body


def _read_exact(stream, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = stream.read(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def _read_frame(stream):
    (n,) = FRAME_HEADER.unpack(_read_exact(stream, FRAME_HEADER.size))
    return json.loads(_read_exact(stream, n))


def _vm_bytes(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _limit_resources(memory_bytes: int) -> None:
    """Address space and data segment: what the worker holds now plus ``memory_bytes``; no
    files written, no core dumps, no child processes."""
    import resource

    def cap(which, value):
        try:
            soft, hard = resource.getrlimit(which)
            if hard != resource.RLIM_INFINITY:
                value = min(value, hard)
            resource.setrlimit(which, (value, value))
        except (ValueError, OSError):
            pass
    cap(resource.RLIMIT_AS, _vm_bytes("VmSize") + memory_bytes)
    cap(resource.RLIMIT_DATA, _vm_bytes("VmData") + memory_bytes)
    cap(resource.RLIMIT_FSIZE, 0)
    cap(resource.RLIMIT_CORE, 0)
    cap(resource.RLIMIT_NPROC, 0)


def _exit_with_parent(parent: int) -> None:
    """The worker ends when the process that started it is gone, even mid-render."""
    import time

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)
    threading.Thread(target=watch, daemon=True).start()


def worker_main() -> None:
    """Serve render requests on stdin/stdout until stdin closes.

    First frame in: ``{"path": [...], "memory_bytes": N, "parent": pid}``; first frame out:
    ``{"ok": true, "jinja2": version}`` or ``{"ok": false, "kind": "setup", "message"}``.
    Then each ``{"template", "variables"}`` gets ``{"ok": true, "text"}`` or
    ``{"ok": false, "kind", "message"}``."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)        # the parent decides when this ends
    stdin = sys.stdin.buffer
    stdout = sys.stdout.buffer
    sys.stdout = sys.stderr                             # nothing but frames on the pipe
    init = _read_frame(stdin)
    sys.path[:0] = [p for p in init.get("path", []) if isinstance(p, str)]
    problem = jinja2_problem()
    if problem is not None:
        stdout.write(encode_frame({"ok": False, "kind": "setup", "message": problem}))
        stdout.flush()
        return
    import jinja2
    render("{{ messages|tojson }}{{ 'a'|wordwrap(3)|center(5)|indent(2) }}{{ lipsum(1) }}{{ '%d'|format(1) }}",
           {"messages": []})                            # import everything rendering needs, now
    _exit_with_parent(int(init.get("parent", os.getppid())))
    _limit_resources(int(init["memory_bytes"]))
    stdout.write(encode_frame({"ok": True, "jinja2": jinja2.__version__}))
    stdout.flush()
    while True:
        try:
            request = _read_frame(stdin)
        except EOFError:
            return
        try:
            reply = {"ok": True, "text": render(request["template"], request["variables"])}
        except SandboxError as exc:
            reply = {"ok": False, "kind": exc.kind, "message": str(exc)}
        except MemoryError:
            reply = {"ok": False, "kind": "memory", "message": "out of memory"}
        try:
            frame = encode_frame(reply)
        except MemoryError:
            frame = encode_frame({"ok": False, "kind": "memory", "message": "out of memory"})
        stdout.write(frame)
        stdout.flush()


if __name__ == "__main__":
    worker_main()
