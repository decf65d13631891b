"""Tiny configs mirroring real checkpoints' structure (head counts, RoPE kind, tying, biases)."""
from __future__ import annotations

from hf_reference import TINY_VOCAB

SMOLLM2_LIKE = dict(  # SmolLM2-135M: 9 heads over 3 KV heads, head_dim 64, rope_theta 100000, tied
    hidden_size=576 // 4, intermediate_size=384, num_hidden_layers=3, num_attention_heads=9,
    num_key_value_heads=3, head_dim=16, rms_norm_eps=1e-5, vocab_size=TINY_VOCAB,
    max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=256, eos_token_id=257,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
)

LLAMA_UNTIED_BIAS = dict(  # untied lm_head, attention biases, explicit head_dim != hidden/heads
    hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=4, head_dim=32, rms_norm_eps=1e-6, vocab_size=TINY_VOCAB,
    max_position_embeddings=4096, tie_word_embeddings=False, attention_bias=True,
    bos_token_id=256, eos_token_id=257, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
)
