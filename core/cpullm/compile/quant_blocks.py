"""Which matrices of a program are stored as raw ggml blocks, in which format, and their bytes.

Two quant modes store matrices as ggml blocks (cpullm_kernels.rows.gguf_blocks), executed by
kernels/cpullm_kernels/rows/kquant.py (decode) and kernels/cpullm_kernels/tiles/kquant_gemm.py (prefill):

* ``"gguf"``: a GGUF file run as it is. A matrix stored in a supported block format (Q8_0, Q4_0,
  Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) keeps its bytes; one stored otherwise (F32, F16, BF16,
  other ggml types) or read through a transform goes the int8 way (cpullm.compile.compiler).
* ``"q4"``: bf16 / f32 checkpoints quantized by cpullm_kernels.rows.q4 (its docstring: the design):
  Q4_K for every matrix but these, kept at Q6_K: the lm_head (and the embedding tied to it), and
  the attention value and MLP down projections of the layers where llama.cpp's Q4_K_M spends more
  bits (:func:`more_bits_layer`). Rows that are not whole 256-weight super-blocks (hidden sizes
  576, 640, 896 of the small models) take Q5_0 for Q4_K and Q8_0 for Q6_K, as llama.cpp's mix
  does: padding them to 256 would cost as many bytes (Q4_K at 576: 6.0 bits per weight against
  Q5_0's 5.5) for a coarser grid. A matrix whose row length is not a multiple of 32 stays int8.

The choice is made from the graph (ops, groups, where an output goes), never from family names.

A Q8_0 matrix is cpullm's own q8 layout interleaved (per 32 weights a binary16 scale and 32 int8
quants): :func:`q8_0_as_q8` splits it into q8's quants and scales, bit for bit the same values,
so it runs through the q8 kernels (int16 activations in decode, as accurate as float32 ones).
It is still counted as Q8_0. (The head screen would apply to such an lm_head, but it is an extra
compact copy: a GGUF run keeps its resident weights at the file's tensor bytes instead.)
"""
from __future__ import annotations

import re

import numpy as np

from ..graph.ir import Graph, Node, Op

BLOCK_QUANTS = ("q4", "gguf")
_LAYER = re.compile(r"^layers\.(\d+)\.")


def more_bits_layer(i: int, n_layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the first and last eighth of the layers and every third in
    between get 6-bit attention value and MLP down projections in its Q4_K_M mix."""
    return i < n_layers // 8 or i >= 7 * n_layers // 8 or (i - n_layers // 8) % 3 == 2


class BlockPlan:
    """The block format (ggml name) of each LINEAR / EMBED node of ``graph`` in mode ``quant``,
    or None where the node's matrix goes the int8 way."""

    def __init__(self, graph: Graph, weights, quant: str):
        self.weights, self.quant = weights, quant
        self.value_inputs = {n.inputs[2] for n in graph.nodes if n.op == Op.ATTENTION and len(n.inputs) > 2}
        layers = [int(m.group(1)) for n in graph.nodes if (m := _LAYER.match(n.name))]
        self.n_layers = max(layers) + 1 if layers else 0
        self.lm_head_ids = {weights.identity(n.weight("weight")) for n in graph.nodes
                            if n.op == Op.LINEAR and n.name == "lm_head" and n.weight("weight") in weights}
        self._memo: dict[str, str | None] = {}

    def fmt(self, node: Node) -> str | None:
        if node.name not in self._memo:
            self._memo[node.name] = self._choose(node)
        return self._memo[node.name]

    def body_has_q8(self, graph: Graph) -> bool:
        """True when a LINEAR of the per-token body runs on q8 weights (Q8_0 blocks, or a matrix
        that goes the int8 way), so prefill needs the q8 GEMM; the head's rows are few."""
        return any(n.op == Op.LINEAR and n.section == "body" and self.fmt(n) in (None, "Q8_0")
                   for n in graph.nodes)

    def warmup_flags(self, graph: Graph) -> dict:
        """Which kernels the program will need (arguments of kernels.warmup.units_for): a LINEAR,
        the EMBED, over raw blocks (Q8_0 runs as q8); the q8 prefill GEMM; the panel GEMM of a
        LINEAR the compiler may store in panels (a format kquant_panels reads)."""
        from cpullm_kernels.panels.kquant_panels import FORMATS as PANEL_FORMATS
        from cpullm_kernels.rows.gguf_blocks import block_format

        def on_blocks(op) -> bool:
            return any(n.op == op and self.fmt(n) not in (None, "Q8_0") for n in graph.nodes)
        # the formats of the LINEARs' raw blocks (Q8_0 runs as q8), whose matvecs compile; every
        # format where routed experts choose theirs when the program is compiled
        formats = None if any(n.op == Op.MOE for n in graph.nodes) else sorted(
            {self.fmt(n) for n in graph.nodes if n.op == Op.LINEAR and self.fmt(n) not in (None, "Q8_0")})
        return {"q8_prefill": self.body_has_q8(graph), "block_formats": formats,
                "blocks": on_blocks(Op.LINEAR), "embed_blocks": on_blocks(Op.EMBED),
                "panels": any(n.op == Op.LINEAR and self.fmt(n) is not None
                              and block_format(self.fmt(n)).ggml_type in PANEL_FORMATS for n in graph.nodes)}

    def _choose(self, node: Node) -> str | None:
        if node.op not in (Op.LINEAR, Op.EMBED) or node.attr("precision") is not None:
            return None
        canonical = node.weight("weight" if node.op == Op.LINEAR else "table")
        if self.quant == "gguf":
            found = self.weights.blocks(canonical) if hasattr(self.weights, "blocks") else None
            return found[0] if found is not None else None
        K = self.weights.shape(canonical)[1]
        if K % 32:
            return None
        whole = K % 256 == 0                       # rows of whole Q4_K / Q6_K super-blocks
        if self.weights.identity(canonical) in self.lm_head_ids:
            return "Q6_K" if whole else "Q8_0"
        m = _LAYER.match(node.name)
        if m and (node.output in self.value_inputs or node.group == "mlp_down") \
                and more_bits_layer(int(m.group(1)), self.n_layers):
            return "Q6_K" if whole else "Q8_0"
        return "Q4_K" if whole else "Q5_0"


def stored_blocks(weights, canonicals: list[str], fmt: str) -> tuple[np.ndarray, int]:
    """gguf mode: the matrix of ``canonicals`` (rows stacked) as the ``fmt`` blocks the file stores:
    (uint8 (N, row bytes), K), views of the file where one tensor makes the matrix."""
    parts = [weights.blocks(c) for c in canonicals]
    if any(p is None or p[0] != fmt for p in parts):
        raise ValueError(f"{canonicals}: not all stored as {fmt} blocks")   # BlockPlan keeps fused groups alike
    K = weights.shape(canonicals[0])[1]
    data = parts[0][1] if len(parts) == 1 else np.concatenate([p[1] for p in parts], axis=0)
    return data, K


def quantize_q4_rows(mat: np.ndarray, fmt: str) -> tuple[np.ndarray, int]:
    """q4 mode: float32 rows (N, K) quantized to ``fmt`` blocks: (uint8 (N, row bytes), Kp), Kp the
    weights per stored row (K, or K padded with zero weights to whole 256-blocks for Q4_K / Q6_K).
    Every format here quantizes each row on its own, so the compiler feeds a matrix a row block at
    a time and gets the bytes of the whole: the quantizers' temporaries are 2-7x their input
    (measured on 2048 x 2048), which is why the block, not the matrix, must bound them."""
    from cpullm_kernels.rows import q4
    quantize = {"Q4_K": q4.quantize_q4, "Q6_K": q4.quantize_q6_k, "Q5_0": q4.quantize_q5_0,
                "Q8_0": q4.quantize_q8_0}[fmt]
    K = mat.shape[1]
    return quantize(mat), (q4.padded_k(K) if fmt in ("Q4_K", "Q6_K") else K)


def q8_0_as_q8(data: np.ndarray, K: int):
    """Q8_0 blocks uint8 (N, K / 32 * 34) -> (q int8 (N, K), s uint16 (N, K / 32)): the same
    values in cpullm's q8 layout (w = f16(s) * q), or None when a quant is -128 (the q8 kernels
    take |q| <= 127, which ggml's quantizer keeps)."""
    N = data.shape[0]
    blocks = data.reshape(N, K // 32, 34)
    q = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(N, K)
    if (q == -128).any():
        return None
    s = np.ascontiguousarray(blocks[:, :, :2]).view(np.uint16).reshape(N, K // 32)
    return q, s
