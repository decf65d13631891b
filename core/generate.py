"""The generation loop: prefill, sample, decode, stop on EOS ids or stop strings, stream text."""
from __future__ import annotations

import time
from typing import Iterator

import attrs

from .errors import PromptError
from .kernels.warmup import compile_seconds
from .sampling import Sampler, SamplingParams
from .tokenize import IncrementalDecoder


@attrs.define
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0           # one-token forward passes (the first token comes from prefill)
    reused_tokens: int = 0          # prompt tokens restored from a prompt cache
    compile_s: float = 0.0          # numba compiling kernels during this generation (cold cache only),
                                    # kept out of prefill_s and decode_s
    stop_reason: str = ""           # "eos" | "stop" | "length"

    @property
    def prefill_tps(self) -> float:
        n = self.prompt_tokens - self.reused_tokens
        return n / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_steps / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> dict:
        d = attrs.asdict(self)
        d.update(prefill_tps=self.prefill_tps, decode_tps=self.decode_tps)
        return d


def generate_ids(model, prompt_ids, max_new_tokens: int, params: SamplingParams,
                 stats: GenerationStats | None = None, stop_ids=None) -> Iterator[int]:
    """Yield generated token ids; stops at an EOS id (not yielded) or after max_new_tokens."""
    if max_new_tokens is None or int(max_new_tokens) <= 0:
        raise PromptError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    prompt_ids = [int(t) for t in prompt_ids]
    if not prompt_ids:
        raise PromptError("the prompt is empty: give some text or token ids")
    sampler = Sampler(params)
    stats = stats if stats is not None else GenerationStats()
    stop_ids = set(model.eos_token_ids if stop_ids is None else stop_ids)
    ex = model.executor
    model._check_fits(len(prompt_ids))
    t0, c0 = time.perf_counter(), compile_seconds()
    reused = model._start_sequence(prompt_ids)          # < len(prompt_ids): one token always runs
    logits = model._prefill_prompt(prompt_ids, reused)
    compiled = compile_seconds() - c0
    stats.prefill_s = max(0.0, time.perf_counter() - t0 - compiled)
    stats.compile_s += compiled
    stats.prompt_tokens, stats.reused_tokens = len(prompt_ids), reused
    history = list(prompt_ids)
    stats.stop_reason = "length"
    # plain greedy needs only each step's argmax: the executor reads the lm_head through its
    # screen for it (the same token as the argmax of the full logits)
    greedy = params.temperature == 0.0 and params.repetition_penalty == 1.0
    next_tok = None
    for i in range(int(max_new_tokens)):
        tok = sampler(logits, history) if next_tok is None else next_tok
        if tok in stop_ids:
            stats.stop_reason = "eos"
            return
        history.append(tok)
        stats.generated_tokens += 1
        yield tok
        if i + 1 == max_new_tokens:
            return
        if ex.n_past >= ex.n_ctx:
            return
        t, c0 = time.perf_counter(), compile_seconds()
        if greedy:
            next_tok = ex.decode_argmax(tok)
        else:
            logits = ex.decode(tok)
        compiled = compile_seconds() - c0
        stats.decode_s += max(0.0, time.perf_counter() - t - compiled)
        stats.compile_s += compiled
        stats.decode_steps += 1


def generate_text(model, prompt_ids, max_new_tokens: int, params: SamplingParams,
                  stop: list[str] | None = None, stats: GenerationStats | None = None) -> Iterator[str]:
    """Yield text pieces; ``stop`` strings end generation and are not emitted."""
    stats = stats if stats is not None else GenerationStats()
    dec = IncrementalDecoder(model.tokenizer)
    stop = [s for s in (stop or []) if s]
    hold = max((len(s) for s in stop), default=0)
    pending = ""
    for tok in generate_ids(model, prompt_ids, max_new_tokens, params, stats):
        pending += dec.push(tok)
        if stop:
            hit = min((pending.find(s) for s in stop if s in pending), default=-1)
            if hit >= 0:
                if pending[:hit]:
                    yield pending[:hit]
                stats.stop_reason = "stop"
                return
            if len(pending) > hold:
                yield pending[:-hold] if hold else pending
                pending = pending[-hold:] if hold else ""
        elif pending:
            yield pending
            pending = ""
    pending += dec.flush()
    if stop:
        hit = min((pending.find(s) for s in stop if s in pending), default=-1)
        if hit >= 0:
            pending = pending[:hit]
            stats.stop_reason = "stop"
    if pending:
        yield pending
