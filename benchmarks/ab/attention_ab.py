"""Prefill (or decode) attention of a git revision against the working tree's, interleaved.

    python benchmarks/ab/attention_ab.py [--old-rev HEAD] [--shapes smollm2,qwen2.5-0.5b,gemma3-270m,llama-1b]
                                         [--tokens 512] [--chunk 512] [--kv f16] [--rounds 12] [--threads 2]

The baseline is ``git show REV:kernels/cpullm_kernels/attention/attention.py`` written to a
temporary directory and imported as ``cpullm_kernels.attention.attention_baseline`` (its relative
imports find the working tree's helpers). For each model shape (query heads / KV heads /
head_dim) both kernels attend ``--tokens`` positions in chunks of ``--chunk`` rows (512: one
prefill chunk; 1: decode, a step per position) over the same random queries, keys and values in
64-byte aligned memory, as the executor holds them. Outputs are checked bit-identical first;
then rounds alternate old and new, and it prints each one's median milliseconds and the median
of the per-round old/new ratios (the figure a loaded machine disturbs least). Run it under
``numba_setup.restricted_target_env("avx2")`` (with a numba cache of its own) for AVX2 code.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import cpullm_kernels  # noqa: F401  (numba_setup first)
import numpy as np

from cpullm.compile.aligned import aligned_zeros
from cpullm_kernels.attention import attention as new
from cpullm_kernels.setup.numba_setup import configure

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baseline import load_at_revision  # noqa: E402  (benchmarks/ab/baseline.py)

SHAPES = {"smollm2": (9, 3, 64), "qwen2.5-0.5b": (14, 2, 64), "gemma3-270m": (4, 1, 256), "llama-1b": (32, 8, 64)}
KV = {"f32": 0, "f16": 1, "q8_0": 2}


def run_shape(mods, shape, T, chunk, code, threads, rounds):
    nh, nkv, hd = shape
    cap = new.padded_cap(T)
    qst, kst = nh * hd, nkv * hd
    arena = aligned_zeros(T * (2 * qst + 2 * kst))
    arena[: T * (qst + 2 * kst)] = np.random.default_rng(0).standard_normal(T * (qst + 2 * kst)).astype(np.float32)
    q, k, v, o = 0, T * qst, T * (qst + kst), T * (qst + 2 * kst)
    state = aligned_zeros(2 * nkv * cap * hd + 2 * nkv * cap * new.q8_blocks(hd))

    def once(m):
        for pos0 in range(0, T, chunk):
            t = min(chunk, T - pos0)
            m.attention(arena, state, q + pos0 * qst, qst, k + pos0 * kst, kst, v + pos0 * kst, kst, o + pos0 * qst,
                        qst, nh, nkv, hd, 0, cap, np.float32(hd ** -0.5), np.float32(0.0), 0, pos0, t, threads,
                        m.kv_operand(code))
    outs = []
    for m in mods:
        once(m)
        outs.append(arena[o:].copy())
    times = [[], []]
    for _ in range(rounds):
        for i, m in enumerate(mods):
            t0 = time.perf_counter()
            once(m)
            times[i].append(time.perf_counter() - t0)
    ratio = float(np.median(np.array(times[0]) / np.array(times[1])))
    same = np.array_equal(outs[0].view(np.int32), outs[1].view(np.int32))
    return [float(np.median(t)) * 1e3 for t in times], ratio, same


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old-rev", default="HEAD")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--kv", choices=list(KV), default="f16")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    threads = configure(args.threads)
    with tempfile.TemporaryDirectory(prefix="cpullm-attention-ab-") as tmp:
        old = load_at_revision(args.old_rev, "kernels/cpullm_kernels/attention/attention.py",
                               "cpullm_kernels.attention.attention_baseline", Path(tmp))
        print(f"threads {threads}, {args.tokens} tokens in chunks of {args.chunk}, KV {args.kv}, "
              f"value vectors per pass: old {old.PV_VECTORS}, new {new.PV_VECTORS}")
        for name in args.shapes.split(","):
            (t_old, t_new), ratio, same = run_shape((old, new), SHAPES[name], args.tokens, args.chunk, KV[args.kv],
                                                    threads, args.rounds)
            print(f"{name:14s} {SHAPES[name]}: old {t_old:7.2f} ms  new {t_new:7.2f} ms  old/new {ratio:.2f}x  "
                  f"{'same bits' if same else 'OUTPUTS DIFFER'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
