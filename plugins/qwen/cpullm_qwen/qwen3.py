"""Qwen3 dense: model_type ``qwen3``, ``Qwen3ForCausalLM``.

Qwen2's decoder with a per-head RMSNorm (w*n, over head_dim) on q and k before RoPE, an explicit
``head_dim`` that may differ from hidden/heads (default 128, as transformers), and q/k/v/o biases
only when ``attention_bias``.
"""
from __future__ import annotations

import attrs

from cpullm.plugin import Args, FamilySpec, blocks, require

from . import chat_formats, dense, tiny_configs


@attrs.define
class Qwen3Args(Args):
    hidden_size: int = 4096
    intermediate_size: int = 22016
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 32
    head_dim: int | None = 128              # never derived from hidden/heads (Qwen3-0.6B/4B differ)
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    vocab_size: int = 151936
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    max_window_layers: int = 28
    layer_types: list | None = None
    # derived in derive()
    qkv_bias: bool = attrs.field(init=False, default=False)
    o_bias: bool = attrs.field(init=False, default=False)
    qk_norm: bool = attrs.field(init=False, default=True)
    rope_spec: object = attrs.field(init=False, default=None)
    layer_windows: tuple = attrs.field(init=False, default=())

    def derive(self, config: dict) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if not self.head_dim:
            self.head_dim = 128
        require(self.hidden_act == "silu", "hidden_act", self.hidden_act, "silu")
        require(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
                self.num_key_value_heads, "a divisor of num_attention_heads")
        self.qkv_bias = self.o_bias = bool(self.attention_bias)
        self.rope_spec = blocks.make_rope(blocks.rope_parameters(config), self.head_dim)
        self.layer_windows = dense.layer_windows(self)


FAMILY = FamilySpec(
    name="qwen3",
    model_types=("qwen3",),
    architectures=("Qwen3ForCausalLM",),
    args_class=Qwen3Args,
    weight_map=dense.weight_map,
    build_graph=dense.build_graph,
    description="Qwen3 dense Qwen3ForCausalLM checkpoints (q/k norm, explicit head_dim)",
    tiny_config=tiny_configs.QWEN3,
    tool_formats=(chat_formats.HERMES,),
    reasoning_formats=(chat_formats.THINK,),
)
