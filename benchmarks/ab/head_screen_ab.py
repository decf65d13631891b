"""Greedy decode's lm_head through the head screen against the full lm_head, paired in one process.

    python benchmarks/ab/head_screen_ab.py MODEL [--quant q4] [--threads 2] [--prompt-tokens 128]
                                                 [--steps 48] [--reps 3] [--json]

Loads MODEL (its program must have a screen: int8 or q4 with an lm_head of at least
head_screen.MIN_LM_HEAD_BYTES), prefills the bench prompt, then for each greedy step runs the
token up to the lm_head once and times both heads on the same activations, ``--reps`` times
each, alternating which goes first: the screen (``HeadScreen.argmax``) and the full lm_head (the
interpreter's LINEAR, then the argmax), and checks that both give the same token. Prints the
medians over steps of each head's time (per step its fastest rep) and of the per-step ratios,
the survivors, and the bytes each reads. Pairing each step's two heads makes the ratio hold on
a shared host whose load moves the absolute times (cpullm bench's per-op profile does not pair).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--quant", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)

    import numba

    import cpullm
    from cpullm.bench.harness import prompt_ids
    from cpullm.compile.head_screen import row_bytes
    from cpullm_kernels.program import program_table as P
    m = cpullm.load(a.model, quant=a.quant, threads=a.threads)
    ex = m.executor
    sc = ex.screen
    if sc is None:
        raise SystemExit("this program has no head screen (int8 / q4 and an lm_head >= MIN_LM_HEAD_BYTES)")
    meta = m.program.meta["head_screen"]
    lin = P.linear_operands(ex.I[sc.row])
    N = lin.n
    head_bytes = N * row_bytes(lin)
    screen_bytes = N * (meta["q_cols"] + 2 * meta["s_cols"] + 12)
    nth = numba.get_num_threads()
    lo = m.program.meta["logits_offset"]

    fwd = m.forward
    slot = fwd.new_slot()

    def plain():
        ex._interp(sc.row, ex.n_instr, slot.state)
        return int(np.argmax(ex.arena[lo: lo + ex.vocab]))

    def screened():
        return sc.argmax(nth)

    ids = prompt_ids(m.tokenizer, a.prompt_tokens, ex.vocab)
    tok = int(np.argmax(fwd.prefill(slot, ids)))
    t_screen, t_plain, ratios, survivors, fallbacks = [], [], [], [], 0
    for step in range(a.steps):
        ex._run_token(slot.state, slot.position, tok, sc.segments)
        best_s = best_p = float("inf")
        for rep in range(a.reps):
            for which in ((0, 1) if (step + rep) % 2 == 0 else (1, 0)):
                t0 = time.perf_counter()
                if which == 0:
                    got, surv = screened()
                    dt = time.perf_counter() - t0
                    best_s = min(best_s, dt)
                else:
                    want = plain()
                    dt = time.perf_counter() - t0
                    best_p = min(best_p, dt)
        if got < 0:
            fallbacks += 1
        elif got != want:
            raise SystemExit(f"step {step}: screen token {got} != full head's {want}")
        survivors.append(surv)
        t_screen.append(best_s)
        t_plain.append(best_p)
        ratios.append(best_s / best_p)
        slot.position += 1
        tok = want
    med = statistics.median
    row_bytes = head_bytes // N
    out = {"model": str(m.model_dir), "quant": m.quant, "threads": nth, "rows": N,
           "head_format": "q8" if lin.kind == P.WEIGHT_Q8 else f"ggml type {lin.s_off}",
           "head_MB": head_bytes / 1e6, "screen_MB": screen_bytes / 1e6,
           "screen_read_MB_median": (screen_bytes + med(survivors) * row_bytes) / 1e6,
           "full_head_ms": 1e3 * med(t_plain), "screen_ms": 1e3 * med(t_screen),
           "ratio_median": med(ratios), "survivors_median": med(survivors),
           "survivors_p90": float(np.percentile(survivors, 90)), "fallbacks": fallbacks, "steps": a.steps}
    if a.json:
        print(json.dumps(out))
    else:
        print(f"{out['model']} ({m.quant}, {nth} threads): lm_head {N} rows, {out['head_format']}, "
              f"{out['head_MB']:.1f} MB; screen {out['screen_MB']:.1f} MB + median {out['survivors_median']:.0f} "
              f"exact rows (p90 {out['survivors_p90']:.0f}) = {out['screen_read_MB_median']:.1f} MB a step")
        print(f"  full lm_head {out['full_head_ms']:.2f} ms, screen {out['screen_ms']:.2f} ms (medians over "
              f"{a.steps} steps, fastest of {a.reps} reps each); per-step ratio screen / full: median "
              f"{out['ratio_median']:.3f}; {fallbacks} step(s) fell back; every token equal")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
