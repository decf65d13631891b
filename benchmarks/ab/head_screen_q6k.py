"""The raw-block head screen on a real lm_head and real activations, the head stored as Q6_K.

    python benchmarks/ab/head_screen_q6k.py MODEL_DIR [--threads 2] [--steps 48] [--reps 3]

For a model whose hidden size is not a multiple of 256 (the small ones in the store: 576, 640,
896), ``--quant q4`` keeps the head at Q8_0 (held as q8: the q8 screen), so the Q6_K screen of
the larger models (Qwen2.5-1.5B, Llama-3.2-1B) cannot be met on them directly. This takes the
model's real lm_head weights (the tied embedding, or lm_head.weight), quantizes them to Q6_K
as --quant q4 does for a whole-super-block head (rows zero-padded to a multiple of 256, as q4
pads), and the lm_head inputs of its own greedy decode (q4 program, the bench prompt); then, per
step, times ``kquant.matvec`` + argmax (the full head) against
``head_screen_blocks.screen_argmax_blocks`` on the same activations, fastest of ``--reps``
each, alternating which goes first, and checks the tokens are equal. Columns kept at 8 bits: from
the first 16 steps' activations (as the compiler's calibration text does).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=128)
    a = p.parse_args(argv)

    import numba

    import cpullm
    from cpullm.bench.harness import prompt_ids
    from cpullm_kernels.panels import head_screen as H
    from cpullm_kernels.panels import head_screen_blocks as HB
    from cpullm_kernels.rows import kquant, q4
    from cpullm.loading.tensors import TensorStore

    m = cpullm.load(a.model, quant="q4", threads=a.threads)
    ex = m.executor
    nth = numba.get_num_threads()
    ids = prompt_ids(m.tokenizer, a.prompt_tokens, ex.vocab)
    slot = m.forward.new_slot()
    tok = int(np.argmax(m.forward.prefill(slot, ids)))
    r = ex.n_instr - 1
    from cpullm_kernels.program import program_table as P
    lin = P.linear_operands(ex.I[r])
    xs = []
    for _ in range(a.steps):
        logits = ex.decode(slot.state, slot.position, tok)
        slot.position += 1
        xs.append(ex.arena[lin.x_off: lin.x_off + lin.k].copy())
        tok = int(np.argmax(logits))
    store = TensorStore(m.model_dir)
    name = "lm_head.weight" if "lm_head.weight" in store.names() else "model.embed_tokens.weight"
    t0 = time.perf_counter()
    w = q4.quantize_q6_k(store.get(name))                      # (N, Kp / 256 * 210)
    t_quant = time.perf_counter() - t0
    N, K = store.shape(name)
    Kp = q4.padded_k(K)
    calib = np.stack(xs[:16]).astype(np.float64)
    importance = np.zeros(Kp)
    importance[:K] = np.sqrt((calib ** 2).mean(0))
    k_sel = H.sel_columns(Kp)
    perm = H.screen_columns(importance, Kp, k_sel)
    t0 = time.perf_counter()
    hq, hs, hb = HB.build_screen_blocks(w, "Q6_K", Kp, perm, k_sel)
    t_build = time.perf_counter() - t0
    nb = Kp // 32
    scratch = (np.zeros(Kp, np.int8), np.zeros(nb, np.float32), np.zeros(Kp // 16, np.float32),
               np.zeros(Kp, np.int16), np.zeros(H.padded_blocks(Kp), np.float32), np.zeros(Kp, np.float32),
               np.zeros(N, np.float32), np.zeros(N, np.int64), np.zeros(N, np.float32),
               np.zeros(nth, np.float32), np.zeros(nth, np.int64))
    x_q, x_s, x_m = np.zeros(Kp, np.int8), np.zeros(nb, np.float32), np.zeros(Kp // 16, np.float32)
    out = np.zeros(N, np.float32)
    fmt = 14

    def full(x):
        kquant.quantize_act_q8(x, x_q[:K], x_s[:K // 32], x_m[:K // 16])
        kquant.matvec(fmt, w, x_q, x_s, x_m, out)
        return int(np.argmax(out))

    def screen(x):
        return HB.screen_argmax_blocks(x, perm, k_sel // 32, hq, hs, hb, w, fmt, *scratch, nth, N // 16)

    full(xs[0])
    screen(xs[0])                                             # compile
    t_full, t_screen, ratios, surv, fallbacks = [], [], [], [], 0
    for i, x in enumerate(xs):
        bf = bs = float("inf")
        for rep in range(a.reps):
            for which in ((0, 1) if (i + rep) % 2 == 0 else (1, 0)):
                t0 = time.perf_counter()
                if which == 0:
                    want = full(x)
                    bf = min(bf, time.perf_counter() - t0)
                else:
                    got, s = screen(x)
                    bs = min(bs, time.perf_counter() - t0)
        if got < 0:
            fallbacks += 1
        elif got != want:
            raise SystemExit(f"step {i}: screen token {got} != full head's {want}")
        surv.append(s)
        t_full.append(bf)
        t_screen.append(bs)
        ratios.append(bs / bf)
    med = statistics.median
    rb = w.shape[1]
    screen_b = hq.nbytes + hs.nbytes + hb.nbytes
    print(f"{m.model_dir}: real lm_head ({N} x {K}, padded to {Kp}) as Q6_K, {w.nbytes / 1e6:.1f} MB "
          f"(quantized in {t_quant:.0f} s); screen {screen_b / 1e6:.1f} MB (built in {t_build:.1f} s), "
          f"k_sel {k_sel}, {nth} threads")
    print(f"  survivors: median {med(surv):.0f}, p90 {np.percentile(surv, 90):.0f}, max {max(surv)} of {N}; "
          f"{fallbacks} step(s) fell back; read a step: {(screen_b + med(surv) * rb) / 1e6:.1f} MB (median)")
    print(f"  full Q6_K head {1e3 * med(t_full):.2f} ms, screen {1e3 * med(t_screen):.2f} ms (medians over "
          f"{len(xs)} steps, fastest of {a.reps} reps); per-step ratio screen / full: median {med(ratios):.3f}; "
          f"every token equal")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
