"""Micro-benchmark of the decode-batch q8 LINEAR (cpullm_kernels.panels.q8_panels.panels_matmul) at each
batch size B, interleaved, on one ~65 MB matrix (streamed from DRAM on every call where that
exceeds the L3 cache; ``--n`` sets the size).

    python benchmarks/ab/batch_linear.py [--threads 2] [--rows 1,2,4,8,16] [--rounds 15] [--n 75968 --k 896] [--gemm]

Each round times every (kernel, B) once, in a shuffled order; the table shows medians over the
rounds (ms, G multiply-adds/s) and the median per-round ratio of each time to the panels kernel's
time at the first B of ``--rows`` in the same round (a shared host's drift cancels in the ratio):
how much a batch of B costs against one decode step. Before timing, every B's rows are checked
equal, bit for bit, to the same rows at the largest B (batch invariance), and the first
CHECK_ROWS outputs of every row against ``q8.matvec_q8_ref``. ``--gemm`` adds the W8A16 GEMM (``q8_gemm.matmul_w8a16``,
which packs each weight panel per call: timed, not compared) on the same weights, row-major.
"""
from __future__ import annotations

import argparse
import random
import time

import cpullm_kernels  # noqa: F401  (numba_setup first)
import numba
import numpy as np

from cpullm_kernels.rows import q8
from cpullm_kernels.panels import q8_panels
from cpullm_kernels.setup.numba_setup import configure

CHECK_ROWS = 256
"""Weight rows checked against the numpy reference (all of them would take minutes)."""


def _weights(n: int, k: int, rng):
    """Random q8 weights (n, Kp): row-major (w_q, w_s) and their panels (wp, sp)."""
    Kp = q8.padded_k(k)
    w_q = rng.integers(-127, 128, (n, Kp), dtype=np.int8)
    w_s = np.full((n, Kp // 32), np.float16(0.01).view(np.uint16), np.uint16)
    return w_q, w_s, *q8_panels.pack_panels(w_q, w_s)


def _quantized(x):
    """x float32 (B, K) -> int16 activation blocks x_q (B, Kp), x_s (B, Kp // 32)."""
    Kp = q8.padded_k(x.shape[1])
    x_q, x_s = np.zeros((x.shape[0], Kp), np.int16), np.zeros((x.shape[0], Kp // 32), np.float32)
    for t in range(x.shape[0]):
        q8.quantize_act_q16(x[t], x_q[t], x_s[t])
    return x_q, x_s


def _check(w_q, w_s, x_q, x_s, outs, rows):
    """Batch invariance (each B's rows equal the largest B's bit for bit) and the numpy reference."""
    full = outs[max(rows)]
    for B in rows:
        if not np.array_equal(outs[B], full[:B]):
            raise SystemExit(f"panels_matmul: rows at B={B} differ from the same rows at B={max(rows)}")
    for t in range(max(rows)):
        ref = q8.matvec_q8_ref(w_q[:CHECK_ROWS], w_s[:CHECK_ROWS], x_q[t], x_s[t])
        if np.abs(full[t, :CHECK_ROWS] - ref).max() > 1e-5 * np.abs(ref).max():
            raise SystemExit(f"panels_matmul: row {t} differs from q8.matvec_q8_ref")


def _time_rounds(calls, rounds):
    """{key: [seconds per round]}: every call once per round, in a shuffled order, after one
    untimed call each (compilation, first touch of the output)."""
    for call in calls.values():
        call()
    times = {key: [] for key in calls}
    for _ in range(rounds):
        order = list(calls)
        random.shuffle(order)
        for key in order:
            t = time.perf_counter()
            calls[key]()
            times[key].append(time.perf_counter() - t)
    return times


def _table(times, names, rows, macs_per_row):
    """Markdown table: per B, each kernel's median ms and G multiply-adds/s, and its median
    per-round time / the panels kernel's time at B = rows[0]."""
    base = np.array(times["panels", rows[0]])
    print("| B | " + " | ".join(f"{n} ms" for n in names) + " | " + " | ".join(f"{n} GMAC/s" for n in names)
          + " | " + " | ".join(f"{n} / panels B={rows[0]}" for n in names) + " |")
    print("|---:" * (1 + 3 * len(names)) + "|")
    for B in rows:
        med = {n: float(np.median(times[n, B])) for n in names}
        ratio = {n: float(np.median(np.array(times[n, B]) / base)) for n in names}
        print(f"| {B} | " + " | ".join(f"{med[n] * 1e3:.{1 if med[n] > 0.01 else 3}f}" for n in names) + " | "
              + " | ".join(f"{macs_per_row * B / med[n] / 1e9:.1f}" for n in names) + " | "
              + " | ".join(f"{ratio[n]:.2f}x" for n in names) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--n", type=int, default=75968)
    ap.add_argument("--k", type=int, default=896)
    ap.add_argument("--gemm", action="store_true", help="also time the W8A16 GEMM (matmul_w8a16)")
    a = ap.parse_args()
    configure(a.threads)
    nthreads = numba.get_num_threads()
    rng = np.random.default_rng(0)
    w_q, w_s, wp, sp = _weights(a.n, a.k, rng)
    rows = [int(r) for r in a.rows.split(",")]
    x = rng.standard_normal((max(rows), a.k)).astype(np.float32)
    x_q, x_s = _quantized(x)
    outs = {B: np.zeros((B, a.n), np.float32) for B in rows}
    calls = {("panels", B): (lambda B=B: q8_panels.panels_matmul(wp, sp, a.n, x_q[:B], x_s[:B], outs[B], nthreads))
             for B in rows}
    for call in calls.values():
        call()
    _check(w_q, w_s, x_q, x_s, outs, rows)
    names = ["panels"]
    if a.gemm:
        from cpullm_kernels.tiles.q8_gemm import GEMM_ISA, matmul_w8a16
        if GEMM_ISA is None:
            raise SystemExit("--gemm: the W8A16 GEMM needs x86 with AVX2 (or AVX-512 VNNI)")
        gemm_out = {B: np.zeros((B, a.n), np.float32) for B in rows}
        calls.update({("gemm", B): (lambda B=B: matmul_w8a16(x[:B], w_q, w_s, gemm_out[B])) for B in rows})
        names.append("gemm")
    times = _time_rounds(calls, a.rounds)
    Kp = w_q.shape[1]
    print(f"{a.n} x {Kp} q8 ({w_q.nbytes / 1e6:.0f} MB + scales), {nthreads} threads, {a.rounds} rounds, "
          f"panels ISA {q8_panels.ISA}")
    _table(times, names, rows, a.n * Kp)


if __name__ == "__main__":
    main()
