"""Attention over the KV cache, batched decode attention, the linear-attention state."""
