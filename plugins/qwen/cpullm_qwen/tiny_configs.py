"""Tiny config.json per family (FamilySpec.tiny_config): cpullm's registry-coverage test runs the
conformance kit on a random checkpoint of each. Built like the real checkpoints named beside
them, 3-4 layers, the byte-level test tokenizer's 384-token vocabulary."""

_TOKENS = dict(vocab_size=384, bos_token_id=256, eos_token_id=257)

QWEN2 = dict(  # Qwen2.5: GQA, head_dim from hidden/heads, tied, attention biases
    model_type="qwen2", architectures=["Qwen2ForCausalLM"],
    hidden_size=96, intermediate_size=192, num_hidden_layers=3, num_attention_heads=6,
    num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=32768,
    tie_word_embeddings=True, use_sliding_window=False, sliding_window=8, max_window_layers=1,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **_TOKENS,
)
QWEN3 = dict(  # Qwen3-0.6B: heads x head_dim != hidden, GQA, q/k norm, tied
    model_type="qwen3", architectures=["Qwen3ForCausalLM"],
    hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, max_position_embeddings=40960,
    tie_word_embeddings=True, attention_bias=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **_TOKENS,
)
QWEN3_MOE = dict(  # Qwen3-30B-A3B shrunk: 8 experts, top 2, renormalized; layer 1 dense (mlp_only_layers)
    model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
    hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
    max_position_embeddings=40960, tie_word_embeddings=False, attention_bias=False,
    num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
    rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **_TOKENS,
)
# Qwen3.5 text model: hybrid layers (3 Gated DeltaNet, 1 gated attention), partial rotary.
_QWEN35_TEXT = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, max_position_embeddings=262144,
    linear_num_key_heads=2, linear_key_head_dim=16, linear_num_value_heads=4,
    linear_value_head_dim=16, linear_conv_kernel_dim=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True}, **_TOKENS,
)
QWEN3_5_TEXT = dict(_QWEN35_TEXT, model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"],
                    tie_word_embeddings=False)
QWEN3_5 = dict(  # the multimodal wrapper: the text model in text_config (no vision tensors here)
    model_type="qwen3_5", architectures=["Qwen3_5ForConditionalGeneration"], tie_word_embeddings=True,
    text_config=dict(_QWEN35_TEXT, model_type="qwen3_5_text"),
)
_QWEN35_MOE_TEXT = dict(  # Qwen3.5-35B-A3B shrunk: hybrid layers, 8 experts top 4, gated shared expert
    {k: v for k, v in _QWEN35_TEXT.items() if k != "intermediate_size"},
    moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=4,
)
QWEN3_5_MOE_TEXT = dict(_QWEN35_MOE_TEXT, model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"],
                        tie_word_embeddings=False)
QWEN3_5_MOE = dict(
    model_type="qwen3_5_moe", architectures=["Qwen3_5MoeForConditionalGeneration"], tie_word_embeddings=False,
    text_config=dict(_QWEN35_MOE_TEXT, model_type="qwen3_5_moe_text"),
)

# Parity configs of the family's tests (plugins/qwen/tests), also run by the core's scheduler tests.
QWEN2_SLIDING_UNTIED = dict(  # untied lm_head; use_sliding_window on: layers >= 1 see 8 keys
    hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=4096,
    tie_word_embeddings=False, use_sliding_window=True, sliding_window=8, max_window_layers=1,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **_TOKENS,
)

# Qwen3.5-4B text_config, shrunk: hybrid layers, GQA 4/2 with head_dim 32 (heads*hd != hidden),
# output gate, partial rotary 0.25 (rotary_dim 8) with M-RoPE keys, linear heads nv = 2 * nk.
QWEN35_TEXT = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
    max_position_embeddings=262144, linear_num_key_heads=2, linear_key_head_dim=16,
    linear_num_value_heads=4, linear_value_head_dim=16, linear_conv_kernel_dim=4,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True}, **_TOKENS,
)
# The text-only model: the default interval-4 pattern, untied, attention biases.
QWEN35_TEXT_ONLY = dict(QWEN35_TEXT, tie_word_embeddings=False, attention_bias=True,
                        layer_types=["linear_attention"] * 3 + ["full_attention"])
