#!/usr/bin/env python
"""The shape of the code: files and lines per package, the longest functions, and the import
graph of the ``cpullm`` and ``cpullm_kernels`` packages (its cycles, its imports that go up a
stage, and the private names imported across modules).

    python scripts/code_stats.py [--top 15]

The stages are the core package's folders (core/cpullm/<stage>/), in the order ``STAGES`` in
core/cpullm/__init__.py gives; the root modules named in ``BASE`` there come before every stage,
and the rest of the root and the shell packages (cli, serve, ...) after them. An import of a
module in a later stage is an upward edge. Imports are read from the source (``ast``),
module-level and inside functions alike, so a lazy import that closes a loop is counted.
tests/test_stages.py holds the tree to this.
"""
from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Import name -> package folder. Before scripts/restage.py ran, core/ itself was the package
# cpullm (and kernels/ cpullm_kernels): then there are no stage folders to read.
PACKAGES = {"cpullm": ROOT / "core" / "cpullm", "cpullm_kernels": ROOT / "kernels" / "cpullm_kernels"}
FLAT_PACKAGES = {"cpullm": ROOT / "core", "cpullm_kernels": ROOT / "kernels"}
SHELL = "shell"


def restaged() -> bool:
    return (PACKAGES["cpullm"] / "__init__.py").exists()


def packages() -> dict[str, Path]:
    return PACKAGES if restaged() else FLAT_PACKAGES


def layout() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(STAGES, BASE) as core/cpullm/__init__.py declares them."""
    tree = ast.parse((PACKAGES["cpullm"] / "__init__.py").read_text(encoding="utf-8"))
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("STAGES", "BASE"):
                found[node.targets[0].id] = tuple(ast.literal_eval(node.value))
    if set(found) != {"STAGES", "BASE"}:
        raise SystemExit("core/cpullm/__init__.py declares no STAGES and BASE (scripts/restage.py writes them)")
    return found["STAGES"], found["BASE"]


def stages() -> list[str]:
    """The stage folders in data-flow order; every one must exist (and be a package)."""
    names, _ = layout()
    missing = [s for s in names if not (PACKAGES["cpullm"] / s / "__init__.py").exists()]
    if missing:
        raise SystemExit(f"STAGES names folders core/cpullm/ does not have: {missing}")
    return list(names)


def modules() -> dict[str, Path]:
    """module name -> file, for both packages."""
    out = {}
    for pkg, folder in packages().items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = list(rel.parts[:-1]) if rel.name == "__init__" else list(rel.parts)
            out[".".join([pkg, *parts])] = path
    return out


def _resolve(current: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = current.split(".") if is_pkg else current.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imported(current: str, is_pkg: bool, node, mods) -> list[str]:
    """The modules one import statement loads: ``from .x import y`` loads x (and x.y when y is
    a module); ``from . import x`` loads x."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in mods]
    prefix = _resolve(current, is_pkg, node)
    subs = [f"{prefix}.{a.name}" for a in node.names if f"{prefix}.{a.name}" in mods]
    if subs and node.module is None:
        return subs
    return ([prefix] if prefix in mods else []) + subs


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of both packages it imports, at module level or inside a function."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[mod].update(m for m in _imported(mod, is_pkg, node, mods) if m != mod)
    return graph


