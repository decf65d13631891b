"""The OpenAI-compatible API: request validation and parsing, response objects, OpenAI-shaped errors.

Sampling defaults for fields a request omits: OpenAI's (temperature 1, top_p 1), overridden by
the checkpoint's generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty).
Extensions accepted beside OpenAI's fields: ``top_k``, ``min_p``, ``repetition_penalty``,
``chat_template_kwargs`` (e.g. ``{"enable_thinking": false}``), and the peers' spellings of
constrained output (:data:`CONSTRAINT_FIELDS`: llama.cpp's ``grammar`` and ``json_schema``, vLLM's
``guided_*`` and ``structured_outputs``, Ollama's ``format``) beside OpenAI's ``response_format``.
Every field of OpenAI's request schemas is honored, accepted as a label (:data:`LABEL_FIELDS`: no
effect on the answer) or refused with a 400 naming it; so is a field no schema has
(:func:`check_fields`).

Tool calls (:mod:`cpullm.toolcalls`): ``tools`` go to the chat template and the answer is parsed
with the model family's tool format into ``message.tool_calls`` (finish_reason "tool_calls");
``tool_choice`` "required", a named function or a ``strict`` function constrain the call to the
declared names and schemas (constrained decoding), "none" answers in text. A model that thinks
returns its thinking as ``reasoning_content``. Lone UTF-16 surrogates anywhere in a body, and
sampling values that would overflow the sampler (a temperature under 1e-3 other than 0), are
400s. An answer is at most ``max_tokens_cap`` tokens (an omitted ``max_tokens`` means the cap,
not the rest of the context; a larger one is cut with finish_reason "length").

Errors are OpenAI-shaped JSON: ``{"error": {"message", "type", "param", "code"}}``.
"""
from __future__ import annotations

import json
import math
import threading
import time

from ..generate.chat_tools import ChatAnswer, plan_chat, tool_request
from ..errors import (ApiError, ChatTemplateError, ContextOverflowError, CpullmError, SamplingError,
                      ServerRequestError)
from ..generate.generate import GenerationStats
from ..limits import one_line, quoted
from ..generate.sampling import MAX_REPETITION_PENALTY, MIN_TEMPERATURE

DEFAULT_MAX_TOKENS_CAP = 1024         # longest answer per request; an omitted max_tokens gets this
DEFAULT_REQUEST_TIMEOUT_S = 300.0     # generation time per request: 1024 tokens at ~4 tok/s (a 4B model)
MAX_STOP = 16


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


# JSON keeps U+0085, U+2028 and U+2029 raw inside strings, but str.splitlines (httpx's
# iter_lines, many JSONL readers) breaks a line at them: a token that decodes to one would cut
# an SSE event or a batch output line in two. Escaped, the value is the same and the line whole.
_LINE_BREAKS_ESCAPED = {0x85: "\\u0085", 0x2028: "\\u2028", 0x2029: "\\u2029"}


def json_text(obj) -> str:
    """Compact JSON on one line for any line reader: UTF-8 as is, line separators escaped."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS_ESCAPED)


def json_bytes(obj) -> bytes:
    return json_text(obj).encode("utf-8")


def shutting_down_error() -> ApiError:
    return ApiError("the server is shutting down; retry on another instance or once it is back",
                    503, "server_shutting_down")


# ---- request parsing ---------------------------------------------------------------------------------
class RequestSpec:
    """A checked request: prompt ids, answer length, sampling (with its ``constraint``, the
    tools' grammar or the requested format), stop strings, how to answer. ``answer`` (a
    :class:`ChatAnswer`) says how a chat answer's text is read: tools, reasoning."""

    def __init__(self, kind, ids, max_tokens, sampling, stop, stream, include_usage, answer=None,
                 cache_salt=None):
        self.kind, self.ids, self.max_tokens = kind, ids, max_tokens
        self.sampling, self.stop = sampling, stop
        self.stream, self.include_usage = stream, include_usage
        self.answer = answer if answer is not None else ChatAnswer()
        self.cache_salt = cache_salt      # the request's own prefix-cache salt (None: its tenant's)

    def parser(self):
        return self.answer.parser()


# ---- every request field: honored, a label, or refused -------------------------------------------
# Fields that only label a request: accepted, no effect on the answer (README "Tool calls, reasoning
# and request fields"): who sent it, for the caller's own records, storage and caching hints.
LABEL_FIELDS = ("user", "metadata", "store", "service_tier", "safety_identifier",
                "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options")
