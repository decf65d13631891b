"""Gemma (model_type ``gemma``, GemmaForCausalLM): google/gemma-2b, gemma-2b-it, gemma-7b.

Pre-norm decoder with zero-centred RMSNorms (``1 + w``, folded at load), embeddings scaled by
sqrt(hidden_size), RoPE over the whole head, full causal attention scaled by head_dim**-0.5
(multi-query in gemma-2b: one KV head), GeGLU MLP with tanh-GELU, tied lm_head.

A transformers quirk: the real configs say ``hidden_act: "gelu"``, which GemmaConfig
rewrites to ``gelu_pytorch_tanh``; ``hidden_activation`` is ignored by Gemma 1 in transformers 5.
"""
from __future__ import annotations

import attrs

from cpullm.plugin import Args, FamilySpec, GraphBuilder, blocks

from . import chat_formats, common, tiny_configs


@attrs.define
class GemmaArgs(Args):
    # config.json keys, defaulting to GemmaConfig's defaults (transformers 5.24)
    vocab_size: int = 256000
    hidden_size: int = 3072
    intermediate_size: int = 24576
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 256
    hidden_act: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    use_bidirectional_attention: bool | None = None
    # derived in derive()
    glu_act: str = ""
    attn_scale: float = 0.0
    embed_scale: float = 0.0
    layer_specs: tuple = ()

    def derive(self, config: dict) -> None:
        common.check_heads(self)
        self.glu_act = common.glu_act(self.hidden_act, "hidden_act", gelu_means_tanh=True)
        self.attn_scale = self.head_dim ** -0.5
        common.number(self.rms_norm_eps, "rms_norm_eps")
        self.embed_scale = common.embed_scale(self.hidden_size)
        rope = common.rope_spec(blocks.rope_parameters(config), self.head_dim)
        types = (common.FULL,) * self.num_hidden_layers
        self.layer_specs = common.layer_specs(types, 0, {common.FULL: rope}, 0.0, qk_norm=False)


def weight_map(a: GemmaArgs):
    return common.weight_map(a, common.PRE_NORM_NAMES)


def build_graph(a: GemmaArgs, g: GraphBuilder):
    return common.build_graph(a, g, sandwich=False, final_softcap=0.0)


FAMILY = FamilySpec(
    name="gemma",
    model_types=("gemma",),
    architectures=("GemmaForCausalLM",),
    args_class=GemmaArgs,
    weight_map=weight_map,
    build_graph=build_graph,
    description="Gemma 2B/7B (GemmaForCausalLM)",
    tiny_config=tiny_configs.GEMMA,
    tool_formats=(chat_formats.TOOL_CALL_JSON,),
)