def private_imports(mods: dict[str, Path]) -> list[str]:
    """Private names (``_x``, not dunders) one module takes from another: ``from m import _x``,
    or ``m._x`` on a module it imported. One entry per (importer, module, name)."""
    found = set()
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"))
        aliases = {}                  # local name -> module, for imported modules
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in mods and a.asname:
                        aliases[a.asname] = a.name
            elif isinstance(node, ast.ImportFrom):
                source = _resolve(mod, is_pkg, node)
                for a in node.names:
                    if f"{source}.{a.name}" in mods:
                        aliases[a.asname or a.name] = f"{source}.{a.name}"
                    elif source in mods and source != mod and a.name.startswith("_") \
                            and not a.name.startswith("__"):
                        found.add(f"{mod} <- {source}.{a.name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id in aliases and node.attr.startswith("_") and not node.attr.startswith("__"):
                if aliases[node.value.id] != mod:
                    found.add(f"{mod} <- {aliases[node.value.id]}.{node.attr}")
    return sorted(found)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def stage_of(mod: str, stage_names: list[str], base: tuple) -> str:
    """The stage a cpullm module belongs to: "base", a stage folder's name, or "shell" (the
    package root's other modules and the packages beside the stages). Kernels: "kernels"."""
    parts = mod.split(".")
    if parts[0] == "cpullm_kernels":
        return "kernels"
    if len(parts) == 1:
        return SHELL
    if parts[1] in stage_names:
        return parts[1]
    if len(parts) == 2 and parts[1] in base:
        return "base"
    return SHELL


def stage_rank(stage_names: list[str]) -> dict[str, int]:
    """Lowest first: the kernels, the base modules, the stages in order, the shell."""
    return {"kernels": 0, "base": 1, **{s: 2 + i for i, s in enumerate(stage_names)}, SHELL: 2 + len(stage_names)}


def upward_imports(graph: dict[str, set[str]], stage_names: list[str], base: tuple) -> list[tuple[str, str]]:
    """Edges from a module to one in a later stage."""
    rank = stage_rank(stage_names)
    return [(a, b) for a in sorted(graph) for b in sorted(graph[a])
            if rank[stage_of(b, stage_names, base)] > rank[stage_of(a, stage_names, base)]]


def longest_functions(top: int) -> list[tuple[int, str]]:
    rows = []
    for folder in ("core", "kernels", "plugins", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if ".venv" in path.parts:
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    rows.append((n, f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"))
    return sorted(rows, reverse=True)[:top]


def counted_folders() -> list[Path]:
    """Each stage folder, shell package and kernel group, the package roots, the plugins and the
    repository's other code folders."""
    out = []
    for folder in packages().values():
        out.append(folder)
        out += sorted(p for p in folder.iterdir() if (p / "__init__.py").exists())
    out += sorted(p for p in (ROOT / "plugins").iterdir() if (p / "pyproject.toml").exists())
    return out + [ROOT / "benchmarks", ROOT / "scripts", ROOT / "tests"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--top", type=int, default=15, help="how many of the longest functions to list")
    args = ap.parse_args(argv)

    folders = counted_folders()
    print("files and lines per folder (*.py; a folder's count excludes the folders listed after it)")
    for folder in folders:
        nested = [n for n in folders if n != folder and folder in n.parents]
        files = [p for p in folder.rglob("*.py") if not any(n in p.parents for n in nested)
                 and ".venv" not in p.parts]
        lines = sum(len(p.read_text(encoding="utf-8").splitlines()) for p in files)
        print(f"  {folder.relative_to(ROOT).as_posix():<36} {len(files):>4} files {lines:>7} lines")

    print("\nlongest functions (lines)")
    for n, where in longest_functions(args.top):
        print(f"  {n:>4}  {where}")

    mods = modules()
    graph = import_graph(mods)
    comps = cycles(graph)
    print(f"\nimport cycles: {len(comps)}")
    for comp in comps:
        inner = [f"{a} -> {b}" for a in comp for b in sorted(graph[a]) if b in comp]
        print(f"  {', '.join(comp)}: {'; '.join(inner)}")
    if restaged():
        names = stages()
        _, base = layout()
        up = upward_imports(graph, names, base)
        print(f"\nupward imports (stages: kernels < base < {' < '.join(names)} < shell): {len(up)}")
        for a, b in up:
            print(f"  {a} ({stage_of(a, names, base)}) -> {b} ({stage_of(b, names, base)})")
    else:
        print("\nupward imports: not checked (the core is not in stage folders; scripts/restage.py moves it)")
    private = private_imports(mods)
    print(f"\nprivate names imported across modules: {len(private)}")
    for row in private:
        print(f"  {row}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
