"""``cpullm bench``'s text report and the profile plot."""
from __future__ import annotations

from pathlib import Path


from .harness import BenchError
from .profile import GROUP_LABELS


# ---- reporting ------------------------------------------------------------------------------------------
def _mb(n) -> str:
    return "?" if n is None else f"{n / 1e6:.1f} MB"


def _ratio(a, b) -> str:
    return "?" if not a or not b else f"{a / b:.2f}x"


def _s(x, unit="s", fmt="{:.2f}") -> str:
    return "n/a" if x is None else fmt.format(x) + " " + unit


def format_report(r: dict) -> str:
    params = f"{r['params'] / 1e6:.1f}M params, " if r.get("params") else ""
    lines = [
        f"cpullm bench: {r['model']}",
        f"  {r['family']} ({r.get('model_type')}), {params}{r['quant']}, {r['threads']} thread(s), "
        f"n_ctx {r['n_ctx']}, KV cache {r.get('kv_dtype', 'f32')}",
        f"  prompt {r['prompt_tokens']} tokens, {r['gen_tokens']} decode steps, "
        f"medians of {r['repeat']} run(s)",
        "",
        f"  prefill                {_s(r['prefill_tps'], 'tokens/s', '{:9.1f}')}",
        f"  decode (short context) {_s(r['decode_tps'], 'tokens/s', '{:9.1f}')}",
        f"  decode @{r['decode_context_tokens']:<4} context    {_s(r['decode_tps_at_512'], 'tokens/s', '{:9.1f}')}",
        f"  decode, full logits    {_s(r.get('decode_logits_tps'), 'tokens/s', '{:9.1f}')}  (short context; "
        "sampling's path" + ("; greedy may read the lm_head through its screen)" if r.get("head_screen") else ")"),
        f"  time to first token    {_s(r['ttft_s'], 's', '{:9.3f}')}",
        f"  load (this process)    {_s(r['load_s'], 's', '{:9.2f}')}  cache {r['cache']}",
        f"  load, cache MISS       {_s(r.get('load_s_miss'), 's', '{:9.2f}')}  process start to ready",
        f"  load, cache HIT        {_s(r.get('load_s_hit'), 's', '{:9.2f}')}  process start to ready",
        f"  build peak RSS         {_mb(r.get('build_peak_rss_bytes')):>12}  the cache MISS process "
        f"({_ratio(r.get('build_peak_rss_bytes'), r.get('weights_bytes'))} the weights); "
        f"cache HIT process {_mb(r.get('peak_rss_bytes_hit_process'))}",
        f"  cold start             {_s(r.get('cold_start_s'), 's', '{:9.2f}')}  process start to first token, "
        f"empty numba and execution caches"
        + (f" ({r['cold_start_compile_s']:.2f} s compiling kernels)" if r.get("cold_start_compile_s") else ""),
        f"  numba compile          {_s(r.get('warmup_compile_s'), 's', '{:9.2f}')}  cold minus warm numba cache "
        f"(both cache MISS)",
        *([f"  numba could not cache (recompiled at every start): {', '.join(r['numba_uncacheable'])}"]
          if r.get("numba_uncacheable") else []),
        "",
        f"  memory: weights {_mb(r['weights_bytes'])}, KV ({r.get('kv_dtype', 'f32')}) {_mb(r['kv_bytes'])} in use "
        f"({_mb(r['kv_bytes_max'])} allocated), arena {_mb(r['arena_bytes'])}, "
        f"peak RSS {_mb(r['peak_rss_bytes'])}",
        *([f"  context plan (n_ctx {r['n_ctx']}): KV {_mb(p['kv_bytes_max'])} (full attention "
           f"{_mb(p['kv_full_attention_bytes'])}, sliding window {_mb(p['kv_sliding_window_bytes'])}), "
           f"linear-attention state {_mb(p['linear_state_bytes'])}, arena {_mb(p['arena_bytes'])}"]
          if (p := r.get("context_plan")) else []),
    ]
    if r.get("decode_weight_bytes"):
        lines += ["", format_memory_bound(r)]
    if r.get("profile"):
        lines += ["", format_profile(r["profile"])]
    return "\n".join(lines)


