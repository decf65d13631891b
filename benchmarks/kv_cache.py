"""KV cache formats at long context: quality (KL divergence of the next-token distribution against
a reference cache, float32 or float16) and decode speed, on real text.

    python benchmarks/kv_cache.py MODEL --ctx 4096 16384 --eval 32 [--cache-type f32 f16 q8_0]
        [--emulate-blocks 32 64] [--threads N] [--logits-dir DIR] [--json]
    python benchmarks/kv_cache.py MODEL --speed --ctx 4096 16384 [--cache-type f16 q8_0]

For each context N of ``--ctx`` and each format of ``--cache-type`` (the first one listed is the
reference; f32 by default): a fresh sequence prefills N tokens of real text (this repository's
documentation and sources, tokenized by the model's tokenizer; no repeats while they last), then
``--eval`` one-token decode steps feed the text's next tokens (teacher forcing) and keep each
step's logits (the full lm_head) and wall time. Reported per format: mean and max KL(reference ||
format) over the steps' next-token distributions, top-1 agreement with the reference, the median
decode step (tokens/s at context N) and the KV bytes held at N.

``--logits-dir DIR``: keep each run's logits there and reuse them, so that the formats of one
comparison can run in separate processes (a 16k-token prefill of a 0.5B model takes many minutes
on a loaded host). The text's token ids are saved with the first run and reused by the later ones
(the repository's files change as it is edited). A float format's run is reused as saved; a q8_0
run only if it was made by the same attention kernel source (its sha is saved with it).

``--speed``: decode speed alone, no prefill and no KL: each format's cache is filled with random
keys and values up to position N (:func:`cpullm.compile.kvformat.write_positions`), then
``--eval`` decode steps run with the formats alternating step by step (the first step of each
untimed), so that the host's load falls on all alike; tokens/s from the median step, and its
ratio to the first format's. Attention's work does not depend on the values held, so this is the
decode rate at context N without the minutes a real prefill takes.

``--emulate-blocks B``: what a finer scale would give. After the float32 run's prefill, every
cached key and value is rounded as an int8 cache with one scale per B values of a head row would
hold it (B = head_dim is the q8_0 cache's per-row scale), written back as float32, and the same
decode steps run; its KL against float32 is reported as ``emu-q8/B``. The prefill itself ran on
exact keys there (the real q8_0 run's prefill reads rounded ones), so compare emulations with each
other, and the per-row emulation with the real q8_0 row. ``--emulate-chunked``: the same
rounding after every prefill chunk as well (later chunks then attend over rounded earlier keys
and values, as the real cache's prefill does, except within a chunk), reported as ``emu-q8/B/chunked``.

The formats of one context run back to back in one process; the host's load is printed with the
results (a shared host moves absolute rates; the KL numbers do not depend on it).

``--stepwise N``: the faithful emulation, at short context: N tokens of the text decoded one at a
time (no prefill) in a float32-cache model, the whole cache rounded as ``--emulate-blocks``
says after every step (so every position attends over rounded keys and values, as in the real
cache, except its own), against the same steps in float32 and in each ``--cache-type``.

``--kernel HEADS KV_HEADS HEAD_DIM`` (no MODEL needed): the decode attention kernel alone, no
model: 8 layers' caches of each format filled with random keys and values up to each context of
``--ctx``, then one-token attention over all 8 layers, the formats alternating step by step (31
steps, the first untimed), so that the host's load falls on all alike; ms per layer, min and median.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent


def text_ids(tokenizer, n: int) -> list[int]:
    """``n`` token ids of real text: the repository's Markdown and Python files in sorted order
    (repeated only if they run out)."""
    files = sorted(REPO.glob("*.md")) + sorted((REPO / "docs").glob("*.md")) + sorted((REPO / "core").rglob("*.py")) \
        + sorted((REPO / "kernels").glob("*.py"))
    ids: list[int] = []
    for f in files:
        ids += tokenizer.encode(f.read_text(errors="replace"))
        if len(ids) >= n:
            return ids[:n]
    if not ids:
        raise SystemExit("no text found to tokenize")
    return (ids * (n // len(ids) + 1))[:n]


def q8_blocks_roundtrip(x: np.ndarray, block: int) -> np.ndarray:
    """float32 rows (..., head_dim) as int8 with one max/127 scale per ``block`` values, scaled back."""
    from cpullm_kernels.attention.attention import q8_quantize_ref
    q, sc = q8_quantize_ref(x, block)
    return (q.astype(np.float32).reshape(*x.shape[:-1], -1, block) * sc[..., None]).reshape(x.shape)


def emulate(model, slot, block: int) -> None:
    """Round every cached key and value of ``slot`` (a float32 cache) as int8 blocks of ``block``."""
    for reg in model.program.meta["state_regions"]:
        if reg["kind"] != "kv":
            continue
        n = min(slot.position, reg["cap"])
        lo = slot.position - n
        kv = slot.read_kv(reg, lo, slot.position)
        slot.write_kv(reg, lo, q8_blocks_roundtrip(kv, min(block, reg["head_dim"])))


def run(model, ids: list[int], n_ctx: int, n_eval: int, block: int | None = None, chunked: bool = False) -> dict:
    """Prefill ids[:n_ctx], then ``n_eval`` teacher-forced decode steps: (logits (n_eval + 1,
    vocab) float32, step seconds, prefill seconds, KV bytes held)."""
    from cpullm.run.memory import memory_report
    fwd = model.forward
    slot = model.slot
    fwd.reset(slot)
    t0 = time.perf_counter()
    if chunked:
        for c0 in range(0, n_ctx, fwd.max_chunk):
            first = fwd.prefill(slot, ids[c0: min(n_ctx, c0 + fwd.max_chunk)])
            if c0 + fwd.max_chunk < n_ctx:
                emulate(model, slot, block)
    else:
        first = fwd.prefill(slot, ids[:n_ctx])
    prefill_s = time.perf_counter() - t0
    if block is not None:
        emulate(model, slot, block)
        fwd.set_position(slot, n_ctx - 1)          # the last prompt token again, on the rounded cache
        (first,), _ = fwd.step([slot], [ids[n_ctx - 1]])
    logits, steps = [np.array(first, np.float32)], []
    kv_bytes = memory_report(model)["kv_bytes"]
    for t in range(n_eval):
        t1 = time.perf_counter()
        (row,), _ = fwd.step([slot], [ids[n_ctx + t]])
        steps.append(time.perf_counter() - t1)
        logits.append(np.array(row, np.float32))
    return {"logits": np.stack(logits), "steps": steps, "prefill_s": prefill_s, "kv_bytes": kv_bytes}


def kernel_sha() -> str:
    """sha256 (first 16 hex digits) of the attention kernel's and the KV format's sources: what a
    q8_0 run's numbers depend on beyond the model."""
    import hashlib

    import cpullm.compile.kvformat as kvformat
    import cpullm_kernels.attention.attention as att
    h = hashlib.sha256()
    for mod in (att, kvformat):
        h.update(Path(mod.__file__).read_bytes())
    return h.hexdigest()[:16]


