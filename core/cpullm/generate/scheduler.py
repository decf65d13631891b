"""Continuous batching: many sequences share each pass over the weights.

A :class:`Scheduler` owns KV slots (:class:`cpullm.run.forward.Slot`), planned up front: one float32
state row per slot, laid out as the program's ``state_regions`` (KV caches of ``n_ctx``
positions, sliding-window rings, linear-attention states), so a sequence admitted always fits and
memory never grows. It runs them through the model's one forward path (:class:`cpullm.run.forward.Forward`);
a sequence running alone (``generate``) is a scheduler of one slot. Every :meth:`Scheduler.step`:

1. drops cancelled sequences (their slot is free at once) and admits waiting ones, first come
   first served, into free slots;
2. prefills one chunk (at most ``prefill_chunk`` tokens) of one sequence that is still reading its
   prompt, taking those in turn, so a long prompt never holds the others up for more than a chunk;
   the chunk's last row gives the first token when the prompt is done;
3. decodes one token of every sequence past its prompt in one pass over the weights
   (:meth:`cpullm.run.forward.Forward.step`); finished sequences leave and free their slot. With
   speculation (``speculative``, :mod:`cpullm.generate.speculative`) a sequence may bring guesses of its
   next tokens: the pass then scores them too (:meth:`cpullm.run.forward.Forward.verify`, guesses and
   plain rows of all sequences in one pass), each sequence keeps the guesses it would have
   produced and its state is cut back to them.

A sequence's tokens do not depend on the others (batch invariance): its prefill chunks are cut
from its own prompt only (so the same chunks alone or not) and run on its own state; its decode
row is computed with the one-token decode's numerics whatever the batch holds. In int8 they are
the tokens ``generate`` returns for it alone, exactly; tests/test_scheduler.py checks both.
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque

import numpy as np

from ..errors import ConfigError, CpullmError, SamplingError
from ..run.forward import Forward, Slot
from cpullm_kernels.setup.warmup import compile_seconds
from ..run.prefix_cache import PrefixCache
from .sequence import DECODE, PREFILL, WAITING, Sequence, start_masks
from .speculative import SeqSpec, SpecConfig, SpecStats


DEFAULT_PREFIX_BLOCK = 64
"""Tokens per prefix-cache block (a divisor of the prefill chunk): a shared prefix is reused in
whole blocks, the rest of it prefilled; 64 tokens of Qwen2.5-0.5B's float32 KV are 1.5 MiB."""


