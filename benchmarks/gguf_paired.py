"""One GGUF file, three runtimes side by side: cpullm running it as it is (quant "gguf"), cpullm
requantizing it to INT8 (quant "int8"), and llama.cpp (llama-cpp-python) on the same file.

    python benchmarks/gguf_paired.py FILE.gguf [--threads 1] [--rounds 6] [--steps 16]
                                     [--prompt-tokens 256]

Rounds alternate between the three, so all see the same machine (on a shared host the rates
move by 2x within a minute; compare the medians of one run, never across runs). Decode: each
round ``--steps`` greedy steps after a short prompt (cpullm ``Executor.decode_argmax``, llama.cpp
``eval`` of one token + argmax); prefill: one ``--prompt-tokens`` prompt from a fresh sequence.
Prints medians, every round, cpullm's weight bytes read per decode token and the load average.
Needs llama-cpp-python (the ``[bench]`` extra).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def _load_average() -> list[str]:
    try:
        with open("/proc/loadavg") as fh:
            return fh.read().split()[:3]
    except OSError:
        return ["?"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    args = ap.parse_args()

    import cpullm
    from cpullm.bench import decode_weight_bytes
    from llama_cpp import Llama

    models = {q: cpullm.load(args.gguf, quant=q, threads=args.threads) for q in ("gguf", "int8")}
    llm = Llama(model_path=args.gguf, n_threads=args.threads, n_threads_batch=args.threads,
                verbose=False, n_ctx=2048, n_batch=512)
    tok = models["gguf"].tokenizer
    short = tok.encode("The history of the city begins")
    long_ids = tok.encode("The history of computing is a story of ideas that became machines. " * 60)
    long_ids = long_ids[: args.prompt_tokens]
    names = ["cpullm gguf", "cpullm int8", "llama.cpp"]
    decode = {k: [] for k in names}
    prefill = {k: [] for k in names}
    for _ in range(args.rounds):
        for q, m in models.items():
            fwd = m.forward
            t = time.perf_counter()
            fwd.prefill(fwd.new_slot(), long_ids)
            prefill[f"cpullm {q}"].append(len(long_ids) / (time.perf_counter() - t))
            slot = fwd.new_slot()
            fwd.prefill(slot, short)
            nxt = 5
            t = time.perf_counter()
            for _ in range(args.steps):
                nxt = fwd.step([slot], [nxt], greedy=[True])[1][0]
            decode[f"cpullm {q}"].append(args.steps / (time.perf_counter() - t))
        llm.reset()
        t = time.perf_counter()
        llm.eval(long_ids)
        prefill["llama.cpp"].append(len(long_ids) / (time.perf_counter() - t))
        llm.reset()
        llm.eval(short)
        nxt = 5
        t = time.perf_counter()
        for _ in range(args.steps):
            llm.eval([nxt])
            nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        decode["llama.cpp"].append(args.steps / (time.perf_counter() - t))
    print(f"{args.gguf}: {args.threads} thread(s), {args.rounds} rounds, load average {' '.join(_load_average())}")
    for k in names:
        extra = ""
        if k.startswith("cpullm"):
            extra = f"  weights read per token {decode_weight_bytes(models[k.split()[1]].program) / 1e6:.1f} MB"
        print(f"  {k:12s} decode {statistics.median(decode[k]):7.1f} tok/s   prefill {len(long_ids)} "
              f"{statistics.median(prefill[k]):7.1f} tok/s{extra}")
        print(f"  {'':12s} decode rounds {[round(x, 1) for x in decode[k]]}")


if __name__ == "__main__":
    main()