def _stem(model: str, n: int, n_eval: int) -> str:
    return f"{Path(str(model)).name}-{n}-{n_eval}"


def saved_ids(logits_dir, model: str, n: int, n_eval: int, tokenizer) -> list[int]:
    """The text's n + n_eval token ids: saved in ``logits_dir`` by the first run, reused after."""
    if logits_dir is None:
        return text_ids(tokenizer, n + n_eval)
    f = Path(logits_dir) / f"{_stem(model, n, n_eval)}-ids.npy"
    if f.exists():
        return [int(t) for t in np.load(f)]
    ids = text_ids(tokenizer, n + n_eval)
    Path(logits_dir).mkdir(parents=True, exist_ok=True)
    np.save(f, np.asarray(ids, np.int64))
    return ids


def saved_run(logits_dir, model: str, n: int, n_eval: int, kv: str, make) -> dict:
    """``make()``'s result (:func:`run`), or the one saved in ``logits_dir`` (see --logits-dir)."""
    if logits_dir is None:
        return make()
    f = Path(logits_dir) / f"{_stem(model, n, n_eval)}-{kv}.npz"
    sha = kernel_sha() if kv.startswith("q8") else ""
    if f.exists():
        z = np.load(f)
        if str(z["sha"]) == sha:
            print(f"  {kv}: reusing {f}", flush=True)
            return {"logits": z["logits"], "steps": list(z["steps"]), "prefill_s": float(z["prefill_s"]),
                    "kv_bytes": int(z["kv_bytes"])}
    r = make()
    tmp = f.with_suffix(".tmp.npz")
    np.savez(tmp, logits=r["logits"], steps=np.asarray(r["steps"]), prefill_s=r["prefill_s"],
             kv_bytes=r["kv_bytes"], sha=sha)
    os.replace(tmp, f)
    return r


def fill_random(model, slot, n: int, seed: int = 0) -> None:
    """Keys and values of positions [0, n) of every KV region of ``slot``: random normal rows in the
    region's format (what a decode step reads, without a prefill); the slot is then at position n."""
    rng = np.random.default_rng(seed)
    for reg in model.program.meta["state_regions"]:
        if reg["kind"] != "kv":
            continue
        lo = max(0, n - reg["cap"])
        for p0 in range(lo, n, 1024):
            p1 = min(n, p0 + 1024)
            kv = rng.standard_normal((2, reg["n_kv_heads"], p1 - p0, reg["head_dim"]), np.float32)
            slot.write_kv(reg, p0, kv)
    model.forward.set_position(slot, n)


