"""``cpullm serve --ray``: join or start the cluster, deploy, wait for Ctrl-C, tear down."""
from __future__ import annotations

import signal
import sys
import threading


def serve_options(args) -> dict:
    """How each replica loads its model and builds the server (the CLI's flags)."""
    name = args.model
    if name is None:
        from cpullm.store import ensure_default_model
        name = str(ensure_default_model())
    return {"model": name, "quant": args.quant, "threads": args.threads, "n_ctx": args.ctx,
            "kv_dtype": args.kv_dtype, "cache_dir": args.cache_dir, "use_cache": not args.no_cache,
            "model_id": args.model_name, "parallel": args.parallel,
            "prefix_cache_bytes": None if args.prefix_cache is None else args.prefix_cache * 2**20,
            "prefill_chunk": args.prefill_chunk, "max_tokens_cap": args.max_tokens_cap,
            "request_timeout": args.request_timeout, "template_timeout": args.template_timeout}


def serve_on_ray(args, api_key: str | None) -> int:
    from . import connect

    replicas, threads = args.replicas or 1, args.threads or 1
    options = serve_options(args)
    ray = connect(args.ray_address)
    from . import serve as ray_serve

    stop = threading.Event()
    old = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        ray_serve.deploy(options, replicas, threads, host=args.host, port=args.port, api_key=api_key,
                         max_request_bytes=args.max_request_bytes, body_timeout=args.body_timeout,
                         max_queue=args.max_queue, max_replicas=args.max_replicas)
        shown = f"[{args.host}]" if ":" in args.host else args.host
        scale = f"{replicas}-{args.max_replicas}" if args.max_replicas else f"{replicas}"
        print(f"cpullm: serving {args.model_name or options['model']} on Ray ({scale} replicas x "
              f"{threads} threads) at http://{shown}:{args.port}/ (OpenAI API: "
              f"http://{shown}:{args.port}/v1)", flush=True)
        stop.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        ray_serve.shutdown()
        ray.shutdown()
    print("cpullm: server stopped", file=sys.stderr, flush=True)
    return 0
