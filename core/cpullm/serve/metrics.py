"""``GET /metrics``: the server's state in the Prometheus text format (``prometheus-client``).

Each application has its own :class:`prometheus_client.CollectorRegistry` (never the process's
global one), so several servers in one process (tests, Ray replicas sharing a worker) do not
clash. Two kinds of series:

- read at scrape time from the engine's own counters (the ones ``/health`` reports, the single
  source of truth): requests by outcome, generated tokens, queue depth, running sequences, KV
  memory, prefix-cache hits / misses / reused tokens, model load and compile time;
- observed by the HTTP layer as requests pass: responses by route and HTTP status, prompt
  tokens submitted, time to first token (from submission to the first text piece the client
  gets, queueing included) and time per output token (first piece to the end, over the tokens
  after the first) histograms.

``prometheus-client`` is in the ``serve`` extra; without it ``/metrics`` answers 501 naming it.
"""
from __future__ import annotations

import time

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/")
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)


def available() -> bool:
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return False
    return True


def route_label(path: str) -> str:
    """A bounded label for a request path: a known route, else "other" (clients choose paths)."""
    if path in ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{id}"
    if path.startswith("/static/"):
        return "/static"
    return "other"


class EngineCollector:
    """Series read from the engine's snapshot (and the model's load info) at each scrape."""

    def __init__(self, engine, model, model_id: str):
        self.engine = engine
        self.model = model
        self.model_id = model_id

    def describe(self):
        return []          # nothing at registration: collect() reads a live engine

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.engine.snapshot()
        pc = s.get("prefix_cache") or {}
        m = self.model
        out = []

        def gauge(name, doc, value):
            out.append(GaugeMetricFamily(name, doc, value=float(value)))

        def counter(name, doc, value):
            out.append(CounterMetricFamily(name, doc, value=float(value)))

        info = GaugeMetricFamily("cpullm_model_info", "The model this server runs (value 1)",
                                 labels=["model", "family", "quant", "kv_dtype"])
        info.add_metric([self.model_id, str(m.family.name), str(m.quant), str(s.get("kv_dtype"))], 1.0)
        out.append(info)
        req = CounterMetricFamily("cpullm_requests", "Generations by how they ended (requests "
                                  "submitted: outcome=\"submitted\")", labels=["outcome"])
        req.add_metric(["submitted"], float(s["requests"]))
        for outcome in ("completed", "cancelled", "failed", "timed_out"):
            req.add_metric([outcome], float(s[outcome]))
        out.append(req)
        counter("cpullm_generation_tokens", "Tokens generated", s["generated_tokens"])
        counter("cpullm_prefill_tokens", "Prompt tokens prefilled (not restored from the prefix cache)",
                pc.get("prefilled_tokens", 0))
        gauge("cpullm_queue_depth", "Requests waiting for a slot", s["queued"])
        gauge("cpullm_running_sequences", "Sequences generating now", s["active"])
        gauge("cpullm_parallel", "Sequences that can generate at once (--parallel)", s["parallel"])
        gauge("cpullm_kv_cache_planned_bytes", "KV and state memory allocated for --parallel sequences",
              s["kv_bytes_planned"])
        gauge("cpullm_kv_cache_in_use_bytes", "KV and state memory of the running sequences",
              s["active"] * s["kv_bytes_per_stream"])
        gauge("cpullm_prefix_cache_bytes", "KV memory held by the prefix cache", pc.get("bytes", 0))
        gauge("cpullm_prefix_cache_budget_bytes", "The prefix cache's bound (--prefix-cache)",
              pc.get("budget_bytes", 0))
        counter("cpullm_prefix_cache_hits", "Prompts that restored a cached prefix", pc.get("hits", 0))
        counter("cpullm_prefix_cache_misses", "Prompts that found no cached prefix", pc.get("misses", 0))
        counter("cpullm_prefix_cache_reused_tokens", "Prompt tokens restored instead of prefilled",
                pc.get("reused_tokens", 0))
        gauge("cpullm_model_load_seconds", "Seconds the model took to load (compile included)",
              getattr(m, "load_s", 0.0))
        gauge("cpullm_model_compile_seconds", "Seconds of the load spent compiling kernels (0: all cached)",
              getattr(m, "compile_s", 0.0))
        return out


class ServerMetrics:
    """One application's registry: the engine's series plus those the HTTP layer observes."""

    def __init__(self, engine, model, model_id: str):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(engine, model, model_id))
        self.responses = Counter("cpullm_http_responses", "HTTP responses by route and status code",
                                 ["route", "status"], registry=self.registry)
        self.prompt_tokens = Counter("cpullm_prompt_tokens", "Prompt tokens of the requests submitted",
                                     registry=self.registry)
        self.ttft = Histogram("cpullm_time_to_first_token_seconds",
                              "From submission to the first text piece (queueing included)",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("cpullm_time_per_output_token_seconds",
                              "From the first text piece to the end, per token after the first",
                              buckets=TPOT_BUCKETS, registry=self.registry)

    def count_response(self, path: str, status: int) -> None:
        self.responses.labels(route_label(path), str(status)).inc()

    def counting_send(self, send, path: str):
        """``send`` that counts each response's status as it starts."""
        async def counted(message):
            if message["type"] == "http.response.start":
                self.count_response(path, int(message["status"]))
            await send(message)
        return counted

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest
        return generate_latest(self.registry)

    async def timed(self, pieces, job):
        """``pieces`` (a job's text pieces, just submitted) passed through, timing the first
        piece and the rest: observes TTFT and time per output token when it ends."""
        self.prompt_tokens.inc(len(job.ids))
        t0 = time.monotonic()
        first = None
        try:
            async for piece in pieces:
                if first is None:
                    first = time.monotonic()
                    self.ttft.observe(first - t0)
                yield piece
        finally:
            await pieces.aclose()               # its own cleanup (the job's cancel) runs now
            n = job.stats.generated_tokens
            if first is not None and n > 1:
                self.tpot.observe((time.monotonic() - first) / (n - 1))


def unavailable_text() -> str:
    return ("GET /metrics needs prometheus-client; install it with pip install 'cpullm[serve]'")
