"""``cpullm show MODEL``: one stored model's architecture, size, context, template, license,
files and compiled programs (as Ollama's ``show``)."""
from __future__ import annotations

import json

from .models import ago, one_line, params_text, size_text, when


def add_parser(sub):
    p = sub.add_parser("show", help="show a stored model's details",
                       description="Architecture, parameters, quantization, context length, chat "
                                   "template, license, files and compiled programs of a stored model.")
    p.add_argument("name", metavar="MODEL", help="a name from `cpullm list`")
    p.add_argument("--template", action="store_true", help="print the whole chat template")
    p.add_argument("--license", action="store_true", help="print the whole license")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def run(args) -> int:
    from cpullm.store import model_details

    d = model_details(args.name)
    if args.json:
        print(json.dumps(d, indent=2, default=str))
        return 0
    if args.template or args.license:
        text = d["chat_template"] if args.template else d["license"]
        print(text if text else f"(no {'chat template' if args.template else 'license'} in this model)")
        return 0
    rows = [("name", d["name"]), ("path", d["path"]),
            ("architecture", ", ".join(d["architectures"]) or d.get("family") or "?"),
            ("family", d.get("family") or "?"), ("parameters", params_text(d.get("params", 0))),
            ("quantization", d.get("quantization") or "?"),
            ("context", str(d["context"]) if d.get("context") else "?"),
            ("size on disk", size_text(d["size_bytes"])),
            ("chat template", _first_line(d["chat_template"], "none (a base model: plain completion only)")),
            ("license", _first_line(d["license"], "not stated in the model files"))]
    if d.get("broken"):
        rows.append(("problem", one_line(d["broken"])))
    for k, v in rows:
        print(f"  {k:<14}{v}")
    print("  files")
    for f in d["files"]:
        print(f"    {one_line(f['name'], 60):<60} {size_text(f['size_bytes']):>9}")
    progs = d["programs"]
    print(f"  compiled programs ({len(progs)}, {size_text(sum(p['size_bytes'] for p in progs))};"
          " `cpullm cache ls` lists all)" if progs else "  compiled programs: none yet (built on first run)")
    for p in progs:
        print(f"    {p['key'][:12]}  {p['quant'] or '?':<5} ctx {p['n_ctx'] or '?':>6} "
              f"{size_text(p['size_bytes']):>9}  created {when(p['created'])}, used {ago(p['last_used'])}")
    return 0


def _first_line(text: str | None, none: str) -> str:
    if not text:
        return none
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    more = f" ... ({len(text)} characters; --template/--license prints it)" if len(lines) > 1 else ""
    return one_line(lines[0], 60) + more
