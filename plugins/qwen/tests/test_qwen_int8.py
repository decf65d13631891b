"""INT8 fidelity of Qwen3.5's linear-attention (Gated DeltaNet) path measured on its own, and the
compiler's generic per-node ``precision`` attribute used to isolate it.

int8 mode quantizes every LINEAR's weights (q8, block 32); decode also quantizes activations.
Keeping every node but the Gated DeltaNet projections at f32 measures that path alone.
"""
from pathlib import Path

import attrs
import numpy as np
import pytest

pytestmark = pytest.mark.reference   # needs torch and transformers

pytest.importorskip("torch", reason="torch is a test dependency (pip install -e '.[test]')")
pytest.importorskip("transformers", reason="transformers is a test dependency")

from cpullm.loading import plugins  # noqa: E402
from cpullm import testing  # noqa: E402
from cpullm.compile.compiler import compile_graph  # noqa: E402
from cpullm.run.executor import Executor  # noqa: E402
from cpullm.loading.family import read_config  # noqa: E402
from cpullm.graph.ir import Graph, GraphBuilder, GraphError, Op  # noqa: E402
from cpullm_kernels.program import program_table as P  # noqa: E402
from cpullm.loading.tensors import TensorStore  # noqa: E402
from test_qwen_parity import IDS, make_checkpoint  # noqa: E402
from steps import Steps  # noqa: E402

LINEAR_ATTN = lambda n: ".linear_attn." in n.name          # noqa: E731


def with_precision(graph: Graph, predicate, precision="f32") -> Graph:
    """The graph with ``precision`` set on the LINEAR/EMBED nodes ``predicate`` selects."""
    nodes = [attrs.evolve(n, attrs=tuple(sorted(n.attrs + (("precision", precision),))))
             if n.op in (Op.LINEAR, Op.EMBED) and predicate(n) else n for n in graph.nodes]
    return Graph(nodes=nodes, output=graph.output, hidden=graph.hidden)


def executor(model_dir, quant, keep_f32=None):
    config = read_config(Path(model_dir))
    reg = plugins.discover()
    fam = reg.family_for(config)
    args = fam.args(config)
    weights = fam.weight_map(args).resolve(TensorStore(model_dir), args)
    graph = fam.build_graph(args, GraphBuilder())
    if keep_f32 is not None:
        graph = with_precision(graph, keep_f32)
    program = compile_graph(graph, weights, quant=quant, n_ctx=128)
    return Steps(Executor(program, {k.name: k.fn for k in reg.kernels}))


def logits(ex, ids, path):
    ex.reset()
    if path == "prefill":
        return ex.prefill(ids, all_logits=True)
    rows = [ex.prefill(ids[:1], all_logits=True)] + [ex.decode(t).copy()[None] for t in ids[1:]]
    return np.concatenate(rows)


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3_5_int8")
    make_checkpoint("qwen3_5", "v5", d)
    return d, logits(executor(d, "f32"), IDS, "prefill")


def test_linear_attention_path_int8_fidelity_on_its_own(qwen35):
    d, f32 = qwen35
    variants = {"linear-attn projections alone int8": lambda n: not LINEAR_ATTN(n),
                "whole model int8": None,
                "int8 with linear-attn kept f32": LINEAR_ATTN}
    fid = {}
    for name, keep in variants.items():
        ex = executor(d, "int8", keep_f32=keep)
        for path in ("prefill", "decode"):
            fid[name, path] = f = testing.fidelity(logits(ex, IDS, path), f32)
            print(f"\n[{path}] {name}: cosine {f['cosine']:.5f} top1 {f['top1']:.3f} kl {f['kl']:.5f}", end="")
    for path in ("prefill", "decode"):
        for name in variants:
            assert fid[name, path]["cosine"] >= 0.98 and fid[name, path]["top1"] >= 0.75, (name, path)
        assert (fid["int8 with linear-attn kept f32", path]["cosine"]
                >= fid["whole model int8", path]["cosine"] - 1e-3)


def test_precision_attribute_keeps_weights_f32_and_splits_fusion(qwen35):
    d, _ = qwen35
    meta_kind = lambda ex: {name: int(ex.I[r, P.LINEAR_KIND]) for r, name in enumerate(ex.program.meta["names"])
                            if ex.I[r, P.COL_OP] == P.OP_LINEAR}
    plain = meta_kind(executor(d, "int8"))
    fused_la = next(n for n in plain if "linear_attn.in_qkv" in n)
    assert "linear_attn.in_z" in fused_la and plain[fused_la] == P.WEIGHT_Q8
    kinds = meta_kind(executor(d, "int8", keep_f32=LINEAR_ATTN))
    for name, kind in kinds.items():
        assert kind == (P.WEIGHT_F32 if ".linear_attn." in name else P.WEIGHT_Q8), name
    assert any("in_qkv" in n and "in_a" in n for n in kinds)        # equal precision still fuses
    split = meta_kind(executor(d, "int8", keep_f32=lambda n: n.name.endswith((".in_b", ".in_a"))))
    ba = next(n for n in split if n.endswith("in_b+layers.0.linear_attn.in_a"))
    assert split[ba] == P.WEIGHT_F32 and "in_b" not in next(n for n in split if "0.linear_attn.in_qkv" in n)


def test_unknown_precision_is_rejected(qwen35):
    d, _ = qwen35
    config = read_config(Path(d))
    fam = plugins.discover().family_for(config)
    args = fam.args(config)
    weights = fam.weight_map(args).resolve(TensorStore(d), args)
    graph = with_precision(fam.build_graph(args, GraphBuilder()), lambda n: n.name == "lm_head", "int3")
    with pytest.raises(GraphError, match="precision"):
        compile_graph(graph, weights, quant="int8", n_ctx=64)
