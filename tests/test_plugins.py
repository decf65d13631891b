"""Plugin discovery in-process: conflict precedence, broken plugins, malformed plugins.

The entry points are monkeypatched or plugin objects are registered with
``plugins.register_for_tests``; every test restores the registry afterwards.
"""
from __future__ import annotations

import importlib.metadata as importlib_metadata
import json
import sys
import warnings

import attrs
import numpy as np
import pytest

import cpullm
from cpullm import errors
from cpullm.loading import plugins
from cpullm.cli import main as cli_main
from cpullm.loading.family import KernelSpec
from cpullm.hookspecs import hookimpl
from cpullm.graph.ir import Op
from cpullm.testing import make_random_checkpoint
from tiny_configs import SMOLLM2_LIKE

LLAMA = dict(SMOLLM2_LIKE, model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=1)


@pytest.fixture
def registry(monkeypatch):
    """Yields a function (plugin objects..., entry_points=[...]) -> refreshed Registry; the real
    registry is restored afterwards."""
    saved = list(plugins._extra_plugins)
    real = plugins._entry_points

    def make(*objs, entry_points=(), quiet=True):
        plugins._extra_plugins[:] = saved + list(objs)
        monkeypatch.setattr(plugins, "_entry_points", lambda: [*real(), *entry_points])
        if not quiet:
            return plugins.discover(refresh=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", plugins.PluginConflictWarning)
            return plugins.discover(refresh=True)

    yield make
    plugins._extra_plugins[:] = saved
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", plugins.PluginConflictWarning)
        plugins.discover(refresh=True)


def _llama_clone(name: str, priority: int = 0, model_types=("llama",), architectures=()):
    from cpullm_llama.llama import FAMILY
    return attrs.evolve(FAMILY, name=name, priority=priority, model_types=tuple(model_types),
                        architectures=tuple(architectures))


def _plugin(plugin_name: str, *families, kernels=()):
    """A plugin object, as an entry-point module would be, named ``plugin_name``."""
    ns = {"__name__": plugin_name}

    @hookimpl
    def cpullm_families():
        return [attrs.evolve(f) for f in families]

    @hookimpl
    def cpullm_kernels():
        return list(kernels)

    ns["cpullm_families"] = staticmethod(cpullm_families)
    ns["cpullm_kernels"] = staticmethod(cpullm_kernels)
    return type(plugin_name, (), ns)()


def _owner(reg, model_type):
    return reg.family_for({"model_type": model_type})


# ---- conflicts ------------------------------------------------------------------------------


def test_higher_priority_wins_with_a_warning(registry):
    low = _plugin("aaa_plugin", _llama_clone("llama_low", model_types=("llama", "llama_low_only")))
    high = _plugin("zzz_plugin", _llama_clone("llama_high", priority=5))
    with pytest.warns(plugins.PluginConflictWarning, match="model_type 'llama' is claimed by"):
        reg = registry(low, high, quiet=False)
    # llama is claimed three times: the installed llama plugin (0), aaa (0), zzz (5).
    assert _owner(reg, "llama").name == "llama_high"
    assert _owner(reg, "llama_low_only").name == "llama_low"        # the loser keeps the rest
    notes = [c for c in reg.conflicts if c.startswith("model_type 'llama'")]
    assert len(notes) == 2
    assert all("using zzz_plugin:llama_high (higher priority, then plugin name order)" in c for c in notes)


def test_equal_priority_goes_to_plugin_name_order_whatever_the_registration_order(registry):
    a = _plugin("aaa_plugin", _llama_clone("from_aaa", model_types=("dup",)))
    b = _plugin("bbb_plugin", _llama_clone("from_bbb", model_types=("dup",)))
    for order in ((a, b), (b, a)):
        reg = registry(*order)
        assert _owner(reg, "dup").name == "from_aaa"
        assert reg.conflicts == ["model_type 'dup' is claimed by aaa_plugin:from_aaa (priority 0) and "
                                 "bbb_plugin:from_bbb (priority 0); using aaa_plugin:from_aaa "
                                 "(higher priority, then plugin name order)"]


def test_conflicts_are_printed_by_cpullm_families(registry, capsys):
    registry(_plugin("aaa_plugin", _llama_clone("from_aaa", model_types=("dup",))),
             _plugin("bbb_plugin", _llama_clone("from_bbb", model_types=("dup",))))
    assert cli_main(["families"]) == 0
    out = capsys.readouterr().out
    assert "warning: model_type 'dup' is claimed by aaa_plugin:from_aaa" in out


def test_architecture_conflicts_are_resolved_and_reported(registry):
    reg = registry(_plugin("aaa_plugin", _llama_clone("x", model_types=("x",), architectures=("XForLM",))),
                   _plugin("bbb_plugin", _llama_clone("y", priority=1, model_types=("y",),
                                                      architectures=("XForLM",))))
    assert reg.family_for({"architectures": ["XForLM"]}).name == "y"
    assert any(c.startswith("architecture 'XForLM' is claimed by bbb_plugin:y") for c in reg.conflicts)


def test_conflict_warning_is_one_line(registry):
    registry(_plugin("aaa_plugin", _llama_clone("from_aaa", model_types=("dup",))),
             _plugin("bbb_plugin", _llama_clone("from_bbb", model_types=("dup",))))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plugins.discover(refresh=True)
    w = next(w for w in caught if issubclass(w.category, plugins.PluginConflictWarning))
    line = warnings.formatwarning(w.message, w.category, w.filename, w.lineno, None)
    assert line.strip().count("\n") == 0 and line.startswith("cpullm:0: PluginConflictWarning: ")


# ---- broken plugins -------------------------------------------------------------------------


@pytest.fixture
def broken_entry_point(tmp_path, monkeypatch):
    (tmp_path / "cpullm_test_broken_plugin.py").write_text(
        'raise RuntimeError("needs libfrobnicate")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    yield importlib_metadata.EntryPoint(name="broken", value="cpullm_test_broken_plugin",
                                        group="cpullm")
    sys.modules.pop("cpullm_test_broken_plugin", None)


def test_plugin_raising_on_import_is_listed_and_the_rest_works(registry, broken_entry_point,
                                                             tmp_path, capsys):
    reg = registry(entry_points=[broken_entry_point])
    info = next(p for p in reg.plugins if p.name == "broken")
    assert info.error == "RuntimeError: needs libfrobnicate" and info.families == []
    assert reg.family_for({"model_type": "llama"}).name == "llama"
    model = cpullm.load(make_random_checkpoint(LLAMA, tmp_path / "m"), quant="f32", use_cache=False)
    assert np.isfinite(model.logits([1, 2, 3])).all()

    assert cli_main(["families", "--json"]) == 0
    rows = {p["entry_point"]: p for p in json.loads(capsys.readouterr().out)["plugins"]}
    assert rows["broken"]["error"] == "RuntimeError: needs libfrobnicate"
    assert rows["llama"]["error"] is None and rows["llama"]["families"][0]["name"] == "llama"

    with pytest.raises(errors.UnknownModelTypeError) as exc:
        reg.family_for({"model_type": "frobnicator"})
    assert "plugins that failed to load: broken (RuntimeError: needs libfrobnicate)" in str(exc.value)


class _Misspelled:
    __name__ = "misspelled_plugin"

    @hookimpl
    def cpullm_family(self):                      # not a hook: cpullm_families
        return []


class _Unmarked:
    __name__ = "unmarked_plugin"

    def cpullm_families(self):                    # pluggy would skip it silently
        return []


class _NotAFamily:
    __name__ = "not_a_family_plugin"

    @hookimpl
    def cpullm_families(self):
        return [{"name": "x"}]


def _bad_spec_plugin(name, **changes):
    return _plugin(name, attrs.evolve(_llama_clone("bad", model_types=("bad_mt",)), **changes))


@pytest.mark.parametrize("plugin, message", [
    (_Misspelled(), "PluginError: cpullm_family is not a cpullm hook (hooks: cpullm_families, "
                    "cpullm_gguf_architectures, cpullm_kernels, cpullm_ops, cpullm_rope_types)"),
    (_Unmarked(), "PluginError: cpullm_families is not marked with @hookimpl"),
    (_NotAFamily(), "PluginError: cpullm_families returned dict, not FamilySpec"),
    (_bad_spec_plugin("string_types", model_types="llama"),
     "PluginError: FamilySpec 'bad': model_types must be a tuple of strings, not 'llama'"),
    (_bad_spec_plugin("no_args", args_class=dict),
     "PluginError: FamilySpec 'bad': args_class must subclass cpullm.loading.family.Args"),
    (_plugin("bad_kernel_op", kernels=[KernelSpec(name="k", op=Op.LINEAR, fn=lambda *a: None)]),
     "PluginError: KernelSpec 'k': op LINEAR cannot be replaced by a plugin kernel (replaceable: GATED_DELTA)"),
], ids=["misspelled", "unmarked", "not_a_family", "model_types_str", "args_class", "kernel_op"])
def test_malformed_plugin_is_reported_not_fatal(registry, plugin, message):
    reg = registry(plugin)
    info = next(p for p in reg.plugins if p.name == plugin.__name__)
    assert info.error is not None and info.error.startswith(message), info.error
    assert info.families == []
    assert not any(f.plugin == plugin.__name__ for f in reg.families)
    assert reg.family_for({"model_type": "llama"}).name == "llama"


def test_duplicate_kernel_name_is_an_error_of_the_second_plugin(registry):
    from cpullm_kernels.attention.gated_delta import gated_delta

    k = KernelSpec(name="same.name", op=Op.GATED_DELTA, fn=gated_delta)
    reg = registry(_plugin("aaa_kernels", kernels=[k]), _plugin("bbb_kernels", kernels=[attrs.evolve(k)]))
    errs = {p.name: p.error for p in reg.plugins if p.name.endswith("_kernels")}
    assert errs["aaa_kernels"] is None
    assert "kernel name 'same.name' is already registered by aaa_kernels" in errs["bbb_kernels"]
    assert [x.plugin for x in reg.kernels if x.name == "same.name"] == ["aaa_kernels"]


def test_family_spec_lists_become_tuples(registry):
    fam = attrs.evolve(_llama_clone("listy", model_types=("listy",)), model_types=["listy"])
    reg = registry(_plugin("listy_plugin", fam))
    assert reg.family_for({"model_type": "listy"}).model_types == ("listy",)


# ---- plugin ops and RoPE scalings -----------------------------------------------------------


def _op_plugin(plugin_name: str, *ops, rope_types=()):
    ns = {"__name__": plugin_name}

    @hookimpl
    def cpullm_ops():
        return list(ops)

    @hookimpl
    def cpullm_rope_types():
        return list(rope_types)

    ns["cpullm_ops"] = staticmethod(cpullm_ops)
    ns["cpullm_rope_types"] = staticmethod(cpullm_rope_types)
    return type(plugin_name, (), ns)()


def _square_op(name="p.square"):
    from cpullm.loading.family import OpSpec
    return OpSpec(name=name, width=lambda widths, attrs: widths[0],
                  reference=lambda inputs, weights, attrs, pos0: inputs[0] * inputs[0])


def test_duplicate_op_and_rope_type_names_are_errors_of_the_second_plugin(registry):
    from cpullm.loading.family import RopeType

    rt = RopeType(name="p.rope", inv_freq=lambda params, rotary_dim, n_ctx: (np.ones(rotary_dim // 2), 1.0))
    reg = registry(_op_plugin("aaa_ops", _square_op(), rope_types=[rt]),
                   _op_plugin("bbb_ops", _square_op()),
                   _op_plugin("ccc_ops", rope_types=[attrs.evolve(rt)]))
    errs = {p.name: p.error for p in reg.plugins if p.name.endswith("_ops")}
    assert errs["aaa_ops"] is None
    assert "op name 'p.square' is already registered by aaa_ops" in errs["bbb_ops"]
    assert "rope type name 'p.rope' is already registered by aaa_ops" in errs["ccc_ops"]
    assert reg.ops["p.square"].plugin == "aaa_ops" and reg.rope_types["p.rope"].plugin == "aaa_ops"


@pytest.mark.parametrize("spec, message", [
    ("not an op", "PluginError: cpullm_ops returned str, not OpSpec"),
    (attrs.evolve(_square_op(), width=3), "PluginError: OpSpec 'p.square': width must be callable"),
    (attrs.evolve(_square_op(), params="eps"),
     "PluginError: OpSpec 'p.square': params must be a tuple of attribute names"),
], ids=["not_an_op", "width", "params"])
def test_malformed_op_is_reported_not_fatal(registry, spec, message):
    reg = registry(_op_plugin("bad_ops", spec))
    info = next(p for p in reg.plugins if p.name == "bad_ops")
    assert info.error.startswith(message), info.error
    assert reg.ops == {} or "p.square" not in reg.ops


def test_a_plugin_cannot_replace_a_core_rope_type(registry):
    from cpullm.loading.family import RopeType

    reg = registry(_op_plugin("rope_ops", rope_types=[RopeType(name="llama3", inv_freq=lambda *a: None)]))
    info = next(p for p in reg.plugins if p.name == "rope_ops")
    assert "must be a non-empty string other than the core's (default, linear, llama3)" in info.error


def test_graph_refuses_an_op_no_plugin_provides():
    from cpullm.graph.ir import GraphBuilder, GraphError

    g = GraphBuilder()
    x = g.add("embed", Op.EMBED, [], width=8, weights={"table": "embed"})
    with pytest.raises(GraphError, match=r"layers.0.x: op 'nobody.op' is not provided by any installed plugin"):
        g.op("layers.0.x", "nobody.op", [x])