# Fields this server honors (or checks and refuses values of) in its own parsing.
CHAT_FIELDS = ("model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens",
               "temperature", "top_p", "seed", "stop", "n", "logprobs", "top_logprobs",
               "presence_penalty", "frequency_penalty", "logit_bias", "response_format",
               "tools", "tool_choice", "parallel_tool_calls", "reasoning_effort", "modalities",
               "top_k", "min_p", "repetition_penalty", "chat_template_kwargs", "cache_salt")
COMPLETION_FIELDS = ("model", "prompt", "stream", "stream_options", "max_tokens", "temperature",
                     "top_p", "seed", "stop", "n", "best_of", "logprobs", "echo", "suffix",
                     "presence_penalty", "frequency_penalty", "logit_bias", "top_k", "min_p",
                     "repetition_penalty", "cache_salt")
# Fields refused whatever their value (null aside): what to send instead.
REFUSED_FIELDS = {
    "functions": "the deprecated functions API is not served: send tools=[{\"type\": \"function\", "
                 "\"function\": {...}}] instead",
    "function_call": "the deprecated functions API is not served: send tool_choice instead",
    "audio": "this server answers in text only: omit audio",
    "prediction": "predicted outputs are not supported: omit prediction",
    "web_search_options": "this server has no web search: omit web_search_options (declare a tool instead)",
    "verbosity": "the answer's length follows the model: omit verbosity (use max_tokens to bound it)",
    "moderation": "this server runs no moderation: omit moderation",
}


def check_fields(body: dict, kind: str) -> None:
    """Refuse, with a 400 naming it, every field that is neither honored nor a label."""
    known = (CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS) + CONSTRAINT_FIELDS
    for key in body:
        if key in known or key in LABEL_FIELDS:
            continue
        if key in REFUSED_FIELDS and body[key] is not None:
            raise ApiError(f"{key} is not supported by this server: {REFUSED_FIELDS[key]}", param=key,
                           code="unsupported_parameter")
        if key in REFUSED_FIELDS:
            continue                                    # null: the client sent nothing
        where = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        raise ApiError(f"{key!s:.60} is not a field this server knows for {where}; remove it (the "
                       "fields it honors are OpenAI's plus top_k, min_p, repetition_penalty"
                       f"{', chat_template_kwargs' if kind == 'chat' else ''} and the constraint "
                       f"spellings {', '.join(CONSTRAINT_FIELDS[1:])})", param=str(key)[:60],
                       code="unknown_parameter")
    mods = body.get("modalities")
    if mods is not None and mods != ["text"]:
        raise ApiError(f"modalities={quoted(mods)} is not supported: this server answers in text "
                       "only (send [\"text\"] or omit it)", param="modalities", code="unsupported_parameter")


def _number(body: dict, key: str, default, lo=None, hi=None, lo_open=False, hi_open=False):
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ApiError(f"{key} must be a number, got {quoted(v)}", param=key, code="invalid_type")
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
            raise ApiError(f"{key} must be an integer, got {quoted(v)}", param=key, code="invalid_type")
    if lo is not None and v < lo:
        raise ApiError(f"{key} must be >= {lo}, got {v}", param=key, code="invalid_value")
    return int(v)


