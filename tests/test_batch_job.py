"""``cpullm batch``: OpenAI batch files answered as the server answers them, malformed lines,
duplicate ids, resuming after kill -9 (a partial last line included) and after SIGTERM, and
``--ray`` without Ray."""
from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("starlette")

from test_server_support import chat_model_dir, cli_env  # noqa: E402


def batch_cmd(inp, out, *extra):
    return [sys.executable, "-m", "cpullm.cli", "batch", str(inp), "-o", str(out), "--model",
            str(chat_model_dir()), "--model-name", "tinychat", "--threads", "1", "--ctx", "512", *extra]


def run_batch(inp, out, *extra, timeout=300):
    return subprocess.run(batch_cmd(inp, out, *extra), capture_output=True, text=True, env=cli_env(),
                          timeout=timeout)


def request(cid, i, max_tokens=8, chat=False):
    if chat:
        return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "tinychat", "messages": [{"role": "user", "content": f"question {i}"}],
                         "max_tokens": max_tokens, "temperature": 0}}
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions",
            "body": {"prompt": f"Story number {i}:", "max_tokens": max_tokens, "temperature": 0}}


def write_lines(path: Path, lines) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def read_output(path: Path) -> dict:
    out = {}
    for line in path.read_text().splitlines():
        obj = json.loads(line)
        assert obj["custom_id"] not in out, f"{obj['custom_id']} written twice"
        out[obj["custom_id"]] = obj
    return out


def server_answers(reqs) -> dict:
    """What the single server's application answers to each request (in process)."""
    import cpullm
    from cpullm.serve import create_app
    from cpullm.serve.jobs import BatchLine, answer_line

    model = cpullm.load(chat_model_dir(), threads=1, n_ctx=512)
    app = create_app(model, model_id="tinychat")
    try:
        async def go():
            return await asyncio.gather(*(answer_line(app, BatchLine(
                i, r["custom_id"], url=r["url"], body=json.dumps(r["body"]).encode())) for i, r in enumerate(reqs)))
        return {o["custom_id"]: o for o in asyncio.run(go())}
    finally:
        app.engine.close()


def _content(obj):
    """The answer without its per-call ids and timestamp."""
    r = obj["response"]
    if r is None:
        return ("error", obj["error"]["message"])
    b = r["body"]
    return (r["status_code"], b.get("object"), b.get("model"), b.get("choices"), b.get("usage"), b.get("error"))


def test_a_batch_gets_what_the_server_answers_and_errors_for_malformed_lines(tmp_path):
    reqs = [request(f"r{i}", i, chat=bool(i % 2)) for i in range(6)]
    refused = {"custom_id": "too-hot", "method": "POST", "url": "/v1/completions",
               "body": {"prompt": "x", "temperature": 9}}
    lines = [*reqs, refused, "this is not json", "[1, 2]",
             {"custom_id": "no-url", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
             {"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": {}},
             {"custom_id": "no-body", "method": "POST", "url": "/v1/completions", "body": "prompt"},
             {"method": "POST", "url": "/v1/completions", "body": {"prompt": "no id"}},
             {"custom_id": "streamed", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "x", "stream": True}},
             ""]                                                    # a blank line is skipped
    inp = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    r = run_batch(inp, out)
    assert r.returncode == 0, r.stderr
    assert "batch: 14/14 done (8 errors)" in r.stderr and "tok/s" in r.stderr
    got = read_output(out)
    assert len(got) == 14
    want = server_answers([*reqs, refused])
    for cid, obj in want.items():
        assert obj["response"]["status_code"] == (400 if cid == "too-hot" else 200)
        assert _content(got[cid]) == _content(obj)
        assert got[cid]["id"].startswith("batch_req_") and got[cid]["error"] is None
    assert got["r1"]["response"]["body"]["object"] == "chat.completion"
    assert got["too-hot"]["response"]["body"]["error"]["param"] == "temperature"
    for cid, line_no, words in [("line-8", 8, "not valid JSON"), ("line-9", 9, "JSON object"),
                                ("no-url", 10, "url must be"), ("get", 11, "method must be"),
                                ("no-body", 12, "body must be"), ("line-13", 13, "custom_id is required"),
                                ("streamed", 14, "stream is not supported")]:
        assert got[cid]["response"] is None, cid
        assert got[cid]["error"]["message"].startswith(f"line {line_no}: ") and words in got[cid]["error"]["message"]

    again = run_batch(inp, out)                                    # everything is done already
    assert again.returncode == 0 and "all 14 requests are already in" in again.stderr
    assert read_output(out).keys() == got.keys()


