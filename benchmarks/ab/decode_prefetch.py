"""Decode's lone-row panel tiles, two ways each, interleaved, beside a plain read.

    python benchmarks/ab/decode_prefetch.py [--threads 2] [--shapes 8192x2048,2048x8192]
                                            [--formats int8,Q4_K,Q6_K] [--mb 64] [--rounds 8]
                                            [--kq-against group|mins-beside]

Decode (one activation row) runs the INT8 panels (``q8_panels``) through a tile of 1 x 4 panels
without prefetch instructions: here against the same tile with them (``_make_tile(...,
prefetch=True)``). The Q4_K / Q6_K panels (``kquant_panels``) run it through the one-panel tile,
which prefetches 4 KiB ahead and sums a super-block's mins after its quants ("panel"): here
against the tile of 4 panels without prefetches that decode took before ("group"), or with
``--kq-against mins-beside`` against the one-panel tile with the min sums beside the quants' (what
the AVX-512 variant's one-row tile did before, ``kquant_panels.mins_apart``). Both run over the
same copies of a random N x K matrix (``--mb`` megabytes in all: streamed from DRAM), one group of
4 panels after another split over the threads as the modules' matmul does, alternating with a
plain parallel read of the same bytes
(``bandwidth.read_sum_u32``). Prints, per format and shape, the median GB/s of each and the median
of the per-round time ratios (first / second: above 1, the first takes longer), after checking the
two outputs are identical.
"""
from __future__ import annotations

import argparse
import time

import cpullm_kernels  # noqa: F401  (numba_setup first)
import numba
import numpy as np
from numba import njit, prange

from cpullm_kernels.panels import kquant_panels as kp
from cpullm_kernels.panels import q8_panels as qp
from cpullm_kernels.rows.gguf_blocks import FORMATS, random_blocks
from cpullm_kernels.rows.q8 import quantize_act_q16
from cpullm_kernels.setup.bandwidth import as_words, read_sum_u32


def _q8_runner(tile):
    @njit(parallel=True)
    def run(wp, sp, x_q, x_s, out, nth):
        ngroups = wp.shape[0] // (64 * x_q.shape[1])
        for c in prange(nth):
            for grp in range(c * ngroups // nth, (c + 1) * ngroups // nth):
                tile(wp, sp, grp * 4, x_q, x_s, 0, out, 0, grp * 64)
    return run


def _kq_runner(tile, V):
    """Groups of 4 panels split over the threads; each group as 4 / V tiles of V panels."""
    @njit(parallel=True)
    def run(fmt, w, x_q, x_s, x_m, out, nth):
        nsb = x_q.shape[1] // 256
        ngroups = w.shape[0] // (nsb * kp.block_bytes(fmt) * 16) // 4
        for c in prange(nth):
            for grp in range(c * ngroups // nth, (c + 1) * ngroups // nth):
                for g in range(grp * 4, grp * 4 + 4, V):
                    tile(fmt, w, g, x_q, x_s, x_m, 0, out[:, g * 16:], 0)
    return run


def passes(fmt: str, N: int, K: int, copies: int, rng, threads: int, kq_against: str = "group"):
    """{name: fn} for the two tiles, each running every copy once; their outputs; the bytes of one
    copy; the arrays."""
    if fmt == "int8":
        ws = [qp.pack_panels(rng.integers(-127, 128, (N, K), dtype=np.int8),
                             np.full((N, K // 32), 0x2000, np.uint16)) for _ in range(copies)]
        x_q = np.zeros((1, K), np.int16)
        x_s = np.zeros((1, K // 32), np.float32)
        quantize_act_q16(rng.standard_normal(K).astype(np.float32), x_q[0], x_s[0])
        outs = {k: np.empty((1, N), np.float32) for k in ("prefetch", "none")}
        runs = {k: _q8_runner(qp._make_tile(qp.ISA, 1, 4, prefetch=k == "prefetch")) for k in outs}
        fns = {k: (lambda k=k: [runs[k](wp, sp, x_q, x_s, outs[k], threads) for wp, sp in ws]) for k in outs}
        return fns, outs, ws[0][0].nbytes + ws[0][1].nbytes, [w for pair in ws for w in pair]
    F = FORMATS[fmt]
    ws = [kp.pack(F.ggml_type, random_blocks(F, N, K, rng)) for _ in range(copies)]
    x_q, x_s, x_m = kp.quantize_rows(rng.standard_normal((1, K)).astype(np.float32), K)
    outs = {k: np.empty((1, N), np.float32) for k in ("panel", kq_against)}
    other = (_kq_runner(kp._make_tile(kp.ISA, 1, kp.GROUP, prefetch=False, apart=kp.ISA in kp.YMM_ISAS), kp.GROUP)
             if kq_against == "group"
             else _kq_runner(kp._make_tile(kp.ISA, 1, 1, apart=False), 1))
    runs = {"panel": _kq_runner(kp._make_tile(kp.ISA, 1, 1), 1), kq_against: other}
    fns = {k: (lambda k=k: [runs[k](F.ggml_type, w, x_q, x_s, x_m, outs[k], threads) for w in ws]) for k in outs}
    return fns, outs, ws[0].nbytes, ws


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default="8192x2048,2048x8192")
    ap.add_argument("--formats", default="int8,Q4_K,Q6_K")
    ap.add_argument("--mb", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--kq-against", choices=("group", "mins-beside"), default="group",
                    help="what decode's Q4_K / Q6_K tile is timed against (see above)")
    a = ap.parse_args(argv)
    numba.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    print(f"ISA: q8_panels {qp.ISA}, kquant_panels {kp.ISA}; {a.threads} thread(s)")
    for fmt in a.formats.split(","):
        for shape in a.shapes.split(","):
            N, K = (int(v) for v in shape.split("x"))
            one = N * K * (1 if fmt == "int8" else FORMATS[fmt].bits_per_weight / 8)
            copies = max(1, int(a.mb * 1e6 // one))
            fns, outs, nbytes, arrays = passes(fmt, N, K, copies, rng, a.threads, a.kq_against)
            words = [as_words(w) for w in arrays]

            def read():
                for w in words:
                    read_sum_u32(w, a.threads)
            for f in fns.values():
                f()
            read()
            first, second = fns
            if not np.array_equal(outs[first], outs[second]):
                raise SystemExit(f"{fmt} {shape}: the two tiles' outputs differ")
            times = {k: [] for k in (first, second, "read")}
            for _ in range(a.rounds):
                for k, f in ((first, fns[first]), (second, fns[second]), ("read", read)):
                    t = time.perf_counter()
                    f()
                    times[k].append((time.perf_counter() - t) / copies)
            med = {k: float(np.median(v)) for k, v in times.items()}
            ratio = float(np.median(np.array(times[first]) / np.array(times[second])))
            gbs = {k: nbytes / v / 1e9 for k, v in med.items()}
            print(f"{fmt:5s} {shape:>11s}: {first} {gbs[first]:5.1f} GB/s, {second} {gbs[second]:5.1f} GB/s, "
                  f"plain read {gbs['read']:5.1f} GB/s; time {first} / {second} {ratio:.2f}")


if __name__ == "__main__":
    main()
