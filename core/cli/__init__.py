"""The ``cpullm`` command line (``cpullm`` or ``python -m cpullm.cli``). Each command lives in
``cpullm.cli.commands.<name>`` with ``add_parser(subparsers)`` and ``run(args) -> int``. User
errors print one line and exit 2."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from .. import __version__
from ..errors import CpullmError

COMMANDS = ["families", "run", "chat", "bench", "serve", "convert", "pull", "models", "cache"]
COMMANDS.append("batch")         # cpullm batch: a JSONL file of OpenAI batch requests


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cpullm", description="Run small language models fast on the CPU.")
    p.add_argument("--version", action="version", version=f"cpullm {__version__}")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            mod = importlib.import_module(f"cpullm.cli.commands.{name}")
        except ImportError as exc:   # a command whose optional pieces are absent still lists
            sp = sub.add_parser(name, help=f"(unavailable: {exc})")
            sp.set_defaults(func=lambda a, e=exc: _unavailable(e))
            continue
        sp = mod.add_parser(sub)
        sp.add_argument("--debug", action="store_true", help="show tracebacks")
        # check_args(args), where a command has it, fails early: before any model is loaded.
        sp.set_defaults(func=mod.run, check_args=getattr(mod, "check_args", None))
    return p


def _unavailable(exc) -> int:
    print(f"cpullm: this command is unavailable: {exc}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        if getattr(args, "check_args", None) is not None:
            args.check_args(args)
        return int(args.func(args) or 0)
    except CpullmError as exc:
        if args.debug or os.environ.get("CPULLM_DEBUG") == "1":
            raise
        print(f"cpullm: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0

