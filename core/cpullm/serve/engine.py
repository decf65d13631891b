"""The server's engine: one model, the requests' generations on its scheduler, each cancellable.

How requests run: the event loop reads and validates each request, renders and tokenizes the
prompt in a worker thread, then hands a *job* to the engine. The engine owns the model's
scheduler (cpullm.generate.scheduler), on its own thread: up to ``parallel`` jobs run at once, each decode
step advancing all of them in one pass over the weights, long prompts prefilled a chunk at a
time between those steps; the rest wait in arrival order. KV memory for ``parallel`` sequences
of the whole context is allocated at start and reported by ``/health``. Pieces of text flow back
to the request's coroutine through an asyncio queue. A client that disconnects (streaming or
not) sets its job's cancel flag: its sequence leaves at the next step and frees its slot.
At most ``max_queue`` jobs wait (``--queue``); more get 429 with ``Retry-After`` at once, never a
hang. A client reading its stream slowly holds nothing but its own pieces (at most its
max_tokens of text): the engine's thread never waits for a reader. A job's generation time is bounded by its
``time_limit`` (then it ends with finish_reason "length"). A graceful shutdown (:meth:`Engine.drain`) refuses new jobs and
ends the waiting ones with the 503 ``server_shutting_down`` error while the running generations go
on; :meth:`Engine.close` then ends whatever still runs with that error.
"""
from __future__ import annotations

import asyncio
import threading
import time

from ..generate.generate import GenerationStats
from .openai import ApiError, shutting_down_error

DEFAULT_MAX_QUEUE = 64
RETRY_AFTER_S = 1          # a refused client's Retry-After: a slot frees every few tokens


class Job:
    """One generation: prompt ids, limits, sampling; a cancel flag; the answer out via ``emit``
    as events ``("event", (kind, value))``: kind "content" or "reasoning" with text, or
    "tool_call" with a :class:`cpullm.toolcalls.ToolCall`, as ``parser`` (a
    :class:`cpullm.toolcalls.AnswerParser`; default: all text is content) reads the text."""

    def __init__(self, ids: list[int], max_tokens: int, sampling: dict, stop: list[str],
                 time_limit: float | None = None, parser=None):
        from ..toolcalls import AnswerParser
        self.parser = parser if parser is not None else AnswerParser()
        self.tool_calls = 0
        self.ids = ids
        self.max_tokens = max_tokens
        self.sampling = sampling
        self.seq = None             # the running cpullm.generate.sequence.Sequence (its log-probabilities)
        self.stop = stop
        self.time_limit = time_limit      # seconds of generation, from when the engine takes it
        self.timed_out = False
        self.abort: Exception | None = None    # set with cancel: the error the client gets
        self.cancel = threading.Event()
        self.stats = GenerationStats()
        self.request = None               # the engine's cpullm.generate.engine.Request, once submitted
        self.cache_salt: str | None = None   # its tenant: shares cached prefixes only within it
        self.finished = threading.Event()
        self._emit = None

    def emit(self, item) -> None:
        try:
            self._emit(item)
        except RuntimeError:        # the event loop is gone (server shutting down)
            self.cancel.set()

    def emit_text(self, piece: str, final: bool = False) -> None:
        """Read ``piece`` (and with ``final`` the end of the answer) and emit its events."""
        events = self.parser.push(piece) if piece else []
        if final:
            events += self.parser.finish()
        for kind, value in events:
            if kind == "tool_call":
                self.tool_calls += 1
            self.emit(("event", (kind, value)))


