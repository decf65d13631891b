"""``cpullm cp SOURCE DEST``: the stored model SOURCE under a second name (as Ollama's ``cp``);
its files are hard-linked, so the copy costs no disk where the filesystem allows."""
from __future__ import annotations


def add_parser(sub):
    p = sub.add_parser("cp", help="store a model under a second name",
                       description="Copy a stored model to a new store name (files hard-linked where "
                                   "possible); `cpullm serve DEST` then answers to DEST.")
    p.add_argument("source", metavar="SOURCE", help="a name from `cpullm list`")
    p.add_argument("dest", metavar="DEST", help="the new name")
    return p


def run(args) -> int:
    from cpullm.store import copy_model

    path = copy_model(args.source, args.dest)
    print(f"copied {args.source} to {args.dest} ({path})")
    return 0
