"""Qwen3.5 text model: model_type ``qwen3_5_text`` (``Qwen3_5ForCausalLM``), and the text part of
the multimodal wrapper (see qwen3_5.py). Hybrid decoder, exactly as transformers 5 computes it:

    layer_types: "linear_attention" (Gated DeltaNet) | "full_attention" (gated attention);
                 absent: layer i is full iff (i + 1) % full_attention_interval == 0 (default 4)
    full layer:  q_proj rows interleave query and output gate per head (reordered at load to
                 [query | gate]); zero-centred q/k norm; partial RoPE (partial_rotary_factor,
                 default 0.25; text-only M-RoPE == 1-D RoPE); out = o_proj(attn * sigmoid(gate))
    linear layer: in_proj_qkv -> causal depthwise conv + SiLU -> Gated DeltaNet recurrence ->
                 gated RMSNorm (plain w) * silu(in_proj_z) -> out_proj  (cpullm.graph.blocks.gated_delta)
    norms:       input/post-attention/final/q/k norms are (1 + w): folded once by ADD_ONE;
                 linear_attn.norm is plain w
"""
from __future__ import annotations

import attrs

from cpullm.plugin import (ADD_ONE, W, Args, FamilySpec, GraphBuilder, WeightMap, blocks, decoder_stack,
                           lm_head_rule, require)

from . import chat_formats, tiny_configs
from .common import (BUFFER_IGNORES, MULTIMODAL_IGNORES, TEXT_PREFIX_ALIASES, check_layer_types,
                     per_head_halves)

LAYER_TYPES = ("linear_attention", "full_attention")


@attrs.define
class Qwen35TextArgs(Args):
    vocab_size: int = 248320
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 256
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    layer_types: list | None = None
    full_attention_interval: int = 4
    # derived in derive()
    rope_spec: object = attrs.field(init=False, default=None)
    full_layers: tuple = attrs.field(init=False, default=())
    linear_layers: tuple = attrs.field(init=False, default=())

    def derive(self, config: dict) -> None:
        require(self.hidden_act == "silu", "hidden_act", self.hidden_act, "silu")
        require(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
                self.num_key_value_heads, "a divisor of num_attention_heads")
        require(self.linear_num_value_heads % self.linear_num_key_heads == 0, "linear_num_value_heads",
                self.linear_num_value_heads, "a multiple of linear_num_key_heads")
        require(int(self.full_attention_interval) > 0, "full_attention_interval",
                self.full_attention_interval, "a positive integer")
        if self.layer_types is None:
            n = int(self.full_attention_interval)
            types = ["full_attention" if (i + 1) % n == 0 else "linear_attention"
                     for i in range(self.num_hidden_layers)]
        else:
            types = check_layer_types(self.layer_types, self.num_hidden_layers, LAYER_TYPES)
        self.layer_types = types
        self.full_layers = tuple(i for i, t in enumerate(types) if t == "full_attention")
        self.linear_layers = tuple(i for i, t in enumerate(types) if t == "linear_attention")
        params = blocks.rope_parameters(config)
        # M-RoPE (mrope_section / mrope_interleaved) reduces to 1-D RoPE for text: all rows equal.
        self.rope_spec = blocks.make_rope(params, self.head_dim,
                                          float(config.get("partial_rotary_factor", 0.25)))


