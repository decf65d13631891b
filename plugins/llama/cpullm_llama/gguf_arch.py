"""How llama.cpp's ``llama`` GGUF architecture converts to a transformers Llama checkpoint."""
from __future__ import annotations

from cpullm.plugin import DENSE_LAYER_NAMES, GGUFArch

# Pre-tokenizer split regexes per ``tokenizer.ggml.pre`` of files in this architecture, as
# transformers' GGUF converter uses them.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                     "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe"), LLAMA3_SPLIT),
    "tekken": TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), GPT4O_SPLIT),
}


def config_extras(meta: dict, hp: dict, tensor_names: tuple) -> dict:
    return {"hidden_act": "silu", "mlp_bias": False, "pretraining_tp": 1,
            "attention_bias": any(n.endswith("attn_q.bias") for n in tensor_names)}


GGUF_ARCH = GGUFArch(
    name="llama",
    model_type="llama",
    architectures=("LlamaForCausalLM",),
    layer_names=DENSE_LAYER_NAMES,
    required_layer_leaves=("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
                           "ffn_gate", "ffn_up", "ffn_down"),
    permute_qk=True,
    # older llama files give head_dim only as the rotary dimension
    head_dim_keys=("attention.key_length", "rope.dimension_count"),
    config_extras=config_extras,
    pre_tokenizer_splits=PRE_TOKENIZER_SPLITS,
    # Llama 3's turn ends, plus ChatML's and Phi-3's (SmolLM2 and other llama-architecture files)
    end_of_turn_tokens=("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>"),
)
