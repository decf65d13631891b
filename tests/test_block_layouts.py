"""The blocks' layouts beyond pre-norm: OLMo 2 (norms after attention and MLP, q/k RMSNorm over
the whole projection) as a family written in this test, registered in-process, at f32 parity with
transformers' Olmo2ForCausalLM."""
from __future__ import annotations

import attrs
import numpy as np
import pytest

pytestmark = pytest.mark.reference   # needs torch and transformers

torch = pytest.importorskip("torch", reason="torch is a test dependency (pip install -e '.[test]')")
transformers = pytest.importorskip("transformers", reason="transformers is a test dependency")

import cpullm  # noqa: E402
from cpullm.graph import blocks  # noqa: E402
from cpullm.loading import plugins  # noqa: E402
from cpullm import testing  # noqa: E402
from cpullm.loading.family import Args, FamilySpec  # noqa: E402
from cpullm.hookspecs import hookimpl  # noqa: E402
from cpullm.loading.weightmap import W, WeightMap  # noqa: E402
from hf_reference import TINY_VOCAB, hf_greedy, hf_logits, hf_model, save_tiny  # noqa: E402


@attrs.define
class Olmo2Args(Args):
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None
    rms_norm_eps: float = 1e-6
    vocab_size: int = 100
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    head_dim: int = attrs.field(init=False, default=0)           # derived
    rope: object = attrs.field(init=False, default=None)         # derived

    def derive(self, config):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.hidden_size // self.num_attention_heads
        self.rope = blocks.make_rope(blocks.rope_parameters(config), self.head_dim)


def weight_map(a: Olmo2Args) -> WeightMap:
    H, V, I = a.hidden_size, a.vocab_size, a.intermediate_size
    q, kv = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
    L = "model.layers.{i}."
    return WeightMap(rules=[
        W("embed", "model.embed_tokens.weight", (V, H)),
        W("final_norm", "model.norm.weight", (H,)),
        W("lm_head", "lm_head.weight", (V, H)),
        W("layers.{i}.post_attn_norm", L + "post_attention_layernorm.weight", (H,)),
        W("layers.{i}.post_mlp_norm", L + "post_feedforward_layernorm.weight", (H,)),
        W("layers.{i}.attn.q_proj", L + "self_attn.q_proj.weight", (q, H)),
        W("layers.{i}.attn.k_proj", L + "self_attn.k_proj.weight", (kv, H)),
        W("layers.{i}.attn.v_proj", L + "self_attn.v_proj.weight", (kv, H)),
        W("layers.{i}.attn.o_proj", L + "self_attn.o_proj.weight", (H, q)),
        W("layers.{i}.attn.q_norm", L + "self_attn.q_norm.weight", (q,)),       # whole projection
        W("layers.{i}.attn.k_norm", L + "self_attn.k_norm.weight", (kv,)),
        W("layers.{i}.mlp.gate_proj", L + "mlp.gate_proj.weight", (I, H)),
        W("layers.{i}.mlp.up_proj", L + "mlp.up_proj.weight", (I, H)),
        W("layers.{i}.mlp.down_proj", L + "mlp.down_proj.weight", (H, I)),
    ], n_layers=a.num_hidden_layers)


def build_graph(a: Olmo2Args, g):
    def mixer(g, i, x):
        return blocks.attention(g, i, x, hidden=a.hidden_size, n_heads=a.num_attention_heads,
                                n_kv_heads=a.num_key_value_heads, head_dim=a.head_dim, rope_spec=a.rope,
                                scale=a.head_dim ** -0.5, qk_norm_eps=a.rms_norm_eps,
                                qk_norm_per_head=False)

    def mlp(g, i, x):
        return blocks.glu_mlp(g, i, x, a.hidden_size, a.intermediate_size, act="silu")

    h = blocks.embed(g, a.hidden_size)
    for i in range(a.num_hidden_layers):
        h = blocks.decoder_layer(g, i, h, mixer, mlp, a.rms_norm_eps, layout="post")
    return g.build(blocks.lm_head(g, h, a.vocab_size, a.rms_norm_eps))


FAMILY = FamilySpec(name="olmo2_test", model_types=("olmo2",), args_class=Olmo2Args,
                    weight_map=weight_map, build_graph=build_graph, description="OLMo 2 (test)")


class _Plugin:
    __name__ = "olmo2_test_plugin"

    @hookimpl
    def cpullm_families(self):
        return [FAMILY]


CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=TINY_VOCAB, bos_token_id=256,
              eos_token_id=257, pad_token_id=1, max_position_embeddings=512, tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
IDS = [256] + [int(x) for x in np.random.default_rng(3).integers(0, 255, 39)]


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory):
    from transformers import Olmo2Config

    plugin = _Plugin()
    plugins.register_for_tests(plugin)
    plugins.discover(refresh=True)
    d = save_tiny(Olmo2Config(**CONFIG), tmp_path_factory.mktemp("olmo2"), seed=5)
    ref = hf_model(d)
    yield d, hf_logits(ref, IDS), hf_greedy(ref, IDS[:8], 16)
    plugins.unregister_for_tests(plugin)
    plugins.discover(refresh=True)


def test_post_norm_layout_and_whole_projection_qk_norm_graph():
    a = Olmo2Args.from_config(dict(CONFIG))
    from cpullm.graph.ir import GraphBuilder, Op
    graph = build_graph(a, GraphBuilder())
    norms = {n.name: n for n in graph.nodes if n.op == Op.RMSNORM}
    assert "layers.0.attn_norm" not in norms and "layers.0.post_attn_norm" in norms
    assert norms["layers.0.attn.q_norm"].attr("group_size") == a.num_attention_heads * a.head_dim
    assert norms["layers.0.attn.k_norm"].attr("group_size") == a.num_key_value_heads * a.head_dim


def test_olmo2_layout_at_f32_parity_with_transformers(olmo2):
    d, ref_logits, ref_tokens = olmo2
    report = testing.run_conformance(d, IDS, reference_logits=ref_logits, reference_tokens=ref_tokens,
                                     greedy_prompt=IDS[:8], family="olmo2_test")
    assert report["parity_err"] <= testing.F32_TOLERANCE
    assert report["notes"] == []
    model = cpullm.load(d, quant="f32", use_cache=False)
    assert np.isfinite(model.logits(IDS)).all()
