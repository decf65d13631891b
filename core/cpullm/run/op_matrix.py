"""A plugin op's matrix weight as the compiled program holds it, and the kernel entry that
multiplies by it.

An OpSpec lists roles in ``matrices`` (cpullm.loading.family.OpSpec): the compiler packs those weights
like a LINEAR's (int8 panels under "int8", 4-bit blocks under "q4", a GGUF file's own blocks
under "gguf", float32 under "f32" or with the node's ``precision="f32"``), and the op's fast
kernels receive each one as an :class:`OpMatrix` in that role's argument position, whose
:meth:`OpMatrix.matmul` runs the core's own LINEAR kernels over it. The op's numpy reference
receives :meth:`OpMatrix.dense`, the float32 values the program holds (dequantized), so the
conformance kit compares fast kernels and reference on the same weights.
"""
from __future__ import annotations

import numpy as np

from cpullm_kernels.program.formats import FORMATS


class OpMatrix:
    """Matrix W (N, K) of one plugin-op node: ``kind`` program_table.WEIGHT_* (its row of
    cpullm_kernels.program.formats.FORMATS) at ``w_off`` (wq int8 panels / wq's bytes of ggml
    blocks / wf float32), ``s_off`` (q8 scales in ws; blocks: the ggml type), ``Kp`` weights per
    stored row."""

    def __init__(self, ex, kind: int, w_off: int, s_off: int, Kp: int, N: int, K: int):
        self.kind, self.w_off, self.s_off, self.Kp = int(kind), int(w_off), int(s_off), int(Kp)
        self.shape = (int(N), int(K))
        self._wq, self._ws, self._wf = ex.wq, ex.ws, ex.wf
        self._dense = None
        self.fmt = self._checked_format()

    def _checked_format(self):
        """The matrix's format, its spans inside the program's arrays (a program may come from the cache)."""
        N, K = self.shape
        fmt = FORMATS.get(self.kind)
        spans = fmt.spans(N, K, self.Kp, self.w_off, self.s_off) if fmt is not None else None
        arrays = {"wq": self._wq, "ws": self._ws, "wf": self._wf}
        if spans is None or any(off < 0 or n < 0 or off + n > arrays[a].size for a, off, n in spans):
            raise ValueError(f"a plugin op's matrix {self.shape} lies outside the program's weights: "
                             f"clear the cache (`cpullm cache clear`)")
        return fmt

    @property
    def format(self) -> str:
        """The format's name: "q8", "f32" or "blocks" (raw ggml blocks)."""
        return self.fmt.name

    def matmul(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out (T, N) = x (T, K) @ W.T with the core's LINEAR prefill kernels (int8 / 4-bit /
        float32 weights as packed); x and out float32, any row stride. Returns out."""
        N, K = self.shape
        x = np.asarray(x, np.float32)
        if x.ndim != 2 or x.shape[1] != K or out.shape != (x.shape[0], N):
            raise ValueError(f"OpMatrix.matmul: x {x.shape} and out {out.shape} do not fit W {self.shape}")
        target = out if out.flags.c_contiguous else np.empty(out.shape, np.float32)
        self.fmt.prefill(self._wq, self._ws, self._wf, self.w_off, self.s_off, self.Kp, N, x, target)
        if target is not out:
            out[...] = target
        return out

    def dense(self) -> np.ndarray:
        """W as float32 (N, K): the values the program holds (dequantized from int8 or blocks)."""
        if self._dense is None:
            self._dense = self.fmt.dense(self._wq, self._ws, self._wf, self.w_off, self.s_off, self.Kp,
                                         *self.shape)
        return self._dense
