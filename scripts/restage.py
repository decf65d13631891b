#!/usr/bin/env python
"""Move cpullm into real package folders, one folder per stage, and rewrite every reference.

    python scripts/restage.py            # plan, check, then move and rewrite the working tree
    python scripts/restage.py --check    # plan and check only: print the moves, change nothing

Run it from anywhere on a clean checkout (it works on the tree that holds this script), then
reinstall the editable packages (``bash scripts/test.sh --co -q`` does; an existing .venv needs
``pip install -e . -e plugins/llama -e plugins/qwen -e plugins/gemma`` again, as the package
layout changed), check with ``python -m pytest tests/test_stages.py`` and
``python scripts/code_stats.py``, and commit the result with ``git add -A``. What it does:

* ``core/<module>.py`` -> ``core/cpullm/<stage>/<module>.py`` and each shell package
  ``core/<pkg>/`` -> ``core/cpullm/<pkg>/``, as the table ``CORE`` below says; the stages, in the
  order data flows through them, are ``STAGES``. The modules every stage uses (errors, limits,
  notices, the plugin hooks, the tool-call formats) and the public doors (``cpullm.load``,
  ``cpullm.model``, ``cpullm.plugin``, ``cpullm.testing``) stay at the package root.
* ``kernels/<module>.py`` -> ``kernels/cpullm_kernels/<group>/<module>.py``, grouped by layout
  as ``KERNELS`` says; the kernels' import name becomes ``cpullm_kernels`` (was
  ``cpullm.kernels``), a top-level package of the same distribution.
* Rewrites, in every text file git tracks (CHANGELOG.md and benchmarks/results/ keep the names
  of their time): dotted names (``cpullm.executor`` -> ``cpullm.run.executor``, also inside
  ``mock.patch`` / ``monkeypatch`` strings and subprocess code), ``from cpullm import executor``
  forms (split when the names now live in different packages), the moved modules' relative
  imports (recomputed from their new places), and file paths (``core/executor.py`` ->
  ``core/cpullm/run/executor.py``, ``kernels/q8.py`` -> ``kernels/cpullm_kernels/rows/q8.py``).
* pyproject.toml: the ``package-dir`` map and package list become a package search of
  ``core/`` and ``kernels/``; package data follows its package. tests/conftest.py loses the
  sys.path surgery and scripts/test.sh the ``python -m pytest`` workaround: with the packages in
  their own folders, nothing at the repository root shadows an installed package.
* ``STAGES`` and ``BASE`` are written into cpullm/__init__.py, where scripts/code_stats.py and
  tests/test_stages.py read them; each new folder gets an ``__init__.py`` saying what it holds;
  docs/INTERNALS.md's stage table and core/README.md are written from the tables.

The load stage's folder is ``loading``: a subpackage ``cpullm.load`` would replace the function
``cpullm.load`` on first import. ``toolcalls`` stays at the root (BASE): a FamilySpec declares
its ToolFormat / ReasoningFormat, so the load stage's ``family`` imports it.

It plans everything before it changes anything, and FAILS naming every module under core/ or
kernels/ that the tables do not place (add it to ``CORE`` or ``KERNELS`` and run again). On a
tree already restaged it says so and changes nothing.
"""
from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The stage folders of the core package, in the order data flows through them. A module imports
# only from its own stage, an earlier one, or the root's BASE modules (tests/test_stages.py).
STAGES = ("loading", "graph", "compile", "run", "generate")
# Modules at the package root that every stage may import (they import no stage).
BASE = ("errors", "limits", "notices", "hookspecs", "toolcalls")

# core/<name>.py (or the package core/<name>/, or a data file) -> its folder inside core/cpullm/
# ("" = the package root). The root holds BASE and the doors; the shell packages sit beside the
# stage folders.
CORE = {
    # the package root: what every stage uses ...
    "errors": "", "limits": "", "notices": "", "hookspecs": "",
    "toolcalls": "",        # ToolFormat / ReasoningFormat: what a FamilySpec declares, and their parsing
    # ... and the doors: cpullm.load, the Model it returns, the plugin door and its conformance kit
    "__init__": "", "model": "", "plugin": "", "testing": "",
    # load: files, tensors, weight maps, tokenizers, GGUF; the family a config names
    "locations": "loading", "tensors": "loading", "gguf_file": "loading", "gguf_vocab": "loading",
    "gguf_model": "loading", "weightmap": "loading", "tokenize": "loading", "family": "loading",
    "plugins": "loading", "plugin_index.json": "loading",
    # graph: the IR and the blocks families compose
    "ir": "graph", "blocks": "graph", "decoder": "graph",
    # compile: quant -> block plan -> passes -> head screen -> cache (one entry)
    "quant_blocks": "compile", "compiler": "compile", "filearrays": "compile", "kvformat": "compile",
    "head_screen": "compile", "cache_format": "compile",
    # run: the forward path, slots, batch, prefix / prompt cache, memory
    "executor": "run", "forward": "run", "batch": "run", "prefix_cache": "run", "prompt_cache": "run",
    "memory": "run", "op_matrix": "run",
    # generate: sampling, sequences, scheduler, engine, chat, constraints
    "sampling": "generate", "constraints": "generate", "sequence": "generate", "generate": "generate",
    "scheduler": "generate", "engine": "generate", "chat": "generate", "chat_tools": "generate",
    "template_sandbox": "generate", "speculative": "generate",
    "embed": "generate",
    # the shell, beside the stages
    "store": "", "cli": "", "serve": "", "convert": "", "bench": "", "ray": "",
}
# Files under core/ that are not part of the package and stay where they are.
CORE_KEEP = ("README.md",)

