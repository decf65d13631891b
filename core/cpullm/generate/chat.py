"""Chat templates and conversations.

The template comes from the model directory, as transformers finds it: a sidecar
``chat_template.jinja`` (what transformers 5 ``save_pretrained`` writes), else
``tokenizer_config.json`` ``chat_template`` (a string, or a list of ``{"name", "template"}``:
``tool_use`` when tools are given and it exists, else ``default``), else a processor's
``chat_template.json``.

Templates are untrusted code shipped with a checkpoint. They render in ``cpullm.generate.template_sandbox``
(jinja2's ``ImmutableSandboxedEnvironment`` with transformers' helpers and bounds on repetition,
powers, widths and output size), inside a worker process started on first use: an empty
environment, an address-space limit (RENDER_MEMORY_MB beyond its idle size) and a render time
limit (RENDER_TIMEOUT_S) after which the parent kills it and starts a fresh one for the next
render. So a hostile template costs one error, never the caller's memory, time or secrets.
Every failure is a ``ChatTemplateError`` naming the cause (``TemplateLimitError`` for the
bounds); a model whose template is refused still works for plain completion.
"""
from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..errors import ChatTemplateError, ContextOverflowError, TemplateLimitError


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
        from ..loading.locations import gguf_in_dir
        gguf = model_dir if model_dir.is_file() else (gguf_in_dir(model_dir) if model_dir.is_dir() else None)
        if gguf is not None:            # a GGUF file: the template is in its metadata
            from ..loading.gguf_file import open_gguf
            tpl = open_gguf(gguf).metadata.get("tokenizer.chat_template")
            model_dir, config = gguf, {"chat_template": tpl if isinstance(tpl, str) else None}
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


# ---- rendering, in a worker process ----------------------------------------------------------------
RENDER_TIMEOUT_S = 10.0           # real templates render in milliseconds; a runaway one is killed
RENDER_MEMORY_MB = 512            # the worker's address space beyond what it holds idle
WORKER_START_TIMEOUT_S = 60.0     # a cold interpreter start on a loaded machine
_WAIT_SLICE_S = 0.05              # how often a waiting render looks at its cancel flag
FIX = "use /v1/completions or run without --chat (plain completion), or fix the template"


class RenderCancelled(ChatTemplateError):
    """The caller gave up on a render (its client left, the server is stopping)."""


