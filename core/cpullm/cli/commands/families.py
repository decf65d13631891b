"""``cpullm families``: installed families, their plugins and versions, load errors."""
from __future__ import annotations

import json


def add_parser(sub):
    p = sub.add_parser("families", help="list installed model families and plugin errors")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def run(args) -> int:
    from cpullm.loading import plugins

    reg = plugins.discover()
    # model_types each family really serves after conflict resolution (a loser keeps the rest)
    served = {(f.plugin, f.name): list(f.model_types) for f in reg.families}
    rows = []
    for info in reg.plugins:
        rows.append({
            "plugin": info.distribution or info.name,
            "entry_point": info.name,
            "version": info.version,
            "module": info.module,
            "families": [{"name": f.name,
                          "model_types": served.get((f.plugin, f.name), []),
                          "claimed_model_types": list(f.model_types),
                          "description": f.description} for f in info.families],
            "error": info.error,
        })
    if args.json:
        print(json.dumps({"plugins": rows, "conflicts": reg.conflicts}, indent=2))
        return 0
    if not rows:
        print("no cpullm plugins installed; install one, e.g. pip install cpullm-plugin-llama")
    for r in rows:
        head = f"{r['plugin']} {r['version'] or ''}".strip()
        if r["error"]:
            print(f"{head}  [failed to load: {r['error']}]")
            continue
        print(head)
        for f in r["families"]:
            lost = [m for m in f["claimed_model_types"] if m not in f["model_types"]]
            extra = f"  (also claims {', '.join(lost)}: served by another plugin)" if lost else ""
            print(f"  {f['name']:<12} model_types: {', '.join(f['model_types']) or '-'}{extra}")
    for c in reg.conflicts:
        print(f"warning: {c}")
    return 0