# kernels/<name>.py -> its group folder inside kernels/cpullm_kernels/ ("" = the package root).
KERNELS = {
    "__init__": "",
    # weights read row by row: the formats, their quantizers and row kernels
    "q8": "rows", "q4": "rows", "gguf_blocks": "rows", "kquant": "rows", "batch_linear": "rows",
    # weights in panels of 16 rows: decode, batches and the head screen
    "q8_panels": "panels", "kquant_panels": "panels", "head_screen": "panels", "head_screen_blocks": "panels",
    # register tiles: prefill GEMMs
    "q8_gemm": "tiles", "kquant_gemm": "tiles",
    # attention over the KV cache and linear-attention state
    "attention": "attention", "attention_batch": "attention", "gated_delta": "attention",
    # row-wise ops
    "elementwise": "ops", "norm": "ops", "rope": "ops", "vmath": "ops", "pointwise": "ops", "sample": "ops",
    # the program: its instruction table, the loop that runs it, its composite ops
    "program_table": "program", "interpreter": "program", "moe": "program",
    # setup: numba's settings, its cache lock, warm-up, the read-rate probe
    "numba_setup": "setup", "numba_cache_lock": "setup", "warmup": "setup", "bandwidth": "setup",
}
KERNELS_KEEP: tuple = ()

CORE_PKG = "cpullm"
KERNELS_PKG = "cpullm_kernels"
OLD_KERNELS = "cpullm.kernels"
# Text files whose names are history (or this script's own tables), not references: left as they are.
UNTOUCHED = ("CHANGELOG.md", "scripts/restage.py")   # this script keeps its tables as they are
UNTOUCHED_DIRS = ("benchmarks/results/",)
TEXT_SUFFIXES = {".py", ".md", ".toml", ".json", ".sh", ".txt", ".cfg", ".ini", ".yml", ".yaml", ".rst", ""}


class RestageError(Exception):
    pass


# ---- the plan: old module -> new module, old file -> new file ----------------------------------

def _entries(folder: Path, keep: tuple) -> dict[str, Path]:
    """name -> path of what a flat folder holds: modules (stem), packages, data files."""
    out = {}
    for p in sorted(folder.iterdir()):
        if p.name == "__pycache__" or p.name in keep or p.name.endswith(".egg-info"):
            continue
        if p.is_dir() and not any(p.rglob("*.py")):
            continue            # only caches left behind (a __pycache__ of a module moved away)
        if p.is_dir():
            if not (p / "__init__.py").exists():
                raise RestageError(f"{p.relative_to(ROOT)}/ is a folder without __init__.py: restage.py does not "
                                   f"know where it goes")
            out[p.name] = p
        elif p.suffix == ".py":
            out[p.stem] = p
        else:
            out[p.name] = p
    return out


