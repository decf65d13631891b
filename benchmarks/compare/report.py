"""The report: rows merged over rounds, ratios, the machine, compare.md and compare.png."""
from __future__ import annotations

import os
import platform
from pathlib import Path

import numpy as np

from .paired import PAIR_KINDS, ratio_pairs
from .workers import RATIO_PAIRS, is_cpullm, is_llama_cpp

ROUND_KEYS = ("prefill_tps", "decode_tps", "decode_tps_at_512", "decode_logits_tps", "ttft_s", "load_s",
              "read_gbps", "decode_bound_share")
"""Numbers a runtime's row takes as the median over rounds (the rest come from its first good round)."""


def merge_rounds(runs: list) -> dict:
    """One runtime's row from its rounds: the first successful round, with each of ROUND_KEYS
    replaced by its median over the successful rounds and the per-round values under "rounds";
    the first error when no round succeeded."""
    good = [r for r in runs if "error" not in r]
    if not good:
        return runs[0]
    row = dict(good[0])
    if len(runs) > 1:
        row["rounds"] = {k: [r.get(k) for r in good] for k in ROUND_KEYS if good[0].get(k) is not None}
        for k, vals in row["rounds"].items():
            vals = [v for v in vals if v is not None]
            row[k] = float(np.median(vals)) if vals else None
        row["rounds_ok"] = len(good)
        row["rounds_failed"] = len(runs) - len(good)
    return row


def _ratios(by: dict) -> dict:
    """{"A / B": prefill / decode / decode-at-context tokens/s of A over B's} for each of
    RATIO_PAIRS where both ran."""
    out = {}
    for a, b in RATIO_PAIRS:
        x, y = by.get(a), by.get(b)
        if x and y and "error" not in x and "error" not in y:
            out[f"{a} / {b}"] = {"prefill": _ratio(x["prefill_tps"], y["prefill_tps"]),
                                 "decode": _ratio(x["decode_tps"], y["decode_tps"]),
                                 "decode_at_512": _ratio(x["decode_tps_at_512"], y["decode_tps_at_512"])}
    return out


def _fidelity(a: np.ndarray, ref: np.ndarray) -> dict:
    n = min(a.size, ref.size)
    a, ref = a[:n].astype(np.float64), ref[:n].astype(np.float64)
    x, y = a - a.mean(), ref - ref.mean()
    cos = float((x * y).sum() / (np.linalg.norm(x) * np.linalg.norm(y) + 1e-30))
    return {"cosine": cos, "same_top1": bool(int(a.argmax()) == int(ref.argmax()))}


def _ratio(a, b):
    return (a / b) if (a and b) else None


def machine_info() -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        from cpullm_kernels.panels import q8_panels
        prefill = {"vnni": "W8A16 q8 panels (AVX-512 VNNI)", "avx2": "W8A16 q8 panels (AVX2)"}.get(
            q8_panels.ISA, "W8A16 q8 panels (portable IR)")
    except Exception:  # noqa: BLE001 - the report still says what it can
        prefill = "unknown"
    return {"cpu": cpu, "logical_cpus": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "cpullm_prefill": prefill}


def _busy(report: dict) -> bool:
    """Other work was running when the benchmark started (> a quarter of the CPU time used in
    the seconds before it; the load average where that could not be measured)."""
    busy = report.get("cpu_busy_before")
    if busy is not None:
        return busy > 0.25
    return report["loadavg_before"] > 0.25 * (report["machine"]["logical_cpus"] or 1)


def _pct(x):
    return None if x is None else 100.0 * x


def _fmt(x, f="{:.1f}"):
    return "n/a" if x is None else f.format(x)


