#!/usr/bin/env python
"""The shape of the code: files and lines per package, the longest functions, and the import
graph of the ``cpullm`` package (its cycles, and its imports that run from a lower layer to a
higher one).

    python scripts/code_stats.py [--top 15]

Imports are read from the source (``ast``), module-level and inside functions alike, so a lazy
import that closes a loop is counted. The layers are the ones core/README.md describes, lowest
first; an import of a module in a higher layer is an upward edge.
"""
from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"cpullm": ROOT / "core", "cpullm.kernels": ROOT / "kernels"}   # as pyproject.toml maps them
COUNTED = ["core", "core/bench", "core/cli", "core/convert", "core/serve", "kernels", "plugins/llama", "plugins/qwen", "plugins/gemma",
           "benchmarks", "scripts", "tests"]

# Lowest first. A module's layer is the first entry naming it or a package above it.
LAYERS = [
    ("foundation", ["errors", "limits", "notices", "hookspecs", "filearrays", "kvformat"]),
    ("kernels", ["kernels"]),          # numba kernels: import nothing of cpullm outside their package
    ("registry", ["family", "plugins", "weightmap", "tensors", "gguf_file", "gguf_vocab", "gguf_model",
                  "locations", "tokenize", "toolcalls"]),
    ("graph", ["ir", "blocks", "decoder"]),
    ("compiler", ["compiler", "quant_blocks"]),
    ("execution", ["cache_format", "head_screen", "executor", "batch", "forward", "prompt_cache", "prefix_cache",
                   "memory"]),
    ("generation", ["constraints", "sampling", "sequence", "generate", "scheduler", "embed", "engine", "model", "chat",
                    "template_sandbox", "testing", "plugin", "__init__"]),   # plugin: the door, testing included
    ("shell", ["convert", "store", "bench", "serve", "cli", "ray"]),
]


def modules() -> dict[str, Path]:
    """cpullm module name -> file."""
    out = {}
    for pkg, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"] if rel.name == "__init__" else list(rel.parts)
            out[".".join([pkg, *parts])] = path
    return out


def _imported(current: str, is_pkg: bool, node, mods) -> list[str]:
    """The cpullm modules one import statement loads: ``from .x import y`` loads x (and x.y
    when y is a module); ``from . import x`` loads x."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in mods]
    if node.level:
        base = current.split(".") if is_pkg else current.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    subs = [f"{prefix}.{a.name}" for a in node.names if f"{prefix}.{a.name}" in mods]
    if subs and node.module is None:
        return subs
    return ([prefix] if prefix in mods else []) + subs


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the cpullm modules it imports, at module level or inside a function."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[mod].update(m for m in _imported(mod, is_pkg, node, mods) if m != mod)
    return graph


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


def layer(mod: str) -> int:
    short = mod.removeprefix("cpullm.").removeprefix("cpullm") or "__init__"
    for rank, (_, names) in enumerate(LAYERS):
        for name in names:
            if short == name or short.startswith(name + "."):
                return rank
    raise KeyError(f"{mod} is in no layer of scripts/code_stats.py: add it to LAYERS")


def longest_functions(top: int) -> list[tuple[int, str]]:
    rows = []
    for folder in ("core", "kernels", "plugins", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    rows.append((n, f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"))
    return sorted(rows, reverse=True)[:top]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--top", type=int, default=15, help="how many of the longest functions to list")
    args = ap.parse_args(argv)

    print("files and lines per package (*.py; a package's count excludes its sub-packages listed here)")
    for folder in COUNTED:
        base = ROOT / folder
        nested = [ROOT / c for c in COUNTED if c != folder and c.startswith(folder + "/")]
        files = [p for p in base.rglob("*.py") if not any(n in p.parents for n in nested)]
        lines = sum(len(p.read_text(encoding="utf-8").splitlines()) for p in files)
        print(f"  {folder:<16} {len(files):>4} files {lines:>7} lines")

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
    upward = [(a, b) for a in sorted(graph) for b in sorted(graph[a]) if layer(b) > layer(a)]
    print(f"\nupward imports (a lower layer importing a higher one; layers: "
          f"{' < '.join(name for name, _ in LAYERS)}): {len(upward)}")
    for a, b in upward:
        print(f"  {a} ({LAYERS[layer(a)][0]}) -> {b} ({LAYERS[layer(b)][0]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