class Plan:
    """Where every core and kernel module goes, and the name it is imported by there."""

    def __init__(self):
        core, kern = _entries(ROOT / "core", CORE_KEEP), _entries(ROOT / "kernels", KERNELS_KEEP)
        self.present, self.present_kernels = set(core), set(kern)
        self.core_paths = core
        unplaced = [f"core/{n}" for n in core if n not in CORE] + [f"kernels/{n}" for n in kern if n not in KERNELS]
        if unplaced:
            raise RestageError("not placed by the tables CORE / KERNELS at the top of scripts/restage.py: "
                               + ", ".join(unplaced) + " (add each with its stage or group, then run again)")
        bad = sorted({s for s in CORE.values() if s and s not in STAGES})
        if bad:
            raise RestageError(f"CORE names folders that are not stages: {bad} (STAGES: {STAGES})")
        self.moves: list[tuple[Path, Path]] = []      # old path -> new path (files and packages)
        self.modules: dict[str, str] = {}             # old dotted module -> new dotted module
        self.packages: set[str] = set()               # new dotted packages (for relative imports)
        self.paths: dict[str, str] = {}               # old path (relative, "/"-joined) -> new path
        for name, path in core.items():
            folder = CORE[name]
            dest = ROOT / "core" / CORE_PKG / folder / path.name
            self._add(path, dest, f"{CORE_PKG}.{name}" if name != "__init__" else CORE_PKG,
                      ".".join(x for x in (CORE_PKG, folder, name) if x) if name != "__init__" else CORE_PKG)
        for name, path in kern.items():
            group = KERNELS[name]
            dest = ROOT / "kernels" / KERNELS_PKG / group / path.name
            self._add(path, dest, f"{OLD_KERNELS}.{name}" if name != "__init__" else OLD_KERNELS,
                      ".".join(x for x in (KERNELS_PKG, group, name) if x) if name != "__init__" else KERNELS_PKG)
        self.stage_inits = [ROOT / "core" / CORE_PKG / s / "__init__.py" for s in sorted(set(CORE.values())) if s]
        self.group_inits = [ROOT / "kernels" / KERNELS_PKG / g / "__init__.py"
                            for g in sorted(set(KERNELS.values())) if g]
        self.packages |= {CORE_PKG, KERNELS_PKG} | {f"{CORE_PKG}.{s}" for s in CORE.values() if s} \
            | {f"{KERNELS_PKG}.{g}" for g in KERNELS.values() if g}
        # the old module names inside moved packages (cpullm.serve.openai ...): found on disk
        for name, path in core.items():
            if path.is_dir():
                for f in sorted(path.rglob("*.py")):
                    rel = f.relative_to(path).with_suffix("")
                    parts = list(rel.parts[:-1]) if rel.name == "__init__" else list(rel.parts)
                    old = ".".join([CORE_PKG, name, *parts])
                    self.modules[old] = self.new_name(old)
                    if rel.name == "__init__":
                        self.packages.add(self.modules[old])

    def _add(self, old_path: Path, new_path: Path, old_mod: str, new_mod: str):
        self.moves.append((old_path, new_path))
        self.paths[old_path.relative_to(ROOT).as_posix()] = new_path.relative_to(ROOT).as_posix()
        if old_path.suffix == ".py" or old_path.is_dir():
            self.modules[old_mod] = new_mod
            if old_path.is_dir() or old_path.name == "__init__.py":
                self.packages.add(new_mod)

    def new_name(self, old: str) -> str:
        """The new dotted name of an old module (or of a name inside one)."""
        parts = old.split(".")
        if parts[0] != CORE_PKG:
            return old
        if len(parts) >= 2 and parts[1] == "kernels":
            if len(parts) == 2:
                return KERNELS_PKG
            group = KERNELS.get(parts[2])
            if group is None:
                return ".".join([KERNELS_PKG, *parts[2:]])
            return ".".join(x for x in (KERNELS_PKG, group, *parts[2:]) if x)
        if len(parts) == 1:
            return CORE_PKG
        stage = CORE.get(parts[1])
        if stage is None:
            return old
        return ".".join(x for x in (CORE_PKG, stage, *parts[1:]) if x)

    def is_module(self, old: str) -> bool:
        return old in self.modules


# ---- rewriting text -----------------------------------------------------------------------------

_NAME = r"[A-Za-z_]\w*"


def rewrite_dotted(text: str, plan: Plan) -> str:
    """``cpullm.kernels.q8`` -> ``cpullm_kernels.rows.q8``, ``cpullm.executor`` ->
    ``cpullm.run.executor`` wherever the dotted name appears (code, strings, prose)."""
    def kern(m):
        name = m.group(1)
        return plan.new_name(f"{OLD_KERNELS}.{name}") if name in KERNELS else f"{KERNELS_PKG}.{name}"

    text = re.sub(rf"(?<![\w.]){re.escape(OLD_KERNELS)}\.({_NAME})", kern, text)
    text = re.sub(rf"(?<![\w.]){re.escape(OLD_KERNELS)}(?![\w])", KERNELS_PKG, text)

    def core(m):
        name = m.group(1)
        if name in CORE and CORE[name] and name != "__init__":
            return f"{CORE_PKG}.{CORE[name]}.{name}"
        return m.group(0)

    return re.sub(rf"(?<![\w./-]){CORE_PKG}\.({_NAME})", core, text)