def markdown(report: dict) -> str:
    s = report["settings"]
    rows = report["results"]
    m = report["machine"]
    lines = [
        f"# cpullm vs llama.cpp vs transformers: {report['model_name']}",
        "",
        f"- command: `{report['command']}`",
        f"- machine: {m['cpu']}, {m['logical_cpus']} logical CPUs; {s['threads']} thread(s) for every runtime; "
        f"cpullm prefill path: {m.get('cpullm_prefill', 'unknown')}",
        f"- CPU used by other work in the 2 s before the run: {_fmt(_pct(report.get('cpu_busy_before')), '{:.0f} %')}; "
        f"load average (1 min) before / after (after includes this run): {report['loadavg_before']:.2f} / "
        f"{report['loadavg_after']:.2f}" + ("  **(machine busy before the run: numbers are noisy)**"
                                             if _busy(report) else ""),
        f"- prompt {s['prompt_tokens']} tokens, {s['gen_tokens']} decode steps, decode-at-context after "
        f"{s['context_tokens']} tokens, medians of {s['repeat']} run(s)"
        + (f", then the median over {s['rounds']} rounds (every runtime once per round, in turn)"
           if s.get("rounds", 1) > 1 else "") + f"; {report['date']}",
    ]
    if report.get("gguf_source"):
        lines.append(f"- llama.cpp's GGUFs made from the checkpoint by {report['gguf_source']}")
    lines += [
        "",
        "| runtime | weights | prefill tok/s | decode tok/s | decode @%d tok/s | TTFT s | load s "
        "| weight MB / decode token | KL vs f32 (nats) | fidelity vs transformers f32 |" % s["context_tokens"],
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if "error" in r or "skipped" in r:
            lines.append(f"| {r['runtime']} | {r.get('skipped') or 'failed: ' + r['error'].splitlines()[-1][:80]} "
                         "| | | | | | | | |")
            continue
        fid, agree = r.get("fidelity"), r.get("agreement_with_cpullm")
        if fid:
            fid_s = f"cosine {fid['cosine']:.4f}, top-1 {'same' if fid['same_top1'] else 'differs'}"
        elif r["runtime"] == "transformers":
            fid_s = "reference"
        elif agree:
            fid_s = (f"(vs cpullm) cosine {agree['cosine']:.4f}, top-1 "
                     f"{'same' if agree['same_top1'] else 'differs'}")
        else:
            fid_s = "n/a"
        lines.append(f"| {r['runtime']} | {r.get('weights', '')} | {_fmt(r.get('prefill_tps'))} | "
                     f"{_fmt(r.get('decode_tps'))} | {_fmt(r.get('decode_tps_at_512'))} | "
                     f"{_fmt(r.get('ttft_s'), '{:.3f}')} | {_fmt(r.get('load_s'), '{:.2f}')} | "
                     f"{_fmt(_mb(r.get('decode_weight_bytes')), '{:.2f}')} | {_kl(r.get('kl'))} | {fid_s} |")
    ours = next((r for r in rows if r["runtime"] == "cpullm" and r.get("decode_logits_tps")), None)
    if ours:
        how = ("cpullm's may read the lm_head through its screen (the same tokens; the faster of the two "
               "heads, timed as it goes)" if ours.get("head_screen") else "cpullm's model has no lm_head screen "
               "(its lm_head is below the size for one, or an op follows it, as Gemma 2's logit soft-capping)")
        lines += ["", f"Decode steps pick the argmax (greedy) in every runtime; {how}. Through the full logits, "
                      f"as sampling decodes, cpullm ran {_fmt(ours['decode_logits_tps'])} tok/s."]
    lines += _kl_lines(report)
    lines += ["", "| ratio | prefill | decode | decode @%d |" % s["context_tokens"], "|---|---:|---:|---:|"]
    for label, rat in report["ratios"].items():
        lines.append(f"| {label} | {_fmt(rat['prefill'], '{:.2f}x')} | {_fmt(rat['decode'], '{:.2f}x')} "
                     f"| {_fmt(rat['decode_at_512'], '{:.2f}x')} |")
    lines += _round_lines(report)
    lines += _paired_lines(report)
    lines += _bandwidth_lines(rows)
    lines += ["", "Versions: " + "; ".join(f"{r['runtime']} {r.get('version', '?')}" for r in rows
                                             if "version" in r)]
    return "\n".join(lines) + "\n"


def _mb(n):
    return None if not n else n / 1e6


def _kl(x) -> str:
    if x is None:
        return "n/a"
    return f"{x:.5f}" if x >= 1e-3 else f"{x:.2e}"


def _kl_lines(report: dict) -> list:
    """What the KL column measured (or why it is empty)."""
    kl = report.get("kl")
    if not kl:
        return []
    if "error" in kl:
        return ["", f"KL pass: not run ({kl['error'].splitlines()[-1][:160]})."]
    return ["", f"KL: mean KL(reference || runtime) in nats over all {kl['positions']} positions of "
                f"{len(kl['sequence_lengths'])} teacher-forced sequence(s) (a fixed prompt followed by the "
                f"reference's {kl['gen_tokens']} greedy tokens; lengths {kl['sequence_lengths']}); reference: "
                f"{kl['reference']}. Weight MB / decode token: what one decode step reads (cpullm: its program's "
                "decode spans; llama.cpp: the GGUF's tensors but a separate token embedding; transformers: "
                "its parameters but a separate input embedding)."]


def _round_lines(report: dict) -> list:
    """Each round's ratios (measured minutes apart on a possibly shared machine), and their range."""
    per = report.get("round_ratios") or []
    others = [f"{a} / {b}" for a, b in RATIO_PAIRS if any(f"{a} / {b}" in r for r in per)]
    if not per or not others:
        return []
    head = " | ".join(f"{key} {o}" for o in others for key in ("prefill", "decode", "decode @ctx"))
    lines = ["", "The ratios in every round (the runtimes one after another within a round):",
             "", f"| round | {head} |", "|---|" + "---:|" * (3 * len(others))]
    for i, r in enumerate(per, 1):
        cells = [_fmt((r.get(o) or {}).get(k), "{:.2f}x") for o in others for k in ("prefill", "decode", "decode_at_512")]
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    for label, pick in (("min", min), ("max", max)):
        cells = []
        for o in others:
            for k in ("prefill", "decode", "decode_at_512"):
                vals = [r[o][k] for r in per if r.get(o) and r[o].get(k) is not None]
                cells.append(_fmt(pick(vals) if vals else None, "{:.2f}x"))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def _paired_lines(report: dict) -> list:
    """The paired phase (``--paired N``): each runtime's median tokens/s and the per-turn ratios."""
    pd = report.get("paired")
    if not pd:
        return []
    if "error" in pd:
        return ["", f"Paired decode: not run ({pd['error'].splitlines()[-1][:160]})."]
    s = report["settings"]
    lines = ["", f"Paired decode ({pd['pairs']} turns): every runtime loaded at once, each in its own process, "
                 "taking turns (A B, then B A, ...) with nothing else running; a turn times one run of "
             f"{s['gen_tokens']} greedy steps per runtime after a one-token prompt, then one after the "
             f"{s['context_tokens']}-token prefill. Ratios are taken within a turn, runs seconds apart, so a "
             "drift of the machine's memory bandwidth moves both sides of each ratio.", "",
             f"| runtime | decode tok/s | decode @{s['context_tokens']} tok/s |", "|---|---:|---:|"]
    for name, v in pd["tps"].items():
        lines.append(f"| {name} | {_fmt(float(np.median(v['decode'])))} | {_fmt(float(np.median(v['decode_at_512'])))} |")
    lines += ["", "| ratio per turn | decode: median | min | max | decode @ctx: median | min | max |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for label, rat in pd["ratios"].items():
        cells = []
        for k in PAIR_KINDS:
            v = rat[k]
            cells += [_fmt(float(np.median(v)) if v else None, "{:.2f}x"), _fmt(min(v) if v else None, "{:.2f}x"),
                      _fmt(max(v) if v else None, "{:.2f}x")]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    names, others = list(pd["tps"]), list(pd["ratios"])
    read = pd.get("read_gbps") or {}
    probe = next((n for n in names if is_cpullm(n)), "cpullm")
    lines += ["", f"Each turn (tokens/s and ratios as decode / decode @ctx; read: the plain read rate of {probe}'s "
                  "decode bytes measured right after its runs, GB/s):", "",
              "| turn | read GB/s | " + " | ".join(names) + " | " + " | ".join(others) + " |",
              "|---|---:|" + "---:|" * (len(names) + len(others))]
    for i in range(pd["pairs"]):
        def pair(vals, f):
            return " / ".join(_fmt(v[i] if i < len(v) else None, f) for v in vals)
        cells = [pair([read.get(k, []) for k in PAIR_KINDS], "{:.1f}")]
        cells += [pair([pd["tps"][n][k] for k in PAIR_KINDS], "{:.1f}") for n in names]
        cells += [pair([pd["ratios"][o][k] for k in PAIR_KINDS], "{:.2f}x") for o in others]
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    return lines


def _bandwidth_lines(rows: list) -> list:
    """The memory-bound view of decode: each runtime's weight bytes per token times its decode
    tokens/s, against the read rate measured in the cpullm process (a plain parallel read of
    cpullm's decode bytes after its timed runs, alternating with decode steps)."""
    probe = next((r for r in rows if is_cpullm(r["runtime"]) and r.get("read_gbps")), None)
    read = probe["read_gbps"] if probe else None
    done = [r for r in rows if r.get("decode_weight_bytes") and r.get("decode_tps")]
    if not done:
        return []
    lines = ["", "| runtime | weight bytes read per decode token | decode GB/s | share of the read rate |",
             "|---|---:|---:|---:|"]
    for r in done:
        gbps = r["decode_weight_bytes"] * r["decode_tps"] / 1e9
        share = f"{100 * gbps / read:.0f} %" if read else "n/a"
        lines.append(f"| {r['runtime']} | {r['decode_weight_bytes'] / 1e6:.1f} MB | {gbps:.1f} | {share} |")
    if read:
        who, ours = probe["runtime"], probe.get("decode_bound_share")
        lines += ["", f"Read rate: {read:.1f} GB/s, a plain parallel read of the bytes {who}'s decode reads, "
                      f"in the {who} process after its timed runs, alternating with decode steps (median); "
                      "decode is bound by memory bandwidth as its share nears 100 %."
                      + (f" In those alternating steps {who}'s decode read at {100 * ours:.0f} % of it."
                         if ours else "")]
    return lines


def chart(report: dict, path: Path) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in report["results"] if "prefill_tps" in r]
    if not rows:
        return None
    s = report["settings"]
    metrics = (("prefill_tps", f"prefill ({s['prompt_tokens']} tokens)"),
               ("decode_tps", "decode (short context)"),
               ("decode_tps_at_512", f"decode @{s['context_tokens']} context"))
    def color(name):
        return "#3b75af" if is_cpullm(name) else "#e1812c" if is_llama_cpp(name) else "#6aa84f"
    by = {r["runtime"]: r for r in rows}
    pairs = ratio_pairs(by)
    if len(rows) > 3:           # --four-bit: one panel per row, or the 7 bars' labels collide
        fig, axes = plt.subplots(3, 1, figsize=(max(10.0, 1.6 * len(rows)), 13))
    else:
        fig, axes = plt.subplots(1, 3, figsize=(13, 4.6))
    for ax, (key, title) in zip(axes, metrics):
        names = [r["runtime"] for r in rows]
        vals = [r.get(key) or 0.0 for r in rows]
        bars = ax.bar(names, vals, color=[color(n) for n in names])
        for b, r, v in zip(bars, rows, vals):
            txt = f"{v:.1f}"
            for num, den in pairs:              # the ratios this bar is the denominator of
                if den == r["runtime"] and v:
                    txt += f"\n{num} = {(by[num].get(key) or 0) / v:.2f}x"
            ax.text(b.get_x() + b.get_width() / 2, b.get_height(), txt, ha="center", va="bottom", fontsize=8)
        ax.set_title(title)
        ax.set_ylabel("tokens/s")
        ax.set_ylim(0, max(vals + [1]) * (1.3 + 0.1 * max(1, len(pairs))))
    busy = " (machine busy: noisy)" if _busy(report) else ""
    fig.suptitle(f"{report['model_name']}: {s['threads']} thread(s), medians of {s['repeat']}{busy}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


