"""Token sampling: greedy, temperature, top-k, top-p, min-p, repetition penalty, seed.

The order follows transformers' logits processors: repetition penalty, temperature, top-k,
top-p, min-p, then a draw. ``temperature == 0`` is greedy (argmax, first index on ties).
"""
from __future__ import annotations

import attrs
import numpy as np

from .errors import SamplingError


@attrs.define
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0              # 0 = off
    top_p: float = 1.0          # 1 = off
    min_p: float = 0.0          # 0 = off
    repetition_penalty: float = 1.0
    seed: int | None = None

    def validate(self) -> "SamplingParams":
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise SamplingError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p < 1.0):
            raise SamplingError(f"min_p must be in [0, 1), got {self.min_p}")
        if not (self.repetition_penalty > 0.0):
            raise SamplingError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        return self


class Sampler:
    def __init__(self, params: SamplingParams):
        self.p = params.validate()
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray, history=()) -> int:
        p = self.p
        x = np.array(logits, dtype=np.float64)
        if p.repetition_penalty != 1.0 and len(history):
            ids = np.unique(np.asarray(history, dtype=np.int64))
            ids = ids[ids < x.size]
            v = x[ids]
            x[ids] = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if p.temperature == 0.0:
            return int(np.argmax(x))
        x = x / p.temperature
        if p.top_k and p.top_k < x.size:
            kth = np.partition(x, -p.top_k)[-p.top_k]
            x = np.where(x < kth, -np.inf, x)
        probs = _softmax(x)
        if p.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cum = np.cumsum(probs[order])
            cut = np.searchsorted(cum, p.top_p) + 1      # keep the smallest set reaching top_p
            mask = np.zeros_like(probs, dtype=bool)
            mask[order[:cut]] = True
            probs = np.where(mask, probs, 0.0)
        if p.min_p > 0.0:
            probs = np.where(probs >= p.min_p * probs.max(), probs, 0.0)
        probs /= probs.sum()
        return int(self.rng.choice(probs.size, p=probs))


def _softmax(x: np.ndarray) -> np.ndarray:
    m = np.max(x[np.isfinite(x)]) if np.isfinite(x).any() else 0.0
    e = np.exp(x - m)
    return e / e.sum()
