"""The core's stages are rooms with arrows flowing one way.

core/cpullm/ holds one folder per stage, in the order ``STAGES`` (core/cpullm/__init__.py) gives:
a module imports only from its own stage, an earlier one, the root's ``BASE`` modules and the
kernels; the rest of the root and the shell packages may import from all of them. No import
cycle, in the core or the kernels, and the kernels import nothing of the core. The import graph
is scripts/code_stats.py's (module-level and lazy imports alike).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _code_stats():
    spec = importlib.util.spec_from_file_location("code_stats", REPO / "scripts" / "code_stats.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


cs = _code_stats()


def test_the_core_is_in_stage_folders():
    assert cs.restaged(), "the stage checks below read core/cpullm/<stage>/"


@pytest.fixture(scope="module")
def graph():
    return cs.import_graph(cs.modules())


def test_the_checker_sees_an_upward_import_and_a_cycle():
    """The rules below, on a made-up graph: what they must refuse, they refuse."""
    names, base = ["loading", "graph"], ("errors",)
    g = {"cpullm.errors": set(), "cpullm.loading.a": {"cpullm.errors", "cpullm.graph.b"},
         "cpullm.graph.b": {"cpullm.loading.a"}, "cpullm.model": {"cpullm.graph.b"},
         "cpullm_kernels.rows.q8": {"cpullm.errors"}}
    assert cs.upward_imports(g, names, base) == [("cpullm.loading.a", "cpullm.graph.b"),
                                                  ("cpullm_kernels.rows.q8", "cpullm.errors")]
    assert cs.cycles(g) == [["cpullm.graph.b", "cpullm.loading.a"]]


def test_every_stage_is_a_folder_and_every_base_module_is_at_the_root():
    names, base = cs.layout()
    assert cs.stages() == list(names)
    pkg = cs.PACKAGES["cpullm"]
    assert [b for b in base if not (pkg / f"{b}.py").exists()] == []


def test_no_import_goes_up_a_stage(graph):
    names, base = cs.layout()
    up = [f"{a} ({cs.stage_of(a, names, base)}) -> {b} ({cs.stage_of(b, names, base)})"
          for a, b in cs.upward_imports(graph, list(names), base)]
    assert up == [], "imports that go up a stage:\n" + "\n".join(up)


def test_no_import_cycle(graph):
    assert cs.cycles(graph) == []


def test_the_kernels_import_nothing_of_the_core(graph):
    bad = [f"{a} -> {b}" for a in graph if a.startswith("cpullm_kernels") for b in graph[a]
           if not b.startswith("cpullm_kernels")]
    assert bad == []


# Private names (``_x``) one module takes from another, in the core and in the kernels: none. A helper
# another module needs is public in the module it belongs to (the kernels' LLVM IR pieces: rows/llvm_ir.py).
PRIVATE_CEILING = {"core": 0, "kernels": 0}


def test_private_names_imported_across_modules_only_go_down():
    rows = cs.private_imports(cs.modules())
    found = {"core": [], "kernels": []}
    for row in rows:
        importer = row.split(" <- ")[0]
        found["kernels" if importer.startswith("cpullm_kernels") else "core"].append(row)
    for where, ceiling in PRIVATE_CEILING.items():
        assert len(found[where]) <= ceiling, \
            f"{len(found[where])} private names cross modules in {where} (at most {ceiling}):\n" + "\n".join(found[where])


def test_the_private_name_count_sees_both_spellings(tmp_path):
    """``from .m import _x`` and ``m._x`` on an imported module both count; dunders do not."""
    (tmp_path / "cpullm").mkdir()
    (tmp_path / "cpullm" / "__init__.py").write_text("")
    (tmp_path / "cpullm" / "a.py").write_text("_x = 1\n_y = 2\n__all__ = []\n")
    (tmp_path / "cpullm" / "b.py").write_text("from .a import _x, __all__\nfrom . import a\nprint(a._y, a.__name__)\n")
    mods = {"cpullm": tmp_path / "cpullm" / "__init__.py", "cpullm.a": tmp_path / "cpullm" / "a.py",
            "cpullm.b": tmp_path / "cpullm" / "b.py"}
    assert cs.private_imports(mods) == ["cpullm.b <- cpullm.a._x", "cpullm.b <- cpullm.a._y"]
