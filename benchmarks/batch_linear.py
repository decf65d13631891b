"""Micro-benchmark of the decode-batch q8 LINEAR (cpullm.kernels.batch_linear): the multi-row
kernel of each ISA this CPU runs against the row-wise kernel (the one-row decode routine once per
(batch row, output)), interleaved, on one ~65 MB matrix (streamed from DRAM on every call).

    python benchmarks/batch_linear.py [--threads 2] [--rows 1,2,4,8,16] [--rounds 15] [--n 75968 --k 896] [--gemm]

Each round times every (kernel, B) once, in a shuffled order; the table shows medians over the
rounds (ms, G multiply-adds/s) and the median per-round ratio row-wise / multi-row. Every kernel's
output is first checked equal, bit for bit, to the row-wise kernel's. ``--gemm`` adds the prefill
GEMM (``q8_gemm.matmul_w8a16``, which packs each weight panel per call and sums in another order:
timed, not compared), to see what a GEMM-order batch would cost: the slope of its time over B is
its micro-kernel, the intercept mostly the packing.
"""
from __future__ import annotations

import argparse
import random
import time

import cpullm.kernels  # noqa: F401  (numba_setup first)
import numpy as np

from cpullm.kernels import batch_linear as bl, q8
from cpullm.kernels.numba_setup import configure


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--n", type=int, default=75968)
    ap.add_argument("--k", type=int, default=896)
    ap.add_argument("--gemm", action="store_true", help="also time the prefill GEMM (matmul_w8a16)")
    a = ap.parse_args()
    configure(a.threads)
    rng = np.random.default_rng(0)
    Kp = q8.padded_k(a.k)
    w_q = rng.integers(-127, 128, (a.n, Kp), dtype=np.int8)
    w_s = np.full((a.n, Kp // 32), np.float16(0.01).view(np.uint16), np.uint16)
    rows = [int(r) for r in a.rows.split(",")]
    # the generic multi-row kernel sums its lanes as the generic one-row routine, so it is
    # compared (and timed) only on hosts without AVX2
    kernels = {"rowwise": bl._rows_q8_rowwise,
               **{n: k for n, k in bl.ROWS_Q8_KERNELS.items() if n != "generic" or not q8.HAVE_AVX2}}
    data = {}
    for B in rows:
        x = rng.standard_normal((B, a.k)).astype(np.float32)
        xq, xs = np.zeros((B, Kp), np.int16), np.zeros((B, Kp // 32), np.float32)
        bl._quantize_rows(x, xq, xs)
        outs = {name: np.zeros((B, a.n), np.float32) for name in kernels}
        for name, kern in kernels.items():
            kern(w_q, w_s, xq, xs, outs[name])
            if not np.array_equal(outs[name], outs["rowwise"]):
                raise SystemExit(f"{name} differs from the row-wise kernel at B={B}")
        data[B] = (xq, xs, outs, x)
    if a.gemm:
        from cpullm.kernels.q8_gemm import GEMM_ISA, matmul_w8a16
        if GEMM_ISA is None:
            raise SystemExit("--gemm: the prefill GEMM needs x86 with AVX2 (or AVX-512 VNNI)")
        kernels["gemm"] = None                  # called with the float rows (it quantizes them itself)
        for B in rows:
            data[B][2]["gemm"] = np.zeros((B, a.n), np.float32)
    times = {(name, B): [] for name in kernels for B in rows}
    for _ in range(a.rounds):
        order = list(times)
        random.shuffle(order)
        for name, B in order:
            xq, xs, outs, x = data[B]
            t = time.perf_counter()
            if name == "gemm":
                matmul_w8a16(x, w_q, w_s, outs[name])
            else:
                kernels[name](w_q, w_s, xq, xs, outs[name])
            times[name, B].append(time.perf_counter() - t)
    print(f"{a.n} x {Kp} q8 ({w_q.nbytes / 1e6:.0f} MB + scales), {a.threads} threads, {a.rounds} rounds, "
          f"multi-row ISA in use: {bl.ROWS_Q8_ISA}")
    print("| B | " + " | ".join(f"{n} ms" for n in kernels) + " | " + " | ".join(
        f"{n} GMAC/s" for n in kernels) + " | " + " | ".join(f"rowwise / {n}" for n in kernels if n != "rowwise") + " |")
    print("|---:" * (1 + 3 * len(kernels) - 1) + "|")
    for B in rows:
        med = {n: float(np.median(times[n, B])) for n in kernels}
        ratios = [float(np.median(np.array(times["rowwise", B]) / np.array(times[n, B]))) for n in kernels if n != "rowwise"]
        macs = a.n * Kp * B
        print(f"| {B} | " + " | ".join(f"{med[n] * 1e3:.{1 if med[n] > 0.01 else 3}f}" for n in kernels) + " | "
              + " | ".join(f"{macs / med[n] / 1e9:.1f}" for n in kernels) + " | "
              + " | ".join(f"{r:.2f}x" for r in ratios) + " |")


if __name__ == "__main__":
    main()
