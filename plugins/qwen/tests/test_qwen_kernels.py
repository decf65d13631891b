"""The Qwen plugin's fused Gated DeltaNet kernel, directly: same signature and state layout as the
core's reference kernel, same results (prefill chunks and decode steps, strided operands, rep > 1),
and both against transformers' own Qwen3_5GatedDeltaNet module."""
import inspect
import re

import numpy as np
import pytest

from cpullm.graph.ir import Op
from cpullm_kernels.attention import gated_delta as G
from cpullm_kernels.program import interpreter as K
from cpullm_qwen import kernels as QK
from cpullm_qwen.gated_delta_fused import gated_delta_fused

CHUNKS = (7, 1, 1, 5, 1)          # prefill, decode, decode, prefill, decode


def _params(fn):
    fn = getattr(fn, "py_func", fn)
    return list(inspect.signature(fn).parameters)


def test_kernel_spec_matches_reference_signature():
    ref = _params(G.gated_delta)
    assert _params(QK.KERNEL.fn) == ref == _params(gated_delta_fused)
    listed = re.findall(r"\w+", K.EXTERNAL_SIGNATURES[K.OP_GATED_DELTA])[1:]
    assert listed == ref
    assert QK.KERNEL.op == Op.GATED_DELTA and QK.KERNEL.version


class _Layer:
    """Random Gated DeltaNet inputs and parameters, laid out as the compiler does."""

    def __init__(self, nk, dk, nv, dv, ck, T, seed=0):
        rng = np.random.default_rng(seed)
        self.dims = (nk, dk, nv, dv, ck)
        self.C = 2 * nk * dk + nv * dv
        f = np.float32
        self.qkv = rng.standard_normal((T, self.C)).astype(f)
        self.z = rng.standard_normal((T, nv * dv)).astype(f)
        self.b = rng.standard_normal((T, nv)).astype(f)
        self.a = (rng.standard_normal((T, nv)) * 2).astype(f)
        self.conv = (rng.standard_normal((self.C, ck)) * 0.5).astype(f)
        self.dt = rng.standard_normal(nv).astype(f)
        self.alog = np.log(rng.uniform(1, 8, nv)).astype(f)
        self.norm = rng.standard_normal(dv).astype(f)
        self.wf = np.concatenate([self.conv.ravel(), self.dt, self.alog, self.norm]).astype(f)
        self.offs = [int(x) for x in np.cumsum([0, self.conv.size, nv, nv])]

    def run(self, fn, chunks=CHUNKS, pad=3):
        """Feed the tokens in chunks through ``fn`` with row strides wider than the values (as
        fused projections give); returns (outputs (T, nv*dv), final state)."""
        nk, dk, nv, dv, ck = self.dims
        state = np.zeros(G.state_size(nk, dk, nv, dv, ck), np.float32)
        outs, lo = [], 0
        for n in chunks:
            sl = slice(lo, lo + n)
            mats = [self.qkv[sl], self.z[sl], self.b[sl], self.a[sl]]
            offs, pos = [], 0
            for m in mats:
                offs.append(pos)
                pos += n * (m.shape[1] + pad)
            arena = np.zeros(pos + n * nv * dv, np.float32)
            for m, o in zip(mats, offs):
                arena[o: o + n * (m.shape[1] + pad)].reshape(n, -1)[:, : m.shape[1]] = m
            fn(arena, state, self.wf, offs[0], self.C + pad, offs[1], nv * dv + pad, offs[2], nv + pad,
               offs[3], nv + pad, pos, nv * dv, nk, dk, nv, dv, ck, *self.offs, 0, 1e-6, n)
            outs.append(arena[pos: pos + n * nv * dv].reshape(n, nv * dv).copy())
            lo += n
        return np.concatenate(outs), state


@pytest.mark.parametrize("dims", [(2, 8, 4, 6, 4), (2, 8, 6, 12, 4), (3, 16, 3, 8, 2), (1, 4, 2, 4, 1)],
                         ids=lambda d: "nk{}_dk{}_nv{}_dv{}_k{}".format(*d))
