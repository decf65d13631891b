"""The memory bound of decode: the weight bytes one token reads, and the rate a plain
parallel read of exactly those bytes reaches, alternating with decode steps."""
from __future__ import annotations

import time

import numpy as np

from .harness import CpullmRunner, greedy, next_token


# ---- the memory bound of decode ------------------------------------------------------------------
HEAD_READS = ("screen", "plain", "both")


def head_read(ex) -> str:
    """Which lm_head the executor's last decode step read (a :data:`HEAD_READS` value)."""
    screened, plain = ex.head_read
    return "both" if screened and plain else "screen" if screened else "plain"


def decode_weight_spans(program, head: str = "screen") -> list:
    """What one decode token reads from the weights, as views of the program's packed buffers:
    every LINEAR's matrix once (its format's spans, cpullm_kernels.program.formats: q8: int8
    values and binary16 block scales; raw ggml blocks: their bytes; f32: float32 values) and
    biases, adjacent ranges merged (so the read below streams as decode does, in long runs).
    The embedding row and the norm vectors are left out (a few KB). With a head screen, ``head``
    says which lm_head the step read: "screen" (its compact copy, what a greedy step the screen
    answers reads; the few exact rows left out too), "plain" (the lm_head itself: sampling, or
    the executor found the plain head faster) or "both" (a screened step that fell back). Routers and
    experts are not LINEARs: what a step read of them is :func:`moe_spans`."""
    from cpullm_kernels.program import program_table as P
    from cpullm_kernels.program.formats import weight_format
    if head not in HEAD_READS:
        raise ValueError(f"head must be one of {HEAD_READS}, got {head!r}")
    a = program.arrays
    I = a["I"]
    ranges: dict[str, list] = {"wq": [], "ws": [], "wf": []}
    screen = program.meta.get("head_screen")
    if screen and head != "plain":
        N = int(program.meta["vocab"])
        ranges["wq"].append((screen["q_off"], screen["q_off"] + N * screen["q_cols"]))
        ranges["ws"].append((screen["s_off"], screen["s_off"] + N * screen["s_cols"]))
        ranges["wf"].append((screen["b_off"], screen["b_off"] + 3 * N))
    for r in np.nonzero(I[:, P.COL_OP] == P.OP_LINEAR)[0]:
        if screen and head == "screen" and r == screen["row"]:
            continue
        lin = P.linear_operands(I[r])
        for name, lo, n in weight_format(lin.kind).spans(lin.n, lin.k, lin.kp, lin.w_off, lin.s_off):
            ranges[name].append((lo, lo + n))                   # q8 panels: padding rows too, all read
        if lin.bias_off >= 0:
            ranges["wf"].append((lin.bias_off, lin.bias_off + lin.n))
    views = []
    for name, rs in ranges.items():
        merged: list[list[int]] = []
        for lo, hi in sorted(rs):
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        views += [a[name][lo:hi] for lo, hi in merged]
    return views


def moe_spans(program, executor) -> list:
    """What the executor's MOE calls read in its last step, as views of the program's buffers:
    each call's router (float32) and the experts it chose (its ``counts``: gate, up and down),
    its shared expert included. Unlike :func:`decode_weight_spans` the experts change from token
    to token (8 of Qwen3-30B-A3B's 128 a layer: 40.1 MB of the 61.2 MB a token reads a layer at
    INT8)."""
    from cpullm_kernels.program import moe as M
    from cpullm_kernels.program.formats import weight_format
    a = program.arrays
    views = []
    for call in executor.moe.values():
        H, E, inter, shared = (int(call.prm[c]) for c in (M.PRM_H, M.PRM_E, M.PRM_I, M.PRM_SHARED_I))
        router = int(call.prm[M.PRM_ROUTER_OFF])
        views.append(a["wf"][router: router + E * H])
        for e in np.nonzero(call.counts > 0)[0]:
            width = inter if e < E else shared
            row = call.table[e]
            for col, N, K in ((M.TABLE_GATE, width, H), (M.TABLE_UP, width, H), (M.TABLE_DOWN, H, width)):
                kind, w_off, s_off, Kp = (int(v) for v in row[col: col + 4])
                views += [a[name][lo: lo + n] for name, lo, n in weight_format(kind).spans(N, K, Kp, w_off, s_off)]
    return views


def decode_weight_bytes(program) -> int:
    """Bytes of :func:`decode_weight_spans`: the weights one decode token reads."""
    return int(sum(v.nbytes for v in decode_weight_spans(program)))


def memory_bound(model, steps: int = 32, token: int = 0) -> dict:
    """Decode against this machine's streaming read rate, measured side by side: ``steps`` decode
    steps (after a one-token prompt), each followed by a plain parallel read of exactly the bytes
    that step read (:func:`decode_weight_spans`, :func:`cpullm_kernels.setup.bandwidth.read_sum_u32`;
    with a head screen, the head the executor read that step: random weights' flat logits leave
    the screen too many rows, and the executor then reads the plain lm_head, 1.8x the screen's
    bytes for Llama 3.2 3B). Alternating the two makes both see the same machine: on a shared
    host the read rate alone moves by 30 % within a minute. Medians over the steps that read the
    head most steps read (``memory_bound_head``; every head's count in
    ``memory_bound_head_steps``); the first two steps are dropped. With routed experts each
    step's read adds its routers and the experts it chose (:func:`moe_spans`), so the bytes per
    token are a median too."""
    from cpullm_kernels.setup.bandwidth import as_words, read_sum_u32
    kinds = HEAD_READS if model.program.meta.get("head_screen") else ("plain",)
    spans = {k: decode_weight_spans(model.program, k) for k in kinds}
    nbytes = {k: int(sum(v.nbytes for v in spans[k])) for k in kinds}
    words = {k: [as_words(v) for v in spans[k]] for k in kinds}
    nth = model.forward.threads          # the plain read uses the threads decode uses
    steps = max(3, int(steps))
    runner = CpullmRunner(model)
    runner.reset()
    tok = greedy(runner.prefill([int(token)]))
    ex = model.executor
    dec, rd, read, nb = [], [], [], []
    for _ in range(steps + 2):
        t0 = time.perf_counter()
        tok = next_token(runner, tok)
        t1 = time.perf_counter()
        kind = head_read(ex) if len(kinds) > 1 else "plain"
        routed = [as_words(v) for v in moe_spans(model.program, ex)] if ex.moe else []
        t2 = time.perf_counter()
        for w in words[kind] + routed:
            read_sum_u32(w, nth)
        t3 = time.perf_counter()
        dec.append(t1 - t0)
        rd.append(t3 - t2)
        read.append(kind)
        nb.append(nbytes[kind] + sum(int(w.nbytes) for w in routed))
    runner.reset()
    counts = {k: read[2:].count(k) for k in kinds}
    kind = max(kinds, key=lambda k: counts[k])                # the head most steps read
    steps_of = [i for i in range(2, len(read)) if read[i] == kind]
    dec_s = float(np.median([dec[i] for i in steps_of]))
    rd_s = float(np.median([rd[i] for i in steps_of]))
    per_token = int(np.median([nb[i] for i in steps_of]))
    return {
        "decode_weight_bytes": per_token,
        "read_gbps": per_token / rd_s / 1e9,
        "read_gbps_best": max(nb[i] / rd[i] for i in steps_of) / 1e9,
        "decode_gbps": per_token / dec_s / 1e9,
        "decode_tps_bound": 1.0 / rd_s,
        "decode_bound_share": rd_s / dec_s,
        "memory_bound_steps": steps,
        "memory_bound_head": kind,
        "memory_bound_head_steps": counts,
    }