def _from_groups(plan: Plan, pkg_old: str, names: list[tuple[str, str | None]]):
    """``from <pkg_old> import names``: the new package each name comes from, in order."""
    groups: dict[str, list] = {}
    for name, alias in names:
        sub = f"{pkg_old}.{name}"
        if plan.is_module(sub):
            new = plan.modules[sub]
            where = new.rpartition(".")[0]
        else:
            where = plan.new_name(pkg_old)
        groups.setdefault(where, []).append((name, alias))
    return groups


def _statement(where: str, names, pkg_old: str, plan: Plan) -> str:
    """``from where import names``; names that became top-level packages (``where`` "") are
    imported as ``import package as name``."""
    if where:
        return f"from {where} import {_names_text(names)}"
    return "; ".join(f"import {plan.modules[f'{pkg_old}.{n}']} as {a or n}" for n, a in names)


def _names_text(names) -> str:
    return ", ".join(n if a is None else f"{n} as {a}" for n, a in names)


def rewrite_absolute_from(text: str, plan: Plan) -> str:
    """One-line ``from cpullm import a, b`` / ``from cpullm_kernels import a`` (code, strings,
    docs; ``cpullm.kernels`` already renamed by rewrite_dotted): each name from the package it
    now lives in."""
    pattern = re.compile(rf"(?m)^(?P<lead>[^\n]*?)(?<![\w.])from (?P<pkg>{CORE_PKG}|{KERNELS_PKG}) import "
                         rf"(?P<names>{_NAME}(?: as {_NAME})?(?:, *{_NAME}(?: as {_NAME})?)*)(?P<rest>[ \t]*#[^\n]*)?")

    def fix(m):
        names = []
        for item in m.group("names").split(","):
            bits = item.split()
            names.append((bits[0], bits[2] if len(bits) == 3 else None))
        pkg = OLD_KERNELS if m.group("pkg") == KERNELS_PKG else CORE_PKG
        if not any(plan.is_module(f"{pkg}.{n}") for n, _ in names) and pkg == CORE_PKG:
            return m.group(0)
        groups = _from_groups(plan, pkg, names)
        lead, rest = m.group("lead"), m.group("rest") or ""
        parts = [_statement(where, ns, pkg, plan) for where, ns in groups.items()]
        if len(parts) == 1:
            return lead + parts[0] + rest
        if lead.strip() == "":            # a statement of its own: one line per package, each with the comment
            return lead + ("\n" + lead).join(p + rest for p in parts)
        return lead + "; ".join(parts) + rest

    return pattern.sub(fix, text)


_PATH = re.compile(r"(?<![\w./-])(core|kernels)/(" + _NAME + r")(\.py|\.json|/)")


def rewrite_paths(text: str, plan: Plan) -> str:
    """``core/executor.py`` -> ``core/cpullm/run/executor.py``; ``core/serve/`` ->
    ``core/cpullm/serve/``; ``kernels/q8.py`` -> ``kernels/cpullm_kernels/rows/q8.py``."""
    def fix(m):
        top, name, tail = m.groups()
        key = f"{top}/{name}{tail}" if tail != "/" else f"{top}/{name}"
        new = plan.paths.get(key)
        if new is None:
            return m.group(0)
        return new + ("/" if tail == "/" else "")

    return _PATH.sub(fix, text)


def _module_of(path: Path) -> tuple[str, bool]:
    """(dotted module, is a package's __init__) of a file in its NEW place."""
    for top, pkg in (("core", CORE_PKG), ("kernels", KERNELS_PKG)):
        base = ROOT / top / pkg
        if base in path.parents or path.parent == base:
            rel = path.relative_to(base).with_suffix("")
            parts = [pkg, *rel.parts]
            if parts[-1] == "__init__":
                return ".".join(parts[:-1]), True
            return ".".join(parts), False
    raise RestageError(f"{path} is in no package")


def _relative(current_pkg: str, target: str) -> str:
    """The relative spelling of ``target`` from inside package ``current_pkg`` (same top-level
    package), else ``target`` itself."""
    cur, tgt = current_pkg.split("."), target.split(".")
    if cur[0] != tgt[0]:
        return target
    common = 0
    while common < min(len(cur), len(tgt)) and cur[common] == tgt[common]:
        common += 1
    return "." * (len(cur) - common + 1) + ".".join(tgt[common:])


