"""Llama (Llama 2, Llama 3.x, SmolLM2, ...): model_type ``llama``.

Pre-norm decoder, RMSNorm (w * n), RoPE (default / linear / llama3 scaling), GQA, SiLU-gated MLP,
optional attention biases, tied or untied lm_head. Reads both config layouts: the Hub's legacy
``rope_theta`` / ``rope_scaling`` and transformers 5's ``rope_parameters``.
"""
from __future__ import annotations

import attrs

from cpullm.plugin import (Args, ConfigError, FamilySpec, GraphBuilder, WeightMap, blocks, decoder_stack,
                           require, standard_rules)

from . import chat_formats, tiny_configs


@attrs.define
class LlamaArgs(Args):
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    vocab_size: int = 32000
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    rope: object = None                 # derived: cpullm.loading.family.RopeSpec

    def derive(self, config: dict) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        require(self.hidden_act == "silu", "hidden_act", self.hidden_act, "silu")
        require(not self.mlp_bias, "mlp_bias", self.mlp_bias, "false")
        require(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
                self.num_key_value_heads, "a divisor of num_attention_heads")
        # transformers' Llama ignores layer_types; a checkpoint that lists sliding-window (or any
        # other) layers was meant for another model, so refuse it rather than run full attention.
        layer_types = config.get("layer_types")
        if layer_types is not None:
            if not isinstance(layer_types, list) or len(layer_types) != self.num_hidden_layers:
                raise ConfigError(f"config key 'layer_types' must list one type per layer "
                                  f"({self.num_hidden_layers}), got {layer_types!r}")
            other = sorted({t for t in layer_types if t != "full_attention"}, key=str)
            require(not other, "layer_types", other, "'full_attention' only: the llama family runs "
                    "full causal attention; a checkpoint with other layer types needs a family "
                    "that declares them")
        self.rope = blocks.make_rope(blocks.rope_parameters(config), self.head_dim)


def weight_map(a: LlamaArgs) -> WeightMap:
    """The standard decoder tensors; with ``attention_bias`` all four projections carry a bias."""
    rules = standard_rules(a, qkv_bias=a.attention_bias, o_bias=a.attention_bias)
    ignore = [r"rotary_emb\.inv_freq$"]        # buffers some old checkpoints saved
    return WeightMap(rules=rules, n_layers=a.num_hidden_layers, ignore=ignore)


def build_graph(a: LlamaArgs, g: GraphBuilder):
    def mixer(g, i, x):
        return blocks.attention(g, i, x, hidden=a.hidden_size, n_heads=a.num_attention_heads,
                                n_kv_heads=a.num_key_value_heads, head_dim=a.head_dim,
                                rope_spec=a.rope, scale=a.head_dim ** -0.5, qkv_bias=a.attention_bias,
                                o_bias=a.attention_bias)

    return decoder_stack(g, a, mixer)


FAMILY = FamilySpec(
    name="llama",
    model_types=("llama",),
    architectures=("LlamaForCausalLM",),
    args_class=LlamaArgs,
    weight_map=weight_map,
    build_graph=build_graph,
    description="Llama 2/3.x, SmolLM2 and other LlamaForCausalLM checkpoints",
    tiny_config=tiny_configs.LLAMA,
    tool_formats=(chat_formats.LLAMA3_JSON,),
)
