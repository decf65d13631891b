"""Decode speed against context length: how much a long KV cache slows a decode step.

    python benchmarks/context_decode.py MODEL_DIR --ctx 9216 --at 512 8192 --steps 32 [--cache-type f32] [--json]

Loads MODEL_DIR once (INT8), then for each context length N of ``--at``: a fresh sequence, an
N-token prefill (the bench prompt, repeated), ``--steps`` greedy decode steps timed (the median
step of ``--rounds`` rounds after one untimed step). (``--synthetic-kv``: no prefill; random keys and values fill the cache and the position is set
to N, which costs decode the same reads.) Prints tokens/s at each N and its ratio to
the first N: decode reads the weights once a step plus every position's keys and values, so the
ratio falls with the KV bytes one step reads next to the weight bytes.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def decode_at(model, n_context: int, steps: int, rounds: int, synthetic_kv: bool = False) -> dict:
    from cpullm.bench import CpullmRunner, greedy, next_token, prompt_ids

    vocab = int(model.program.meta.get("embed_rows", model.program.meta["vocab"]))
    ids = prompt_ids(model.tokenizer, n_context, vocab)
    runner = CpullmRunner(model)
    step_s = []
    for _ in range(rounds):
        runner.reset()
        t0 = time.perf_counter()
        if synthetic_kv:     # random keys and values in every slot, as if n_context tokens ran
            ex = model.executor
            tok = greedy(runner.prefill(ids[:1]))
            rng = np.random.default_rng(0)
            for reg in model.program.meta["state_regions"]:    # in each region's format (f16: no NaNs)
                region = ex.state_region(reg)
                if reg.get("kv_dtype") == "f16":
                    region = region.view(np.float16)
                for i in range(0, region.size, 1 << 24):
                    chunk = region[i: i + (1 << 24)]
                    chunk[:] = rng.standard_normal(chunk.size, np.float32)
            ex.set_position(n_context)
        else:
            tok = greedy(runner.prefill(ids))
        prefill_s = time.perf_counter() - t0
        tok = next_token(runner, tok)                   # untimed first step
        for _ in range(steps):
            t1 = time.perf_counter()
            tok = next_token(runner, tok)
            step_s.append(time.perf_counter() - t1)
    kv = model.info()["memory"]["kv_bytes"]
    return {"context": n_context, "decode_tps": 1.0 / float(np.median(step_s)), "prefill_s": prefill_s,
            "kv_bytes_read": kv, "steps": steps * rounds}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--ctx", type=int, default=9216)
    p.add_argument("--at", type=int, nargs="+", default=[512, 8192])
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument("--cache-type", dest="kv_dtype", choices=["f16", "f32"], default=None,
                   help="KV cache format (default: cpullm.load's, f16 for INT8)")
    p.add_argument("--synthetic-kv", action="store_true",
                   help="skip the prefill: fill the whole KV state with random values and set the position "
                        "(decode reads the same bytes; minutes of 8k prefill saved)")
    a = p.parse_args(argv)
    import cpullm
    model = cpullm.load(a.model, n_ctx=a.ctx, threads=a.threads, kv_dtype=a.kv_dtype)
    rows = [decode_at(model, n, a.steps, a.rounds, a.synthetic_kv) for n in a.at]
    w = model.info()["memory"]["weights_bytes"]
    if a.json:
        print(json.dumps({"model": a.model, "n_ctx": a.ctx, "kv_dtype": model.kv_dtype, "threads": model.threads,
                          "weights_bytes": w,
                          "runs": rows}))
        return 0
    print(f"{a.model}: n_ctx {a.ctx}, KV {model.kv_dtype}, {model.threads} threads, weights {w / 1e6:.0f} MB")
    for r in rows:
        print(f"  context {r['context']:6d}: decode {r['decode_tps']:7.1f} tok/s "
              f"({r['decode_tps'] / rows[0]['decode_tps']:.2f}x of context {rows[0]['context']}), "
              f"KV {r['kv_bytes_read'] / 1e6:.0f} MB, prefill {r['prefill_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
