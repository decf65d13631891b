"""The HTTP side of ``cpullm serve``: the ASGI application (starlette) and running it (uvicorn).

Endpoints: ``GET /v1/models`` (and ``/v1/models/{id}``), ``POST /v1/chat/completions``,
``POST /v1/completions`` (both streaming as server-sent events ending in ``data: [DONE]``, or
not), ``POST /v1/embeddings``, ``POST /tokenize`` and ``/detokenize`` (llama.cpp's shape), ``GET /health``,
``GET /metrics`` (Prometheus text, ``cpullm.serve.metrics``) and ``GET /``
(a small chat page, ``cpullm/serve/static``).

Bounds: ``request_timeout`` seconds of generation per request (then it ends with finish_reason
"length"). A client has ``header_timeout`` seconds to send its request line and headers (else
the connection closes; a custom uvicorn protocol, since uvicorn bounds only idle keep-alive
connections) and ``body_timeout`` seconds for its body (else 408). Chat templates render in a
worker process with their own time and memory limits (``cpullm.generate.chat``); a client that leaves
during the render stops it. ``/health`` and ``/v1/models`` report the limits. On SIGINT/SIGTERM
the engine stops first: the running generation and every waiting request end with the 503
``server_shutting_down`` error (a stream gets it as its last event).

With an API key, every ``/v1/``, ``/tokenize``, ``/detokenize`` and ``/metrics`` request needs
``Authorization: Bearer KEY`` (compared in constant time; a Prometheus scrape job sends it as its
``authorization`` credentials); the page and ``/health`` stay open (they reveal nothing and run nothing). Bound to
loopback, the server also refuses Host headers that are not loopback names (DNS rebinding), and
POST bodies must be ``application/json`` (so a web page elsewhere cannot post to it without a
CORS preflight, which this server never grants).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import sys
import threading
import time
import traceback
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ChatTemplateError, ConfigError, CpullmError
from .engine import DEFAULT_MAX_QUEUE, Engine, Job, job_pieces
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import ServerMetrics, available as metrics_available, unavailable_text
from .openai import (LogprobCursor, choice_sampling, choices_count, merge_choices, DEFAULT_MAX_TOKENS_CAP, DEFAULT_REQUEST_TIMEOUT_S, Api, ApiError, RequestSpec,
                     error_body, json_bytes, json_text, shutting_down_error, surrogate_path)

if TYPE_CHECKING:
    from starlette.exceptions import HTTPException
    from starlette.requests import Request

STATIC_DIR = Path(__file__).parent / "static"
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20
DEFAULT_HEADER_TIMEOUT_S = 10.0       # to send a request's line and headers
DEFAULT_BODY_TIMEOUT_S = 30.0         # to send its body (4 MiB at ~140 KB/s)
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0     # SIGTERM: running generations' time to finish
KEYED_PATHS = {"/tokenize", "/detokenize", "/metrics"}   # outside /v1/, behind the API key all the same
LOOPBACK_NAMES = {"127.0.0.1", "localhost", "::1", "[::1]"}
PAGE_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; connect-src 'self'; "
            "img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")


# ---- ASGI plumbing --------------------------------------------------------------------------------
def _host_name(host_header: str) -> str:
    h = host_header.strip().lower()
    if h.startswith("["):
        return h[: h.find("]") + 1] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


async def _send_json(send, status: int, obj, headers=()) -> None:
    body = json_bytes(obj)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


MAX_HEADER_BYTES = 16 * 1024        # request line aside: names and values of every header


def headers_too_large_error() -> dict:
    """The 431 body, the same whether the headers arrived whole (the Guard counts them) or in
    pieces that h11 stopped buffering at its own 16 KiB limit (the protocol answers)."""
    return {"error": {"message": f"the request headers are over {MAX_HEADER_BYTES // 1024} KiB; send "
                                 "fewer or shorter headers", "type": "invalid_request_error",
                      "param": None, "code": "headers_too_large"}}


def check_api_keys(keys) -> list[str]:
    """The API keys (a string or a list), each 1..4096 visible ASCII characters (what a client
    can send in an Authorization header); anything else is a ConfigError at start, not a key
    no client could ever send."""
    keys = [keys] if isinstance(keys, str) else list(keys or [])
    for i, k in enumerate(keys):
        if not isinstance(k, str) or not 0 < len(k) <= 4096 or not all("!" <= c <= "~" for c in k):
            raise ConfigError(f"API key {i + 1} must be 1 to 4096 visible ASCII characters (no spaces, "
                              "no other alphabets): a client could not send it in an HTTP header")
    return keys


def tenant_salt(key: bytes) -> str:
    """The prefix-cache salt of the requests made with ``key``: its tenant's, never the key."""
    import hashlib
    return "key:" + hashlib.sha256(b"cpullm prefix cache tenant\0" + key).hexdigest()[:32]


