"""cpullm.kernels: numba kernels, one op per module, each with a numpy reference ``*_ref``.

``numba_setup`` runs first: it fixes the code-generation settings every kernel relies on
(vectorised integer dot products) before anything compiles.
"""
from . import numba_setup  # noqa: F401  (must precede every kernel import)

# Bumped whenever a kernel's numerics, the packed weight layout or the KV cache layout change
# (3: keys in tiles of 16 slots, cache capacities rounded up to 16; 4: the lm_head screen of
# greedy decoding, kernels/head_screen.py; 5: screens only for lm_heads >= 64 MiB; 6: one packed
# copy per tensor identity (source, transform, rows), not per source; the LAYERNORM opcode; plugin
# ops and RoPE scalings; 7: raw ggml-block weights (WEIGHT_BLOCKS, quant modes q4 and gguf); 8: the
# q4 mix's Q5_0 / Q8_0 for rows that are not whole super-blocks, Q6_K scales coded to -128; 9: q4
# programs get the lm_head screen, kernels/head_screen_blocks.py; 10: the ATTENTION row's KV format
# column, float16 KV caches; 11: q8 weights in panels of 16 rows, kernels/q8_panels.py; 12: Q4_K /
# Q6_K blocks in panels of 16 rows, kernels/kquant_panels.py): it enters
# the execution-cache key, so old compiled programs are rebuilt rather than misread.
KERNELS_VERSION = "12"