def rewrite_relative_imports(source: str, old_module: str, old_is_pkg: bool, new_path: Path, plan: Plan) -> str:
    """The relative imports of a moved file, recomputed from its new place."""
    new_module, new_is_pkg = _module_of(new_path)
    new_pkg = new_module if new_is_pkg else new_module.rpartition(".")[0]
    old_pkg = old_module if old_is_pkg else old_module.rpartition(".")[0]
    lines = source.splitlines(keepends=True)
    edits = []          # (first line, last line, replacement lines)
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom) or not node.level:
            continue
        base = old_pkg.split(".")
        base = base[:len(base) - (node.level - 1)]
        target_old = ".".join(base + ([node.module] if node.module else []))
        names = [(a.name, a.asname) for a in node.names]
        if node.module is None or any(plan.is_module(f"{target_old}.{n}") for n, _ in names):
            groups = _from_groups(plan, target_old, names)
        else:
            groups = {plan.new_name(target_old): names}
        spelled = {_relative(new_pkg, where) if where else "": ns for where, ns in groups.items()}
        first, last = node.lineno - 1, node.end_lineno - 1
        stmt = "".join(lines[first:last + 1])
        head = re.compile(r"from\s+(\.+[\w.]*)\s+import")
        if len(spelled) == 1 and "" not in spelled:
            (mod_text, _), = spelled.items()
            at = node.col_offset
            m = head.match(stmt, at)
            if m is None:
                raise RestageError(f"cannot read the import at {new_path}:{node.lineno}")
            if m.group(1) != mod_text:
                new_stmt = stmt[:m.start(1)] + mod_text + stmt[m.end(1):]
                edits.append((first, last, new_stmt))
            continue
        # names now in several packages: one statement per package
        indent = lines[first][:node.col_offset]
        if lines[first][:node.col_offset].strip():
            raise RestageError(f"cannot split the import at {new_path}:{node.lineno}")
        comment = ""
        tail = lines[last][node.end_col_offset:].rstrip("\n")
        if tail.strip().startswith("#"):
            comment = "  " + tail.strip()
        out = [f"{indent}{_statement(mod, ns, target_old, plan)}{comment}\n" for mod, ns in sorted(spelled.items())]
        edits.append((first, last, "".join(out)))
    for first, last, new in sorted(edits, reverse=True):
        lines[first:last + 1] = [new]
    return "".join(lines)


# ---- the special files -----------------------------------------------------------------------------

def new_pyproject(text: str, plan: Plan) -> str:
    """The package search of core/ and kernels/ instead of the package-dir map; package data
    keyed by the packages' new names."""
    m = re.search(r"(?ms)^\[tool\.setuptools\]\n.*?(?=^\[tool\.(?!setuptools)|\Z)", text)
    if m is None:
        raise RestageError("pyproject.toml has no [tool.setuptools] table to rewrite")
    data = re.search(r"(?ms)^\[tool\.setuptools\.package-data\]\n(.*?)(?=^\[|\Z)", m.group(0))
    rows = []
    for line in (data.group(1) if data else "").splitlines():
        k = re.match(r'\s*"?([\w.]+)"?\s*=\s*(.*)', line)
        if not k:
            continue
        pkg, files = k.group(1), k.group(2)
        for f in re.findall(r'"([^"]+)"', files):
            # data beside a moved module moves with it
            mod = plan.new_name(pkg)
            key = f"core/{f}" if pkg == CORE_PKG else None
            if key and key in plan.paths:
                mod = ".".join(Path(plan.paths[key]).parent.relative_to("core").parts)
            rows.append((mod, f))
    merged: dict[str, list] = {}
    for mod, f in rows:
        merged.setdefault(mod, []).append(f)
    block = ["[tool.setuptools.packages.find]",
             'where = ["core", "kernels"]   # core/cpullm/ and kernels/cpullm_kernels/: the package folders',
             "",
             "[tool.setuptools.package-data]"]
    block += [f'"{mod}" = [{", ".join(chr(34) + f + chr(34) for f in files)}]' for mod, files in merged.items()]
    return text[:m.start()] + "\n".join(block) + "\n\n" + text[m.end():]


def new_conftest(text: str) -> str:
    """tests/conftest.py without the sys.path surgery (the root no longer shadows anything)."""
    start = text.find("def _keep_the_repository_root_off_sys_path")
    if start < 0:
        return text
    end = text.index("_keep_the_repository_root_off_sys_path()\n", start + 10)
    end += len("_keep_the_repository_root_off_sys_path()\n")
    text = text[:start] + text[end:]
    text = re.sub(r"\nREPO = HERE\.parent\n", "\n", text)
    return re.sub(r"\n{3,}(?=sys\.path\.insert)", "\n\n", text)


def new_test_sh(text: str) -> str:
    """scripts/test.sh runs ``python -m pytest`` (no entry-point workaround)."""
    m = re.search(r"(?ms)^# pytest's own entry point.*?\Z", text)
    if m is None:
        return text
    return text[:m.start()] + 'exec "$CPULLM_PY" -m pytest -q -ra "$@"\n'


