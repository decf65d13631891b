"""The one forward path: :class:`Forward` runs tokens of sequences whose state it is handed, each
sequence's state and position held by a :class:`Slot`.

    fwd = model.forward
    slot = fwd.new_slot()                    # a fresh sequence (position 0)
    logits = fwd.prefill(slot, prompt_ids)   # (vocab,) for the last prompt token; slot.position advances
    rows = fwd.step([slot], [token])         # one token of each slot in one pass over the weights

A slot is one row of a (slots, state_floats) float32 table laid out as the program's
``state_regions`` (KV caches, sliding-window rings, linear-attention states); slots made together
(:meth:`Forward.slots`) share one table, so one step decodes them in one pass over the weights
(:class:`cpullm.batch.BatchDecoder`). Nothing about a sequence lives in the Forward: the same
object serves a lone ``generate`` (a scheduler of one slot), the scheduler's batches, the server
and the benchmarks.

``threads`` travels with the Forward: numba keeps its thread count per Python thread, so every
call sets it on the thread that makes the call (the scheduler's, a chat's answer thread, the
caller's own) before any kernel runs.
"""
from __future__ import annotations

import numba
import numpy as np

from .errors import ContextOverflowError
from .executor import Executor, lazy_zeros
from .kernels import program_table as P
from . import kvformat


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
        cpullm.kvformat.read_positions). The caller makes sure the region still holds them
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
        self._decoder = None
        # a lone row may take the executor's one-token decode (compiled as one call; greedy
        # through the lm_head screen) when every LINEAR is q8 or raw ggml blocks, whose one
        # kernel gives a batched row the same numbers; f32 matrices sum in another order
        self.lone_path_identical = executor.linear_kinds() <= {P.WEIGHT_Q8, P.WEIGHT_BLOCKS}

    # ---- threads -----------------------------------------------------------------------------
    def use_threads(self) -> None:
        """Set numba's thread count for the calling thread to this Forward's (a no-op when set)."""
        if numba.get_num_threads() != self.threads:
            numba.set_num_threads(self.threads)

    # ---- slots -------------------------------------------------------------------------------
    def slots(self, n: int) -> list[Slot]:
        """``n`` fresh slots sharing one (n, state_floats) table, planned now (the scheduler's)."""
        table = np.zeros((int(n), self.state_floats), np.float32)
        return [Slot(table, i) for i in range(int(n))]

    def new_slot(self) -> Slot:
        """One fresh slot whose memory is resident only where written (a lone sequence at a long
        context touches only the KV rows it fills: :func:`cpullm.executor.lazy_zeros`)."""
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

    def step(self, slots: list[Slot], tokens, greedy=None) -> tuple[list, list]:
        """One token of every slot (``tokens[b]`` at ``slots[b].position``) in one pass over the
        weights; every position advances by one. ``greedy[b]`` True: only row b's argmax is
        needed (a lone greedy row may read the lm_head through its screen). Returns (logits,
        tokens): per row, float32 logits (vocab,) or None, and the greedy token or None."""
        self.use_threads()
        B = len(slots)
        greedy = [False] * B if greedy is None else [bool(g) for g in greedy]
        if B == 1 and self.lone_path_identical:
            # one row: the executor's one-token decode, the same numbers as a batched row
            s = slots[0]
            if greedy[0]:
                rows = [None], [self.executor.decode_argmax(s.state, s.position, int(tokens[0]))]
            else:
                rows = [self.executor.decode(s.state, s.position, int(tokens[0])).copy()], [None]
        else:
            table = slots[0].table
            if any(s.table is not table for s in slots):
                raise ValueError("a step decodes slots of one table (made by one Forward.slots call)")
            logits = self.decoder.decode(table, [s.index for s in slots], [s.position for s in slots],
                                         [int(t) for t in tokens])
            rows = ([None if g else logits[b] for b, g in enumerate(greedy)],
                    [int(np.argmax(logits[b])) if g else None for b, g in enumerate(greedy)])
        for s in slots:
            s.position += 1
        return rows

    @property
    def decoder(self):
        """The batched decode step (:class:`cpullm.batch.BatchDecoder`), made on first use: its
        activation scratch is sized for max_chunk rows."""
        if self._decoder is None:
            from .batch import BatchDecoder
            self._decoder = BatchDecoder(self.executor)
        return self._decoder


    def logits(self, ids) -> np.ndarray:
        """float32 (T, vocab): logits at every position of ``ids`` run as a fresh sequence."""
        return self.prefill(self.new_slot(), ids, all_logits=True)