class Guard:
    """Pure ASGI middleware: Host check (loopback servers), header size, bearer API key on /v1/
    (any of the keys; each key is a tenant, whose salt goes to ``scope["cpullm.tenant"]``), a
    last-resort JSON 500, and ``nosniff`` on every response. ``scope["cpullm.authorized"]``
    says whether the request may see the server's statistics (no key, or a valid one)."""

    def __init__(self, app, api_key, allowed_hosts: set[str] | None, engine=None):
        self.app = app
        self.api_keys = [k.encode() for k in check_api_keys(api_key)]
        self.api_key = self.api_keys[0] if self.api_keys else None
        self.allowed_hosts = allowed_hosts
        self.engine = engine
        self.metrics: ServerMetrics | None = None     # counts every response's status when set

    def _key_of(self, token: str) -> bytes | None:
        """The configured key equal to ``token`` (every key compared, in constant time each)."""
        got = None
        raw = token.encode("latin-1", "replace")
        for k in self.api_keys:
            if hmac.compare_digest(raw, k):
                got = k
        return got

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if sum(len(k) + len(v) + 4 for k, v in scope["headers"]) > MAX_HEADER_BYTES:
            return await _send_json(send, 431, headers_too_large_error())
        if self.metrics is not None:
            send = self.metrics.counting_send(send, scope["path"])
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.allowed_hosts is not None and _host_name(headers.get("host", "")) not in self.allowed_hosts:
            return await _send_json(send, 400, {"error": {
                "message": "this server is bound to loopback and only answers requests for "
                           "localhost / 127.0.0.1 / [::1] (Host header refused)",
                "type": "invalid_request_error", "param": None, "code": "invalid_host"}})
        key = None
        if self.api_keys:
            scheme, _, token = headers.get("authorization", "").partition(" ")
            key = self._key_of(token.strip()) if scheme.lower() == "bearer" else None
        scope["cpullm.authorized"] = not self.api_keys or key is not None
        scope["cpullm.tenant"] = tenant_salt(key) if key is not None and len(self.api_keys) > 1 else None
        if self.api_keys and (scope["path"].startswith("/v1") or scope["path"] in KEYED_PATHS):
            if key is None:
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

        _, body = error_body(shutting_down_error())
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


class ClientLeft(Exception):
    """The client hung up before its request was read whole: nobody to answer (counted as
    cancelled, not logged)."""


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

    from starlette.requests import ClientDisconnect

    buf = bytearray()
    with anyio.move_on_after(timeout) as scope:
        try:
            async for chunk in request.stream():
                buf += chunk
                if len(buf) > limit:
                    raise ApiError(f"the request body is over the limit of {limit} bytes (the server's "
                                   "--max-request-bytes)", 413, "request_too_large")
        except ClientDisconnect:
            raise ClientLeft() from None
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
    where = surrogate_path(body)
    if where is not None:
        top = where.split(".")[0].split("[")[0]
        raise ApiError(f"{where[:200]} holds a lone UTF-16 surrogate (an escape such as \\ud800 "
                       "without its pair), which is not text; send valid Unicode",
                       param=top if top in body else None, code="invalid_value")
    return body


def _cache_salt(request, spec: RequestSpec) -> str | None:
    """The prefix-cache salt of a request's sequences: its tenant's (the API key's), narrowed by
    its own ``cache_salt``."""
    tenant = request.scope.get("cpullm.tenant")
    return tenant if spec.cache_salt is None else f"{tenant}|salt:{spec.cache_salt}"