def test_fused_equals_reference_kernel(dims):
    layer = _Layer(*dims, T=sum(CHUNKS))
    ref_out, ref_state = layer.run(G.gated_delta)
    out, state = layer.run(QK.KERNEL.fn)
    np.testing.assert_allclose(out, ref_out, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(state, ref_state, rtol=1e-4, atol=1e-5)
    nk, dk, nv, dv, ck = dims
    numpy_ref, conv_state, S = G.gated_delta_ref(layer.qkv, layer.z, layer.b, layer.a, layer.conv, layer.dt,
                                                 layer.alog, layer.norm, nk, dk, nv, dv, 1e-6)
    np.testing.assert_allclose(out, numpy_ref, rtol=2e-4, atol=2e-5)
    conv_floats = layer.C * (ck - 1)
    np.testing.assert_allclose(state[conv_floats:].reshape(S.shape), S, rtol=2e-4, atol=2e-5)


def test_kernels_continue_each_others_state():
    """Same state layout: the reference kernel can continue a sequence the fused one started."""
    layer = _Layer(2, 8, 4, 6, 4, T=sum(CHUNKS))
    ref_out, _ = layer.run(G.gated_delta)
    calls = iter([QK.KERNEL.fn, G.gated_delta] * 3)
    mixed_out, _ = layer.run(lambda *a: next(calls)(*a))
    np.testing.assert_allclose(mixed_out, ref_out, rtol=1e-4, atol=1e-5)


def test_kernel_supports():
    from cpullm.graph import blocks
    from cpullm.graph.ir import GraphBuilder
    g = GraphBuilder()
    x = blocks.embed(g, 32)
    blocks.gated_delta(g, 0, x, hidden=32, n_k_heads=2, k_head_dim=8, n_v_heads=4, v_head_dim=8,
                       conv_kernel=4, norm_eps=1e-6)
    node = next(n for n in g.nodes if n.op == Op.GATED_DELTA)
    assert QK.KERNEL.supports(node)


# ---- against transformers ----------------------------------------------------------------------


@pytest.mark.reference
def test_kernels_match_transformers_gated_deltanet():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    H, T = 48, 14
    cfg = Qwen3_5TextConfig(hidden_size=H, linear_num_key_heads=2, linear_key_head_dim=8,
                            linear_num_value_heads=4, linear_value_head_dim=12, linear_conv_kernel_dim=4,
                            rms_norm_eps=1e-6, num_hidden_layers=1, layer_types=["linear_attention"])
    torch.manual_seed(0)
    mod = Qwen3_5GatedDeltaNet(cfg, 0).float().eval()
    with torch.no_grad():
        for name, p in mod.named_parameters():
            if name == "A_log":
                p.copy_(torch.log(torch.rand(p.shape) * 8 + 1))
            elif name == "norm.weight":
                p.copy_(1 + 0.2 * torch.randn(p.shape))
            else:
                p.copy_(0.3 * torch.randn(p.shape))
        x = torch.randn(1, T, H)
        ref = mod(x)[0].numpy()                                    # chunked (prefill) form

    W = {n: p.detach().numpy().astype(np.float32) for n, p in mod.named_parameters()}
    xs = x[0].numpy()
    layer = _Layer(2, 8, 4, 12, 4, T=T)
    layer.qkv, layer.z = xs @ W["in_proj_qkv.weight"].T, xs @ W["in_proj_z.weight"].T
    layer.b, layer.a = xs @ W["in_proj_b.weight"].T, xs @ W["in_proj_a.weight"].T
    layer.conv = W["conv1d.weight"].reshape(layer.C, 4)
    layer.dt, layer.alog, layer.norm = W["dt_bias"], W["A_log"], W["norm.weight"]
    layer.wf = np.concatenate([layer.conv.ravel(), layer.dt, layer.alog, layer.norm]).astype(np.float32)
    scale = np.abs(ref).max()
    for fn in (G.gated_delta, QK.KERNEL.fn):
        out, _ = layer.run(fn, chunks=(6, 1, 1, 5, 1))
        got = out @ W["out_proj.weight"].T
        assert np.abs(got - ref).max() / scale < 1e-4, getattr(fn, "__name__", fn)
