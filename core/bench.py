"""``cpullm bench``: how fast a model runs here, measured the same way every time.

Definitions (the same harness, :func:`measure_speed`, also drives llama.cpp and transformers in
``benchmarks/compare.py``, so the three runtimes are measured identically):

* **prompt**: deterministic token ids, a fixed English passage tokenized without special tokens
  and repeated until it is exactly ``prompt_tokens`` long (:func:`prompt_ids`).
* **prefill tokens/s**: ``prompt_tokens`` / wall time of one batched forward pass over the prompt
  in a fresh sequence (logits of the last position only).
* **time to first token** (``ttft_s``): prefill plus choosing the first token (greedy).
* **decode tokens/s** (``decode_tps``): ``gen_tokens`` one-token steps, each a forward pass plus
  a greedy pick, after a one-token prompt (short context, like llama-bench's ``tg``). A runtime
  with a greedy step of its own (``decode_next``: cpullm's lm_head screen, the same tokens) uses it;
  ``decode_logits_tps`` is then the same steps through the full logits, as sampling runs them.
* **decode tokens/s at 512** (``decode_tps_at_512``): the same steps after a 512-token prefill
  (the prompt itself when ``prompt_tokens == 512``).
* Every figure is the **median** over ``repeat`` runs, after one untimed warm-up pass. End of
  sequence never stops a run.
* **load time**: in a child process, from process start to *ready* (``cpullm.load`` returned and
  one short forward pass has run, so every kernel is loaded): ``load_s_miss`` with a fresh,
  empty execution cache directory (the program is quantized and compiled), then ``load_s_hit``
  with that directory warm; the numba cache is warm for both (this process filled it).
* **build peak RSS** (``build_peak_rss_bytes``): the MISS child's peak RSS (VmHWM), imports,
  kernels, quantizing, the head screen's calibration and writing the entry included; the HIT
  child's is ``peak_rss_bytes_hit_process``.
* **cold start** (``cold_start_s``): a first run. A child with ``NUMBA_CACHE_DIR`` set to an
  empty directory and an empty execution cache directory, from process start to its first token
  (load, then the prefill of a few tokens and the argmax); ``cold_start_compile_s`` is the part
  of it the child spent compiling kernels (``Model.compile_s``).
* **numba compile** (``warmup_compile_s``): that child's ready time minus the MISS ready time
  (both with an empty execution cache; only the numba cache differs).
  ``numba_uncacheable`` lists the functions that child compiled but numba could not write to its
  on-disk cache (its "Cannot cache compiled function" warnings): every start recompiles those.
* **memory**: ``model.info()["memory"]`` after the runs: packed weight bytes, KV bytes in use at
  the end of the 512-context run (and allocated for the whole context), activation arena, peak
  RSS of this process.
* **memory bound** (``decode_weight_bytes``, ``read_gbps``, ``decode_tps_bound``,
  ``decode_bound_share``, ``decode_gbps``): after the timed runs, 32 decode steps (at most
  ``gen_tokens``) alternate with a plain parallel read of exactly the weight bytes one token reads
  (:func:`memory_bound`): the rate of that read, the tokens/s it allows, the rate decode reached
  in the same steps and its share of the read's. A share near 100 % means decode is bound by memory
  bandwidth, not by its kernels.

``profile=True`` adds a per-op breakdown: one extra, separately timed pass with the executor's
profile mode on (instruction by instruction with ``perf_counter``; grouped by the IR nodes'
``group`` labels) plus the sampling time measured here. Decode steps are greedy, as in the timed
runs: with a head screen each step's lm_head is the one ``Executor.decode_argmax`` picks, timed
with its argmax (no separate sampling group then). The Python dispatch cost the profile mode
adds to every instruction is calibrated and subtracted. Profile mode is off for every timed run.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .errors import ContextOverflowError, CpullmError, PromptError

CONTEXT_TOKENS = 512

PROMPT_TEXT = (
    "The history of computing is a story of ideas that became machines. Early mechanical "
    "calculators could add and subtract; later designs stored programs in memory and changed "
    "what a machine could do without rewiring it. Compilers turned readable instructions into "
    "code, operating systems shared one processor among many tasks, and networks connected "
    "computers across cities and oceans. Today a small language model can run on an ordinary "
    "laptop processor, reading a prompt, predicting one token after another, and writing text "
    "that answers questions, summarizes documents, or translates between languages. "
)

# Profile groups (IR node ``group`` labels, plus "sampling") -> table / chart labels.
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


class BenchError(CpullmError):
    """A benchmark step failed (a child process, a missing optional extra)."""


# ---- the prompt ---------------------------------------------------------------------------------
def prompt_ids(tokenizer, n: int, vocab: int | None = None) -> list[int]:
    """Exactly ``n`` deterministic token ids: PROMPT_TEXT tokenized (no special tokens), repeated."""
    if n <= 0:
        raise PromptError(f"--prompt-tokens must be >= 1, got {n}")
    base = [int(t) for t in tokenizer.encode(PROMPT_TEXT, add_special_tokens=False)]
    if vocab is not None:
        base = [t for t in base if 0 <= t < vocab]
    if not base:
        raise PromptError("the tokenizer produced no usable token ids for the benchmark prompt")
    reps = -(-n // len(base))
    return (base * reps)[:n]


def cpu_busy(seconds: float = 2.0) -> float | None:
    """Fraction of all CPU time used (by anything) over the next ``seconds`` (Linux /proc/stat;
    None elsewhere). Unlike the load average it does not remember a run that just ended."""
    def snap():
        with open("/proc/stat") as fh:
            v = [int(x) for x in fh.readline().split()[1:]]
        return sum(v), v[3] + v[4]                       # total, idle + iowait
    try:
        t0, i0 = snap()
        time.sleep(seconds)
        t1, i1 = snap()
    except (OSError, ValueError, IndexError):
        return None
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


def greedy(logits) -> int:
    """The benchmark's token choice for every runtime: argmax (first index on ties)."""
    return int(np.argmax(logits))


