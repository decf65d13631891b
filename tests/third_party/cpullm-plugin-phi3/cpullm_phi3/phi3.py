"""phi3 (Phi-3, Phi-3.5, Phi-4-mini): model_type ``phi3``, as transformers computes it.

A Llama-like pre-norm decoder with RMSNorm and a SiLU-gated MLP, whose checkpoints fuse the
projections: ``qkv_proj`` rows are [q | k | v] and ``gate_up_proj`` rows [gate | up]. The weight
map takes each as a row range (``W(rows=...)``); the compiler fuses them back into one matrix.
Partial rotary (``partial_rotary_factor``), optional sliding window, and RoPE ``default`` or
``longrope`` (this plugin's RoPE scaling, longrope.py).

Checkpoint tensors (q = heads * head_dim, kv = kv_heads * head_dim)::

    model.embed_tokens.weight                        (V, H)
    model.layers.{i}.input_layernorm.weight          (H,)
    model.layers.{i}.self_attn.qkv_proj.weight       (q + 2 kv, H)
    model.layers.{i}.self_attn.o_proj.weight         (H, q)
    model.layers.{i}.post_attention_layernorm.weight (H,)
    model.layers.{i}.mlp.gate_up_proj.weight         (2 I, H)
    model.layers.{i}.mlp.down_proj.weight            (H, I)
    model.norm.weight                                (H,)
    lm_head.weight                                   (V, H)     absent when tied
"""
from __future__ import annotations

import attrs

from cpullm.plugin import W, Args, FamilySpec, GraphBuilder, WeightMap, blocks, require


@attrs.define
class Phi3Args(Args):
    vocab_size: int = 32064
    hidden_size: int = 3072
    intermediate_size: int = 8192
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    original_max_position_embeddings: int | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    partial_rotary_factor: float = 1.0
    head_dim: int = attrs.field(init=False, default=0)            # derived
    rope: object = attrs.field(init=False, default=None)          # derived: RopeSpec

    def derive(self, config: dict) -> None:
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        require(self.hidden_act == "silu", "hidden_act", self.hidden_act, "silu")
        require(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
                self.num_key_value_heads, "a divisor of num_attention_heads")
        self.head_dim = self.hidden_size // self.num_attention_heads
        params = blocks.rope_parameters(config)
        params.setdefault("original_max_position_embeddings",
                          self.original_max_position_embeddings or self.max_position_embeddings)
        params["max_position_embeddings"] = self.max_position_embeddings
        self.rope = blocks.make_rope(params, self.head_dim, self.partial_rotary_factor)


def weight_map(a: Phi3Args) -> WeightMap:
    H, V, I = a.hidden_size, a.vocab_size, a.intermediate_size
    q, kv = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
    L = "model.layers.{i}."
    qkv, gate_up = L + "self_attn.qkv_proj.weight", L + "mlp.gate_up_proj.weight"
    tied = a.tie_word_embeddings
    rules = [
        W("embed", "model.embed_tokens.weight", (V, H)),
        W("final_norm", "model.norm.weight", (H,)),
        W("lm_head", None if tied else "lm_head.weight", (V, H), tied_to="embed" if tied else None),
        W("layers.{i}.attn_norm", L + "input_layernorm.weight", (H,)),
        W("layers.{i}.mlp_norm", L + "post_attention_layernorm.weight", (H,)),
        W("layers.{i}.attn.q_proj", qkv, (q + 2 * kv, H), rows=(0, q)),
        W("layers.{i}.attn.k_proj", qkv, (q + 2 * kv, H), rows=(q, q + kv)),
        W("layers.{i}.attn.v_proj", qkv, (q + 2 * kv, H), rows=(q + kv, q + 2 * kv)),
        W("layers.{i}.attn.o_proj", L + "self_attn.o_proj.weight", (H, q)),
        W("layers.{i}.mlp.gate_proj", gate_up, (2 * I, H), rows=(0, I)),
        W("layers.{i}.mlp.up_proj", gate_up, (2 * I, H), rows=(I, 2 * I)),
        W("layers.{i}.mlp.down_proj", L + "mlp.down_proj.weight", (H, I)),
    ]
    ignore = [r"rotary_emb\.inv_freq$"] + ([r"^lm_head\.weight$"] if tied else [])
    return WeightMap(rules=rules, n_layers=a.num_hidden_layers, ignore=ignore)


def build_graph(a: Phi3Args, g: GraphBuilder):
    def mixer(g, i, x):                                                   # (T, H) -> (T, H)
        return blocks.attention(g, i, x, hidden=a.hidden_size, n_heads=a.num_attention_heads,
                                n_kv_heads=a.num_key_value_heads, head_dim=a.head_dim, rope_spec=a.rope,
                                scale=a.head_dim ** -0.5, window=a.sliding_window or 0)

    def mlp(g, i, x):                                                     # (T, H) -> (T, H)
        return blocks.glu_mlp(g, i, x, a.hidden_size, a.intermediate_size, act="silu")

    h = blocks.embed(g, a.hidden_size)                                    # (T, H)
    for i in range(a.num_hidden_layers):
        h = blocks.decoder_layer(g, i, h, mixer, mlp, a.rms_norm_eps)
    return g.build(blocks.lm_head(g, h, a.vocab_size, a.rms_norm_eps))   # (T, V)


FAMILY = FamilySpec(
    name="phi3",
    model_types=("phi3",),
    architectures=("Phi3ForCausalLM",),
    args_class=Phi3Args,
    weight_map=weight_map,
    build_graph=build_graph,
    description="Phi-3 / Phi-3.5 / Phi-4-mini: fused qkv and gate_up, partial rotary, longrope",
)
