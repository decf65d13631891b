"""Token sampling: the per-sequence logits pipeline, then greedy or a seeded draw.

One step, in this order (:meth:`Sampler.process` does 1-4, the sequence 5, :meth:`Sampler.draw` 6):

1. ``logits_processors``: user callables ``(token_ids, logits) -> logits``, ``token_ids`` the
   prompt and the tokens generated so far (transformers' and llama-cpp-python's convention);
2. ``logit_bias``: ``{token id: bias}`` added to the logits (OpenAI: -100 bans, +100 forces);
3. ``presence_penalty`` / ``frequency_penalty`` (OpenAI's): ``logit[j] -= presence * (c[j] > 0)
   + frequency * c[j]``, ``c[j]`` how often token j was generated (not the prompt);
4. ``repetition_penalty`` (transformers'): on every token of the prompt and the output;
5. the constraint's mask (cpullm.generate.constraints): forbidden tokens get -inf;
6. temperature, top-k, top-p, min-p, then a draw. ``temperature == 0`` is greedy (argmax, first
   index on ties). The draw is :func:`cpullm_kernels.ops.sample.sample_logits`: three passes over the
   vocabulary and a sort of only the likeliest tokens a cut can keep (no argsort of the whole
   vocabulary), one uniform number from the sequence's seeded generator per token.

A plain sampler (no processors, bias, penalties or log-probabilities) reads the logits it is given
as they are (no float64 copy): a sampled step costs a few hundred microseconds of its own.

Log-probabilities (``logprobs``) are the log-softmax of the logits after steps 1-5: after the
penalties, the bias and the mask, before temperature and the top-k/top-p/min-p cuts (vLLM's
"processed" log-probs; a constrained token's log-probability is its share among the allowed ones).
"""
from __future__ import annotations

import attrs
import numpy as np