class _Worker:
    """One ``template_sandbox`` process: frames over its stdin/stdout, killed on overrun."""

    def __init__(self, memory_mb: int, cancel):
        from . import template_sandbox as sandbox

        self.memory_mb = memory_mb
        self.signalled = False
        script = Path(sandbox.__file__)
        # -I: no PYTHON* variables, no user site, not the script's folder on sys.path (it holds
        # modules named like the standard library's); an empty environment: nothing to leak.
        self.proc = subprocess.Popen([sys.executable, "-I", str(script)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env={},
                                     start_new_session=True, close_fds=True)
        try:
            self._send(sandbox.encode_frame({"path": [p for p in sys.path if p],
                                             "memory_bytes": memory_mb * 2**20,
                                             "parent": os.getpid()}),
                       time.monotonic() + WORKER_START_TIMEOUT_S, cancel)
            ready = self._receive(time.monotonic() + WORKER_START_TIMEOUT_S, cancel)
        except BaseException:
            self.kill()
            raise
        if ready is None:
            self.kill()
            raise ChatTemplateError("the chat-template worker process did not start; "
                                    f"{FIX}") from None
        if not ready.get("ok"):
            self.kill()
            raise ChatTemplateError(_jinja2_refusal(ready.get("message", "")))

    def alive(self) -> bool:
        # a worker sent SIGKILL is not alive even before the kernel has ended it: the next render
        # would otherwise reuse it and read its end-of-file as a crash
        return not self.signalled and self.proc.poll() is None

    def signal_kill(self) -> None:
        """SIGKILL only (safe from any thread): whoever renders sees end-of-file at once."""
        self.signalled = True
        if self.proc.poll() is None:
            self.proc.kill()

    def kill(self) -> None:
        """Kill, reap and close the pipes (by the thread holding the worker lock)."""
        self.signal_kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass

    def _wait(self, fileobj, writable: bool, deadline: float, cancel) -> None:
        """Until ``fileobj`` is ready; TimeoutError past ``deadline``, RenderCancelled when
        ``cancel`` is set."""
        poller = select.poll()
        poller.register(fileobj.fileno(), select.POLLOUT if writable else select.POLLIN)
        while True:
            if cancel is not None and cancel.is_set():
                raise RenderCancelled("the render was cancelled (the client left or the server is stopping)")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            if poller.poll(1000 * min(left, _WAIT_SLICE_S)):
                return

    def _send(self, frame: bytes, deadline: float, cancel) -> None:
        fd = self.proc.stdin.fileno()
        view = memoryview(frame)
        while view:
            self._wait(self.proc.stdin, True, deadline, cancel)
            try:
                n = os.write(fd, view[:65536])
            except (BrokenPipeError, BlockingIOError):
                if not self.alive():
                    raise EOFError from None
                continue
            view = view[n:]

    def _read(self, n: int, deadline: float, cancel) -> bytes | None:
        fd = self.proc.stdout.fileno()
        buf = bytearray()
        while len(buf) < n:
            self._wait(self.proc.stdout, False, deadline, cancel)
            chunk = os.read(fd, min(n - len(buf), 2**20))
            if not chunk:
                return None                     # the worker died
            buf += chunk
        return bytes(buf)

    def _receive(self, deadline: float, cancel):
        from .template_sandbox import FRAME_HEADER

        head = self._read(FRAME_HEADER.size, deadline, cancel)
        if head is None:
            return None
        body = self._read(FRAME_HEADER.unpack(head)[0], deadline, cancel)
        if body is None:
            return None
        try:
            return json.loads(body)                 # JSON, never pickle: the worker is not trusted
        except ValueError:
            return None

    def render(self, frame: bytes, timeout: float, cancel):
        """The worker's reply, or None when it died; TimeoutError / RenderCancelled as _wait."""
        deadline = time.monotonic() + timeout
        try:
            self._send(frame, deadline, cancel)
        except EOFError:
            return None
        return self._receive(deadline, cancel)


_worker: _Worker | None = None
_worker_lock = threading.Lock()


def _jinja2_refusal(problem: str) -> str:
    return (f"chat templates are refused: {problem}. Install a fixed jinja2 "
            "(pip install -U 'jinja2>=3.1.6'); until then " + FIX.split(", or fix")[0])


def stop_render_worker() -> None:
    """Kill the worker now (a render in flight fails at once); the next render starts a new one.
    The server calls this when it shuts down, so no thread waits on a template."""
    global _worker
    w = _worker
    if w is not None:
        w.signal_kill()


atexit.register(stop_render_worker)


def _acquire(cancel) -> None:
    while not _worker_lock.acquire(timeout=_WAIT_SLICE_S):
        if cancel is not None and cancel.is_set():
            raise RenderCancelled("the render was cancelled (the client left or the server is stopping)")


def _render_in_worker(frame: bytes, cancel):
    global _worker
    timeout, memory_mb = float(RENDER_TIMEOUT_S), int(RENDER_MEMORY_MB)
    _acquire(cancel)
    try:
        if _worker is None or not _worker.alive() or _worker.memory_mb != memory_mb:
            if _worker is not None:
                _worker.kill()
            _worker = None
            _worker = _Worker(memory_mb, cancel)
        worker = _worker
        try:
            reply = worker.render(frame, timeout, cancel)
        except TimeoutError:
            worker.kill()
            raise TemplateLimitError(f"the model's chat template exceeded {timeout:g} s while "
                                     f"rendering (a runaway or hostile template); {FIX}") from None
        except BaseException:
            worker.kill()                           # cancelled mid-render: stop the work too
            raise
        if reply is None:
            worker.kill()
            raise ChatTemplateError("the chat template crashed the render worker (a hostile or "
                                    f"broken template); {FIX}")
        if not reply.get("ok") and reply.get("kind") == "memory":
            worker.kill()                           # a fresh worker, not a fragmented heap
            raise TemplateLimitError(f"the model's chat template exceeded {memory_mb} MB while "
                                     f"rendering (a runaway or hostile template); {FIX}")
        return reply
    finally:
        _worker_lock.release()


def render_template(template: str, messages: list[dict], *, bos_token: str | None = None,
                    eos_token: str | None = None, add_generation_prompt: bool = True,
                    tools=None, cancel: threading.Event | None = None, **extra) -> str:
    """Render ``messages`` with ``template`` in the sandbox worker, within RENDER_TIMEOUT_S and
    RENDER_MEMORY_MB. Variables must be JSON values. ``cancel`` (an Event) stops the render when
    set. Every failure is a ChatTemplateError (TemplateLimitError for the bounds)."""
    from .template_sandbox import encode_frame, jinja2_problem

    problem = jinja2_problem()
    if problem is not None:
        raise ChatTemplateError(_jinja2_refusal(problem))
    variables = dict(extra, messages=messages, bos_token=bos_token or "", eos_token=eos_token or "",
                     add_generation_prompt=add_generation_prompt, tools=tools)
    try:
        frame = encode_frame({"template": template, "variables": variables})
    except (TypeError, ValueError) as exc:
        raise ChatTemplateError(f"chat template variables must be JSON values (text, numbers, "
                                f"lists, objects): {exc}") from None
    reply = _render_in_worker(frame, cancel)
    if not reply.get("ok"):
        kind, message = reply.get("kind"), str(reply.get("message", "the chat template failed"))
        if kind == "setup":
            raise ChatTemplateError(_jinja2_refusal(message))
        raise ChatTemplateError(message)
    text = reply.get("text")
    if not isinstance(text, str):
        raise ChatTemplateError(f"the render worker answered nonsense; {FIX}")
    return text


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


def apply_chat_template(model, messages: list[dict], tools=None, add_generation_prompt: bool = True,
                        tokenize: bool = False, **extra):
    """transformers' ``tokenizer.apply_chat_template`` for a loaded model (``model.tokenizer``
    has it bound): the rendered text, or with ``tokenize`` its token ids (no special tokens
    added: the template writes them). Messages are checked as the server checks them; a tool
    call's ``arguments`` may be a JSON string (OpenAI's form) or an object."""
    from ..toolcalls import formats_of, messages_for_template

    msgs = arguments_as_objects(check_messages(messages))
    fmt, _ = formats_of(model, require_template(model, tools=tools))
    if fmt is not None and not fmt.in_template:
        msgs, tools = messages_for_template(msgs, tools, fmt), None
    text = render_chat(model, msgs, add_generation_prompt=add_generation_prompt, tools=tools, **extra)
    return model.tokenizer.encode(text, add_special_tokens=False) if tokenize else text


def arguments_as_objects(messages: list[dict]) -> list[dict]:
    """Earlier assistant calls with their ``arguments`` as objects (OpenAI sends JSON text;
    templates write the object with ``tojson``)."""
    out = []
    for m in messages:
        if m.get("role") == "assistant" and isinstance(m.get("tool_calls"), list):
            calls = []
            for tc in m["tool_calls"]:
                if isinstance(tc, dict) and isinstance(tc.get("function"), dict):
                    fn = dict(tc["function"])
                    if isinstance(fn.get("arguments"), str):
                        try:
                            fn["arguments"] = json.loads(fn["arguments"])
                        except ValueError:
                            pass
                    tc = dict(tc, function=fn)
                calls.append(tc)
            m = dict(m, tool_calls=calls)
        out.append(m)
    return out


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
