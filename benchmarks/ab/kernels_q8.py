"""Microbenchmark of the INT8 LINEAR (cpullm_kernels.panels.q8_panels) and the f32 kernels on real model shapes.

    python benchmarks/ab/kernels_q8.py [--threads 2,1] [--models qwen05,smol135] [--quick]
                                        [--wait-idle SECONDS] [--skip matmul]

Prints, per thread count:
  * the DRAM read ceiling (cpullm_kernels.setup.bandwidth.read_rate over 1 GiB: the read `cpullm bench`
    measures decode against);
  * the one-token q8 LINEAR (q8_panels.panels_matmul, B = 1) and q8.matvec_f32: GB/s of weight
    bytes (int8 + binary16 scales, panels padded to 64 rows / float32), per shape, cycling through
    512 MB of copies of each matrix (one flat buffer) so every call streams from DRAM;
  * a whole decode sweep (every matrix of every layer + lm_head once, as one token reads them):
    ms per token and the tokens/s bound this sets;
  * prefill at T=512: q8_panels.matmul_panels (the runtime's q8 prefill) and, where the CPU has
    AVX2 or AVX-512 VNNI, the W8A16 GEMM (q8_gemm.matmul_w8a16): GOP/s next to numpy sgemm on
    float32 weights;
  * per-call overhead of quantize_act_q16 + panels_matmul called from a serial @njit wrapper (the
    interpreter pattern) on 32 x 32 and 576 x 576 matrices, next to panels_matmul called from
    Python and matvec_f32 from @njit.

The machine may be shared: ``--wait-idle S`` waits up to S seconds for an idle CPU before each
section. Timings are the median of repeats (best in brackets).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import cpullm_kernels  # noqa: F401  (numba_setup first)
import numba
import numpy as np
from numba import njit

from cpullm.bench import cpu_busy as bench_cpu_busy
from cpullm_kernels.rows import q8
from cpullm_kernels.tiles import q8_gemm
from cpullm_kernels.panels import q8_panels
from cpullm_kernels.setup.bandwidth import read_rate
from cpullm_kernels.setup.numba_setup import configure


MODELS = {
    # name: (layers, [(label, N, K), ...] per layer, lm_head (N, K))
    "qwen05": (24, [("qkv", 896 + 2 * 128, 896), ("o", 896, 896), ("gate_up", 2 * 4864, 896),
                    ("down", 896, 4864)], ("lm_head", 151936, 896)),
    "gemma270": (18, [("qkv", 1024 + 2 * 256, 640), ("o", 640, 1024), ("gate_up", 2 * 2048, 640),
                      ("down", 640, 2048)], ("lm_head", 262144, 640)),
    "smol135": (30, [("qkv", 576 + 2 * 192, 576), ("o", 576, 576), ("gate_up", 2 * 1536, 576),
                     ("down", 576, 1536)], ("lm_head", 49152, 576)),
}


def cpu_busy():
    return bench_cpu_busy(0.5) or 0.0


def wait_idle(limit):
    if not limit:
        return
    end = time.time() + limit
    while time.time() < end:
        if cpu_busy() < 0.05 and cpu_busy() < 0.05:
            return
        time.sleep(1)
    print(f"  (machine still busy: {100 * cpu_busy():.0f}% CPU used by others)")


def timeit(fn, reps, inner=1):
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        ts.append((time.perf_counter() - t) / inner)
    ts = np.array(ts)
    return float(np.median(ts)), float(ts.min())


@njit(cache=True)
def _wrapper_loop(wp, sp, N, x, x_q, x_s, out, nthreads, reps):
    # the interpreter pattern: a serial njit function calling quantize + the parallel q8 LINEAR
    for _ in range(reps):
        q8.quantize_act_q16(x, x_q[0], x_s[0])
        q8_panels.panels_matmul(wp, sp, N, x_q, x_s, out, nthreads)


@njit(cache=True)
def _wrapper_loop_f32(w, x, out, reps):
    for _ in range(reps):
        q8.matvec_f32(w, x, out)


STREAM_BYTES = 512 << 20
"""Weights cycled through per shape: far beyond L3 (32 MiB; reads stay faster than DRAM up to
~200 MB here), so every call streams from DRAM, as in decode."""


def _flat(nbytes, dtype, rng):
    """A flat buffer (one allocation, like the interpreter's packed weights) of random values."""
    n = nbytes // np.dtype(dtype).itemsize
    chunk = (rng.integers(-127, 128, min(n, 1 << 24)) if dtype == np.int8
             else rng.standard_normal(min(n, 1 << 24))).astype(dtype)
    return np.resize(chunk, n)


def _mats(N, K, kind, rng, total=STREAM_BYTES):
    """Flat (wp, sp) panels (kind "q8") or w (N, K) of consecutive matrices in one flat buffer of
    ~total bytes. Random bytes are as good as packed weights for timing: only the size counts."""
    Kp = q8.padded_k(K)
    if kind == "q8":
        Np = q8_panels.padded_rows(N)
        nc = max(1, total // (Np * Kp))
        fq = _flat(nc * Np * Kp, np.int8, rng)
        fs = _scales(nc * Np * Kp // 32, rng)
        return [(fq[i * Np * Kp:(i + 1) * Np * Kp], fs[i * Np * Kp // 32:(i + 1) * Np * Kp // 32])
                for i in range(nc)]
    nc = max(1, total // (N * K * 4))
    f = _flat(nc * N * K * 4, np.float32, rng)
    return [f[i * N * K:(i + 1) * N * K].reshape(N, K) for i in range(nc)]


def _scales(n, rng):
    """n binary16 weight-scale bit patterns around 1e-3 (as uint16)."""
    return ((np.abs(rng.standard_normal(n)) + 0.5) * 1e-3).astype(np.float16).view(np.uint16)


def make_q8(N, K, rng):
    """One random row-major q8 matrix: (w_q int8 (N, Kp), w_s uint16 (N, Kp // 32))."""
    Kp = q8.padded_k(K)
    return rng.integers(-127, 128, (N, Kp), dtype=np.int8), _scales(N * Kp // 32, rng).reshape(N, Kp // 32)


def _act(Kp, rng):
    """One random row of int16 activation blocks: x_q (1, Kp), x_s (1, Kp // 32)."""
    return rng.integers(-32767, 32768, (1, Kp), dtype=np.int16), rng.random((1, Kp // 32), dtype=np.float32)


def bench_matvec(shapes, rng, reps, kind):
    """kind 'q8' or 'f32'; returns {label: (median GB/s, best GB/s, ms per call)}."""
    res = {}
    nthreads = numba.get_num_threads()
    for label, N, K in shapes:
        Kp = q8.padded_k(K)
        mats = _mats(N, K, kind, rng)
        per = (mats[0][0].size + mats[0][1].nbytes) if kind == "q8" else N * K * 4
        nc = len(mats)
        x_q, x_s = _act(Kp, rng)
        x = rng.standard_normal(K, dtype=np.float32)
        out = np.empty((1, N), np.float32)

        def run():
            for m in mats:
                if kind == "q8":
                    q8_panels.panels_matmul(m[0], m[1], N, x_q, x_s, out, nthreads)
                else:
                    q8.matvec_f32(m, x, out[0])
        run()
        med, best = timeit(run, reps)
        res[label] = (per * nc / med / 1e9, per * nc / best / 1e9, med / nc * 1e3)
    return res


def bench_sweep(model, rng, reps):
    """One decode token's worth of q8 LINEARs (panels_matmul, B = 1; all layers + lm_head),
    panels in one flat buffer in call order as the interpreter keeps them."""
    layers, shapes, head = MODELS[model]
    order = [(N, q8.padded_k(K)) for _ in range(layers) for _, N, K in shapes] + [(head[1], q8.padded_k(head[2]))]
    sizes = [q8_panels.padded_rows(N) * Kp for N, Kp in order]
    fq = _flat(sum(sizes), np.int8, rng)
    fs = _scales(sum(sizes) // 32, rng)
    mats, off = [], 0
    for (N, Kp), sz in zip(order, sizes):
        mats.append((N, Kp, fq[off:off + sz], fs[off // 32:(off + sz) // 32]))
        off += sz
    xs = {Kp: _act(Kp, rng) for _, Kp in order}
    outs = {N: np.empty((1, N), np.float32) for N, _ in order}
    nbytes = fq.nbytes + fs.nbytes
    nthreads = numba.get_num_threads()

    def run():
        for N, Kp, wp, sp in mats:
            x_q, x_s = xs[Kp]
            q8_panels.panels_matmul(wp, sp, N, x_q, x_s, outs[N], nthreads)
    run()
    med, best = timeit(run, reps)
    return nbytes, med, best


def bench_matmul(shapes, rng, T, reps):
    res = {}
    for label, N, K in shapes:
        w_q, w_s = make_q8(N, K, rng)
        wp, sp = q8_panels.pack_panels(w_q, w_s)
        x = rng.standard_normal((T, K), dtype=np.float32)
        out = np.empty((T, N), np.float32)
        w = np.ascontiguousarray(q8.dequantize_weight_q8(w_q, w_s)[:, :K])
        flops = 2.0 * T * N * K
        r = max(2, int(reps * min(1.0, 2e10 / flops / 10)))
        fns = {"panels": lambda: q8_panels.matmul_panels(x, wp, sp, N, out),
               "w8a16": (lambda: q8_gemm.matmul_w8a16(x, w_q, w_s, out)) if q8_gemm.GEMM_ISA else None,
               "sgemm": lambda: np.matmul(x, w.T, out=out)}
        res[label] = {}
        for name, fn in fns.items():
            if fn is None:
                continue
            fn()
            med, best = timeit(fn, r)
            res[label][name] = (flops / med / 1e9, flops / best / 1e9)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="2,1")
    ap.add_argument("--models", default="qwen05,smol135")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--quick", action="store_true", help="fewer repeats, no decode sweep")
    ap.add_argument("--skip", default="", help="comma list of: ceiling,matvec,f32,sweep,matmul,overhead")
    ap.add_argument("--wait-idle", type=float, default=0.0)
    a = ap.parse_args(argv)
    skip = set(filter(None, a.skip.split(",")))
    reps = 3 if a.quick else a.reps
    rng = np.random.default_rng(0)
    print(f"numba {numba.__version__}, numpy {np.__version__}, threading layer: ", end="")
    configure(1)
    read_rate([np.ones(1024, np.uint32)], repeat=1)
    print(numba.threading_layer(), f"| q8 panels: {q8_panels.ISA}",
          f"| W8A16 GEMM: {q8_gemm.GEMM_ISA or 'none'}",
          f"| GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')}")
    big = None if "ceiling" in skip else np.ones(256 << 20, np.uint32)   # 1 GiB
    for th in (int(t) for t in a.threads.split(",")):
        configure(th)
        print(f"\n=== {th} thread(s) ===")
        if big is not None:
            wait_idle(a.wait_idle)
            r = read_rate([big], repeat=reps)
            print(f"DRAM read ceiling (bandwidth.read_rate, 1 GiB): {r['gbps']:.1f} GB/s "
                  f"[best {r['best_gbps']:.1f}]")
        for model in a.models.split(","):
            layers, shapes, head = MODELS[model]
            allshapes = shapes + [head]
            if "matvec" not in skip:
                wait_idle(a.wait_idle)
                r = bench_matvec(allshapes, rng, reps, "q8")
                for label, (g, gb, ms) in r.items():
                    N, K = next((n, k) for lb, n, k in allshapes if lb == label)
                    print(f"  {model:8s} q8 panels  {label:8s} [{N:6d} x {K:5d}] {g:5.1f} GB/s "
                          f"[best {gb:5.1f}]  {ms * 1e3:8.1f} us/call")
            if "f32" not in skip:
                wait_idle(a.wait_idle)
                r = bench_matvec(allshapes, rng, max(3, reps // 2), "f32")
                for label, (g, gb, ms) in r.items():
                    print(f"  {model:8s} matvec_f32 {label:8s} {g:5.1f} GB/s [best {gb:5.1f}]  {ms * 1e3:8.1f} us/call")
            if "sweep" not in skip and not a.quick:
                wait_idle(a.wait_idle)
                nbytes, med, best = bench_sweep(model, rng, max(3, reps // 2))
                print(f"  {model:8s} decode sweep (all {layers} layers + lm_head, {nbytes / 1e6:.0f} MB): "
                      f"{med * 1e3:.2f} ms/token = {nbytes / med / 1e9:.1f} GB/s -> <= {1 / med:.0f} tokens/s "
                      f"from the q8 LINEARs [best {best * 1e3:.2f} ms]")
            if "matmul" not in skip:
                wait_idle(a.wait_idle)
                r = bench_matmul(allshapes if not a.quick else shapes, rng, 512, max(3, reps // 3))
                for label, row in r.items():
                    cols = "   ".join(f"{name} {g:6.1f} [best {gb:6.1f}]" for name, (g, gb) in row.items())
                    print(f"  {model:8s} matmul T=512 {label:8s} GOP/s: {cols}   "
                          f"panels / sgemm {row['panels'][0] / row['sgemm'][0]:.2f}")
        if "overhead" not in skip:
            wait_idle(a.wait_idle)
            for N in (32, 576):
                K = N
                wp, sp = q8_panels.pack_panels(*make_q8(N, K, rng))
                x = rng.standard_normal(K, dtype=np.float32)
                x_q = np.empty((1, K), np.int16)
                x_s = np.empty((1, K // 32), np.float32)
                out = np.empty((1, N), np.float32)
                n, nt = 4000, numba.get_num_threads()
                _wrapper_loop(wp, sp, N, x, x_q, x_s, out, nt, 1)
                med, best = timeit(lambda: _wrapper_loop(wp, sp, N, x, x_q, x_s, out, nt, n), reps)
                q8_panels.panels_matmul(wp, sp, N, x_q, x_s, out, nt)
                mp, bp = timeit(lambda: q8_panels.panels_matmul(wp, sp, N, x_q, x_s, out, nt), reps, n)
                w = rng.standard_normal((N, K), dtype=np.float32)
                _wrapper_loop_f32(w, x, out[0], 1)
                mf, bf = timeit(lambda: _wrapper_loop_f32(w, x, out[0], n), reps)
                print(f"  {N}x{N} (cache-resident) per call: quantize_act + panels_matmul from a serial @njit "
                      f"wrapper {med / n * 1e6:.2f} us [best {best / n * 1e6:.2f}]; panels_matmul from Python "
                      f"{mp * 1e6:.2f} us; matvec_f32 from @njit {mf / n * 1e6:.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
