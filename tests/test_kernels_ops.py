"""Every non-matmul numba kernel against its numpy reference (odd sizes, strided operands)."""
import numpy as np
import pytest

from cpullm.graph.ir import Op
from cpullm_kernels.attention import attention as A
from cpullm_kernels.ops import elementwise as E
from cpullm_kernels.attention import gated_delta as G
from cpullm_kernels.program import interpreter as K
from cpullm_kernels.ops import norm as N
from cpullm_kernels.ops import rope as R
from cpullm_kernels.program import program_table as P
from cpullm_kernels.program import row_ops

rng = np.random.default_rng(0)


def row_op_par(op, cols, fcols, arena, wf, T, pos0=0, layernorm=False):
    """One row-op instruction over rows [0, T), as the interpreter runs a prefill chunk
    (row_ops.row_op_par: a row per task of one parallel region)."""
    I = np.zeros((1, P.NI), np.int64)
    F = np.zeros((1, P.NF), np.float64)
    I[0, P.COL_OP] = op
    for c, v in cols.items():
        I[0, c] = v
    for c, v in fcols.items():
        F[0, c] = v
    I.flags.writeable = F.flags.writeable = False
    row_ops.row_op_par(I, F, 0, arena, wf, wf if layernorm else None, pos0, T)


def _arena_with(*mats, extra=0):
    """Place (T, w) matrices in one flat arena with a row stride wider than w (like fused outputs)."""
    offs, pos = [], 0
    for m in mats:
        offs.append(pos)
        pos += m.shape[0] * (m.shape[1] + 3)
    arena = np.zeros(pos + extra, np.float32)
    for m, o in zip(mats, offs):
        st = m.shape[1] + 3
        arena[o: o + m.shape[0] * st].reshape(m.shape[0], st)[:, : m.shape[1]] = m
    return arena, offs, pos


def _view(arena, off, T, st, w):
    return arena[off: off + T * st].reshape(T, st)[:, :w]


def test_opcodes_match_ir():
    for name in ("EMBED", "RMSNORM", "LINEAR", "ROPE", "ATTENTION", "GLU", "ADD", "SIGMOID_MUL",
                 "SOFTCAP", "SELECT_ROWS", "GATED_DELTA", "SCALE", "LAYERNORM"):
        assert getattr(K, f"OP_{name}") == int(getattr(Op, name))


@pytest.mark.parametrize("T,width,group", [(1, 37, 37), (5, 64, 16), (9, 96, 96)])
@pytest.mark.parametrize("parallel", [False, True])
def test_rmsnorm(T, width, group, parallel):
    x = rng.standard_normal((T, width)).astype(np.float32)
    w = rng.standard_normal(group).astype(np.float32)
    arena, (xo,), end = _arena_with(x, extra=T * width)
    if parallel:
        row_op_par(P.OP_RMSNORM, {P.NORM_X_OFF: xo, P.NORM_X_ST: width + 3, P.NORM_OUT_OFF: end,
                                  P.NORM_OUT_ST: width, P.NORM_WIDTH: width, P.NORM_GROUP: group, P.NORM_W_OFF: 0},
                   {P.F_NORM_EPS: 1e-6}, arena, w, T)
    else:
        N.rmsnorm_rows(arena, xo, width + 3, end, width, width, group, w, 0, 1e-6, 0, T)
    got = arena[end: end + T * width].reshape(T, width)
    np.testing.assert_allclose(got, N.rmsnorm_ref(x, w, 1e-6, group), rtol=1e-5, atol=1e-5)