def format_memory_bound(r: dict) -> str:
    per, read = r["decode_weight_bytes"], r["read_gbps"]
    return "\n".join([
        f"  decode reads {_mb(per)} of weights per token; a plain read of those bytes, alternating with "
        f"{r['memory_bound_steps']} decode steps,",
        f"  ran at {read:.1f} GB/s (best {r['read_gbps_best']:.1f}), a bound of {r['decode_tps_bound']:.1f} tokens/s; "
        f"decode read {r['decode_gbps']:.1f} GB/s, {100 * r['decode_bound_share']:.0f}% of that rate"
        + _head_note(r)])


def _head_note(r: dict) -> str:
    """Which lm_head the measured steps read, where a head screen gave a choice."""
    counts = r.get("memory_bound_head_steps") or {}
    if len(counts) < 2:
        return ""
    kind = r["memory_bound_head"]
    what = {"screen": "through the head screen", "plain": "the plain lm_head (the screen was slower)",
            "both": "the screen, then the plain lm_head"}[kind]
    return f"\n  (lm_head read {what} on {counts[kind]} of {sum(counts.values())} steps)"


def format_profile(p: dict) -> str:
    dec, pre = p["decode"], p["prefill"]
    names = list(dec["groups"]) + [g for g in pre["groups"] if g not in dec["groups"]]
    lines = [f"  per-op profile ({dec['tokens']} decode steps, prefill of {pre['tokens']} tokens)",
             f"  {'group':<24} {'decode ms/tok':>13} {'share':>7}   {'prefill ms':>10} {'share':>7}"]
    for g in names:
        d, q = dec["groups"].get(g), pre["groups"].get(g)
        label = (d or q)["label"]
        d_ms = f"{d['ms_per_token']:.3f}" if d else "-"
        d_sh = f"{d['share'] * 100:.1f}%" if d else "-"
        q_ms = f"{q['seconds'] * 1e3:.2f}" if q else "-"
        q_sh = f"{q['share'] * 100:.1f}%" if q else "-"
        lines.append(f"  {label:<24} {d_ms:>13} {d_sh:>7}   {q_ms:>10} {q_sh:>7}")
    lines.append(f"  {'total':<24} {dec['total_s'] * 1e3 / max(1, dec['tokens']):>13.3f} {'100%':>7}   "
                 f"{pre['total_s'] * 1e3:>10.2f} {'100%':>7}")
    lines.append(f"  (profile-mode dispatch cost of {p['call_overhead_s'] * 1e6:.2f} us per instruction "
                 f"subtracted from decode)")
    if p.get("decode_head") == "screen":
        lines.append("  (decode's lm_head: each greedy step through the head screen or the full lm_head, "
                     "whichever is faster, its argmax included)")
    return "\n".join(lines)


def plot_profile(result: dict, path) -> Path:
    """A PNG bar chart of the decode and prefill shares per op group (needs matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchError("--plot needs matplotlib: pip install 'cpullm[plot]'") from None
    prof = result.get("profile")
    if not prof:
        raise BenchError("--plot needs a profile: add --profile")
    dec, pre = prof["decode"]["groups"], prof["prefill"]["groups"]
    names = sorted(set(dec) | set(pre), key=lambda g: dec.get(g, {}).get("share", 0.0))
    labels = [GROUP_LABELS.get(g, g) for g in names]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.42 * len(names) + 1.8), sharey=True)
    for ax, groups, title in ((axes[0], dec, f"decode ({result['decode_tps_at_512']:.1f} tok/s)"
                               if result.get("decode_tps_at_512") else "decode"),
                              (axes[1], pre, f"prefill ({result['prefill_tps']:.1f} tok/s)"
                               if result.get("prefill_tps") else "prefill")):
        shares = [100 * groups.get(g, {}).get("share", 0.0) for g in names]
        bars = ax.barh(labels, shares, color="#3b75af" if ax is axes[0] else "#e1812c")
        for b, s in zip(bars, shares):
            if s > 0:
                ax.text(b.get_width() + 0.5, b.get_y() + b.get_height() / 2, f"{s:.1f}%", va="center",
                        fontsize=8)
        ax.set_xlabel("share of time (%)")
        ax.set_title(title)
        ax.set_xlim(0, max(shares + [1]) * 1.18)
    name = Path(str(result["model"])).name
    fig.suptitle(f"cpullm per-op profile: {name}, {result['quant']}, {result['threads']} thread(s), "
                 f"context {result['decode_context_tokens']}")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
