"""The ACT (unary activation) and POS_EMBED (learned absolute positions) core ops: their numba
kernels against the numpy references and against torch's own functions, over strided arena
views, and the ops through the interpreter in prefill, decode and batched decode."""
from __future__ import annotations

import math

import numpy as np
import pytest

from cpullm_kernels.ops import pointwise as K
from cpullm_kernels.program import program_table as P
from cpullm_kernels.program import row_ops


def _arena(x: np.ndarray, stride: int):
    """x (T, w) placed in a flat arena with row stride ``stride``, an output region after it."""
    T, w = x.shape
    arena = np.full(2 * T * stride + 16, np.nan, np.float32)
    arena[:T * stride].reshape(T, stride)[:, :w] = x
    return arena, 0, T * stride + 8


@pytest.mark.parametrize("act", sorted(K.ACT_KINDS))
def test_activation_kernels_match_the_reference(act):
    kind = K.ACT_KINDS[act]
    x = (np.random.default_rng(kind).standard_normal((5, 77)) * 4).astype(np.float32)
    x[0, :6] = [0.0, -0.0, 1e-8, -30.0, 30.0, 88.0]
    ref = K.act_ref(x, kind)
    for parallel in (False, True):
        arena, x_off, o_off = _arena(x, 80)
        if parallel:
            I = np.zeros((1, P.NI), np.int64)          # the instruction, run as a prefill chunk runs it
            I[0, [P.COL_OP, P.UNARY_X_OFF, P.UNARY_X_ST, P.UNARY_OUT_OFF, P.UNARY_OUT_ST, P.UNARY_WIDTH,
                  P.ACT_KIND]] = P.OP_ACT, x_off, 80, o_off, 80, 77, kind
            row_ops.row_op_par(I, np.zeros((1, P.NF)), 0, arena, np.zeros(1, np.float32), None, 0, 5)
        else:
            K.act_rows(arena, x_off, 80, o_off, 80, 77, kind, np.int64(0), np.int64(5))
        got = arena[o_off: o_off + 5 * 80].reshape(5, 80)[:, :77]
        np.testing.assert_allclose(got, ref, rtol=2e-6, atol=2e-6)
        assert np.isnan(arena[o_off + 77])                      # nothing written past the width


def test_activation_references_are_torch_s():
    torch = pytest.importorskip("torch", reason="torch is a test dependency")
    F = torch.nn.functional
    x = (np.random.default_rng(0).standard_normal((4, 33)) * 3).astype(np.float32)
    t = torch.from_numpy(x)
    want = {"gelu": F.gelu(t), "gelu_tanh": F.gelu(t, approximate="tanh"), "relu": F.relu(t), "silu": F.silu(t)}
    for act, kind in K.ACT_KINDS.items():
        np.testing.assert_allclose(K.act_ref(x, kind), want[act].numpy(), rtol=1e-6, atol=1e-6)


def test_position_embedding_kernel_matches_the_reference():
    rng = np.random.default_rng(1)
    table = rng.standard_normal((20, 24)).astype(np.float32)
    x = rng.standard_normal((6, 24)).astype(np.float32)
    wf = np.concatenate([np.zeros(5, np.float32), table.reshape(-1)])
    for pos0, offset in ((0, 0), (7, 2), (12, 2)):
        arena, x_off, o_off = _arena(x, 30)
        K.pos_embed_rows(arena, x_off, 30, o_off, 30, 24, wf, 5, 20, pos0 + offset, np.int64(0), np.int64(6))
        got = arena[o_off: o_off + 6 * 30].reshape(6, 30)[:, :24]
        np.testing.assert_array_equal(got, K.pos_embed_ref(x, table, pos0, offset))
        np.testing.assert_array_equal(got[3], x[3] + table[pos0 + offset + 3])
    arena, x_off, o_off = _arena(x, 30)
    with pytest.raises(ValueError, match="past the position table"):
        K.pos_embed_rows(arena, x_off, 30, o_off, 30, 24, wf, 5, 20, 15, np.int64(0), np.int64(6))
    with pytest.raises(ValueError, match="past the position table"):
        K.pos_embed_ref(x, table, 15)


def _graph(act: str, n_positions: int = 40, offset: int = 2):
    from cpullm.graph import blocks
    from cpullm.graph.ir import GraphBuilder

    H, V = 32, 64
    g = GraphBuilder()
    h = blocks.position_embed(g, blocks.embed(g, H), n_positions, offset=offset)

    def mixer(g, i, x):
        return blocks.attention(g, i, x, hidden=H, n_heads=4, n_kv_heads=4, head_dim=8, rope_spec=None,
                                scale=8 ** -0.5, qkv_bias=False)

    def mlp(g, i, x):
        return blocks.mlp(g, i, x, H, 48, act)

    for i in range(2):
        h = blocks.decoder_layer(g, i, h, mixer, mlp, 1e-5, norm_kind="layer")
    return g.build(blocks.lm_head(g, h, V, 1e-5, norm_kind="layer")), V