class Engine:
    """Owns the model's scheduler (:class:`cpullm.generate.engine.Engine`): up to ``parallel`` jobs decode
    together, sharing each pass over the weights; the others wait in arrival order (at most
    ``max_queue``; more get 429). Text pieces (stop strings applied) go back through each job's
    emit; a job's cancel flag is its sequence's, so a client that leaves frees its slot at the
    next step."""

    def __init__(self, model, max_queue: int = DEFAULT_MAX_QUEUE, parallel: int | None = None,
                 prefill_chunk: int | None = None, prefix_cache_bytes: int | None = None):
        from ..generate.engine import Engine as CoreEngine
        self.model = model
        self.max_queue = max_queue
        self.core = CoreEngine(model, parallel, prefill_chunk, prefix_cache_bytes)
        self.parallel = self.core.parallel
        self._lock = threading.Lock()
        self._closed = False
        self._jobs: set = set()
        self.counters = {"requests": 0, "completed": 0, "cancelled": 0, "failed": 0,
                         "timed_out": 0, "generated_tokens": 0}

    def submit(self, job: Job, loop: asyncio.AbstractEventLoop) -> "asyncio.Queue":
        from ..generate.generate import TextStream
        out: asyncio.Queue = asyncio.Queue()
        job._emit = lambda item: loop.call_soon_threadsafe(out.put_nowait, item)
        with self._lock:
            if self._closed or self._draining:
                raise shutting_down_error()
            c = self.core.scheduler.counts()
            if c["waiting"] >= self.max_queue and not c["free_slots"]:
                err = ApiError(f"the server is busy: {self.parallel} requests are generating and "
                               f"{self.max_queue} waiting (its --queue); retry after {RETRY_AFTER_S} s",
                               429, "rate_limit_exceeded", type="server_overloaded")
                err.headers = {"retry-after": str(RETRY_AFTER_S)}
                raise err
            self.counters["requests"] += 1
        text = TextStream(self.model.tokenizer, job.stop)
        job.ended_by = None              # "stop" (a stop string) or "timeout", set on the engine thread
        job.deadline = None

        submitted = threading.Lock()     # held until job.request is set (read at the end)

        def on_token(tok):               # on the scheduler's thread
            if tok is None:
                with submitted:
                    pass
                self._finish(job, text)
                return
            if job.ended_by is not None or job.cancel.is_set():
                return
            if job.deadline is None and job.time_limit is not None:
                job.deadline = time.monotonic() - job.stats.prefill_s + job.time_limit
            piece = text.push(tok)
            if piece:
                job.emit_text(piece)
            if text.stopped:
                job.ended_by = "stop"
            elif job.deadline is not None and time.monotonic() > job.deadline:
                job.ended_by = "timeout"
            if job.ended_by is not None:
                job.cancel.set()         # frees the slot at the next step

        try:
            with submitted:
                job.request = self.core.submit(job.ids, job.max_tokens, stats=job.stats, cancel=job.cancel,
                                               on_token=on_token, cache_salt=job.cache_salt, **job.sampling)
                job.seq = job.request.seq
                with self._lock:             # before its _finish can run (it waits for `submitted`)
                    self._jobs.add(job)
        except Exception:
            with self._lock:
                self.counters["failed"] += 1
            raise
        return out

    def _finish(self, job: Job, text) -> None:
        """The job's last events, after its outcome is counted (a client that saw its answer end
        finds it in /health and /metrics)."""
        st = job.stats
        last: list = []
        if job.abort is not None:
            outcome = "cancelled"
            last.append(("error", job.abort))
        elif st.stop_reason == "failed" and job.request is not None and job.request.error is not None:
            outcome = "failed"              # this request's own failure (cpullm.errors): a 4xx
            last.append(("error", job.request.error))
        elif st.stop_reason in ("error", "failed"):
            outcome = "failed"
            last.append(("error", RuntimeError("the generation failed (see the server log)")))
        elif st.stop_reason == "cancelled" and job.ended_by is None:
            outcome = "cancelled"
            last.append(("done", None))
        else:
            outcome, piece = "completed", ""
            if job.ended_by == "timeout":
                outcome, job.timed_out, st.stop_reason = "timed_out", True, "length"
            elif job.ended_by == "stop":
                st.stop_reason = "stop"
            else:
                piece = text.flush()
                if text.stopped:
                    st.stop_reason = "stop"
            last += [("text", piece), ("done", None)]
        with self._lock:
            self.counters[outcome] += 1
            self.counters["generated_tokens"] += st.generated_tokens
        for kind, value in last:
            if kind == "text":
                job.emit_text(value, final=True)
            else:
                job.emit((kind, value))
        with self._lock:                 # running until its last events are out (a drain waits for them)
            self._jobs.discard(job)
        job.finished.set()

    def count_left_early(self) -> None:
        """A request whose client left before it reached the engine (during its render)."""
        with self._lock:
            self.counters["requests"] += 1
            self.counters["cancelled"] += 1

    def snapshot(self) -> dict:
        c = self.core.scheduler.counts()
        sch = self.core.scheduler
        with self._lock:
            return {**self.counters, "queued": c["waiting"], "active": c["running"],
                    "parallel": self.parallel, "kv_bytes_per_stream": sch.slot_bytes,
                    "kv_bytes_planned": sch.kv_bytes,
                    "kv_dtype": self.core.model.kv_dtype,
                    "prefix_cache": self.core.prefix_stats(),
                    "speculative": {"mode": sch.spec.mode if sch.spec is not None else "off",
                                    **sch.spec_stats.as_dict()}}

    @property
    def closed(self) -> bool:
        return self._closed or self._draining

    _draining = False

    def drain(self) -> None:
        """Begin a graceful shutdown: new jobs are refused and every job still waiting for a slot
        ends with the 503 ``server_shutting_down`` error; running generations go on (see
        :meth:`running`), until :meth:`close` ends what is left."""
        from ..generate.sequence import WAITING
        with self._lock:
            self._draining = True
            jobs = list(self._jobs)
        for job in jobs:
            if job.request is not None and job.request.seq.phase == WAITING:
                job.abort = shutting_down_error()
                job.cancel.set()

    def running(self) -> int:
        """Jobs not finished yet (generating, or ending)."""
        with self._lock:
            return len(self._jobs)

    def close(self) -> None:
        """Refuse new jobs; the running ones and every waiting one end with a 503 error."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            jobs = list(self._jobs)
        for job in jobs:
            job.abort = shutting_down_error()
            job.cancel.set()
        self.core.close()


async def job_pieces(out: asyncio.Queue, job: Job):
    """Async iterator over a job's answer events ``(kind, value)`` (see :class:`Job`); raises the
    job's error; cancels it when left early."""
    try:
        while True:
            kind, data = await out.get()
            if kind == "event":
                yield data
            elif kind == "error":
                raise data
            else:
                return
    finally:
        job.cancel.set()
