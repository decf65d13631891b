"""The one forward path: :class:`Forward` runs tokens of sequences whose state it is handed, each
sequence's state and position held by a :class:`Slot`.

    fwd = model.forward
    slot = fwd.new_slot()                    # a fresh sequence (position 0)
    logits = fwd.prefill(slot, prompt_ids)   # (vocab,) for the last prompt token; slot.position advances
    rows = fwd.step([slot], [token])         # one token of each slot in one pass over the weights

A slot is one row of a (slots, state_floats) float32 table laid out as the program's
``state_regions`` (KV caches, sliding-window rings, linear-attention states); slots made together
(:meth:`Forward.slots`) share one table, so one step decodes them in one pass over the weights
(:class:`cpullm.run.batch.BatchDecoder`). Nothing about a sequence lives in the Forward: the same
object serves a lone ``generate`` (a scheduler of one slot), the scheduler's batches, the server
and the benchmarks.

``threads`` travels with the Forward: numba keeps its thread count per Python thread, so every
call sets it on the thread that makes the call (the scheduler's, a chat's answer thread, the
caller's own) before any kernel runs.
"""
from __future__ import annotations

import numba
import numpy as np

from ..errors import ContextOverflowError
from .executor import Executor, lazy_zeros
from cpullm_kernels.program.formats import weight_format
from ..compile import kvformat
from ..compile.aligned import aligned_zeros


class Slot:
    """One sequence's state: ``state`` (state_floats,) float32, row ``index`` of ``table``
    (slots, state_floats), and ``position``, the tokens whose keys, values and recurrent state
    it holds (the next token runs at this position)."""

    __slots__ = ("table", "index", "state", "position")

    def __init__(self, table: np.ndarray, index: int, position: int = 0):
        self.table, self.index = table, int(index)
        self.state = table[self.index]
        self.position = int(position)

    # ---- the state's regions (program.meta["state_regions"] entries) ---------------------------
    def region(self, reg: dict) -> np.ndarray:
        """The flat float32 view (floats,) of one state region."""
        return self.state[reg["offset"]: reg["offset"] + reg["floats"]]

    def read_kv(self, reg: dict, lo: int, hi: int) -> np.ndarray:
        """A copy of the keys and values of positions [lo, hi): (2, n_kv_heads, hi - lo, head_dim),
        in the region's format (float16 or float32; q8_0: int8 rows with their scales, see
        cpullm.compile.kvformat.read_positions). The caller makes sure the region still holds them
        (hi - lo <= cap, hi <= position)."""
        return kvformat.read_positions(self.region(reg), reg, lo, hi)

    def write_kv(self, reg: dict, lo: int, kv: np.ndarray) -> None:
        """Put keys and values of positions [lo, lo + n), as :meth:`read_kv` returns them, into
        their ring slots (rounded to nearest even when the region stores float16)."""
        kvformat.write_positions(self.region(reg), reg, lo, kv)


