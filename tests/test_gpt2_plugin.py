"""A GPT-2 plugin written the way a third party writes one (tests/third_party/cpullm-plugin-gpt2),
registered in-process: its Conv1D checkpoints (matrices stored (in, out)) map onto core LINEARs
through the TRANSPOSE transform and quantize, its learned positions and tanh GELU are core ops
(POS_EMBED, ACT), its context limit is enforced at load, its own config keys are bounded.
Parity is against transformers' GPT2LMHeadModel on tiny random configs (its own suite)."""
from __future__ import annotations

import json
import shutil
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
from cpullm.errors import ConfigError, WeightMapError  # noqa: E402

PACKAGE = Path(__file__).parent / "third_party" / "cpullm-plugin-gpt2"


@pytest.fixture(scope="module")
def gpt2():
    """The gpt2 plugin registered in this process; its own test module for configs and reference."""
    sys.path.insert(0, str(PACKAGE))
    sys.path.insert(0, str(PACKAGE / "tests"))
    import cpullm_gpt2.plugin as plugin
    import test_gpt2 as suite
    plugins.register_for_tests(plugin)
    plugins.discover(refresh=True)
    yield suite
    plugins.unregister_for_tests(plugin)
    plugins.discover(refresh=True)
    sys.path.remove(str(PACKAGE / "tests"))
    sys.path.remove(str(PACKAGE))


@pytest.mark.parametrize("name", ["gpt2", "inner_relu_untied"])
def test_gpt2_at_parity_with_its_matrices_quantized(gpt2, name, tmp_path):
    report = gpt2.test_conformance(name, tmp_path)
    assert report["batched_decode_err"] <= testing.F32_TOLERANCE
    assert report["context_limit"]["ran_at_limit"]