from ..errors import SamplingError


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
    presence_penalty: float = 0.0       # OpenAI's, in [-2, 2]; 0 = off
    frequency_penalty: float = 0.0      # OpenAI's, in [-2, 2]; 0 = off
    logit_bias: dict | None = None      # {token id: bias in [-100, 100]}
    logprobs: int | None = None         # None: off; N >= 0: the chosen token's and the N likeliest

    MAX_TOP_LOGPROBS = 20               # OpenAI's bound on top_logprobs
    MAX_LOGIT_BIAS = 1024               # entries of one logit_bias (OpenAI allows 300)

    @property
    def plain(self) -> bool:
        """No penalty, bias or log-probabilities: the logits go to the draw as they are."""
        return (self.repetition_penalty == 1.0 and self.presence_penalty == 0.0
                and self.frequency_penalty == 0.0 and not self.logit_bias and self.logprobs is None)

    def check_surface(self, vocab_size: int | None = None) -> "SamplingParams":
        """Check the penalties, the bias and the log-probability count (token ids against
        ``vocab_size`` when given); normalizes ``logit_bias`` to ``{int: float}``."""
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and -2.0 <= v <= 2.0):
                raise SamplingError(f"{name} must be in [-2, 2] (0 = off), got {v}")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and not isinstance(self.logprobs, bool)
                                              and 0 <= self.logprobs <= self.MAX_TOP_LOGPROBS):
            raise SamplingError(f"logprobs (top log-probabilities per token) must be in "
                                f"[0, {self.MAX_TOP_LOGPROBS}], got {self.logprobs!r}")
        if self.logit_bias:
            if not isinstance(self.logit_bias, dict):
                raise SamplingError("logit_bias must be a mapping {token id: bias}")
            if len(self.logit_bias) > self.MAX_LOGIT_BIAS:
                raise SamplingError(f"logit_bias has {len(self.logit_bias)} entries, more than "
                                    f"the {self.MAX_LOGIT_BIAS} allowed")
            bias = {}
            for k, v in self.logit_bias.items():
                try:
                    tid = int(k)
                except (TypeError, ValueError):
                    raise SamplingError(f"logit_bias keys are token ids, got {k!r:.40}") from None
                if tid < 0 or (vocab_size is not None and tid >= vocab_size) or str(k).strip() != str(tid):
                    raise SamplingError(f"logit_bias token id {k!r:.40} is not in [0, {vocab_size})")
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100.0 <= v <= 100.0:
                    raise SamplingError(f"logit_bias[{k}] must be a number in [-100, 100], got {v!r:.40}")
                bias[tid] = float(v)
            self.logit_bias = bias
        return self

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
    def __init__(self, params: SamplingParams, logits_processors=()):
        self.p = params.validate()
        self.p.check_surface()
        self.processors = list(logits_processors or ())
        for f in self.processors:
            if not callable(f):
                raise SamplingError(f"logits_processors takes callables (token_ids, logits) -> logits, "
                                    f"got {type(f).__name__}")
        self.rng = np.random.default_rng(params.seed)
        self._counts: dict[int, int] = {}       # generated token -> times (presence/frequency)
        self._scratch: np.ndarray | None = None  # float32 (vocab,): the draw's token weights

    @property
    def plain(self) -> bool:
        return self.p.plain and not self.processors

    def __call__(self, logits: np.ndarray, history=()) -> int:
        return self.draw(self.process(logits, history))

    def note(self, token: int) -> None:
        """Count a generated token (presence and frequency penalties count the output only)."""
        self._counts[int(token)] = self._counts.get(int(token), 0) + 1

    def process(self, logits: np.ndarray, history=()) -> np.ndarray:
        """float64 (vocab,): ``logits`` after the processors, the bias and the penalties (steps
        1-4 of the module docstring); ``history`` is the prompt and the output so far."""
        p = self.p
        if self.plain:                      # nothing to apply: the logits as they are
            x = np.ascontiguousarray(logits)
            check_finite_logits(x)
            return x
        x = np.array(logits, dtype=np.float64)
        check_finite_logits(x)
        for f in self.processors:
            y = f(list(history), x)
            y = np.asarray(y, dtype=np.float64) if y is not None else x
            if y.shape != x.shape:
                raise SamplingError(f"a logits processor returned shape {y.shape}, expected {x.shape}")
            x = np.array(y, dtype=np.float64)
        if p.logit_bias:
            ids = np.fromiter(p.logit_bias.keys(), np.int64)
            keep = ids < x.size
            x[ids[keep]] += np.fromiter(p.logit_bias.values(), np.float64)[keep]
        if (p.presence_penalty or p.frequency_penalty) and self._counts:
            ids = np.fromiter(self._counts.keys(), np.int64)
            c = np.fromiter(self._counts.values(), np.float64)
            keep = ids < x.size
            x[ids[keep]] -= p.presence_penalty + p.frequency_penalty * c[keep]
        if p.repetition_penalty != 1.0 and len(history):
            ids = np.unique(np.asarray(history, dtype=np.int64))
            ids = ids[ids < x.size]
            v = x[ids]
            x[ids] = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        return x

    def screen_cuts(self, vocab: int) -> tuple | None:
        """(1 / temperature, top_k, top_p, min_p, u) of the next draw when the logits need not be
        read whole for it: a plain sampled draw with a cut that leaves tokens out (an lm_head
        screen may then compute only the rows that can matter: cpullm.compile.head_screen's
        sample_through_screen, the same token). ``u`` is this draw's uniform number, taken from
        the sequence's generator now: a draw from the full logits instead must be given it
        (:meth:`draw`'s ``u``). None otherwise (no number taken)."""
        from cpullm_kernels.ops.sample import screen_can_sample
        p = self.p
        if p.temperature == 0.0 or not self.plain:
            return None
        top_k = min(int(p.top_k), vocab)
        if not screen_can_sample(top_k, float(p.top_p), float(p.min_p), vocab):
            return None
        return 1.0 / p.temperature, top_k, float(p.top_p), float(p.min_p), float(self.rng.random())

    def draw(self, x: np.ndarray, u: float | None = None) -> int:
        """The next token from processed logits ``x`` (vocab,): argmax when greedy, else
        temperature, top-k, top-p, min-p and a seeded draw (cpullm_kernels.ops.sample) with ``u``
        (default: the next number of the sequence's generator)."""
        p = self.p
        if p.temperature == 0.0:
            return int(np.argmax(x))
        from cpullm_kernels.ops.sample import sample_logits
        x = np.ascontiguousarray(x)
        if x.dtype not in (np.float32, np.float64):
            x = x.astype(np.float64)
        if self._scratch is None or self._scratch.size != x.size:
            self._scratch = np.empty(x.size, np.float32)
        top_k = min(int(p.top_k), x.size)         # a client's top_k may exceed int64; past the vocab it is off
        tok = sample_logits(x, 1.0 / p.temperature, top_k, float(p.top_p), float(p.min_p),
                            float(self.rng.random()) if u is None else float(u), self._scratch)
        if tok < 0:
            raise SamplingError("no token can be drawn: every logit is -inf (the constraint, bias or "
                                "processors banned them all)")
        return int(tok)


def top_logprobs(x: np.ndarray, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """(log-probability of ``token``, the ``n`` likeliest (id, log-probability), best first)
    under the log-softmax of processed logits ``x`` (vocab,)."""
    finite = np.isfinite(x)
    m = np.max(x[finite]) if finite.any() else 0.0
    lse = m + np.log(np.sum(np.exp(x[finite] - m))) if finite.any() else 0.0
    chosen = float(x[token] - lse) if np.isfinite(x[token]) else float("-inf")
    top: list[tuple[int, float]] = []
    if n > 0:
        k = min(n, int(finite.sum()) or 1, x.size)
        idx = np.argpartition(-x, k - 1)[:k]
        idx = idx[np.lexsort((idx, -x[idx]))]          # best first, lower id on ties
        top = [(int(i), float(x[i] - lse)) for i in idx if np.isfinite(x[i])]
    return chosen, top
