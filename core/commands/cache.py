"""``cpullm cache ls | clear [MODEL]``: the execution cache."""
from __future__ import annotations

import datetime
import json


def add_parser(sub):
    p = sub.add_parser("cache", help="list or clear compiled execution programs")
    p.add_argument("action", choices=["ls", "clear"])
    p.add_argument("model", nargs="?", default=None, help="with clear: only this model (directory or name)")
    p.add_argument("--cache-dir", default=None, help="cache root (default ~/.cache/cpullm or $CPULLM_CACHE_DIR)")
    p.add_argument("--json", action="store_true", help="machine-readable output (ls)")
    return p


def _when(ts):
    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M") if ts else "-"


def run(args) -> int:
    from cpullm import cache_format

    if args.action == "clear":
        n = cache_format.clear(args.cache_dir, args.model)
        print(f"removed {n} execution cache entr{'y' if n == 1 else 'ies'}")
        return 0
    entries = cache_format.list_entries(args.cache_dir)
    if args.json:
        print(json.dumps(entries, indent=2))
        return 0
    if not entries:
        print(f"the execution cache is empty ({cache_format.exec_dir(args.cache_dir)})")
        return 0
    print(f"{'MODEL':<40} {'QUANT':<5} {'KEY':<14} {'SIZE':>9} {'CREATED':<17} LAST USED")
    for e in entries:
        model = (e["model"] or "?")[-40:]
        print(f"{model:<40} {e['quant'] or '?':<5} {e['key'][:12]:<14} {e['size_bytes'] / 2**20:8.1f}M "
              f"{_when(e['created']):<17} {_when(e['last_used'])}{'' if e['valid'] else '  (invalid)'}")
    return 0
