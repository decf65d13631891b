"""cpullm_kernels: numba kernels, one op per module, each with a numpy reference ``*_ref``.

``numba_setup`` runs first: it fixes the code-generation settings every kernel relies on
(vectorised integer dot products) before anything compiles.
"""
from .setup import numba_setup  # noqa: F401  (must precede every kernel import)

# Bumped whenever a kernel's numerics, the packed weight layout or the KV cache layout change: it
# enters the execution-cache key, so old compiled programs are rebuilt rather than misread (history:
# CHANGELOG.md).
KERNELS_VERSION = "12"
