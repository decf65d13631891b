"""Qwen2 and Qwen2.5 (incl. Coder / Math): model_type ``qwen2``, ``Qwen2ForCausalLM``.

Llama-like pre-norm decoder (w*n RMSNorm, SiLU MLP, RoPE theta typically 1e6, GQA) whose q/k/v
projections always carry a bias (hard-coded in transformers, no config key) and o_proj none.
``sliding_window`` is ignored unless ``use_sliding_window`` (transformers quirk). Reads both config
layouts (legacy ``rope_theta``/``rope_scaling``, transformers 5 ``rope_parameters``).
"""
from __future__ import annotations

import attrs

from cpullm.plugin import Args, FamilySpec, blocks, require

from . import chat_formats, dense, tiny_configs


@attrs.define
class Qwen2Args(Args):
    hidden_size: int = 4096
    intermediate_size: int = 22016
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 32
    head_dim: int | None = None             # absent in real configs: hidden / heads
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    vocab_size: int = 151936
    tie_word_embeddings: bool = False
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    max_window_layers: int = 28
    layer_types: list | None = None
    # derived in derive()
    qkv_bias: bool = attrs.field(init=False, default=True)
    o_bias: bool = attrs.field(init=False, default=False)
    qk_norm: bool = attrs.field(init=False, default=False)
    rope_spec: object = attrs.field(init=False, default=None)
    layer_windows: tuple = attrs.field(init=False, default=())

    def derive(self, config: dict) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_attention_heads
        require(self.hidden_act == "silu", "hidden_act", self.hidden_act, "silu")
        require(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
                self.num_key_value_heads, "a divisor of num_attention_heads")
        self.rope_spec = blocks.make_rope(blocks.rope_parameters(config), self.head_dim)
        self.layer_windows = dense.layer_windows(self)


FAMILY = FamilySpec(
    name="qwen2",
    model_types=("qwen2",),
    architectures=("Qwen2ForCausalLM",),
    args_class=Qwen2Args,
    weight_map=dense.weight_map,
    build_graph=dense.build_graph,
    description="Qwen2 / Qwen2.5 (incl. Coder, Math) Qwen2ForCausalLM checkpoints",
    tiny_config=tiny_configs.QWEN2,
    tool_formats=(chat_formats.HERMES,),
)
