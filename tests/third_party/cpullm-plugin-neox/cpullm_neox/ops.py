"""``neox.gelu_erf``: the exact GELU, ``x * (1 + erf(x / sqrt 2)) / 2``, which the core does not
have (its GLU MLPs use SiLU or the tanh approximation). An op is its name, a shape rule, a numpy
reference and, optionally, fast kernels for prefill (T rows) and decode (one row); see
cpullm.loading.family.OpSpec. The kernels live in kernels.py and compile on their first call."""
from __future__ import annotations

import math

import numpy as np

from cpullm.plugin import OpSpec


def width(widths: tuple, attrs: dict) -> int:
    """One input, elementwise: the output has its columns."""
    if len(widths) != 1:
        raise ValueError(f"gelu_erf takes one input, got {len(widths)}")
    return widths[0]


_erf = np.frompyfunc(math.erf, 1, 1)


def reference(inputs: list, weights: dict, attrs: dict, pos0: int) -> np.ndarray:
    """(T, w) -> (T, w) in float64, then float32."""
    x = inputs[0].astype(np.float64)
    return (0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)).astype(np.float64))).astype(np.float32)


def prefill(out, x, params, pos0):
    from .kernels import gelu_erf_par
    gelu_erf_par(out, x)


def decode(out, x, params, pos0):
    from .kernels import gelu_erf_rows
    gelu_erf_rows(out, x)


GELU_ERF = OpSpec(name="neox.gelu_erf", width=width, reference=reference, prefill=prefill,
                  decode=decode, group="mlp_act", version="1")
