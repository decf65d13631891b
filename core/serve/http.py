"""An OpenAI-compatible HTTP server for one model (``cpullm serve``), built on starlette + uvicorn.

Endpoints: ``GET /v1/models`` (and ``/v1/models/{id}``), ``POST /v1/chat/completions``,
``POST /v1/completions`` (both streaming as server-sent events ending in ``data: [DONE]``, or
not), ``GET /health`` and ``GET /`` (a small chat page, ``cpullm/serve/static``).

How requests run: the event loop reads and validates each request, renders and tokenizes the
prompt in a worker thread, then hands a *job* to the engine. The engine owns the model's
scheduler (cpullm.scheduler), on its own thread: up to ``parallel`` jobs run at once, each decode
step advancing all of them in one pass over the weights, long prompts prefilled a chunk at a
time between those steps; the rest wait in arrival order. KV memory for ``parallel`` sequences
of the whole context is allocated at start and reported by ``/health``. Pieces of text flow back
to the request's coroutine through an asyncio queue. A client that disconnects (streaming or
not) sets its job's cancel flag: its sequence leaves at the next step and frees its slot.
At most ``max_queue`` jobs wait; more get 503.

Bounds: an answer is at most ``max_tokens_cap`` tokens (an omitted ``max_tokens`` means the cap,
not the rest of the context; a larger one is cut with finish_reason "length") and
``request_timeout`` seconds of generation (then it ends the same way). A client has
``header_timeout`` seconds to send its request line and headers (else the connection closes; a
custom uvicorn protocol, since uvicorn bounds only idle keep-alive connections) and
``body_timeout`` seconds for its body (else 408). Chat templates render in a worker process with
their own time and memory limits (``cpullm.chat``); a client that leaves during the render stops
it. ``/health`` and ``/v1/models`` report the limits. Lone UTF-16 surrogates anywhere in a body,
and sampling values that would overflow the sampler (a temperature under 1e-3 other than 0), are
400s. On SIGINT/SIGTERM the engine stops first: the running generation and every waiting request
end with the 503 ``server_shutting_down`` error (a stream gets it as its last event).

Sampling defaults for fields a request omits: OpenAI's (temperature 1, top_p 1), overridden by
the checkpoint's generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty).
Extensions accepted beside OpenAI's fields: ``top_k``, ``min_p``, ``repetition_penalty``,
``chat_template_kwargs`` (e.g. ``{"enable_thinking": false}``). ``tools`` are passed to the chat
template; tool calls come back as plain text.

Errors are OpenAI-shaped JSON: ``{"error": {"message", "type", "param", "code"}}``. With an API
key, every ``/v1/`` request needs ``Authorization: Bearer KEY`` (compared in constant time); the
page and ``/health`` stay open (they reveal nothing and run nothing). Bound to loopback, the
server also refuses Host headers that are not loopback names (DNS rebinding), and POST bodies must
be ``application/json`` (so a web page elsewhere cannot post to it without a CORS preflight,
which this server never grants).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import math
import sys
import threading
import time
import traceback
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

from ..errors import (ChatTemplateError, ConfigError, ContextOverflowError, CpullmError,
                     SamplingError, ServerRequestError)
from ..generate import GenerationStats
from ..limits import one_line

STATIC_DIR = Path(__file__).parent / "static"
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20
DEFAULT_MAX_QUEUE = 64
DEFAULT_MAX_TOKENS_CAP = 1024         # longest answer per request; an omitted max_tokens gets this
DEFAULT_REQUEST_TIMEOUT_S = 300.0     # generation time per request: 1024 tokens at ~4 tok/s (a 4B model)
DEFAULT_HEADER_TIMEOUT_S = 10.0       # to send a request's line and headers
DEFAULT_BODY_TIMEOUT_S = 30.0         # to send its body (4 MiB at ~140 KB/s)
MIN_TEMPERATURE = 1e-3                # logits / T must stay finite: 3.4e38 (float32 max) / 1e-3 is
MAX_REPETITION_PENALTY = 1e3          # ... and so must penalized ones (x * 1e3, x / 1e-3)
MAX_STOP = 16
LOOPBACK_NAMES = {"127.0.0.1", "localhost", "::1", "[::1]"}
PAGE_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; connect-src 'self'; "
            "img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")


class ApiError(ServerRequestError):
    """A request error with the OpenAI error fields (``type``, ``param``, ``code``)."""

    def __init__(self, message: str, status: int = 400, code: str | None = None,
                 param: str | None = None, type: str | None = None):
        super().__init__(one_line(message, 500), status, code or "invalid_request_error")
        self.param = param
        self.openai_code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")


def _quoted(value) -> str:
    """A client's value quoted in an error message: JSON, one line, at most 80 characters."""
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError, RecursionError):
        text = repr(type(value))
    return one_line(text, 80)


