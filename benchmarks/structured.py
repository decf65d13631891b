"""Constrained (JSON-schema) decode against unconstrained decode, same model, same prompts, one run.

For each N of ``--streams``: N chat prompts asking for JSON, decoded greedily by one scheduler with
N slots, unconstrained (plain greedy: the lm_head screen path where it applies) and with each
sequence constrained by ``--schema``'s JSON schema (the mask computed on the mask thread while the
forward pass runs; the unmasked argmax, a lone row's through the screen, kept when the mask allows
it, else the full logits of the step masked and their argmax). Reported per mode: decode tokens/s summed
over the streams, timed from the step at which every stream is decoding to the end (prefill is
left out; it is the same in both modes); the ratio constrained / unconstrained; and the mask time
per token (median, p99: llguidance's compute_mask for one sequence and one step). ``--repeat R``
runs R rounds of both modes, alternating (the order flipped every other round), and reports the
median run of each mode and the median of the rounds' ratios.

End of sequence is ignored in the unconstrained mode; a constrained sequence ends when its JSON
is complete, so its schema should allow long answers (the default: a list of up to 64 strings).
A 2-core machine shared with other work gives noisy absolute rates: say so with the numbers.

    python benchmarks/structured.py [MODEL_DIR] --threads 2 --streams 1,8 --gen-tokens 64
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

DEFAULT_SCHEMA = {"type": "object", "properties": {
    "items": {"type": "array", "maxItems": 64, "items": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40}, "count": {"type": "integer"}},
        "required": ["name", "count"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False}
TOPICS = ["fruits", "tools in a workshop", "cities in Europe", "programming languages", "birds",
          "board games", "musical instruments", "rivers", "vegetables", "car brands", "planets", "trees",
          "colors", "sports", "spices", "metals"]


def run(model, n: int, gen_tokens: int, schema: dict | None) -> dict:
    from cpullm.generate.sampling import SamplingParams
    from cpullm.generate.scheduler import Scheduler
    from cpullm.generate.sequence import DECODE, Sequence

    sch = Scheduler(model.forward, n, prefix_cache_bytes=0)
    sch.warm_up()
    seqs = []
    for i in range(n):
        ids = model._prompt_ids(f"List {TOPICS[i % len(TOPICS)]} with a count for each, as JSON.", chat=True)
        cons = model.constraint({"json_schema": schema}) if schema is not None else None
        seqs.append(sch.add(Sequence(ids, gen_tokens, SamplingParams(),
                                     stop_ids=() if schema is None else model.eos_token_ids,
                                     constraint=cons)))
    t0 = None
    tokens = 0
    while not sch.idle:
        events = sch.step()
        if t0 is None:
            if all(s.phase == DECODE or s.done for s in seqs) and not sch.waiting:
                t0 = time.perf_counter()
            continue
        tokens += sum(1 for _, tok in events if tok is not None)
    wall = time.perf_counter() - (t0 or time.perf_counter())
    masks = [t for s in seqs if s.constraint is not None for t in s.constraint.mask_seconds]
    return {"streams": n, "tokens": tokens, "seconds": wall, "tps": tokens / wall if wall > 0 else 0.0,
            "mask_ms_median": 1e3 * float(np.median(masks)) if masks else None,
            "mask_ms_p99": 1e3 * float(np.percentile(masks, 99)) if masks else None,
            "stop_reasons": sorted({s.stats.stop_reason for s in seqs})}


def median_run(runs: list[dict]) -> dict:
    """The run with the median tokens/s (the lower middle one of an even count)."""
    return dict(sorted(runs, key=lambda r: r["tps"])[(len(runs) - 1) // 2])


def _median_of(xs):
    xs = [x for x in xs if x is not None]
    return float(np.median(xs)) if xs else None


def main(argv=None) -> int:
    import cpullm

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--schema", default=None, help="a JSON schema file (default: a list of named counts)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds per stream count, free and constrained alternating; medians (the "
                         "ratio: median of each round's ratio)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    schema = json.load(open(a.schema)) if a.schema else DEFAULT_SCHEMA
    model = cpullm.load(a.model, quant="int8", threads=a.threads, n_ctx=256)
    model.constraint({"json_schema": schema})           # the token table, once, outside the timing
    rows = []
    for n in [int(x) for x in a.streams.split(",")]:
        frees, conss = [], []
        for i in range(a.repeat):             # alternating, the order flipped every other round
            order = (None, schema) if i % 2 == 0 else (schema, None)
            for sch in order:
                (frees if sch is None else conss).append(run(model, n, a.gen_tokens, sch))
        ratios = [c["tps"] / f["tps"] for f, c in zip(frees, conss) if f["tps"]]
        free = median_run(frees)
        cons = median_run(conss)
        cons["mask_ms_median"] = _median_of([c["mask_ms_median"] for c in conss])
        cons["mask_ms_p99"] = _median_of([c["mask_ms_p99"] for c in conss])
        rows.append({"streams": n, "unconstrained": free, "json_schema": cons,
                     "ratio": float(np.median(ratios)) if ratios else None,
                     "ratios": ratios})
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'streams':>7} {'free tok/s':>10} {'json tok/s':>10} {'ratio':>6} {'mask ms med':>11} {'p99':>7}")
    for r in rows:
        c = r["json_schema"]
        print(f"{r['streams']:>7} {r['unconstrained']['tps']:>10.2f} {c['tps']:>10.2f} {r['ratio']:>6.3f} "
              f"{c['mask_ms_median'] or 0:>11.3f} {c['mask_ms_p99'] or 0:>7.3f}   ({c['tokens']} constrained "
              f"tokens, stop {','.join(c['stop_reasons'])}; ratios {', '.join(f'{x:.3f}' for x in r['ratios'])})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
