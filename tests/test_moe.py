"""Routed experts (Op.MOE, cpullm_kernels.program.moe): the compiled op against the numpy reference in
f32, the quantized expert formats (q8 panels, raw k-quant blocks) against their dequantized f32,
batched decode bit-identical to decode alone, prefill equal to decode, and only chosen experts read."""
import attrs
import numba
import numpy as np
import pytest

from cpullm.graph import blocks
from cpullm.compile.compiler import compile_graph
from cpullm.run.executor import Executor
from cpullm.run.forward import Forward
from cpullm.graph.ir import GraphBuilder, GraphError, Op
from cpullm_kernels.program import moe as M
from cpullm_kernels.ops.norm import rmsnorm_ref
from cpullm.testing import _ArrayWeights as _Plain


class _ArrayWeights(_Plain):
    def identity(self, name):            # what the q4 block plan keys tensors by
        return (name, None, None)


def _graph(H, V, E, k, inter, routing, norm_topk, shared_i, shared_gate, experts_only=False):
    """embed -> h + moe(h) -> final norm -> lm_head; ``experts_only``: the embedding and the
    lm_head kept float32 in every quant mode, so only the expert matrices are quantized."""
    g = GraphBuilder()
    h = blocks.embed(g, H)
    m = blocks.moe_mlp(g, 0, h, hidden=H, n_experts=E, top_k=k, intermediate=inter, routing=routing,
                       norm_topk=norm_topk, shared_intermediate=shared_i, shared_gate=shared_gate)
    h = g.add("layers.0.residual", Op.ADD, [h, m], group="residual")
    graph = g.build(blocks.lm_head(g, h, V, 1e-6))
    if experts_only:
        graph.nodes = [attrs.evolve(n, attrs=n.attrs + (("precision", "f32"),))
                       if n.op in (Op.EMBED, Op.LINEAR) else n for n in graph.nodes]
    return graph