def _boolean(body: dict, key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(f"{key} must be true or false, got {quoted(v)}", param=key, code="invalid_type")
    return v


def _unsupported(body: dict, key: str, allowed, why: str) -> None:
    v = body.get(key)
    if v is not None and v not in allowed:
        raise ApiError(f"{key}={quoted(v)} is not supported by this server: {why}", param=key,
                       code="unsupported_parameter")


MAX_CACHE_SALT = 256


def _cache_salt(body: dict) -> str | None:
    """``cache_salt`` (as vLLM names it): requests share cached prompt prefixes only with
    requests of the same salt (and the same API key), so a client that sends a secret one can
    be neither reused nor timed by others."""
    v = body.get("cache_salt")
    if v is None:
        return None
    if not isinstance(v, str) or not 0 < len(v) <= MAX_CACHE_SALT:
        raise ApiError(f"cache_salt must be a string of 1 to {MAX_CACHE_SALT} characters, got {quoted(v)}",
                       param="cache_salt", code="invalid_value")
    return v


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


def surrogate_path(obj, where: str = "") -> str | None:
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
    """The API over one model: parses and checks requests into :class:`RequestSpec`, shapes the
    answers. ``engine`` is the :class:`cpullm.serve.engine.Engine` the requests run on."""

    def __init__(self, model, model_id: str, engine,
                 max_tokens_cap: int = DEFAULT_MAX_TOKENS_CAP,
                 request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT_S):
        self.model = model
        self.model_id = model_id
        self.model_ids = {model_id}        # every id a request may name (create_app adds aliases)
        self.engine = engine
        self.max_tokens_cap = max_tokens_cap
        self.request_timeout = request_timeout
        self.created = int(time.time())
        self.fingerprint = f"cpullm-{_version()}-{model.quant}"
        from ..generate.engine import embedding_rows
        self.vocab = embedding_rows(model)          # ids a prompt may hold
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

    # -- token counting
    def check_model(self, body: dict) -> None:
        """A 404 when the body names a model this server does not run."""
        m = body.get("model")
        if m is not None:
            if not isinstance(m, str):
                raise ApiError(f"model must be a string, got {quoted(m)}", param="model", code="invalid_type")
            if m not in self.model_ids:
                raise ApiError(f"The model `{m}` does not exist: this server runs `{self.model_id}` "
                               "(GET /v1/models lists it)", 404, "model_not_found", "model")

    def tokenize(self, body: dict) -> dict:
        """``POST /tokenize``: ``{"tokens": [id, ...]}``, or with ``with_pieces``
        ``{"tokens": [{"id": id, "piece": text}, ...]}`` (a piece is the token decoded alone)."""
        content, add_special, with_pieces = parse_tokenize(body)
        self.check_model(body)
        tok = self.model.tokenizer
        ids = tok.encode(content, add_special_tokens=add_special)
        if not with_pieces:
            return {"tokens": ids}
        return {"tokens": [{"id": i, "piece": tok.decode([i])} for i in ids]}

    def detokenize(self, body: dict) -> dict:
        """``POST /detokenize``: ``{"content": text}`` of the ids (special tokens kept)."""
        ids = parse_detokenize(body, self.vocab)
        self.check_model(body)
        return {"content": self.model.tokenizer.decode(ids)}

    def embeddings(self, body: dict) -> dict:
        """``POST /v1/embeddings`` in OpenAI's shape (:meth:`cpullm.model.Model.embed`)."""
        from ..generate.embed import token_inputs

        inp, fmt, dims, pooling = parse_embeddings(body)
        self.check_model(body)
        try:
            ids = token_inputs(inp, self.model.tokenizer, self.model._embed_vocab(), self.model.n_ctx)
        except CpullmError as exc:
            raise ApiError(str(exc), param="input", code="invalid_value") from None
        try:
            vecs = self.model.embed_ids(ids, pooling=pooling, dimensions=dims)
        except CpullmError as exc:
            raise ApiError(str(exc), param="dimensions" if dims is not None else None,
                           code="invalid_value") from None
        n = sum(len(i) for i in ids)
        return {"object": "list", "model": self.model_id,
                "data": [embedding_item(i, v, fmt) for i, v in enumerate(vecs)],
                "usage": {"prompt_tokens": n, "total_tokens": n}}

    # -- shared fields
    def _check_common(self, body: dict) -> None:
        m = body.get("model")
        if m is not None:
            if not isinstance(m, str):
                raise ApiError(f"model must be a string, got {quoted(m)}", param="model", code="invalid_type")
            if m not in self.model_ids:
                raise ApiError(f"The model `{m}` does not exist: this server runs `{self.model_id}` "
                               "(GET /v1/models lists it)", 404, "model_not_found", "model")
        choices_count(body)
        _unsupported(body, "best_of", (1,), "best_of is not served: send n for several choices")

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
        out.update(sampling_surface(body, self.vocab))
        spec = constraint_request(body)
        if spec is not None:
            field = next(k for k in CONSTRAINT_FIELDS if body.get(k) is not None and
                         not (k == "response_format" and body[k] == {"type": "text"}))
            out["constraint"] = build_request_constraint(self.model, spec, field)
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

    def _without_paths(self, message: str) -> str:
        """A message for the client with the model's location on this machine replaced by its id
        (a client has no use for the server's file system layout)."""
        where = str(self.model.model_dir)
        return message.replace(where, f"the model `{self.model_id}`") if where else message

    def _check_ids(self, ids: list[int], param: str) -> None:
        """A text prompt whose tokens have no embedding row (a tokenizer longer than the model's
        embedding) is this request's 400, before it joins a batch."""
        bad = next((t for t in ids if not 0 <= t < self.vocab), None)
        if bad is not None:
            raise ApiError(f"the {param} tokenize to id {bad}, but this model's embedding has {self.vocab} "
                           "rows: its tokenizer and weights do not match; use other text", param=param,
                           code="invalid_value")

    # -- endpoint-specific parsing (runs in a worker thread: rendering and tokenizing cost CPU)
    def prepare_chat(self, body: dict, cancel: threading.Event | None = None) -> RequestSpec:
        from ..generate.chat import RenderCancelled, check_messages, render_chat

        check_fields(body, "chat")
        self._check_common(body)
        if "messages" not in body:
            raise ApiError("messages is required: a list of {role, content} objects", param="messages",
                           code="missing_required_parameter")
        try:
            messages = check_messages(body["messages"])
        except ChatTemplateError as exc:
            raise ApiError(str(exc), param="messages", code="invalid_value") from None
        tools, choice, parallel = tool_request(body)
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
            plan = plan_chat(self.model, body, messages, tools, choice, parallel, extra)
            text = render_chat(self.model, plan.messages, tools=plan.template_tools, cancel=cancel,
                               **plan.template_kwargs)
        except RenderCancelled:
            raise
        except ChatTemplateError as exc:
            raise ApiError(self._without_paths(str(exc)), param="messages", code="chat_template_error") from None
        ids = self.model.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise ApiError("the chat template rendered an empty prompt", param="messages")
        self._check_ids(ids, "messages")
        max_tokens = self._max_tokens(body, len(ids), "messages")
        answer_spec = constraint_request(body) if sampling.get("constraint") is not None else None
        answer, constraint = plan.answer(self.model, text, answer_spec)
        if constraint is not None:
            # the tool grammar holds the answer format too (auto), or forces a call (required)
            sampling = dict(sampling, constraint=constraint)
        return RequestSpec("chat", ids, max_tokens, sampling, stop, stream, include_usage, answer,
                           cache_salt=_cache_salt(body))

    def prepare_completion(self, body: dict, cancel: threading.Event | None = None) -> RequestSpec:
        check_fields(body, "completion")
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
            self._check_ids(ids, "prompt")
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
        return RequestSpec("completion", ids, max_tokens, sampling, stop, stream, include_usage,
                           cache_salt=_cache_salt(body))

    # -- responses
    def finish_reason(self, stats: GenerationStats, tool_calls: int = 0) -> str:
        if tool_calls:
            return "tool_calls"
        return "length" if stats.stop_reason == "length" else "stop"

    @staticmethod
    def usage(stats: GenerationStats, spec: RequestSpec) -> dict:
        p, c = len(spec.ids), stats.generated_tokens
        out = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
        if stats.spec_passes:            # speculative decoding: guesses kept per verify pass
            out["speculative"] = {"verify_passes": stats.spec_passes, "drafted_tokens": stats.spec_drafted,
                                  "accepted_tokens": stats.spec_accepted}
        return out

    def answer(self, spec: RequestSpec, rid: str, created: int, answer, stats: GenerationStats) -> dict:
        """The response object of a non-streamed answer (``answer``: a
        :class:`cpullm.toolcalls.Answer`)."""
        usage, fr = self.usage(stats, spec), self.finish_reason(stats, len(answer.tool_calls))
        text = answer.content
        if spec.kind == "chat":
            return {"id": rid, "object": "chat.completion", "created": created, "model": self.model_id,
                    "system_fingerprint": self.fingerprint,
                    "choices": [{"index": 0, "message": answer.message(),
                                 "logprobs": None, "finish_reason": fr}],
                    "usage": usage}
        return {"id": rid, "object": "text_completion", "created": created, "model": self.model_id,
                "system_fingerprint": self.fingerprint,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": fr}],
                "usage": usage}

    def chunk(self, spec: RequestSpec, rid: str, created: int, delta=None, text=None, finish=None,
              usage=None, empty=False, logprobs=None) -> str:
        """One streamed chunk as JSON text: a chat ``delta`` or completion ``text``; ``empty``:
        no choices (the last chunk, carrying the usage)."""
        chat = spec.kind == "chat"
        c = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
             "created": created, "model": self.model_id, "system_fingerprint": self.fingerprint}
        if empty:
            c["choices"] = []
        elif chat:
            c["choices"] = [{"index": 0, "delta": delta or {}, "logprobs": logprobs, "finish_reason": finish}]
        else:
            c["choices"] = [{"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}]
        if usage is not None or spec.include_usage:
            c["usage"] = usage
        return json_text(c)


def _version() -> str:
    from .. import __version__
    return __version__


# ---- constrained output and the sampling surface (cpullm.generate.constraints, cpullm.generate.sampling) ------------
CONSTRAINT_FIELDS = ("response_format", "grammar", "json_schema", "guided_json", "guided_regex",
                     "guided_choice", "guided_grammar", "structured_outputs", "format")
"""Request fields that constrain the output (at most one per request): OpenAI's
``response_format`` (text, json_object, json_schema); llama.cpp's ``grammar`` (GBNF) and
``json_schema``; vLLM's ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``
and ``structured_outputs`` ({json | regex | choice | grammar | json_object}); Ollama's ``format``
("json" or a schema)."""


def _schema_value(field: str, v):
    """A schema given as an object or as JSON text (vLLM accepts both)."""
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError as exc:
            raise ApiError(f"{field} is not valid JSON: {exc}", param=field, code="invalid_value") from None
    if not isinstance(v, dict):
        raise ApiError(f"{field} must be a JSON schema object, got {quoted(v)}", param=field,
                       code="invalid_type")
    return v


def _text_value(field: str, v) -> str:
    if not isinstance(v, str):
        raise ApiError(f"{field} must be a string, got {quoted(v)}", param=field, code="invalid_type")
    return v


def _choice_value(field: str, v) -> list:
    if not isinstance(v, list) or not all(isinstance(c, str) for c in v):
        raise ApiError(f"{field} must be a list of strings, got {quoted(v)}", param=field, code="invalid_type")
    return v


def _response_format(v):
    if not isinstance(v, dict) or v.get("type") not in ("text", "json_object", "json_schema"):
        raise ApiError("response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                       "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}, "
                       f"got {quoted(v)}", param="response_format", code="invalid_value")
    if v["type"] == "text":
        return None
    if v["type"] == "json_object":
        return {"json_object": True}
    js = v.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("name", ""), str):
        raise ApiError("response_format.json_schema must be {\"name\": ..., \"schema\": {...}, "
                       "\"strict\": true}", param="response_format", code="invalid_value")
    schema = js.get("schema")
    # OpenAI's strict flag asks the schema to be followed exactly: constrained decoding always does,
    # strict or not (a schema OpenAI would refuse in strict mode is still enforced as written)
    if schema is None:
        return {"json_object": True}
    return {"json_schema": _schema_value("response_format.json_schema.schema", schema)}


