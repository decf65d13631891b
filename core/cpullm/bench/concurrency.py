"""``cpullm bench --concurrency N``: N streams at once through the scheduler.

All N requests (distinct ``prompt_tokens``-token prompts, ``gen_tokens`` greedy tokens each, EOS
ignored) are queued at t0 on a scheduler with N slots, stepped in this thread. Reported:

* ``aggregate_decode_tps``: tokens emitted per second while all N streams decode (from the last
  stream's first token to the first stream's last): the machine's decode rate with N streams;
* ``per_stream_decode_tps``: median over streams of (tokens - 1) / (last token - first token);
* ``ttft_median_s`` / ``ttft_p95_s``: time from t0 to each stream's first token (its queueing
  behind the other prompts' prefill chunks included);
* ``throughput_tps``: every generated token over the whole run's wall time.
"""
from __future__ import annotations

import time

import numpy as np

from .harness import prompt_ids
from ..generate.sampling import SamplingParams
from ..generate.scheduler import Scheduler
from ..generate.sequence import Sequence


def _percentile(xs, q: float) -> float:
    return float(np.percentile(np.asarray(xs, np.float64), q)) if xs else 0.0


def run_concurrency(model, n: int, prompt_tokens: int = 128, gen_tokens: int = 128,
                    prefill_chunk: int | None = None) -> dict:
    base = prompt_ids(model.tokenizer, prompt_tokens + n, model.program.meta.get("embed_rows"))
    prompts = [base[i: i + prompt_tokens] for i in range(n)]
    warm = Scheduler(model.forward, min(n, 2))
    for p in prompts[:2]:                       # compile / page in outside the measurement
        warm.add(Sequence(p[:8], 2, SamplingParams(), stop_ids=()))
    warm.run_until_idle()
    del warm
    sch = Scheduler(model.forward, n, prefill_chunk)
    seqs = [sch.add(Sequence(p, gen_tokens, SamplingParams(), stop_ids=())) for p in prompts]
    times: dict[int, list[float]] = {id(s): [] for s in seqs}
    t0 = time.perf_counter()
    while not sch.idle:
        events = sch.step()
        now = time.perf_counter()
        for seq, tok in events:
            if tok is not None:
                times[id(seq)].append(now)
    wall = time.perf_counter() - t0
    stamps = [times[id(s)] for s in seqs]
    ttft = [ts[0] - t0 for ts in stamps]
    per_stream = [(len(ts) - 1) / (ts[-1] - ts[0]) for ts in stamps if len(ts) > 1 and ts[-1] > ts[0]]
    all_in, first_out = max(ts[0] for ts in stamps), min(ts[-1] for ts in stamps)
    in_window = sum(sum(1 for t in ts if all_in < t <= first_out) for ts in stamps)
    aggregate = in_window / (first_out - all_in) if first_out > all_in else 0.0
    return {
        "concurrency": n, "prompt_tokens": prompt_tokens, "gen_tokens": gen_tokens,
        "quant": model.quant, "threads": model.threads,
        "aggregate_decode_tps": aggregate,
        "per_stream_decode_tps": _percentile(per_stream, 50),
        "ttft_median_s": _percentile(ttft, 50), "ttft_p95_s": _percentile(ttft, 95),
        "throughput_tps": sum(len(ts) for ts in stamps) / wall, "wall_s": wall,
        "kv_bytes_planned": sch.kv_bytes,
    }


def format_concurrency(rows: list[dict]) -> str:
    head = (f"{'streams':>7} {'aggregate decode tok/s':>22} {'per-stream tok/s':>16} "
            f"{'TTFT median s':>13} {'TTFT p95 s':>10} {'all tokens/s':>12}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['concurrency']:>7} {r['aggregate_decode_tps']:>22.1f} {r['per_stream_decode_tps']:>16.1f} "
                     f"{r['ttft_median_s']:>13.3f} {r['ttft_p95_s']:>10.3f} {r['throughput_tps']:>12.1f}")
    if rows:
        r = rows[0]
        lines.append(f"({r['prompt_tokens']}-token prompts, {r['gen_tokens']} greedy tokens per stream, "
                     f"{r['quant']}, {r['threads']} threads)")
    return "\n".join(lines)
