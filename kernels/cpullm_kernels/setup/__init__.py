"""numba's settings and cache lock, kernel warm-up, the memory read-rate probe."""
