"""Decode speed against context length: how much a long KV cache slows a decode step.

    python benchmarks/context_decode.py MODEL_DIR --ctx 9216 --at 512 8192 --steps 32 [--cache-type f16 f32] [--json]

Loads MODEL_DIR (INT8) once per KV cache format of ``--cache-type`` (default: cpullm.load's, f16),
then for each round, each context length N of ``--at`` and each format: a fresh sequence, an
N-token prefill (the bench prompt, repeated), ``--steps`` greedy decode steps timed after one
untimed step; the rate is the median step over ``--rounds`` rounds. The formats and contexts
alternate inside each round, so a drift in the machine's load (a shared host) falls on all of
them alike. (``--synthetic-kv``: no prefill; random keys and values, in the cache's format, fill
the cache once per model and the position is set to N, which costs decode the same reads; the
configurations then alternate step by step, ``steps x rounds`` timed steps each.) Prints
tokens/s at each N and its ratio to the first N: decode reads the weights once a step plus every
position's keys and values, so the ratio falls with the KV bytes one step reads next to the weight
bytes.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def fill_synthetic_kv(model, slot) -> None:
    """Random keys and values in every ring slot of every KV region of ``slot``, in its format
    (f16: no NaNs)."""
    rng = np.random.default_rng(0)
    for reg in model.program.meta["state_regions"]:
        region = slot.region(reg)
        if reg.get("kv_dtype") == "f16":
            region = region.view(np.float16)
        for i in range(0, region.size, 1 << 24):
            chunk = region[i: i + (1 << 24)]
            chunk[:] = rng.standard_normal(chunk.size, np.float32)


def decode_steps(model, n_context: int, steps: int, synthetic_kv: bool = False) -> tuple[list, float]:
    """(seconds of each of ``steps`` decode steps at context n_context, seconds of the prefill)."""
    from cpullm.bench import CpullmRunner, greedy, next_token, prompt_ids

    vocab = int(model.program.meta.get("embed_rows", model.program.meta["vocab"]))
    runner = CpullmRunner(model)
    runner.reset()
    t0 = time.perf_counter()
    if synthetic_kv:         # random keys and values in the cache (fill_synthetic_kv)
        fill_synthetic_kv(model, runner.slot)
        tok = greedy(runner.prefill(prompt_ids(model.tokenizer, 1, vocab)))
        model.forward.set_position(runner.slot, n_context)
    else:
        tok = greedy(runner.prefill(prompt_ids(model.tokenizer, n_context, vocab)))
    prefill_s = time.perf_counter() - t0
    tok = next_token(runner, tok)                   # untimed first step
    step_s = []
    for _ in range(steps):
        t1 = time.perf_counter()
        tok = next_token(runner, tok)
        step_s.append(time.perf_counter() - t1)
    return step_s, prefill_s


def interleaved_steps(models: dict, contexts: list, n_steps: int, steps: dict) -> None:
    """With synthetic KV: one decode step of every (format, context) in turn, ``n_steps`` times
    (the position set back to the context before each step, so each step reads the same keys),
    so that a change in the host's load within seconds falls on every configuration alike."""
    from cpullm.bench import CpullmRunner, greedy, next_token, prompt_ids

    runners = {}
    for kv, m in models.items():
        r = CpullmRunner(m)
        r.reset()
        fill_synthetic_kv(m, r.slot)
        vocab = int(m.program.meta.get("embed_rows", m.program.meta["vocab"]))
        runners[kv] = (r, greedy(r.prefill(prompt_ids(m.tokenizer, 1, vocab))))
    for i in range(n_steps + 1):                     # the first pass is untimed
        for n in contexts:
            for kv, m in models.items():
                r, tok = runners[kv]
                m.forward.set_position(r.slot, n)
                t0 = time.perf_counter()
                tok = next_token(r, tok)
                if i:
                    steps[kv, n].append(time.perf_counter() - t0)
                runners[kv] = (r, tok)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--ctx", type=int, default=9216)
    p.add_argument("--at", type=int, nargs="+", default=[512, 8192])
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument("--cache-type", dest="kv_dtypes", nargs="+", choices=["f16", "f32"], default=[None],
                   help="KV cache format(s), measured alternately (default: cpullm.load's, f16 for INT8)")
    p.add_argument("--synthetic-kv", action="store_true",
                   help="skip the prefill: fill the whole KV state with random values and set the position "
                        "(decode reads the same bytes; minutes of 8k prefill saved)")
    a = p.parse_args(argv)
    import cpullm
    models = {}
    for kv in a.kv_dtypes:
        m = cpullm.load(a.model, n_ctx=a.ctx, threads=a.threads, kv_dtype=kv)
        models[m.kv_dtype] = m
    steps = {(kv, n): [] for kv in models for n in a.at}
    prefill = {}
    if a.synthetic_kv:
        interleaved_steps(models, a.at, a.steps * a.rounds, steps)
        prefill = {k: 0.0 for k in steps}
    else:
        for _ in range(a.rounds):
            for n in a.at:
                for kv, m in models.items():
                    s, prefill[kv, n] = decode_steps(m, n, a.steps, a.synthetic_kv)
                    steps[kv, n] += s
    first = next(iter(models.values()))
    w = first.info()["memory"]["weights_bytes"]
    out = {"model": a.model, "n_ctx": a.ctx, "threads": first.threads, "weights_bytes": w, "formats": {}}
    for kv, m in models.items():
        rows = []
        for n in a.at:
            m.forward.set_position(m.slot, n)           # the KV bytes a step at n reads
            rows.append({"context": n, "decode_tps": 1.0 / float(np.median(steps[kv, n])),
                         "prefill_s": prefill[kv, n], "kv_bytes_read": m.info()["memory"]["kv_bytes"],
                         "steps": len(steps[kv, n])})
        out["formats"][kv] = rows
    if a.json:
        print(json.dumps(out))
        return 0
    print(f"{a.model}: n_ctx {a.ctx}, {first.threads} threads, weights {w / 1e6:.0f} MB, "
          f"{a.rounds} round(s) of {a.steps} steps")
    for kv, rows in out["formats"].items():
        for r in rows:
            print(f"  KV {kv} context {r['context']:6d}: decode {r['decode_tps']:7.2f} tok/s "
                  f"({r['decode_tps'] / rows[0]['decode_tps']:.2f}x of context {rows[0]['context']}), "
                  f"KV {r['kv_bytes_read'] / 1e6:.0f} MB, prefill {r['prefill_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
