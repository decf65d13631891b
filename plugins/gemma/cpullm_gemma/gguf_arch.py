"""How llama.cpp's ``gemma3`` GGUF architecture converts to a transformers Gemma 3 text checkpoint."""
from __future__ import annotations

from cpullm.plugin import (DENSE_LAYER_NAMES, QK_NORM_LAYER_NAMES, ConversionError, GGUFArch, limits,
                           meta_int)

# "Sandwich" norms: llama.cpp's ffn_norm is the *pre*-feedforward norm here.
LAYER_NAMES = {
    **DENSE_LAYER_NAMES,
    **QK_NORM_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def gemma3_config_extras(meta: dict, hp: dict, tensor_names: tuple) -> dict:
    arch = hp["arch"]
    n = hp["num_hidden_layers"]
    # llama.cpp hard-codes Gemma 3's pattern 6 (5 sliding layers, then 1 global); newer files
    # may state it as a number or as one bool per layer (true = sliding window).
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        if len(pattern) != n or not all(isinstance(s, (bool, int)) for s in pattern):
            raise ConversionError(f"GGUF sliding_window_pattern has {len(pattern)} entries for {n} layers; "
                                  "the file is damaged")
        layer_types = ["sliding_attention" if s else "full_attention" for s in pattern]
        pattern = next((i + 1 for i, s in enumerate(pattern) if not s), n)
    else:
        pattern = meta_int(meta, arch, "attention.sliding_window_pattern", 0, limits.MAX_LAYERS, default=6) or 6
        layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
    # llama.cpp: Gemma 3 27B (62 layers) scales queries by hidden/heads, the others by head_dim.
    qpas = hp["hidden_size"] // hp["num_attention_heads"] if n == 62 else hp["head_dim"]
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": qpas,
        "sliding_window": meta_int(meta, arch, "attention.sliding_window", 1, limits.MAX_CONTEXT, default=4096),
        "sliding_window_pattern": pattern,
        "layer_types": layer_types,
        "rope_local_base_freq": 10000.0,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "attention_bias": False,
    }


GEMMA3 = GGUFArch(
    name="gemma3",
    model_type="gemma3_text",
    architectures=("Gemma3ForCausalLM",),
    layer_names=LAYER_NAMES,
    required_layer_leaves=("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm",
                           "attn_k_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm",
                           "ffn_gate", "ffn_up", "ffn_down"),
    norm_offset=True,
    config_extras=gemma3_config_extras,
    sentencepiece="replace_spaces",
    # Gemma 3's turn end, and Gemma 4's
    end_of_turn_tokens=("<end_of_turn>", "<turn|>"),
)
