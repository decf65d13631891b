"""Prefill's Q4_K / Q6_K panel kernel with one tile size at a time, interleaved: which tile to take.

    python benchmarks/ab/panel_tiles.py [--formats Q4_K,Q6_K] [--shapes 8192x2048,2048x8192]
                                        [--rows 512] [--tiles 8,6,5,4,3,2] [--rounds 9] [--threads 2]

``kquant_panels.matmul`` cuts a prefill chunk's B rows into register tiles (``TILES``, the
largest skipped per ``SKIP_LARGEST_TILE``). This builds the same tile (``_make_tile``) at each
of ``--tiles`` rows and runs a random N x K matrix against B quantized activation rows with only
that tile, panels split over the threads as ``matmul`` splits them; the rows a tile size leaves
over are not computed, so each time is per row it computed. Each variant's output is checked
identical to ``matmul``'s first. Rounds interleave the variants; it prints the median of each
(microseconds a row, GMAC/s). Run it under ``numba_setup.restricted_target_env("avx2")`` (with a
numba cache of its own) for the AVX2 variant.
"""
from __future__ import annotations

import argparse
import time

import cpullm_kernels  # noqa: F401  (numba_setup first)
import numpy as np
from numba import njit, prange

from cpullm_kernels.panels import kquant_panels as kp
from cpullm_kernels.rows.gguf_blocks import FORMATS, random_blocks


def _runner(tile, rows_per_tile: int):
    @njit(parallel=True)
    def run(fmt, w, x_q, x_s, x_m, out, nth):
        B, Kp = x_q.shape
        npan = w.shape[0] // (Kp // 256 * kp.block_bytes(fmt) * 16)
        for c in prange(nth):
            for g in range(c * npan // nth, (c + 1) * npan // nth):
                o = out[:, 16 * g:]
                for t0 in range(0, B - rows_per_tile + 1, rows_per_tile):
                    tile(fmt, w, g, x_q, x_s, x_m, t0, o, t0)
    return run


def measure(fmt_name: str, N: int, K: int, B: int, tiles: list[int], rounds: int, threads: int, rng) -> dict:
    """{tile rows: (median seconds a row, GMAC/s)}."""
    fmt = FORMATS[fmt_name].ggml_type
    w = kp.pack(fmt, random_blocks(fmt, N, K, rng).reshape(N, -1))
    x_q, x_s, x_m = kp.quantize_rows(rng.standard_normal((B, K)).astype(np.float32), K)
    want = np.zeros((B, N), np.float32)
    kp.matmul(fmt, w, x_q, x_s, x_m, want, threads)
    runs = {}
    for rows in tiles:
        run = _runner(kp._make_tile(kp.ISA, rows, 1), rows)
        out = np.zeros((B, N), np.float32)
        run(fmt, w, x_q, x_s, x_m, out, threads)
        done = B // rows * rows
        if not np.array_equal(out[:done], want[:done]):
            raise AssertionError(f"tile of {rows} rows differs from matmul")
        runs[rows] = (run, out, done)
    times = {rows: [] for rows in tiles}
    for _ in range(rounds):
        for rows, (run, out, done) in runs.items():
            t0 = time.perf_counter()
            run(fmt, w, x_q, x_s, x_m, out, threads)
            times[rows].append((time.perf_counter() - t0) / done)
    return {rows: (float(np.median(t)), N * K / float(np.median(t)) / 1e9) for rows, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="Q4_K,Q6_K")
    ap.add_argument("--shapes", default="8192x2048,2048x8192", help="N x K, comma-separated")
    ap.add_argument("--rows", type=int, default=512, help="activation rows B (a prefill chunk)")
    ap.add_argument("--tiles", default="8,6,5,4,3,2")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    tiles = [int(t) for t in a.tiles.split(",")]
    print(f"kquant_panels ISA {kp.ISA}, TILES {kp.TILES}, B {a.rows}, {a.threads} threads, "
          f"medians of {a.rounds} interleaved rounds")
    for fmt_name in a.formats.split(","):
        for shape in a.shapes.split(","):
            N, K = (int(v) for v in shape.split("x"))
            res = measure(fmt_name, N, K, a.rows, tiles, a.rounds, a.threads, rng)
            cells = ", ".join(f"{rows}: {gmac:.1f}" for rows, (_, gmac) in res.items())
            print(f"{fmt_name} {N}x{K}: GMAC/s by tile rows  {cells}", flush=True)


if __name__ == "__main__":
    main()