def stages_block() -> str:
    return ("\n# The package's layout (scripts/code_stats.py and tests/test_stages.py read it): the stage\n"
            "# folders in the order data flows through them, and the root modules every stage may use. A\n"
            "# module imports only from its own stage, an earlier one and BASE; the rest of the root (this\n"
            "# module, model, plugin, testing, store) and the shell packages beside the stages (cli, serve,\n"
            "# convert, bench, ray) may import from all of them.\n"
            f"STAGES = {STAGES!r}\n"
            f"BASE = {BASE!r}\n")


def new_core_init(text: str) -> str:
    if re.search(r"(?m)^STAGES = ", text):
        return text
    at = text.find("\n__all__")
    if at < 0:
        return text.rstrip("\n") + "\n" + stages_block()
    return text[:at].rstrip("\n") + "\n\n" + stages_block() + text[at:]


STAGE_DOCS = {
    "loading": "Load: find a model, read its config, family, tensors (safetensors or GGUF), weight map and tokenizer.",
    "graph": "Graph: the IR and the blocks a family composes into its model's graph.",
    "compile": "Compile: IR and weights to an execution program (quantize, plan, head screen), cached on disk.",
    "run": "Run: the forward path over slots, the executor and batch decoder, prefix and prompt caches, memory.",
    "generate": "Generate: sampling, sequences, the scheduler and engine, chat templates, constraints.",
}
GROUP_DOCS = {
    "rows": "Weight formats read row by row: q8 block-32, ggml blocks, their quantizers and row kernels.",
    "panels": "Weights in panels of 16 rows: one LINEAR kernel for decode, batches and the head screen.",
    "tiles": "Register-tiled GEMMs for prefill.",
    "attention": "Attention over the KV cache, batched decode attention, the linear-attention state.",
    "ops": "Row-wise ops: elementwise, norms, RoPE, vectorised exp/tanh.",
    "program": "The compiled program's instruction table and the interpreter that runs it.",
    "setup": "numba's settings and cache lock, kernel warm-up, the memory read-rate probe.",
}


# ---- the stage table (docs/INTERNALS.md) and core/README.md, written from the tables -------------

def _summary(path: Path) -> str:
    """A module's docstring up to its first full stop (one line), or ""."""
    try:
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    except (SyntaxError, UnicodeDecodeError):
        return ""
    text = " ".join(doc.split("\n\n")[0].split())
    m = re.match(r"(.+?)\.(\s|$)", text)
    text = m.group(1) if m else text
    if len(text) > 110:
        m = re.match(r"(.+?)[:;](\s|$)", text)
        text = m.group(1) if m else text
    while text.count("(") > text.count(")"):
        text = text[:text.rindex("(")].rstrip()
    return text.rstrip(":.")


def _rows(present=None):
    """(stage, folder, [core module or package names]) in data-flow order, of the names in
    ``present`` (default: every name CORE places)."""
    core = [n for n in CORE if not n.endswith(".json") and (present is None or n in present)]
    rows = [("base", "core/cpullm/", [n for n in core if CORE[n] == "" and n in BASE])]
    rows += [(s, f"core/cpullm/{s}/", [n for n in core if CORE[n] == s]) for s in STAGES]
    rows.append(("shell", "core/cpullm/", [n for n in core if CORE[n] == "" and n not in BASE]))
    return rows


def _groups(present=None) -> dict[str, list]:
    """kernel group -> its modules (of those in ``present``), in the table's order."""
    groups: dict[str, list] = {}
    for name, group in KERNELS.items():
        if group and (present is None or name in present):
            groups.setdefault(group, []).append(name)
    return groups


def stage_table(present=None, present_kernels=None) -> str:
    """The folder = stage table that opens docs/INTERNALS.md."""
    out = ["| stage | folder | modules |", "|---|---|---|"]
    for stage, folder, names in _rows(present):
        shown = [f"`{n}/`" if (ROOT / "core" / n).is_dir() or (ROOT / folder / n).is_dir() else f"`{n}.py`"
                 for n in names]
        out.append(f"| {stage} | `{folder}` | {', '.join(shown)} |")
    for group, names in _groups(present_kernels).items():
        out.append(f"| kernels: {group} | `kernels/cpullm_kernels/{group}/` | {', '.join(f'`{n}.py`' for n in names)} |")
    return "\n".join(out) + "\n"