def test_duplicate_custom_ids_are_refused_before_anything_runs(tmp_path):
    inp = write_lines(tmp_path / "in.jsonl", [request("a", 1), request("b", 2), request("a", 3)])
    r = run_batch(inp, tmp_path / "out.jsonl")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"cpullm: error: {inp}: custom_id 'a' is on lines 1 and 3; give every request its own custom_id"]
    assert not (tmp_path / "out.jsonl").exists()


def _start_and_wait_for_lines(inp, out, n_lines, timeout=240):
    proc = subprocess.Popen(batch_cmd(inp, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=cli_env(), start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if out.exists() and out.read_bytes().count(b"\n") >= n_lines:
            return proc
        if proc.poll() is not None:
            raise AssertionError(f"the job ended before {n_lines} lines: {proc.stderr.read()}")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("no output lines in time")


def test_a_job_killed_midway_resumes_with_every_custom_id_once(tmp_path):
    reqs = [request(f"q{i}", i, max_tokens=96) for i in range(64)]
    inp = write_lines(tmp_path / "in.jsonl", reqs)
    out = tmp_path / "out.jsonl"
    proc = _start_and_wait_for_lines(inp, out, 6)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    proc.stdout.close(), proc.stderr.close()
    before = read_output(out)
    assert 6 <= len(before) < 64, "the job finished before it was killed: make it longer"
    with open(out, "ab") as f:                                      # a crash in the middle of a write
        f.write(b'{"id":"batch_req_x","custom_id":"q63","response":{"status_c')
    r = run_batch(inp, out)
    assert r.returncode == 0, r.stderr
    assert f"resuming: {len(before)} of 64 already in" in r.stderr
    after = read_output(out)
    assert sorted(after) == sorted(f"q{i}" for i in range(64))
    assert all(after[c] == before[c] for c in before)               # finished lines kept as they were
    assert all(o["response"]["status_code"] == 200 for o in after.values())
    early = next(iter(before))                                      # one from each run
    late = next(c for c in after if c not in before)
    want = server_answers([r for r in reqs if r["custom_id"] in (early, late)])
    assert len(want) == 2
    for cid, obj in want.items():
        assert _content(after[cid]) == _content(obj)


def test_sigterm_stops_cleanly_and_the_rerun_finishes(tmp_path):
    reqs = [request(f"s{i}", i, max_tokens=96) for i in range(40)]
    inp = write_lines(tmp_path / "in.jsonl", reqs)
    out = tmp_path / "out.jsonl"
    proc = _start_and_wait_for_lines(inp, out, 2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "SIGTERM: stopping" in err.decode() and "rerun the same command" in err.decode()
    data = out.read_bytes()
    assert data.endswith(b"\n")                                     # no half-written line
    first = read_output(out)
    assert len(first) < 40
    r = run_batch(inp, out)
    assert r.returncode == 0, r.stderr
    assert sorted(read_output(out)) == sorted(f"s{i}" for i in range(40))


def test_ray_flags_without_ray_name_the_extra(tmp_path, monkeypatch, capsys):
    from cpullm.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)                   # import ray fails
    inp = write_lines(tmp_path / "in.jsonl", [request("a", 1)])
    assert main(["batch", str(inp), "-o", str(tmp_path / "o.jsonl"), "--ray"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["cpullm: error: --ray needs Ray (ray[serve,data]); install it with pip install 'cpullm[ray]'"]
    assert main(["serve", "--ray", "--replicas", "2"]) == 2
    assert "pip install 'cpullm[ray]'" in capsys.readouterr().err
    assert main(["batch", str(inp), "-o", str(tmp_path / "o.jsonl"), "--replicas", "2"]) == 2
    assert "go with --ray" in capsys.readouterr().err


def test_the_core_and_the_cli_never_import_ray():
    code = ("import sys, cpullm, cpullm.serve, cpullm.serve.jobs, cpullm.cli; cpullm.cli.build_parser(); "
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
