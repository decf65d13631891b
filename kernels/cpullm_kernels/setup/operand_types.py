"""The numba types of the operands the executor passes to the compiled kernels: what the warm-up
compiles them for, and what an addressed call (:mod:`cpullm_kernels.setup.addressed`) declares.
Program arrays are read-only (the executor makes them so), so each kernel has one specialization
per operand kind."""
from __future__ import annotations

from numba import types as nt


def array(dtype, ndim: int = 1, readonly: bool = False, layout: str = "C"):
    return nt.Array(dtype, ndim, layout, readonly=readonly)


ARENA = array(nt.float32)                  # arena, state, x_s scratch
WF = array(nt.float32, readonly=True)      # float weights
WQ = array(nt.int8, readonly=True)         # int8 weights
WS = array(nt.uint16, readonly=True)       # their binary16 scales
WB = array(nt.uint8, readonly=True)        # wq's bytes, for raw-block (GGUF format) weights
PROG_I = array(nt.int64, 2, readonly=True)
PROG_F = array(nt.float64, 2, readonly=True)
INTS = array(nt.int64)                     # tokens, rt
XQ = array(nt.int16)                       # quantized activations
i64, f64 = nt.int64, nt.float64
