"""``cpullm serve MODEL --ray``: replicas on Ray Serve behind one OpenAI-compatible endpoint.

Two deployments:

- :class:`Replica` (``--replicas`` of them, ``--threads`` CPUs each): a loaded model and the
  single server's whole ASGI application (``cpullm.serve.http.create_app``: routes, API key,
  limits, streaming, error shapes), called in process (:func:`cpullm.serve.jobs.call_app`) with
  each request's method, path, headers and body; the ASGI messages it sends stream back.
- :class:`Ingress` (one, no CPU reserved): the HTTP entry point behind Ray's proxy. It reads a
  request's body (bounded by --max-request-bytes and --body-timeout), picks its routing key (the
  first ``ROUTE_PREFIX_CHARS`` characters of the prompt, or of the messages as JSON) and
  forwards it to a replica; ``GET /metrics`` merges every replica's metrics (label ``replica``)
  with its own.

Prefix-aware routing: :class:`PrefixRouter` is the replicas' Ray Serve request router. It ranks
the live replicas by rendezvous hashing of the key (highest ``hash(key, replica)`` first), so
requests sharing a prompt prefix (a system prompt) go to the same replica and hit its prefix
cache, and when a replica is added or lost only the keys it owned move. A replica at its
``max_ongoing_requests`` is passed over for the next in rank (load spills instead of queueing).

Failures: Ray restarts a replica that dies (its actor, or a failed health check). A request
whose replica dies before the answer started is retried on another replica (at most
``RETRIES`` times); one whose stream had started ends with an OpenAI-shaped error event
(``replica_failed``). The replicas push their metrics to the ingress every
``METRICS_PUSH_S`` seconds; a replica silent for three periods leaves ``/metrics``.
Ray Serve's own metrics (queue lengths, latencies per deployment) are on Ray's metrics port
(``ray start --metrics-export-port``), not on this endpoint.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import threading
import time

from ray import serve
from ray.serve.request_router import FIFOMixin, RequestRouter

APP_NAME = "cpullm"
ROUTE_PREFIX_CHARS = 512
RETRIES = 3
METRICS_PUSH_S = 2.0


# ---- routing -------------------------------------------------------------------------------------
def route_key(path: str, body: bytes) -> str:
    """The prefix that decides a request's replica: the first ROUTE_PREFIX_CHARS characters of
    its prompt (completions) or of its messages as JSON (chat); the path alone when there is none."""
    try:
        obj = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError, RecursionError):
        obj = None
    if isinstance(obj, dict):
        part = obj.get("messages") if path.endswith("/chat/completions") else obj.get("prompt")
        if part is not None:
            try:
                text = part if isinstance(part, str) else json.dumps(part, ensure_ascii=False,
                                                                    separators=(",", ":"))
            except (TypeError, ValueError, RecursionError):
                text = ""
            return path + "\n" + text[:ROUTE_PREFIX_CHARS]
    return path


def _rank(key: str, replica_id: str) -> bytes:
    return hashlib.blake2b(f"{key}\0{replica_id}".encode("utf-8", "surrogatepass"), digest_size=8).digest()


class PrefixRouter(FIFOMixin, RequestRouter):
    """Ray Serve request router: replicas ranked by rendezvous hash of the request's route key
    (its first argument); the first that has room takes it."""

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if not candidate_replicas:
            return []
        if pending_request is None or not pending_request.args or not isinstance(pending_request.args[0], str):
            return [list(candidate_replicas)]
        key = pending_request.args[0]
        ranked = sorted(candidate_replicas, key=lambda r: _rank(key, r.replica_id.unique_id), reverse=True)
        return [[r] for r in ranked]


# ---- the replicas ---------------------------------------------------------------------------------
class Replica:
    """One model and the single server's application; each request answered through it."""

    def __init__(self, options: dict, app_options: dict):
        from ..serve.jobs import build_app

        self.app = build_app(options, **app_options)
        self.metrics = getattr(self.app, "metrics", None)
        ctx = serve.get_replica_context()
        self.replica_id = ctx.replica_id.unique_id
        self._stop = threading.Event()
        if self.metrics is not None:
            threading.Thread(target=self._push_metrics, name="cpullm-metrics-push", daemon=True).start()

    async def handle(self, key: str, request: dict):
        """The ASGI messages of the app's answer to ``request`` (``key`` is for the router)."""
        from ..serve.jobs import call_app

        async for msg in call_app(self.app, request["path"], request["body"], headers=request["headers"],
                                  method=request["method"], query=request["query"]):
            yield msg

    def pid(self, key: str = "") -> int:
        """This replica's process id (``key`` routes the call like a request's)."""
        return os.getpid()

    def _push_metrics(self) -> None:
        handle = serve.get_deployment_handle("Ingress", app_name=APP_NAME)
        while not self._stop.wait(METRICS_PUSH_S):
            try:
                handle.report.remote(self.replica_id, self.metrics.exposition()).result(timeout_s=10)
            except Exception:         # the ingress restarting: the next push catches up
                pass

    def __del__(self):
        self._stop.set()
        engine = getattr(getattr(self, "app", None), "engine", None)
        if engine is not None:
            engine.close()