def _structured_outputs(v):
    kinds = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "gbnf",
             "json_object": "json_object"}
    if not isinstance(v, dict):
        raise ApiError("structured_outputs must be an object with one of json, regex, choice, grammar, "
                       "json_object", param="structured_outputs", code="invalid_type")
    given = {k: x for k, x in v.items() if x is not None and x is not False}
    unknown = sorted(set(given) - set(kinds))
    if unknown or len(given) != 1:
        raise ApiError(f"structured_outputs takes exactly one of {', '.join(kinds)}; got "
                       f"{', '.join(map(str, given)) or 'none'}", param="structured_outputs",
                       code="invalid_value")
    key, x = next(iter(given.items()))
    where = f"structured_outputs.{key}"
    if key == "json":
        return {"json_schema": _schema_value(where, x)}
    if key == "json_object":
        return {"json_object": True}
    if key == "choice":
        return {"choice": _choice_value(where, x)}
    return {kinds[key]: _text_value(where, x)}


def constraint_request(body: dict) -> dict | None:
    """The constraint spec (cpullm.generate.constraints) a request asks for through any of
    :data:`CONSTRAINT_FIELDS`, or None; two of them at once is a 400 naming both."""
    given = [k for k in CONSTRAINT_FIELDS if body.get(k) is not None]
    rf = body.get("response_format")
    if rf is not None and isinstance(rf, dict) and rf.get("type") == "text":
        given.remove("response_format")          # plain text: no constraint
        if not given:
            return None
    if len(given) > 1:
        raise ApiError(f"{given[0]} and {given[1]} both constrain the output: send one of them",
                       param=given[1], code="invalid_value")
    if not given:
        return None
    field = given[0]
    v = body[field]
    if field == "response_format":
        return _response_format(v)
    if field in ("grammar", "guided_grammar"):
        return {"gbnf": _text_value(field, v)}           # GBNF, or Lark told apart by its syntax
    if field in ("json_schema", "guided_json"):
        return {"json_schema": _schema_value(field, v)}
    if field == "guided_regex":
        return {"regex": _text_value(field, v)}
    if field == "guided_choice":
        return {"choice": _choice_value(field, v)}
    if field == "structured_outputs":
        return _structured_outputs(v)
    # Ollama's format: "json" or a schema
    if v == "json":
        return {"json_object": True}
    if isinstance(v, dict):
        return {"json_schema": _schema_value(field, v)}
    raise ApiError(f"format must be \"json\" or a JSON schema object, got {quoted(v)}", param="format",
                   code="invalid_value")