def error_body(exc: Exception) -> tuple[int, dict]:
    """(HTTP status, OpenAI error object) for any exception."""
    if isinstance(exc, ApiError):
        status, typ, param, code = exc.status, exc.type, exc.param, exc.openai_code
    elif isinstance(exc, ServerRequestError):
        status, param = exc.status, None
        typ = "invalid_request_error" if status < 500 else "server_error"
        code = exc.code
    elif isinstance(exc, ContextOverflowError):
        status, typ, param, code = 400, "invalid_request_error", "messages", "context_length_exceeded"
    elif isinstance(exc, ChatTemplateError):
        status, typ, param, code = 400, "invalid_request_error", "messages", "chat_template_error"
    elif isinstance(exc, SamplingError):
        status, typ, param, code = 400, "invalid_request_error", None, "invalid_value"
    elif isinstance(exc, CpullmError):
        status, typ, param, code = 400, "invalid_request_error", None, None
    else:
        return 500, {"error": {"message": f"internal server error ({type(exc).__name__}); "
                                          "the server log has the details",
                               "type": "server_error", "param": None, "code": None}}
    return status, {"error": {"message": str(exc), "type": typ, "param": param, "code": code}}


def _json_bytes(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


# ---- the engine: one model, one generation at a time ----------------------------------------------
class Job:
    """One generation: prompt ids, limits, sampling; a cancel flag; text pieces out via ``emit``."""

    def __init__(self, ids: list[int], max_tokens: int, sampling: dict, stop: list[str],
                 time_limit: float | None = None):
        self.ids = ids
        self.max_tokens = max_tokens
        self.sampling = sampling
        self.stop = stop
        self.time_limit = time_limit      # seconds of generation, from when the engine takes it
        self.timed_out = False
        self.abort: Exception | None = None    # set with cancel: the error the client gets
        self.cancel = threading.Event()
        self.stats = GenerationStats()
        self.finished = threading.Event()
        self._emit = None

    def emit(self, item) -> None:
        try:
            self._emit(item)
        except RuntimeError:        # the event loop is gone (server shutting down)
            self.cancel.set()


class Engine:
    """Owns the model's scheduler (:class:`cpullm.engine.Engine`): up to ``parallel`` jobs decode
    together, sharing each pass over the weights; the others wait in arrival order (at most
    ``max_queue``; more get 503). Text pieces (stop strings applied) go back through each job's
    emit; a job's cancel flag is its sequence's, so a client that leaves frees its slot at the
    next step."""

    def __init__(self, model, max_queue: int = DEFAULT_MAX_QUEUE, parallel: int | None = None,
                 prefill_chunk: int | None = None, prefix_cache_bytes: int | None = None):
        from ..engine import Engine as CoreEngine
        self.model = model
        self.max_queue = max_queue
        self.core = CoreEngine(model, parallel, prefill_chunk, prefix_cache_bytes)
        self.parallel = self.core.parallel
        self._lock = threading.Lock()
        self._closed = False
        self._jobs: set = set()
        self.counters = {"requests": 0, "completed": 0, "cancelled": 0, "failed": 0,
                         "timed_out": 0, "generated_tokens": 0}

    def submit(self, job: Job, loop: asyncio.AbstractEventLoop) -> "asyncio.Queue":
        from ..generate import TextStream
        out: asyncio.Queue = asyncio.Queue()
        job._emit = lambda item: loop.call_soon_threadsafe(out.put_nowait, item)
        with self._lock:
            if self._closed:
                raise _shutting_down()
            if self.core.scheduler.counts()["waiting"] >= self.max_queue:
                raise ApiError(f"the server is busy ({self.max_queue} requests are already waiting); "
                               "retry in a moment", 503, "server_overloaded")
            self.counters["requests"] += 1
        text = TextStream(self.model.tokenizer, job.stop)
        job.ended_by = None              # "stop" (a stop string) or "timeout", set on the engine thread
        job.deadline = None

        def on_token(tok):               # on the scheduler's thread
            if tok is None:
                self._finish(job, text)
                return
            if job.ended_by is not None or job.cancel.is_set():
                return
            if job.deadline is None and job.time_limit is not None:
                job.deadline = time.monotonic() - job.stats.prefill_s + job.time_limit
            piece = text.push(tok)
            if piece:
                job.emit(("piece", piece))
            if text.stopped:
                job.ended_by = "stop"
            elif job.deadline is not None and time.monotonic() > job.deadline:
                job.ended_by = "timeout"
            if job.ended_by is not None:
                job.cancel.set()         # frees the slot at the next step

        try:
            self.core.submit(job.ids, job.max_tokens, stats=job.stats, cancel=job.cancel,
                             on_token=on_token, **job.sampling)
        except Exception:
            with self._lock:
                self.counters["failed"] += 1
            raise
        with self._lock:
            self._jobs.add(job)
        return out

    def _finish(self, job: Job, text) -> None:
        st = job.stats
        if job.abort is not None:
            outcome = "cancelled"
            job.emit(("error", job.abort))
        elif st.stop_reason == "error":
            outcome = "failed"
            job.emit(("error", RuntimeError("the generation failed (see the server log)")))
        elif st.stop_reason == "cancelled" and job.ended_by is None:
            outcome = "cancelled"
            job.emit(("done", None))
        else:
            outcome = "completed"
            if job.ended_by == "timeout":
                outcome, job.timed_out, st.stop_reason = "timed_out", True, "length"
            elif job.ended_by == "stop":
                st.stop_reason = "stop"
            else:
                piece = text.flush()
                if piece:
                    job.emit(("piece", piece))
                if text.stopped:
                    st.stop_reason = "stop"
            job.emit(("done", None))
        with self._lock:
            self.counters[outcome] += 1
            self.counters["generated_tokens"] += st.generated_tokens
            self._jobs.discard(job)
        job.finished.set()

    def count_left_early(self) -> None:
        """A request whose client left before it reached the engine (during its render)."""
        with self._lock:
            self.counters["requests"] += 1
            self.counters["cancelled"] += 1

    def snapshot(self) -> dict:
        c = self.core.scheduler.counts()
        sch = self.core.scheduler
        with self._lock:
            return {**self.counters, "queued": c["waiting"], "active": c["running"],
                    "parallel": self.parallel, "kv_bytes_per_stream": sch.slot_bytes,
                    "kv_bytes_planned": sch.kv_bytes, "prefix_cache": self.core.prefix_stats()}

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Refuse new jobs; the running ones and every waiting one end with a 503 error."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            jobs = list(self._jobs)
        for job in jobs:
            job.abort = _shutting_down()
            job.cancel.set()
        self.core.close()


def _shutting_down() -> ApiError:
    return ApiError("the server is shutting down; retry on another instance or once it is back",
                    503, "server_shutting_down")


async def _pieces(out: asyncio.Queue, job: Job):
    """Async iterator over a job's text pieces; raises the job's error; cancels it when left early."""
    try:
        while True:
            kind, data = await out.get()
            if kind == "piece":
                yield data
            elif kind == "error":
                raise data
            else:
                return
    finally:
        job.cancel.set()


# ---- request parsing ---------------------------------------------------------------------------------
class RequestSpec:
    def __init__(self, kind, ids, max_tokens, sampling, stop, stream, include_usage):
        self.kind, self.ids, self.max_tokens = kind, ids, max_tokens
        self.sampling, self.stop = sampling, stop
        self.stream, self.include_usage = stream, include_usage


def _number(body: dict, key: str, default, lo=None, hi=None, lo_open=False, hi_open=False):
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ApiError(f"{key} must be a number, got {_quoted(v)}", param=key, code="invalid_type")
    if lo is not None and (v <= lo if lo_open else v < lo) or hi is not None and (v >= hi if hi_open else v > hi):
        rng = f"{'(' if lo_open else '['}{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}{')' if hi_open else ']'}"
        raise ApiError(f"{key} must be in {rng}, got {v}", param=key, code="invalid_value")
    return float(v)


def _integer(body: dict, key: str, default, lo=None):
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise ApiError(f"{key} must be an integer, got {_quoted(v)}", param=key, code="invalid_type")
    if lo is not None and v < lo:
        raise ApiError(f"{key} must be >= {lo}, got {v}", param=key, code="invalid_value")
    return int(v)


def _boolean(body: dict, key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(f"{key} must be true or false, got {_quoted(v)}", param=key, code="invalid_type")
    return v


def _unsupported(body: dict, key: str, allowed, why: str) -> None:
    v = body.get(key)
    if v is not None and v not in allowed:
        raise ApiError(f"{key}={_quoted(v)} is not supported by this server: {why}", param=key,
                       code="unsupported_parameter")


def _check_sampling_value(key: str, v: float) -> None:
    """Values inside the documented ranges that still break the sampler's arithmetic."""
    if key == "temperature" and 0.0 < v < MIN_TEMPERATURE:
        raise ApiError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {v:g} "
                       "(smaller values overflow the sampler)", param=key, code="invalid_value")
    if key == "repetition_penalty" and not 1 / MAX_REPETITION_PENALTY <= v <= MAX_REPETITION_PENALTY:
        raise ApiError(f"repetition_penalty must be in [{1 / MAX_REPETITION_PENALTY:g}, "
                       f"{MAX_REPETITION_PENALTY:g}] (1 = off), got {v:g}", param=key, code="invalid_value")


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")            # C speed; only lone surrogates fail
        return False
    except UnicodeEncodeError:
        return True


def _surrogate_path(obj, where: str = "") -> str | None:
    """Where in a parsed JSON body a string holds a lone UTF-16 surrogate ("\\ud800"), which
    no tokenizer can encode; None when there is none. Iterative: bodies nest deeply."""
    stack = [(obj, where)]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if _has_surrogate(value):
                return path or "the body"
        elif isinstance(value, dict):
            for k, v in value.items():
                if _has_surrogate(k):
                    return f"{path}.{k!a}" if path else f"key {k!a}"
                stack.append((v, f"{path}.{k}" if path else k))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(value))
    return None


