"""Tiny config.json of the family (FamilySpec.tiny_config): cpullm's registry-coverage test runs
the conformance kit on a random checkpoint of it. Built like Llama 3.2 (llama3 RoPE scaling,
GQA, tied embeddings), 3 layers, the byte-level test tokenizer's 384-token vocabulary."""

LLAMA = dict(
    model_type="llama", architectures=["LlamaForCausalLM"],
    hidden_size=96, intermediate_size=192, num_hidden_layers=3, num_attention_heads=6,
    num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, vocab_size=384,
    max_position_embeddings=131072, tie_word_embeddings=True, bos_token_id=256, eos_token_id=257,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                     "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192},
)
