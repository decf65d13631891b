"""Old vs new GGUF block matvec (cpullm_kernels.rows.kquant), interleaved, against a plain read.

    python benchmarks/ab/kquant_ab.py [--old-rev HEAD] [--old-path kernels/cpullm_kernels/rows/kquant.py] [--threads 1]
                                      [--shape 2048x8192] [--formats Q4_1,Q4_K] [--rounds 11] [--mb 64]

The baseline ("old") is ``git show REV:PATH`` of this repository, written into a temporary
directory and imported from there as cpullm_kernels.rows.kquant_baseline (its relative imports
find the working tree's helpers; benchmarks/ab/baseline.py); nothing is written into the package
folder.

Each round runs one pass of the old kernel, one of the new and one plain parallel read
(``bandwidth.read_sum_u32``) over the same copies of a random N x K matrix of blocks (``--mb``
megabytes: streamed from DRAM), for every ISA variant but generic. Prints per-pass medians (GB/s
of block bytes, share of the read rate, G weights/s), the median of the per-round old/new time
ratios (the figure a loaded machine disturbs least: both passes of a round see the same load),
and whether the two outputs are bit-identical (else their largest difference / largest |out|).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import cpullm_kernels  # noqa: F401  (numba_setup first)
import numpy as np

from cpullm_kernels.rows import gguf_blocks as gb
from cpullm_kernels.rows import kquant as new
from cpullm_kernels.setup.bandwidth import as_words, read_sum_u32
from cpullm_kernels.setup.numba_setup import configure

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baseline import load_at_revision  # noqa: E402  (benchmarks/ab/baseline.py)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--shape", default="2048x8192", help="N x K of one matrix")
    ap.add_argument("--formats", default="Q4_1,Q4_0,Q5_0,Q4_K,Q6_K")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--mb", type=int, default=64)
    ap.add_argument("--old-rev", default="HEAD", help="git revision of the baseline kernel (default HEAD)")
    ap.add_argument("--old-path", default="kernels/cpullm_kernels/rows/kquant.py", help="the kernel's file at that revision")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cpullm-kquant-ab-") as tmp:
        return run(args, load_at_revision(args.old_rev, args.old_path, "cpullm_kernels.rows.kquant_baseline", Path(tmp)))


def run(args, old) -> int:
    threads = configure(args.threads)
    N, K = (int(v) for v in args.shape.lower().split("x"))
    rng = np.random.default_rng(0)
    with open("/proc/loadavg") as fh:
        load = fh.read().split()[0]
    print(f"threads {threads}, matrix {N} x {K}, {args.mb} MB per pass, load average {load}")
    for name in args.formats.split(","):
        fmt = gb.FORMATS[name]
        one = gb.random_blocks(name, N, K, rng)
        mats = [one] + [rng.permutation(one, axis=0) for _ in range(max(2, (args.mb << 20) // one.nbytes) - 1)]
        words = [as_words(m) for m in mats]
        nbytes = sum(m.nbytes for m in mats)
        x = rng.standard_normal(K).astype(np.float32)
        x_q, x_s, x_m = np.empty(K, np.int8), np.empty(K // 32, np.float32), np.empty(K // 16, np.float32)
        new.quantize_act_q8(x, x_q, x_s, x_m)
        out_old, out_new = np.empty(N, np.float32), np.empty(N, np.float32)
        for isa in [i for i in new.ISAS if i != new.ISA_GENERIC]:
            k_old, k_new = old.MATVECS[isa], new.MATVECS[isa]
            passes = {"old": lambda: [k_old(fmt.ggml_type, m, x_q, x_s, x_m, out_old) for m in mats],
                      "new": lambda: [k_new(fmt.ggml_type, m, x_q, x_s, x_m, out_new) for m in mats],
                      "read": lambda: [read_sum_u32(w, threads) for w in words]}
            for p in passes.values():
                p()
            k_old(fmt.ggml_type, one, x_q, x_s, x_m, out_old)
            k_new(fmt.ggml_type, one, x_q, x_s, x_m, out_new)
            same = np.array_equal(out_old, out_new)
            rel = np.abs(out_old - out_new).max() / np.abs(out_old).max()
            t = {k: [] for k in passes}
            for _ in range(args.rounds):
                for k, p in passes.items():
                    t0 = time.perf_counter()
                    p()
                    t[k].append(time.perf_counter() - t0)
            gbs = {k: nbytes / np.median(v) / 1e9 for k, v in t.items()}
            gws = {k: len(mats) * N * K / np.median(v) / 1e9 for k, v in t.items()}
            ratio = np.median(np.array(t["old"]) / np.array(t["new"]))
            print(f"{name:5} {new.ISA_NAMES[isa]:8} old {gbs['old']:6.2f} GB/s ({gbs['old'] / gbs['read']:.2f} of read, "
                  f"{gws['old']:5.1f} Gw/s)  new {gbs['new']:6.2f} GB/s ({gbs['new'] / gbs['read']:.2f}, "
                  f"{gws['new']:5.1f} Gw/s)  read {gbs['read']:6.2f}  new/old per round {ratio:.2f}  "
                  + ("identical" if same else f"differs by {rel:.1e}"), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
