"""``cpullm batch --ray``: a batch job on Ray Data.

The pending input lines become a dataset; ``map_batches`` runs them through a pool of
``replicas`` actors (:class:`LineAnswerer`), each holding ``threads`` CPUs, its own loaded model
and its own engine (the server's ASGI application, as ``cpullm batch`` runs locally), and
answering the requests of a batch ``2 x parallel`` at a time. The driver streams the finished
lines back (``iter_rows``, in the order batches finish) and appends each to the output with the
same writer as the local job: one write, fsynced. So the output file, the resume rule and, with
greedy decoding, the answers are the local run's.
"""
from __future__ import annotations

import asyncio
import json
import signal

from . import check_cores, connect


class LineAnswerer:
    """A Ray Data actor: one model and engine; a batch of input rows in, output lines out."""

    def __init__(self, options: dict):
        from ..serve.jobs import build_app

        self.app = build_app(options)
        self.loop = asyncio.new_event_loop()
        self.in_flight = min(self.app.engine.max_queue, 2 * self.app.engine.parallel)

    def __call__(self, batch: dict) -> dict:
        from ..serve.jobs import BatchLine, run_local

        lines = [BatchLine(int(n), str(c), url=str(u) or None, body=bytes(b) or None, error=str(e) or None)
                 for n, c, u, b, e in zip(batch["number"], batch["custom_id"], batch["url"],
                                          batch["body"], batch["error"])]
        sink = _Collect()
        self.loop.run_until_complete(run_local(self.app, lines, sink, _NoProgress(), self.in_flight,
                                               asyncio.Event()))
        return {"line": sink.lines}


class _Collect:
    def __init__(self):
        self.lines: list[str] = []

    def write(self, obj: dict) -> None:
        from ..serve.openai import json_text

        self.lines.append(json_text(obj))


class _NoProgress:
    def update(self, obj: dict) -> None:
        pass


def run_batch(pending, output: str, options: dict, progress, replicas: int, threads: int,
              address: str | None = None) -> bool:
    """Answer ``pending`` (BatchLines) on Ray Data into ``output``; True when a signal stopped
    it first (every line written is whole; the rest run on the next run)."""
    from ..serve.jobs import OutputWriter

    import ray as ray_module
    started = not ray_module.is_initialized()
    ray = connect(address)
    check_cores(replicas, threads)
    import ray.data

    options = dict(options, threads=threads)
    per_batch = 2 * (options.get("parallel") or min(8, 4 * threads))
    rows = [{"number": ln.number, "custom_id": ln.custom_id, "url": ln.url or "", "body": ln.body or b"",
             "error": ln.error or ""} for ln in pending]
    import logging
    logging.getLogger("ray.data").setLevel(logging.ERROR)      # the job's progress line says it
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    ds = ray.data.from_items(rows, override_num_blocks=max(1, -(-len(rows) // per_batch)))
    ds = ds.map_batches(LineAnswerer, fn_constructor_kwargs={"options": options}, batch_size=per_batch,
                        compute=ray.data.ActorPoolStrategy(size=replicas), num_cpus=threads,
                        batch_format="numpy")
    writer = OutputWriter(output)
    state = {"writing": False, "stop": False}

    def on_signal(signum, frame):
        if state["stop"]:
            raise KeyboardInterrupt                  # a second signal: now
        state["stop"] = True
        if not state["writing"]:
            raise KeyboardInterrupt

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for row in ds.iter_rows():
            obj = json.loads(row["line"])
            state["writing"] = True
            writer.write(obj)
            state["writing"] = False
            progress.update(obj)
            if state["stop"]:
                return True
        return False
    except KeyboardInterrupt:
        return True
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        writer.close()
        if started:
            ray.shutdown()
