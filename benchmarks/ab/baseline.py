"""A kernel module as it was at a git revision, importable beside the working tree's own."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def load_at_revision(rev: str, path: str, module: str, tmp: Path):
    """``git show REV:PATH`` of this repository, written into ``tmp`` and imported as ``module``
    (a dotted name inside the package the file belongs to, so its relative imports find the
    working tree's helpers); nothing is written into the package folder."""
    proc = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{path}"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"git show {rev}:{path} failed: {proc.stderr.strip()}")
    src = Path(tmp) / (module.rsplit(".", 1)[-1] + ".py")
    src.write_text(proc.stdout)
    spec = importlib.util.spec_from_file_location(module, src)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod
