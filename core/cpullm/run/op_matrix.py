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

from cpullm_kernels.program import program_table as P


class OpMatrix:
    """Matrix W (N, K) of one plugin-op node: ``kind`` program_table.WEIGHT_* at ``w_off`` (wq
    int8 panels / wq's bytes of ggml blocks / wf float32), ``s_off`` (q8 scales in ws; blocks:
    the ggml type), ``Kp`` weights per stored row."""

    def __init__(self, ex, kind: int, w_off: int, s_off: int, Kp: int, N: int, K: int):
        self.kind, self.w_off, self.s_off, self.Kp = int(kind), int(w_off), int(s_off), int(Kp)
        self.shape = (int(N), int(K))
        self._wq, self._ws, self._wf = ex.wq, ex.ws, ex.wf
        self._dense = None
        self._check_bounds()

    def _check_bounds(self) -> None:
        """The matrix lies inside the program's arrays (a program may come from the cache)."""
        from ..compile.cache_format import block_rows_bytes
        from cpullm_kernels.panels.q8_panels import padded_rows
        N, K = self.shape
        if self.kind == P.WEIGHT_F32:
            spans = [(self.w_off, N * K, self._wf.size)]
        elif self.kind == P.WEIGHT_Q8:
            Np = padded_rows(N)
            spans = [(self.w_off, Np * self.Kp, self._wq.size), (self.s_off, Np * (self.Kp // 32), self._ws.size)]
            spans += [(0, -1, 0)] if self.Kp < K or self.Kp % 32 else []
        elif self.kind == P.WEIGHT_BLOCKS:
            need = block_rows_bytes(self.s_off, N, self.Kp)
            spans = [(self.w_off, need if need is not None and self.Kp >= K else -1, self._wq.size)]
        else:
            spans = [(0, -1, 0)]
        if any(off < 0 or n < 0 or off + n > size for off, n, size in spans):
            raise ValueError(f"a plugin op's matrix {self.shape} lies outside the program's weights: "
                             f"clear the cache (`cpullm cache clear`)")

    @property
    def format(self) -> str:
        """"q8", "f32" or "blocks" (raw ggml blocks)."""
        return {P.WEIGHT_Q8: "q8", P.WEIGHT_F32: "f32", P.WEIGHT_BLOCKS: "blocks"}[self.kind]

    def matmul(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out (T, N) = x (T, K) @ W.T with the core's LINEAR kernels (int8 / 4-bit / float32
        weights as packed); x and out float32, any row stride. Returns out."""
        from cpullm_kernels.rows.q8 import matmul_f32
        from cpullm_kernels.panels.q8_panels import matmul_panels, padded_rows
        N, K = self.shape
        x = np.asarray(x, np.float32)
        if x.ndim != 2 or x.shape[1] != K or out.shape != (x.shape[0], N):
            raise ValueError(f"OpMatrix.matmul: x {x.shape} and out {out.shape} do not fit W {self.shape}")
        if self.kind == P.WEIGHT_Q8:
            target = out if out.flags.c_contiguous else np.empty(out.shape, np.float32)
            Np = padded_rows(N)
            matmul_panels(x, self._wq[self.w_off: self.w_off + Np * self.Kp],
                          self._ws[self.s_off: self.s_off + Np * (self.Kp // 32)], N, target)
        elif self.kind == P.WEIGHT_BLOCKS:
            target = out if out.flags.c_contiguous else np.empty(out.shape, np.float32)
            matmul_blocks(self._wq.view(np.uint8), self.s_off, self.w_off, self.Kp, x, target)
        else:
            target = out
            matmul_f32(x, self._wf[self.w_off: self.w_off + N * K].reshape(N, K), out)
        if target is not out:
            out[...] = target
        return out

    def dense(self) -> np.ndarray:
        """W as float32 (N, K): the values the program holds (dequantized from int8 or blocks)."""
        if self._dense is None:
            self._dense = self._dequantized()
        return self._dense

    def _dequantized(self) -> np.ndarray:
        from cpullm_kernels.rows.gguf_blocks import block_format
        from cpullm_kernels.tiles.kquant_gemm import dequantize
        from cpullm_kernels.panels.kquant_panels import PANELED, dequantize_ref
        from cpullm_kernels.panels.q8_panels import dequantized_rows, padded_rows
        N, K = self.shape
        if self.kind == P.WEIGHT_F32:
            return self._wf[self.w_off: self.w_off + N * K].reshape(N, K)
        if self.kind == P.WEIGHT_Q8:
            Np = padded_rows(N)
            rows = dequantized_rows(self._wq[self.w_off: self.w_off + Np * self.Kp],
                                    self._ws[self.s_off: self.s_off + Np * (self.Kp // 32)], self.Kp, 0, N)
            return np.ascontiguousarray(rows[:, :K], dtype=np.float32)
        fmt = self.s_off % PANELED
        rb = block_format(fmt).row_bytes(self.Kp)
        data = self._wq.view(np.uint8)[self.w_off: self.w_off + N * rb]
        if self.s_off >= PANELED:
            full = dequantize_ref(fmt, data, N, self.Kp)
        else:
            full = dequantize(fmt, data.reshape(N, rb), self.Kp)
        return np.ascontiguousarray(full[:, :K], dtype=np.float32)


def matmul_blocks(wb: np.ndarray, fmt: int, w_off: int, Kp: int, x: np.ndarray, out: np.ndarray) -> None:
    """Prefill LINEAR over raw ggml blocks: out (T, N) = x (T, K) @ W.T by kquant_gemm.matmul, or
    kquant_panels.matmul_float for Q4_K / Q6_K in panels (``fmt`` the ggml type + PANELED); rows
    stored padded to Kp weights (zero weights) get x padded with zeros."""
    from cpullm_kernels.rows.gguf_blocks import block_format
    from cpullm_kernels.tiles.kquant_gemm import matmul
    from cpullm_kernels.panels.kquant_panels import PANELED, matmul_float
    N = out.shape[1]
    rb = block_format(fmt % PANELED).row_bytes(Kp)
    if fmt >= PANELED:                   # Q4_K / Q6_K in panels of 16 rows
        matmul_float(fmt % PANELED, x, wb[w_off: w_off + N * rb], N, out)
        return
    w = wb[w_off: w_off + N * rb].reshape(N, rb)
    if x.shape[1] != Kp:
        xp = np.zeros((x.shape[0], Kp), np.float32)
        xp[:, :x.shape[1]] = x
        x = xp
    matmul(fmt, x, w, out)