def error_response(exc: Exception):
    """The OpenAI error JSON for ``exc``; an unexpected failure's traceback goes to the log."""
    from starlette.responses import Response

    status, body = error_body(exc)
    if status >= 500 and not isinstance(exc, CpullmError):
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    return Response(json_bytes(body), status, media_type="application/json",
                    headers=getattr(exc, "headers", None))


class Endpoints:
    """The route handlers over one :class:`Api` (its model and engine) and the body limits."""

    def __init__(self, api: Api, max_request_bytes: int, body_timeout: float,
                 metrics: ServerMetrics | None = None):
        self.api = api
        self.engine = api.engine
        self.metrics = metrics
        self.max_request_bytes = max_request_bytes
        self.body_timeout = body_timeout

    def routes(self) -> list:
        from starlette.routing import Mount, Route
        from starlette.staticfiles import StaticFiles

        return [
            Route("/", self.page, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics_text, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.model_info, methods=["GET"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
        ]

    async def models(self, request: Request):
        from starlette.responses import JSONResponse
        return JSONResponse({"object": "list", "data": [_model_card(self.api)]})

    async def model_info(self, request: Request):
        from starlette.responses import JSONResponse

        mid, model_id = request.path_params["model_id"], self.api.model_id
        if mid not in self.api.model_ids:
            return error_response(ApiError(f"The model `{mid}` does not exist: this server runs "
                                           f"`{model_id}`", 404, "model_not_found", "model"))
        return JSONResponse(_model_card(self.api))

    async def health(self, request: Request):
        """Open to all; the prefix cache's statistics only with the API key (hits tell whether
        someone sent a prompt, so they are the key holders' business)."""
        from starlette.responses import JSONResponse
        snap = self.engine.snapshot()
        if not request.scope.get("cpullm.authorized", True):
            snap.pop("prefix_cache", None)
        return JSONResponse({"status": "ok", "model": self.api.model_id, "n_ctx": self.api.model.n_ctx,
                             "limits": _limits(self.api, self.max_request_bytes, self.body_timeout),
                             **snap})

    async def metrics_text(self, request: Request):
        from starlette.responses import Response

        if self.metrics is None:
            return error_response(ApiError(unavailable_text(), 501, "metrics_unavailable"))
        return Response(self.metrics.exposition(), 200, media_type=METRICS_CONTENT_TYPE)

    async def page(self, request: Request):
        from starlette.responses import FileResponse
        return FileResponse(STATIC_DIR / "index.html", headers={
            "content-security-policy": PAGE_CSP, "cache-control": "no-cache"})

    async def completions(self, request: Request):
        return await self._complete(request, self.api.prepare_completion)

    async def chat_completions(self, request: Request):
        return await self._complete(request, self.api.prepare_chat)

    async def embeddings(self, request: Request):
        return await self._answer(request, self.api.embeddings)

    async def tokenize(self, request: Request):
        return await self._answer(request, self.api.tokenize)

    async def detokenize(self, request: Request):
        return await self._answer(request, self.api.detokenize)

    async def _answer(self, request: Request, handle):
        """A JSON request answered by ``handle(body) -> dict`` in a worker thread (tokenizing a
        long text must not stall the event loop)."""
        import anyio
        from starlette.responses import Response

        try:
            body = await _read_json(request, self.max_request_bytes, self.body_timeout)
            out = await anyio.to_thread.run_sync(handle, body)
        except Exception as exc:
            return error_response(exc)
        return Response(json_bytes(out), 200, media_type="application/json")

    async def not_found(self, request: Request, exc: HTTPException):
        """404 and 405 (and any other HTTPException) as OpenAI-shaped errors."""
        if exc.status_code == 404:
            e = ApiError(f"Unknown request URL: {request.method} {request.url.path}. Endpoints: "
                         "GET /v1/models, POST /v1/chat/completions, POST /v1/completions, "
                         "POST /v1/embeddings, POST /tokenize, POST /detokenize, GET /health, GET /metrics, GET /",
                         404, "unknown_url")
        elif exc.status_code == 405:
            e = ApiError(f"{request.method} is not allowed on {request.url.path}", 405,
                         "method_not_allowed")
        else:
            e = ApiError(str(exc.detail), exc.status_code)
        return error_response(e)

    @asynccontextmanager
    async def lifespan(self, app):
        try:
            yield
        finally:
            self.engine.close()

    async def _prepare(self, request: Request, prepare, body):
        """Render and tokenize in a thread; a client that leaves meanwhile cancels the render
        (its worker is killed, nothing keeps running for nobody). Returns (spec, gone)."""
        import anyio

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

    async def _complete(self, request: Request, prepare):
        """Read, prepare and submit one completion request; answer it streamed or whole."""
        from starlette.responses import Response

        api, engine = self.api, self.engine
        try:
            try:
                body = await _read_json(request, self.max_request_bytes, self.body_timeout)
            except ClientLeft:
                engine.count_left_early()
                return Response(b"", 499)            # the client left; nobody reads this
            spec, gone = await self._prepare(request, prepare, body)
            if gone:
                engine.count_left_early()
                return Response(b"", 499)            # the client left; nobody reads this
            n = choices_count(body)
            if n > 1:
                return await self._complete_choices(request, spec, n)
            job = Job(spec.ids, spec.max_tokens, spec.sampling, spec.stop, api.request_timeout,
                      parser=spec.parser())
            job.cache_salt = _cache_salt(request, spec)
            out = engine.submit(job, asyncio.get_running_loop())
        except Exception as exc:
            if engine.closed and (isinstance(exc, ChatTemplateError) or
                                  getattr(exc, "openai_code", None) == "chat_template_error"):
                exc = shutting_down_error()           # the render was stopped by the shutdown
            return error_response(exc)
        rid = ("chatcmpl-" if spec.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        pieces = job_pieces(out, job)
        if self.metrics is not None:
            pieces = self.metrics.timed(pieces, job)
        if spec.stream:
            return SSEResponse(_sse_events(api, spec, job, pieces, rid, created), job.cancel.set)
        return await _collect(request, api, spec, job, pieces, rid, created)


    async def _complete_choices(self, request: Request, spec: RequestSpec, n: int):
        """``n`` choices of one request: ``n`` jobs, each its own sequence with its own seed
        offset (and its own copy of the constraint); their prompt is the same, so the scheduler's
        prefix cache shares its KV in whole blocks. Each is answered as a request of its own would
        be, and the answers are merged with their choices re-indexed."""
        api, engine = self.api, self.engine
        loop = asyncio.get_running_loop()
        jobs, outs = [], []
        try:
            for i in range(n):
                job = Job(spec.ids, spec.max_tokens, choice_sampling(spec.sampling, i), spec.stop,
                          api.request_timeout, parser=spec.parser())
                job.cache_salt = _cache_salt(request, spec)
                outs.append(engine.submit(job, loop))
                jobs.append(job)
        except Exception as exc:
            for job in jobs:
                job.cancel.set()
            return error_response(exc)
        rid = ("chatcmpl-" if spec.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())

        def cancel_all():
            for job in jobs:
                job.cancel.set()

        if spec.stream:
            streams = [_sse_events(api, spec, job, job_pieces(out, job), rid, created) for job, out in zip(jobs, outs)]
            return SSEResponse(_merged_events(streams, spec), cancel_all)
        from starlette.responses import Response
        answers = await asyncio.gather(*[_collect(request, api, spec, job, job_pieces(out, job), rid, created)
                                         for job, out in zip(jobs, outs)])
        for r in answers:
            if r.status_code != 200:
                cancel_all()
                return r
        return Response(json_bytes(merge_choices([json.loads(r.body) for r in answers])), 200,
                        media_type="application/json")


async def _merged_events(streams, spec: RequestSpec):
    """The ``data:`` payloads of several choices' streams, as they come, each chunk's choice
    re-indexed; one usage chunk (prompt counted once) and one ``[DONE]`` at the end."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, events):
        try:
            async for data in events:
                await queue.put((i, data))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, ev)) for i, ev in enumerate(streams)]
    left, usage = len(tasks), None
    try:
        while left:
            i, data = await queue.get()
            if data is None:
                left -= 1
                continue
            if data == "[DONE]":
                continue
            obj = json.loads(data)
            if "error" in obj:
                yield data
                continue
            if not obj.get("choices"):                  # a choice's usage chunk: summed below
                u = obj.get("usage") or {}
                usage = usage or {"prompt_tokens": u.get("prompt_tokens", 0), "completion_tokens": 0}
                usage["completion_tokens"] += u.get("completion_tokens", 0)
                last = obj
                continue
            for c in obj["choices"]:
                c["index"] = i
            if spec.include_usage:
                obj["usage"] = None
            yield json_text(obj)
        if usage is not None:
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            yield json_text({**last, "choices": [], "usage": usage})
    finally:
        for t in tasks:
            t.cancel()
    yield "[DONE]"


def create_app(model, model_id: str | None = None, api_key: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, max_queue: int = DEFAULT_MAX_QUEUE,
               allowed_hosts: set[str] | None = None, max_tokens_cap: int = DEFAULT_MAX_TOKENS_CAP,
               request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT_S,
               body_timeout: float = DEFAULT_BODY_TIMEOUT_S, parallel: int | None = None,
               prefix_cache_bytes: int | None = None, prefill_chunk: int | None = None,
               model_aliases: tuple[str, ...] = ()):
    """The ASGI application serving ``model`` as ``model_id`` (also answering to
    ``model_aliases`` and the model's file name); ``parallel`` streams at once (None: chosen from
    the machine, :func:`cpullm.generate.engine.default_parallel`); ``prefix_cache_bytes`` bounds the KV
    kept for shared prompt prefixes (None: :func:`cpullm.generate.engine.default_prefix_cache_bytes`);
    ``prefill_chunk``: prompt tokens prefilled per scheduler step, also the prefix cache's block
    (None: the program's max chunk). ``allowed_hosts``: Host names accepted (None: any).
    ``max_tokens_cap``: the longest answer (an omitted max_tokens gets it); ``request_timeout``:
    seconds of generation per request (None: no limit); ``body_timeout``: seconds to send a body."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException

    model_id = model_id or Path(str(model.model_dir)).name
    engine = Engine(model, max_queue=max_queue, parallel=parallel, prefill_chunk=prefill_chunk,
                    prefix_cache_bytes=prefix_cache_bytes)
    api = Api(model, model_id, engine, max_tokens_cap=max_tokens_cap, request_timeout=request_timeout)
    api.model_ids = {model_id, Path(str(model.model_dir)).name, *model_aliases}
    metrics = ServerMetrics(engine, model, model_id) if metrics_available() else None
    endpoints = Endpoints(api, max_request_bytes, body_timeout, metrics)
    app = Starlette(routes=endpoints.routes(), exception_handlers={HTTPException: endpoints.not_found},
                    lifespan=endpoints.lifespan)
    app.state.engine = engine
    app.state.model_id = model_id
    app.state.metrics = metrics
    guarded = Guard(app, api_key, allowed_hosts, engine)
    guarded.engine = engine
    guarded.metrics = metrics
    return guarded


def _limits(api: Api, max_request_bytes: int | None = None, body_timeout: float | None = None) -> dict:
    from ..generate import chat

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


async def _collect(request, api: Api, spec: RequestSpec, job: Job, pieces, rid, created):
    """A non-streaming answer from ``pieces`` (the job's text, :func:`job_pieces`); a client
    that disconnects while waiting cancels its job."""
    import anyio
    from starlette.responses import Response

    from ..toolcalls import Answer, collect

    answer = Answer()
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
            async for event in pieces:
                collect([event], answer)
        except Exception as exc:
            failure = exc
        tg.cancel_scope.cancel()
    if gone:
        return Response(b"", 499)                  # the client left; nobody reads this
    if failure is not None:
        return error_response(failure)
    obj = api.answer(spec, rid, created, answer, job.stats)
    obj["choices"][0]["logprobs"] = LogprobCursor(spec, api.model.tokenizer, job.seq).whole()
    return Response(json_bytes(obj), 200, media_type="application/json")


async def _sse_events(api: Api, spec: RequestSpec, job: Job, pieces, rid, created):
    """The ``data:`` payloads of a streamed answer (``pieces``: the job's text), ``[DONE]`` last; an error mid-stream is sent
    as an ``{"error": ...}`` event."""
    chat = spec.kind == "chat"
    lps = LogprobCursor(spec, api.model.tokenizer, job.seq)

    def chunk(**fields):
        return api.chunk(spec, rid, created, **fields)

    try:
        if chat:
            yield chunk(delta={"role": "assistant", "content": ""})
        calls = 0
        async for kind, value in pieces:
            if not chat:
                yield chunk(text=value, logprobs=lps.take())
            elif kind == "tool_call":
                yield chunk(delta={"tool_calls": [{"index": calls, **value.openai()}]}, logprobs=lps.take())
                calls += 1
            else:
                yield chunk(delta={"reasoning_content" if kind == "reasoning" else "content": value},
                            logprobs=lps.take())
        yield chunk(delta={}, text="", finish=api.finish_reason(job.stats, calls), logprobs=lps.take(final=True))
        if spec.include_usage:
            yield chunk(empty=True, usage=api.usage(job.stats, spec))
    except Exception as exc:
        _, body = error_body(exc)
        if not isinstance(exc, CpullmError):
            traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        yield json_text(body)
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
    connection is closed. The body has its own deadline in the application.

    Headers too large get the Guard's 431 however they arrive. Sent whole in one read, h11
    parses them and the Guard counts them; in pieces, h11 stops buffering at 16 KiB with
    ``error_status_hint`` 431, which uvicorn would answer as a plain-text 400."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutProtocol(H11Protocol):
        _header_cycle = 0
        _header_timer = None
        _protocol_error = None

        def connection_made(self, transport):
            super().connection_made(transport)
            next_event = self.conn.next_event

            def next_event_noting_errors():
                try:
                    return next_event()
                except h11.RemoteProtocolError as exc:
                    self._protocol_error = exc
                    raise
            self.conn.next_event = next_event_noting_errors
            self._arm_header_deadline()

        def send_400_response(self, msg: str) -> None:
            if getattr(self._protocol_error, "error_status_hint", None) != 431:
                return super().send_400_response(msg)
            body = json_bytes(headers_too_large_error())
            self.transport.write(self.conn.send(h11.Response(
                status_code=431, reason=b"Request Header Fields Too Large",
                headers=[(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                         (b"x-content-type-options", b"nosniff"), (b"connection", b"close")])))
            self.transport.write(self.conn.send(h11.Data(data=body)))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
            self.transport.close()

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
          prefix_cache_bytes: int | None = None, prefill_chunk: int | None = None,
          shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S, model_aliases: tuple[str, ...] = (),
          on_ready=None) -> None:
    """Serve until interrupted. ``port=0`` picks a free port; ``announce`` gets the ready line
    (with the real URL) once the socket listens, and ``on_ready(host, port)`` is called then. On
    SIGINT/SIGTERM the server stops accepting, every waiting client gets the 503 JSON error,
    running generations have ``shutdown_timeout`` seconds to finish, then the rest end with an
    error event (a stream) or the 503 JSON error, and the template worker stops, before
    uvicorn's graceful close."""
    import socket

    import uvicorn

    from ..generate.chat import stop_render_worker

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            # stop accepting, refuse what waits, let what generates finish within the grace
            # period, then end the rest with the shutdown error (a stream's last event)
            for server in self.servers:
                server.close()
            app.engine.drain()
            deadline = time.monotonic() + shutdown_timeout
            # the grace period covers generating and sending: a stream whose tokens are all made
            # may still be on its way to a slow client (uvicorn's request tasks)
            while (app.engine.running() or self.server_state.tasks) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            app.engine.close()
            stop_render_worker()
            await super().shutdown(sockets=sockets)

    allowed = LOOPBACK_NAMES if is_loopback(host) else None
    app = create_app(model, model_id=model_id, api_key=api_key, max_request_bytes=max_request_bytes,
                     max_queue=max_queue, allowed_hosts=allowed, max_tokens_cap=max_tokens_cap,
                     request_timeout=request_timeout, body_timeout=body_timeout, parallel=parallel,
                     prefix_cache_bytes=prefix_cache_bytes, prefill_chunk=prefill_chunk,
                     model_aliases=model_aliases)
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
    import signal

    class _Terminated(Exception):
        pass

    def _on_sigterm(signum, frame):       # uvicorn re-raises the signal it handled once it is done
        raise _Terminated()

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    if on_ready is not None:
        on_ready(bind_host, real_port)
    try:
        server.run(sockets=[sock])
    except _Terminated:
        pass                              # a graceful stop: exit status 0
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        app.engine.close()
        stop_render_worker()
        sock.close()
