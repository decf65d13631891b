"""The measurement every runtime shares: the prompt, the runners, :func:`measure_speed`
(definitions: :mod:`cpullm.bench`)."""
from __future__ import annotations

import statistics
import time

import numpy as np

from ..errors import ContextOverflowError, CpullmError, PromptError


CONTEXT_TOKENS = 512

PROMPT_TEXT = (
    "The history of computing is a story of ideas that became machines. Early mechanical "
    "calculators could add and subtract; later designs stored programs in memory and changed "
    "what a machine could do without rewiring it. Compilers turned readable instructions into "
    "code, operating systems shared one processor among many tasks, and networks connected "
    "computers across cities and oceans. Today a small language model can run on an ordinary "
    "laptop processor, reading a prompt, predicting one token after another, and writing text "
    "that answers questions, summarizes documents, or translates between languages. "
)

# Profile groups (IR node ``group`` labels, plus "sampling") -> table / chart labels.


class BenchError(CpullmError):
    """A benchmark step failed (a child process, a missing optional extra)."""


# ---- the prompt ---------------------------------------------------------------------------------
def prompt_ids(tokenizer, n: int, vocab: int | None = None) -> list[int]:
    """Exactly ``n`` deterministic token ids: PROMPT_TEXT tokenized (no special tokens), repeated."""
    if n <= 0:
        raise PromptError(f"--prompt-tokens must be >= 1, got {n}")
    base = [int(t) for t in tokenizer.encode(PROMPT_TEXT, add_special_tokens=False)]
    if vocab is not None:
        base = [t for t in base if 0 <= t < vocab]
    if not base:
        raise PromptError("the tokenizer produced no usable token ids for the benchmark prompt")
    reps = -(-n // len(base))
    return (base * reps)[:n]


def cpu_busy(seconds: float = 2.0) -> float | None:
    """Fraction of all CPU time used (by anything) over the next ``seconds`` (Linux /proc/stat;
    None elsewhere). Unlike the load average it does not remember a run that just ended."""
    def snap():
        with open("/proc/stat") as fh:
            v = [int(x) for x in fh.readline().split()[1:]]
        return sum(v), v[3] + v[4]                       # total, idle + iowait
    try:
        t0, i0 = snap()
        time.sleep(seconds)
        t1, i1 = snap()
    except (OSError, ValueError, IndexError):
        return None
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


def greedy(logits) -> int:
    """The benchmark's token choice for every runtime: argmax (first index on ties)."""
    return int(np.argmax(logits))


# ---- runners ------------------------------------------------------------------------------------
class CpullmRunner:
    """The minimal interface :func:`measure_speed` drives: reset / prefill / decode -> logits, on
    one slot of the model's forward path (the path generate and the scheduler take)."""

    name = "cpullm"

    def __init__(self, model):
        self.model = model
        self.ex = model.executor
        self.forward = model.forward      # the path generate and the scheduler take
        self.slot = model.slot            # the model's own: model.info() reports its KV in use

    @property
    def n_ctx(self) -> int:
        return self.model.n_ctx

    def reset(self):
        self.forward.reset(self.slot)

    @property
    def position(self) -> int:
        return self.slot.position

    def prefill(self, ids, all_logits: bool = False):
        return self.forward.prefill(self.slot, ids, all_logits)

    def decode(self, tok: int):
        return self.forward.step([self.slot], [tok])[0][0]

    def decode_next(self, tok: int) -> int:
        """Greedy decoding's step: the next token only (through the lm_head screen, if any)."""
        return self.forward.step([self.slot], [tok], greedy=[True])[1][0]


def next_token(runner, tok: int) -> int:
    """One greedy decode step of any runner: ``runner.decode_next`` where the runtime has a
    step that returns only the argmax, else the argmax of ``runner.decode``'s logits."""
    step = getattr(runner, "decode_next", None)
    return int(step(tok)) if step is not None else greedy(runner.decode(tok))


def _median(xs):
    xs = [x for x in xs if x is not None]
    return float(statistics.median(xs)) if xs else None


def _decode_steps(runner, tok: int, steps: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = next_token(runner, tok)
    return time.perf_counter() - t0, tok


def measure_speed(runner, ids: list[int], gen_tokens: int, repeat: int = 3,
                  context_tokens: int = CONTEXT_TOKENS, context_ids: list[int] | None = None,
                  warmup: bool = True, after_run=None) -> dict:
    """Median prefill / decode / decode-at-context tokens/s and time to first token.

    ``runner`` has ``reset()``, ``prefill(ids) -> last logits``, ``decode(tok) -> logits`` and
    ``n_ctx``. ``context_ids`` (default: ``ids`` when it has ``context_tokens`` tokens) is the
    prefill before the decode-at-context run. ``after_run(runner)`` is called at the end of each
    repeat with the 512-context sequence still in the cache.
    """
    if gen_tokens <= 0:
        raise PromptError(f"--gen-tokens must be >= 1, got {gen_tokens}")
    if repeat <= 0:
        raise PromptError(f"--repeat must be >= 1, got {repeat}")
    n_ctx = int(runner.n_ctx)
    if len(ids) + gen_tokens > n_ctx:
        raise ContextOverflowError(
            f"{len(ids)} prompt + {gen_tokens} generated tokens exceed the context of {n_ctx}; "
            f"lower --prompt-tokens/--gen-tokens or raise --ctx")
    context_tokens = max(1, min(context_tokens, n_ctx - gen_tokens))
    if context_ids is None:
        context_ids = ids if len(ids) == context_tokens else None
    if context_ids is not None and len(context_ids) != context_tokens:
        raise PromptError(f"context_ids has {len(context_ids)} tokens, expected {context_tokens}")
    same = context_ids is ids or (context_ids is not None and list(context_ids) == list(ids))

    if warmup:   # untimed: loads / compiles every kernel path the timed runs take
        runner.reset()
        tok = greedy(runner.prefill(ids))
        _decode_steps(runner, tok, min(4, gen_tokens))

    runs = []
    for _ in range(repeat):
        r = {}
        # short context decode: a one-token prompt, then gen_tokens steps
        runner.reset()
        tok = greedy(runner.prefill(ids[:1]))
        dt, _ = _decode_steps(runner, tok, gen_tokens)
        r["decode_s"] = dt
        if getattr(runner, "decode_next", None) is not None:   # the same steps, full logits
            runner.reset()
            tok = greedy(runner.prefill(ids[:1]))
            t0 = time.perf_counter()
            for _ in range(gen_tokens):
                tok = greedy(runner.decode(tok))
            r["decode_logits_s"] = time.perf_counter() - t0
        # prefill + first token
        runner.reset()
        t0 = time.perf_counter()
        logits = runner.prefill(ids)
        t1 = time.perf_counter()
        tok = greedy(logits)
        t2 = time.perf_counter()
        r["prefill_s"], r["ttft_s"] = t1 - t0, t2 - t0
        # decode after a context_tokens-long prefill
        if not same:
            runner.reset()
            tok = greedy(runner.prefill(context_ids if context_ids is not None
                                        else _extend(ids, context_tokens)))
        dt, _ = _decode_steps(runner, tok, gen_tokens)
        r["decode_ctx_s"] = dt
        if after_run is not None:
            after_run(runner)
        runs.append(r)

    n = len(ids)
    return {
        "prefill_tps": _median(n / r["prefill_s"] for r in runs),
        "decode_tps": _median(gen_tokens / r["decode_s"] for r in runs),
        "decode_tps_at_512": _median(gen_tokens / r["decode_ctx_s"] for r in runs),
        "decode_logits_tps": _median(gen_tokens / r["decode_logits_s"] for r in runs if "decode_logits_s" in r),
        "ttft_s": _median(r["ttft_s"] for r in runs),
        "decode_context_tokens": context_tokens,
        "runs": runs,
    }


def _extend(ids: list[int], n: int) -> list[int]:
    reps = -(-n // len(ids))
    return (list(ids) * reps)[:n]
