"""``cpullm serve [MODEL]``: an OpenAI-compatible HTTP API (and a small chat page) for one model."""
from __future__ import annotations

import argparse
import os
import sys

from .common import add_model_options, add_speculative_options, load_model, non_negative_int, positive_int

EPILOG = """\
endpoints: GET /v1/models, POST /v1/chat/completions, POST /v1/completions (stream or not),
GET /health, GET /metrics (Prometheus text; needs the API key when one is set), GET / (chat
page). Point an OpenAI client at http://HOST:PORT/v1.
Requests that omit sampling fields get OpenAI's defaults (temperature 1, top_p 1), overridden
by the model's generation_config.json. Up to --parallel requests generate at once (each decode
step advances all of them in one pass over the weights; long prompts are prefilled a chunk at a
time between steps); the others wait in arrival order. KV memory for --parallel sequences of
--ctx tokens is allocated at start (GET /health: kv_bytes_planned); a prompt longer than --ctx
gets a 400. Requests whose prompts start with the same whole --prefill-chunk blocks (a shared
system prompt) restore that KV instead of prefilling it again, within --prefix-cache MiB
(GET /health: prefix_cache hits, reused_tokens, bytes).
Every answer is at most --max-tokens-cap tokens (also when a request omits max_tokens; a larger
max_tokens ends with finish_reason "length") and --request-timeout seconds of generation; GET
/health and /v1/models report these limits. The model's chat template renders in a separate
process within --template-timeout seconds and 512 MB; a template that overruns is refused with
a 400, and /v1/completions still works.
Without an API key anyone who can reach the port can use the model: the server binds 127.0.0.1
unless --host says otherwise. The key comes from --api-key-file (its first line), else
--api-key (which other users can read with ps), else the CPULLM_API_KEY environment variable.
--tenant-keys-file gives several keys, one per line, each a tenant: a tenant shares cached
prompt prefixes only with requests made with its own key (a request's "cache_salt" narrows that
further). /health shows the prefix cache's statistics only to a request with a key.
Ctrl-C (SIGINT) or SIGTERM stops the server: it stops accepting, waiting requests get a 503
JSON error, running generations have --shutdown-timeout seconds to finish, then the rest end
with an error event (streams) or the 503 error; exit status 0.
With --ray, --replicas copies of this server (each --threads cores, its own scheduler and prefix
cache) run on Ray Serve behind one endpoint with the same routes, key and limits; requests whose
prompts start alike go to the same replica; Ray restarts a replica that dies (docs/scaling.md)."""


def positive_seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not (v > 0 and v < float("inf")):
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return v


def non_negative_seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not (0 <= v < float("inf")):
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {text}")
    return v


