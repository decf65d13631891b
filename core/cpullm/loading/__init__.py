"""Load: find a model, read its config, family, tensors (safetensors or GGUF), weight map and tokenizer."""