class Scheduler:
    def __init__(self, forward: Forward, slots: int | list[Slot], prefill_chunk: int | None = None,
                 prefix_cache_bytes: int = 0, prefix_block: int | None = None, prompt_cache=None,
                 speculative: SpecConfig | None = None):
        """``slots``: how many to plan (one (slots, state_floats) table, allocated now), or the
        slots to use (of one table). ``prompt_cache``: a :class:`cpullm.run.prompt_cache.PromptCache`
        to restore each prompt from and record it into (a scheduler of one slot: ``generate``).
        ``speculative``: how sequences guess their next tokens (:class:`cpullm.generate.speculative.SpecConfig`;
        None or mode "off": they do not)."""
        fwd = forward
        n = slots if isinstance(slots, int) else len(slots)
        if n < 1:
            raise ConfigError(f"the scheduler needs at least 1 slot (--parallel N >= 1), got {n}")
        if n > fwd.max_chunk:
            raise ConfigError(f"--parallel {n} exceeds the {fwd.max_chunk} rows one step can "
                              f"run (the program's prefill chunk); load with a larger max_chunk or lower --parallel")
        self.forward = fwd
        self.n_ctx = fwd.n_ctx
        self.n_slots = int(n)
        self.state_floats = int(fwd.state_floats)
        # KV for every slot, planned now: (slots, state_floats) float32
        self.slots = fwd.slots(n) if isinstance(slots, int) else list(slots)
        self.prompt_cache = prompt_cache
        self.prefill_chunk = int(min(prefill_chunk or fwd.max_chunk, fwd.max_chunk))
        # prompts sharing whole blocks of leading tokens restore them instead of running them
        # again (cpullm.run.prefix_cache); off with prefix_cache_bytes=0
        block = int(prefix_block or math.gcd(self.prefill_chunk, DEFAULT_PREFIX_BLOCK))
        if not 0 < block <= self.prefill_chunk or self.prefill_chunk % block:
            raise ConfigError(f"the prefix block ({block} tokens) must divide the prefill chunk "
                              f"({self.prefill_chunk} tokens); give a divisor of it")
        self.prefix_cache = PrefixCache(fwd.program.meta["state_regions"], block, prefix_cache_bytes)
        self.prefilled_tokens = 0       # prompt tokens run through the model (not restored)
        self.free = list(range(self.n_slots - 1, -1, -1))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._prefill_turn = 0
        self._lock = threading.Lock()
        self.steps = 0
        self.spec = speculative if speculative is not None and speculative.on else None
        self.spec_stats = SpecStats()       # every sequence's, summed (bench, /health)
        self.plain_pass_s = self.verify_pass_s = None   # recent decode passes' seconds (auto's draft choice)
        self._step_compiled = False         # the batched step is compiled (_verify_ready)
        if self.spec is not None and self.spec.draft is not None:
            self.spec.draft.attach(self.n_slots)

    def warm_up(self) -> None:
        """Compile (or load from numba's cache) the batched decode's kernels now, with a 2-row step
        on the first slots, rather than in the first step that batches two requests (a server
        would stall its streams for it). The rows written are overwritten before they are read:
        a sequence writes each position before attending to it, and admission zeroes its
        recurrent state."""
        n = min(2, self.n_slots)
        slots = self.slots[:n]
        self.forward.step(slots, [0] * n)
        for s in slots:
            s.position = 0

    # ---- capacity --------------------------------------------------------------------------
    @property
    def slot_bytes(self) -> int:
        return self.state_floats * 4

    @property
    def kv_bytes(self) -> int:
        """Bytes of sequence state planned for all slots (allocated at construction)."""
        return self.n_slots * self.slot_bytes

    # ---- requests ----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> Sequence:
        """Queue ``seq`` (thread-safe). A prompt longer than the context raises
        ContextOverflowError here, before it waits."""
        seq.check_fits(self.n_ctx)
        with self._lock:
            seq.phase = WAITING
            self.waiting.append(seq)
        return seq

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    def counts(self) -> dict:
        with self._lock:
            return {"waiting": len(self.waiting), "running": len(self.running),
                    "free_slots": len(self.free)}

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> list[tuple[Sequence, int | None]]:
        """Advance every sequence by one unit of work. Returns the (sequence, token) pairs emitted
        this step, and (sequence, None) once for every sequence that ended (EOS, length, cancel)."""
        events: list[tuple[Sequence, int | None]] = []
        self._drop_cancelled(events)
        self._admit()
        self._prefill_one(events)
        self._decode_all(events)
        for seq in [s for s in self.running if s.done]:
            self._release(seq)
            events.append((seq, None))
        self.steps += 1
        return events

    def _drop_cancelled(self, events):
        with self._lock:
            gone = [s for s in self.waiting if s.cancelled]
            for s in gone:
                self.waiting.remove(s)
        for s in gone:
            s.finish("cancelled")
            events.append((s, None))
        for s in [s for s in self.running if s.cancelled]:
            s.finish("cancelled")
            self._release(s)
            events.append((s, None))

    def _admit(self):
        admitted = []
        with self._lock:
            while self.free and self.waiting:
                seq = self.waiting.popleft()
                seq.slot = self.slots[self.free.pop()]
                admitted.append(seq)
        for seq in admitted:             # (outside the lock: submitters do not wait for the zeroing)
            self.forward.reset(seq.slot)
            seq.reused = 0
            if self.prompt_cache is not None:
                self._restore_prompt(seq)
            seq.phase = PREFILL
            self.running.append(seq)

    def _release(self, seq: Sequence):
        if seq in self.running:
            self.running.remove(seq)
        if seq.spec is not None and self.spec is not None and self.spec.draft is not None:
            self.spec.draft.give_back(seq.spec)
        slot = seq.leave_slot()
        if slot is not None:
            with self._lock:
                self.free.append(slot.index)

    def _restore_prompt(self, seq: Sequence) -> None:
        """Restore the leading prompt tokens the prompt cache holds into ``seq``'s fresh slot."""
        got = self.prompt_cache.start(self.forward, seq.slot, seq.prompt)
        seq.reused = got
        seq.stats.reused_tokens = got

    def _prefill_one(self, events):
        reading = [s for s in self.running if s.phase == PREFILL]
        if not reading:
            return
        seq = reading[self._prefill_turn % len(reading)]
        self._prefill_turn += 1
        slot = seq.slot
        # the longest cached prefix, if it is ahead of this sequence (cpullm.run.prefix_cache)
        got = self.prefix_cache.restore(seq.prompt, slot.state, slot.position, salt=seq.cache_salt)
        if got > slot.position:
            seq.reused += got - slot.position
            slot.position = got
            seq.stats.reused_tokens = seq.reused
        # chunks end on the grid of prefill_chunk: from position 0 the same chunks as ever; after a
        # prefix hit inside a chunk, the first one ends where that chunk would have; a prompt
        # cache that records the state at one position (split_at) ends a chunk there
        start = slot.position
        end = (start // self.prefill_chunk + 1) * self.prefill_chunk
        split = self.prompt_cache.split_at if self.prompt_cache is not None else None
        if split is not None and start < split < end:
            end = split
        ids = seq.prompt[start: end]
        t0, c0 = time.perf_counter(), compile_seconds()
        try:
            logits = self.forward.prefill(slot, ids)
        except CpullmError as exc:              # this prompt's own fault: it alone fails
            seq.fail(exc)
            return
        self.prefilled_tokens += len(ids)
        self.prefix_cache.record(seq.prompt, start, slot.position, slot.state, salt=seq.cache_salt)
        if split is not None and slot.position == split:
            self.prompt_cache.snapshot_split(slot)
        compiled = compile_seconds() - c0
        seq.stats.prefill_s += max(0.0, time.perf_counter() - t0 - compiled)
        seq.stats.compile_s += compiled
        if slot.position == len(seq.prompt):
            self._take(seq, events, logits=logits)

    def _decode_all(self, events):
        batch = [s for s in self.running if s.phase == DECODE and s.pending is not None]
        if not batch:
            return
        drafts = self._drafts(batch) if self.spec is not None and self._verify_ready(batch) else None
        if drafts is not None and any(drafts):
            self._verify_all(batch, drafts, events)
            return
        masks = start_masks(batch)        # constrained rows' next masks, beside the forward pass
        t0, c0 = time.perf_counter(), compile_seconds()
        # one pass over the weights for every row; a row that only needs its argmax (plain
        # greedy, or a constrained greedy one whose mask allows it) gets just the token (a lone
        # one may read the lm_head through its screen; its full logits only if the mask refuses)
        # a lone plain sampled row may be drawn through the screen too (the same token)
        draws = ([s.screen_draw(self.forward.vocab) for s in batch]
                 if len(batch) == 1 and self.forward.lone_path_identical else None)
        try:
            logits, tokens = self.forward.step([s.slot for s in batch], [s.pending for s in batch],
                                               greedy=[s.argmax_first for s in batch], draws=draws)
        except SamplingError as exc:            # a lone row's draw refused its logits: it alone fails
            if draws is None or draws[0] is None:
                raise
            batch[0].fail(exc)
            masks.join()
            return
        compiled = compile_seconds() - c0
        dt = max(0.0, time.perf_counter() - t0 - compiled)
        self.plain_pass_s = _recent(self.plain_pass_s, dt)
        masks.join()
        for seq, row, tok in zip(batch, logits, tokens):
            seq.stats.decode_s += dt
            seq.stats.decode_steps += 1
            seq.stats.compile_s += compiled
            self._take(seq, events, logits=row, token=tok,
                       full_logits=lambda s=seq.slot: self.forward.lone_logits(s))

    # ---- speculation ---------------------------------------------------------------------------
    def _verify_ready(self, batch: list[Sequence]) -> bool:
        """Whether this step may verify guesses: always, unless the config asks to compile the
        batched step first (SpecConfig.compile_first) and a lone sequence would wait for it."""
        if not self.spec.compile_first or self._step_compiled or len(batch) > 1:
            return True
        decoder, states = self.forward.decoder, batch[0].slot.table
        if decoder.compiled(states):
            self._step_compiled = True
            return True
        decoder.compile_in_background(states)
        return False

    def _drafts(self, batch: list[Sequence]) -> list[list[int]]:
        """Each sequence's guesses of its next tokens (maybe none), within its pacing, its
        remaining tokens and context, and the rows one pass can run."""
        cfg = self.spec
        rows_left = self.forward.max_chunk - len(batch)      # the rows one pass runs (BatchDecoder.max_rows)
        want = []
        for seq in batch:
            if seq.spec is None:
                seq.spec = SeqSpec(cfg, self.forward.guess_row_cost)
            room = min(seq.max_new_tokens - len(seq.generated) - 1, self.n_ctx - seq.slot.position - 1)
            want.append(max(0, min(seq.spec.pacer.budget(), room)) if room > 0 else 0)
        drafts = [seq.spec.lookup(seq.history, k) if k else [] for seq, k in zip(batch, want)]
        draft = cfg.draft
        for seq in batch:
            seq.spec.from_draft = False
        if draft is not None and cfg.mode in ("draft", "auto"):
            need = [i for i, (d, k) in enumerate(zip(drafts, want)) if k and not d]
            if cfg.mode == "auto" and need and not draft.pays(self.plain_pass_s, self.verify_pass_s,
                                                              max(want[i] for i in need)):
                need = []                 # auto: a draft that does not pay is not used
            for i in need:
                draft.take_slot(batch[i].spec)
            got = draft.propose([batch[i].spec for i in need], [batch[i].history for i in need],
                                [want[i] for i in need])
            for i, g in zip(need, got):
                drafts[i] = g
                batch[i].spec.from_draft = bool(g)
        out = []
        for d in drafts:                  # the pass's rows: one per sequence, then the guesses
            d = d[:max(0, rows_left)]
            rows_left -= len(d)
            out.append(d)
        return out

    def _verify_all(self, batch: list[Sequence], drafts: list[list[int]], events) -> None:
        """One pass over the weights scoring every sequence's pending token and guesses; each
        sequence takes its rows in order until its token differs from the next guess (or it
        ends), and its state is cut back to the rows it took."""
        masks = start_masks(batch)
        t0, c0 = time.perf_counter(), compile_seconds()
        inputs = [[s.pending] + d for s, d in zip(batch, drafts)]
        slots = [s.slot for s in batch]
        # every row greedy: only the argmaxes (the lm_head maybe through the head screen)
        argmax_only = all(s.greedy for s in batch)
        rows, snaps = (self.forward.verify_argmax if argmax_only else self.forward.verify)(slots, inputs)
        compiled = compile_seconds() - c0
        dt = max(0.0, time.perf_counter() - t0 - compiled)
        self.verify_pass_s = _recent(self.verify_pass_s, dt)
        masks.join()
        kept_lists = []
        for seq, out, toks, guesses, (pos0, _) in zip(batch, rows, inputs, drafts, snaps):
            kept = accepted = 0
            for i in range(len(toks)):
                seq.slot.position = pos0 + i + 1
                if argmax_only:
                    tok = self._take(seq, events, token=int(out[i]))
                elif seq.greedy:
                    tok = self._take(seq, events, token=int(np.argmax(out[i])))
                else:
                    tok = self._take(seq, events, logits=out[i])
                kept = i + 1
                hit = i < len(guesses) and tok == guesses[i]
                accepted += hit
                if seq.done or not hit:
                    break
            seq.slot.position = pos0 + len(toks)
            kept_lists.append(toks if seq.done else toks[:kept])
            seq.stats.decode_s += dt
            seq.stats.decode_steps += kept
            seq.stats.compile_s += compiled
            if guesses:
                seq.spec.pacer.record(len(guesses), accepted)
                if seq.spec.from_draft:
                    self.spec.draft.scored(len(guesses), accepted)
                for st in (seq.spec.stats, self.spec_stats):
                    st.verify_passes += 1
                    st.drafted += len(guesses)
                    st.accepted += accepted
                seq.stats.spec_passes = seq.spec.stats.verify_passes
                seq.stats.spec_drafted = seq.spec.stats.drafted
                seq.stats.spec_accepted = seq.spec.stats.accepted
        self.forward.rewind(slots, snaps, kept_lists)

    def _take(self, seq: Sequence, events, **output) -> int | None:
        """Give ``seq`` its model output; a failure of its own (a SamplingError on non-finite
        logits) ends it alone, with the error for its consumer, and never the batch. Returns the
        token emitted (None: none)."""
        try:
            tok = seq.take(self.n_ctx, **output)
        except CpullmError as exc:
            seq.fail(exc)
            return None
        if tok is not None:
            events.append((seq, tok))
        return tok

    def run_until_idle(self, on_event=None) -> None:
        """Step until every sequence added so far has ended."""
        while not self.idle:
            for ev in self.step():
                if on_event is not None:
                    on_event(*ev)


def _recent(avg: float | None, seconds: float, weight: float = 0.25) -> float:
    """An exponential moving average of pass times (the last passes count most)."""
    return seconds if avg is None else (1.0 - weight) * avg + weight * seconds
