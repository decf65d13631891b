"""``cpullm bench``: prefill / decode tokens/s, time to first token, load and compile times,
memory, and (with ``--profile``) a per-op breakdown. Definitions: ``cpullm.bench``."""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from ...errors import MissingDependencyError, OutputPathError
from .common import add_model_options, add_speculative_options, load_model, positive_int


def add_parser(sub):
    p = sub.add_parser("bench", help="measure prefill/decode speed, load time and memory",
                       description="Measure a model: medians over --repeat runs of prefill and decode "
                                   "tokens/s (short context and after a 512-token prefill), time to "
                                   "first token, load time with the execution cache MISS and HIT, "
                                   "numba compile time, memory. Definitions: cpullm.bench.")
    add_model_options(p)
    add_speculative_options(p)
    p.add_argument("--prompt-tokens", type=positive_int, default=512, help="prompt length (default 512)")
    p.add_argument("--gen-tokens", type=positive_int, default=128, help="decode steps (default 128)")
    p.add_argument("--context-tokens", type=positive_int, default=512,
                   help="context of the second decode rate, decode @N (default 512; e.g. 8192 with --ctx 32768)")
    p.add_argument("--repeat", type=positive_int, default=3, help="runs; medians are reported (default 3)")
    p.add_argument("--profile", action="store_true",
                   help="add a per-op breakdown of decode and prefill time (one extra profiled run)")
    p.add_argument("--plot", metavar="FILE", default=None,
                   help="write the per-op profile as a PNG bar chart (implies --profile; needs matplotlib)")
    p.add_argument("--no-load-timing", action="store_true",
                   help="skip the cache MISS/HIT load-time child processes")
    p.add_argument("--no-compile-timing", action="store_true",
                   help="skip the cold-numba-cache compile-time child process")
    p.add_argument("--concurrency", type=concurrency_list, default=None, metavar="N[,N...]",
                   help="instead: N streams at once through the scheduler (--prompt-tokens each, "
                        "--gen-tokens greedy tokens each): aggregate and per-stream decode tokens/s, "
                        "time to first token median and p95; a list (1,2,4,8) gives the curve")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def concurrency_list(text: str) -> list[int]:
    import argparse
    try:
        ns = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ns = []
    if not ns or min(ns) < 1:
        raise argparse.ArgumentTypeError(f"give stream counts >= 1 separated by commas (e.g. 1,2,4,8), got {text!r}")
    return ns


def check_args(args) -> None:
    """What can fail before the model loads and the benchmark runs: --plot's matplotlib and path."""
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError as exc:
            raise MissingDependencyError(
                f"--plot needs matplotlib ({exc}): pip install 'cpullm[plot]', or leave out --plot"
            ) from None
        check_writable_file(args.plot, "--plot")


def check_writable_file(path, option: str) -> None:
    """Raise OutputPathError unless a file can be created at path (an existing one replaced).

    A file is created and removed in the target folder: permission bits alone do not tell (root
    ignores them; a read-only mount does not).
    """
    target = Path(path).expanduser()
    folder = target.parent.resolve()
    if target.is_dir():
        raise OutputPathError(f"{option} {path} is a directory; give a file name, "
                              f"e.g. {option} {target / 'profile.png'}")
    if folder.exists() and not folder.is_dir():
        raise OutputPathError(f"{option} {path}: {folder} is a file, not a folder; write elsewhere")
    if not folder.is_dir():
        raise OutputPathError(f"{option} {path}: the folder {folder} does not exist; "
                              f"create it (mkdir -p {folder}) or write elsewhere")
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=f".{target.name}.", suffix=".probe")
    except OSError as exc:
        raise OutputPathError(f"{option} {path}: cannot write in {folder} ({exc.strerror}); "
                              f"choose a writable folder") from None
    os.close(fd)
    os.unlink(probe)
    if target.exists() and not os.access(target, os.W_OK):
        raise OutputPathError(f"{option} {path} exists and is read-only; remove it or write elsewhere")


def run(args) -> int:
    from cpullm.bench import format_report, plot_profile, run_bench

    def say(msg):
        if not args.json:
            print(f"cpullm bench: {msg}", file=sys.stderr, flush=True)

    profile = bool(args.profile or args.plot)
    model = load_model(args)
    say(f"loaded {model.model_dir} in {model.load_s:.2f} s (cache {model.cache_status})")
    if args.concurrency:
        return run_concurrency_bench(model, args, say)
    if args.speculative not in (None, "off") or args.draft_model is not None:
        return run_speculative_bench(model, args, say)
    result = run_bench(model, prompt_tokens=args.prompt_tokens, gen_tokens=args.gen_tokens,
                       repeat=args.repeat, profile=profile, context_tokens=args.context_tokens, load=not args.no_load_timing,
                       compile=not args.no_compile_timing, progress=say)
    if args.plot:
        result["plot"] = str(plot_profile(result, args.plot))
    if args.json:
        print(json.dumps(result, default=float))
    else:
        print(format_report(result))
        if args.plot:
            print(f"\n  profile chart written to {result['plot']}")
    return 0


def run_speculative_bench(model, args, say) -> int:
    """A copying workload (a standard-library module to repeat), greedy, plain and with the
    chosen speculation: decode tokens/s of each and tokens accepted per verify pass."""
    from cpullm.bench.speculative import copy_prompt, measure
    ids = copy_prompt(model.tokenizer, args.prompt_tokens)
    say(f"speculative ({model.speculative.mode}, draft max {model.speculative.draft_max}): "
        f"{len(ids)}-token copying prompt, {args.gen_tokens} tokens plain and speculative")
    r = measure(model, ids, args.gen_tokens, model.speculative)
    if args.json:
        print(json.dumps({"speculative": r}, default=float))
    else:
        print(f"speculative {r['mode']} (draft max {r['draft_max']}): {r['gen_tokens']} tokens, decode "
              f"{r['plain_decode_tps']:.2f} tok/s plain, {r['speculative_decode_tps']:.2f} tok/s speculative "
              f"({r['speedup']:.2f}x); {r['accepted_per_pass']:.2f} tokens accepted per verify pass "
              f"({r['verify_passes']} passes); output identical: {r['identical']}")
    return 0


def run_concurrency_bench(model, args, say) -> int:
    from cpullm.bench import format_concurrency, run_concurrency

    rows = []
    for n in args.concurrency:
        say(f"{n} stream(s) of {args.prompt_tokens} + {args.gen_tokens} tokens")
        rows.append(run_concurrency(model, n, args.prompt_tokens, args.gen_tokens))
    if args.json:
        print(json.dumps({"concurrency": rows}, default=float))
    else:
        print(format_concurrency(rows))
    return 0
