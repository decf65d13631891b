"""Register-tiled GEMMs for prefill."""