def add_parser(sub):
    p = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API and a chat page",
                       description="Serve one model over an OpenAI-compatible HTTP API.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(p)
    add_speculative_options(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/ (visible in ps: prefer "
                        "--api-key-file or $CPULLM_API_KEY; default: $CPULLM_API_KEY, else none)")
    p.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="read the API key from the first line of FILE (not shown in ps)")
    p.add_argument("--tenant-keys-file", default=None, metavar="FILE",
                   help="API keys, one per line, each a tenant: a tenant's cached prompt prefixes are "
                        "never reused (nor timed) by another key")
    p.add_argument("--model-name", "--alias", dest="model_name", default=None,
                   help="model id clients send and /v1/models lists (default: the store name or "
                        "file name it was started with; the file name is always accepted too)")
    p.add_argument("--max-request-bytes", type=positive_int, default=4 * 2**20,
                   help="largest request body accepted, larger ones get 413 (default 4 MiB)")
    p.add_argument("--queue", "--max-queue", dest="max_queue", type=non_negative_int, default=64, metavar="N",
                   help="requests allowed to wait while every --parallel slot is busy; more get 429 with "
                        "Retry-After at once (default 64)")
    p.add_argument("--parallel", "-np", "--parallel-slots", dest="parallel", type=positive_int, default=None, metavar="N",
                   help="requests generating at once (default: 4 per thread, at most 8, and no more "
                        "than whose KV fits in half the available memory)")
    p.add_argument("--prefix-cache", type=non_negative_int, default=None, metavar="MIB",
                   help="MiB of KV kept for prompt prefixes shared between requests (a system prompt), "
                        "reused in whole prefill chunks instead of prefilling them again; 0 turns it off "
                        "(default: 256, less if the memory left after the --parallel KV is short)")
    p.add_argument("--prefill-chunk", type=positive_int, default=None, metavar="N",
                   help="prompt tokens prefilled per step between the others' decode steps, and the "
                        "block in which shared prefixes are reused (default: the program's chunk, 512)")
    p.add_argument("--max-tokens-cap", type=positive_int, default=1024,
                   help="longest answer in tokens, and what an omitted max_tokens means (default 1024)")
    p.add_argument("--request-timeout", type=positive_seconds, default=300.0, metavar="SECONDS",
                   help="generation time per request; the answer then ends with finish_reason "
                        "\"length\" (default 300)")
    p.add_argument("--template-timeout", type=positive_seconds, default=10.0, metavar="SECONDS",
                   help="time to render the chat template of one request (default 10)")
    p.add_argument("--shutdown-timeout", type=non_negative_seconds, default=10.0, metavar="SECONDS",
                   help="on SIGTERM/SIGINT, running generations get this long to finish before they "
                        "end with an error event (default 10; 0: end them at once)")
    p.add_argument("--header-timeout", type=positive_seconds, default=10.0, metavar="SECONDS",
                   help="time a client has to send a request's headers, else the connection "
                        "closes (default 10)")
    p.add_argument("--body-timeout", type=positive_seconds, default=30.0, metavar="SECONDS",
                   help="time a client has to send a request's body, else 408 (default 30)")
    p.add_argument("--ray", action="store_true",
                   help="serve --replicas replicas on Ray Serve behind one endpoint, requests sharing a "
                        "prompt prefix on the same replica (pip install 'cpullm[ray]'; docs/scaling.md)")
    p.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="with --ray: the Ray cluster to join (default: $RAY_ADDRESS, else a local one)")
    p.add_argument("--replicas", type=positive_int, default=None, metavar="N",
                   help="with --ray: model replicas, each on --threads cores of one node (default 1)")
    p.add_argument("--max-replicas", type=positive_int, default=None, metavar="N",
                   help="with --ray: scale between --replicas and N replicas on the requests each "
                        "holds (Ray Serve autoscaling; default: a fixed --replicas)")
    p.add_argument("--log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="server log level; info and debug also log each request (default warning)")
    return p


def api_key(args) -> str | list[str] | None:
    """The key from --api-key-file (its first line), the keys of --tenant-keys-file (one per
    line: several tenants, whose cached prompt prefixes are kept apart), --api-key or
    $CPULLM_API_KEY (one source at a time); each visible ASCII, refused at start otherwise."""
    from cpullm.errors import ConfigError
    from cpullm.serve.http import check_api_keys

    if args.api_key_file is not None:
        if args.api_key is not None or getattr(args, "tenant_keys_file", None) is not None:
            raise ConfigError("give the API key once: --api-key, --api-key-file or --tenant-keys-file, "
                              "not both")
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                key = f.readline(4097).strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read --api-key-file {args.api_key_file} "
                              f"({getattr(exc, 'strerror', None) or exc}); give a readable text file "
                              "whose first line is the key") from None
        if not key or len(key) > 4096:
            raise ConfigError(f"--api-key-file {args.api_key_file}: the first line must hold the key "
                              "(1 to 4096 characters)")
        check_api_keys(key)
        return key
    if getattr(args, "tenant_keys_file", None) is not None:
        if args.api_key is not None:
            raise ConfigError("give the API keys once: --api-key or --tenant-keys-file, not both")
        try:
            with open(args.tenant_keys_file, encoding="utf-8") as f:
                lines = f.read(1 << 20).splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read --tenant-keys-file {args.tenant_keys_file} "
                              f"({getattr(exc, 'strerror', None) or exc}); give a readable text file "
                              "with one key per line") from None
        keys = [k.strip() for k in lines if k.strip()]
        if not keys or len(keys) > 4096:
            raise ConfigError(f"--tenant-keys-file {args.tenant_keys_file} must hold 1 to 4096 keys, one per line")
        return check_api_keys(keys)
    key = args.api_key if args.api_key is not None else os.environ.get("CPULLM_API_KEY")
    if key:
        check_api_keys(key)
    return key or None


