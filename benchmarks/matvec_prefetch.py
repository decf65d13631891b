"""Where matvec_q8 should prefetch its weight stream: L1 or L2, on a real model's decode matrices.

    python benchmarks/matvec_prefetch.py MODEL [--threads 2] [--rounds 90]

Loads MODEL (a cpullm store name or directory, INT8), takes the body's LINEAR instructions of its
compiled program (every matrix one decode token reads but the lm_head, in program order, on the
program's own memory-mapped weights) and times three sweeps over them, interleaved round by
round in rotating order: each LINEAR's activations quantized and its matrix-vector product with

  * ``L1``: the software prefetch 4 KiB ahead as ``prefetcht0`` for every matrix,
  * ``L2 long``: ``prefetcht1`` for rows of at least ``q8.LONG_ROW_K``, ``prefetcht0`` otherwise,
  * ``L2``: ``prefetcht1`` for every matrix.

Prints GB/s (int8 values + binary16 scales) of each and the median over rounds of each one's
time / the ``L1`` sweep's in the same round (a shared host's drift cancels in the ratio).
``cpullm.kernels.q8.matvec_q8`` picks between the two prefetches (see its docstring).
"""
from __future__ import annotations

import argparse
import time

import cpullm
import numba
import numpy as np
from numba import njit, prange
from numba.extending import intrinsic

from cpullm.kernels import program_table as P
from cpullm.kernels import q8


def _matvec(locality: int):
    @intrinsic
    def row_dot(typingctx, w_q, w_s, x_q, x_s, n):
        return q8._row_dot_typer(w_q, w_s, x_q, x_s, n, q8.HAVE_AVX2, True, locality)

    @njit(parallel=True)
    def matvec(w_q, w_s, x_q, x_s, out):
        for n in prange(w_q.shape[0]):
            out[n] = row_dot(w_q, w_s, x_q, x_s, n)
    return matvec


_MV_L1, _MV_L2 = _matvec(3), _matvec(2)


@njit
def _sweep(mode, I, arena, wq, ws, xq, xs, long_k):
    """mode 0: L1 everywhere; 1: L2 for rows >= long_k; 2: L2 everywhere."""
    for r in range(I.shape[0]):
        x_off, o_off, Kd, N = I[r, P.LINEAR_X_OFF], I[r, P.LINEAR_OUT_OFF], I[r, P.LINEAR_K], I[r, P.LINEAR_N]
        w_off, s_off, Kp = I[r, P.LINEAR_W_OFF], I[r, P.LINEAR_S_OFF], I[r, P.LINEAR_KP]
        q8.quantize_act_q16(arena[x_off:x_off + Kd], xq[:Kp], xs[:Kp // 32])
        w = wq[w_off: w_off + N * Kp].reshape(N, Kp)
        s = ws[s_off: s_off + N * (Kp // 32)].reshape(N, Kp // 32)
        if mode == 2 or (mode == 1 and Kp >= long_k):
            _MV_L2(w, s, xq[:Kp], xs[:Kp // 32], arena[o_off: o_off + N])
        else:
            _MV_L1(w, s, xq[:Kp], xs[:Kp // 32], arena[o_off: o_off + N])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=90)
    args = ap.parse_args(argv)
    m = cpullm.load(args.model, threads=args.threads)
    ex = m.executor
    body_end = ex.screen.row if ex.screen is not None else ex.first_head
    rows = [r for r in range(body_end)
            if ex.I[r, P.COL_OP] == P.OP_LINEAR and ex.I[r, P.LINEAR_KIND] == P.WEIGHT_Q8]
    if not rows:
        raise SystemExit("matvec_prefetch: the program has no INT8 body matrices (load it with --quant int8)")
    lin = np.ascontiguousarray(ex.I[rows])
    nbytes = sum(int(r[P.LINEAR_N]) * int(r[P.LINEAR_KP]) * 17 // 16 for r in lin)        # int8 values + a binary16 per 32
    sweep_args = (lin, ex.arena, ex.wq, ex.ws, ex.xq, ex.xs, q8.LONG_ROW_K)
    names = ["L1", "L2 long", "L2"]
    for mode in range(3):
        _sweep(mode, *sweep_args)
    times: list[list[float]] = [[], [], []]
    orders = [(0, 1, 2), (2, 0, 1), (1, 2, 0)]
    for i in range(args.rounds):
        for mode in orders[i % 3]:
            t0 = time.perf_counter()
            _sweep(mode, *sweep_args)
            times[mode].append(time.perf_counter() - t0)
    base = np.array(times[0])
    print(f"{args.model}: {len(rows)} matrices, {nbytes / 1e6:.1f} MB, {numba.get_num_threads()} thread(s), "
          f"{args.rounds} rounds, LONG_ROW_K {q8.LONG_ROW_K}")
    for mode, name in enumerate(names):
        t = np.array(times[mode])
        print(f"  {name:8s} {nbytes / np.median(t) / 1e9:6.1f} GB/s   time / L1's: {np.median(t / base):.3f}")


if __name__ == "__main__":
    main()
