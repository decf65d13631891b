"""Row-wise ops: elementwise, norms, RoPE, vectorised exp/tanh."""
