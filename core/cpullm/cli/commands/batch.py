"""``cpullm batch INPUT.jsonl -o OUTPUT.jsonl``: a file of OpenAI batch requests, answered and
written line by line, resumable; locally or on Ray Data (``--ray``)."""
from __future__ import annotations

import argparse
import sys

from .common import add_cache_type_options, non_negative_int, positive_int

EPILOG = """\
INPUT is OpenAI's batch input: one JSON object per line, {"custom_id": "...", "method": "POST",
"url": "/v1/chat/completions" or "/v1/completions", "body": {request}}. OUTPUT gets OpenAI's batch
output, one line per request as it finishes: {"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}. Each request is answered exactly as `cpullm serve` would answer
it (a request the server refuses gets its 4xx status and error body); a line that is not a
request (not JSON, no custom_id, another url) gets "response": null and an "error". Requests run
--parallel at a time through the scheduler; progress (done/total, tokens/s, ETA) goes to stderr.
Each line is written and fsynced as it finishes. Rerunning the same command resumes: the
custom_ids already in OUTPUT are skipped (a last line cut short by a crash is dropped first).
Ctrl-C or SIGTERM stops cleanly: no line is half-written and the unfinished ones run on the next
run. With --ray the requests run on Ray Data: --replicas actors, each with its own model and
scheduler on --threads cores; greedy answers are the same as a local run."""


def add_parser(sub):
    p = sub.add_parser("batch", help="answer a JSONL file of OpenAI batch requests (resumable)",
                       description="Answer a file of OpenAI batch requests into a JSONL output file.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", metavar="INPUT.jsonl", help="OpenAI batch input file")
    p.add_argument("-o", "--output", required=True, metavar="OUTPUT.jsonl",
                   help="batch output file: appended to, and the custom_ids already in it are skipped")
    p.add_argument("--model", default=None,
                   help="model directory, .gguf file or store name (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--model-name", default=None,
                   help="model id request bodies may name (default: the directory name); another gets 404")
    p.add_argument("--quant", choices=["int8", "q4", "f32", "gguf"], default=None,
                   help="weight format (default: int8 for a checkpoint directory, gguf for a .gguf file)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="threads per model (default: physical cores; with --ray, 1)")
    p.add_argument("--ctx", type=positive_int, default=None, help="context length (default: min(4096, model max))")
    add_cache_type_options(p)
    p.add_argument("--cache-dir", default=None, help="execution cache root (default ~/.cache/cpullm)")
    p.add_argument("--no-cache", action="store_true", help="compile without the execution cache")
    p.add_argument("--parallel", type=positive_int, default=None, metavar="N",
                   help="requests generating at once per model (default: as cpullm serve)")
    p.add_argument("--prefix-cache", type=non_negative_int, default=None, metavar="MIB",
                   help="MiB of KV kept for shared prompt prefixes (default: as cpullm serve)")
    p.add_argument("--max-tokens-cap", type=positive_int, default=1024,
                   help="longest answer in tokens, and what an omitted max_tokens means (default 1024)")
    p.add_argument("--request-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="generation time per request (default 300)")
    p.add_argument("--ray", action="store_true", help="run on Ray Data (pip install 'cpullm[ray]')")
    p.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="Ray cluster to join (default: $RAY_ADDRESS, else a local cluster on this machine)")
    p.add_argument("--replicas", type=positive_int, default=None, metavar="N",
                   help="with --ray: model actors (default 1)")
    return p


def check_args(args) -> None:
    from cpullm.errors import ConfigError

    if not args.ray and (args.ray_address is not None or args.replicas is not None):
        raise ConfigError("--ray-address and --replicas go with --ray; add --ray (or drop them)")
    if not args.request_timeout > 0:
        raise ConfigError(f"--request-timeout must be > 0 seconds, got {args.request_timeout}")
    if args.ray:
        from cpullm.ray import require_ray
        require_ray()


def load_options(args) -> dict:
    """What each process that answers requests needs: how to load the model and build the app."""
    return {"model": args.model, "quant": args.quant, "threads": args.threads, "n_ctx": args.ctx,
            "kv_dtype": args.kv_dtype, "cache_dir": args.cache_dir, "use_cache": not args.no_cache,
            "model_id": args.model_name, "parallel": args.parallel,
            "prefix_cache_bytes": None if args.prefix_cache is None else args.prefix_cache * 2**20,
            "max_tokens_cap": args.max_tokens_cap, "request_timeout": args.request_timeout}


def run(args) -> int:
    from cpullm.serve.jobs import Progress, finished_ids, read_input

    lines = read_input(args.input)
    done = finished_ids(args.output)
    pending = [ln for ln in lines if ln.custom_id not in done]
    progress = Progress(len(lines), len(lines) - len(pending))
    if not pending:
        print(f"cpullm: batch: all {len(lines)} requests are already in {args.output}", file=sys.stderr)
        return 0
    if done:
        print(f"cpullm: batch: resuming: {len(lines) - len(pending)} of {len(lines)} already in "
              f"{args.output}", file=sys.stderr, flush=True)
    if args.ray:
        from cpullm.ray.data import run_batch
        stopped = run_batch(pending, args.output, load_options(args), progress,
                            replicas=args.replicas or 1, threads=args.threads or 1,
                            address=args.ray_address)
    else:
        stopped = _run_local(pending, args, progress)
    progress.show(final=True)
    if stopped:
        print(f"cpullm: batch: stopped; {progress.total - progress.done} requests left: rerun the same "
              "command to finish them", file=sys.stderr, flush=True)
        return 130
    return 0


def _run_local(pending, args, progress) -> bool:
    """Answer ``pending`` in this process; True when a signal stopped it first."""
    import asyncio
    import signal

    from cpullm.serve.jobs import OutputWriter, run_local
    from cpullm.serve.jobs import build_app

    writer = OutputWriter(args.output)          # an unwritable output fails before the model loads
    try:
        app = build_app(load_options(args))
    except BaseException:
        writer.close()
        raise
    engine = app.engine

    async def main() -> bool:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal(signum):
            print(f"\ncpullm: batch: {signal.Signals(signum).name}: stopping after the lines being "
                  "written (again to stop at once)", file=sys.stderr, flush=True)
            stop.set()
            for s in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(s)        # a second signal stops at once

        for s in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(s, on_signal, s)
        in_flight = min(engine.max_queue, 2 * engine.parallel)
        await run_local(app, pending, writer, progress, in_flight, stop)
        return stop.is_set()

    try:
        return asyncio.run(main())
    finally:
        from cpullm.generate.chat import stop_render_worker
        writer.close()
        engine.close()
        stop_render_worker()
