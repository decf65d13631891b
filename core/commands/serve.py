"""``cpullm serve [MODEL]``: an OpenAI-compatible HTTP API (and a small chat page) for one model."""
from __future__ import annotations

import argparse
import os
import sys

from .common import add_model_options, load_model, positive_int

EPILOG = """\
endpoints: GET /v1/models, POST /v1/chat/completions, POST /v1/completions (stream or not),
GET /health, GET / (chat page). Point an OpenAI client at http://HOST:PORT/v1.
Requests that omit sampling fields get OpenAI's defaults (temperature 1, top_p 1), overridden
by the model's generation_config.json. One generation runs at a time; others wait in order.
Without --api-key anyone who can reach the port can use the model: the server binds 127.0.0.1
unless --host says otherwise."""


def add_parser(sub):
    p = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API and a chat page",
                       description="Serve one model over an OpenAI-compatible HTTP API.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--api-key", default=os.environ.get("CPULLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/ (default: $CPULLM_API_KEY; none)")
    p.add_argument("--model-name", default=None,
                   help="model id clients send and /v1/models lists (default: the directory name)")
    p.add_argument("--max-request-bytes", type=positive_int, default=4 * 2**20,
                   help="largest request body accepted, larger ones get 413 (default 4 MiB)")
    p.add_argument("--max-queue", type=positive_int, default=64,
                   help="requests allowed to wait for the model, more get 503 (default 64)")
    p.add_argument("--log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="server log level; info and debug also log each request (default warning)")
    return p


def run(args) -> int:
    from cpullm.errors import ConfigError

    try:
        from cpullm.server import is_loopback, serve
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"cpullm serve needs starlette and uvicorn ({exc}); install them with "
                          "pip install 'cpullm[serve]'") from None
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in 0..65535, got {args.port}")
    if not is_loopback(args.host) and not args.api_key:
        print(f"cpullm: warning: listening on {args.host} without --api-key: anyone who can reach "
              "this port can use the model", file=sys.stderr, flush=True)
    model = load_model(args)
    try:
        serve(model, host=args.host, port=args.port, api_key=args.api_key or None,
              model_id=args.model_name, max_request_bytes=args.max_request_bytes,
              max_queue=args.max_queue, log_level=args.log_level,
              announce=lambda line: print(line, flush=True))
    except KeyboardInterrupt:
        pass
    print("cpullm: server stopped", file=sys.stderr, flush=True)
    return 0
