"""Sequence: one running generation, run by the scheduler (a lone ``generate`` is a scheduler of
one slot).

A sequence owns what belongs to one request and nothing of the model: its prompt and generated
token ids, its sampler and stop rules, its statistics and its cancel flag, and while it runs the
slot the scheduler lent it (:class:`cpullm.run.forward.Slot`: its state and position). The scheduler
runs the forward passes and only feeds it logits or greedy tokens through :meth:`take`.
"""
from __future__ import annotations

import threading

import attrs
import numpy as np

from ..errors import ContextOverflowError, PromptError
from .sampling import Sampler, SamplingParams, top_logprobs

WAITING, PREFILL, DECODE, DONE = "waiting", "prefill", "decode", "done"

DEFAULT_MAX_TOKENS = 128


def resolve_max_tokens(max_tokens: int | None, max_new_tokens: int | None,
                       default: int = DEFAULT_MAX_TOKENS) -> int:
    """The answer length from ``max_tokens`` (the peers' name) or ``max_new_tokens`` (its alias,
    transformers' name); a PromptError when both are given and differ."""
    if max_tokens is not None and max_new_tokens is not None and max_tokens != max_new_tokens:
        raise PromptError(f"max_tokens={max_tokens} and max_new_tokens={max_new_tokens} disagree; "
                          "give one of them (max_new_tokens is an alias of max_tokens)")
    n = max_tokens if max_tokens is not None else max_new_tokens
    return default if n is None else n


@attrs.define
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0           # tokens from decode passes (one per one-token pass; a verify pass
                                    # gives as many as it keeps); the first token comes from prefill
    reused_tokens: int = 0          # prompt tokens restored from a prompt cache
    compile_s: float = 0.0          # numba compiling kernels during this generation (cold cache only),
                                    # kept out of prefill_s and decode_s
    stop_reason: str = ""           # "eos" | "stop" | "length" | "cancelled" | "failed" (Sequence.error)
    spec_passes: int = 0            # decode passes that scored guesses (cpullm.generate.speculative)
    spec_drafted: int = 0           # guessed tokens scored
    spec_accepted: int = 0          # guessed tokens kept (each a token without a pass of its own)

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



@attrs.frozen
class TokenLogprob:
    """One generated token's log-probability and the likeliest alternatives at its step (see
    cpullm.generate.sampling for which logits they come from)."""
    token: int
    logprob: float
    top: tuple = ()                 # ((token id, log-probability), ...) best first