class Api:
    def __init__(self, model, model_id: str, engine: Engine,
                 max_tokens_cap: int = DEFAULT_MAX_TOKENS_CAP,
                 request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT_S):
        self.model = model
        self.model_id = model_id
        self.engine = engine
        self.max_tokens_cap = max_tokens_cap
        self.request_timeout = request_timeout
        self.created = int(time.time())
        self.fingerprint = f"cpullm-{_version()}-{model.quant}"
        self.vocab = int(model.program.meta.get("vocab", model.tokenizer.vocab_size))
        gc = model.config.get("_generation_config") or {}
        self.defaults = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                         "repetition_penalty": 1.0}
        for k in self.defaults:
            v = gc.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                try:
                    _check_sampling_value(k, float(v))
                except ApiError:
                    continue                        # the checkpoint's value would break sampling
                self.defaults[k] = type(self.defaults[k])(v)

    # -- shared fields
    def _check_common(self, body: dict) -> None:
        m = body.get("model")
        if m is not None:
            if not isinstance(m, str):
                raise ApiError(f"model must be a string, got {_quoted(m)}", param="model", code="invalid_type")
            if m != self.model_id:
                raise ApiError(f"The model `{m}` does not exist: this server runs `{self.model_id}` "
                               "(GET /v1/models lists it)", 404, "model_not_found", "model")
        _unsupported(body, "n", (1,), "one choice per request (send several requests)")
        _unsupported(body, "best_of", (1,), "one choice per request")
        _unsupported(body, "logprobs", (False, 0), "log-probabilities are not returned")
        _unsupported(body, "top_logprobs", (0,), "log-probabilities are not returned")
        _unsupported(body, "presence_penalty", (0, 0.0), "use repetition_penalty instead")
        _unsupported(body, "frequency_penalty", (0, 0.0), "use repetition_penalty instead")
        lb = body.get("logit_bias")
        if lb not in (None, {}):
            raise ApiError("logit_bias is not supported by this server", param="logit_bias",
                           code="unsupported_parameter")
        rf = body.get("response_format")
        if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
            raise ApiError("response_format other than {\"type\": \"text\"} is not supported by this "
                           "server (no constrained decoding)", param="response_format",
                           code="unsupported_parameter")

    def _sampling(self, body: dict) -> dict:
        d = self.defaults
        seed = _integer(body, "seed", None)
        out = {
            "temperature": _number(body, "temperature", d["temperature"], 0.0, 2.0),
            "top_p": _number(body, "top_p", d["top_p"], 0.0, 1.0, lo_open=True),
            "top_k": _integer(body, "top_k", d["top_k"], 0),
            "min_p": _number(body, "min_p", d["min_p"], 0.0, 1.0, hi_open=True),
            "repetition_penalty": _number(body, "repetition_penalty", d["repetition_penalty"], 0.0,
                                          lo_open=True),
            "seed": None if seed is None else seed & (2**64 - 1),
        }
        _check_sampling_value("temperature", out["temperature"])
        _check_sampling_value("repetition_penalty", out["repetition_penalty"])
        return out

    def _stop(self, body: dict) -> list[str]:
        stop = body.get("stop")
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ApiError("stop must be a string or a list of strings", param="stop", code="invalid_type")
        if len(stop) > MAX_STOP:
            raise ApiError(f"stop takes at most {MAX_STOP} strings, got {len(stop)}", param="stop",
                           code="invalid_value")
        return [s for s in stop if s]

    def _max_tokens(self, body: dict, n_prompt: int, prompt_param: str) -> int:
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        n = _integer(body, key, None, 1)
        n_ctx = self.model.n_ctx
        room = n_ctx - n_prompt
        if room <= 0:
            raise ApiError(f"This model's maximum context length is {n_ctx} tokens, but the "
                           f"{prompt_param} take {n_prompt} tokens; shorten them (or restart the "
                           "server with a larger --ctx)", 400, "context_length_exceeded", prompt_param)
        if n is None:
            return min(room, self.max_tokens_cap)
        if n > room:
            raise ApiError(f"This model's maximum context length is {n_ctx} tokens; you requested "
                           f"{n_prompt + n} tokens ({n_prompt} in the {prompt_param}, {n} in the "
                           f"completion): lower {key} to at most {room} or shorten the {prompt_param}",
                           400, "context_length_exceeded", key)
        return min(n, self.max_tokens_cap)        # over the cap: finish_reason "length"

    def _stream_flags(self, body: dict) -> tuple[bool, bool]:
        stream = _boolean(body, "stream", False)
        so = body.get("stream_options")
        include_usage = False
        if so is not None:
            if not isinstance(so, dict):
                raise ApiError("stream_options must be an object", param="stream_options", code="invalid_type")
            include_usage = _boolean(so, "include_usage", False)
        return stream, include_usage

    # -- endpoint-specific parsing (runs in a worker thread: rendering and tokenizing cost CPU)
    def prepare_chat(self, body: dict, cancel: threading.Event | None = None) -> RequestSpec:
        from ..chat import RenderCancelled, check_messages, chat_prompt_ids

        self._check_common(body)
        if "messages" not in body:
            raise ApiError("messages is required: a list of {role, content} objects", param="messages",
                           code="missing_required_parameter")
        try:
            messages = check_messages(body["messages"])
        except ChatTemplateError as exc:
            raise ApiError(str(exc), param="messages", code="invalid_value") from None
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise ApiError("tools must be a list", param="tools", code="invalid_type")
        extra = body.get("chat_template_kwargs") or {}
        if not isinstance(extra, dict):
            raise ApiError("chat_template_kwargs must be an object", param="chat_template_kwargs",
                           code="invalid_type")
        extra = {k: v for k, v in extra.items() if isinstance(k, str) and k.isidentifier() and
                 k not in ("messages", "tools", "bos_token", "eos_token", "add_generation_prompt",
                           "cancel")}
        stream, include_usage = self._stream_flags(body)
        sampling, stop = self._sampling(body), self._stop(body)
        try:
            ids = chat_prompt_ids(self.model, messages, tools=tools, cancel=cancel, **extra)
        except RenderCancelled:
            raise
        except ChatTemplateError as exc:
            raise ApiError(str(exc), param="messages", code="chat_template_error") from None
        if not ids:
            raise ApiError("the chat template rendered an empty prompt", param="messages")
        max_tokens = self._max_tokens(body, len(ids), "messages")
        return RequestSpec("chat", ids, max_tokens, sampling, stop, stream, include_usage)

    def prepare_completion(self, body: dict, cancel: threading.Event | None = None) -> RequestSpec:
        self._check_common(body)
        _unsupported(body, "echo", (False,), "the prompt is not echoed")
        _unsupported(body, "suffix", ("",), "no fill-in-the-middle")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]                                  # a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise ApiError("prompt is empty: give some text", param="prompt", code="invalid_value")
            ids = self.model.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.vocab]
            if bad:
                raise ApiError(f"prompt token ids must be in [0, {self.vocab}), got {bad[0]}",
                               param="prompt", code="invalid_value")
            ids = list(prompt)
        elif prompt is None:
            raise ApiError("prompt is required: a string (or a list of token ids)", param="prompt",
                           code="missing_required_parameter")
        elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
            raise ApiError("batched prompts are not supported: send one request per prompt",
                           param="prompt", code="unsupported_parameter")
        else:
            raise ApiError("prompt must be a non-empty string or a list of token ids", param="prompt",
                           code="invalid_type")
        stream, include_usage = self._stream_flags(body)
        sampling, stop = self._sampling(body), self._stop(body)
        max_tokens = self._max_tokens(body, len(ids), "prompt")
        return RequestSpec("completion", ids, max_tokens, sampling, stop, stream, include_usage)

    # -- responses
    def finish_reason(self, stats: GenerationStats) -> str:
        return "length" if stats.stop_reason == "length" else "stop"

    @staticmethod
    def usage(stats: GenerationStats, spec: RequestSpec) -> dict:
        p, c = len(spec.ids), stats.generated_tokens
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _version() -> str:
    from .. import __version__
    return __version__


