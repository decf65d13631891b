"""Prefix sharing on a real model: requests with one shared system prompt, run through the
scheduler without the prefix cache (each alone) and with it (one after another, then 4 at once
twice over). Prints the tokens' equality, the prompt tokens reused and each request's prefill
seconds (machine-load dependent: compare within one run).

    python benchmarks/prefix_sharing.py smollm2-135m-instruct [--quant int8] [--new 12]
"""
from __future__ import annotations

import argparse

import cpullm
from cpullm.generate.sampling import SamplingParams
from cpullm.generate.scheduler import Scheduler
from cpullm.generate.sequence import Sequence

SYSTEM = ("You are a careful assistant for a software company. " * 30).strip()
USERS = ["How do I reverse a list in Python?", "Write a haiku about autumn.", "What is 17 * 23?",
         "Name three prime numbers.", "Explain what a mutex is in one sentence."]


def run(model, prompts, slots, budget, n_new):
    sch = Scheduler(model.forward, slots, prefix_cache_bytes=budget)
    seqs = [sch.add(Sequence(p, n_new, SamplingParams())) for p in prompts]
    sch.run_until_idle()
    return sch, seqs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--quant", default="int8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=12)
    a = ap.parse_args()
    m = cpullm.load(a.model, quant=a.quant, threads=a.threads, n_ctx=1024)
    prompts = [m.tokenizer.encode(SYSTEM + "\nUser: " + u + "\nAssistant:") for u in USERS]
    shared = next(i for i in range(len(prompts[0])) if prompts[0][i] != prompts[1][i])
    print(f"{a.model} {a.quant}: prompt tokens {[len(p) for p in prompts]}, {shared} shared")
    alone = [run(m, [p], 1, 0, a.new)[1][0] for p in prompts]
    print("alone (no cache): prefill s", [round(s.stats.prefill_s, 3) for s in alone])
    sch, seqs = run(m, prompts, 1, 256 * 2**20, a.new)
    print("one after another, cache: same tokens", all(s.generated == x.generated for s, x in zip(seqs, alone)),
          "reused", [s.reused for s in seqs], "prefill s", [round(s.stats.prefill_s, 3) for s in seqs])
    print("  ", sch.prefix_cache.stats(), "prefilled", sch.prefilled_tokens)
    sch, seqs = run(m, prompts + prompts, 4, 256 * 2**20, a.new)
    print("4 at once, cache: same tokens", all(s.generated == x.generated for s, x in zip(seqs, alone + alone)),
          "reused", [s.reused for s in seqs])


if __name__ == "__main__":
    main()
