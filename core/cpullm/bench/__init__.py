"""``cpullm bench``: how fast a model runs here, measured the same way every time.

Definitions (the same harness, :func:`measure_speed`, also drives llama.cpp and transformers in
``benchmarks/compare/``, so the three runtimes are measured identically):

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

The harness in modules: :mod:`~cpullm.bench.harness` (the prompt, the runners,
:func:`measure_speed`), :mod:`~cpullm.bench.profile`, :mod:`~cpullm.bench.memory_bound`,
:mod:`~cpullm.bench.startup` (load, build and cold-start times, in child processes), :mod:`~cpullm.bench.run` (the whole run),
:mod:`~cpullm.bench.report` (text and plot), :mod:`~cpullm.bench.concurrency` (``--concurrency N``).
"""
from .concurrency import format_concurrency, run_concurrency
from .harness import (CONTEXT_TOKENS, PROMPT_TEXT, BenchError, CpullmRunner, cpu_busy, greedy, measure_speed,
                      next_token, prompt_ids)
from .startup import load_timings
from .memory_bound import decode_weight_bytes, decode_weight_spans, memory_bound
from .profile import GROUP_LABELS, profile_pass
from .report import format_memory_bound, format_profile, format_report, plot_profile
from .run import count_params, run_bench

__all__ = ["BenchError", "CONTEXT_TOKENS", "CpullmRunner", "GROUP_LABELS", "PROMPT_TEXT", "count_params",
           "cpu_busy", "decode_weight_bytes", "decode_weight_spans", "format_concurrency", "format_memory_bound",
           "format_profile", "format_report", "greedy", "load_timings", "measure_speed", "memory_bound",
           "next_token", "plot_profile", "profile_pass", "prompt_ids", "run_bench", "run_concurrency"]
