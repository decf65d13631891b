"""Compile: IR and weights to an execution program (quantize, plan, head screen), cached on disk."""
