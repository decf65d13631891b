"""Tiny config.json per family (FamilySpec.tiny_config): cpullm's registry-coverage test runs the
conformance kit on a random checkpoint of each. Built like the real checkpoints named beside
them, 3-7 layers, the byte-level test tokenizer's 384-token vocabulary."""

_TOKENS = dict(vocab_size=384, bos_token_id=256, eos_token_id=257, pad_token_id=0)

GEMMA = dict(  # gemma-2b: MQA, heads x head_dim != hidden, tied
    model_type="gemma", architectures=["GemmaForCausalLM"],
    hidden_size=80, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6, max_position_embeddings=8192,
    hidden_act="gelu_pytorch_tanh", rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    **_TOKENS,
)
GEMMA2 = dict(  # gemma-2-2b: alternating sliding layers, attention and final soft-capping
    model_type="gemma2", architectures=["Gemma2ForCausalLM"],
    hidden_size=96, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
    attn_logit_softcapping=50.0, final_logit_softcapping=30.0, rms_norm_eps=1e-6,
    max_position_embeddings=8192, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    **_TOKENS,
)
_GEMMA3_TEXT = dict(  # gemma-3-270m: 5 local : 1 global, two RoPE thetas, q/k norms
    hidden_size=96, intermediate_size=192, num_hidden_layers=7, num_attention_heads=4,
    num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, sliding_window=12,
    rms_norm_eps=1e-6, max_position_embeddings=32768,
    rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
    **_TOKENS,
)
GEMMA3_TEXT = dict(_GEMMA3_TEXT, model_type="gemma3_text", architectures=["Gemma3ForCausalLM"])
GEMMA3 = dict(  # the multimodal wrapper: the text model in text_config (no vision tensors here)
    model_type="gemma3", architectures=["Gemma3ForConditionalGeneration"],
    text_config=dict(_GEMMA3_TEXT, model_type="gemma3_text"),
    **{k: v for k, v in _TOKENS.items() if k != "vocab_size"},
)

# Parity configs of the family's tests (plugins/gemma/tests), also run by the core's scheduler tests.
# gemma-2-2b: GQA 8/4 -> 4/2, query_pre_attn_scalar != head_dim here so the scale is tested,
# alternating sliding layers (window 4096 -> 8), attention softcap 50, final softcap 30.
GEMMA2_2B_LIKE = dict(
    hidden_size=96, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
    attn_logit_softcapping=50.0, final_logit_softcapping=30.0, rms_norm_eps=1e-6,
    max_position_embeddings=8192, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    **_TOKENS)

# gemma-3-270m: 4 heads over 1 KV head, 5 local : 1 global (7 layers: layer 5 is global),
# window 512 -> 12, global theta 1e6 / local 1e4, no RoPE scaling. The softcap values check that
# transformers' Gemma3 attention ignores its cap and Gemma3ForCausalLM applies the final cap.
GEMMA3_270M_LIKE = dict(
    hidden_size=96, intermediate_size=192, num_hidden_layers=7, num_attention_heads=4,
    num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, sliding_window=12,
    rms_norm_eps=1e-6, max_position_embeddings=32768, attn_logit_softcapping=5.0,
    final_logit_softcapping=10.0,
    rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
    **_TOKENS)
