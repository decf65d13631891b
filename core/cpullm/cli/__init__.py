"""The ``cpullm`` command line (``cpullm`` or ``python -m cpullm.cli``). Each command lives in
``cpullm.cli.commands.<name>`` with ``add_parser(subparsers)`` and ``run(args) -> int``. User
errors print one line and exit 2.

Options are matched exactly (no argparse prefix matching: ``--top`` is not ``--top-k``), and an
unknown option is an error naming the nearest real one. llama.cpp's spellings (``-m``, ``-c``,
``-t``, ``--temp``, ...) are accepted beside ours; see :mod:`cpullm.cli.commands.common`."""
from __future__ import annotations

import argparse
import difflib
import importlib
import os
import sys

from .. import __version__
from ..errors import CpullmError

# (heading, commands) in the order `cpullm --help` shows them: how people look for them.
GROUPS = [
    ("run a model", ["run", "chat", "serve", "embed", "batch"]),
    ("manage models", ["pull", "list", "show", "rm", "cp", "ps"]),
    ("tools", ["bench", "convert", "cache", "families"]),
]
COMMANDS = [name for _, names in GROUPS for name in names]
MODULES = {"list": "models"}      # a command whose module has another name


class Parser(argparse.ArgumentParser):
    """An ArgumentParser without prefix matching whose "unrecognized argument" error names the
    nearest real option."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        """A command's options may come before, between or after its positionals
        (``cpullm run MODEL -n 5 "prompt"``): commands parse intermixed."""
        if self._subparsers is not None or getattr(self, "_intermixing", False):
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False

    def nearest_option(self, word: str) -> str | None:
        """The options ``word`` most likely meant: those it begins (what argparse's prefix
        matching guessed, now named instead), else the closest spelling."""
        flag = word.split("=", 1)[0]
        options = [o for o in self._option_string_actions if o.startswith("-")]
        longer = sorted(o for o in options if flag.startswith("--") and o.startswith(flag))
        if longer:
            return " or ".join(longer[:3])
        close = difflib.get_close_matches(flag, options, n=1, cutoff=0.7)
        return close[0] if close else None

    def unknown(self, extras: list[str]):
        """Exit with the usage error for ``extras`` (what no option consumed)."""
        first = extras[0]
        if first.startswith("-") and len(first) > 1:
            near = self.nearest_option(first)
            hint = f"; did you mean {near}?" if near else f"; `{self.prog} --help` lists the options"
            self.error(f"unknown option {first}{hint}")
        self.error(f"unexpected argument(s): {' '.join(extras)}")


def build_parser() -> Parser:
    p = Parser(prog="cpullm", description="Run small language models fast on the CPU.",
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"cpullm {__version__}")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    helps: dict[str, str] = {}
    p.commands = sub.choices          # command name or alias -> its parser
    for name in COMMANDS:
        try:
            mod = importlib.import_module(f"cpullm.cli.commands.{MODULES.get(name, name)}")
        except ImportError as exc:   # a command whose optional pieces are absent still lists
            sp = sub.add_parser(name, help=f"(unavailable: {exc})")
            sp.set_defaults(func=lambda a, e=exc: _unavailable(e))
            continue
        sp = mod.add_parser(sub)
        sp.add_argument("--debug", action="store_true", help="show tracebacks")
        # check_args(args), where a command has it, fails early: before any model is loaded.
        sp.set_defaults(func=mod.run, check_args=getattr(mod, "check_args", None))
    for action in sub._choices_actions:
        helps[action.dest] = action.help or ""
    sub._choices_actions.clear()      # listed by group in the epilog instead
    lines = []
    for heading, names in GROUPS:
        lines.append(f"{heading}:")
        lines += [f"  {n:<10}{helps.get(n, '')}" for n in names]
    p.epilog = "\n".join(lines) + "\n\n`cpullm COMMAND --help` shows a command's options."
    return p


def _unavailable(exc) -> int:
    print(f"cpullm: this command is unavailable: {exc}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if not getattr(args, "command", None):
        if extras:
            parser.unknown(extras)
        parser.print_help()
        return 2
    if extras:
        parser.commands[args.command].unknown(extras)
    try:
        from .commands.common import settle_model_args
        settle_model_args(args, getattr(args, "model_spare", None))
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
