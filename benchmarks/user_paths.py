"""One stream's decode rate on the paths users run, against ``cpullm bench``'s, in one run.

    python benchmarks/user_paths.py qwen2.5-coder-0.5b-instruct --threads 2 --tokens 128 --repeat 3

Per round, one after another on the same machine (so a shared host's load hits them alike):

* ``bench``: this process loads the model (int8) and runs what ``cpullm bench``'s decode_tps runs
  (``CpullmRunner.decode_next``: greedy one-token steps, the lm_head screen where it pays) after
  the same prompt the other paths get, timed over ``--tokens`` steps;
* ``serve greedy`` / ``serve sampled``: a streamed ``/v1/completions`` request to a ``cpullm
  serve`` started once for the whole run (temperature 0; temperature 0.7 with top_p 0.9 and a
  seed);
* ``run``: ``cpullm run MODEL PROMPT -n TOKENS`` (greedy), its standard output read as it streams;
* ``chat``: ``cpullm chat MODEL`` with the prompt as one piped turn (its default sampling,
  temperature 0.7; ``--chat-temperature`` changes it), the answer read as it streams.

The decode rate of a streamed path is (tokens - 1) / (time of the last text chunk - time of the
first), seen by the client: it counts everything between two tokens (the forward pass, sampling,
detokenization, the stream), which is what a user waits for; a token count comes from the path's
own report (usage, the stats line). ``bench`` has no stream: tokens / time of its steps. Reported:
the median over ``--repeat`` rounds (after one warm-up round) and each path's ratio to ``bench``.
The chat's prompt passes through the chat template (a few dozen tokens more, immaterial to decode
at this length). ``--markdown FILE`` also writes the table there.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

PROMPT = ("Write a long, detailed story about a lighthouse keeper, a lost ship and a storm at sea, "
          "with dialogue and many events.")


def cli(*args) -> list[str]:
    return [sys.executable, "-m", "cpullm.cli", *args]


def bench_rate(model, ids: list[int], tokens: int) -> float:
    from cpullm.bench.harness import CpullmRunner, greedy, next_token
    r = CpullmRunner(model)
    r.reset()
    tok = greedy(r.prefill(ids))
    t0 = time.perf_counter()
    for _ in range(tokens):
        tok = next_token(r, tok)
    return tokens / (time.perf_counter() - t0)


def _stream_rate(times: list[float], tokens: int) -> float | None:
    if tokens < 2 or len(times) < 2 or times[-1] <= times[0]:
        return None
    return (tokens - 1) / (times[-1] - times[0])


def serve_rate(url: str, tokens: int, sampled: bool, seed: int) -> tuple[float | None, int]:
    import httpx
    body = {"prompt": PROMPT, "max_tokens": tokens, "stream": True, "stream_options": {"include_usage": True},
            "temperature": 0.7 if sampled else 0.0}
    if sampled:
        body.update(top_p=0.9, seed=seed)
    times, used = [], 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("choices") and ev["choices"][0].get("text"):
                times.append(time.perf_counter())
            if ev.get("usage"):
                used = ev["usage"]["completion_tokens"]
    return _stream_rate(times, used), used


def _timed_stdout(proc):
    """(times at which standard output chunks arrive, the thread reading them as they stream)."""
    times: list[float] = []

    def read():
        fd = proc.stdout.fileno()
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                return
            if chunk.strip():
                times.append(time.perf_counter())
    t = threading.Thread(target=read, daemon=True)
    t.start()
    return times, t


def run_rate(model: str, threads: int, tokens: int) -> tuple[float | None, int]:
    proc = subprocess.Popen(cli("run", model, PROMPT, "-n", str(tokens), "-t", str(threads), "--quant", "int8"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    times, reader = _timed_stdout(proc)
    err = proc.stderr.read().decode()
    proc.wait()
    reader.join()
    if proc.returncode:
        raise RuntimeError(f"cpullm run failed: {err[-500:]}")
    line = [ln for ln in err.splitlines() if " generated, decode " in ln][-1]
    n = int(line.split(" generated")[0].rsplit(",", 1)[1])
    return _stream_rate(times[:-1], n), n          # the last chunk is the closing newline


def chat_rate(model: str, threads: int, tokens: int, temperature: float) -> tuple[float | None, int]:
    proc = subprocess.Popen(cli("chat", model, "-n", str(tokens), "-t", str(threads), "--quant", "int8",
                                "--temperature", str(temperature)),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    times, reader = _timed_stdout(proc)
    proc.stdin.write((PROMPT + "\n").encode())
    proc.stdin.close()
    out_err = proc.stderr.read().decode()
    proc.wait()
    reader.join()
    if proc.returncode:
        raise RuntimeError(f"cpullm chat failed: {out_err[-500:]}")
    stats = [ln for ln in out_err.splitlines() if " tokens, " in ln and "tok/s" in ln]
    if not stats:
        raise RuntimeError(f"cpullm chat printed no stats line: {out_err[-500:]}")
    n = int(stats[-1].strip("[").split(" tokens")[0])
    return _stream_rate(times[:-1], n), n


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, threads: int):
    import httpx
    port = free_port()
    proc = subprocess.Popen(cli("serve", model, "--port", str(port), "-t", str(threads), "--quant", "int8"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"cpullm serve exited: {proc.stderr.read().decode()[-500:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("cpullm serve did not answer /health within 15 minutes")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--chat-temperature", type=float, default=0.7)
    ap.add_argument("--paths", default="bench,serve_greedy,serve_sampled,run,chat")
    ap.add_argument("--markdown", default=None, metavar="FILE")
    a = ap.parse_args(argv)
    import cpullm
    paths = a.paths.split(",")
    model = cpullm.load(a.model, quant="int8", threads=a.threads)
    ids = model.tokenizer.encode(PROMPT)
    server, url = start_server(a.model, a.threads) if any(p.startswith("serve") for p in paths) else (None, None)
    measure = {
        "bench": lambda i: (bench_rate(model, ids, a.tokens), a.tokens),
        "serve_greedy": lambda i: serve_rate(url, a.tokens, False, i),
        "serve_sampled": lambda i: serve_rate(url, a.tokens, True, i),
        "run": lambda i: run_rate(a.model, a.threads, a.tokens),
        "chat": lambda i: chat_rate(a.model, a.threads, a.tokens, a.chat_temperature),
    }
    rates: dict = {p: [] for p in paths}
    counts: dict = {p: [] for p in paths}
    try:
        for i in range(a.repeat + 1):
            for p in paths:
                rate, n = measure[p](i)
                if i and rate is not None:              # round 0: warm-up
                    rates[p].append(rate)
                    counts[p].append(n)
                print(json.dumps({"round": i, "path": p, "tok_s": rate and round(rate, 2), "tokens": n}),
                      flush=True)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
    base = statistics.median(rates["bench"]) if rates.get("bench") else None
    rows = ["| path | decode tok/s (median) | tokens | vs bench |", "|---|---:|---:|---:|"]
    for p in paths:
        if not rates[p]:
            rows.append(f"| {p} | - | - | - |")
            continue
        med = statistics.median(rates[p])
        ratio = f"{med / base:.3f}" if base else "-"
        rows.append(f"| {p} | {med:.2f} | {statistics.median(counts[p]):.0f} | {ratio} |")
    table = "\n".join(rows)
    print(table)
    if a.markdown:
        with open(a.markdown + ".tmp", "w") as f:
            f.write(table + "\n")
        os.replace(a.markdown + ".tmp", a.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