# ---- the entry point -----------------------------------------------------------------------------
class Ingress:
    """The HTTP entry point: bounded body read, routing key, forwarding with retries, /metrics."""

    def __init__(self, replicas, api_key: str | None, max_request_bytes: int, body_timeout: float):
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.replicas = replicas.options(stream=True)
        self.api_key = api_key.encode() if api_key else None
        self.max_request_bytes = max_request_bytes
        self.body_timeout = body_timeout
        self.reports: dict[str, tuple[float, bytes]] = {}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_MergedReplicas(self.reports))
        self.forwarded = Counter("cpullm_ray_forwarded_requests", "Requests forwarded to a replica",
                                 registry=self.registry)
        self.retries = Counter("cpullm_ray_retries", "Requests retried on another replica after theirs "
                               "died before answering", registry=self.registry)
        self.broken = Counter("cpullm_ray_broken_streams", "Answers cut by their replica's failure",
                              registry=self.registry)
        self.overhead = Gauge("cpullm_ray_replicas_reporting", "Replicas whose metrics are current",
                              registry=self.registry)
        self.overhead.set_function(lambda: sum(1 for t, _ in list(self.reports.values())
                                               if time.monotonic() - t < 3 * METRICS_PUSH_S))

    def report(self, replica_id: str, text: bytes) -> None:
        self.reports[replica_id] = (time.monotonic(), text)

    async def __call__(self, request):
        from ..serve.http import error_response
        from ..serve.openai import ApiError

        if request.url.path == "/metrics":
            return self._metrics(request)
        try:
            body = await self._read_body(request)
        except ApiError as exc:
            return error_response(exc)
        req = {"method": request.method, "path": request.url.path, "query": request.url.query.encode(),
               "headers": [(k, v) for k, v in request.headers.raw], "body": body}
        return await self._forward(route_key(req["path"], body), req)

    async def _read_body(self, request) -> bytes:
        """At most max_request_bytes + 1 bytes (the replica answers the 413), within body_timeout."""
        import anyio

        from ..serve.openai import ApiError

        buf = bytearray()
        with anyio.move_on_after(self.body_timeout) as scope:
            async for chunk in request.stream():
                buf += chunk
                if len(buf) > self.max_request_bytes:
                    break
        if scope.cancelled_caught:
            raise ApiError(f"the request body did not arrive within {self.body_timeout:g} s; send it "
                           "at once", 408, "request_timeout")
        return bytes(buf[: self.max_request_bytes + 1])

    async def _forward(self, key: str, req: dict):
        from ray.exceptions import RayError
        from starlette.responses import StreamingResponse

        from ..serve.http import error_response
        from ..serve.openai import ApiError

        self.forwarded.inc()
        for attempt in range(RETRIES + 1):
            gen = self.replicas.handle.remote(key, req)
            try:
                start = await gen.__anext__()
                break
            except (RayError, ConnectionError) as exc:
                gen.cancel()
                failure = exc
                if attempt < RETRIES:
                    self.retries.inc()
                    await asyncio.sleep(0.25 * 2 ** attempt)      # let Ray drop the dead replica
            except StopAsyncIteration:
                return error_response(RuntimeError("the replica sent no answer"))
        else:
            return error_response(ApiError(f"no replica could answer ({type(failure).__name__}); "
                                           "retry in a moment", 503, "replica_failed"))
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start.get("headers", [])}
        streaming = headers.get("content-type", "").startswith("text/event-stream")

        async def body():
            try:
                async for msg in gen:
                    if msg["type"] == "http.response.body" and msg.get("body"):
                        yield msg["body"]
            except (RayError, ConnectionError):
                self.broken.inc()
                if streaming:
                    err = {"error": {"message": "the replica answering this request failed; retry it",
                                     "type": "server_error", "param": None, "code": "replica_failed"}}
                    yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
            finally:
                gen.cancel()

        headers.pop("content-length", None) if streaming else None
        return StreamingResponse(body(), status_code=start["status"], headers=headers)

    def _metrics(self, request):
        from prometheus_client import generate_latest
        from starlette.responses import Response

        from ..serve.http import error_response
        from ..serve.metrics import CONTENT_TYPE
        from ..serve.openai import ApiError

        if self.api_key is not None:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key):
                return error_response(ApiError("Incorrect or missing API key: send the header "
                                               "'Authorization: Bearer <key>' with the key the server "
                                               "was started with", 401, "invalid_api_key"))
        return Response(generate_latest(self.registry), 200, media_type=CONTENT_TYPE)


