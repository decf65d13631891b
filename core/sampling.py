"""Token sampling: greedy, temperature, top-k, top-p, min-p, repetition penalty, seed.

The order follows transformers' logits processors: repetition penalty, temperature, top-k,
top-p, min-p, then a draw. ``temperature == 0`` is greedy (argmax, first index on ties).
"""
from __future__ import annotations

import attrs
import numpy as np

from .errors import SamplingError


MIN_TEMPERATURE = 1e-3         # logits / T stays finite: 3.4e38 (float32 max) / 1e-3 fits float64
MAX_REPETITION_PENALTY = 1e3   # ... and so do penalized ones (x * 1e3, x / 1e-3)


def check_finite_logits(x: np.ndarray) -> None:
    """Refuse logits a distribution cannot come from: NaN or +inf anywhere, or nothing finite
    (-inf alone marks a token that may not be drawn). They come from a damaged model (a NaN in
    a weight row a prompt reaches), so the error names that, on one line."""
    finite = np.isfinite(x)
    if finite.all():                    # the usual case: one pass
        return
    if np.isnan(x).any() or np.isposinf(x).any() or not finite.any():
        raise SamplingError("the model produced non-finite logits (NaN or inf) for this sequence: its "
                            "weights are damaged where this prompt reaches them; try another model file")


@attrs.define
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0              # 0 = off
    top_p: float = 1.0          # 1 = off
    min_p: float = 0.0          # 0 = off
    repetition_penalty: float = 1.0
    seed: int | None = None

    def validate(self) -> "SamplingParams":
        """Refuse values out of range, and values in range that overflow the arithmetic: a
        temperature between 0 and MIN_TEMPERATURE (logits / T past float range), a repetition
        penalty outside [1 / MAX_REPETITION_PENALTY, MAX_REPETITION_PENALTY]."""
        t = self.temperature
        if not (t == 0.0 or MIN_TEMPERATURE <= t < float("inf")):
            raise SamplingError(f"temperature must be 0 (greedy) or a finite number of at least "
                                f"{MIN_TEMPERATURE:g} (smaller ones overflow the sampler), got {t}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p < 1.0):
            raise SamplingError(f"min_p must be in [0, 1), got {self.min_p}")
        r = self.repetition_penalty
        if not (1.0 / MAX_REPETITION_PENALTY <= r <= MAX_REPETITION_PENALTY):
            raise SamplingError(f"repetition_penalty must be in [{1.0 / MAX_REPETITION_PENALTY:g}, "
                                f"{MAX_REPETITION_PENALTY:g}] (1 = off), got {r}")
        return self


class Sampler:
    def __init__(self, params: SamplingParams):
        self.p = params.validate()
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray, history=()) -> int:
        p = self.p
        x = np.array(logits, dtype=np.float64)
        check_finite_logits(x)
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
