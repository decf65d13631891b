"""Plugin ops may own matrices: an OpSpec lists roles in ``matrices``, the compiler packs them like
LINEAR weights (int8 panels, 4-bit blocks; float32 under "f32" or precision="f32"), and the op's
fast kernels multiply by them through OpMatrix.matmul (the core's LINEAR kernels). A plugin's own
MLP layer (one op: up, bias, tanh GELU, down) is then not stuck in float32."""
from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from cpullm.graph import blocks
from cpullm.loading import plugins
from cpullm import testing
from cpullm.compile.compiler import compile_graph
from cpullm.loading.family import OpSpec
from cpullm.hookspecs import hookimpl
from cpullm.graph.ir import GraphBuilder
from cpullm_kernels.ops.pointwise import ACT_GELU_TANH, act_ref
from cpullm.run.op_matrix import OpMatrix

H, I, V = 64, 96, 80


def _roles(widths, attrs):
    if len(widths) != 1:
        raise ValueError("one input")
    return {"up": (attrs["inter"], widths[0]), "up_bias": (attrs["inter"],), "down": (widths[0], attrs["inter"])}


def _reference(inputs, weights, attrs, pos0):
    h = inputs[0].astype(np.float64) @ weights["up"].T.astype(np.float64) + weights["up_bias"]
    return (act_ref(h, ACT_GELU_TANH).astype(np.float64) @ weights["down"].T.astype(np.float64)).astype(np.float32)


@njit(cache=False)
def _bias_gelu(h, bias):
    for t in range(h.shape[0]):
        for j in range(h.shape[1]):
            v = h[t, j] + bias[j]
            h[t, j] = np.float32(0.5) * v * (np.float32(1.0) + np.tanh(np.float32(0.7978845608) * (
                v + np.float32(0.044715) * v * v * v)))


def _fast(out, x, up, up_bias, down, params, pos0):
    """numba for the elementwise work, OpMatrix.matmul for the matrices (never numpy's BLAS)."""
    assert isinstance(up, OpMatrix) and isinstance(down, OpMatrix) and isinstance(up_bias, np.ndarray)
    h = np.empty((x.shape[0], up.shape[0]), np.float32)
    up.matmul(x, h)
    _bias_gelu(h, up_bias)
    down.matmul(h, out)


MLP = OpSpec(name="testmat.mlp", width=lambda widths, attrs: widths[0], reference=_reference,
             prefill=_fast, decode=_fast, weight_roles=_roles, matrices=("up", "down"), group="mlp")


class _Plugin:
    @hookimpl
    def cpullm_ops(self):
        return [MLP]


@pytest.fixture(scope="module", autouse=True)
def registered():
    plugin = _Plugin()
    plugins.register_for_tests(plugin)
    plugins.discover(refresh=True)
    yield
    plugins.unregister_for_tests(plugin)
    plugins.discover(refresh=True)


def _graph(precision=None):
    g = GraphBuilder()
    h = blocks.embed(g, H)

    def mixer(g, i, x):
        return blocks.attention(g, i, x, hidden=H, n_heads=4, n_kv_heads=2, head_dim=16,
                                rope_spec=blocks.make_rope({"rope_theta": 10000.0}, 16), scale=0.25)

    def mlp(g, i, x):
        p = f"layers.{i}.mlp"
        extra = {"precision": precision} if precision else {}
        return g.op(f"{p}.fused", "testmat.mlp", [x], weights={"up": f"{p}.up_proj", "up_bias": f"{p}.up_bias",
                                                              "down": f"{p}.down_proj"}, inter=I, **extra)

    for i in range(2):
        h = blocks.decoder_layer(g, i, h, mixer, mlp, 1e-6)
    return g.build(blocks.lm_head(g, h, V, 1e-6))


IDS = [int(i) for i in np.random.default_rng(5).integers(0, V, 24)]


@pytest.fixture(scope="module")
def weights():
    return testing._sample_weights(_graph(), V, seed=2)


def _run(program, impl="fast"):
    fwd = testing._forward(program, {}, op_impl=impl)
    return fwd.logits(IDS), testing._cached_logits(fwd, IDS, 9)


def test_int8_stores_the_op_s_matrices_as_int8_and_stays_close_to_f32(weights):
    graph = _graph()
    f32 = compile_graph(graph, weights, quant="f32", n_ctx=32, max_chunk=8)
    q8 = compile_graph(graph, weights, quant="int8", n_ctx=32, max_chunk=8)
    slots = q8.meta["weight_slots"]
    for i in range(2):
        assert slots[f"layers.{i}.mlp.up_proj"][0] == "q8" and slots[f"layers.{i}.mlp.down_proj"][0] == "q8"
        assert slots[f"layers.{i}.mlp.up_bias"][0] == "f32"
    assert testing.float32_share(q8)["share"] < 0.1 < testing.float32_share(f32)["share"]
    ref_prefill, ref_decode = _run(f32)
    assert testing._rel_err(ref_prefill, _run(f32, "reference")[0]) < 1e-4     # f32: fast == reference
    got_prefill, got_decode = _run(q8)
    for got, ref in ((got_prefill, ref_prefill), (got_decode, ref_decode)):
        fid = testing.fidelity(got, ref)
        assert fid["cosine"] >= testing.INT8_MIN_COSINE and fid["top1"] >= testing.INT8_MIN_TOP1, fid
    # the reference gets the int8 values the program holds: the same numbers as the fast kernels
    assert testing._rel_err(got_prefill, _run(q8, "reference")[0]) < 2e-2


def test_the_reference_receives_the_dequantized_matrix(weights):
    q8 = compile_graph(_graph(), weights, quant="int8", n_ctx=32, max_chunk=8)
    fwd = testing._forward(q8, {})
    call = next(iter(fwd.executor.plugin_ops.values()))
    up = call.weights[call.roles.index("up")]
    want = weights.get("layers.0.mlp.up_proj")
    assert up.format == "q8" and up.dense().shape == want.shape
    assert np.abs(up.dense() - want).max() <= np.abs(want).max() / 100          # int8, block 32
    x = np.random.default_rng(0).standard_normal((3, H)).astype(np.float32)
    out = np.empty((3, I), np.float32)
    np.testing.assert_allclose(up.matmul(x, out), x @ up.dense().T, rtol=0, atol=2e-2 * np.abs(out).max())


def test_q4_and_precision_f32(weights):
    q4 = compile_graph(_graph(), weights, quant="q4", n_ctx=32, max_chunk=8)
    assert q4.meta["weight_slots"]["layers.0.mlp.down_proj"][0] == "Q5_0"       # K = 96: 32-blocks
    ref = _run(compile_graph(_graph(), weights, quant="f32", n_ctx=32, max_chunk=8))[0]
    assert testing.fidelity(_run(q4)[0], ref)["cosine"] > 0.95
    kept = compile_graph(_graph("f32"), weights, quant="int8", n_ctx=32, max_chunk=8)
    assert kept.meta["weight_slots"]["layers.0.mlp.up_proj"][0] == "f32"
    call = next(iter(testing._forward(kept, {}).executor.plugin_ops.values()))
    up = call.weights[call.roles.index("up")]
    assert up.format == "f32"
    np.testing.assert_array_equal(up.dense(), weights.get("layers.0.mlp.up_proj"))
