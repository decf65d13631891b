"""Weights in panels of 16 rows: one LINEAR kernel for decode, batches and the head screen."""