def speed(name: str, kinds: list, n_ctx: int, steps: int, threads, quant) -> dict:
    """{format: tokens/s} of decode at context n_ctx, the formats alternating step by step."""
    import cpullm
    models = []
    for kv in kinds:
        m = cpullm.load(name, n_ctx=n_ctx + steps + 2, threads=threads, kv_dtype=kv, quant=quant)
        m.forward.reset(m.slot)
        fill_random(m, m.slot, n_ctx)
        models.append(m)
    times = {kv: [] for kv in kinds}
    for i in range(steps + 1):
        for kv, m in zip(kinds, models):
            t0 = time.perf_counter()
            m.forward.step([m.slot], [100 + i])
            if i:
                times[kv].append(time.perf_counter() - t0)
    return {kv: 1.0 / float(np.median(t)) for kv, t in times.items()}


def kernel_times(nh: int, nkv: int, hd: int, n_ctx: int, threads: int | None, layers: int = 8,
                 steps: int = 30) -> dict:
    """{format: (min, median) ms per layer} of one decode step's attention at context n_ctx."""
    import numba

    from cpullm_kernels.attention import attention as A
    from cpullm.compile.kvformat import format_code, region_floats
    if threads:
        numba.set_num_threads(threads)
    nthreads = numba.get_num_threads()
    rng = np.random.default_rng(0)
    W = nh * hd + 2 * nkv * hd                         # one arena row: q, k, v
    cap = A.padded_cap(n_ctx + 16)
    cfg = {}
    for name in ("f32", "f16", "q8_0"):
        kv = A.kv_operand(format_code(name))
        states = [np.zeros(region_floats(nkv, cap, hd, name), np.float32) for _ in range(layers)]
        for st in states:
            for p0 in range(0, n_ctx, 512):
                T = min(512, n_ctx - p0)
                rows = rng.standard_normal(T * W).astype(np.float32)
                A.kv_write(rows, st, nh * hd, W, nh * hd + nkv * hd, W, nkv, hd, 0, cap, p0, T, kv)
        cfg[name] = (states, kv)
    arena = np.concatenate([rng.standard_normal(W).astype(np.float32), np.zeros(nh * hd, np.float32)])
    times = {k: [] for k in cfg}
    for i in range(steps + 1):
        for name, (states, kv) in cfg.items():
            t0 = time.perf_counter()
            for st in states:
                A.attention(arena, st, 0, W, nh * hd, W, nh * hd + nkv * hd, W, W, nh * hd, nh, nkv, hd, 0, cap,
                            1.0 / np.sqrt(hd), 0.0, 0, n_ctx, 1, nthreads, kv)
            if i:
                times[name].append((time.perf_counter() - t0) / layers * 1e3)
    return {k: (float(np.min(v)), float(np.median(v))) for k, v in times.items()}


