"""``cpullm cache ls [--json] | clear [MODEL]``: the execution cache (compiled programs)."""
from __future__ import annotations

import datetime
import json


def add_parser(sub):
    p = sub.add_parser("cache", help="list or clear compiled execution programs",
                       description="ls: one line per cached program (model, key, size, created, "
                                   "last used). clear [MODEL]: delete all entries, or a model's.")
    p.add_argument("action", choices=["ls", "clear"])
    p.add_argument("model", nargs="?", default=None,
                   help="with clear: only this model (its directory, or its directory name)")
    p.add_argument("--cache-dir", default=None, help="cache root (default ~/.cache/cpullm or $CPULLM_CACHE_DIR)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def _when(ts):
    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M") if ts else "-"


def _size(n: int) -> str:
    return f"{n / 2**20:.1f}M" if n >= 2**20 else f"{n / 1024:.1f}K"


def run(args) -> int:
    from cpullm.compile import cache_format
    from cpullm.errors import CacheError

    if args.action == "clear":
        n = cache_format.clear(args.cache_dir, args.model)
        if args.model and n == 0:
            raise CacheError(f"no execution cache entry belongs to model {args.model!r}; "
                             "`cpullm cache ls` lists the cached models")
        if args.json:
            print(json.dumps({"removed": n}))
        else:
            print(f"removed {n} execution cache entr{'y' if n == 1 else 'ies'}")
        return 0
    if args.model:
        raise CacheError("`cpullm cache ls` takes no MODEL; use `cpullm cache clear MODEL` to delete one")
    entries = cache_format.list_entries(args.cache_dir)
    if args.json:
        print(json.dumps(entries, indent=2))
        return 0
    root = cache_format.exec_dir(args.cache_dir)
    if not entries:
        print(f"the execution cache is empty ({root})")
        return 0
    print(f"{'MODEL':<40} {'QUANT':<5} {'CTX':>6} {'KEY':<12} {'SIZE':>8} {'CREATED':<16}  LAST USED")
    for e in entries:
        model = e["model"] or "?"
        model = model if len(model) <= 40 else "…" + model[-39:]
        print(f"{model:<40} {e['quant'] or '?':<5} {e['n_ctx'] or '?':>6} {e['key'][:12]:<12} "
              f"{_size(e['size_bytes']):>8} {_when(e['created']):<16}  {_when(e['last_used'])}"
              f"{'' if e['valid'] else '  (invalid: rebuilt on next load)'}")
    total = sum(e["size_bytes"] for e in entries)
    print(f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}, {_size(total)} in {root}")
    return 0