def build_request_constraint(model, spec: dict, field: str = "response_format"):
    """The request's Constraint (built in the request's worker thread: the first one on a model
    reads the token table, a few seconds); errors become 400s naming the field."""
    from ..errors import ConstraintError, MissingDependencyError
    from ..generate.constraints import build_constraint  # noqa: F401  (cpullm.generate.constraints loads without llguidance)
    try:
        return model.constraint(spec)
    except MissingDependencyError as exc:
        raise ApiError(f"{exc} (or drop {field} from the request)", 400,
                       "unsupported_parameter", field) from None
    except ConstraintError as exc:
        raise ApiError(f"{field}: {exc}", param=field, code="invalid_value") from None


def sampling_surface(body: dict, vocab: int) -> dict:
    """OpenAI's penalties, logit_bias and log-probability fields, checked, as engine.submit
    keywords. ``logprobs`` (chat: true/false with ``top_logprobs`` 0-20; completions: 0-5, the
    alternatives per token) asks for each token's log-probability from the logits it was sampled
    from (after penalties, bias and the constraint's mask, before temperature)."""
    from ..generate.sampling import SamplingParams

    out = {"presence_penalty": _number(body, "presence_penalty", 0.0, -2.0, 2.0),
           "frequency_penalty": _number(body, "frequency_penalty", 0.0, -2.0, 2.0)}
    lb = body.get("logit_bias")
    if lb is not None:
        if not isinstance(lb, dict):
            raise ApiError("logit_bias must be an object {\"token id\": bias}", param="logit_bias",
                           code="invalid_type")
        try:
            out["logit_bias"] = SamplingParams(logit_bias=dict(lb)).check_surface(vocab).logit_bias or None
        except SamplingError as exc:
            raise ApiError(str(exc), param="logit_bias", code="invalid_value") from None
    lp = body.get("logprobs")
    top = body.get("top_logprobs")
    if isinstance(lp, bool):                                 # chat: logprobs true + top_logprobs N
        n = _integer(body, "top_logprobs", 0, 0)
        if n > SamplingParams.MAX_TOP_LOGPROBS:
            raise ApiError(f"top_logprobs must be in [0, {SamplingParams.MAX_TOP_LOGPROBS}], got {n}",
                           param="top_logprobs", code="invalid_value")
        if top is not None and not lp:
            raise ApiError("top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
        if lp:
            out["logprobs"] = n
    elif lp is not None:                                     # completions: logprobs N
        n = _integer(body, "logprobs", 0, 0)
        if n > 5:
            raise ApiError(f"logprobs must be in [0, 5] for completions, got {n}", param="logprobs",
                           code="invalid_value")
        out["logprobs"] = n
    elif top is not None:
        raise ApiError("top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
    return out


# ---- log-probabilities in OpenAI's answer shapes ---------------------------------------------------------
def _token_text(tokenizer, tok: int) -> tuple[str, list[int]]:
    """A token's text and its UTF-8 bytes (a token holding part of a character decodes to
    U+FFFD; its bytes are then those of that replacement)."""
    text = tokenizer.decode([int(tok)])
    return text, list(text.encode("utf-8", "surrogatepass"))


def chat_logprobs(tokenizer, records) -> dict:
    """``choices[].logprobs`` of a chat answer: ``{"content": [{token, logprob, bytes,
    top_logprobs: [...]}, ...]}`` for ``records`` (cpullm.generate.sequence.TokenLogprob)."""
    content = []
    for r in records:
        text, raw = _token_text(tokenizer, r.token)
        top = []
        for t, lp in r.top:
            tt, tb = _token_text(tokenizer, t)
            top.append({"token": tt, "logprob": _finite(lp), "bytes": tb})
        content.append({"token": text, "logprob": _finite(r.logprob), "bytes": raw, "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(tokenizer, records, offset: int = 0) -> dict:
    """``choices[].logprobs`` of a completion: OpenAI's legacy shape (tokens, token_logprobs,
    top_logprobs as {token text: logprob}, text_offset from ``offset``)."""
    tokens, lps, tops, offsets = [], [], [], []
    for r in records:
        text, _ = _token_text(tokenizer, r.token)
        tokens.append(text)
        lps.append(_finite(r.logprob))
        tops.append({_token_text(tokenizer, t)[0]: _finite(lp) for t, lp in r.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _finite(x: float) -> float:
    """JSON has no -inf: a token the mask forbade (never sampled, only listed) gets -9999 as OpenAI does."""
    return float(x) if math.isfinite(x) else -9999.0


class LogprobCursor:
    """The log-probabilities of a running sequence, handed out as the stream goes: each chunk
    carries the tokens recorded since the last one (the scheduler's thread appends to
    ``seq.logprobs``; a slice of a list is safe to read meanwhile)."""

    def __init__(self, spec, tokenizer, seq):
        self.on = seq is not None and spec.sampling.get("logprobs") is not None
        self.chat = spec.kind == "chat"
        self.tokenizer, self.seq = tokenizer, seq
        self.done, self.offset = 0, 0

    def take(self, final: bool = False):
        """The ``logprobs`` of the next chunk (None when off; at ``final`` everything left)."""
        if not self.on:
            return None
        n = len(self.seq.logprobs) if final else min(len(self.seq.logprobs), len(self.seq.generated))
        recs = self.seq.logprobs[self.done:n]
        self.done = n
        if self.chat:
            return chat_logprobs(self.tokenizer, recs)
        out = completion_logprobs(self.tokenizer, recs, self.offset)
        self.offset += sum(len(t) for t in out["tokens"])
        return out

    def whole(self):
        """The ``logprobs`` of a non-streamed answer (None when off)."""
        return self.take(final=True)


# ---- n choices --------------------------------------------------------------------------------------------
MAX_CHOICES = 8
"""Largest ``n``: each choice is a sequence of its own in the scheduler (its own slot and seed)."""


def choices_count(body: dict) -> int:
    """``n``, checked: 1 to :data:`MAX_CHOICES`."""
    n = _integer(body, "n", 1, 1)
    if n > MAX_CHOICES:
        raise ApiError(f"n must be at most {MAX_CHOICES}, got {n}: send several requests for more",
                       param="n", code="invalid_value")
    return n


def choice_sampling(sampling: dict, index: int) -> dict:
    """The sampling of choice ``index`` of a request: the seed offset by the index (each choice
    draws its own tokens; a seeded request stays reproducible), and a copy of the constraint."""
    out = dict(sampling)
    if index and out.get("seed") is not None:
        out["seed"] = (out["seed"] + index) & (2**64 - 1)
    if index and out.get("constraint") is not None:
        out["constraint"] = out["constraint"].copy()
    return out


def merge_choices(objs: list[dict]) -> dict:
    """One answer from the whole answers of each choice (``choices[0]`` of each, re-indexed;
    completion tokens summed, the prompt counted once)."""
    out = dict(objs[0])
    out["choices"] = [dict(o["choices"][0], index=i) for i, o in enumerate(objs)]
    u = [o.get("usage") or {} for o in objs]
    prompt = u[0].get("prompt_tokens", 0)
    done = sum(x.get("completion_tokens", 0) for x in u)
    out["usage"] = {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}
    return out


# ---- token counting: llama.cpp's /tokenize and /detokenize ----------------------------------------
MAX_TOKENIZE_CHARS = 1 << 20          # text per /tokenize request
MAX_DETOKENIZE_TOKENS = 1 << 18       # ids per /detokenize request


def _only_fields(body: dict, allowed: tuple[str, ...], route: str) -> None:
    """A 400 naming the first field ``route`` does not take (nothing is silently ignored)."""
    for key in body:
        if key not in allowed:
            raise ApiError(f"{route} takes no field {key!r}; its fields are {', '.join(allowed)}",
                           param=key, code="unsupported_parameter")


def _token_ids(value, key: str, vocab: int, limit: int) -> list[int]:
    """A list of token ids in [0, vocab), at most ``limit`` of them."""
    if not isinstance(value, list):
        raise ApiError(f"{key} must be a list of token ids, got {quoted(value)}", param=key,
                       code="invalid_type")
    if len(value) > limit:
        raise ApiError(f"{key} holds {len(value)} token ids; the limit is {limit}", param=key,
                       code="invalid_value")
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            raise ApiError(f"{key}[{i}] must be a token id in [0, {vocab}), got {quoted(t)}",
                           param=key, code="invalid_value")
    return [int(t) for t in value]


def parse_tokenize(body: dict) -> tuple[str, bool, bool]:
    """(content, add_special, with_pieces) of a ``POST /tokenize`` body:
    ``{"content": str, "add_special": bool = false, "with_pieces": bool = false}``."""
    _only_fields(body, ("content", "add_special", "with_pieces", "model"), "/tokenize")
    content = body.get("content")
    if not isinstance(content, str):
        raise ApiError(f"content must be a string, got {quoted(content)}", param="content",
                       code="invalid_type" if content is not None else "missing_required_parameter")
    if len(content) > MAX_TOKENIZE_CHARS:
        raise ApiError(f"content holds {len(content)} characters; the limit is {MAX_TOKENIZE_CHARS}",
                       param="content", code="invalid_value")
    return content, _boolean(body, "add_special", False), _boolean(body, "with_pieces", False)


def parse_detokenize(body: dict, vocab: int) -> list[int]:
    """The token ids of a ``POST /detokenize`` body: ``{"tokens": [int, ...]}``."""
    _only_fields(body, ("tokens", "model"), "/detokenize")
    if body.get("tokens") is None:
        raise ApiError("tokens is required: a list of token ids", param="tokens",
                       code="missing_required_parameter")
    return _token_ids(body["tokens"], "tokens", vocab, MAX_DETOKENIZE_TOKENS)


# ---- embeddings: OpenAI's POST /v1/embeddings -----------------------------------------------------
EMBEDDING_FIELDS = ("input", "model", "encoding_format", "dimensions", "user", "pooling")


def parse_embeddings(body: dict) -> tuple:
    """(input, encoding_format, dimensions, pooling) of a ``POST /v1/embeddings`` body. ``input``
    is a string, a list of strings, a list of token ids or a list of such lists (checked in
    full by :func:`cpullm.generate.embed.token_inputs`); ``pooling`` ("last" | "mean" | "cls") is
    cpullm's extension; ``user`` (OpenAI's end-user tag) must be a string and has no effect."""
    from ..generate.embed import POOLINGS

    _only_fields(body, EMBEDDING_FIELDS, "/v1/embeddings")
    inp = body.get("input")
    if inp is None:
        raise ApiError("input is required: a string or a list of strings (or of token-id lists)",
                       param="input", code="missing_required_parameter")
    if not isinstance(inp, (str, list)) or (isinstance(inp, list) and not inp):
        raise ApiError(f"input must be a string or a non-empty list, got {quoted(inp)}",
                       param="input", code="invalid_value")
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise ApiError(f"encoding_format must be \"float\" or \"base64\", got {quoted(fmt)}",
                       param="encoding_format", code="invalid_value")
    dims = _integer(body, "dimensions", None, lo=1)
    pooling = body.get("pooling")
    if pooling is not None and pooling not in POOLINGS:
        raise ApiError(f"pooling must be one of {', '.join(POOLINGS)}, got {quoted(pooling)}",
                       param="pooling", code="invalid_value")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise ApiError(f"user must be a string, got {quoted(body['user'])}", param="user",
                       code="invalid_type")
    return inp, fmt, dims, pooling


def embedding_item(index: int, vec, fmt: str) -> dict:
    """One ``data`` entry: the vector as a list of floats, or base64 of its little-endian float32."""
    import base64

    import numpy as np
    if fmt == "base64":
        emb = base64.b64encode(np.asarray(vec, "<f4").tobytes()).decode("ascii")
    else:
        emb = [float(x) for x in vec]
    return {"object": "embedding", "index": index, "embedding": emb}