class _MergedReplicas:
    """The replicas' latest metrics as one set of families, each sample labelled ``replica``."""

    def __init__(self, reports: dict):
        self.reports = reports

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.parser import text_string_to_metric_families
        from prometheus_client.samples import Sample

        merged: dict = {}
        now = time.monotonic()
        for rid, (t, text) in sorted(self.reports.items()):
            if now - t > 3 * METRICS_PUSH_S:
                continue
            for fam in text_string_to_metric_families(text.decode("utf-8")):
                out = merged.get(fam.name)
                if out is None:
                    out = merged[fam.name] = type(fam)(fam.name, fam.documentation, fam.type, fam.unit)
                out.samples.extend(Sample(s.name, {**s.labels, "replica": rid}, s.value, s.timestamp,
                                          s.exemplar) for s in fam.samples)
        return list(merged.values())


# ---- deploying -----------------------------------------------------------------------------------
def deploy(options: dict, replicas: int, threads: int, host: str = "127.0.0.1", port: int = 8000,
           api_key: str | None = None, max_request_bytes: int = 4 * 2**20, body_timeout: float = 30.0,
           app_options: dict | None = None, max_queue: int = 64, max_replicas: int | None = None):
    """Start Ray Serve's proxy on host:port and deploy ``replicas`` x ``threads``; returns when
    every replica has loaded its model. With ``max_replicas``, Ray Serve scales between the two
    on the requests each replica has in hand (target: its --parallel). The caller joined or
    started the cluster."""
    from ..serve.http import LOOPBACK_NAMES, is_loopback
    from ..errors import ConfigError
    from . import check_cores

    if max_replicas is not None and max_replicas < replicas:
        raise ConfigError(f"--max-replicas {max_replicas} is below --replicas {replicas}; raise it")
    check_cores(max_replicas or replicas, threads)
    import logging
    logging.getLogger("ray.serve").setLevel(logging.WARNING)     # its INFO lines; warnings show
    options = dict(options, threads=threads)
    parallel = options.get("parallel") or min(8, 4 * threads)
    app_options = dict(app_options or {}, api_key=api_key, max_request_bytes=max_request_bytes,
                       body_timeout=body_timeout, max_queue=max_queue,
                       allowed_hosts=LOOPBACK_NAMES if is_loopback(host) else None)
    serve.start(http_options={"host": host.strip("[]"), "port": port})
    scaling = {"num_replicas": replicas} if not max_replicas or max_replicas == replicas else {
        "num_replicas": "auto", "autoscaling_config": {
            "min_replicas": replicas, "initial_replicas": replicas, "max_replicas": max_replicas,
            "target_ongoing_requests": parallel}}
    replica = serve.deployment(Replica, name="Replica", **scaling,
                               ray_actor_options={"num_cpus": threads},
                               max_ongoing_requests=2 * parallel, max_queued_requests=max_queue,
                               health_check_period_s=5, health_check_timeout_s=30,
                               request_router_config={"request_router_class": PrefixRouter})
    ingress = serve.deployment(Ingress, name="Ingress", num_replicas=1, ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=10_000)
    app = ingress.bind(replica.bind(options, app_options), api_key, max_request_bytes, body_timeout)
    return serve.run(app, name=APP_NAME, route_prefix="/")


def shutdown() -> None:
    serve.shutdown()
