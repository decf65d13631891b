"""tinyllama_variant: a Llama with GPT-style tensor names, zero-centred norms and optional
sliding-window layers. model_type ``tinyllama_variant``.

Reads top to bottom like every family: Args, weight map, graph, FamilySpec.
Checkpoint tensors (L layers, H hidden, V vocab, q = heads*head_dim, kv = kv_heads*head_dim)::

    transformer.wte.weight               (V, H)      token embedding
    transformer.h.{i}.ln_1.weight        (H,)        RMSNorm before attention, stored as w (applied as 1 + w)
    transformer.h.{i}.attn.wq.weight     (q, H)
    transformer.h.{i}.attn.wk.weight     (kv, H)
    transformer.h.{i}.attn.wv.weight     (kv, H)
    transformer.h.{i}.attn.wo.weight     (H, q)
    transformer.h.{i}.ln_2.weight        (H,)        RMSNorm before the MLP (1 + w)
    transformer.h.{i}.mlp.w1.weight      (I, H)      gate
    transformer.h.{i}.mlp.w3.weight      (I, H)      up
    transformer.h.{i}.mlp.w2.weight      (H, I)      down
    transformer.ln_f.weight              (H,)        final RMSNorm (1 + w)
    lm_head.weight                       (V, H)      absent when tie_word_embeddings
"""
from __future__ import annotations

import attrs

from cpullm.plugin import ADD_ONE, W, Args, ConfigError, FamilySpec, GraphBuilder, WeightMap, blocks, require

LAYER_TYPES = ("full_attention", "sliding_attention")


@attrs.define
class VariantArgs(Args):
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    vocab_size: int = 32000
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    sliding_window: int | None = None
    layer_types: list | None = None
    rope: object = None                 # derived: cpullm.loading.family.RopeSpec
    windows: tuple = ()                 # derived: attention window of each layer (0 = full)

    def derive(self, config: dict) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        require(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
                self.num_key_value_heads, "a divisor of num_attention_heads")
        types = self.layer_types or ["full_attention"] * self.num_hidden_layers
        if len(types) != self.num_hidden_layers:
            raise ConfigError(f"config key 'layer_types' lists {len(types)} layers but "
                              f"num_hidden_layers is {self.num_hidden_layers}")
        unknown = sorted({t for t in types if t not in LAYER_TYPES}, key=str)
        require(not unknown, "layer_types", unknown, ", ".join(LAYER_TYPES))
        if "sliding_attention" in types:
            require(bool(self.sliding_window) and self.sliding_window > 0, "sliding_window",
                    self.sliding_window, "a positive window when layer_types has sliding_attention")
        self.windows = tuple(self.sliding_window if t == "sliding_attention" else 0 for t in types)
        # An unknown rope_type raises UnsupportedConfigError here, at load, naming the key.
        self.rope = blocks.make_rope(blocks.rope_parameters(config), self.head_dim)


def weight_map(a: VariantArgs) -> WeightMap:
    H, V, I = a.hidden_size, a.vocab_size, a.intermediate_size
    q, kv = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
    L = "transformer.h.{i}."
    rules = [
        W("embed", "transformer.wte.weight", (V, H)),
        W("final_norm", "transformer.ln_f.weight", (H,), transform=ADD_ONE),
        W("lm_head", None if a.tie_word_embeddings else "lm_head.weight", (V, H),
          tied_to="embed" if a.tie_word_embeddings else None),
        W("layers.{i}.attn_norm", L + "ln_1.weight", (H,), transform=ADD_ONE),
        W("layers.{i}.mlp_norm", L + "ln_2.weight", (H,), transform=ADD_ONE),
        W("layers.{i}.attn.q_proj", L + "attn.wq.weight", (q, H)),
        W("layers.{i}.attn.k_proj", L + "attn.wk.weight", (kv, H)),
        W("layers.{i}.attn.v_proj", L + "attn.wv.weight", (kv, H)),
        W("layers.{i}.attn.o_proj", L + "attn.wo.weight", (H, q)),
        W("layers.{i}.mlp.gate_proj", L + "mlp.w1.weight", (I, H)),
        W("layers.{i}.mlp.up_proj", L + "mlp.w3.weight", (I, H)),
        W("layers.{i}.mlp.down_proj", L + "mlp.w2.weight", (H, I)),
    ]
    return WeightMap(rules=rules, n_layers=a.num_hidden_layers)


def build_graph(a: VariantArgs, g: GraphBuilder):
    def mixer(g, i, x):
        return blocks.attention(g, i, x, hidden=a.hidden_size, n_heads=a.num_attention_heads,
                                n_kv_heads=a.num_key_value_heads, head_dim=a.head_dim,
                                rope_spec=a.rope, scale=a.head_dim ** -0.5, window=a.windows[i])

    def mlp(g, i, x):
        return blocks.glu_mlp(g, i, x, a.hidden_size, a.intermediate_size, act="silu")

    h = blocks.embed(g, a.hidden_size)                     # (T, H)
    for i in range(a.num_hidden_layers):
        h = blocks.decoder_layer(g, i, h, mixer, mlp, a.rms_norm_eps)
    return g.build(blocks.lm_head(g, h, a.vocab_size, a.rms_norm_eps))   # (T, V)


FAMILY = FamilySpec(
    name="tinyvariant",
    model_types=("tinyllama_variant",),
    architectures=("TinyLlamaVariantForCausalLM",),
    args_class=VariantArgs,
    weight_map=weight_map,
    build_graph=build_graph,
    description="tinyllama_variant: Llama with GPT-style names, (1 + w) norms, sliding layers",
)
