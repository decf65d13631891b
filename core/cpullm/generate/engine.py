"""Engine: a scheduler on its own thread, for code that submits requests from other threads (the
server, user code), each with its own sampling and a cancel handle.

    engine = model.engine(parallel=4)
    req = engine.submit(ids, max_new_tokens=64, temperature=0.7, seed=1)
    for tok in req: ...            # blocks for each token; req.cancel() from anywhere
    engine.close()

``model.generate_batch(prompts, ...)`` runs a scheduler in the calling thread instead, for a
fixed list of prompts.
"""
from __future__ import annotations

import os
import queue
import sys
import threading
import traceback

from cpullm_kernels.setup.numba_setup import on_passing_thread

from ..errors import ConfigError, PromptError
from .sampling import SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence, resolve_max_tokens

MAX_DEFAULT_PARALLEL = 8
"""Largest default --parallel: decode reads the weights once per step whatever the batch, and
each extra stream adds arithmetic (one row dot per weight row); past ~4 streams per core a 2-core
Zen 4 is compute-bound (see ``cpullm bench --concurrency``), so more streams only split its rate."""

KV_MEMORY_SHARE = 0.5
"""The default --parallel keeps the planned sequence state under this share of available memory."""


DEFAULT_PREFIX_CACHE_BYTES = 256 * 2**20
"""Default bound on the prefix cache (cpullm.run.prefix_cache): 256 MiB hold ~10k tokens of shared
prefixes of Qwen2.5-0.5B (24 KiB of float32 KV per token), and it stays within KV_MEMORY_SHARE of
the available memory together with the planned KV (it gets less when that is short)."""