def _numpy_forward(graph, weights, ids):
    """The graph's logits by numpy alone, from the references (attention causal, full)."""
    from cpullm.graph.ir import Op

    vals, T = {}, len(ids)
    for n in graph.nodes:
        w = {r: weights.get(c) for r, c in n.weights}
        x = [vals[i] for i in n.inputs]
        if n.op == Op.EMBED:
            out = w["table"][ids]
        elif n.op == Op.POS_EMBED:
            out = K.pos_embed_ref(x[0], w["table"], 0, n.attr("offset"))
        elif n.op == Op.ACT:
            out = K.act_ref(x[0], K.ACT_KINDS[n.attr("act")])
        elif n.op == Op.LAYERNORM:
            v = x[0].astype(np.float64)
            out = (v - v.mean(-1, keepdims=True)) / np.sqrt(v.var(-1, keepdims=True) + n.attr("eps")) * w["weight"]
        elif n.op == Op.LINEAR:
            out = x[0] @ w["weight"].T
        elif n.op == Op.ADD:
            out = x[0] + x[1]
        elif n.op == Op.SELECT_ROWS:
            out = x[0]
        elif n.op == Op.ATTENTION:
            nh, hd = n.attr("n_heads"), n.attr("head_dim")
            q, k, v = (a.reshape(T, nh, hd).transpose(1, 0, 2).astype(np.float64) for a in x)
            s = q @ k.transpose(0, 2, 1) * n.attr("scale") + np.triu(np.full((T, T), -np.inf), 1)
            p = np.exp(s - s.max(-1, keepdims=True))
            out = ((p / p.sum(-1, keepdims=True)) @ v).transpose(1, 0, 2).reshape(T, nh * hd)
        else:
            raise AssertionError(n.op)
        vals[n.output] = np.asarray(out, np.float32)
    return vals[graph.output]


@pytest.mark.parametrize("act", ["gelu", "relu"])
def test_the_ops_through_the_interpreter_prefill_decode_and_batch(act):
    from cpullm.compile.compiler import compile_graph
    from cpullm.testing import _forward, _sample_weights, _rel_err, _cached_logits

    graph, V = _graph(act)
    weights = _sample_weights(graph, V, seed=3)
    ids = [int(i) for i in np.random.default_rng(4).integers(0, V, 30)]
    fwd = _forward(compile_graph(graph, weights, quant="f32", n_ctx=38, max_chunk=7), {})
    want = _numpy_forward(graph, weights, ids)
    assert _rel_err(fwd.logits(ids), want) < 1e-4                      # prefill, in chunks of 7
    assert _rel_err(_cached_logits(fwd, ids, 11), want) < 1e-4          # decode from position 11
    slots = fwd.slots(2)                                                # two sequences at 5 and 17
    fwd.prefill(slots[0], ids[:5])
    fwd.prefill(slots[1], ids[:17])
    rows, _ = fwd.step(slots, [ids[5], ids[17]])
    np.testing.assert_allclose(rows[0], want[5], rtol=0, atol=1e-4 * np.abs(want).max())
    np.testing.assert_allclose(rows[1], want[17], rtol=0, atol=1e-4 * np.abs(want).max())


def test_a_context_past_the_position_table_is_refused_at_compile():
    from cpullm.compile.compiler import compile_graph
    from cpullm.errors import ConfigError
    from cpullm.testing import _sample_weights

    graph, V = _graph("silu", n_positions=40, offset=2)
    weights = _sample_weights(graph, V)
    compile_graph(graph, weights, quant="f32", n_ctx=38)
    with pytest.raises(ConfigError, match=r"n_ctx 39 is more than the 38 positions"):
        compile_graph(graph, weights, quant="f32", n_ctx=39)


def test_graph_validation_names_the_activation():
    from cpullm.graph.ir import GraphBuilder, GraphError, Op

    g = GraphBuilder()
    x = g.add("embed", Op.EMBED, [], width=8, weights={"table": "embed"})
    g.add("act", Op.ACT, [x], act="gelu_erf")
    g.begin_head("act")
    with pytest.raises(GraphError, match="activation 'gelu_erf' is not one of gelu, gelu_tanh, relu, silu"):
        g.build("head.select")
    assert math.isclose(float(K.act_ref(np.float32([[1.0]]), K.ACT_GELU)[0, 0]), 0.8413447, rel_tol=1e-6)
