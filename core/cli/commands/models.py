"""``cpullm models``: the models in the store."""
from __future__ import annotations

import json


def add_parser(sub):
    p = sub.add_parser("models", help="list the models in the model store")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def _size(n) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _one_line(text: str, width: int = 100) -> str:
    """A reason shown in the table: one line, printable, cut to ``width`` characters."""
    text = " ".join(str(text).split())
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text if len(text) <= width else text[:width - 3] + "..."


def run(args) -> int:
    from cpullm.store import list_models

    models = list_models()
    if args.json:
        print(json.dumps(models, indent=2, default=str))
        return 0
    if not models:
        print("no models in the store; fetch one with `cpullm pull smollm2-135m-instruct`")
        return 0
    print(f"{'NAME':<32} {'FAMILY':<12} {'PARAMS':>8} {'SIZE':>10}  EXEC CACHE")
    for m in models:
        if m.get("broken"):
            print(f"{m['name']:<32} {'(broken)':<12} {'?':>8} {_size(m.get('size_bytes', 0)):>10}  "
                  f"-  {_one_line(m['broken'])}")
            continue
        params = f"{m.get('params', 0) / 1e6:.0f}M" if m.get("params") else "?"
        print(f"{m['name']:<32} {str(m.get('model_type') or m.get('family') or '?'):<12} {params:>8} "
              f"{_size(m.get('size_bytes', 0)):>10}  {'yes' if m.get('has_exec_cache') else 'no'}")
    return 0
