"""``cpullm rm MODEL...``: delete stored models and their compiled programs (as Ollama's ``rm``).
Only store names are accepted, never paths: nothing outside the store is deleted."""
from __future__ import annotations

import sys

from .models import size_text


def add_parser(sub):
    p = sub.add_parser("rm", help="delete a stored model and its compiled programs",
                       description="Delete stored models (names from `cpullm list`) with their compiled "
                                   "programs, after a confirmation unless -y. Paths are refused: rm "
                                   "deletes only what is inside the model store.")
    p.add_argument("names", nargs="+", metavar="MODEL", help="a name from `cpullm list`")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    return p


def run(args) -> int:
    from cpullm.errors import StoreError
    from cpullm.store import model_details, remove_model

    details = [model_details(n) for n in args.names]    # every name checked before anything goes
    if not args.yes:
        for d in details:
            progs = d["programs"]
            print(f"{d['name']}: {d['path']} ({size_text(d['size_bytes'])})"
                  + (f" and {len(progs)} compiled program(s) ({size_text(sum(p['size_bytes'] for p in progs))})"
                     if progs else ""), file=sys.stderr)
        if not _confirm(f"delete {'these models' if len(details) > 1 else 'this model'}? [y/N] "):
            raise StoreError("nothing deleted (not confirmed); add -y to delete without asking")
    for d in details:
        r = remove_model(d["name"])
        print(f"deleted {d['name']} ({size_text(r['bytes'])}"
              + (f", {r['programs']} compiled program(s), {size_text(r['program_bytes'])}" if r["programs"] else "")
              + ")")
    return 0


def _confirm(question: str) -> bool:
    """A yes from the terminal; stdin that is not a terminal never confirms (use -y)."""
    from cpullm.errors import StoreError
    try:
        interactive = sys.stdin is not None and sys.stdin.isatty()
    except (OSError, ValueError):
        interactive = False
    if not interactive:
        raise StoreError("rm asks for confirmation on a terminal; add -y to delete without asking")
    try:
        answer = input(question)
    except EOFError:
        return False
    return answer.strip().lower() in ("y", "yes")
