"""Read rate of the GGUF block matvec (cpullm_kernels.rows.kquant) against a plain read of the same bytes.

    python benchmarks/ab/kquant_matvec.py [--threads 2] [--shape 2048x8192] [--mb 256] [--rounds 7]
                                          [--formats Q4_K,Q6_K,...] [--isa all|best] [--json]

For each format: enough copies of a random N x K matrix of its blocks (finite scales) to fill
``--mb`` megabytes, so every call streams from DRAM; then ``--rounds`` rounds, each one pass of
the matvec over every copy and one pass of ``bandwidth.read_sum_u32`` (a parallel read that only
adds the words, one contiguous range per thread) over the same buffers, interleaved so both see
the same machine. Prints the median GB/s of weight-block bytes of each, their ratio (the
fraction of the read rate decode of that format reaches), and weights per second.

The CPU's load is printed first: on a shared machine the numbers are only indicative.
"""
from __future__ import annotations

import argparse
import json
import time

import cpullm_kernels  # noqa: F401  (numba_setup first)
import numba
import numpy as np

from cpullm_kernels.rows import gguf_blocks as gb
from cpullm_kernels.rows import kquant as kq
from cpullm_kernels.setup.bandwidth import as_words, read_sum_u32
from cpullm_kernels.setup.numba_setup import configure

ORDER = ["Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q5_K", "Q4_1", "Q5_0", "Q5_1"]


def load_average() -> float:
    try:
        with open("/proc/loadavg") as fh:
            return float(fh.read().split()[0])
    except OSError:
        return float("nan")


def bench_format(name: str, N: int, K: int, mb: int, rounds: int, isas, rng) -> list[dict]:
    fmt = gb.FORMATS[name]
    one = gb.random_blocks(name, N, K, rng)
    copies = max(2, (mb << 20) // one.nbytes)
    mats = [one] + [rng.permutation(one, axis=0) for _ in range(copies - 1)]
    words = [as_words(m) for m in mats]
    nbytes = sum(m.nbytes for m in mats)
    x = rng.standard_normal(K).astype(np.float32)
    x_q, x_s, x_m = np.empty(K, np.int8), np.empty(K // 32, np.float32), np.empty(K // 16, np.float32)
    kq.quantize_act_q8(x, x_q, x_s, x_m)
    out = np.empty(N, np.float32)
    nth = numba.get_num_threads()
    rows = []
    for isa in isas:
        kernel = kq.MATVECS[isa]

        def matvec_pass():
            for m in mats:
                kernel(fmt.ggml_type, m, x_q, x_s, x_m, out)

        def read_pass():
            for w in words:
                read_sum_u32(w, nth)

        matvec_pass()
        read_pass()
        t_mv, t_rd = [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            matvec_pass()
            t1 = time.perf_counter()
            read_pass()
            t2 = time.perf_counter()
            t_mv.append(t1 - t0)
            t_rd.append(t2 - t1)
        mv, rd = nbytes / np.median(t_mv) / 1e9, nbytes / np.median(t_rd) / 1e9
        rows.append({"format": name, "isa": kq.ISA_NAMES[isa], "bits_per_weight": fmt.bits_per_weight,
                     "matvec_gbps": mv, "read_gbps": rd, "ratio": mv / rd,
                     "gweights_per_s": len(mats) * N * K / np.median(t_mv) / 1e9, "bytes": nbytes})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shape", default="2048x8192", help="N x K of one matrix")
    ap.add_argument("--mb", type=int, default=256, help="megabytes of copies streamed per pass")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--formats", default=",".join(ORDER))
    ap.add_argument("--isa", choices=["all", "best"], default="best")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    N, K = (int(v) for v in args.shape.lower().split("x"))
    threads = configure(args.threads)
    isas = kq.ISAS if args.isa == "all" else [kq.BEST_ISA]
    rng = np.random.default_rng(0)
    load = load_average()
    rows = []
    if not args.json:
        print(f"threads {threads}, matrix {N} x {K}, {args.mb} MB per pass, load average {load:.2f} "
              f"(a shared machine makes these numbers indicative only)")
        print(f"{'format':6} {'isa':8} {'bits/w':>6} {'matvec GB/s':>11} {'read GB/s':>9} {'ratio':>6} {'Gw/s':>6}")
    for name in args.formats.split(","):
        for r in bench_format(name, N, K, args.mb, args.rounds, isas, rng):
            rows.append(r)
            if not args.json:
                print(f"{r['format']:6} {r['isa']:8} {r['bits_per_weight']:6.2f} {r['matvec_gbps']:11.2f} "
                      f"{r['read_gbps']:9.2f} {r['ratio']:6.2f} {r['gweights_per_s']:6.1f}", flush=True)
    if args.json:
        print(json.dumps({"threads": threads, "shape": [N, K], "load_average": load, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