def new_internals(text: str, present=None, present_kernels=None) -> str:
    """docs/INTERNALS.md with the generated stage table in place of the hand-written one."""
    m = re.search(r"(?ms)^Where each module sits.*?\n\n(\|.*?\n)(?=\n)", text)
    if m is None:
        return text
    intro = ("Where each module sits: one folder per stage inside the package `cpullm` (core/cpullm/), in\n"
             "the order data flows; a module imports only from its own stage, an earlier one and the base\n"
             "modules (tests/test_stages.py). The kernels are the package `cpullm_kernels`\n"
             "(kernels/cpullm_kernels/), grouped by how they lay out their data.\n\n")
    return text[:m.start()] + intro + stage_table(present, present_kernels) + text[m.end():]


def core_readme(plan: Plan) -> str:
    """core/README.md: each stage folder and its modules, with their docstrings' first sentence."""
    out = ["# cpullm's core", "",
           "The package `cpullm` (core/cpullm/): one folder per stage, in the order data flows through",
           "them. A checkpoint's tensors become a family's graph, the graph a compiled program, the",
           "program runs one token after another for many sequences at once. A module imports only from",
           "its own stage, an earlier one and the base modules at the package root",
           "(tests/test_stages.py; `python scripts/code_stats.py` draws the import graph). The core names",
           "no model family: everything family-specific comes from the plugins (`plugins/`) through the",
           "hooks in `hookspecs.py`; a plugin imports only `cpullm.plugin`.", ""]
    for stage, folder, names in _rows(plan.present):
        title = {"base": "Base: what every stage uses", "shell": "The doors and the shell"}.get(
            stage, STAGE_DOCS.get(stage, stage))
        out += [f"## `{folder}` ({stage})", "", title, "", "| module | what it is |", "|---|---|"]
        for n in names:
            path = plan.core_paths[n]            # read before the move
            init = path / "__init__.py" if path.is_dir() else path
            label = f"`{n}/`" if path.is_dir() else f"`{n}.py`"
            out.append(f"| {label} | {_summary(init)} |")
        out.append("")
    out += ["## `kernels/cpullm_kernels/` (the kernels)", "",
            "numba kernels, each with a numpy reference, grouped by how they lay out their data:", ""]
    for group, names in _groups(plan.present_kernels).items():
        out.append(f"- `{group}/` ({GROUP_DOCS.get(group, group)}): {', '.join(f'`{n}.py`' for n in names)}")
    return "\n".join(out) + "\n"


# ---- running it ----------------------------------------------------------------------------------