def _arrays(H, V, E, inter, shared_i, shared_gate, seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s: (rng.standard_normal(s) * 0.3).astype(np.float32)          # noqa: E731
    a = {"embed": f(V, H), "final_norm": (1 + f(H) / 3).astype(np.float32), "lm_head": f(V, H),
         "layers.0.moe.router": f(E, H)}
    for e in range(E):
        a.update({f"layers.0.moe.experts.{e}.gate_proj": f(inter, H), f"layers.0.moe.experts.{e}.up_proj": f(inter, H),
                  f"layers.0.moe.experts.{e}.down_proj": f(H, inter)})
    if shared_i:
        a.update({"layers.0.moe.shared.gate_proj": f(shared_i, H), "layers.0.moe.shared.up_proj": f(shared_i, H),
                  "layers.0.moe.shared.down_proj": f(H, shared_i)})
        if shared_gate:
            a["layers.0.moe.shared_gate"] = f(1, H)
    return a


def _reference(a, ids, E, k, routing, norm_topk, shared_i, shared_gate):
    x = a["embed"][ids]
    p = "layers.0.moe."
    experts = [tuple(a[f"{p}experts.{e}.{m}"] for m in ("gate_proj", "up_proj", "down_proj")) for e in range(E)]
    shared = tuple(a[f"{p}shared.{m}"] for m in ("gate_proj", "up_proj", "down_proj")) if shared_i else None
    y = x + M.moe_ref(x, a[p + "router"], experts, k=k, routing=routing, norm_topk=norm_topk, shared=shared,
                      shared_gate=a[p + "shared_gate"][0] if shared_i and shared_gate else None)
    return rmsnorm_ref(y, a["final_norm"], 1e-6) @ a["lm_head"].T.astype(np.float64)


IDS = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
CASES = [  # (routing, norm_topk, shared_intermediate, shared_gate)
    ("softmax_topk", True, 0, False),       # Qwen3-MoE
    ("softmax_topk", False, 24, True),      # Qwen2-MoE / Qwen3.5-MoE: a gated shared expert
    ("topk_softmax", False, 0, False),      # Mixtral
]


@pytest.mark.parametrize("routing,norm_topk,shared_i,shared_gate", CASES)
def test_f32_program_matches_reference_prefill_and_decode(routing, norm_topk, shared_i, shared_gate):
    H, V, E, k, inter = 32, 24, 6, 2, 16
    a = _arrays(H, V, E, inter, shared_i, shared_gate)
    graph = _graph(H, V, E, k, inter, routing, norm_topk, shared_i, shared_gate)
    fwd = Forward(Executor(compile_graph(graph, _ArrayWeights(a), quant="f32", n_ctx=32, max_chunk=8)),
                  numba.get_num_threads())
    want = _reference(a, IDS, E, k, routing, norm_topk, shared_i, shared_gate)
    slot = fwd.new_slot()
    got = fwd.prefill(slot, IDS, all_logits=True)               # chunks of 8 then 3 rows
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    fwd.reset(slot)
    dec = np.stack([fwd.step([slot], [t])[0][0] for t in IDS])
    np.testing.assert_allclose(dec, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def _decode_alone_and_batched(fwd, seqs):
    """Logits of each sequence decoded alone, and of all decoded together step by step."""
    alone = []
    for ids in seqs:
        slot = fwd.new_slot()
        alone.append(np.stack([fwd.step([slot], [t])[0][0].copy() for t in ids]))
    slots = fwd.slots(len(seqs))
    together = [[] for _ in seqs]
    for step in range(len(seqs[0])):
        logits = fwd.step(slots, [ids[step] for ids in seqs])[0]
        for b in range(len(seqs)):
            together[b].append(logits[b].copy())
    return alone, [np.stack(t) for t in together]


@pytest.mark.parametrize("quant", ["int8", "q4"])
def test_quantized_experts_batch_invariant_and_close_to_f32(quant):
    H, V, E, k, inter = 256, 40, 8, 2, 256          # whole 256-blocks: q4 stores Q4_K / Q6_K panels
    a = _arrays(H, V, E, inter, 64, True, seed=1)
    graph = _graph(H, V, E, k, inter, "softmax_topk", True, 64, True, experts_only=True)
    program = compile_graph(graph, _ArrayWeights(a), quant=quant, n_ctx=32, max_chunk=8)
    kinds = {tuple(row[c] for c in (M.TABLE_GATE, M.TABLE_UP, M.TABLE_DOWN))
             for call in program.meta["moe"].values() for row in call["table"][:E]}     # the routed ones
    from cpullm_kernels.program import program_table as P
    want_kind = P.WEIGHT_Q8 if quant == "int8" else P.WEIGHT_BLOCKS
    assert all(set(k3) == {want_kind} for k3 in kinds)
    if quant == "q4":
        assert program.meta["block_bytes"].get("Q4_K", 0) > 0
    ex = Executor(program)
    fwd = Forward(ex, numba.get_num_threads())
    rng = np.random.default_rng(5)
    seqs = [[int(t) for t in rng.integers(0, V, 6)] for _ in range(4)]
    alone, together = _decode_alone_and_batched(fwd, seqs)
    for x, y in zip(alone, together):
        np.testing.assert_array_equal(x, y)             # batch invariance, bit for bit
    # prefill (rows grouped by expert, several rows per expert) agrees with decode row by row
    slot = fwd.new_slot()
    pre = fwd.prefill(slot, seqs[0], all_logits=True)
    np.testing.assert_allclose(pre, alone[0], rtol=0, atol=1e-4 * np.abs(alone[0]).max())
    # against float64 on the weights as stored (q4: Q4_K gate / up, Q6_K down in this "more bits"
    # layer, Q8_0 for the shared down projection of K 64), the router seeing exact inputs: what is
    # left is the activations' rounding (int16 per 32 for q8, int8 per 32 for raw blocks)
    stored = a if quant == "int8" else {n: _as_q4(n, w) for n, w in a.items()}
    want = _reference(stored, seqs[0], E, k, "softmax_topk", True, 64, True)
    err = np.abs(alone[0] - want).max() / np.abs(want).max()
    assert err < (0.02 if quant == "int8" else 0.03), err


@pytest.mark.parametrize("quant", ["int8", "q4"])
def test_chosen_experts_at_once_equal_one_expert_at_a_time(quant):
    """The routed experts' matrices of a step go through two calls (every gate and up, then every
    down: formats.matmul_many) where they went three an expert: the same numbers, bit for bit,
    for a decode row and for a batch whose rows share experts."""
    H, V, E, k, inter = 256, 40, 8, 2, 256
    a = _arrays(H, V, E, inter, 0, False, seed=2)
    graph = _graph(H, V, E, k, inter, "softmax_topk", True, 0, False, experts_only=True)
    ex = Executor(compile_graph(graph, _ArrayWeights(a), quant=quant, n_ctx=32, max_chunk=8))
    call = next(iter(ex.moe.values()))
    rng = np.random.default_rng(7)
    for T in (1, 5):
        x = rng.standard_normal((T, H)).astype(np.float32)
        idx, wts = np.empty((T, k), np.int64), np.empty((T, k), np.float32)
        M.route(x, a["layers.0.moe.router"], k, M.ROUTE_SOFTMAX_TOPK, True, idx, wts)
        counts = np.bincount(idx.ravel(), minlength=E + 1).astype(np.int64)
        start = np.concatenate([[0], np.cumsum(counts[:E])]).astype(np.int64)
        pairs = np.argsort(idx.ravel(), kind="stable").astype(np.int64)     # t * k + j, by expert
        assert M._all_at_once(call.table, counts, E, inter, H)
        got = np.empty((T * k, H), np.float32)
        M._chosen_at_once(ex.wq, ex.ws, call.wb, call.table, counts, start, pairs, x, k, inter,
                          M.ACT_SILU, got, 2)
        for e in np.flatnonzero(counts[:E]):
            mine = pairs[start[e]: start[e] + counts[e]]
            want = np.empty((len(mine), H), np.float32)
            M._expert(ex.wq, ex.ws, ex.wf, call.wb, call.table, e, inter, M.ACT_SILU, x[mine // k], want, 2)
            np.testing.assert_array_equal(got[mine], want)


def _as_q4(name, w):
    """An expert matrix as q4 mode stores it, dequantized (others unchanged)."""
    from cpullm_kernels.rows.gguf_blocks import dequantize_ref
    from cpullm.compile.quant_blocks import quantize_q4_rows
    if ".experts." not in name and ".shared." not in name:
        return w
    fmt = ("Q8_0" if ".shared." in name else "Q6_K") if "down" in name else "Q4_K"
    data, Kp = quantize_q4_rows(w.copy(), fmt)
    return dequantize_ref(data, fmt, (w.shape[0], Kp))[:, :w.shape[1]]


SPARSE = dict(H=64, V=24, E=16, k=2, inter=64)
"""A layer of 16 experts, 2 a token: what a step reads of them is countable."""


def _sparse_int8():
    """(executor, forward, its MOE call) of an INT8 program of one SPARSE layer (Qwen3-MoE routing)."""
    H, V, E, k, inter = (SPARSE[n] for n in ("H", "V", "E", "k", "inter"))
    ex = Executor(compile_graph(_graph(H, V, E, k, inter, "softmax_topk", True, 0, False),
                                _ArrayWeights(_arrays(H, V, E, inter, 0, False)), quant="int8", n_ctx=32, max_chunk=8))
    return ex, Forward(ex, numba.get_num_threads()), next(iter(ex.moe.values()))


def test_decode_reads_only_the_chosen_experts():
    E, k = SPARSE["E"], SPARSE["k"]
    ex, fwd, call = _sparse_int8()
    slot = fwd.new_slot()
    fwd.step([slot], [7])
    per_expert = call.expert_bytes[0]
    assert call.bytes_read == k * per_expert            # one token: exactly its k experts
    assert (call.counts[:E] > 0).sum() == k
    before = call.bytes_read
    slots = fwd.slots(4)
    fwd.step(slots, [1, 2, 3, 4])                       # a batch reads each chosen expert once
    chosen = int((call.counts[:E] > 0).sum())
    assert call.bytes_read - before == chosen * per_expert and chosen <= 4 * k


def test_moe_node_checks_its_attributes():
    g = GraphBuilder()
    h = blocks.embed(g, 8)
    with pytest.raises(GraphError, match="top_k"):
        m = blocks.moe_mlp(g, 0, h, hidden=8, n_experts=2, top_k=3, intermediate=4)
        g.build(blocks.lm_head(g, m, 10, 1e-6))


def test_route_matches_reference_order_and_weights():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 16)).astype(np.float32)
    router = rng.standard_normal((9, 16)).astype(np.float32)
    for routing, norm in (("softmax_topk", True), ("softmax_topk", False), ("topk_softmax", False)):
        idx = np.empty((5, 3), np.int64)
        wts = np.empty((5, 3), np.float32)
        M.route(x, router, 3, M.ROUTINGS[routing], norm, idx, wts)
        logits = x.astype(np.float64) @ router.T.astype(np.float64)
        np.testing.assert_array_equal(idx, np.argsort(-logits, axis=1, kind="stable")[:, :3])
        z = np.exp(logits - logits.max(1, keepdims=True))
        sel = np.take_along_axis(z, idx, 1)
        w = sel / z.sum(1, keepdims=True) if routing == "softmax_topk" else sel / sel.sum(1, keepdims=True)
        if norm:
            w = w / w.sum(1, keepdims=True)
        np.testing.assert_allclose(wts, w, rtol=1e-5)


def test_executor_calls_the_kernel_with_a_warmed_signature():
    from cpullm_kernels.setup import warmup
    H, V, E, k, inter = 256, 24, 4, 2, 256
    a = _arrays(H, V, E, inter, 0, False)
    for quant in ("int8", "q4"):
        fwd = Forward(Executor(compile_graph(_graph(H, V, E, k, inter, "softmax_topk", True, 0, False),
                                             _ArrayWeights(a), quant=quant, n_ctx=16, max_chunk=4)), 2)
        slot = fwd.new_slot()
        fwd.prefill(slot, [1, 2, 3])
        fwd.step([slot], [4])
    warmed = {sig for unit in ("moe", "moe_blocks") for _, sig in warmup._kernels(unit)}
    assert set(M.moe.signatures) <= warmed and len(M.moe.signatures) == 2


@pytest.mark.parametrize("quant", ["int8", "q4"])
def test_a_moe_program_comes_back_from_the_execution_cache(quant, tmp_path, monkeypatch):
    """The cache's checker knows MOE rows and their expert tables: a second load is a HIT with the
    same logits."""
    import cpullm
    from cpullm import testing
    pytest.importorskip("cpullm_qwen", reason="the tiny MoE config is the qwen plugin's")
    from cpullm_qwen.tiny_configs import QWEN3_MOE
    monkeypatch.setenv("CPULLM_CACHE_DIR", str(tmp_path / "cache"))
    d = testing.make_random_checkpoint(QWEN3_MOE, tmp_path / "m")
    ids = [256, 5, 9, 12, 40, 41]
    first = cpullm.load(d, quant=quant)
    second = cpullm.load(d, quant=quant)
    assert second.info()["cache"] == "HIT"
    np.testing.assert_array_equal(first.logits(ids), second.logits(ids))


def test_the_memory_bound_reads_each_steps_chosen_experts():
    """`cpullm bench`'s plain read after a decode step covers what the step read: the dense
    matrices, the router and the k experts it chose (not every expert, and not none)."""
    from types import SimpleNamespace
    from cpullm.bench.memory_bound import decode_weight_bytes, memory_bound, moe_spans
    H, E, k = SPARSE["H"], SPARSE["E"], SPARSE["k"]
    ex, fwd, call = _sparse_int8()
    model = SimpleNamespace(program=ex.program, executor=ex, forward=fwd, slot=fwd.new_slot(), n_ctx=32)
    fwd.step([model.slot], [7])
    routed = k * call.expert_bytes[0] + 4 * E * H           # the k experts and the float32 router
    assert sum(v.nbytes for v in moe_spans(ex.program, ex)) == routed
    r = memory_bound(model, steps=4)
    assert r["decode_weight_bytes"] == decode_weight_bytes(ex.program) + routed
