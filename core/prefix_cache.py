"""Prefix sharing for the scheduler: requests that start with the same tokens (a shared system
prompt) restore the state of that prefix instead of prefilling it again.

The cache works in blocks of ``block`` tokens, the scheduler's prefill chunk: a sequence's
prefill chunks start at multiples of ``block`` (position 0, then every chunk is full but the
last), so when a chunk ends at position ``p = k * block`` the sequence's slot holds exactly the
state after ``prompt[:p]``. The cache then records block ``k`` of that prefix, keyed by the
tokens ``prompt[:p]`` themselves (a dict key: equal prefixes only, no hash collisions):

* full-attention KV regions (position q in row q, never overwritten): only the keys and values
  of the block's own positions ``[p - block, p)``; the earlier ones are in blocks 1..k-1;
* every other region (a sliding-window ring, a linear-attention recurrent state): a copy of the
  whole region, since their state after ``p`` tokens cannot be rebuilt from anything else.

A new sequence whose prompt starts with blocks 1..k (and has at least one token more: the last
prompt token's logits give its first token) gets them written into its slot and starts its
prefill at ``k * block``. Its following chunks are the ones it would have run without the hit
(the same grid), on the same state, so its tokens are the same, bit for bit (batch invariance;
tests/test_prefix_cache.py checks it in f32 and int8, with sliding-window and linear-attention
layers).

Memory is bounded: entries are evicted least recently used past ``budget_bytes`` (a restore
touches blocks 1..k in order, so a prefix's later blocks outlive its earlier ones only briefly;
a lookup stops at the first missing block). The core names no layer by family: what decides how
a region is saved is its kind and window in ``program.meta["state_regions"]``.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from .kernels.attention import TILE, kv_views


def _full_kv(reg: dict) -> bool:
    return reg["kind"] == "kv" and not reg.get("window")


def read_positions(state: np.ndarray, reg: dict, lo: int, hi: int) -> np.ndarray:
    """Keys and values of positions [lo, hi) of a full-attention region of ``state`` (a slot):
    (2, n_kv_heads, hi - lo, head_dim), a copy."""
    k, v = kv_views(state[reg["offset"]: reg["offset"] + reg["floats"]], reg["n_kv_heads"], reg["cap"],
                    reg["head_dim"])
    rows = np.arange(lo, hi)
    keys = k[:, rows // TILE, :, rows % TILE]            # (n, n_kv, head_dim)
    return np.stack([keys.transpose(1, 0, 2), v[:, rows, :]])


def write_positions(state: np.ndarray, reg: dict, lo: int, kv: np.ndarray) -> None:
    """Put keys and values (2, n_kv_heads, n, head_dim) of positions [lo, lo + n) into ``state``."""
    k, v = kv_views(state[reg["offset"]: reg["offset"] + reg["floats"]], reg["n_kv_heads"], reg["cap"],
                    reg["head_dim"])
    rows = np.arange(lo, lo + kv.shape[2])
    k[:, rows // TILE, :, rows % TILE] = kv[0].transpose(1, 0, 2)
    v[:, rows, :] = kv[1]


class PrefixCache:
    """A bounded LRU of prefix blocks for one program's state layout (see the module docstring)."""

    def __init__(self, regions: list[dict], block: int, budget_bytes: int):
        if block < 1:
            raise ValueError("a prefix block holds at least one token")
        self.regions = list(regions)
        self.block = int(block)
        self.budget_bytes = max(0, int(budget_bytes))
        self.entries: OrderedDict[tuple, list[np.ndarray]] = OrderedDict()   # prefix -> arrays per region
        self.bytes = 0
        self.hits = 0                    # sequences that restored at least one block
        self.misses = 0                  # sequences that restored none
        self.reused_tokens = 0           # prompt tokens restored rather than prefilled
        self.stored_blocks = 0
        self.evicted_blocks = 0

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def block_bytes(self) -> int:
        """Bytes one block takes (the same for every block of this layout)."""
        n = 0
        for reg in self.regions:
            n += (2 * reg["n_kv_heads"] * self.block * reg["head_dim"] if _full_kv(reg) else reg["floats"]) * 4
        return n

    # ---- lookup and restore -------------------------------------------------------------------
    def restore(self, prompt: list[int], state: np.ndarray) -> int:
        """Write the longest cached prefix of ``prompt`` (whole blocks, shorter than the prompt)
        into slot ``state``; returns its length in tokens (0: nothing cached)."""
        if not self.enabled:
            return 0
        found: list[list[np.ndarray]] = []
        p = self.block
        while p < len(prompt):
            arrays = self.entries.get(tuple(prompt[:p]))
            if arrays is None:
                break
            found.append(arrays)
            p += self.block
        if not found:
            self.misses += 1
            return 0
        n = len(found) * self.block
        for k, arrays in enumerate(found):
            self.entries.move_to_end(tuple(prompt[:(k + 1) * self.block]))
            for reg, arr in zip(self.regions, arrays):
                if _full_kv(reg):
                    write_positions(state, reg, k * self.block, arr)
        for reg, arr in zip(self.regions, found[-1]):
            if not _full_kv(reg):
                state[reg["offset"]: reg["offset"] + reg["floats"]] = arr
        self.hits += 1
        self.reused_tokens += n
        return n

    # ---- recording ------------------------------------------------------------------------------
    def record(self, prompt: list[int], position: int, state: np.ndarray) -> None:
        """Called after a prefill chunk leaves slot ``state`` at ``position`` of ``prompt``: keep
        the block that ends there, if it is a whole block not cached yet and fits the budget."""
        if not self.enabled or position % self.block or position == 0 or position > len(prompt):
            return
        key = tuple(prompt[:position])
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        size = self.block_bytes()
        if size > self.budget_bytes:
            return
        arrays = []
        for reg in self.regions:
            if _full_kv(reg):
                arrays.append(read_positions(state, reg, position - self.block, position))
            else:
                arrays.append(state[reg["offset"]: reg["offset"] + reg["floats"]].copy())
        while self.bytes + size > self.budget_bytes and self.entries:
            _, old = self.entries.popitem(last=False)
            self.bytes -= sum(a.nbytes for a in old)
            self.evicted_blocks += 1
        self.entries[key] = arrays
        self.bytes += sum(a.nbytes for a in arrays)
        self.stored_blocks += 1

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0

    def stats(self) -> dict:
        return {"block_tokens": self.block, "budget_bytes": self.budget_bytes, "bytes": self.bytes,
                "blocks": len(self.entries), "hits": self.hits, "misses": self.misses,
                "reused_tokens": self.reused_tokens, "evicted_blocks": self.evicted_blocks}
