"""``cpullm list`` (also ``models``, ``ls``): the models in the store, as Ollama's ``list``."""
from __future__ import annotations

import datetime
import json
import time


def add_parser(sub):
    p = sub.add_parser("list", aliases=["models", "ls"], help="list the models in the model store",
                       description="The stored models: name (what run/serve/show/rm take), family, "
                                   "parameters, quantization, size on disk, when last used.")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def size_text(n) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def ago(ts: float | None) -> str:
    """A Unix time as Ollama shows it: "5 minutes ago", or "never"."""
    if not ts:
        return "never"
    s = max(0.0, time.time() - ts)
    for unit, n in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if s >= n:
            k = int(s // n)
            return f"{k} {unit}{'s' if k > 1 else ''} ago"
    return "just now"


def when(ts: float | None) -> str:
    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M") if ts else "-"


def one_line(text: str, width: int = 100) -> str:
    """A reason shown in the table: one line, printable, cut to ``width`` characters."""
    text = " ".join(str(text).split())
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text if len(text) <= width else text[:width - 3] + "..."


def print_table(columns, rows) -> None:
    """Print a header and the rows as fixed-width columns, as Ollama's tables. ``columns``:
    (title, width) or (title, width, spaces before it; default 1); a negative width right-aligns,
    width 0 is the last column (one line, not padded). Every cell is cut to its width."""
    def line(cells):
        out = ""
        for i, (col, cell) in enumerate(zip(columns, cells)):
            width = col[1]
            text = one_line(str(cell), abs(width) if width else 100)
            out += (" " * (col[2] if len(col) > 2 else 1) if i else "") + \
                (text.rjust(-width) if width < 0 else text.ljust(width) if width else text)
        return out.rstrip()
    print(line([col[0] for col in columns]))
    for row in rows:
        print(line(row))


def params_text(n: int) -> str:
    return (f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M") if n else "?"


def run(args) -> int:
    from cpullm.store import list_models

    models = list_models()
    if args.json:
        print(json.dumps(models, indent=2, default=str))
        return 0
    if not models:
        print("no models in the store; fetch one with `cpullm pull smollm2-135m-instruct`")
        return 0
    rows = []
    for m in models:
        if m.get("broken"):
            rows.append((m["name"], "(broken)", "?", "?", size_text(m.get("size_bytes", 0)),
                         f"-  {one_line(m['broken'])}"))
        else:
            rows.append((m["name"], m.get("family") or "?", params_text(m.get("params", 0)),
                         m.get("quantization") or "?", size_text(m.get("size_bytes", 0)), ago(m.get("last_used"))))
    print_table([("NAME", 32), ("FAMILY", 10), ("PARAMS", -7), ("QUANT", 9), ("SIZE", -9), ("LAST USED", 0, 2)], rows)
    return 0
