"""How llama.cpp's ``qwen2``, ``qwen3`` and ``qwen3moe`` GGUF architectures convert to transformers
checkpoints."""
from __future__ import annotations

from cpullm.plugin import DENSE_LAYER_NAMES, QK_NORM_LAYER_NAMES, ConversionError, GGUFArch, meta_int

from .qwen3_moe import MAX_EXPERTS

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


# llama.cpp's qwen3moe: every layer's MLP is routed experts, stored as 3-D tensors (one matrix per
# expert stacked, "{e}" below) beside the router ffn_gate_inp (E, H).
MOE_LAYER_NAMES = {
    **{k: v for k, v in DENSE_LAYER_NAMES.items() if not k.startswith(("ffn_gate", "ffn_up", "ffn_down"))},
    **QK_NORM_LAYER_NAMES,
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
    "ffn_up_exps": "mlp.experts.{e}.up_proj",
    "ffn_down_exps": "mlp.experts.{e}.down_proj",
}
MOE_LEAVES = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
              "ffn_norm", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
SOFTMAX_GATING = 1          # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX (the one qwen3moe runs)


def moe_config_extras(meta: dict, hp: dict, tensor_names: tuple) -> dict:
    """Qwen3-MoE's config keys as llama.cpp runs the architecture: every layer sparse (no
    ``mlp_only_layers``), softmax over all experts then the top ``expert_used_count``,
    renormalized (llama.cpp's qwen3moe always renormalizes the chosen weights)."""
    arch = hp["arch"]
    n_experts = meta_int(meta, arch, "expert_count", 1, MAX_EXPERTS)
    gating = meta.get(f"{arch}.expert_gating_func", SOFTMAX_GATING)
    if gating != SOFTMAX_GATING:
        raise ConversionError(f"GGUF {arch}.expert_gating_func = {gating!r}: cpullm runs {arch} with llama.cpp's "
                              f"softmax gating ({SOFTMAX_GATING}) only; the file is not a Qwen3-MoE model")
    out = config_extras(meta, hp, tensor_names)
    out.update(attention_bias=any(n.endswith("attn_q.bias") for n in tensor_names),
               num_experts=n_experts,
               num_experts_per_tok=meta_int(meta, arch, "expert_used_count", 1, n_experts),
               moe_intermediate_size=meta_int(meta, arch, "expert_feed_forward_length", 1, 1 << 20),
               norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    return out


QWEN3_MOE = GGUFArch(
    name="qwen3moe",
    model_type="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    layer_names=MOE_LAYER_NAMES,
    required_layer_leaves=MOE_LEAVES,
    config_extras=moe_config_extras,
    pre_tokenizer_splits=PRE_TOKENIZER_SPLITS,
    end_of_turn_tokens=END_OF_TURN_TOKENS,
)