# ---- runners ------------------------------------------------------------------------------------
class CpullmRunner:
    """The minimal interface :func:`measure_speed` drives: reset / prefill / decode -> logits."""

    name = "cpullm"

    def __init__(self, model):
        self.model = model
        self.ex = model.executor

    @property
    def n_ctx(self) -> int:
        return self.model.n_ctx

    def reset(self):
        self.ex.reset()
        self.model._seq = []

    def prefill(self, ids):
        return self.ex.prefill(ids)

    def decode(self, tok: int):
        return self.ex.decode(tok)

    def decode_next(self, tok: int) -> int:
        """Greedy decoding's step: the next token only (through the lm_head screen, if any)."""
        return self.ex.decode_argmax(tok)


def next_token(runner, tok: int) -> int:
    """One greedy decode step of any runner: ``runner.decode_next`` where the runtime has a
    step that returns only the argmax, else the argmax of ``runner.decode``'s logits."""
    step = getattr(runner, "decode_next", None)
    return int(step(tok)) if step is not None else greedy(runner.decode(tok))


def _median(xs):
    xs = [x for x in xs if x is not None]
    return float(statistics.median(xs)) if xs else None


def _decode_steps(runner, tok: int, steps: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = next_token(runner, tok)
    return time.perf_counter() - t0, tok


def measure_speed(runner, ids: list[int], gen_tokens: int, repeat: int = 3,
                  context_tokens: int = CONTEXT_TOKENS, context_ids: list[int] | None = None,
                  warmup: bool = True, after_run=None) -> dict:
    """Median prefill / decode / decode-at-context tokens/s and time to first token.

    ``runner`` has ``reset()``, ``prefill(ids) -> last logits``, ``decode(tok) -> logits`` and
    ``n_ctx``. ``context_ids`` (default: ``ids`` when it has ``context_tokens`` tokens) is the
    prefill before the decode-at-context run. ``after_run(runner)`` is called at the end of each
    repeat with the 512-context sequence still in the cache.
    """
    if gen_tokens <= 0:
        raise PromptError(f"--gen-tokens must be >= 1, got {gen_tokens}")
    if repeat <= 0:
        raise PromptError(f"--repeat must be >= 1, got {repeat}")
    n_ctx = int(runner.n_ctx)
    if len(ids) + gen_tokens > n_ctx:
        raise ContextOverflowError(
            f"{len(ids)} prompt + {gen_tokens} generated tokens exceed the context of {n_ctx}; "
            f"lower --prompt-tokens/--gen-tokens or raise --ctx")
    context_tokens = max(1, min(context_tokens, n_ctx - gen_tokens))
    if context_ids is None:
        context_ids = ids if len(ids) == context_tokens else None
    if context_ids is not None and len(context_ids) != context_tokens:
        raise PromptError(f"context_ids has {len(context_ids)} tokens, expected {context_tokens}")
    same = context_ids is ids or (context_ids is not None and list(context_ids) == list(ids))

    if warmup:   # untimed: loads / compiles every kernel path the timed runs take
        runner.reset()
        tok = greedy(runner.prefill(ids))
        _decode_steps(runner, tok, min(4, gen_tokens))

    runs = []
    for _ in range(repeat):
        r = {}
        # short context decode: a one-token prompt, then gen_tokens steps
        runner.reset()
        tok = greedy(runner.prefill(ids[:1]))
        dt, _ = _decode_steps(runner, tok, gen_tokens)
        r["decode_s"] = dt
        if getattr(runner, "decode_next", None) is not None:   # the same steps, full logits
            runner.reset()
            tok = greedy(runner.prefill(ids[:1]))
            t0 = time.perf_counter()
            for _ in range(gen_tokens):
                tok = greedy(runner.decode(tok))
            r["decode_logits_s"] = time.perf_counter() - t0
        # prefill + first token
        runner.reset()
        t0 = time.perf_counter()
        logits = runner.prefill(ids)
        t1 = time.perf_counter()
        tok = greedy(logits)
        t2 = time.perf_counter()
        r["prefill_s"], r["ttft_s"] = t1 - t0, t2 - t0
        # decode after a context_tokens-long prefill
        if not same:
            runner.reset()
            tok = greedy(runner.prefill(context_ids if context_ids is not None
                                        else _extend(ids, context_tokens)))
        dt, _ = _decode_steps(runner, tok, gen_tokens)
        r["decode_ctx_s"] = dt
        if after_run is not None:
            after_run(runner)
        runs.append(r)

    n = len(ids)
    return {
        "prefill_tps": _median(n / r["prefill_s"] for r in runs),
        "decode_tps": _median(gen_tokens / r["decode_s"] for r in runs),
        "decode_tps_at_512": _median(gen_tokens / r["decode_ctx_s"] for r in runs),
        "decode_logits_tps": _median(gen_tokens / r["decode_logits_s"] for r in runs if "decode_logits_s" in r),
        "ttft_s": _median(r["ttft_s"] for r in runs),
        "decode_context_tokens": context_tokens,
        "runs": runs,
    }


def _extend(ids: list[int], n: int) -> list[int]:
    reps = -(-n // len(ids))
    return (list(ids) * reps)[:n]


# ---- per-op profile -------------------------------------------------------------------------------
def _dispatch_overhead(ex, n: int = 3000) -> float:
    """Median seconds the profile mode's per-instruction timing adds: perf_counter pair plus one
    interpreter call that runs no instruction."""
    ts = np.empty(n)
    for i in range(n):
        t1 = time.perf_counter()
        ex._interp(0, 0)
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
    ex = model.executor
    groups = model.program.meta["groups"]
    overhead = _dispatch_overhead(ex)
    runner = CpullmRunner(model)
    runner.reset()

    ex.start_profile()
    t0 = time.perf_counter()
    logits = ex.prefill(ids)
    t1 = time.perf_counter()
    pre = ex.stop_profile()
    ts = time.perf_counter()
    tok = greedy(logits)
    pre["sampling"] = time.perf_counter() - ts
    prefill_wall = t1 - t0 + pre["sampling"]

    # Greedy steps as the timed runs take them: through the head screen where the model has one
    # (Executor.decode_argmax times its lm_head step, the argmax included), else the full logits.
    screened = ex.screen is not None
    sampling = 0.0
    ex.start_profile()
    t0 = time.perf_counter()
    for _ in range(gen_tokens):
        if screened:
            tok = ex.decode_argmax(tok)
            continue
        logits = ex.decode(tok)
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


# ---- the memory bound of decode ------------------------------------------------------------------
def decode_weight_spans(program) -> list:
    """What one decode token reads from the weights, as views of the program's packed buffers:
    every LINEAR's matrix once (q8: int8 values and binary16 block scales; raw ggml blocks: their
    bytes; f32: float32 values)
    and biases, adjacent ranges merged (so the read below streams as decode does, in long runs).
    The embedding row and the norm vectors are left out (a few KB). With a head screen, greedy
    decoding reads the screen instead of the lm_head (plus a few exact rows, left out too)."""
    from .kernels import program_table as P
    a = program.arrays
    I = a["I"]
    ranges: dict[str, list] = {"wq": [], "ws": [], "wf": []}
    screen = program.meta.get("head_screen")
    if screen:
        N = int(program.meta["vocab"])
        ranges["wq"].append((screen["q_off"], screen["q_off"] + N * screen["q_cols"]))
        ranges["ws"].append((screen["s_off"], screen["s_off"] + N * screen["s_cols"]))
        ranges["wf"].append((screen["b_off"], screen["b_off"] + 3 * N))
    for r in np.nonzero(I[:, P.COL_OP] == P.OP_LINEAR)[0]:
        if screen and r == screen["row"]:
            continue
        lin = P.linear_operands(I[r])
        Kd, N, kind, w_off, s_off, Kp, b_off = lin.k, lin.n, lin.kind, lin.w_off, lin.s_off, lin.kp, lin.bias_off
        if kind == P.WEIGHT_Q8:
            ranges["wq"].append((w_off, w_off + N * Kp))
            ranges["ws"].append((s_off, s_off + N * (Kp // 32)))
        elif kind == P.WEIGHT_BLOCKS:               # raw ggml blocks in wq's bytes; s_off: ggml type
            from .kernels.gguf_blocks import block_format
            ranges["wq"].append((w_off, w_off + N * block_format(s_off).row_bytes(Kp)))
        else:
            ranges["wf"].append((w_off, w_off + N * Kd))
        if b_off >= 0:
            ranges["wf"].append((b_off, b_off + N))
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


def decode_weight_bytes(program) -> int:
    """Bytes of :func:`decode_weight_spans`: the weights one decode token reads."""
    return int(sum(v.nbytes for v in decode_weight_spans(program)))


def memory_bound(model, steps: int = 32, token: int = 0) -> dict:
    """Decode against this machine's streaming read rate, measured side by side: ``steps`` decode
    steps (after a one-token prompt), each followed by a plain parallel read of exactly the bytes
    one decode token reads (:func:`decode_weight_spans`, :func:`cpullm.kernels.bandwidth.read_sum_u32`).
    Alternating the two makes both see the same machine: on a shared host the read rate alone
    moves by 30 % within a minute. Medians; the first two steps of each are dropped."""
    import numba

    from .kernels.bandwidth import as_words, read_sum_u32
    spans = decode_weight_spans(model.program)
    per_token = int(sum(v.nbytes for v in spans))            # = decode_weight_bytes(program)
    words = [as_words(v) for v in spans]
    nth = numba.get_num_threads()
    steps = max(3, int(steps))
    runner = CpullmRunner(model)
    runner.reset()
    tok = greedy(runner.prefill([int(token)]))
    dec, rd = [], []
    for _ in range(steps + 2):
        t0 = time.perf_counter()
        tok = next_token(runner, tok)
        t1 = time.perf_counter()
        for w in words:
            read_sum_u32(w, nth)
        t2 = time.perf_counter()
        dec.append(t1 - t0)
        rd.append(t2 - t1)
    runner.reset()
    dec_s, rd_s = float(np.median(dec[2:])), float(np.median(rd[2:]))
    return {
        "decode_weight_bytes": per_token,
        "read_gbps": per_token / rd_s / 1e9,
        "read_gbps_best": per_token / min(rd[2:]) / 1e9,
        "decode_gbps": per_token / dec_s / 1e9,
        "decode_tps_bound": 1.0 / rd_s,
        "decode_bound_share": rd_s / dec_s,
        "memory_bound_steps": steps,
    }


# ---- load and compile times in child processes ------------------------------------------------------
_CHILD = r"""
import os, sys
if sys.path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]        # a cpullm/ folder in the working directory must not shadow the package
import json, time
spec = json.loads(sys.argv[1])
import cpullm
from cpullm.memory import peak_rss_bytes
t0 = time.perf_counter()
m = cpullm.load(spec["model"], quant=spec["quant"], threads=spec["threads"], n_ctx=spec["n_ctx"],
                cache_dir=spec["cache_dir"])
load_s = time.perf_counter() - t0
ex = m.executor
first_token = []
def forward():
    ex.reset()
    tok = int(ex.prefill(spec["ids"]).argmax())
    first_token.append(time.time())
    ex.decode(tok)
t1 = time.perf_counter()
forward()
first_s = time.perf_counter() - t1
ready = time.time()
t2 = time.perf_counter()
forward()
second_s = time.perf_counter() - t2
print("CPULLM_BENCH_CHILD " + json.dumps({"ready_wall": ready, "first_token_wall": first_token[0],
      "load_s": load_s, "compile_s": m.compile_s, "cache": m.cache_status, "first_forward_s": first_s,
      "second_forward_s": second_s, "peak_rss_bytes": peak_rss_bytes()}))
"""


def _child_load(spec: dict, env_extra: dict | None = None, timeout: float = 3600) -> dict:
    env = dict(os.environ)
    env["CPULLM_QUIET"] = "1"
    env.update(env_extra or {})
    t_spawn = time.time()
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(spec)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("CPULLM_BENCH_CHILD ")), None)
    if proc.returncode != 0 or line is None:
        tail = "\n".join((proc.stderr or "").strip().splitlines()[-5:])
        raise BenchError(f"the load-time child process failed (exit {proc.returncode}): {tail}")
    out = json.loads(line.split(" ", 1)[1])
    out["ready_s"] = out["ready_wall"] - t_spawn
    if "first_token_wall" in out:
        out["first_token_s"] = out["first_token_wall"] - t_spawn
    out["uncacheable"] = sorted(set(_UNCACHEABLE.findall(proc.stderr or "")))
    return out


_UNCACHEABLE = re.compile(r'Cannot cache compiled function "([^"]+)"')
"""numba's warning for a function it compiled but cannot write to its on-disk cache."""


def load_timings(model_dir, quant: str, threads: int, n_ctx: int, probe_ids: list[int],
                 load: bool = True, compile: bool = True, progress=None) -> dict:
    """MISS / HIT process-start-to-ready times and the cold numba compile time (see module doc)."""
    res: dict = {}
    if not (load or compile):
        return res
    tmp = Path(tempfile.mkdtemp(prefix="cpullm-bench-"))
    try:
        spec = {"model": str(model_dir), "quant": quant, "threads": threads, "n_ctx": n_ctx,
                "cache_dir": str(tmp / "exec-cache"), "ids": list(probe_ids)}
        say = progress or (lambda msg: None)
        say("load time, execution cache MISS (child process)")
        miss = _child_load(spec)
        say("load time, execution cache HIT (child process)")
        hit = _child_load(spec)
        if load:
            res.update(load_s_miss=miss["ready_s"], load_s_hit=hit["ready_s"],
                       load_s_miss_inproc=miss["load_s"], load_s_hit_inproc=hit["load_s"],
                       cache_miss_status=str(miss["cache"]).split()[0],
                       cache_hit_status=str(hit["cache"]).split()[0],
                       peak_rss_bytes_hit_process=hit["peak_rss_bytes"],
                       build_peak_rss_bytes=miss["peak_rss_bytes"])
        if compile:
            say("cold start: empty numba cache and execution cache (child process)")
            numba_dir = tmp / "numba-cache"
            numba_dir.mkdir()
            cold = _child_load(dict(spec, cache_dir=str(tmp / "exec-cache-cold")),
                               {"NUMBA_CACHE_DIR": str(numba_dir)})
            res.update(warmup_compile_s=max(0.0, cold["ready_s"] - miss["ready_s"]),
                       load_s_cold_numba=cold["ready_s"], numba_uncacheable=cold["uncacheable"],
                       cold_start_s=cold.get("first_token_s"), cold_start_compile_s=cold.get("compile_s"),
                       first_forward_compile_s=max(0.0, cold["first_forward_s"] - cold["second_forward_s"]))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return res


# ---- the whole benchmark -----------------------------------------------------------------------------
def run_bench(model, prompt_tokens: int = 512, gen_tokens: int = 128, repeat: int = 3,
              profile: bool = False, load: bool = True, compile: bool = True,
              context_tokens: int = CONTEXT_TOKENS, progress=None) -> dict:
    """Benchmark a loaded :class:`cpullm.model.Model`; returns the ``--json`` object."""
    say = progress or (lambda msg: None)
    info0 = model.info()
    vocab = int(model.program.meta.get("embed_rows", info0["vocab"]))
    ids = prompt_ids(model.tokenizer, prompt_tokens, vocab)
    ctx_n = max(1, min(context_tokens, model.n_ctx - gen_tokens))
    ctx_ids = ids if ctx_n == len(ids) else prompt_ids(model.tokenizer, ctx_n, vocab)
    runner = CpullmRunner(model)
    snap: dict = {}
    say(f"speed: prompt {prompt_tokens}, generate {gen_tokens}, {repeat} repeat(s)")
    speed = measure_speed(runner, ids, gen_tokens, repeat=repeat, context_tokens=ctx_n,
                          context_ids=ctx_ids,
                          after_run=lambda r: snap.update(model.info()["memory"]))
    result = {
        "model": str(model.model_dir),
        "family": info0["family"],
        "model_type": info0["model_type"],
        "params": int(info0.get("params") or 0) or count_params(model.model_dir),
        "quant": model.quant,
        "threads": model.threads,
        "n_ctx": model.n_ctx,
        "prompt_tokens": len(ids),
        "gen_tokens": gen_tokens,
        "repeat": repeat,
        "prefill_tps": speed["prefill_tps"],
        "decode_tps": speed["decode_tps"],
        "decode_tps_at_512": speed["decode_tps_at_512"],
        "decode_logits_tps": speed["decode_logits_tps"],
        "decode_context_tokens": speed["decode_context_tokens"],
        "ttft_s": speed["ttft_s"],
        "load_s": model.load_s,
        "cache": str(model.cache_status).split()[0],
        "cache_detail": str(model.cache_status),
    }
    if profile:
        say("per-op profile pass")
        result["profile"] = profile_pass(model, ctx_ids, gen_tokens)
    mem = model.info()["memory"]
    result.update(
        weights_bytes=mem["weights_bytes"],
        kv_bytes=snap.get("kv_bytes", mem["kv_bytes"]),
        kv_bytes_max=mem["kv_bytes_max"],
        linear_state_bytes=mem.get("linear_state_bytes", 0),
        arena_bytes=mem["arena_bytes"],
        peak_rss_bytes=mem["peak_rss_bytes"],
        context_plan=model.info()["context_plan"],
    )
    say("memory bound: decode steps alternating with a plain read of the same bytes")
    result.update(memory_bound(model, steps=min(32, gen_tokens), token=ids[0]))  # after the RSS snapshot
    result.update({"load_s_hit": None, "load_s_miss": None, "build_peak_rss_bytes": None,
                   "peak_rss_bytes_hit_process": None, "warmup_compile_s": None,
                   "cold_start_s": None, "cold_start_compile_s": None})
    if load or compile:
        result.update(load_timings(model.model_dir, model.quant, model.threads, model.n_ctx,
                                   ids[:8], load=load, compile=compile, progress=say))
    result["runs"] = speed["runs"]
    return result


def count_params(model_dir) -> int:
    """Parameters in the checkpoint's safetensors headers (fallback when the program lacks it)."""
    try:
        from .tensors import TensorStore
        store = TensorStore(model_dir)
        return int(sum(int(np.prod(store.shape(n))) for n in store.names()))
    except Exception:
        return 0


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
        f"n_ctx {r['n_ctx']}",
        f"  prompt {r['prompt_tokens']} tokens, {r['gen_tokens']} decode steps, "
        f"medians of {r['repeat']} run(s)",
        "",
        f"  prefill                {_s(r['prefill_tps'], 'tokens/s', '{:9.1f}')}",
        f"  decode (short context) {_s(r['decode_tps'], 'tokens/s', '{:9.1f}')}",
        f"  decode @{r['decode_context_tokens']:<4} context    {_s(r['decode_tps_at_512'], 'tokens/s', '{:9.1f}')}",
        f"  decode, full logits    {_s(r.get('decode_logits_tps'), 'tokens/s', '{:9.1f}')}  (short context; "
        "sampling's path; greedy reads the lm_head through its screen)",
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
        f"  memory: weights {_mb(r['weights_bytes'])}, KV {_mb(r['kv_bytes'])} in use "
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
        f"decode read {r['decode_gbps']:.1f} GB/s, {100 * r['decode_bound_share']:.0f}% of that rate"])


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
