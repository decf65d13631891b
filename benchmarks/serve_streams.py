"""Aggregate tokens/s and time to first token of a running OpenAI-compatible endpoint (``cpullm
serve``, or ``cpullm serve --ray``) at 1..N concurrent streams, and the latency of a one-token
request (to compare a single server with the same model behind Ray: Ray's overhead per request).

    python benchmarks/serve_streams.py http://127.0.0.1:8000 --streams 1,2,4,8,16 --tokens 64
    python benchmarks/serve_streams.py http://127.0.0.1:8771 --paired http://127.0.0.1:8772

``--paired URL2``: instead, one-token requests sent alternately to URL and URL2 (both up: the same
model served two ways, e.g. alone and on Ray), 60 each after 2 warm-ups; the medians and the
median of the paired differences (URL2 - URL): Ray's overhead per request.

Each stream is a streamed /v1/completions request with its own prompt (no shared prefix),
greedy, ``--tokens`` tokens (the model's EOS is ignored: ``min_tokens`` is not sent, so a short
answer counts what it generated). TTFT: request sent -> first text chunk received. Aggregate:
completion tokens of all streams / wall time from the first request to the last answer.
Medians over ``--repeat`` rounds after one warm-up round. Timings depend on the machine's load.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

WORDS = "river stone cloud lamp window garden letter orange music paper bridge candle".split()


def prompt(i: int) -> str:
    return "Write a short story about " + " and ".join(WORDS[(i + k) % len(WORDS)] for k in range(3)) + \
        f" (story {i})."


def stream_once(url: str, i: int, tokens: int, key: str | None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"prompt": prompt(i), "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, used = None, 0
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if first is None and ev.get("choices") and ev["choices"][0].get("text"):
                first = time.perf_counter() - t0
            if ev.get("usage"):
                used = ev["usage"]["completion_tokens"]
    return first if first is not None else time.perf_counter() - t0, used


def round_of(url: str, n: int, tokens: int, key: str | None, offset: int):
    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        res = list(pool.map(lambda i: stream_once(url, offset + i, tokens, key), range(n)))
    wall = time.perf_counter() - t0
    return sum(u for _, u in res) / wall, statistics.median(t for t, _ in res)


def one_token_latency(url: str, key: str | None, n: int = 20) -> float:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    times = []
    for i in range(n + 2):
        t0 = time.perf_counter()
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "temperature": 0},
                       headers=headers, timeout=120)
        r.raise_for_status()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def paired(url: str, url2: str, key: str | None, n: int = 60) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    times: dict = {url: [], url2: []}
    for i in range(n + 2):
        for u in ((url, url2) if i % 2 else (url2, url)):
            t0 = time.perf_counter()
            r = httpx.post(u + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "temperature": 0},
                           headers=headers, timeout=120)
            r.raise_for_status()
            if i >= 2:
                times[u].append(time.perf_counter() - t0)
    return {"median_s": round(statistics.median(times[url]), 4), "median2_s": round(statistics.median(times[url2]), 4),
            "paired_difference_s": round(statistics.median(b - a for a, b in zip(times[url], times[url2])), 4)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--streams", default="1,2,4,8,16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--label", default="")
    ap.add_argument("--paired", default=None, metavar="URL2")
    a = ap.parse_args()
    if a.paired:
        print(json.dumps({"label": a.label, **paired(a.url, a.paired, a.api_key)}))
        return
    print(json.dumps({"label": a.label, "one_token_request_s": round(one_token_latency(a.url, a.api_key), 4)}),
          flush=True)
    offset = 0
    for n in map(int, a.streams.split(",")):
        round_of(a.url, n, a.tokens, a.api_key, offset)            # warm-up
        offset += n
        rounds = []
        for _ in range(a.repeat):
            rounds.append(round_of(a.url, n, a.tokens, a.api_key, offset))
            offset += n
        print(json.dumps({"label": a.label, "streams": n,
                          "aggregate_tps": round(statistics.median(r[0] for r in rounds), 2),
                          "ttft_median_s": round(statistics.median(r[1] for r in rounds), 3)}), flush=True)


if __name__ == "__main__":
    main()
