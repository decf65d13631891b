"""Gemma 2 (model_type ``gemma2``, Gemma2ForCausalLM): google/gemma-2-2b, gemma-2-9b.

Gemma 1 plus:
* sandwich norms: input / post_attention / pre_feedforward / post_feedforward, all ``1 + w``;
* attention scaled by ``query_pre_attn_scalar**-0.5`` and soft-capped
  (``cap * tanh(scores / cap)``, ``attn_logit_softcapping``) before the mask;
* sliding-window attention on alternating layers: ``layer_types`` when given, else layer i slides
  iff ``(i + 1) % 2 != 0`` (0, 2, 4, ... slide; 1, 3, 5, ... are global). A sliding layer's KV
  cache is a ring of ``sliding_window + max_chunk`` slots (the compiler sizes it);
* final logit soft-capping (``final_logit_softcapping``);
* the activation is read from ``hidden_activation``; one RoPE for every layer.
"""
from __future__ import annotations

import attrs

from cpullm.plugin import Args, FamilySpec, GraphBuilder, blocks

from . import chat_formats, common, tiny_configs


@attrs.define
class Gemma2Args(Args):
    # config.json keys, defaulting to Gemma2Config's defaults (transformers 5.24)
    vocab_size: int = 256000
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 26
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    query_pre_attn_scalar: float = 256
    sliding_window: int | None = 4096
    final_logit_softcapping: float | None = 30.0
    attn_logit_softcapping: float | None = 50.0
    use_bidirectional_attention: bool | None = None
    # derived in derive()
    glu_act: str = ""
    attn_scale: float = 0.0
    embed_scale: float = 0.0
    final_softcap: float = 0.0
    layer_specs: tuple = ()

    def derive(self, config: dict) -> None:
        common.check_heads(self)
        self.glu_act = common.glu_act(self.hidden_activation, "hidden_activation")
        self.attn_scale = common.number(self.query_pre_attn_scalar, "query_pre_attn_scalar") ** -0.5
        common.number(self.rms_norm_eps, "rms_norm_eps")
        self.embed_scale = common.embed_scale(self.hidden_size)
        self.final_softcap = common.number(self.final_logit_softcapping, "final_logit_softcapping", optional=True)
        attn_softcap = common.number(self.attn_logit_softcapping, "attn_logit_softcapping", optional=True)
        types = common.layer_types(config, self.num_hidden_layers, pattern=2)
        window = common.sliding_window(self.sliding_window, types)
        rope = common.rope_spec(blocks.rope_parameters(config), self.head_dim)
        self.layer_specs = common.layer_specs(types, window, {common.SLIDING: rope, common.FULL: rope},
                                              attn_softcap, qk_norm=False)


def weight_map(a: Gemma2Args):
    return common.weight_map(a, common.SANDWICH_NORM_NAMES)


def build_graph(a: Gemma2Args, g: GraphBuilder):
    return common.build_graph(a, g, sandwich=True, final_softcap=a.final_softcap)


FAMILY = FamilySpec(
    name="gemma2",
    model_types=("gemma2",),
    architectures=("Gemma2ForCausalLM",),
    args_class=Gemma2Args,
    weight_map=weight_map,
    build_graph=build_graph,
    description="Gemma 2 2B/9B (Gemma2ForCausalLM): soft-capping, alternating sliding windows",
    tiny_config=tiny_configs.GEMMA2,
    tool_formats=(chat_formats.TOOL_CALL_JSON,),
)
