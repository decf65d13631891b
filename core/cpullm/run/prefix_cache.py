"""Prefix sharing for the scheduler: requests that start with the same tokens (a shared system
prompt) restore the state of that prefix instead of prefilling it again.

The cache works in blocks of ``block`` tokens, a divisor of the scheduler's prefill chunk, so
every chunk starts and ends on a block boundary (but a prompt's last). After a chunk ran
positions [start, end) of a prompt, the cache records each whole block ending in (start, end],
keyed by the tokens ``prompt[:p]`` themselves (a dict key: equal prefixes only, no collisions):

* KV regions (position q in row q % cap; a full-attention region never wraps, a sliding-window
  ring has cap >= window + chunk, so it still holds every position of the chunk just run): the
  keys and values of the block's own positions ``[p - block, p)``; the earlier ones are in
  blocks 1..k-1, and a restore to ``p`` writes back the last ``cap`` positions, as the ring of a
  sequence that ran them holds them;
* every other region (a linear-attention recurrent state), only for the block ending at
  ``end``: a copy of the whole region. Its state after ``p`` tokens cannot be rebuilt from
  anything else, and the slot holds it only at the end of a chunk; so a model with such layers
  reuses prefixes that end where a chunk ended, one without at any block.

Before each prefill chunk of a sequence (its first, or a later one: a request admitted beside
another with the same prefix catches up with what that one recorded meanwhile), a prompt that
starts with cached blocks 1..k (and has at least one token more: the last prompt token's logits
give its first token) gets them written into its slot and goes on from ``k * block``, on exactly
the state its own prefill would have left there. Its tokens
are the same as without the hit (tests/test_prefix_cache.py: f32 and int8, full attention,
sliding-window and linear-attention layers, blocks equal to and smaller than the chunk), which
for a block inside a chunk relies on a prefill row not depending on the other rows of its chunk.

Memory is bounded: blocks are evicted least recently used past ``budget_bytes`` (a restore
touches blocks 1..k in order; a lookup stops at the first missing block). The core names no layer
by family: how a region is saved follows from its kind and window in
``program.meta["state_regions"]``.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from ..compile import kvformat


def _positional(reg: dict) -> bool:
    """A KV region: position q's keys and values sit in row q % cap (cap = the context for full
    attention, >= window + chunk for a sliding-window ring), so a block's positions can be saved
    and written back on their own."""
    return reg["kind"] == "kv"


def read_positions(state: np.ndarray, reg: dict, lo: int, hi: int) -> np.ndarray:
    """Keys and values of positions [lo, hi) of a KV region of ``state`` (a slot), which must
    still hold them (hi - lo <= cap): (2, n_kv_heads, hi - lo, head_dim), a copy in the region's
    format (float16 blocks take half the cache's memory, q8_0 ones about a quarter: int8 rows
    with their scales, cpullm.compile.kvformat.read_positions)."""
    return kvformat.read_positions(state[reg["offset"]: reg["offset"] + reg["floats"]], reg, lo, hi)


def write_positions(state: np.ndarray, reg: dict, lo: int, kv: np.ndarray) -> None:
    """Put keys and values of positions [lo, lo + n) as :func:`read_positions` returns them into ``state``."""
    kvformat.write_positions(state[reg["offset"]: reg["offset"] + reg["floats"]], reg, lo, kv)


class _Block:
    """One cached block: the full-attention KV of its positions (one array per full region) and,
    when the prefix ends at a chunk boundary, a copy of every other region (``snap``, None if not)."""
    __slots__ = ("kv", "snap")

    def __init__(self, kv: list, snap: list | None):
        self.kv, self.snap = kv, snap

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.kv) + (sum(a.nbytes for a in self.snap) if self.snap else 0)


class PrefixCache:
    """A bounded LRU of prefix blocks for one program's state layout (see the module docstring)."""

    def __init__(self, regions: list[dict], block: int, budget_bytes: int):
        if block < 1:
            raise ValueError("a prefix block holds at least one token")
        self.full = [r for r in regions if _positional(r)]
        self.other = [r for r in regions if not _positional(r)]
        self.block = int(block)
        self.budget_bytes = max(0, int(budget_bytes))
        self.entries: OrderedDict[tuple, _Block] = OrderedDict()     # prefix tokens -> its last block
        self.bytes = 0
        self.hits = 0                    # restores (a sequence may restore more between its chunks)
        self.misses = 0                  # sequences that found nothing before their first chunk
        self.reused_tokens = 0           # prompt tokens restored rather than prefilled
        self.stored_blocks = 0
        self.evicted_blocks = 0

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def block_bytes(self, snapshot: bool = True) -> int:
        """Bytes one block takes (with the other regions' copy, or without)."""
        n = sum(2 * r["n_kv_heads"] * self.block * r["head_dim"] for r in self.full)
        if snapshot:
            n += sum(r["floats"] for r in self.other)
        return n * 4

    # ---- lookup and restore -------------------------------------------------------------------
    @staticmethod
    def _key(prompt: list[int], p: int, salt: str | None) -> tuple:
        """The entry of ``prompt[:p]``; a ``salt`` (a tenant's) keeps its prefixes apart from
        every other salt's and the unsalted ones: a tenant can neither reuse nor time another's."""
        return tuple(prompt[:p]) if salt is None else (salt, *prompt[:p])

    def restore(self, prompt: list[int], state: np.ndarray, have: int = 0, salt: str | None = None) -> int:
        """Write the longest cached prefix of ``prompt`` (whole blocks, shorter than the prompt,
        ending where every region's state is known) into slot ``state``, which already holds the
        state after ``have`` tokens of it (a block boundary); returns the prefix's length, or
        ``have`` when the cache holds nothing longer. Only prefixes recorded with the same
        ``salt`` are found."""
        if not self.enabled:
            return have
        found: list[_Block] = []
        usable = 0                      # blocks 1..usable can be restored
        p = self.block
        while p < len(prompt):
            blk = self.entries.get(self._key(prompt, p, salt))
            if blk is None:
                break
            found.append(blk)
            if not self.other or blk.snap is not None:
                usable = len(found)
            p += self.block
        n = usable * self.block
        if n <= have:
            if have == 0:
                self.misses += 1
            return have
        for k, blk in enumerate(found[:usable]):
            self.entries.move_to_end(self._key(prompt, (k + 1) * self.block, salt))
            lo = k * self.block
            if lo + self.block <= have:          # already in the slot, the same numbers
                continue
            for reg, arr in zip(self.full, blk.kv):
                # a ring keeps only the last cap positions (older ones would be overwritten anyway)
                skip = max(0, n - reg["cap"] - lo)
                if skip < self.block:
                    write_positions(state, reg, lo + skip, arr[:, :, skip:])
        for reg, arr in zip(self.other, found[usable - 1].snap or ()):
            state[reg["offset"]: reg["offset"] + reg["floats"]] = arr
        self.hits += 1
        self.reused_tokens += n - have
        return n

    # ---- recording ------------------------------------------------------------------------------
    def record(self, prompt: list[int], start: int, end: int, state: np.ndarray, salt: str | None = None) -> None:
        """Called after a prefill chunk ran positions [start, end) of ``prompt`` on slot ``state``:
        keep the whole blocks that end in (start, end] and are not cached yet. Only the block
        ending at ``end`` gets the other regions' copy (their state at ``end`` is the slot's; at
        an earlier boundary it is gone)."""
        if not self.enabled:
            return
        first = (start // self.block + 1) * self.block
        # a block whose positions a ring no longer holds is not kept (the compiler's rings hold
        # window + chunk positions, so with chunks of at most the program's this never happens)
        held_from = max((end - r["cap"] for r in self.full), default=0)
        first = max(first, (max(0, held_from) + 2 * self.block - 1) // self.block * self.block)
        for p in range(first, min(end, len(prompt)) + 1, self.block):
            self._record_one(self._key(prompt, p, salt), p, state, with_snap=bool(self.other) and p == end)

    def _record_one(self, key: tuple, p: int, state: np.ndarray, with_snap: bool) -> None:
        blk = self.entries.get(key)
        if blk is not None:
            self.entries.move_to_end(key)
            if with_snap and blk.snap is None and self._make_room(self.block_bytes() - blk.nbytes, keep=key):
                blk.snap = [state[r["offset"]: r["offset"] + r["floats"]].copy() for r in self.other]
                self.bytes += sum(a.nbytes for a in blk.snap)
            return
        if not self._make_room(self.block_bytes(with_snap), keep=None):
            return
        kv = [read_positions(state, r, p - self.block, p) for r in self.full]
        snap = [state[r["offset"]: r["offset"] + r["floats"]].copy() for r in self.other] if with_snap else None
        blk = _Block(kv, snap)
        self.entries[key] = blk
        self.bytes += blk.nbytes
        self.stored_blocks += 1

    def _make_room(self, size: int, keep) -> bool:
        """Evict least recently used blocks (not ``keep``) until ``size`` more bytes fit."""
        if size > self.budget_bytes:
            return False
        while self.bytes + size > self.budget_bytes:
            victim = next((k for k in self.entries if k != keep), None)
            if victim is None:
                return False
            self.bytes -= self.entries.pop(victim).nbytes
            self.evicted_blocks += 1
        return True

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0

    def stats(self) -> dict:
        return {"block_tokens": self.block, "budget_bytes": self.budget_bytes, "bytes": self.bytes,
                "blocks": len(self.entries), "hits": self.hits, "misses": self.misses,
                "reused_tokens": self.reused_tokens, "evicted_blocks": self.evicted_blocks}
