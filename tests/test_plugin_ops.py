"""Plugins that bring their own ops and RoPE scalings, registered in-process from the
out-of-tree packages in tests/third_party (test_third_party.py pip-installs them as well).

cpullm-plugin-neox adds ``neox.gelu_erf`` (exact GELU, which the core lacks) and runs GPT-NeoX
with it at f32 parity with transformers; the op's fast kernels are compared with its numpy
reference by the conformance kit, its version is in the execution-cache key, the profile
reports it by its group. cpullm-plugin-phi3 adds the ``longrope`` RoPE scaling (frequencies for
the program's context length) and runs Phi-3 (fused qkv_proj / gate_up_proj taken as row ranges,
partial rotary, sliding window) at f32 parity with transformers.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.reference   # needs torch and transformers

torch = pytest.importorskip("torch", reason="torch is a test dependency (pip install -e '.[test]')")
transformers = pytest.importorskip("transformers", reason="transformers is a test dependency")

import cpullm  # noqa: E402
from cpullm.loading import plugins  # noqa: E402
from cpullm import testing  # noqa: E402
from cpullm.errors import PluginError  # noqa: E402

THIRD_PARTY = Path(__file__).parent / "third_party"


def _import_plugin(package_dir: str, module: str):
    path = str(THIRD_PARTY / package_dir)
    if path not in sys.path:
        sys.path.insert(0, path)
    __import__(module)
    return sys.modules[module]


@pytest.fixture(scope="module")
def neox():
    """The neox plugin registered in this process; its own test module for configs and reference."""
    plugin = _import_plugin("cpullm-plugin-neox", "cpullm_neox.plugin")
    plugins.register_for_tests(plugin)
    plugins.discover(refresh=True)
    sys.path.insert(0, str(THIRD_PARTY / "cpullm-plugin-neox" / "tests"))
    import test_gpt_neox as suite
    yield suite
    sys.path.remove(str(THIRD_PARTY / "cpullm-plugin-neox" / "tests"))
    plugins.unregister_for_tests(plugin)
    plugins.discover(refresh=True)


@pytest.mark.parametrize("name", ["parallel", "sequential"])
def test_gpt_neox_with_its_own_op_at_parity(neox, name, tmp_path):
    neox.test_conformance(name, tmp_path)


def test_the_op_s_fast_kernels_match_its_reference_directly(neox):
    from cpullm_neox.ops import GELU_ERF

    x = np.random.default_rng(0).standard_normal((7, 53)).astype(np.float32) * 3
    ref = GELU_ERF.reference([x], {}, {}, 0)
    want = torch.nn.functional.gelu(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(ref, want, rtol=1e-6, atol=1e-6)
    for fn in (GELU_ERF.prefill, GELU_ERF.decode):
        out = np.zeros_like(x)
        fn(out, x, np.zeros(0), 0)
        np.testing.assert_allclose(out, ref, rtol=2e-6, atol=2e-6)


@pytest.fixture(scope="module")
def neox_checkpoint(neox, tmp_path_factory):
    d = tmp_path_factory.mktemp("neox")
    neox._save(neox.CONFIGS["parallel"], d)
    return d


def test_the_op_is_in_the_graph_the_cache_key_and_the_profile(neox, neox_checkpoint, monkeypatch):
    from cpullm import bench
    from cpullm.compile.compiler import graph_hash
    from cpullm.graph.ir import GraphBuilder, Op

    model = cpullm.load(neox_checkpoint, quant="int8", use_cache=False)
    nodes = [n for n in model.graph.nodes if n.op == Op.PLUGIN]
    assert [n.attr("plugin_op") for n in nodes] == ["neox.gelu_erf"] * 2
    assert "PLUGIN(layers.0.mlp.up_proj)" in model.graph.dump()
    before = graph_hash(model.graph)
    spec = plugins.discover().ops["neox.gelu_erf"]
    monkeypatch.setattr(spec, "version", "2")                         # a new release of the op
    graph = model.family.build_graph(model.args, GraphBuilder())
    assert graph_hash(graph) != before
    monkeypatch.undo()
    prof = bench.profile_pass(model, list(range(1, 20)), 3)
    assert prof["decode"]["groups"]["mlp_act"]["seconds"] > 0
    assert prof["prefill"]["groups"]["mlp_act"]["seconds"] > 0


def test_a_program_with_an_op_that_is_not_installed_is_refused(neox, neox_checkpoint):
    from cpullm.run.executor import Executor

    model = cpullm.load(neox_checkpoint, quant="f32", use_cache=False)
    with pytest.raises(PluginError, match=r"plugin ops that are not installed: \['neox.gelu_erf'\]"):
        Executor(model.program, ops={})


def test_the_kit_catches_a_fast_kernel_that_disagrees_with_the_reference(neox, neox_checkpoint, monkeypatch):
    spec = plugins.discover().ops["neox.gelu_erf"]
    right = spec.decode

    def off_by_a_little(out, x, params, pos0):
        right(out, x, params, pos0)
        out *= np.float32(1.01)

    monkeypatch.setattr(spec, "decode", off_by_a_little)
    model = cpullm.load(neox_checkpoint, quant="f32", use_cache=False)
    with pytest.raises(AssertionError, match="neox.gelu_erf differ from their numpy references"):
        testing.check_plugin_ops(model, list(range(1, 20)))


@pytest.fixture(scope="module")
def phi3():
    plugin = _import_plugin("cpullm-plugin-phi3", "cpullm_phi3.plugin")
    plugins.register_for_tests(plugin)
    plugins.discover(refresh=True)
    tests_dir = str(THIRD_PARTY / "cpullm-plugin-phi3" / "tests")
    sys.path.insert(0, tests_dir)
    import test_phi3 as suite
    yield suite
    sys.path.remove(tests_dir)
    plugins.unregister_for_tests(plugin)
    plugins.discover(refresh=True)


@pytest.mark.parametrize("name", ["longrope", "longrope_partial", "window"])
def test_phi3_at_parity(phi3, name, tmp_path):
    phi3.test_conformance(name, tmp_path)


@pytest.mark.parametrize("name", ["longrope", "longrope_partial"])
def test_phi3_longrope_short_and_long(phi3, name, tmp_path):
    phi3.test_longrope_within_the_original_context_uses_the_short_factors(name, tmp_path)


def test_rope_scaling_is_in_the_cache_key_and_refused_when_missing(phi3, tmp_path, monkeypatch):
    from cpullm.compile.compiler import graph_hash
    from cpullm.errors import UnsupportedConfigError
    from cpullm.loading.family import read_config
    from cpullm.graph.ir import GraphBuilder

    phi3._save(phi3.CONFIGS["longrope"], tmp_path)
    fam = plugins.discover().family_for(read_config(tmp_path))
    args = fam.args(read_config(tmp_path))
    before = graph_hash(fam.build_graph(args, GraphBuilder()))
    monkeypatch.setattr(plugins.discover().rope_types["longrope"], "version", "2")
    assert graph_hash(fam.build_graph(fam.args(read_config(tmp_path)), GraphBuilder())) != before
    monkeypatch.setattr(plugins.discover(), "rope_types", {})
    with pytest.raises(UnsupportedConfigError, match="'longrope' is not supported .*a plugin may add it"):
        fam.args(read_config(tmp_path))


def test_a_plugin_op_runs_per_sequence_in_the_scheduler(neox, neox_checkpoint):
    """Continuous batching with a plugin op (and LayerNorm, partial RoPE): each request's greedy
    tokens are the same alone, mixed with others, and from generate()."""
    from cpullm.generate.sampling import SamplingParams
    from cpullm.generate.scheduler import Scheduler
    from cpullm.generate.sequence import Sequence

    model = cpullm.load(neox_checkpoint, quant="int8", use_cache=False, n_ctx=128, max_chunk=16)
    prompts = [list(range(3, 3 + n)) for n in (4, 37, 1, 20)]

    def run(ps):
        sch = Scheduler(model.forward, slots=3, prefill_chunk=16)
        seqs = [sch.add(Sequence(p, 9, SamplingParams())) for p in ps]
        sch.run_until_idle()
        return [s.generated for s in seqs]
    alone = [run([p])[0] for p in prompts]
    assert run(prompts) == alone
    assert alone == [list(model.generate_ids(p, 9, ignore_eos=True)) for p in prompts]