@pytest.mark.reference
@pytest.mark.parametrize("T,width,group", [(1, 37, 37), (5, 64, 16), (9, 96, 96)])
@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_layernorm_against_numpy_and_torch(T, width, group, parallel, bias):
    torch = pytest.importorskip("torch", reason="torch is a test dependency")
    x = (rng.standard_normal((T, width)) * 3 + 1.5).astype(np.float32)     # far from mean zero
    w = rng.standard_normal(group).astype(np.float32)
    b = rng.standard_normal(group).astype(np.float32) if bias else None
    wf = np.concatenate([w, b if bias else np.zeros(0, np.float32)])
    b_off = group if bias else -1
    arena, (xo,), end = _arena_with(x, extra=T * width)
    if parallel:
        row_op_par(P.OP_LAYERNORM, {P.NORM_X_OFF: xo, P.NORM_X_ST: width + 3, P.NORM_OUT_OFF: end,
                                    P.NORM_OUT_ST: width, P.NORM_WIDTH: width, P.NORM_GROUP: group, P.NORM_W_OFF: 0,
                                    P.NORM_BIAS_OFF: b_off}, {P.F_NORM_EPS: 1e-5}, arena, wf, T, layernorm=True)
    else:
        N.layernorm_rows(arena, xo, width + 3, end, width, width, group, wf, 0, b_off, 1e-5, 0, T)
    got = arena[end: end + T * width].reshape(T, width)
    ref = N.layernorm_ref(x, w, b, 1e-5, group)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    tx = torch.from_numpy(x).reshape(T, width // group, group)
    want = torch.nn.functional.layer_norm(tx, (group,), torch.from_numpy(w),
                                          torch.from_numpy(b) if bias else None, 1e-5)
    np.testing.assert_allclose(got, want.reshape(T, width).numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_layernorm_node_in_a_program_prefill_and_decode(bias):
    """blocks.layernorm compiled and run by the interpreter: batched prefill and one-row decode."""
    from cpullm.graph import blocks
    from cpullm.compile.compiler import compile_graph
    from cpullm.run.executor import Executor
    from cpullm.graph.ir import GraphBuilder

    H, V = 40, 24
    g = GraphBuilder()
    h = blocks.embed(g, H)
    h = blocks.layernorm(g, "ln", h, "ln", 1e-5, bias="ln_bias" if bias else None)
    graph = g.build(blocks.lm_head(g, h, V, 1e-5, norm_kind="layer", norm_bias=bias))
    arrays = {"embed": (rng.standard_normal((V, H)) * 2 + 1).astype(np.float32),
              "ln": rng.standard_normal(H).astype(np.float32),
              "final_norm": rng.standard_normal(H).astype(np.float32),
              "lm_head": rng.standard_normal((V, H)).astype(np.float32)}
    if bias:
        arrays.update(ln_bias=rng.standard_normal(H).astype(np.float32),
                      final_norm_bias=rng.standard_normal(H).astype(np.float32))
    from cpullm.testing import _ArrayWeights
    from steps import Steps
    ex = Steps(Executor(compile_graph(graph, _ArrayWeights(arrays), quant="f32", n_ctx=16, max_chunk=8)))
    ids = [3, 1, 4, 1, 5]
    x = N.layernorm_ref(arrays["embed"][ids], arrays["ln"], arrays.get("ln_bias"), 1e-5)
    x = N.layernorm_ref(x, arrays["final_norm"], arrays.get("final_norm_bias"), 1e-5)
    want = x @ arrays["lm_head"].T
    np.testing.assert_allclose(ex.prefill(ids, all_logits=True), want, rtol=1e-4, atol=1e-4)
    ex.reset()
    got = np.stack([np.array(ex.decode(t)) for t in ids])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rotary_dim", [16, 8])
def test_rope(rotary_dim):
    T, nh, hd, pos0 = 6, 3, 16, 11
    x = rng.standard_normal((T, nh * hd)).astype(np.float32)
    inv = (1.0 / 10000 ** (np.arange(0, rotary_dim, 2) / rotary_dim)).astype(np.float32)
    arena, (xo,), end = _arena_with(x, extra=T * nh * hd)
    row_op_par(P.OP_ROPE, {P.ROPE_X_OFF: xo, P.ROPE_X_ST: nh * hd + 3, P.ROPE_OUT_OFF: end, P.ROPE_OUT_ST: nh * hd,
                           P.ROPE_N_HEADS: nh, P.ROPE_HEAD_DIM: hd, P.ROPE_ROTARY_DIM: rotary_dim, P.ROPE_FREQ_OFF: 0},
               {P.F_ROPE_SCALING: 1.0}, arena, inv, T, pos0=pos0)
    got = arena[end: end + T * nh * hd].reshape(T, nh * hd)
    np.testing.assert_allclose(got, R.rope_ref(x, np.arange(pos0, pos0 + T), nh, hd, inv), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("nthreads", [1, 2, 4])     # 2, 4: decode splits the keys of 1-3 KV heads into ranges
@pytest.mark.parametrize("nh,nkv", [(6, 2), (4, 1), (3, 3), (14, 2), (9, 3)])
@pytest.mark.parametrize("hd", [8, 16, 64, 80])     # 8: plain value loop; others: 16-lane IR passes
@pytest.mark.parametrize("window,softcap,chunks", [(0, 0.0, [7, 1, 1, 5]), (4, 0.0, [9, 1, 1, 3]),
                                                   (3, 0.0, [2, 6, 1, 5, 4]), (0, 20.0, [3, 1]),
                                                   (0, 0.0, [150, 1]),                   # > MAX_CHUNKS jobs
                                                   (50, 0.0, [90, 2, 40, 1])])           # the ring wraps
def test_attention_prefill_then_decode(window, softcap, chunks, hd, nh, nkv, nthreads):
    total = sum(chunks)
    q = rng.standard_normal((total, nh * hd)).astype(np.float32)
    k = rng.standard_normal((total, nkv * hd)).astype(np.float32)
    v = rng.standard_normal((total, nkv * hd)).astype(np.float32)
    ref = A.attention_ref(q, k, v, nh, nkv, hd, 0.3, softcap, window)
    cap = A.padded_cap((window + max(chunks)) if window else total)
    state = np.full(2 * nkv * cap * hd, 1e30, np.float32)     # stale slots must never be read
    pos, outs = 0, []
    for T in chunks:
        arena, (qo, ko, vo), end = _arena_with(q[pos:pos + T], k[pos:pos + T], v[pos:pos + T], extra=T * nh * hd)
        A.attention(arena, state, qo, nh * hd + 3, ko, nkv * hd + 3, vo, nkv * hd + 3, end, nh * hd,
                    nh, nkv, hd, 0, cap, 0.3, softcap, window, pos, T, nthreads, A.kv_operand(A.KV_F32))
        outs.append(arena[end: end + T * nh * hd].reshape(T, nh * hd).copy())
        pos += T
    np.testing.assert_allclose(np.concatenate(outs), ref, rtol=1e-4, atol=1e-5)


def test_kv_cache_layout():
    # keys land in tiles of 16 slots (transposed inside a tile), values one row per slot
    nkv, hd, cap, T, pos0 = 2, 24, 48, 5, 14           # slots 14..18 cross a tile boundary
    k = rng.standard_normal((T, nkv * hd)).astype(np.float32)
    v = rng.standard_normal((T, nkv * hd)).astype(np.float32)
    arena, (ko, vo), _ = _arena_with(k, v)
    state = np.zeros(2 * nkv * cap * hd, np.float32)
    A.kv_write(arena, state, ko, nkv * hd + 3, vo, nkv * hd + 3, nkv, hd, 0, cap, pos0, T, A.kv_operand(A.KV_F32))
    kt, vc = A.kv_views(state, nkv, cap, hd)
    for t in range(T):
        slot = pos0 + t
        for h in range(nkv):
            np.testing.assert_array_equal(kt[h, slot // 16, :, slot % 16], k[t, h * hd:(h + 1) * hd])
            np.testing.assert_array_equal(vc[h, slot], v[t, h * hd:(h + 1) * hd])


@pytest.mark.parametrize("act", [E.ACT_SILU, E.ACT_GELU_TANH])
def test_glu(act):
    T, w = 4, 45
    g, u = rng.standard_normal((2, T, w)).astype(np.float32)
    arena, (go, uo), end = _arena_with(g, u, extra=T * w)
    row_op_par(P.OP_GLU, {P.GLU_GATE_OFF: go, P.GLU_GATE_ST: w + 3, P.GLU_UP_OFF: uo, P.GLU_UP_ST: w + 3,
                          P.GLU_OUT_OFF: end, P.GLU_OUT_ST: w, P.GLU_WIDTH: w, P.GLU_ACT: act},
               {}, arena, np.zeros(1, np.float32), T)
    np.testing.assert_allclose(arena[end:end + T * w].reshape(T, w), E.glu_ref(g, u, act), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", [E.BIN_ADD, E.BIN_SIGMOID_MUL])
def test_binary(kind):
    T, w = 3, 33
    a, b = rng.standard_normal((2, T, w)).astype(np.float32)
    arena, (ao, bo), end = _arena_with(a, b, extra=T * w)
    E.binary_rows(arena, ao, w + 3, bo, w + 3, end, w, w, kind, 0, T)
    np.testing.assert_allclose(arena[end:end + T * w].reshape(T, w), E.binary_ref(a, b, kind), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind,c", [(E.UN_SOFTCAP, 5.0), (E.UN_SCALE, 0.7)])
def test_unary(kind, c):
    T, w = 2, 19
    x = (rng.standard_normal((T, w)) * 8).astype(np.float32)
    arena, (xo,), end = _arena_with(x, extra=T * w)
    E.unary_rows(arena, xo, w + 3, end, w, w, kind, c, 0, T)
    np.testing.assert_allclose(arena[end:end + T * w].reshape(T, w), E.unary_ref(x, kind, c), rtol=1e-5, atol=1e-5)


def test_gated_delta_prefill_then_decode_matches_reference():
    nk, dk, nv, dv, K = 2, 8, 4, 6, 4
    C = 2 * nk * dk + nv * dv
    T1, T2 = 7, 3
    T = T1 + T2
    qkv = rng.standard_normal((T, C)).astype(np.float32)
    z = rng.standard_normal((T, nv * dv)).astype(np.float32)
    b = rng.standard_normal((T, nv)).astype(np.float32)
    a = rng.standard_normal((T, nv)).astype(np.float32)
    conv_w = (rng.standard_normal((C, K)) * 0.5).astype(np.float32)
    dt = rng.standard_normal(nv).astype(np.float32)
    alog = np.log(rng.uniform(1, 8, nv)).astype(np.float32)
    norm_w = rng.standard_normal(dv).astype(np.float32)
    ref, _, _ = G.gated_delta_ref(qkv, z, b, a, conv_w, dt, alog, norm_w, nk, dk, nv, dv, 1e-6)
    wf = np.concatenate([conv_w.ravel(), dt, alog, norm_w]).astype(np.float32)
    offs = np.cumsum([0, conv_w.size, nv, nv])
    state = np.zeros(G.state_size(nk, dk, nv, dv, K), np.float32)
    outs = []
    for lo, hi in ((0, T1), (T1, T1 + 1), (T1 + 1, T)):
        n = hi - lo
        arena, (qo, zo, bo, ao), end = _arena_with(qkv[lo:hi], z[lo:hi], b[lo:hi], a[lo:hi], extra=n * nv * dv)
        G.gated_delta(arena, state, wf, qo, C + 3, zo, nv * dv + 3, bo, nv + 3, ao, nv + 3, end, nv * dv,
                      nk, dk, nv, dv, K, offs[0], offs[1], offs[2], offs[3], 0, 1e-6, n)
        outs.append(arena[end:end + n * nv * dv].reshape(n, nv * dv).copy())
    np.testing.assert_allclose(np.concatenate(outs), ref, rtol=2e-4, atol=2e-5)


# ---- bandwidth: the streaming read decode is measured against ------------------------------------
@pytest.mark.parametrize("n", [0, 1, 7, 4096, 100_003])
@pytest.mark.parametrize("nchunks", [1, 2, 5])
def test_read_sum_u32_matches_numpy_wrapping_sum(n, nchunks):
    from cpullm_kernels.setup import bandwidth as B
    a = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    assert B.read_sum_u32(a, nchunks) == B.read_sum_u32_ref(a)


def test_as_words_views_whole_words_and_read_rate_counts_them():
    from cpullm_kernels.setup import bandwidth as B
    q = rng.integers(-127, 128, 4099, dtype=np.int64).astype(np.int8)     # 4099 bytes: 1024 words
    s = rng.integers(0, 2**16, 10, dtype=np.int64).astype(np.uint16)       # 20 bytes: 5 words
    w = B.as_words(q)
    assert w.dtype == np.uint32 and w.size == 1024 and np.shares_memory(w, q)
    assert bytes(w.view(np.uint8)) == bytes(q.view(np.uint8)[:4096])
    r = B.read_rate([q, s, q[:0]], repeat=2)
    assert r["bytes"] == 4096 + 20 and r["passes"] == 2
    assert r["gbps"] > 0 and r["best_gbps"] >= r["gbps"]
    with pytest.raises(ValueError, match="nothing to read"):
        B.read_rate([q[:3]])


def test_row_ops_give_each_row_the_row_kernels_bits_in_parallel_and_serially():
    """row_ops.row_op (decode) and row_op_par (prefill) call the same compiled row kernels through
    their address: every row equal to the bit, whichever ran it, and to the kernel called alone."""
    T, w = 7, 61
    x, y = (rng.standard_normal((2, T, w)) * 3).astype(np.float32)
    wts = rng.standard_normal(w).astype(np.float32)
    cases = [
        (P.OP_RMSNORM, {P.NORM_X_OFF: 0, P.NORM_X_ST: w + 3, P.NORM_WIDTH: w, P.NORM_GROUP: w, P.NORM_W_OFF: 0},
         {P.F_NORM_EPS: 1e-6}, lambda a, o: N.rmsnorm_rows(a, 0, w + 3, o, w, w, w, wts, 0, 1e-6, 0, T)),
        (P.OP_SIGMOID_MUL, {P.BINARY_A_OFF: 0, P.BINARY_A_ST: w + 3, P.BINARY_B_OFF: T * (w + 3),
                            P.BINARY_B_ST: w + 3, P.BINARY_WIDTH: w}, {},
         lambda a, o: E.binary_rows(a, 0, w + 3, T * (w + 3), w + 3, o, w, w, E.BIN_SIGMOID_MUL, 0, T)),
        (P.OP_SOFTCAP, {P.UNARY_X_OFF: 0, P.UNARY_X_ST: w + 3, P.UNARY_WIDTH: w}, {P.F_UNARY_PARAM: 2.5},
         lambda a, o: E.unary_rows(a, 0, w + 3, o, w, w, E.UN_SOFTCAP, 2.5, 0, T)),
    ]
    out_col = {P.OP_RMSNORM: (P.NORM_OUT_OFF, P.NORM_OUT_ST), P.OP_SIGMOID_MUL: (P.BINARY_OUT_OFF, P.BINARY_OUT_ST),
               P.OP_SOFTCAP: (P.UNARY_OUT_OFF, P.UNARY_OUT_ST)}
    for op, cols, fcols, alone in cases:
        arena, _, end = _arena_with(x, y, extra=T * w)
        results = []
        for run in ("alone", "serial", "parallel"):
            a = arena.copy()
            if run == "alone":
                alone(a, end)
            else:
                I = np.zeros((1, P.NI), np.int64)
                F = np.zeros((1, P.NF), np.float64)
                I[0, P.COL_OP] = op
                I[0, list(out_col[op])] = end, w
                for c, v in cols.items():
                    I[0, c] = v
                for c, v in fcols.items():
                    F[0, c] = v
                if run == "serial":
                    row_ops.row_op(I, F, 0, a, wts, None, 0, 0, T)
                else:
                    row_ops.row_op_par(I, F, 0, a, wts, None, 0, T)
            results.append(a[end: end + T * w])
        np.testing.assert_array_equal(results[0], results[1])
        np.testing.assert_array_equal(results[0], results[2])
        assert not np.isnan(results[0]).any()
