"""The per-op profile: one pass with the executor's profile mode, grouped by the IR nodes'
``group`` labels, the Python dispatch cost subtracted."""
from __future__ import annotations

import time

import numpy as np

from .harness import greedy


GROUP_LABELS = {
    "embedding": "embedding",
    "norm": "norms",
    "qkv": "QKV projection",
    "rope": "RoPE",
    "attention": "attention",
    "o_proj": "O projection",
    "mlp_up": "MLP up/gate",
    "mlp_act": "MLP activation",
    "mlp_down": "MLP down",
    "residual": "residual adds",
    "linear_attn": "linear-attention mixer",
    "linear_attn_proj": "linear-attention proj.",
    "lm_head": "lm_head",
    "sampling": "sampling",
}


# ---- per-op profile -------------------------------------------------------------------------------
def _dispatch_overhead(ex, state, n: int = 3000) -> float:
    """Median seconds the profile mode's per-instruction timing adds: perf_counter pair plus one
    interpreter call that runs no instruction."""
    ts = np.empty(n)
    for i in range(n):
        t1 = time.perf_counter()
        ex._interp(0, 0, state)
        ts[i] = time.perf_counter() - t1
    return float(np.median(ts))


def _interp_instruction_counts(segments, groups) -> dict:
    """Instructions per group that the profile mode times one by one in these segments."""
    counts: dict[str, int] = {}
    for seg in segments:
        if seg[0] == "interp":
            for r in range(seg[1], seg[2]):
                counts[groups[r]] = counts.get(groups[r], 0) + 1
    return counts


def _summarize(groups_s: dict, tokens: int, wall_s: float, per_token: bool) -> dict:
    total = sum(groups_s.values())
    out = {}
    for g, s in sorted(groups_s.items(), key=lambda kv: -kv[1]):
        d = {"label": GROUP_LABELS.get(g, g), "seconds": s, "share": s / total if total > 0 else 0.0}
        if per_token:
            d["ms_per_token"] = 1000.0 * s / max(1, tokens)
        out[g] = d
    return {"groups": out, "total_s": total, "wall_s": wall_s, "tokens": tokens}


def profile_pass(model, ids: list[int], gen_tokens: int) -> dict:
    """One profiled prefill of ``ids`` and ``gen_tokens`` profiled decode steps after it."""
    ex, fwd = model.executor, model.forward
    groups = model.program.meta["groups"]
    slot = fwd.new_slot()
    fwd.use_threads()
    overhead = _dispatch_overhead(ex, slot.state)

    ex.start_profile()
    t0 = time.perf_counter()
    logits = fwd.prefill(slot, ids)
    t1 = time.perf_counter()
    pre = ex.stop_profile()
    ts = time.perf_counter()
    tok = greedy(logits)
    pre["sampling"] = time.perf_counter() - ts
    prefill_wall = t1 - t0 + pre["sampling"]

    # Greedy steps through the executor's one-token decode (the profile mode splits it by
    # instruction): through the head screen where the model has one (Executor.decode_argmax
    # times its lm_head step, the argmax included), else the full logits.
    screened = ex.screen is not None
    sampling = 0.0
    ex.start_profile()
    t0 = time.perf_counter()
    for _ in range(gen_tokens):
        pos = slot.position
        slot.position += 1
        if screened:
            tok = ex.decode_argmax(slot.state, pos, tok)
            continue
        logits = ex.decode(slot.state, pos, tok)
        ts = time.perf_counter()
        tok = greedy(logits)
        sampling += time.perf_counter() - ts
    decode_wall = time.perf_counter() - t0
    dec = ex.stop_profile()
    # Decode normally runs the whole token in one compiled call; the profile mode calls the
    # interpreter once per instruction. Remove that added dispatch cost, group by group.
    counts = _interp_instruction_counts(ex.screen.segments if screened else ex._decode_segments, groups)
    for g, c in counts.items():
        if g in dec:
            dec[g] = max(0.0, dec[g] - overhead * c * gen_tokens)
    if not screened:
        dec["sampling"] = sampling
    return {
        "call_overhead_s": overhead,
        "decode_head": "screen" if screened else "logits",
        "decode": _summarize(dec, gen_tokens, decode_wall, per_token=True),
        "prefill": _summarize(pre, len(ids), prefill_wall, per_token=False),
    }
