"""Gemma 3 text model (model_type ``gemma3_text``, Gemma3ForCausalLM): google/gemma-3-270m,
gemma-3-1b-it.

Gemma 2's layer (sandwich norms, ``query_pre_attn_scalar``) plus:
* q_norm / k_norm: zero-centred RMSNorm over each head, before RoPE;
* 5 local : 1 global layers: ``layer_types`` when given, else layer i slides iff
  ``(i + 1) % sliding_window_pattern != 0`` (pattern 6). transformers reads only
  ``sliding_window_pattern`` for that, never ``_sliding_window_pattern`` (which real configs
  carry beside an explicit ``layer_types``), and so does this module;
* two RoPEs: sliding layers use the local base (``rope_local_base_freq``, 1e4) unscaled, global
  layers the global base (``rope_theta``, 1e6) with ``rope_scaling`` (linear, factor 8 in 4B).
  transformers 5 writes both as ``rope_parameters = {"full_attention": {...},
  "sliding_attention": {...}}``; both layouts are read;
* no attention soft-capping: Gemma3Attention ignores ``attn_logit_softcapping``;
* Gemma3ForCausalLM applies ``final_logit_softcapping`` when it is set (null in the
  real configs). The multimodal wrapper never does (:mod:`.gemma3`).
"""
from __future__ import annotations

import attrs

from cpullm.plugin import Args, FamilySpec, GraphBuilder

from . import chat_formats, common, tiny_configs

DEFAULT_THETA = {common.FULL: 1_000_000.0, common.SLIDING: 10_000.0}
DEFAULT_PATTERN = 6


def rope_parameters(config: dict) -> dict:
    """{layer type: rope parameters} from either config layout, as Gemma3TextConfig resolves it:
    nested ``rope_parameters``; or legacy ``rope_theta`` (+ ``rope_scaling``, global layers only)
    and ``rope_local_base_freq``; defaults 1e6 (global) and 1e4 (local)."""
    rp = config.get("rope_parameters")
    if rp is not None and not isinstance(rp, dict):
        raise common.unsupported_rope("rope_parameters", rp)
    if rp and not any(k in rp for k in common.LAYER_TYPES):
        raise common.unsupported_rope("rope_parameters", rp)
    rp = rp or {}
    out = {t: dict(rp.get(t) or {"rope_type": "default"}) for t in common.LAYER_TYPES}
    scaling = config.get("rope_scaling")
    if scaling is not None:
        if not isinstance(scaling, dict):
            raise common.unsupported_rope("rope_scaling", scaling)
        out[common.FULL].update(scaling)
    legacy_theta = {common.FULL: config.get("rope_theta"), common.SLIDING: config.get("rope_local_base_freq")}
    for t in common.LAYER_TYPES:
        if out[t].get("rope_theta") is None:
            out[t]["rope_theta"] = legacy_theta[t] if legacy_theta[t] is not None else DEFAULT_THETA[t]
    return out


@attrs.define
class Gemma3TextArgs(Args):
    # config.json keys, defaulting to Gemma3TextConfig's defaults (transformers 5.24). The
    # multimodal checkpoint lists only non-default text keys, so these defaults matter.
    vocab_size: int = 262_208
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 26
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 131_072
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    query_pre_attn_scalar: float = 256
    sliding_window: int | None = 4096
    sliding_window_pattern: int = DEFAULT_PATTERN
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None   # ignored by transformers 5.24's Gemma3Attention
    use_bidirectional_attention: bool | None = False
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
        types = common.layer_types(config, self.num_hidden_layers, pattern=self.sliding_window_pattern)
        window = common.sliding_window(self.sliding_window, types)
        ropes = {t: common.rope_spec(p, self.head_dim, f"rope_parameters.{t}")
                 for t, p in rope_parameters(config).items()}
        self.layer_specs = common.layer_specs(types, window, ropes, attn_softcap=0.0, qk_norm=True)


def weight_map(a: Gemma3TextArgs, aliases=(), ignore=()):
    return common.weight_map(a, common.SANDWICH_NORM_NAMES, qk_norm=True, aliases=aliases, ignore=ignore)


def build_graph(a: Gemma3TextArgs, g: GraphBuilder):
    return common.build_graph(a, g, sandwich=True, final_softcap=a.final_softcap)


FAMILY = FamilySpec(
    name="gemma3_text",
    model_types=("gemma3_text",),
    architectures=("Gemma3ForCausalLM",),
    args_class=Gemma3TextArgs,
    weight_map=weight_map,
    build_graph=build_graph,
    description="Gemma 3 270M/1B text models (Gemma3ForCausalLM): 5 local : 1 global, q/k norms",
    tiny_config=tiny_configs.GEMMA3_TEXT,
    tool_formats=(chat_formats.TOOL_CALL_JSON,),
)
