"""cpullm on a local Ray cluster started here (2 CPUs): 2 replicas x 1 thread behind one endpoint
answer 16 concurrent requests as the single server does, requests sharing a prefix go to one
replica, a killed replica leaves the endpoint answering, merged /metrics; a 64-request batch job
on Ray Data equals the local batch job, resuming included. Ray is in the test extra; slow (a
cluster start, model loads in the replicas and actors)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("starlette")
pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from test_batch_job import _content, read_output, request, server_answers, write_lines  # noqa: E402
from test_server_support import chat_model_dir, cli_env  # noqa: E402

pytestmark = pytest.mark.slow

SYSTEM = "You are a terse assistant who answers in one line. " * 3


@pytest.fixture(scope="module")
def cluster(session_cache_dir):
    from cpullm.ray import connect

    assert not ray.is_initialized()
    connect(None, num_cpus=2)             # a local cluster, as the CLI starts one
    yield ray
    ray.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _requests():
    out = []
    for i in range(16):
        if i % 2:
            out.append(("/v1/completions", {"prompt": f"Story number {i}:", "max_tokens": 12, "temperature": 0,
                                             "stream": i % 4 == 1}))
        else:
            out.append(("/v1/chat/completions", {
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question {i}"}],
                "max_tokens": 12, "temperature": 0, "stream": i % 4 == 2, "model": "tinychat"}))
    return out


def _ask(url, path, body, key="k3y"):
    """The answer's text (streamed or not) and finish reason."""
    r = httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)
    assert r.status_code == 200, r.text
    if not body.get("stream"):
        c = r.json()["choices"][0]
        return (c.get("message") or {}).get("content", c.get("text")), c["finish_reason"]
    text, finish = "", None
    for line in r.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            ev = json.loads(line[6:])
            assert "error" not in ev, ev
            for c in ev["choices"]:
                text += (c.get("delta") or {}).get("content") or c.get("text") or ""
                finish = c["finish_reason"] or finish
    return text, finish


def _single_server_answers(reqs):
    as_batch = [{"custom_id": str(i), "method": "POST", "url": p, "body": dict(b, stream=False)}
                for i, (p, b) in enumerate(reqs)]
    got = server_answers(as_batch)
    out = []
    for i in range(len(reqs)):
        c = got[str(i)]["response"]["body"]["choices"][0]
        out.append(((c.get("message") or {}).get("content", c.get("text")), c["finish_reason"]))
    return out


def _metrics(url, key="k3y") -> dict:
    r = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert r.status_code == 200, r.text
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def _submitted_by_replica(url) -> dict:
    return {dict(k[1])["replica"]: v for k, v in _metrics(url).items()
            if k[0] == "cpullm_requests_total" and dict(k[1]).get("outcome") == "submitted"}


def _settled(url, timeout=60) -> dict:
    """Requests submitted per replica once the replicas' pushed metrics stop changing (they
    push every METRICS_PUSH_S seconds)."""
    from cpullm.ray.serve import METRICS_PUSH_S

    deadline = time.monotonic() + timeout
    last = _submitted_by_replica(url)
    while time.monotonic() < deadline:
        time.sleep(1.25 * METRICS_PUSH_S)
        now = _submitted_by_replica(url)
        if now == last and len(now) == 2:
            return now
        last = now
    raise AssertionError(f"the replicas' metrics did not settle: {last}")


