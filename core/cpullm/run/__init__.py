"""Run: the forward path over slots, the executor and batch decoder, prefix and prompt caches, memory."""
