"""Weight formats read row by row: q8 block-32, ggml blocks, their quantizers and row kernels."""
