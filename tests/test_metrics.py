"""``GET /metrics``: the Prometheus text parsed with prometheus_client's own parser, its counters
against ``/health``'s, the histograms, per-application registries, and the API key."""
from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("starlette")
pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from test_server_support import chat_model_dir  # noqa: E402


@pytest.fixture(scope="module")
def model():
    import cpullm
    return cpullm.load(chat_model_dir(), threads=1, n_ctx=512)


def _call(app, method, path, body=None, key=None):
    """(status, headers, body bytes) of one request to the ASGI app, in process."""
    from cpullm.serve.jobs import JSON_HEADERS, call_app

    headers = list(JSON_HEADERS) + ([(b"authorization", f"Bearer {key}".encode())] if key else [])
    data = json.dumps(body).encode() if body is not None else b""

    async def go():
        status, hdrs, chunks = None, {}, []
        async for msg in call_app(app, path, data, headers=headers, method=method):
            if msg["type"] == "http.response.start":
                status = msg["status"]
                hdrs = {k.decode(): v.decode() for k, v in msg["headers"]}
            else:
                chunks.append(msg.get("body", b""))
        return status, hdrs, b"".join(chunks)
    return asyncio.run(go())


def _samples(text: str) -> dict:
    """{(sample name, frozenset(labels)): value} of an exposition."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def _value(samples, name, **labels):
    return samples[(name, frozenset(labels.items()))]


def test_metrics_follow_the_engine_and_the_requests(model):
    from cpullm.serve import create_app

    app = create_app(model, model_id="tinychat", parallel=2)
    other = create_app(model, model_id="other", parallel=1)      # a second registry in this process
    try:
        n_prompt = 0
        for i in range(3):
            st, _, body = _call(app, "POST", "/v1/completions",
                                {"prompt": f"Once upon {i}", "max_tokens": 5, "temperature": 0})
            assert st == 200
            n_prompt += json.loads(body)["usage"]["prompt_tokens"]
        st, _, body = _call(app, "POST", "/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                             "temperature": 0, "stream": True})
        assert st == 200 and body.endswith(b"data: [DONE]\n\n")
        st, _, _ = _call(app, "POST", "/v1/completions", {"prompt": "x", "temperature": 9})
        assert st == 400

        st, headers, text = _call(app, "GET", "/metrics")
        assert st == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
        s = _samples(text.decode())
        health = json.loads(_call(app, "GET", "/health")[2])
        assert _value(s, "cpullm_requests_total", outcome="submitted") == health["requests"] == 4
        assert _value(s, "cpullm_requests_total", outcome="completed") == health["completed"] == 4
        assert _value(s, "cpullm_generation_tokens_total") == health["generated_tokens"] == 3 * 5 + 4
        assert _value(s, "cpullm_prompt_tokens_total") > n_prompt          # + the chat prompt
        assert _value(s, "cpullm_queue_depth") == 0 and _value(s, "cpullm_running_sequences") == 0
        assert _value(s, "cpullm_parallel") == 2
        assert _value(s, "cpullm_kv_cache_planned_bytes") == health["kv_bytes_planned"] > 0
        pc = health["prefix_cache"]
        assert _value(s, "cpullm_prefix_cache_hits_total") == pc["hits"]
        assert _value(s, "cpullm_prefix_cache_misses_total") == pc["misses"]
        assert _value(s, "cpullm_model_load_seconds") == model.load_s > 0
        assert _value(s, "cpullm_model_compile_seconds") == model.compile_s
        assert _value(s, "cpullm_model_info", model="tinychat", family="llama", quant="int8",
                      kv_dtype="f16") == 1
        # 4 answers: 4 first tokens, 4 per-token times; the 400 never reached the engine
        assert _value(s, "cpullm_time_to_first_token_seconds_count") == 4
        assert _value(s, "cpullm_time_per_output_token_seconds_count") == 4
        assert _value(s, "cpullm_time_to_first_token_seconds_bucket", le="+Inf") == 4
        assert _value(s, "cpullm_http_responses_total", route="/v1/completions", status="200") == 3
        assert _value(s, "cpullm_http_responses_total", route="/v1/completions", status="400") == 1
        assert _value(s, "cpullm_http_responses_total", route="/v1/chat/completions", status="200") == 1

        o = _samples(_call(other, "GET", "/metrics")[2].decode())
        assert _value(o, "cpullm_requests_total", outcome="submitted") == 0
        assert _value(o, "cpullm_model_info", model="other", family="llama", quant="int8", kv_dtype="f16") == 1
        assert ("cpullm_http_responses_total", frozenset({("route", "/v1/completions"),
                                                          ("status", "200")})) not in o
    finally:
        app.engine.close()
        other.engine.close()


def test_metrics_need_the_api_key_when_one_is_set(model):
    from cpullm.serve import create_app

    app = create_app(model, model_id="tinychat", parallel=1, api_key="sekret")
    try:
        st, _, body = _call(app, "GET", "/metrics")
        assert st == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
        assert _call(app, "GET", "/metrics", key="wrong")[0] == 401
        st, _, text = _call(app, "GET", "/metrics", key="sekret")
        assert st == 200
        s = _samples(text.decode())
        assert _value(s, "cpullm_http_responses_total", route="/metrics", status="401") == 2
        assert _call(app, "GET", "/health")[0] == 200          # /health stays open
    finally:
        app.engine.close()