def stepwise(name: str, n: int, kinds: list, blocks: list, threads: int | None, quant=None) -> dict:
    """{label: compare(f32, label)} of n one-token steps (see ``--stepwise``)."""
    import cpullm
    out = {}
    m32 = cpullm.load(name, n_ctx=n + 16, threads=threads, kv_dtype="f32", quant=quant)
    ids = text_ids(m32.tokenizer, n)
    runs = [("f32", m32, 0)] + [(f"emu-q8/{b}/stepwise", m32, b) for b in blocks]
    runs += [(k, cpullm.load(name, n_ctx=n + 16, threads=threads, kv_dtype=k, quant=quant), 0) for k in kinds if k != "f32"]
    for label, m, block in runs:
        f, s = m.forward, m.slot
        f.reset(s)
        rows = []
        for t in ids:
            (row,), _ = f.step([s], [t])
            rows.append(np.array(row, np.float32))
            if block:
                emulate(m, s, block)
        out[label] = np.stack(rows)
    return {k: compare(out["f32"], v) for k, v in out.items()}


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def compare(ref: np.ndarray, got: np.ndarray) -> dict:
    """KL(ref || got) per row (mean, max) and top-1 agreement."""
    lp, lq = _log_softmax(ref), _log_softmax(got)
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "top1": float(np.mean(ref.argmax(-1) == got.argmax(-1)))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?")
    p.add_argument("--ctx", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--eval", type=int, default=32, help="teacher-forced decode steps after the prefill")
    p.add_argument("--cache-type", dest="kv_dtypes", nargs="+", default=["f32", "f16", "q8_0"])
    p.add_argument("--emulate-blocks", type=int, nargs="*", default=[],
                   help="also emulate int8 with a scale per this many values of a head row (float32 cache)")
    p.add_argument("--emulate-chunked", action="store_true",
                   help="round the emulated cache after every prefill chunk too")
    p.add_argument("--quant", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument("--stepwise", type=int, default=0, metavar="N",
                   help="the faithful emulation: N one-token steps, the cache rounded after each")
    p.add_argument("--kernel", type=int, nargs=3, metavar=("HEADS", "KV_HEADS", "HEAD_DIM"),
                   help="time the decode attention kernel alone for this shape (no model)")
    p.add_argument("--logits-dir", default=None, help="keep and reuse each format's logits here")
    p.add_argument("--speed", action="store_true", help="decode speed alone over a randomly filled cache")
    a = p.parse_args(argv)
    if a.speed:
        if a.model is None:
            p.error("give MODEL")
        for n in a.ctx:
            r = speed(a.model, a.kv_dtypes, n, a.eval, a.threads, a.quant)
            first = r[a.kv_dtypes[0]]
            print(f"{a.model}: decode at context {n}, {a.eval} steps, load average {os.getloadavg()[0]:.1f}: "
                  + ", ".join(f"{k} {v:.2f} tok/s ({v / first:.2f}x)" for k, v in r.items()), flush=True)
        return 0
    if a.kernel:
        out = {n: kernel_times(*a.kernel, n, a.threads) for n in a.ctx}
        if a.json:
            print(json.dumps(out))
            return 0
        for n, r in out.items():
            print(f"attention, heads {a.kernel[0]}/{a.kernel[1]}, head_dim {a.kernel[2]}, context {n}, load average "
                  f"{os.getloadavg()[0]:.1f}: " + ", ".join(f"{k} {lo:.3f} ms (median {med:.3f})"
                                                            for k, (lo, med) in r.items()), flush=True)
        return 0
    if a.model is None:
        p.error("give MODEL (or --kernel)")
    if a.stepwise:
        res = stepwise(a.model, a.stepwise, a.kv_dtypes, a.emulate_blocks, a.threads, a.quant)
        if a.json:
            print(json.dumps(res))
            return 0
        print(f"{a.model}: {a.stepwise} one-token steps from position 0, KL against the float32 cache")
        for k, r in res.items():
            print(f"  {k:22s} KL mean {r['kl_mean']:.2e} max {r['kl_max']:.2e} top-1 {r['top1']:.3f}")
        return 0
    import cpullm

    kinds = list(dict.fromkeys(a.kv_dtypes))             # the first one is the reference
    out = {"model": a.model, "eval": a.eval, "reference": kinds[0], "contexts": {}}
    for n in a.ctx:
        res = {}
        for kv in kinds:
            m = cpullm.load(a.model, n_ctx=n + a.eval + 1, threads=a.threads, kv_dtype=kv, quant=a.quant)
            ids = saved_ids(a.logits_dir, a.model, n, a.eval, m.tokenizer)
            res[kv] = saved_run(a.logits_dir, a.model, n, a.eval, kv, lambda: run(m, ids, n, a.eval))
            if kv == "f32":
                for b in a.emulate_blocks:
                    res[f"emu-q8/{b}"] = run(m, ids, n, a.eval, block=b)
                    if a.emulate_chunked:
                        res[f"emu-q8/{b}/chunked"] = run(m, ids, n, a.eval, block=b, chunked=True)
            out["threads"], out["quant"] = m.threads, m.quant
            del m
        ref = res[kinds[0]]["logits"]
        rows = {}
        for kv, r in res.items():
            rows[kv] = {**compare(ref, r["logits"]), "decode_tps": 1.0 / float(np.median(r["steps"])),
                        "prefill_s": r["prefill_s"], "kv_bytes": r["kv_bytes"]}
        out["contexts"][n] = rows
        out.setdefault("loadavg", []).append(os.getloadavg())
        if not a.json:
            print(f"{a.model} ({out['quant']}, {out['threads']} threads), context {n}, {a.eval} teacher-forced "
                  f"steps, KL against the {kinds[0]} cache, load average {os.getloadavg()[0]:.1f}", flush=True)
            for kv, r in rows.items():
                print(f"  {kv:18s} KL mean {r['kl_mean']:.2e} max {r['kl_max']:.2e} top-1 {r['top1']:.3f}  "
                      f"decode {r['decode_tps']:6.2f} tok/s  KV {r['kv_bytes'] / 1e6:7.1f} MB  "
                      f"prefill {r['prefill_s']:.0f} s", flush=True)
    if a.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
