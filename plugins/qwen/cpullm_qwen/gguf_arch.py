"""How llama.cpp's ``qwen2`` and ``qwen3`` GGUF architectures convert to transformers checkpoints."""
from __future__ import annotations

from cpullm.plugin import DENSE_LAYER_NAMES, QK_NORM_LAYER_NAMES, GGUFArch

# Pre-tokenizer split regexes per ``tokenizer.ggml.pre``, as transformers' GGUF converter uses them.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), QWEN2_SPLIT),
    "qwen35": QWEN35_SPLIT,
}
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>")
DENSE_LEAVES = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
                "ffn_gate", "ffn_up", "ffn_down")


def config_extras(meta: dict, hp: dict, tensor_names: tuple) -> dict:
    out = {"hidden_act": "silu", "use_sliding_window": False, "sliding_window": None,
           "max_window_layers": hp["num_hidden_layers"]}
    if hp["arch"] == "qwen3":
        out["attention_bias"] = any(n.endswith("attn_q.bias") for n in tensor_names)
    return out


QWEN2 = GGUFArch(
    name="qwen2",
    model_type="qwen2",
    architectures=("Qwen2ForCausalLM",),
    layer_names=DENSE_LAYER_NAMES,
    required_layer_leaves=DENSE_LEAVES,
    config_extras=config_extras,
    pre_tokenizer_splits=PRE_TOKENIZER_SPLITS,
    end_of_turn_tokens=END_OF_TURN_TOKENS,
)
QWEN3 = GGUFArch(
    name="qwen3",
    model_type="qwen3",
    architectures=("Qwen3ForCausalLM",),
    layer_names={**DENSE_LAYER_NAMES, **QK_NORM_LAYER_NAMES},
    required_layer_leaves=DENSE_LEAVES[:5] + ("attn_q_norm", "attn_k_norm") + DENSE_LEAVES[5:],
    config_extras=config_extras,
    pre_tokenizer_splits=PRE_TOKENIZER_SPLITS,
    end_of_turn_tokens=END_OF_TURN_TOKENS,
)