def available_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def default_parallel(model) -> int:
    """Streams served at once when --parallel is not given: 4 per core the model runs on, at most
    MAX_DEFAULT_PARALLEL, and no more than fit (their KV and state planned for the whole context)
    in KV_MEMORY_SHARE of the available memory."""
    cores = int(model.threads or os.cpu_count() or 1)
    n = max(1, min(MAX_DEFAULT_PARALLEL, 4 * cores, model.forward.max_chunk))
    avail = available_memory_bytes()
    slot = model.forward.state_floats * 4
    if avail is not None and slot > 0:
        n = max(1, min(n, int(avail * KV_MEMORY_SHARE) // slot))
    return n


def default_prefix_cache_bytes(model, parallel: int) -> int:
    """DEFAULT_PREFIX_CACHE_BYTES, or what is left of KV_MEMORY_SHARE of the available memory
    after the KV of ``parallel`` sequences, if less."""
    avail = available_memory_bytes()
    n = DEFAULT_PREFIX_CACHE_BYTES
    if avail is not None:
        n = min(n, max(0, int(avail * KV_MEMORY_SHARE) - parallel * model.forward.state_floats * 4))
    return n


def check_fits_in_memory(model, parallel: int, prefix_cache_bytes: int = 0) -> None:
    """Refuse a --parallel / --ctx / --prefix-cache whose planned state exceeds the available memory."""
    avail = available_memory_bytes()
    kv = parallel * model.forward.state_floats * 4
    need = kv + prefix_cache_bytes
    if avail is not None and need > avail:
        raise ConfigError(f"--parallel {parallel} at --ctx {model.n_ctx} plans {kv / 2**20:.0f} MiB of KV and "
                          f"state and --prefix-cache {prefix_cache_bytes / 2**20:.0f} MiB, more than the "
                          f"{avail / 2**20:.0f} MiB available; lower --parallel or --ctx (or --prefix-cache)")


def embedding_rows(model) -> int:
    """Token ids the model's embedding has rows for: every prompt id must be below this."""
    meta = model.executor.program.meta
    return int(meta.get("embed_rows") or meta["vocab"])


def check_prompt_ids(model, ids) -> None:
    """Refuse a prompt holding an id the embedding has no row for, before it joins a batch (a
    text prompt can tokenize to one when the tokenizer is longer than the embedding)."""
    rows = embedding_rows(model)
    bad = next((int(t) for t in ids if not 0 <= int(t) < rows), None)
    if bad is not None:
        raise PromptError(f"the prompt holds token id {bad}, but the model's embedding has {rows} rows "
                          f"(ids 0..{rows - 1}); the tokenizer and the model do not match, or the id is wrong")


class Request:
    """One submitted sequence: iterate for its token ids (blocking); ``cancel()`` from any
    thread; ``stats`` and ``seq`` while or after it runs. ``on_token(tok)`` (tok None at the
    end), if given at submit, is called on the engine's thread with each token instead of
    queueing it; the iterator then yields nothing and ends with the request (``result()`` waits
    for it and returns every token)."""

    def __init__(self, seq: Sequence, on_token=None):
        self.seq = seq
        self.on_token = on_token
        self.error: BaseException | None = None
        self.finished = threading.Event()
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._ended = False             # the iterator has seen the end (a second one returns at once)

    @property
    def stats(self):
        return self.seq.stats

    def cancel(self) -> None:
        self.seq.cancel()

    def _deliver(self, tok) -> None:
        if tok is None:
            self.finished.set()
        if self.on_token is not None:
            self.on_token(tok)
            if tok is None:
                self._q.put(None)
        else:
            self._q.put(tok)

    def __iter__(self):
        while not self._ended:
            tok = self._q.get()
            if tok is None:
                self._ended = True
                break
            yield tok
        if self.error is not None:
            raise self.error

    def result(self) -> list[int]:
        """Every generated token id, once the request ends."""
        for _ in self:
            pass
        return list(self.seq.generated)


class Engine:
    def __init__(self, model, parallel: int | None = None, prefill_chunk: int | None = None,
                 prefix_cache_bytes: int | None = None):
        """``prefix_cache_bytes``: bound on the KV kept for prompts' shared prefixes (None: the
        default, :func:`default_prefix_cache_bytes`; 0: no prefix sharing)."""
        self.model = model
        self.parallel = int(parallel or default_parallel(model))
        if prefix_cache_bytes is None:
            prefix_cache_bytes = default_prefix_cache_bytes(model, self.parallel)
        check_fits_in_memory(model, self.parallel, int(prefix_cache_bytes))
        self.scheduler = Scheduler(model.forward, self.parallel, prefill_chunk, int(prefix_cache_bytes),
                                   speculative=getattr(model, "speculative", None))
        # the warm-up's kernels run on a thread that ends with it: the scheduler's thread is then the
        # only one holding an OpenMP team (numba_setup.on_passing_thread: 0.81x decode otherwise)
        on_passing_thread(self._warm_up, model)
        self._requests: dict[int, Request] = {}
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="cpullm-scheduler", daemon=True)
        self._thread.start()

    def _warm_up(self, model) -> None:
        if self.parallel > 1:
            self.scheduler.warm_up()
            from cpullm_kernels.ops.sample import warm_up as warm_sampler
            warm_sampler()              # a server's first sampled step would compile it for the batch
        screen = getattr(getattr(model.forward, "executor", None), "screen", None)
        if screen is not None:          # ... and a lone sampled row's draw through the lm_head screen
            from ..compile.head_screen import compile_sample_kernels
            compile_sample_kernels(screen)

    def submit(self, prompt_ids, max_tokens: int | None = None, *, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, min_p: float = 0.0, repetition_penalty: float = 1.0,
               seed: int | None = None, stop_ids=None, stats=None, cancel=None, on_token=None,
               presence_penalty: float = 0.0, frequency_penalty: float = 0.0, logit_bias: dict | None = None,
               logprobs: int | None = None, constraint=None, logits_processors=(),
               cache_salt: str | None = None, max_new_tokens: int | None = None) -> Request:
        """Queue a sequence of at most ``max_tokens`` new tokens (default 128; ``max_new_tokens``
        is an alias); errors in the request itself (empty prompt, too long for the context, bad
        sampling values, ids the embedding has no row for) raise here.
        ``constraint``: a spec dict (cpullm.generate.constraints.build_constraint) or a built Constraint
        for this sequence alone; ``logprobs``: record each token's log-probability and that many
        alternatives (``req.seq.logprobs``); ``cache_salt``: the sequence shares cached prefixes
        only with others of the same salt (one per tenant: another tenant can neither reuse nor
        time them)."""
        max_new_tokens = resolve_max_tokens(max_tokens, max_new_tokens)
        if self._closed:
            raise ConfigError("the engine is closed; create a new one (model.engine())")
        params = SamplingParams(temperature, top_k, top_p, min_p, repetition_penalty, seed,
                                presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                logit_bias=logit_bias, logprobs=logprobs).validate()
        params.check_surface(self.model.logits_size)
        check_prompt_ids(self.model, prompt_ids)
        if isinstance(constraint, dict):
            constraint = self.model.constraint(constraint)
        seq = Sequence(prompt_ids, max_new_tokens, params,
                       stop_ids=self.model.eos_token_ids if stop_ids is None else stop_ids,
                       stats=stats, cancel=cancel, constraint=constraint,
                       logits_processors=logits_processors)
        seq.cache_salt = cache_salt
        req = Request(seq, on_token)
        self._requests[id(seq)] = req
        try:
            self.scheduler.add(seq)
        except BaseException:
            self._requests.pop(id(seq), None)
            raise
        self._wake.set()
        return req

    def counts(self) -> dict:
        return {"parallel": self.parallel, **self.scheduler.counts()}

    def prefix_stats(self) -> dict:
        """The prefix cache's hits, misses, tokens reused, bytes held and budget, and the prompt
        tokens prefilled (a snapshot; the scheduler's thread updates them)."""
        return {**self.scheduler.prefix_cache.stats(), "prefilled_tokens": self.scheduler.prefilled_tokens}

    def _loop(self) -> None:
        sch = self.scheduler
        while not self._closed:
            if sch.idle:
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                events = sch.step()
            except BaseException as exc:        # a bug: fail what runs, keep serving
                traceback.print_exc(file=sys.stderr)
                events = self._fail_running(exc)
            for seq, tok in events:
                req = self._requests.get(id(seq))
                if req is None:
                    continue
                if tok is None:
                    self._requests.pop(id(seq), None)
                    if seq.error is not None and req.error is None:   # it failed alone (Sequence.fail)
                        req.error = seq.error
                try:
                    req._deliver(tok)
                except Exception:               # a consumer's callback must not stop the others
                    traceback.print_exc(file=sys.stderr)

    def _fail_running(self, exc) -> list:
        sch = self.scheduler
        events = []
        for seq in list(sch.running):
            seq.finish("error")
            sch._release(seq)
            req = self._requests.get(id(seq))
            if req is not None:
                req.error = exc
            events.append((seq, None))
        return events

    def close(self) -> None:
        """Stop the thread; every unfinished request is cancelled and its iterator ends."""
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=30)
        for req in list(self._requests.values()):
            req.seq.finish("cancelled")
            req._deliver(None)
        self._requests.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def generate_batch(model, prompts, max_new_tokens: int = 128, parallel: int | None = None,
                   prefill_chunk: int | None = None, stop_ids=None, params=None, stats=None,
                   prefix_cache_bytes: int | None = None, constraints=None,
                   logits_processors=None) -> list[list[int]]:
    """Token ids generated for each prompt (lists of ids), ``parallel`` at a time through one
    scheduler in the calling thread. ``params``: one SamplingParams for all, or a list of them;
    ``constraints`` and ``logits_processors``: one per prompt (None entries: none)."""
    prompts = list(prompts)
    if not isinstance(params, (list, tuple)):
        params = [params or SamplingParams()] * len(prompts)
    if len(params) != len(prompts):
        raise ConfigError(f"give one sampling setting per prompt ({len(prompts)}), got {len(params)}")
    n = int(parallel or min(len(prompts), default_parallel(model))) or 1
    if prefix_cache_bytes is None:
        prefix_cache_bytes = default_prefix_cache_bytes(model, max(1, n))
    sch = Scheduler(model.forward, max(1, n), prefill_chunk, int(prefix_cache_bytes),
                    speculative=getattr(model, "speculative", None))
    eos = model.eos_token_ids if stop_ids is None else stop_ids
    for p in prompts:
        check_prompt_ids(model, p)
    cons = list(constraints) if constraints is not None else [None] * len(prompts)
    procs = list(logits_processors) if logits_processors is not None else [()] * len(prompts)
    if len(cons) != len(prompts) or len(procs) != len(prompts):
        raise ConfigError(f"give one constraint and one processor list per prompt ({len(prompts)})")
    seqs = [sch.add(Sequence(p, max_new_tokens, pp, stop_ids=eos,
                             stats=None if stats is None else stats[i], constraint=cons[i],
                             logits_processors=procs[i] or ()))
            for i, (p, pp) in enumerate(zip(prompts, params))]
    sch.run_until_idle()
    failed = next((s.error for s in seqs if s.error is not None), None)
    if failed is not None:          # the others ran to their end; this one's error is the caller's
        raise failed
    return [list(s.generated) for s in seqs]
