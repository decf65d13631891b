"""The generation loop: prefill, sample, decode, stop on EOS ids or stop strings, stream text."""
from __future__ import annotations

import time
from typing import Iterator

import attrs

from .sampling import SamplingParams
from .scheduler import Scheduler
from .sequence import GenerationStats, Sequence  # noqa: F401  (GenerationStats: re-exported)
from ..loading.tokenize import IncrementalDecoder


def generate_ids(forward, slot, prompt_ids, max_new_tokens: int, params: SamplingParams, stop_ids,
                 stats: GenerationStats | None = None, cancel=None, prompt_cache=None, constraint=None,
                 logits_processors=(), seq_out: list | None = None, speculative=None) -> Iterator[int]:
    """Yield generated token ids of ``prompt_ids`` run alone in ``slot``; stops at an EOS id in
    ``stop_ids`` (not yielded), after max_new_tokens, at the end of the context, when
    ``constraint`` (cpullm.generate.constraints.Constraint) is complete (stop_reason "stop"), or when
    ``cancel`` (a threading.Event) is set (stop_reason "cancelled"). ``seq_out``: a list that
    receives the Sequence (its log-probabilities). ``speculative``: a
    :class:`cpullm.generate.speculative.SpecConfig` (None: no guesses)."""
    seq = Sequence(prompt_ids, max_new_tokens, params, stop_ids=stop_ids, stats=stats, cancel=cancel,
                   constraint=constraint, logits_processors=logits_processors)
    if seq_out is not None:
        seq_out.append(seq)
    yield from run_alone(forward, slot, seq, prompt_cache, speculative)


def run_alone(forward, slot, seq: Sequence, prompt_cache=None, speculative=None) -> Iterator[int]:
    """Run ``seq`` by itself: a scheduler of the one ``slot`` (plain greedy reads the lm_head
    through the executor's screen there), restoring its prompt from ``prompt_cache``
    (:class:`cpullm.run.prompt_cache.PromptCache`) when one is given."""
    sch = Scheduler(forward, [slot], prompt_cache=prompt_cache, speculative=speculative)
    sch.add(seq)
    while not sch.idle:
        for _, tok in sch.step():
            if tok is not None:
                yield tok
    if seq.error is not None:        # a failure of its own (cpullm.errors): the caller's to see
        raise seq.error


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


def generate_text(tokenizer, token_ids: Iterator[int], stop: list[str] | None = None,
                  stats: GenerationStats | None = None) -> Iterator[str]:
    """Yield the text pieces of the generated ``token_ids``; ``stop`` strings end generation and
    are not emitted (``stats.stop_reason`` becomes "stop")."""
    text = TextStream(tokenizer, stop)
    for tok in token_ids:
        piece = text.push(tok)
        if piece:
            yield piece
        if text.stopped:
            if stats is not None:
                stats.stop_reason = "stop"
            return
    piece = text.flush()
    if text.stopped and stats is not None:
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


def generate_events(tokenizer, token_ids: Iterator[int], holder: list, stop: list[str] | None = None,
                    stats: GenerationStats | None = None) -> Iterator[TokenEvent]:
    """Yield a :class:`TokenEvent` per generated token of ``token_ids`` (whose Sequence
    ``holder[0]`` receives: :func:`generate_ids`'s ``seq_out``); text past a ``stop`` string is
    cut (the event that reaches it carries the text before it, and generation ends)."""
    stats = stats if stats is not None else GenerationStats()
    text = TextStream(tokenizer, stop)
    t0 = time.perf_counter()
    last = None
    for tok in token_ids:
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
