"""The generation loop: prefill, sample, decode, stop on EOS ids or stop strings, stream text."""
from __future__ import annotations

import time
from typing import Iterator

import attrs

from .kernels.warmup import compile_seconds
from .sampling import SamplingParams
from .sequence import GenerationStats, Sequence, start_masks  # noqa: F401  (GenerationStats: re-exported)
from .tokenize import IncrementalDecoder


def generate_ids(model, prompt_ids, max_new_tokens: int, params: SamplingParams,
                 stats: GenerationStats | None = None, stop_ids=None, cancel=None,
                 constraint=None, logits_processors=(), seq_out: list | None = None) -> Iterator[int]:
    """Yield generated token ids; stops at an EOS id (not yielded), after max_new_tokens, at the
    end of the context, when ``constraint`` (cpullm.constraints.Constraint) is complete
    (stop_reason "stop"), or when ``cancel`` (a threading.Event) is set (stop_reason
    "cancelled"). ``seq_out``: a list that receives the Sequence (its log-probabilities)."""
    seq = Sequence(prompt_ids, max_new_tokens, params,
                   stop_ids=model.eos_token_ids if stop_ids is None else stop_ids, stats=stats, cancel=cancel,
                   constraint=constraint, logits_processors=logits_processors)
    if seq_out is not None:
        seq_out.append(seq)
    yield from run_alone(model, seq)


def run_alone(model, seq: Sequence) -> Iterator[int]:
    """Run ``seq`` by itself on the model's executor (one token per forward pass), restoring its
    prompt from the model's prompt cache when one is attached."""
    stats = seq.stats
    ex = model.executor
    seq.check_fits(model.n_ctx)
    t0, c0 = time.perf_counter(), compile_seconds()
    model._seq = list(seq.prompt)           # what save_prompt_cache saves
    pc = getattr(model, "_prompt_cache", None)
    seq.restore(ex, pc)
    logits = seq.prefill_alone(ex, pc)
    compiled = compile_seconds() - c0
    stats.prefill_s = max(0.0, time.perf_counter() - t0 - compiled)
    stats.compile_s += compiled
    # plain greedy needs only each step's argmax: the executor reads the lm_head through its
    # screen for it (the same token as the argmax of the full logits)
    greedy = seq.greedy
    tok = seq.take(ex.n_ctx, logits=logits)
    while tok is not None:
        yield tok
        if seq.done:
            return
        if seq.cancelled:
            seq.finish("cancelled")
            return
        masks = start_masks([seq])       # the next constraint mask, beside the forward pass
        t, c0 = time.perf_counter(), compile_seconds()
        if greedy:
            nxt, logits = ex.decode_argmax(seq.pending), None
        else:
            nxt, logits = None, ex.decode(seq.pending)
        masks.join()
        seq.position = ex.n_past
        compiled = compile_seconds() - c0
        stats.decode_s += max(0.0, time.perf_counter() - t - compiled)
        stats.compile_s += compiled
        stats.decode_steps += 1
        tok = seq.take(ex.n_ctx, logits=logits, token=nxt)


class TextStream:
    """Token ids in, text pieces out: incremental detokenization, with ``stop`` strings held back
    until they can no longer start a stop string, and cut (not emitted) when one appears."""

    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.dec = IncrementalDecoder(tokenizer)
        self.stop = [s for s in (stop or []) if s]
        self.hold = max((len(s) for s in self.stop), default=0)
        self.pending = ""
        self.stopped = False            # a stop string was found: the text ends here

    def push(self, tok: int) -> str:
        """The text that became final with ``tok`` ("" when none)."""
        if self.stopped:
            return ""
        self.pending += self.dec.push(tok)
        if not self.stop:
            out, self.pending = self.pending, ""
            return out
        hit = min((self.pending.find(s) for s in self.stop if s in self.pending), default=-1)
        if hit >= 0:
            self.stopped = True
            out, self.pending = self.pending[:hit], ""
            return out
        if len(self.pending) > self.hold:
            out = self.pending[:-self.hold] if self.hold else self.pending
            self.pending = self.pending[-self.hold:] if self.hold else ""
            return out
        return ""

    def flush(self) -> str:
        """The rest of the text once generation ended (cut at a stop string)."""
        if self.stopped:
            return ""
        self.pending += self.dec.flush()
        out, self.pending = self.pending, ""
        if self.stop:
            hit = min((out.find(s) for s in self.stop if s in out), default=-1)
            if hit >= 0:
                self.stopped = True
                out = out[:hit]
        return out


def generate_text(model, prompt_ids, max_new_tokens: int, params: SamplingParams,
                  stop: list[str] | None = None, stats: GenerationStats | None = None,
                  cancel=None, constraint=None, logits_processors=()) -> Iterator[str]:
    """Yield text pieces; ``stop`` strings end generation and are not emitted."""
    stats = stats if stats is not None else GenerationStats()
    text = TextStream(model.tokenizer, stop)
    for tok in generate_ids(model, prompt_ids, max_new_tokens, params, stats, cancel=cancel,
                            constraint=constraint, logits_processors=logits_processors):
        piece = text.push(tok)
        if piece:
            yield piece
        if text.stopped:
            stats.stop_reason = "stop"
            return
    piece = text.flush()
    if text.stopped:
        stats.stop_reason = "stop"
    if piece:
        yield piece


@attrs.frozen
class TokenEvent:
    """One generated token as :func:`generate_events` streams it: its id, the text that became
    final with it (may be "" while a character or a stop string is incomplete), its
    log-probability and the likeliest alternatives (None / () unless log-probabilities were
    asked for), and the seconds since generation started."""
    token: int
    text: str
    logprob: float | None
    top_logprobs: tuple
    elapsed_s: float


def generate_events(model, prompt_ids, max_new_tokens: int, params: SamplingParams,
                    stop: list[str] | None = None, stats: GenerationStats | None = None,
                    cancel=None, constraint=None, logits_processors=()) -> Iterator[TokenEvent]:
    """Yield a :class:`TokenEvent` per generated token; text past a ``stop`` string is cut (the
    event that reaches it carries the text before it, and generation ends)."""
    stats = stats if stats is not None else GenerationStats()
    text = TextStream(model.tokenizer, stop)
    holder: list = []
    t0 = time.perf_counter()
    last = None
    for tok in generate_ids(model, prompt_ids, max_new_tokens, params, stats, cancel=cancel,
                            constraint=constraint, logits_processors=logits_processors, seq_out=holder):
        seq = holder[0]
        lp = seq.logprobs[-1] if seq.logprobs else None
        piece = text.push(tok)
        if last is not None:
            yield last
        last = TokenEvent(tok, piece, None if lp is None else lp.logprob, () if lp is None else lp.top,
                          time.perf_counter() - t0)
        if text.stopped:
            stats.stop_reason = "stop"
            break
    if last is not None:
        tail = text.flush()
        if text.stopped:
            stats.stop_reason = "stop"
        yield attrs.evolve(last, text=last.text + tail)