class TestServe:
    @pytest.fixture(scope="class")
    def endpoint(self, cluster):
        from cpullm.ray import serve as ray_serve

        port = _free_port()
        ray_serve.deploy({"model": str(chat_model_dir()), "n_ctx": 512, "model_id": "tinychat"},
                         replicas=2, threads=1, port=port, api_key="k3y")
        yield f"http://127.0.0.1:{port}"
        ray_serve.shutdown()

    def test_two_replicas_answer_16_concurrent_requests_as_the_single_server(self, endpoint):
        reqs = _requests()
        want = _single_server_answers(reqs)
        with ThreadPoolExecutor(16) as pool:
            got = list(pool.map(lambda pb: _ask(endpoint, *pb), reqs))
        assert got == want
        # the same limits and error shapes as the single server
        r = httpx.post(endpoint + "/v1/completions", json={"prompt": "x"}, timeout=60)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(endpoint + "/v1/completions", json={"prompt": "x", "temperature": 9},
                       headers={"Authorization": "Bearer k3y"}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
        assert httpx.get(endpoint + "/metrics", timeout=30).status_code == 401

    def test_requests_sharing_a_prefix_go_to_one_replica(self, endpoint):
        before = _settled(endpoint)
        assert len(before) == 2
        body = {"messages": [{"role": "system", "content": SYSTEM + " Shared prefix."},
                             {"role": "user", "content": "same"}], "max_tokens": 2, "temperature": 0}
        for _ in range(6):
            _ask(endpoint, "/v1/chat/completions", body)
        after = _settled(endpoint)
        assert sorted(after[r] - before[r] for r in after) == [0, 6]
        m = _metrics(endpoint)
        assert m[("cpullm_ray_replicas_reporting", frozenset())] == 2

    def test_a_killed_replica_leaves_the_endpoint_answering(self, endpoint):
        from ray import serve

        handle = serve.get_deployment_handle("Replica", app_name="cpullm")
        pids = set()
        for i in range(64):
            pids.add(handle.pid.remote(f"key {i}").result(timeout_s=30))
            if len(pids) == 2:
                break
        assert len(pids) == 2
        reqs = _requests()
        want = _single_server_answers(reqs)
        os.kill(sorted(pids)[0], signal.SIGKILL)
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda pb: _ask(endpoint, *pb), reqs))
        assert got == want
        deadline = time.monotonic() + 180                   # Ray starts a new replica
        new = set()
        while time.monotonic() < deadline:
            new = set()
            for i in range(64):
                try:
                    new.add(handle.pid.remote(f"key {i}").result(timeout_s=30))
                except Exception:
                    pass
                if len(new - pids) >= 1 and len(new) == 2:
                    break
            if len(new) == 2 and len(new - pids) == 1:
                break
            time.sleep(1)
        assert len(new) == 2 and len(new - pids) == 1
        assert _ask(endpoint, *reqs[1]) == want[1]


def test_a_batch_on_ray_data_equals_the_local_batch_and_resumes(cluster, tmp_path):
    from cpullm.ray.data import run_batch
    from cpullm.serve.jobs import Progress, finished_ids, read_input

    reqs = [request(f"b{i}", i, max_tokens=16, chat=bool(i % 3 == 0)) for i in range(64)]
    inp = write_lines(tmp_path / "in.jsonl", reqs)
    local = tmp_path / "local.jsonl"
    r = subprocess.run([sys.executable, "-m", "cpullm.cli", "batch", str(inp), "-o", str(local), "--model",
                        str(chat_model_dir()), "--model-name", "tinychat", "--threads", "1", "--ctx", "512"],
                       capture_output=True, text=True, env=cli_env(), timeout=300)
    assert r.returncode == 0, r.stderr
    want = read_output(local)

    # a job that stopped halfway: 30 lines written, the 31st cut short
    out = tmp_path / "ray.jsonl"
    lines = local.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:30]) + lines[30][:40])
    options = {"model": str(chat_model_dir()), "n_ctx": 512, "model_id": "tinychat", "max_tokens_cap": 1024,
               "request_timeout": 300.0}
    done = finished_ids(str(out))
    pending = [ln for ln in read_input(str(inp)) if ln.custom_id not in done]
    assert len(pending) == 34
    stopped = run_batch(pending, str(out), options, Progress(64, 30, every_s=1e9), replicas=2, threads=1)
    assert stopped is False
    got = read_output(out)
    assert sorted(got) == sorted(want)
    assert all(_content(got[c]) == _content(want[c]) for c in want)