@pytest.fixture(scope="module")
def checkpoint(gpt2, tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt2")
    gpt2._save(gpt2.CONFIGS["gpt2"], d)
    return d


def test_every_conv1d_matrix_is_an_int8_linear(gpt2, checkpoint):
    from cpullm.graph.ir import Op

    model = cpullm.load(checkpoint, quant="int8", use_cache=False)
    slots = model.program.meta["weight_slots"]
    matrices = [n.weight("weight") for n in model.graph.nodes if n.op == Op.LINEAR]
    assert len(matrices) == 2 * 6 + 1                          # q k v o up down per layer, lm_head
    assert {name: slots[name][0] for name in matrices} == {name: "q8" for name in matrices}
    ops = {n.op for n in model.graph.nodes}
    assert Op.POS_EMBED in ops and Op.ACT in ops and Op.PLUGIN not in ops


def test_the_context_limit_is_refused_in_one_line_naming_the_fix(gpt2, checkpoint):
    limit = gpt2.CONFIGS["gpt2"]["n_positions"]
    assert cpullm.load(checkpoint, quant="f32", use_cache=False).n_ctx == limit      # default: the limit
    with pytest.raises(ConfigError, match=rf"^n_ctx {limit + 1} is more than the {limit} positions a gpt2 "
                                          rf"checkpoint can address; load with n_ctx <= {limit} "):
        cpullm.load(checkpoint, quant="f32", n_ctx=limit + 1, use_cache=False)


def test_a_cached_program_is_not_stretched_past_the_position_table(gpt2, checkpoint, tmp_path):
    """The execution cache reuses a program for another context (compiler.with_context): never
    past the learned position table."""
    from cpullm.compile.compiler import with_context

    model = cpullm.load(checkpoint, quant="f32", n_ctx=32, use_cache=False)
    assert with_context(model.program, 64).meta["n_ctx"] == 64
    with pytest.raises(ConfigError, match="positions this model's learned position table holds"):
        with_context(model.program, 65)


@pytest.mark.parametrize("key, value", [("n_embd", 1 << 40), ("n_layer", -1), ("n_head", "4"),
                                        ("layer_norm_epsilon", 0.0), ("n_positions", 0)])
def test_family_specific_config_keys_are_bounded(gpt2, checkpoint, tmp_path, key, value):
    d = tmp_path / "bad"
    shutil.copytree(checkpoint, d)
    config = json.loads((checkpoint / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(ConfigError, match=rf"config key '{key}' = .* is invalid"):
        cpullm.load(d, quant="f32", use_cache=False)


def test_a_transform_must_give_the_shape_it_declares(gpt2, checkpoint):
    from cpullm.plugin import Transform, W, WeightMap
    from cpullm.loading.tensors import TensorStore

    store = TensorStore(checkpoint)
    H = gpt2.CONFIGS["gpt2"]["n_embd"]
    wrong = Transform("not_a_transpose", lambda w, a: w, shape=lambda s, a: tuple(reversed(s)))
    rules = [W("x", "transformer.h.0.mlp.c_fc.weight", (H, 4 * H), transform=wrong)]
    resolved = WeightMap(rules=rules, ignore=[r"^(?!transformer\.h\.0\.mlp\.c_fc\.weight$)"]).resolve(store)
    assert resolved.shape("x") == (4 * H, H)
    with pytest.raises(WeightMapError, match=r"into \(64, 256\), not the \(256, 64\) it declares"):
        resolved.get("x")
    with pytest.raises(WeightMapError, match="a reshape keeps the number of values"):
        Transform("bad", lambda w, a: w, shape=lambda s, a: (1,)).out_shape((2, 3))


def test_precision_f32_keeps_one_linear_float32(gpt2, checkpoint, monkeypatch):
    """blocks.linear(..., precision="f32"): that matrix stays float32 under INT8, the rest is int8."""
    from cpullm.compile.compiler import compile_graph
    from cpullm.graph.ir import GraphBuilder
    from cpullm.plugin import blocks
    from cpullm.loading.tensors import TensorStore

    family = plugins.discover().family_for(json.loads((checkpoint / "config.json").read_text()))
    args = family.args(json.loads((checkpoint / "config.json").read_text()))
    weights = family.weight_map(args).resolve(TensorStore(checkpoint), args)
    real_linear = blocks.linear

    def down_in_f32(g, name, x, weight, out_features, bias=None, group="", precision=None):
        keep = "f32" if name == "layers.1.mlp.down_proj" else precision
        return real_linear(g, name, x, weight, out_features, bias=bias, group=group, precision=keep)

    monkeypatch.setattr(blocks, "linear", down_in_f32)       # the family's graph, one LINEAR marked
    graph = family.build_graph(args, GraphBuilder())
    monkeypatch.undo()
    program = compile_graph(graph, weights, quant="int8", n_ctx=16, max_chunk=8)
    slots = program.meta["weight_slots"]
    assert slots["layers.1.mlp.down_proj"][0] == "f32" and slots["layers.0.mlp.down_proj"][0] == "q8"
    wf = program.arrays["wf"]
    kind, off, size = slots["layers.1.mlp.down_proj"][:3]
    np.testing.assert_array_equal(wf[off: off + size], weights.get("layers.1.mlp.down_proj").reshape(-1))
    with pytest.raises(ValueError, match="precision 'bf16' is not one of f32"):
        blocks.linear(GraphBuilder(), "x", "y", "w", 4, precision="bf16")


def test_the_kit_catches_a_batch_that_reads_one_position_for_every_sequence(gpt2, checkpoint, monkeypatch):
    """POS_EMBED reads the step's position: run once for the whole batch (as a row-wise op) every
    sequence would get the first one's positions; the kit's batched-decode check fails then."""
    from cpullm.run import batch
    from cpullm_kernels.program import program_table as P

    model = cpullm.load(checkpoint, quant="f32", use_cache=False)
    ids = list(range(3, 30))
    assert testing.check_batched_decode(model, ids) <= testing.F32_TOLERANCE
    monkeypatch.setattr(batch, "PER_SEQUENCE_OPS", tuple(o for o in batch.PER_SEQUENCE_OPS if o != P.OP_POS_EMBED))
    model = cpullm.load(checkpoint, quant="f32", use_cache=False)
    with pytest.raises(AssertionError, match="batched decode differs from decoding alone"):
        testing.check_batched_decode(model, ids)


def test_a_wrong_config_keys_declaration_fails_the_family(gpt2):
    import attrs

    from cpullm.plugin import FamilySpec

    family = plugins.discover().family_for({"model_type": "gpt2"})
    with pytest.raises(ValueError, match=r"config_keys\['n_embd'\] = 'hidden': give a common key"):
        FamilySpec(**{**attrs.asdict(family, recurse=False), "config_keys": {"n_embd": "hidden"}})
    assert FamilySpec(**{**attrs.asdict(family, recurse=False), "config_keys": {"n_expert": (1, 512)}})


def test_the_execution_cache_keeps_the_new_ops(gpt2, checkpoint, tmp_path):
    """A program with ACT and POS_EMBED rows is stored, passes the cache's bounds checks when read
    back, and gives the same logits; another context within the table reuses it."""
    ids = list(range(5, 25))
    first = cpullm.load(checkpoint, quant="int8", n_ctx=48, cache_dir=tmp_path)
    again = cpullm.load(checkpoint, quant="int8", n_ctx=48, cache_dir=tmp_path)
    other = cpullm.load(checkpoint, quant="int8", n_ctx=64, cache_dir=tmp_path)
    assert first.cache_status.startswith("MISS") and again.cache_status == other.cache_status == "HIT"
    np.testing.assert_array_equal(again.logits(ids), first.logits(ids))
    np.testing.assert_array_equal(other.logits(ids), first.logits(ids))
