"""Write constraints.txt: the exact versions, taken from the running environment, of every package
that cpullm, its plugins and the extras test, serve, ray, bench and plot need, directly or not.

Run it (Python 3.11+) with the interpreter of an environment in which the whole suite passed:

    python scripts/lock.py            # rewrites constraints.txt at the repository root

scripts/test.sh installs with ``-c constraints.txt``, so a new upstream release cannot change the
tested set until this file is regenerated and committed. Only what is installed can be pinned:
packages the environment's markers left out (another Python version or OS) stay unpinned.
"""
from __future__ import annotations

import importlib.metadata as md
import os
import re
import sys
import tomllib
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
EXTRAS = ("test", "serve", "ray", "bench", "plot")
OUT = ROOT / "constraints.txt"

HEADER = """\
# The versions the test suite is known to pass with: every package that cpullm, its plugins and
# the extras test, serve, ray, bench and plot need, directly or not. scripts/test.sh installs with
# `-c constraints.txt`; `pip install -c constraints.txt -e '.[bench]'` gives the same set elsewhere.
# Regenerate from an environment in which the whole suite passed: python scripts/lock.py
# torch is pinned by its public version: the CPU build (2.13.0+cpu) satisfies it; see README.md
# for PyTorch's CPU wheel index.
"""


def project_requirements() -> tuple[set[str], list[Requirement]]:
    """The names of the repository's own distributions and what they require (with EXTRAS)."""
    own, reqs = set(), []
    for pyproject in [ROOT / "pyproject.toml", *sorted(ROOT.glob("plugins/*/pyproject.toml"))]:
        project = tomllib.loads(pyproject.read_text())["project"]
        own.add(canonicalize_name(project["name"]))
        reqs += [Requirement(r) for r in project.get("dependencies", [])]
        for extra in EXTRAS:
            reqs += [Requirement(r) for r in project.get("optional-dependencies", {}).get(extra, [])]
    return own, reqs


def applies(req: Requirement, extras: set[str]) -> bool:
    """Whether the requirement's marker holds here, for a distribution installed with extras."""
    if req.marker is None:
        return True
    env = default_environment()
    return any(req.marker.evaluate({**env, "extra": e}) for e in (extras or {""}))


def closure(own: set[str], roots: list[Requirement]) -> dict[str, md.Distribution]:
    """Every installed distribution reachable from roots, by canonical name."""
    found: dict[str, md.Distribution] = {}
    todo = [(r, set()) for r in roots]
    seen: set[tuple[str, frozenset]] = set()
    while todo:
        req, parent_extras = todo.pop()
        name = canonicalize_name(req.name)
        if name in own or not applies(req, parent_extras):
            continue
        key = (name, frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            sys.exit(f"lock.py: {req.name} is required ({req}) but not installed here; "
                     "install the extras first: pip install -e '.[test,serve,bench,plot]'")
        found[name] = dist
        todo += [(Requirement(r), set(req.extras)) for r in dist.requires or []]
    return found


def pin(dist: md.Distribution) -> str:
    version = Version(dist.version).public          # 2.13.0+cpu -> 2.13.0: any build satisfies it
    return f"{canonicalize_name(dist.metadata['Name'])}=={version}"


def main() -> int:
    own, roots = project_requirements()
    dists = closure(own, roots)
    lines = [pin(dists[name]) for name in sorted(dists)]
    body = HEADER + f"# Python {sys.version_info.major}.{sys.version_info.minor}, {sys.platform}\n" \
        + "\n".join(lines) + "\n"
    tmp = OUT.with_name(OUT.name + ".tmp")
    tmp.write_text(body)
    os.replace(tmp, OUT)
    print(f"lock.py: wrote {len(lines)} pins to {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