def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        files = [ROOT / p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        files = [p for p in ROOT.rglob("*") if p.is_file() and not {".git", ".venv", "__pycache__"} & set(p.parts)]
    # files not yet added (a new module) are moved and rewritten too
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, check=True).stdout
        files += [ROOT / p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        pass
    return sorted({p for p in files if p.is_file()})


def _is_text(path: Path) -> bool:
    rel = path.relative_to(ROOT).as_posix()
    if rel in UNTOUCHED or rel.startswith(UNTOUCHED_DIRS) or "/static/" in rel and path.suffix not in (".md",):
        return False
    return path.suffix in TEXT_SUFFIXES


def check_imports(text: str, new_path: Path | None, known: set) -> str | None:
    """Why the rewritten ``text`` would not import, or None: it must parse, and each import of a
    cpullm / cpullm_kernels module (relative ones resolved from ``new_path``, the file's new
    place) must name a module or package that exists after the move."""
    try:
        tree = ast.parse(text)
    except SyntaxError as exc:
        return f"does not parse (line {exc.lineno}: {exc.msg})"
    pkg = None
    if new_path is not None:
        mod, is_pkg = _module_of(new_path)
        pkg = mod if is_pkg else mod.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if pkg is None:
                    continue
                base = pkg.split(".")[:len(pkg.split(".")) - (node.level - 1)]
                targets = [".".join(base + ([node.module] if node.module else []))]
            else:
                targets = [node.module or ""]
        else:
            continue
        for t in targets:
            if t.split(".")[0] in (CORE_PKG, KERNELS_PKG) and t not in known:
                return f"line {node.lineno} imports {t}, which does not exist"
    return None


def already_restaged() -> bool:
    return (ROOT / "core" / CORE_PKG / "__init__.py").exists() and not (ROOT / "core" / "__init__.py").exists()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="plan and check only; change nothing")
    args = ap.parse_args(argv)
    if already_restaged():
        print("restage: already restaged (core/cpullm/ exists, core/__init__.py does not); nothing to do")
        return 0
    try:
        plan = Plan()
    except RestageError as exc:
        print(f"restage: error: {exc}", file=sys.stderr)
        return 2
    files = tracked_files()
    known = set(plan.modules.values()) | plan.packages
    # new text of every file, computed before anything changes
    new_text: dict[Path, str] = {}
    for f in files:
        dest = f
        for old, new in plan.moves:
            if f == old or (old.is_dir() and old in f.parents):
                dest = new / f.relative_to(old) if old.is_dir() else new
        if not _is_text(f):
            continue
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out = text
        if f.suffix == ".py" and dest != f:
            rel = f.relative_to(ROOT)
            top = rel.parts[0]
            pkg = CORE_PKG if top == "core" else OLD_KERNELS
            inner = rel.relative_to(top).with_suffix("")
            is_pkg = inner.name == "__init__"
            parts = list(inner.parts[:-1]) if is_pkg else list(inner.parts)
            old_module = ".".join([pkg, *parts])
            try:
                out = rewrite_relative_imports(out, old_module, is_pkg, dest, plan)
            except SyntaxError as exc:
                raise SystemExit(f"restage: error: {f.relative_to(ROOT)} does not parse: {exc}")
        out = rewrite_dotted(out, plan)
        out = rewrite_absolute_from(out, plan)
        out = rewrite_paths(out, plan)
        rel = f.relative_to(ROOT).as_posix()
        if rel == "pyproject.toml":
            out = new_pyproject(out, plan)
        elif rel == "tests/conftest.py":
            out = new_conftest(out)
        elif rel == "scripts/test.sh":
            out = new_test_sh(out)
        elif rel == "core/__init__.py":
            out = new_core_init(out)
        elif rel == "tests/test_import_isolation.py":
            out = out.replace("folder would win; tests/conftest.py takes the root and the working directory off sys.path.",
                              "folder would win if it were a package; none is (the packages are folders inside them:\n"
                              "core/cpullm/, kernels/cpullm_kernels/), so an installed package of its name comes first.")
        elif rel == "docs/INTERNALS.md":
            out = new_internals(out, plan.present, plan.present_kernels)
        if f.suffix == ".py":
            left = re.search(rf"(?m)^\s*from ({CORE_PKG}|{KERNELS_PKG}) import \(", out)
            if left:
                raise SystemExit(f"restage: error: {f.relative_to(ROOT)}: a parenthesized `{left.group(0).strip()}` "
                                 "is not rewritten; write it on one line (or as `from cpullm.x import y`) first")
        if out != text and f.suffix == ".py":
            problem = check_imports(out, dest, known) if dest != f else check_imports(out, None, known)
            if problem:
                raise SystemExit(f"restage: error: {f.relative_to(ROOT)}: {problem} after the rewrite; nothing was changed")
        if out != text:
            new_text[f] = out
    readme = core_readme(plan)
    for old, new in plan.moves:
        print(f"  {old.relative_to(ROOT)} -> {new.relative_to(ROOT)}")
    print(f"restage: {len(plan.moves)} moves, {len(new_text)} files rewritten")
    if args.check:
        return 0
    # write: rewritten text in place, then the moves, then the new packages' __init__ files
    for f, text in new_text.items():
        tmp = f.with_name(f.name + ".restage-tmp")
        tmp.write_text(text, encoding="utf-8")
        shutil.copymode(f, tmp)
        os.replace(tmp, f)
    git = (ROOT / ".git").exists()
    for old, new in sorted(plan.moves, key=lambda m: str(m[0])):
        new.parent.mkdir(parents=True, exist_ok=True)
        tracked = git and subprocess.run(["git", "ls-files", "--error-unmatch", str(old)], cwd=ROOT,
                                         capture_output=True).returncode == 0
        if tracked:
            subprocess.run(["git", "mv", str(old), str(new)], cwd=ROOT, check=True)
        else:
            shutil.move(str(old), str(new))
    for init, docs in [(p, STAGE_DOCS) for p in plan.stage_inits] + [(p, GROUP_DOCS) for p in plan.group_inits]:
        if not init.exists():
            init.write_text(f'"""{docs.get(init.parent.name, init.parent.name.capitalize() + ".")}"""\n',
                            encoding="utf-8")
            if git:
                subprocess.run(["git", "add", str(init)], cwd=ROOT, check=True)
    (ROOT / "core" / "README.md").write_text(readme, encoding="utf-8")
    for stale in (ROOT / "core" / "__pycache__", ROOT / "kernels" / "__pycache__"):
        shutil.rmtree(stale, ignore_errors=True)
    if git:
        subprocess.run(["git", "add", "-A", "core", "kernels"], cwd=ROOT, check=True)
    print("restage: done; reinstall the editable packages (bash scripts/test.sh --co -q) and run the tests")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
