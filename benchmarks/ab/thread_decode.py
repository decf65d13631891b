"""One stream's decode rate when ``generate`` runs on the main thread against the same call on
another thread (a new thread per round, the main thread blocked in ``join``), alternating, in
one process: the difference between ``cpullm run`` (decodes on the main thread) and ``cpullm
serve`` / ``cpullm chat`` (decode on the scheduler's or the answer's thread) with the serving
and printing taken out.

    python benchmarks/ab/thread_decode.py [MODEL] [--threads 2] [--tokens 128] [--rounds 3]

Run it under different OpenMP settings (``GOMP_SPINCOUNT=0``, ``OMP_WAIT_POLICY=active``) to see
how the gap follows the team's wait policy. Decode tokens/s from the second token to the last.
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time

PROMPT = "Write a Python function that parses an ISO 8601 date and explain each step."


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quant", default="int8")
    a = ap.parse_args(argv)

    import numba

    import cpullm
    model = cpullm.load(a.model, threads=a.threads, quant=a.quant)

    def rate(out: list) -> None:
        t = [time.perf_counter() for _ in model.generate(PROMPT, max_tokens=a.tokens, temperature=0.0)]
        out.append((len(t) - 2) / (t[-1] - t[1]))

    rate([])                                        # every kernel compiled and paged in
    on_main, on_worker = [], []
    for r in range(a.rounds):
        rate(on_main)
        th = threading.Thread(target=rate, args=(on_worker,))
        th.start()
        th.join()
        print(f"round {r}: main thread {on_main[-1]:.1f} tok/s, another thread {on_worker[-1]:.1f} tok/s",
              flush=True)
    m, w = statistics.median(on_main), statistics.median(on_worker)
    print(f"median: main {m:.1f}, another thread {w:.1f} tok/s ({w / m:.3f}x); threading layer "
          f"{numba.threading_layer()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