class Sequence:
    def __init__(self, prompt_ids, max_new_tokens: int, params: SamplingParams | None = None,
                 stop_ids=(), stats=None, cancel: threading.Event | None = None, constraint=None,
                 logits_processors=()):
        if max_new_tokens is None or int(max_new_tokens) <= 0:
            raise PromptError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.prompt = [int(t) for t in prompt_ids]
        if not self.prompt:
            raise PromptError("the prompt is empty: give some text or token ids")
        self.max_new_tokens = int(max_new_tokens)
        self.params = (params or SamplingParams()).validate()
        self.sampler = Sampler(self.params, logits_processors)
        self.constraint = constraint          # cpullm.generate.constraints.Constraint or None
        self.logprobs: list[TokenLogprob] = []   # one per generated token when params.logprobs is set
        self.stop_ids = set(int(t) for t in stop_ids)
        self.stats = stats if stats is not None else GenerationStats()
        self.cancel_event = cancel if cancel is not None else threading.Event()
        self.history: list[int] = list(self.prompt)    # prompt + generated (the repetition penalty's)
        self.generated: list[int] = []
        self.reused = 0              # leading prompt tokens restored rather than prefilled
        self.pending: int | None = None   # the last emitted token, input of the next decode step
        self.slot = None             # the cpullm.run.forward.Slot lent by the scheduler while it runs
        self._left_at = 0            # the slot's position when the sequence gave it back
        self.phase = WAITING
        self.error: Exception | None = None   # why it failed, when only this sequence did (fail())
        self.cache_salt: str | None = None     # its tenant: shares cached prefixes only with the same salt
        self.spec = None             # cpullm.generate.speculative.SeqSpec while a speculating runner runs it
        self.stats.prompt_tokens = len(self.prompt)
        self.stats.stop_reason = "length"

    # ---- what the runner asks --------------------------------------------------------------
    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax of the logits (no sampler state needed), so a
        runner may compute only the argmax (the executor's lm_head screen). False as soon as
        anything reads or changes the logits: penalties, bias, processors, a constraint,
        log-probabilities."""
        return self.params.temperature == 0.0 and self.sampler.plain and self.constraint is None

    @property
    def argmax_first(self) -> bool:
        """True when the argmax of the unprocessed logits is the next token unless a constraint
        forbids it: plain greedy, or greedy under a constraint with nothing else reading the
        logits (a runner may then compute the argmax alone, the lm_head screen's; :meth:`take`
        asks for the full logits only when the mask refuses that token: the masked argmax of
        the same logits, so the same tokens as always reading them)."""
        return self.params.temperature == 0.0 and self.sampler.plain

    def screen_draw(self, vocab: int):
        """(cuts, draw) when the next token is a plain sampled draw an lm_head screen may make
        (:meth:`cpullm.generate.sampling.Sampler.screen_cuts`; its uniform number is taken now),
        ``draw(logits)`` the same draw from the full logits; None otherwise. The token either
        gives goes to :meth:`take` as ``token``."""
        if self.constraint is not None:
            return None
        cuts = self.sampler.screen_cuts(vocab)
        if cuts is None:
            return None
        u = cuts[-1]
        return cuts, lambda logits: self.sampler.draw(self.sampler.process(logits, self.history), u)

    @property
    def position(self) -> int:
        """Tokens whose state sits in the sequence's slot (before it got one: 0; after it gave
        it back: as many as when it left)."""
        return self.slot.position if self.slot is not None else self._left_at

    def leave_slot(self):
        """Give the slot back (the runner's call when the sequence ends); returns it."""
        slot, self.slot = self.slot, None
        if slot is not None:
            self._left_at = slot.position
        return slot

    @property
    def cancelled(self) -> bool:
        return self.cancel_event.is_set()

    def cancel(self) -> None:
        """Ask the runner to stop this sequence at the next step (thread-safe)."""
        self.cancel_event.set()

    @property
    def done(self) -> bool:
        return self.phase == DONE

    def check_fits(self, n_ctx: int) -> None:
        if len(self.prompt) > n_ctx:
            raise ContextOverflowError(
                f"the prompt has {len(self.prompt)} tokens but the context holds {n_ctx}; shorten it or "
                f"load with a larger n_ctx (--ctx N)")

    # ---- what the runner reports ------------------------------------------------------------
    def take(self, n_ctx: int, logits: np.ndarray | None = None, token: int | None = None,
             full_logits=None) -> int | None:
        """The model's output after the last prompt token or the pending token: ``logits``
        (vocab,) to sample from, or a greedy ``token`` already chosen. Returns the new token if it
        is emitted (then the caller yields it), None when the sequence ends here (an EOS id: not
        emitted). Sets :attr:`pending` while the sequence goes on.

        With ``logits`` the per-sequence pipeline runs (cpullm.generate.sampling: processors, bias,
        penalties, then the constraint's mask), log-probabilities are recorded from its result,
        and the token is drawn from it. A constraint that is complete ends the sequence with
        stop reason "stop" after its last token.

        A greedy ``token`` given for a constrained sequence (:attr:`argmax_first`) is the
        unmasked argmax: kept when the mask allows it, else the masked argmax is taken from
        ``logits`` or, without them, from ``full_logits()`` (the runner's full logits of the
        same step)."""
        if token is not None and self.constraint is not None and not self.constraint.allows(int(token)):
            if logits is None:
                logits = full_logits()
            token = None
        if token is None:
            x = self.sampler.process(logits, self.history)
            tok = None
            if self.constraint is not None:
                if self.params.temperature == 0.0 and self.params.logprobs is None:
                    # greedy: the unmasked argmax, when allowed, is the masked argmax (the same
                    # first index on ties), so the full mask is applied only when it is not
                    best = int(np.argmax(x))
                    if self.constraint.allows(best):
                        tok = best
                if tok is None:
                    x = self.constraint.apply(x)
            if tok is None:
                tok = int(self.sampler.draw(x))
            if self.params.logprobs is not None:
                lp, top = top_logprobs(x, tok, self.params.logprobs)
                self.logprobs.append(TokenLogprob(tok, lp, tuple(top)))
        else:
            tok = int(token)
        self.pending = None
        if tok in self.stop_ids:
            if token is None and self.params.logprobs is not None:
                self.logprobs.pop()             # an EOS id is not emitted: neither is its log-probability
            self.finish("eos")
            return None
        self.history.append(tok)
        self.generated.append(tok)
        self.sampler.note(tok)
        self.stats.generated_tokens += 1
        if self.constraint is not None:
            if not self.constraint.consume(tok):
                # only a token the mask did not choose (a runner's greedy token) gets here:
                # the output cannot continue under the constraint
                self.finish("stop")
                return tok
            if self.constraint.finished:
                self.finish("stop")
                return tok
        if len(self.generated) >= self.max_new_tokens or self.position >= n_ctx:
            self.finish("length")
        else:
            self.pending = tok
            self.phase = DECODE
        return tok

    def fail(self, error: Exception) -> None:
        """End this sequence only, with ``error`` for its consumer (stop reason "failed"): a
        failure that belongs to it (non-finite logits under sampling) and not to its batch."""
        if self.phase != DONE:
            self.error = error
            self.finish("failed")

    def finish(self, reason: str) -> None:
        if self.phase != DONE:
            self.stats.stop_reason = reason
            self.phase = DONE
            self.pending = None


def start_masks(seqs):
    """Start computing the next step's constraint mask of every constrained sequence in
    ``seqs`` on the mask thread (cpullm.generate.constraints.start_masks); call ``.join()`` on the result
    after the forward pass. Free sequences cost nothing here."""
    from .constraints import MaskJob, start_masks as start
    cons = [s.constraint for s in seqs if s.constraint is not None]
    return start(cons) if cons else MaskJob()
