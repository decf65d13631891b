"""Exact speculative decoding: guess a few tokens of a sequence, score them all in one pass over
the weights (:meth:`cpullm.run.forward.Forward.verify`), keep the ones the model would have produced.

Decode of one stream reads every weight once per token; a pass over the weights with k + 1 rows
costs little more than one with one row, so every right guess is a token for (almost) free. The
guesses come from

* the text itself (``lookup``, prompt lookup): the tokens that followed the most recent earlier
  occurrence of the sequence's last n tokens (n = 4, 3, 2) in its prompt and generated text. Code
  edits, refactors, quoting answers and summaries copy long spans, and each copied token is a
  right guess. No second model, a dict of n-grams per sequence;
* a small model that shares the tokenizer (``draft``, :class:`DraftModel`): its greedy tokens,
  decoded on the same cores between verify passes.

Exactness: the scheduler feeds the verify rows to :meth:`cpullm.generate.sequence.Sequence.take` one after
the other, exactly as one-token steps would feed it (the rows' logits are the one-token steps'
bit for bit), and stops at the first row whose chosen token is not the next guess. With greedy
decoding the tokens are therefore those of plain decoding. With sampling, a guess is accepted when
the token drawn from the row's (processed, masked) distribution equals it; for a guess that is one
token (both drafters propose deterministically: the draft model greedily) this is the standard
accept/reject rule (accept with probability p(guess), otherwise draw from the residual p without
the guess, renormalized), so the output distribution is the target model's. Constraints,
penalties and log-probabilities apply to every row as they would to a step.

Adaptive length (:class:`Pacer`): the number of guesses follows each sequence's acceptance
(doubling while every guess is kept, falling to what was kept plus one), and a sequence whose
guesses keep failing (open-ended chat) waits 1, 2, 4, ... 32 steps before it guesses again (a
pass that kept a single guess does not shorten the wait: failures between such passes still back
off), so its decode costs at most a few percent more than plain decode. Those waits are for an
INT8 program, whose verify pass reads the weights once whatever its rows; where a guessed row
costs more (raw ggml blocks multiplied a row at a time), they grow in proportion
(:data:`REF_ROW_COST`). The pacing follows the guesses and the program's formats, not timings,
so greedy lookup makes the same passes in every run.
"""
from __future__ import annotations

from collections import deque

import attrs
import numpy as np

from ..errors import ConfigError

MODES = ("off", "lookup", "draft", "auto")
DEFAULT_MODE = "auto"
"""``auto``: prompt lookup, and the draft model where one was given, lookup has no guess and the
draft pays on the measured costs (:func:`draft_pays`). Lookup costs nothing when it finds no
earlier occurrence and backs off when its guesses fail, so it is on by default; greedy output is
the same either way."""
DEFAULT_DRAFT_MAX = 8
MAX_DRAFT_MAX = 32
LOOKUP_NGRAMS = (4, 3, 2)        # the longest earlier match first
MAX_COOLDOWN = 32                # steps a sequence waits after guesses that failed, at most (see REF_ROW_COST)
REF_ROW_COST = 0.06
"""The cost of a guessed row, in decode steps, that the waits of 1..MAX_COOLDOWN steps are for:
an INT8 program's, whose verify pass reads every weight once for all rows (one guess: 1.06 steps
at Qwen2.5-0.5B, benchmarks/results/2026-12-06-verify-after-prefetch.md). Where a guessed row
costs more (Forward.guess_row_cost: raw blocks multiplied a row at a time, 0.5 steps more per
row for Qwen2.5-0.5B's Q5_0 GGUF), the waits grow by the same factor, so a failed guess costs
open-ended chat the same share of its decode time."""


@attrs.define
class SpecStats:
    """What speculation did for one sequence (or a whole engine, summed)."""
    verify_passes: int = 0       # passes that scored at least one guess of this sequence
    drafted: int = 0             # guesses scored
    accepted: int = 0            # guesses kept

    @property
    def accepted_per_pass(self) -> float:
        """Tokens accepted per verify pass (guesses kept; the pass's own token not counted)."""
        return self.accepted / self.verify_passes if self.verify_passes else 0.0

    def add(self, other: "SpecStats") -> None:
        self.verify_passes += other.verify_passes
        self.drafted += other.drafted
        self.accepted += other.accepted

    def as_dict(self) -> dict:
        return {"verify_passes": self.verify_passes, "drafted_tokens": self.drafted,
                "accepted_tokens": self.accepted, "accepted_per_pass": round(self.accepted_per_pass, 3)}