# ---- ASGI plumbing --------------------------------------------------------------------------------
def _host_name(host_header: str) -> str:
    h = host_header.strip().lower()
    if h.startswith("["):
        return h[: h.find("]") + 1] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


async def _send_json(send, status: int, obj, headers=()) -> None:
    body = _json_bytes(obj)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


class Guard:
    """Pure ASGI middleware: Host check (loopback servers), bearer API key on /v1/, a last-resort
    JSON 500, and ``nosniff`` on every response."""

    def __init__(self, app, api_key: str | None, allowed_hosts: set[str] | None, engine=None):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.allowed_hosts = allowed_hosts
        self.engine = engine

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.allowed_hosts is not None and _host_name(headers.get("host", "")) not in self.allowed_hosts:
            return await _send_json(send, 400, {"error": {
                "message": "this server is bound to loopback and only answers requests for "
                           "localhost / 127.0.0.1 / [::1] (Host header refused)",
                "type": "invalid_request_error", "param": None, "code": "invalid_host"}})
        if self.api_key is not None and scope["path"].startswith("/v1"):
            auth = headers.get("authorization", "")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key):
                return await _send_json(send, 401, {"error": {
                    "message": "Incorrect or missing API key: send the header "
                               "'Authorization: Bearer <key>' with the key the server was started with",
                    "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}},
                    headers=[(b"www-authenticate", b"Bearer")])
        started = streaming = False

        async def guarded_send(message):
            nonlocal started, streaming
            if message["type"] == "http.response.start":
                started = True
                streaming = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                for k, v in message.get("headers", []))
                message = dict(message)
                message["headers"] = [*message.get("headers", []), (b"x-content-type-options", b"nosniff")]
            await send(message)

        try:
            await self.app(scope, receive, guarded_send)
        except asyncio.CancelledError:
            # the server's shutdown grace ran out with this request still going: answer as the
            # docs say (503 JSON, or an error event ending the stream), then end quietly
            if self.engine is None or not self.engine.closed:
                raise
            await self._shutdown_answer(send, started, streaming)
        except Exception as exc:
            if isinstance(exc, OSError):          # the client went away
                return
            traceback.print_exc(file=sys.stderr)
            if not started:
                status, body = error_body(exc)
                await _send_json(send, status, body)


    @staticmethod
    async def _shutdown_answer(send, started: bool, streaming: bool) -> None:
        import anyio

        _, body = error_body(_shutting_down())
        with anyio.move_on_after(1.0):                # a client that reads nothing gets nothing
            try:
                if not started:
                    await _send_json(send, 503, body)
                elif streaming:
                    await send({"type": "http.response.body", "more_body": False,
                                "body": f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()})
            except OSError:
                pass


class SSEResponse:
    """Server-sent events from an async iterator of ``data:`` payloads (str). Watches for the
    client's disconnect while streaming and calls ``on_disconnect`` (the job's cancel)."""

    def __init__(self, events, on_disconnect):
        self.events = events
        self.on_disconnect = on_disconnect

    async def __call__(self, scope, receive, send):
        import anyio

        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no")]})
        async with anyio.create_task_group() as tg:
            async def watch():
                while True:
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        self.on_disconnect()
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(watch)
            try:
                async for data in self.events:
                    await send({"type": "http.response.body", "body": f"data: {data}\n\n".encode("utf-8"),
                                "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:
                self.on_disconnect()
            finally:
                tg.cancel_scope.cancel()
                with anyio.CancelScope(shield=True):     # run the events' cleanup now, not at GC
                    await self.events.aclose()


async def _read_json(request, limit: int, timeout: float = DEFAULT_BODY_TIMEOUT_S) -> dict:
    ctype = request.headers.get("content-type", "")
    if ctype.split(";")[0].strip().lower() != "application/json":
        raise ApiError("send the request body as JSON with the header 'Content-Type: application/json'",
                       415, "unsupported_media_type")
    cl = request.headers.get("content-length")
    if cl is not None and cl.strip().isdigit() and int(cl) > limit:
        raise ApiError(f"the request body is {int(cl)} bytes; the limit is {limit} (the server's "
                       "--max-request-bytes)", 413, "request_too_large")
    import anyio

    buf = bytearray()
    with anyio.move_on_after(timeout) as scope:
        async for chunk in request.stream():
            buf += chunk
            if len(buf) > limit:
                raise ApiError(f"the request body is over the limit of {limit} bytes (the server's "
                               "--max-request-bytes)", 413, "request_too_large")
    if scope.cancelled_caught:
        raise ApiError(f"the request body did not arrive within {timeout:g} s; send it at once",
                       408, "request_timeout")
    try:
        body = json.loads(bytes(buf).decode("utf-8"))
    except UnicodeDecodeError:
        raise ApiError("the request body is not UTF-8 text", code="invalid_json") from None
    except (ValueError, RecursionError) as exc:
        raise ApiError(f"the request body is not valid JSON ({str(exc)[:120]}); send a JSON object",
                       code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, not {type(body).__name__}",
                       code="invalid_json")
    where = _surrogate_path(body)
    if where is not None:
        top = where.split(".")[0].split("[")[0]
        raise ApiError(f"{where[:200]} holds a lone UTF-16 surrogate (an escape such as \\ud800 "
                       "without its pair), which is not text; send valid Unicode",
                       param=top if top in body else None, code="invalid_value")
    return body


def create_app(model, model_id: str | None = None, api_key: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, max_queue: int = DEFAULT_MAX_QUEUE,
               allowed_hosts: set[str] | None = None, max_tokens_cap: int = DEFAULT_MAX_TOKENS_CAP,
               request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT_S,
               body_timeout: float = DEFAULT_BODY_TIMEOUT_S, parallel: int | None = None,
               prefix_cache_bytes: int | None = None, prefill_chunk: int | None = None):
    """The ASGI application serving ``model``; ``parallel`` streams at once (None: chosen from
    the machine, :func:`cpullm.engine.default_parallel`); ``prefix_cache_bytes`` bounds the KV
    kept for shared prompt prefixes (None: :func:`cpullm.engine.default_prefix_cache_bytes`);
    ``prefill_chunk``: prompt tokens prefilled per scheduler step, also the prefix cache's block
    (None: the program's max chunk). ``allowed_hosts``: Host names accepted (None: any).
    ``max_tokens_cap``: the longest answer (an omitted max_tokens gets it); ``request_timeout``:
    seconds of generation per request (None: no limit); ``body_timeout``: seconds to send a body."""
    import anyio
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import FileResponse, JSONResponse, Response
    from starlette.routing import Mount, Route
    from starlette.staticfiles import StaticFiles

    model_id = model_id or Path(str(model.model_dir)).name
    engine = Engine(model, max_queue=max_queue, parallel=parallel, prefill_chunk=prefill_chunk,
                    prefix_cache_bytes=prefix_cache_bytes)
    api = Api(model, model_id, engine, max_tokens_cap=max_tokens_cap, request_timeout=request_timeout)

    def err(exc: Exception) -> Response:
        status, body = error_body(exc)
        if status >= 500 and not isinstance(exc, CpullmError):
            traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        return Response(_json_bytes(body), status, media_type="application/json")

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [_model_card(api)]})

    async def model_info(request: Request):
        mid = request.path_params["model_id"]
        if mid != model_id:
            return err(ApiError(f"The model `{mid}` does not exist: this server runs `{model_id}`",
                                404, "model_not_found", "model"))
        return JSONResponse(_model_card(api))

    async def health(request: Request):
        return JSONResponse({"status": "ok", "model": model_id, "n_ctx": model.n_ctx,
                             "limits": _limits(api, max_request_bytes, body_timeout),
                             **engine.snapshot()})

    async def page(request: Request):
        return FileResponse(STATIC_DIR / "index.html", headers={
            "content-security-policy": PAGE_CSP, "cache-control": "no-cache"})

    async def completions(request: Request):
        return await _complete(request, api.prepare_completion)

    async def chat_completions(request: Request):
        return await _complete(request, api.prepare_chat)

    async def _prepare(request: Request, prepare, body):
        """Render and tokenize in a thread; a client that leaves meanwhile cancels the render
        (its worker is killed, nothing keeps running for nobody). Returns (spec, gone)."""
        cancel = threading.Event()
        gone, spec, failure = False, None, None
        async with anyio.create_task_group() as tg:
            async def watch():
                nonlocal gone
                while True:
                    if (await request.receive())["type"] == "http.disconnect":
                        gone = True
                        cancel.set()
                        return

            tg.start_soon(watch)
            try:
                spec = await anyio.to_thread.run_sync(prepare, body, cancel)
            except Exception as exc:
                failure = exc
            tg.cancel_scope.cancel()
        if failure is not None and not gone:
            raise failure
        return spec, gone

    async def _complete(request: Request, prepare):
        try:
            body = await _read_json(request, max_request_bytes, body_timeout)
            spec, gone = await _prepare(request, prepare, body)
            if gone:
                engine.count_left_early()
                return Response(b"", 499)            # the client left; nobody reads this
            job = Job(spec.ids, spec.max_tokens, spec.sampling, spec.stop, api.request_timeout)
            out = engine.submit(job, asyncio.get_running_loop())
        except Exception as exc:
            if engine.closed and (isinstance(exc, ChatTemplateError) or
                                  getattr(exc, "openai_code", None) == "chat_template_error"):
                exc = _shutting_down()               # the render was stopped by the shutdown
            return err(exc)
        rid = ("chatcmpl-" if spec.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if spec.stream:
            return SSEResponse(_sse_events(api, spec, job, out, rid, created), job.cancel.set)
        return await _collect(request, api, spec, job, out, rid, created, err)

    async def not_found(request: Request, exc: HTTPException):
        if exc.status_code == 404:
            e = ApiError(f"Unknown request URL: {request.method} {request.url.path}. Endpoints: "
                         "GET /v1/models, POST /v1/chat/completions, POST /v1/completions, "
                         "GET /health, GET /", 404, "unknown_url")
        elif exc.status_code == 405:
            e = ApiError(f"{request.method} is not allowed on {request.url.path}", 405,
                         "method_not_allowed")
        else:
            e = ApiError(str(exc.detail), exc.status_code)
        return err(e)

    @asynccontextmanager
    async def lifespan(app):
        try:
            yield
        finally:
            engine.close()

    routes = [
        Route("/", page, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", model_info, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: not_found}, lifespan=lifespan)
    app.state.engine = engine
    app.state.model_id = model_id
    guarded = Guard(app, api_key, allowed_hosts, engine)
    guarded.engine = engine
    return guarded


def _limits(api: Api, max_request_bytes: int | None = None, body_timeout: float | None = None) -> dict:
    from .. import chat

    out = {"max_tokens_cap": api.max_tokens_cap, "request_timeout_s": api.request_timeout,
           "template_timeout_s": chat.RENDER_TIMEOUT_S, "template_memory_mb": chat.RENDER_MEMORY_MB,
           "max_queue": api.engine.max_queue}
    if max_request_bytes is not None:
        out["max_request_bytes"] = max_request_bytes
    if body_timeout is not None:
        out["body_timeout_s"] = body_timeout
    return out


def _model_card(api: Api) -> dict:
    m = api.model
    return {"id": api.model_id, "object": "model", "created": api.created, "owned_by": "cpullm",
            "family": m.family.name, "quant": m.quant, "n_ctx": m.n_ctx,
            "max_tokens_cap": api.max_tokens_cap, "request_timeout_s": api.request_timeout}


async def _collect(request, api: Api, spec: RequestSpec, job: Job, out, rid, created, err):
    """A non-streaming answer; a client that disconnects while waiting cancels its job."""
    import anyio
    from starlette.responses import Response

    pieces: list[str] = []
    failure = None
    gone = False
    async with anyio.create_task_group() as tg:
        async def watch():
            nonlocal gone
            while True:
                msg = await request.receive()
                if msg["type"] == "http.disconnect":
                    gone = True
                    job.cancel.set()
                    tg.cancel_scope.cancel()
                    return

        tg.start_soon(watch)
        try:
            async for p in _pieces(out, job):
                pieces.append(p)
        except Exception as exc:
            failure = exc
        tg.cancel_scope.cancel()
    if gone:
        return Response(b"", 499)                  # the client left; nobody reads this
    if failure is not None:
        return err(failure)
    text = "".join(pieces)
    usage, fr = api.usage(job.stats, spec), api.finish_reason(job.stats)
    if spec.kind == "chat":
        obj = {"id": rid, "object": "chat.completion", "created": created, "model": api.model_id,
               "system_fingerprint": api.fingerprint,
               "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                            "logprobs": None, "finish_reason": fr}],
               "usage": usage}
    else:
        obj = {"id": rid, "object": "text_completion", "created": created, "model": api.model_id,
               "system_fingerprint": api.fingerprint,
               "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": fr}],
               "usage": usage}
    return Response(_json_bytes(obj), 200, media_type="application/json")


async def _sse_events(api: Api, spec: RequestSpec, job: Job, out, rid, created):
    """The ``data:`` payloads of a streamed answer, ``[DONE]`` last; an error mid-stream is sent
    as an ``{"error": ...}`` event."""
    chat = spec.kind == "chat"
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta=None, text=None, finish=None, usage=None, empty=False):
        c = {"id": rid, "object": obj, "created": created, "model": api.model_id,
             "system_fingerprint": api.fingerprint}
        if empty:
            c["choices"] = []
        elif chat:
            c["choices"] = [{"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}]
        else:
            c["choices"] = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]
        if usage is not None or spec.include_usage:
            c["usage"] = usage
        return json.dumps(c, ensure_ascii=False, separators=(",", ":"))

    try:
        if chat:
            yield chunk(delta={"role": "assistant", "content": ""})
        async for piece in _pieces(out, job):
            yield chunk(delta={"content": piece}) if chat else chunk(text=piece)
        yield chunk(delta={}, text="", finish=api.finish_reason(job.stats))
        if spec.include_usage:
            yield chunk(empty=True, usage=api.usage(job.stats, spec))
    except Exception as exc:
        _, body = error_body(exc)
        if not isinstance(exc, CpullmError):
            traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        yield json.dumps(body, ensure_ascii=False)
    finally:
        job.cancel.set()
    yield "[DONE]"


# ---- running it -------------------------------------------------------------------------------------
def is_loopback(host: str) -> bool:
    import ipaddress
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def header_timeout_protocol(header_timeout: float):
    """uvicorn's h11 protocol with a deadline for each request's line and headers.

    uvicorn times out only idle keep-alive connections after a response; a client that connects
    and sends nothing, or trickles its headers a byte at a time, would hold its connection
    forever. Here each request cycle (a new connection, or the next request on a kept-alive one)
    must have delivered its complete headers ``header_timeout`` seconds after it began, or the
    connection is closed. The body has its own deadline in the application."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutProtocol(H11Protocol):
        _header_cycle = 0
        _header_timer = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm_header_deadline()

        def on_response_complete(self):
            super().on_response_complete()
            self._arm_header_deadline()

        def connection_lost(self, exc):
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

        def _arm_header_deadline(self):
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_cycle += 1
            self._header_timer = self.loop.call_later(header_timeout, self._header_deadline,
                                                      self._header_cycle)

        def _header_deadline(self, cycle: int):
            if cycle == self._header_cycle and not self.transport.is_closing() and \
                    self.conn.their_state is h11.IDLE:      # no complete request line + headers yet
                self.transport.close()

    return HeaderTimeoutProtocol


def serve(model, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          model_id: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
          max_queue: int = DEFAULT_MAX_QUEUE, log_level: str = "warning", announce=print,
          max_tokens_cap: int = DEFAULT_MAX_TOKENS_CAP,
          request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT_S,
          header_timeout: float = DEFAULT_HEADER_TIMEOUT_S,
          body_timeout: float = DEFAULT_BODY_TIMEOUT_S, parallel: int | None = None,
          prefix_cache_bytes: int | None = None, prefill_chunk: int | None = None) -> None:
    """Serve until interrupted. ``port=0`` picks a free port; ``announce`` gets the ready line
    (with the real URL) once the socket listens. On SIGINT/SIGTERM the engine and the template
    worker stop first, so every waiting client gets the 503 JSON error and every stream an
    error event, before uvicorn's graceful close."""
    import socket

    import uvicorn

    from ..chat import stop_render_worker

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            app.engine.close()
            stop_render_worker()
            await super().shutdown(sockets=sockets)

    allowed = LOOPBACK_NAMES if is_loopback(host) else None
    app = create_app(model, model_id=model_id, api_key=api_key, max_request_bytes=max_request_bytes,
                     max_queue=max_queue, allowed_hosts=allowed, max_tokens_cap=max_tokens_cap,
                     request_timeout=request_timeout, body_timeout=body_timeout, parallel=parallel,
                     prefix_cache_bytes=prefix_cache_bytes, prefill_chunk=prefill_chunk)
    bind_host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(bind_host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        app.engine.close()
        raise ConfigError(f"cannot resolve --host {host!r} ({exc.strerror}); give an IP address "
                          "such as 127.0.0.1") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        app.engine.close()
        raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror}); pick another --port "
                          "(or stop the program using it)") from None
    real_port = sock.getsockname()[1]
    shown = f"[{bind_host}]" if ":" in bind_host else bind_host
    config = uvicorn.Config(app, log_level=log_level, access_log=log_level in ("info", "debug", "trace"),
                            timeout_graceful_shutdown=3, lifespan="on", server_header=False,
                            http=header_timeout_protocol(header_timeout), timeout_keep_alive=5)
    server = Server(config)
    announce(f"cpullm: serving {model_id or Path(str(model.model_dir)).name} at "
             f"http://{shown}:{real_port}/ (OpenAI API: http://{shown}:{real_port}/v1, "
             f"chat page: http://{shown}:{real_port}/)")
    try:
        server.run(sockets=[sock])
    finally:
        app.engine.close()
        stop_render_worker()
        sock.close()