class Forward:
    """Prefill and decode steps of one compiled program over slots the caller owns."""

    def __init__(self, executor: Executor, threads: int):
        self.executor = executor
        self.threads = int(threads)
        self.program = executor.program
        self.n_ctx = executor.n_ctx
        self.max_chunk = executor.max_chunk
        self.vocab = executor.vocab
        self.state_floats = executor.state_floats
        self.linear_regions = [(r["offset"], r["floats"]) for r in self.program.meta["state_regions"]
                               if r["kind"] == "linear"]
        self._snapshots: dict[int, np.ndarray] = {}     # slot index -> its recurrent state before a pass
        self._decoder = None
        # a lone row may take the executor's one-token decode (compiled as one call; greedy
        # through the lm_head screen) when every LINEAR's format gives a batched row the same
        # numbers (q8, raw ggml blocks: one kernel); f32 matrices sum in another order
        self.lone_path_identical = all(weight_format(k).decode_exact for k in executor.linear_kinds())
        # what one more row of a verify pass costs, in decode steps: the bytes a pass reads again
        # for each row (the step itself is bound by reading its bytes once)
        self.guess_row_cost = executor.row_at_a_time_share()

    # ---- threads -----------------------------------------------------------------------------
    def use_threads(self) -> None:
        """Set numba's thread count for the calling thread to this Forward's (a no-op when set)."""
        if numba.get_num_threads() != self.threads:
            numba.set_num_threads(self.threads)

    # ---- slots -------------------------------------------------------------------------------
    def slots(self, n: int) -> list[Slot]:
        """``n`` fresh slots sharing one (n, state_floats) table, planned now (the scheduler's)."""
        table = aligned_zeros((int(n), self.state_floats))
        return [Slot(table, i) for i in range(int(n))]

    def new_slot(self) -> Slot:
        """One fresh slot whose memory is resident only where written (a lone sequence at a long
        context touches only the KV rows it fills: :func:`cpullm.run.executor.lazy_zeros`)."""
        return Slot(lazy_zeros(self.state_floats).reshape(1, self.state_floats), 0)

    def reset(self, slot: Slot) -> None:
        """Start a new sequence in ``slot``: position 0, recurrent (linear-attention) state zeroed;
        KV rows need no clearing, a sequence writes each position before attending to it."""
        for off, n in self.linear_regions:
            slot.state[off: off + n] = 0.0
        slot.position = 0

    def set_position(self, slot: Slot, position: int) -> None:
        """Continue ``slot``'s sequence after ``position`` tokens whose state was restored."""
        if not 0 <= position <= self.n_ctx:
            raise ContextOverflowError(f"position {position} is outside the context of {self.n_ctx}")
        slot.position = int(position)

    # ---- running -----------------------------------------------------------------------------
    def prefill(self, slot: Slot, ids, all_logits: bool = False) -> np.ndarray:
        """Run ``ids`` after ``slot``'s tokens (in chunks of max_chunk) and advance its position.
        Returns float32 logits (T, vocab) if ``all_logits`` else (vocab,) of the last token."""
        self.use_threads()
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        out = self.executor.prefill(slot.state, slot.position, ids, all_logits)
        slot.position += int(ids.size)
        return out

    def prefill_hidden(self, ids, slot: Slot | None = None) -> np.ndarray:
        """float32 (T, hidden): the final-norm hidden states (the lm_head's input) of ``ids`` run
        after ``slot``'s tokens (default: a fresh slot); embeddings pool them."""
        self.use_threads()
        slot = slot if slot is not None else self.new_slot()
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        out = self.executor.prefill_hidden(slot.state, slot.position, ids)
        slot.position += int(ids.size)
        return out

    def step(self, slots: list[Slot], tokens, greedy=None, draws=None) -> tuple[list, list]:
        """One token of every slot (``tokens[b]`` at ``slots[b].position``) in one pass over the
        weights; every position advances by one. ``greedy[b]`` True: row b's argmax is wanted
        (a lone greedy row may read the lm_head through its screen; :meth:`lone_logits` gives
        its full logits after all if needed). ``draws[b]``: None, or (cuts, draw) for a row
        sampled without anything else reading its logits: a lone one may be drawn through the
        screen (:meth:`cpullm.run.executor.Executor.decode_sample`; ``draw(logits)`` otherwise).
        Returns (logits, tokens): per row, float32 logits (vocab,) (None for a lone greedy or
        drawn row), and the greedy or drawn token or None."""
        self.use_threads()
        B = len(slots)
        greedy = [False] * B if greedy is None else [bool(g) for g in greedy]
        if B == 1 and self.lone_path_identical:
            # one row: the executor's one-token decode, the same numbers as a batched row
            s = slots[0]
            if greedy[0]:
                rows = [None], [self.executor.decode_argmax(s.state, s.position, int(tokens[0]))]
            elif draws is not None and draws[0] is not None:
                cuts, draw = draws[0]
                rows = [None], [self.executor.decode_sample(s.state, s.position, int(tokens[0]), cuts, draw)]
            else:
                rows = [self.executor.decode(s.state, s.position, int(tokens[0])).copy()], [None]
        else:
            table = slots[0].table
            if any(s.table is not table for s in slots):
                raise ValueError("a step decodes slots of one table (made by one Forward.slots call)")
            logits = self.decoder.decode(table, [s.index for s in slots], [s.position for s in slots],
                                         [int(t) for t in tokens])
            rows = ([logits[b] for b in range(B)],
                    [int(np.argmax(logits[b])) if g else None for b, g in enumerate(greedy)])
        for s in slots:
            s.position += 1
        return rows

    def verify(self, slots: list[Slot], token_lists) -> tuple[list[np.ndarray], list]:
        """Score several tokens of each slot in one pass over the weights: ``token_lists[b]``
        (n_b >= 1 tokens) run at positions ``slots[b].position``, ``+1``, ... Returns (logits,
        snapshots): per slot float32 logits (n_b, vocab), row t for the input after its token t,
        and what :meth:`rewind` needs to keep only a prefix of the tokens (valid until the next
        verify pass of the same slot index). Every position advances by n_b.

        Exact by construction: every token is one row of the batched decode step
        (:class:`cpullm.run.batch.BatchDecoder`) with its slot and its own position, so it gets the
        one-token decode's numbers: the rows of a slot are in order, each writes its keys and
        values before any row attends (positions after a row are never read by it), and the
        recurrent (linear-attention) ops run row after row on the slot's state. The logits of
        token t are those of t one-token steps (the lone decode's where it is the batched
        row's: ``lone_path_identical``; f32 always decodes through the batch)."""
        return self._verify(slots, token_lists, self.decoder.decode)

    def verify_argmax(self, slots: list[Slot], token_lists) -> tuple[list[np.ndarray], list]:
        """:meth:`verify` for greedy rows: per slot int64 (n_b,) the argmax of each row's logits
        (lowest index on ties) instead of the logits, the lm_head maybe read through the head
        screen (:meth:`cpullm.run.batch.BatchDecoder.decode_argmax`: the same tokens)."""
        return self._verify(slots, token_lists, self.decoder.decode_argmax)

    def _verify(self, slots: list[Slot], token_lists, run) -> tuple[list[np.ndarray], list]:
        self.use_threads()
        table = slots[0].table
        if any(s.table is not table for s in slots):
            raise ValueError("a verify pass runs slots of one table (made by one Forward.slots call)")
        counts = [len(t) for t in token_lists]
        if min(counts) < 1 or sum(counts) > self.decoder.max_rows:
            raise ValueError(f"a verify pass runs 1..{self.decoder.max_rows} rows, at least one per slot; "
                             f"got {counts}")
        rows_slot, rows_pos, rows_tok = [], [], []
        for s, toks in zip(slots, token_lists):
            if s.position + len(toks) > self.n_ctx:
                raise ContextOverflowError(f"{len(toks)} tokens at position {s.position} pass the context "
                                           f"of {self.n_ctx}")
            rows_slot += [s.index] * len(toks)
            rows_pos += range(s.position, s.position + len(toks))
            rows_tok += [int(t) for t in toks]
        # the recurrent state before the pass: it cannot be cut back by position (rewind)
        snaps = [self._linear_snapshot(s) if n > 1 else None for s, n in zip(slots, counts)]
        logits = run(table, rows_slot, rows_pos, rows_tok)
        out, r = [], 0
        for s, n in zip(slots, counts):
            out.append(logits[r: r + n])
            r += n
            s.position += n
        return out, [(s.position - n, snap) for s, n, snap in zip(slots, counts, snaps)]

    def _linear_snapshot(self, slot: Slot):
        """The slot's recurrent state regions, copied into a buffer kept for its index: the next
        verify pass of that index reuses it (the scheduler rewinds before then). A fresh copy
        each pass took Qwen3.5-4B's 53 MB of state 22 ms to copy into new pages, an eighth of a
        5-row verify pass."""
        if not self.linear_regions:
            return None
        total = sum(n for _, n in self.linear_regions)
        buf = self._snapshots.get(slot.index)
        if buf is None:
            buf = self._snapshots[slot.index] = np.empty(total, np.float32)
        out, at = [], 0
        for off, n in self.linear_regions:
            np.copyto(buf[at: at + n], slot.state[off: off + n])
            out.append(buf[at: at + n])
            at += n
        return out

    def rewind(self, slots: list[Slot], snapshots: list, kept_lists) -> None:
        """Keep only the first tokens ``kept_lists[b]`` (a prefix of what :meth:`verify` ran) of
        each slot. Keys and values are cut by position (later rows are overwritten before any
        token reads them; a sliding-window ring holds window + max_chunk positions, so a pass of
        at most max_chunk rows never overwrote a position still in the window). A recurrent
        state cannot be cut: it is restored from the snapshot and the kept tokens run again, all
        slots in one pass, the same rows as before (so the same state, bit for bit)."""
        again = []
        for s, (pos0, snap), kept in zip(slots, snapshots, kept_lists):
            target = pos0 + len(kept)
            if target == s.position:
                continue
            s.position = target
            if snap is not None:
                for (off, n), saved in zip(self.linear_regions, snap):
                    s.state[off: off + n] = saved
                s.position = pos0
                again.append((s, kept))
        if again:
            self.verify_argmax([s for s, _ in again], [k for _, k in again])     # (the state is what counts)

    @property
    def decoder(self):
        """The batched decode step (:class:`cpullm.run.batch.BatchDecoder`), made on first use: its
        activation scratch is sized for max_chunk rows."""
        if self._decoder is None:
            from .batch import BatchDecoder
            self._decoder = BatchDecoder(self.executor)
        return self._decoder


    def lone_logits(self, slot: Slot) -> np.ndarray:
        """float32 (vocab,): the full logits of the lone greedy row :meth:`step` just ran on
        ``slot`` (whose argmax it returned, maybe through the lm_head screen); call it before the
        next step. A constrained greedy row needs them when the mask forbids that argmax."""
        return self.executor.last_step_logits(slot.state).copy()

    def logits(self, ids) -> np.ndarray:
        """float32 (T, vocab): logits at every position of ``ids`` run as a fresh sequence."""
        return self.prefill(self.new_slot(), ids, all_logits=True)
