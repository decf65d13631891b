"""A test-only hybrid family for the cache tests: full attention, sliding-window attention and
Gated DeltaNet (linear attention) layers in one tiny model, built from the shared blocks.

It stands in for the Gemma (sliding window) and Qwen3.5 (linear attention) plugins, so the
execution cache, prompt cache and memory report are exercised on every layer kind generically.
Import the fixtures (``_hybrid_registered``, ``hybrid_dir``, ``llama_dir``) from here; this module
holds no tests.
"""
from __future__ import annotations

import attrs
import pytest

from cpullm.graph import blocks
from cpullm.loading import plugins
from cpullm.loading.family import Args, FamilySpec
from cpullm.hookspecs import hookimpl
from cpullm.testing import make_random_checkpoint
from cpullm.loading.weightmap import W, WeightMap

MODEL_TYPE = "cpullm_test_hybrid"
WINDOW = 4

HYBRID = dict(model_type=MODEL_TYPE, hidden_size=32, intermediate_size=64, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, vocab_size=300, rms_norm_eps=1e-5,
              layer_kinds=["full", "window", "linear", "window"], sliding_window=WINDOW,
              lin_k_heads=2, lin_k_dim=8, lin_v_heads=4, lin_v_dim=8, conv_kernel=4,
              max_position_embeddings=512, tie_word_embeddings=True, rope_theta=10000.0,
              bos_token_id=256, eos_token_id=257)

LLAMA = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=300, rms_norm_eps=1e-5,
             max_position_embeddings=512, tie_word_embeddings=True, rope_theta=10000.0,
             bos_token_id=256, eos_token_id=257)


@attrs.define
class HybridArgs(Args):
    hidden_size: int = 32
    intermediate_size: int = 64
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 8
    vocab_size: int = 300
    rms_norm_eps: float = 1e-5
    layer_kinds: list = attrs.field(factory=lambda: ["full"])
    sliding_window: int = 4
    lin_k_heads: int = 2
    lin_k_dim: int = 8
    lin_v_heads: int = 4
    lin_v_dim: int = 8
    conv_kernel: int = 4
    max_position_embeddings: int = 512
    rope: object = None

    def derive(self, config):
        self.rope = blocks.make_rope(blocks.rope_parameters(config), self.head_dim)


def _weight_map(a: HybridArgs) -> WeightMap:
    H, V, I = a.hidden_size, a.vocab_size, a.intermediate_size
    q, kv = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
    att = tuple(i for i, k in enumerate(a.layer_kinds) if k != "linear")
    lin = tuple(i for i, k in enumerate(a.layer_kinds) if k == "linear")
    kd, vd = a.lin_k_heads * a.lin_k_dim, a.lin_v_heads * a.lin_v_dim
    L, A, G = "layers.{i}.", "layers.{i}.attn.", "layers.{i}.linear_attn."
    rules = [W("embed", "embed", (V, H)), W("final_norm", "final_norm", (H,)),
             W("lm_head", None, (V, H), tied_to="embed")]
    for n in ("attn_norm", "mlp_norm"):
        rules.append(W(L + n, L + n, (H,)))
    for n, s in (("mlp.gate_proj", (I, H)), ("mlp.up_proj", (I, H)), ("mlp.down_proj", (H, I))):
        rules.append(W(L + n, L + n, s))
    for n, s in (("q_proj", (q, H)), ("k_proj", (kv, H)), ("v_proj", (kv, H)), ("o_proj", (H, q))):
        rules.append(W(A + n, A + n, s, layers=att))
    for n, s in (("in_qkv", (2 * kd + vd, H)), ("in_z", (vd, H)), ("in_b", (a.lin_v_heads, H)),
                 ("in_a", (a.lin_v_heads, H)), ("conv", (2 * kd + vd, a.conv_kernel)),
                 ("dt_bias", (a.lin_v_heads,)), ("A_log", (a.lin_v_heads,)),
                 ("norm", (a.lin_v_dim,)), ("out_proj", (H, vd))):
        rules.append(W(G + n, G + n, s, layers=lin))
    return WeightMap(rules=rules, n_layers=len(a.layer_kinds))


def _build_graph(a: HybridArgs, g):
    def mixer(g, i, x):
        kind = a.layer_kinds[i]
        if kind == "linear":
            return blocks.gated_delta(g, i, x, hidden=a.hidden_size, n_k_heads=a.lin_k_heads,
                                      k_head_dim=a.lin_k_dim, n_v_heads=a.lin_v_heads,
                                      v_head_dim=a.lin_v_dim, conv_kernel=a.conv_kernel,
                                      norm_eps=a.rms_norm_eps)
        return blocks.attention(g, i, x, hidden=a.hidden_size, n_heads=a.num_attention_heads,
                                n_kv_heads=a.num_key_value_heads, head_dim=a.head_dim,
                                rope_spec=a.rope, scale=a.head_dim ** -0.5,
                                window=a.sliding_window if kind == "window" else 0)

    def mlp(g, i, x):
        return blocks.glu_mlp(g, i, x, a.hidden_size, a.intermediate_size, act="silu")

    h = blocks.embed(g, a.hidden_size)
    for i in range(len(a.layer_kinds)):
        h = blocks.decoder_layer(g, i, h, mixer, mlp, a.rms_norm_eps)
    return g.build(blocks.lm_head(g, h, a.vocab_size, a.rms_norm_eps))


FAMILY = FamilySpec(name="test_hybrid", model_types=(MODEL_TYPE,), args_class=HybridArgs,
                    weight_map=_weight_map, build_graph=_build_graph,
                    description="test-only: full + sliding-window + gated delta layers")


class HybridPlugin:
    """A plugin object (as an entry point module would be) with one hookimpl."""

    __name__ = "cpullm_test_hybrid_plugin"

    @hookimpl
    def cpullm_families(self):
        return [attrs.evolve(FAMILY)]


PLUGIN = HybridPlugin()


def register():
    if PLUGIN not in plugins._extra_plugins:
        plugins.register_for_tests(PLUGIN)
    if not any(MODEL_TYPE in f.model_types for f in plugins.discover().families):
        plugins.discover(refresh=True)


@pytest.fixture(scope="session")
def hybrid_dir(tmp_path_factory):
    register()
    return make_random_checkpoint(HYBRID, tmp_path_factory.mktemp("hybrid"), seed=11, std=0.3)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    return make_random_checkpoint(LLAMA, tmp_path_factory.mktemp("llama"), seed=5, std=0.3)


def unregister():
    plugins.unregister_for_tests(PLUGIN)
    plugins.discover(refresh=True)


@pytest.fixture(autouse=True, scope="module")
def _hybrid_registered():
    """Registered for the modules that import this fixture, and only for them (other modules'
    tests may list the installed families)."""
    register()
    yield
    unregister()
