"""Print a key naming everything that decides what ``pip install`` puts in this environment, and
exit 1 when the repository's own packages are not installed from this checkout.

Used by scripts/env.sh: it reinstalls only when the key differs from the one stored after the last
install, or a package is missing. Editable installs pick up code edits without a reinstall, so the
key holds what they do not: the pyproject files, the constraints file, the pip arguments, the
interpreter and the checkout's location.

    python scripts/install_state.py PIP_ARG...
"""
from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Each module, and the folder its install must point into.
OWN_MODULES = {"cpullm": ROOT / "core", "cpullm_llama": ROOT / "plugins" / "llama",
               "cpullm_qwen": ROOT / "plugins" / "qwen", "cpullm_gemma": ROOT / "plugins" / "gemma"}


def install_key(pip_args: list[str]) -> str:
    h = hashlib.sha256()
    for part in (str(ROOT), sys.executable, sys.version, *pip_args):
        h.update(part.encode() + b"\0")
    for path in [ROOT / "pyproject.toml", *sorted(ROOT.glob("plugins/*/pyproject.toml")),
                 ROOT / "constraints.txt"]:
        h.update(str(path.relative_to(ROOT)).encode() + b"\0")
        h.update(path.read_bytes() if path.is_file() else b"(absent)")
    return h.hexdigest()


def installed_from_here() -> bool:
    for module, folder in OWN_MODULES.items():
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None or folder not in Path(spec.origin).resolve().parents:
            return False
    return True


if __name__ == "__main__":
    print(install_key(sys.argv[1:]))
    sys.exit(0 if installed_from_here() else 1)