@attrs.frozen
class SpecConfig:
    """How a runner speculates: ``mode`` (one of MODES), at most ``draft_max`` guesses per pass,
    and the ``draft`` model (:class:`DraftModel`) when there is one. ``compile_first``: a lone
    sequence decodes plainly while the batched step that verifies guesses is not compiled yet,
    and a child process compiles it (the CLI's first run on a fresh machine keeps decoding instead
    of stopping for it)."""
    mode: str = DEFAULT_MODE
    draft_max: int = DEFAULT_DRAFT_MAX
    draft: object = None
    compile_first: bool = False

    @property
    def on(self) -> bool:
        return self.mode != "off"


def resolve(mode: str | None = None, draft_max: int | None = None, draft=None) -> SpecConfig:
    """A checked :class:`SpecConfig` from the user's settings (``--speculative``, ``--draft-max``,
    a loaded draft model); ConfigError naming the fix otherwise."""
    mode = DEFAULT_MODE if mode is None else str(mode)
    if mode not in MODES:
        raise ConfigError(f"--speculative must be one of {', '.join(MODES)}, not {mode!r}")
    if draft_max is None:
        draft_max = DEFAULT_DRAFT_MAX
    if isinstance(draft_max, bool) or not isinstance(draft_max, (int, np.integer)) \
            or not 1 <= int(draft_max) <= MAX_DRAFT_MAX:
        raise ConfigError(f"--draft-max must be an integer in 1..{MAX_DRAFT_MAX}, got {draft_max!r}")
    if mode == "draft" and draft is None:
        raise ConfigError("--speculative draft needs a draft model: give --draft-model MODEL "
                          "(or use --speculative lookup)")
    return SpecConfig(mode, int(draft_max), draft)


PRIOR_ACCEPTANCE = 0.8           # a draft's acceptance before MIN_DRAFTED of its guesses were scored
MIN_DRAFTED = 32
RECENT_ROUNDS = 16               # a draft's acceptance is measured over its last rounds (the text changes)
PROBE_EVERY = 32                 # a draft that does not pay is tried again after this many refusals


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a verify pass of k guesses yields when each guess holds with probability
    ``acceptance`` independently: (1 - a^(k+1)) / (1 - a) (its own token included)."""
    a = min(max(float(acceptance), 0.0), 0.999)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def draft_pays(step_s: float, draft_step_s: float, verify_s: float, k: int, acceptance: float) -> bool:
    """Whether a round of ``k`` draft steps and a verify pass is expected to give more tokens per
    second than plain decode steps of ``step_s``: expected_tokens * step_s > k draft steps + the pass."""
    return expected_tokens(acceptance, k) * step_s > k * draft_step_s + verify_s


class LookupIndex:
    """Prompt lookup over one sequence's tokens: for every n-gram (n in LOOKUP_NGRAMS) the index
    where its most recent occurrence continued. Grows with the text (:meth:`extend`)."""

    def __init__(self):
        self.tokens: list[int] = []
        self.after = {n: {} for n in LOOKUP_NGRAMS}

    def extend(self, tokens) -> None:
        toks = self.tokens
        for t in tokens:
            i = len(toks)                  # the n-grams ending just before token i continue at i
            for n, table in self.after.items():
                if i >= n:
                    table[tuple(toks[i - n: i])] = i
            toks.append(int(t))

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the last earlier occurrence of the longest tail n-gram."""
        toks = self.tokens
        L = len(toks)
        for n, table in self.after.items():
            if L < n:
                continue
            at = table.get(tuple(toks[L - n:]))
            if at is not None:
                return toks[at: at + k]
        return []


class Pacer:
    """How many guesses a sequence makes next (0: none this step), from how the last ones fared
    and what a guessed row costs (``row_cost``, in decode steps: the waits after failures scale
    with it past REF_ROW_COST)."""

    def __init__(self, draft_max: int, row_cost: float = 0.0):
        self.max = int(draft_max)
        self.k = min(4, self.max)
        self.wait = 0                   # steps left before guessing again
        self.cooldown = 1               # the wait after the next failure, in REF_ROW_COST units
        self.wait_scale = max(1.0, float(row_cost) / REF_ROW_COST)

    def budget(self) -> int:
        if self.wait > 0:
            self.wait -= 1
            return 0
        return self.k

    def record(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        if accepted == drafted:
            self.k = min(self.max, self.k * 2)
            if accepted >= 2:           # one kept guess barely pays a pass: the backoff stands
                self.cooldown = 1
        elif accepted == 0:
            self.k = max(1, self.k // 2)
            self.wait = round(self.cooldown * self.wait_scale)
            self.cooldown = min(MAX_COOLDOWN, self.cooldown * 2)
        else:
            self.k = max(1, min(self.max, accepted + 1))
            if accepted >= 2:           # one kept guess barely pays a pass: the backoff stands
                self.cooldown = 1


class SeqSpec:
    """One sequence's speculation: its lookup index, pacing, statistics and draft-model slot.
    ``row_cost``: what a guessed row costs its model (Forward.guess_row_cost)."""

    def __init__(self, cfg: SpecConfig, row_cost: float = 0.0):
        self.cfg = cfg
        self.index = LookupIndex() if cfg.mode in ("lookup", "auto") else None
        self.pacer = Pacer(cfg.draft_max, row_cost)
        self.stats = SpecStats()
        self.from_draft = False         # the guesses being verified are the draft model's
        self.draft_slot = None          # a cpullm.run.forward.Slot of the draft model (DraftModel)
        self.draft_fed: list[int] = []  # the tokens whose state the draft slot holds

    def sync(self, history) -> None:
        if self.index is not None and len(history) > len(self.index.tokens):
            self.index.extend(history[len(self.index.tokens):])

    def lookup(self, history, k: int) -> list[int]:
        if self.index is None:
            return []
        self.sync(history)
        return self.index.propose(k)


class DraftModel:
    """A small model that shares the target's tokenizer, decoding greedy guesses on its own slots
    (one per scheduler slot, planned when a scheduler attaches it)."""

    def __init__(self, model):
        self.model = model
        self.forward = model.forward
        self.slots: list = []
        self.free: list = []
        self.step_s = 0.0
        self.steps = 0
        self.drafted = 0                # its guesses scored, and kept (all time)
        self.accepted = 0
        self.recent: deque = deque(maxlen=RECENT_ROUNDS)   # (scored, kept) of its last rounds
        self.refused = 0                # auto's refusals since the draft last ran

    def scored(self, drafted: int, accepted: int) -> None:
        """A verify pass scored ``drafted`` of its guesses and kept ``accepted``."""
        self.drafted += drafted
        self.accepted += accepted
        self.recent.append((drafted, accepted))

    @property
    def acceptance(self) -> float:
        """Its guesses' acceptance over the last RECENT_ROUNDS rounds (PRIOR_ACCEPTANCE until
        MIN_DRAFTED guesses were scored)."""
        drafted = sum(d for d, _ in self.recent)
        return sum(a for _, a in self.recent) / drafted if drafted >= MIN_DRAFTED else PRIOR_ACCEPTANCE

    def pays(self, step_s: float | None, verify_s: float | None, k: int) -> bool:
        """``auto``'s choice: whether guessing ``k`` tokens with this draft beats plain steps of the
        target (``step_s`` a plain pass, ``verify_s`` a verify pass, both measured by the
        scheduler; None: not yet) at the acceptance measured over its recent rounds. A draft step
        not measured yet is tried once; before a plain step was measured, no. A draft refused
        PROBE_EVERY times in a row is tried once more, so a text it guesses well again (a chat
        that turns to quoting) gets it back."""
        if step_s is None:
            return False
        if self.steps == 0:
            return True
        if draft_pays(step_s, self.step_s / self.steps, verify_s if verify_s is not None else step_s, k,
                      self.acceptance):
            self.refused = 0
            return True
        self.refused += 1
        if self.refused >= PROBE_EVERY:
            self.refused = 0
            return True
        return False

    @staticmethod
    def check_pair(draft_model, target_model) -> None:
        """Refuse a draft that cannot guess the target's tokens: another vocabulary (ids or
        tokenizer), more parameters than the target, or a recurrent state (its guesses cannot be
        cut back by position)."""
        dv, tv = int(draft_model.program.meta["vocab"]), int(target_model.program.meta["vocab"])
        dt, tt = draft_model.tokenizer, target_model.tokenizer
        probe = "def main():\n    print('Hello, world!')  # 2025 café"
        same_tok = dt.encode(probe) == tt.encode(probe)
        same_eos = set(getattr(draft_model, "eos_token_ids", ()) or ()) == set(getattr(target_model, "eos_token_ids", ()) or ())
        if draft_model.family.name != target_model.family.name or not same_tok or abs(dv - tv) > 1024 \
                or not same_eos:
            raise ConfigError(f"the draft model ({draft_model.family.name}, vocabulary {dv}) does not share the "
                              f"target's tokenizer ({target_model.family.name}, vocabulary {tv}); give a draft "
                              f"of the same family and tokenizer, or use --speculative lookup")
        dp, tp = int(draft_model.weights_info.get("params", 0)), int(target_model.weights_info.get("params", 0))
        if dp and tp and dp >= tp:
            raise ConfigError(f"the draft model has {dp / 1e6:.0f}M parameters, the target {tp / 1e6:.0f}M: a "
                              f"draft must be smaller than the target; give a smaller --draft-model")
        if draft_model.forward.linear_regions:
            raise ConfigError("the draft model has linear-attention (recurrent) layers, whose state cannot be "
                              "cut back to the accepted guesses; give a draft with attention layers only, "
                              "or use --speculative lookup")

    def attach(self, n_slots: int) -> None:
        """Plan ``n_slots`` draft slots (one per scheduler slot), once."""
        if len(self.slots) < n_slots:
            self.slots = self.forward.slots(n_slots)
            self.free = list(range(n_slots))

    def take_slot(self, spec: SeqSpec) -> None:
        if spec.draft_slot is None and self.free:
            spec.draft_slot = self.slots[self.free.pop()]
            self.forward.reset(spec.draft_slot)
            spec.draft_fed = []

    def give_back(self, spec: SeqSpec) -> None:
        if spec.draft_slot is not None:
            self.free.append(spec.draft_slot.index)
            spec.draft_slot = None
            spec.draft_fed = []

    def propose(self, specs: list[SeqSpec], histories: list[list[int]], ks: list[int]) -> list[list[int]]:
        """Greedy guesses for each sequence (``ks[i]`` tokens after ``histories[i]``): catch each
        draft slot up to the history (cut back to the longest prefix it holds, then prefill the
        rest but the last token), then decode all of them together one token a step."""
        import time
        t0 = time.perf_counter()
        fwd = self.forward
        live = []
        for spec, hist, k in zip(specs, histories, ks):
            if spec.draft_slot is None or k <= 0:
                continue
            fed = spec.draft_fed
            common = 0
            n = min(len(fed), len(hist) - 1)
            while common < n and fed[common] == hist[common]:
                common += 1
            spec.draft_slot.position = common
            spec.draft_fed = list(hist[:common])
            rest = hist[common: len(hist) - 1]
            for a in range(0, len(rest), fwd.max_chunk):
                fwd.prefill(spec.draft_slot, rest[a: a + fwd.max_chunk])
            spec.draft_fed.extend(rest)
            room = fwd.n_ctx - spec.draft_slot.position - 1
            live.append([spec, [], min(k, room), hist[-1]])
        out = {}
        while live:
            rows = [x for x in live if len(x[1]) < x[2]]
            if not rows:
                break
            _, toks = fwd.step([x[0].draft_slot for x in rows], [x[3] for x in rows], greedy=[True] * len(rows))
            self.steps += 1
            for x, t in zip(rows, toks):
                x[0].draft_fed.append(x[3])
                x[1].append(int(t))
                x[3] = int(t)
            live = [x for x in live if len(x[1]) < x[2]]
            for x in rows:
                if len(x[1]) >= x[2]:
                    out[id(x[0])] = x[1]
        self.step_s += time.perf_counter() - t0
        return [out.get(id(s), []) for s in specs]
