"""``cpullm bench``'s whole run: speed, memory, the memory bound, load times, the profile."""
from __future__ import annotations

import numpy as np

from .harness import CONTEXT_TOKENS, CpullmRunner, measure_speed, prompt_ids
from .startup import load_timings
from .memory_bound import memory_bound
from .profile import profile_pass


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
        "kv_dtype": getattr(model, "kv_dtype", "f32"),
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
        "head_screen": model.executor.screen is not None,
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
                                   ids[:8], load=load, compile=compile, progress=say,
                                   kv_dtype=getattr(model, "kv_dtype", None)))
    result["runs"] = speed["runs"]
    return result


def count_params(model_dir) -> int:
    """Parameters in the checkpoint's safetensors headers (fallback when the program lacks it)."""
    try:
        from ..loading.tensors import TensorStore
        store = TensorStore(model_dir)
        return int(sum(int(np.prod(store.shape(n))) for n in store.names()))
    except Exception:
        return 0