def default_model_id(name: str | None, model) -> str:
    """The id the server answers to: the store name the model was given as (``cpullm serve
    smollm2-135m-instruct``), else the model's file or directory name."""
    from pathlib import Path

    from cpullm.loading.locations import models_dir

    if name and not Path(name).expanduser().exists():
        return name.strip()
    path = Path(str(model.model_dir)).resolve()
    root = models_dir().resolve()
    for folder in (path, path.parent):         # a store entry (the default model too)
        if folder.parent == root:
            return folder.name.replace("--", "/")
    return path.name
def check_args(args) -> None:
    from cpullm.errors import ConfigError

    if not args.ray and (args.ray_address is not None or args.replicas is not None or
                         args.max_replicas is not None):
        raise ConfigError("--ray-address, --replicas and --max-replicas go with --ray; add --ray "
                          "(or drop them)")
    if args.ray:
        from cpullm.ray import require_ray
        require_ray()


def run(args) -> int:
    from cpullm.errors import ConfigError

    try:
        from cpullm.serve import is_loopback, serve
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"cpullm serve needs starlette and uvicorn ({exc}); install them with "
                          "pip install 'cpullm[serve]'") from None
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in 0..65535, got {args.port}")
    key = api_key(args)
    if not is_loopback(args.host) and not key:
        print(f"cpullm: warning: listening on {args.host} without an API key: anyone who can reach "
              "this port can use the model", file=sys.stderr, flush=True)
    from cpullm.generate import chat

    chat.RENDER_TIMEOUT_S = args.template_timeout
    if args.ray:
        from cpullm.ray.cli import serve_on_ray
        return serve_on_ray(args, key)
    model = load_model(args)
    model_id = args.model_name or default_model_id(args.model, model)
    state = []

    def ready(host: str, port: int) -> None:
        from cpullm.serve.running import write_state
        try:
            state.append(write_state({"host": host, "port": port, "model": model_id,
                                      "model_path": str(model.model_dir), "api_key": bool(key)}))
        except OSError as exc:      # `cpullm ps` will not list it; serving goes on
            print(f"cpullm: warning: cannot record this server for `cpullm ps` ({exc})",
                  file=sys.stderr, flush=True)
    try:
        serve(model, host=args.host, port=args.port, api_key=key, on_ready=ready,
              model_id=model_id, model_aliases=tuple(a for a in (args.model,) if a and a != model_id), max_request_bytes=args.max_request_bytes,
              max_queue=args.max_queue, log_level=args.log_level,
              announce=lambda line: print(line, flush=True), max_tokens_cap=args.max_tokens_cap,
              request_timeout=args.request_timeout, header_timeout=args.header_timeout,
              body_timeout=args.body_timeout, parallel=args.parallel,
              prefix_cache_bytes=None if args.prefix_cache is None else args.prefix_cache * 2**20,
              prefill_chunk=args.prefill_chunk, shutdown_timeout=args.shutdown_timeout)
    except KeyboardInterrupt:
        pass
    finally:
        from cpullm.serve.running import remove_state
        for path in state:
            remove_state(path)
    print("cpullm: server stopped", file=sys.stderr, flush=True)
    return 0