def weight_map(a: Qwen35TextArgs) -> WeightMap:
    H, V, I = a.hidden_size, a.vocab_size, a.intermediate_size
    nh, nkv, hd = a.num_attention_heads, a.num_key_value_heads, a.head_dim
    nk, dk, nv, dv = (a.linear_num_key_heads, a.linear_key_head_dim, a.linear_num_value_heads,
                      a.linear_value_head_dim)
    conv_dim, K = 2 * nk * dk + nv * dv, a.linear_conv_kernel_dim
    full, lin = a.full_layers, a.linear_layers
    q_gate = per_head_halves(nh, hd)
    L = "model.layers.{i}."
    A = L + "self_attn."
    G = L + "linear_attn."
    rules = [
        W("embed", "model.embed_tokens.weight", (V, H)),
        W("final_norm", "model.norm.weight", (H,), transform=ADD_ONE),
        lm_head_rule(a.tie_word_embeddings, V, H),
        W("layers.{i}.attn_norm", L + "input_layernorm.weight", (H,), transform=ADD_ONE),
        W("layers.{i}.mlp_norm", L + "post_attention_layernorm.weight", (H,), transform=ADD_ONE),
        W("layers.{i}.mlp.gate_proj", L + "mlp.gate_proj.weight", (I, H)),
        W("layers.{i}.mlp.up_proj", L + "mlp.up_proj.weight", (I, H)),
        W("layers.{i}.mlp.down_proj", L + "mlp.down_proj.weight", (H, I)),
        # full (gated) attention layers
        W("layers.{i}.attn.q_proj", A + "q_proj.weight", (2 * nh * hd, H), transform=q_gate, layers=full),
        W("layers.{i}.attn.k_proj", A + "k_proj.weight", (nkv * hd, H), layers=full),
        W("layers.{i}.attn.v_proj", A + "v_proj.weight", (nkv * hd, H), layers=full),
        W("layers.{i}.attn.o_proj", A + "o_proj.weight", (H, nh * hd), layers=full),
        W("layers.{i}.attn.q_norm", A + "q_norm.weight", (hd,), transform=ADD_ONE, layers=full),
        W("layers.{i}.attn.k_norm", A + "k_norm.weight", (hd,), transform=ADD_ONE, layers=full),
        # Gated DeltaNet layers
        W("layers.{i}.linear_attn.in_qkv", G + "in_proj_qkv.weight", (conv_dim, H), layers=lin),
        W("layers.{i}.linear_attn.in_z", G + "in_proj_z.weight", (nv * dv, H), layers=lin),
        W("layers.{i}.linear_attn.in_b", G + "in_proj_b.weight", (nv, H), layers=lin),
        W("layers.{i}.linear_attn.in_a", G + "in_proj_a.weight", (nv, H), layers=lin),
        W("layers.{i}.linear_attn.conv", G + "conv1d.weight", (conv_dim, 1, K), layers=lin),
        W("layers.{i}.linear_attn.dt_bias", G + "dt_bias", (nv,), layers=lin),
        W("layers.{i}.linear_attn.A_log", G + "A_log", (nv,), layers=lin),
        W("layers.{i}.linear_attn.norm", G + "norm.weight", (dv,), layers=lin),    # plain w
        W("layers.{i}.linear_attn.out_proj", G + "out_proj.weight", (H, nv * dv), layers=lin),
    ]
    if a.attention_bias:
        rules += [
            W("layers.{i}.attn.q_bias", A + "q_proj.bias", (2 * nh * hd,), transform=q_gate, layers=full),
            W("layers.{i}.attn.k_bias", A + "k_proj.bias", (nkv * hd,), layers=full),
            W("layers.{i}.attn.v_bias", A + "v_proj.bias", (nkv * hd,), layers=full),
            W("layers.{i}.attn.o_bias", A + "o_proj.bias", (H,), layers=full),
        ]
    return WeightMap(rules=rules, n_layers=a.num_hidden_layers, aliases=list(TEXT_PREFIX_ALIASES),
                     ignore=MULTIMODAL_IGNORES + BUFFER_IGNORES)


def mixer(a: Qwen35TextArgs, g: GraphBuilder, i: int, x: str, full: set) -> str:
    """Layer i's token mixer: gated attention if i is in ``full``, else Gated DeltaNet."""
    if i in full:
        return blocks.attention(g, i, x, hidden=a.hidden_size, n_heads=a.num_attention_heads,
                                n_kv_heads=a.num_key_value_heads, head_dim=a.head_dim,
                                rope_spec=a.rope_spec, scale=a.head_dim ** -0.5,
                                qkv_bias=a.attention_bias, o_bias=a.attention_bias,
                                qk_norm_eps=a.rms_norm_eps, output_gate=True)
    return blocks.gated_delta(g, i, x, hidden=a.hidden_size, n_k_heads=a.linear_num_key_heads,
                              k_head_dim=a.linear_key_head_dim, n_v_heads=a.linear_num_value_heads,
                              v_head_dim=a.linear_value_head_dim,
                              conv_kernel=a.linear_conv_kernel_dim, norm_eps=a.rms_norm_eps)


def build_graph(a: Qwen35TextArgs, g: GraphBuilder):
    full = set(a.full_layers)
    return decoder_stack(g, a, lambda g, i, x: mixer(a, g, i, x, full))


FAMILY = FamilySpec(
    name="qwen3_5_text",
    model_types=("qwen3_5_text",),
    architectures=("Qwen3_5ForCausalLM",),
    args_class=Qwen35TextArgs,
    weight_map=weight_map,
    build_graph=build_graph,
    description="Qwen3.5 text-only checkpoints (hybrid Gated DeltaNet + gated attention)",
    tiny_config=tiny_configs.QWEN3_5_TEXT,
    tool_formats=(chat_formats.XML, chat_formats.HERMES),
    reasoning_formats=(chat_formats.THINK,),
)
