"""GGUF (ggml) quantized block formats as data, with a numpy reference dequantizer for each.

A quantized GGUF matrix of shape (N, K) (numpy order: N rows of K weights along the input
dimension) is stored row after row; each row is K / W blocks of B bytes, W weights per block
(K is always a multiple of W). The formats cpullm executes as they are:

    name  ggml type  W    B    bits/w  layout of one block (little-endian; f16 = IEEE binary16)
    Q8_0   8         32   34   8.5     d f16 | qs int8[32]                  w = d * qs
    Q4_0   2         32   18   4.5     d f16 | qs u8[16]                    w = d * (q - 8)
    Q4_1   3         32   20   5.0     d f16 | m f16 | qs u8[16]            w = d * q + m
    Q5_0   6         32   22   5.5     d f16 | qh u32 | qs u8[16]           w = d * (q - 16)
    Q5_1   7         32   24   6.0     d f16 | m f16 | qh u32 | qs u8[16]   w = d * q + m
    Q4_K  12         256  144  4.5     d f16 | dmin f16 | scales u8[12] | qs u8[128]
    Q5_K  13         256  176  5.5     d f16 | dmin f16 | scales u8[12] | qh u8[32] | qs u8[128]
    Q6_K  14         256  210  6.5625  ql u8[128] | qh u8[64] | scales int8[16] | d f16

Where the quants q sit (j: weight index inside the block):

* Q4_0 / Q4_1: q[j] = qs[j] & 15 and q[j + 16] = qs[j] >> 4, for j < 16.
* Q5_0 / Q5_1: the same low 4 bits, plus bit j of the 32-bit word qh as bit 4 of q[j].
* Q4_K: 8 sub-blocks of 32 weights, sub-block s scaled by d * sc[s] with offset -dmin * mn[s]
  (w = d sc q - dmin mn), sc and mn 6-bit values packed in ``scales`` (:func:`k_scales_mins`).
  Weights 64 c .. 64 c + 31 are the low nibbles of qs[32 c:32 c + 32], weights 64 c + 32 ..
  64 c + 63 their high nibbles (c < 4), so sub-block s is the low (s even) or high (s odd) half.
* Q5_K: Q4_K plus a fifth bit: bit s of qh[l] is bit 4 of weight 32 s + l.
* Q6_K: 16 sub-blocks of 16 weights, w = d * scales[j // 16] * (q - 32), q 6 bits: for weight
  128 h + 32 k + l (h < 2, k < 4, l < 32) the low 4 bits are the low (k < 2) or high (k >= 2)
  nibble of ql[64 h + 32 (k % 2) + l], the high 2 bits are bits 2k, 2k + 1 of qh[32 h + l].

Every product is evaluated in float32 in the order written above (d * sc first for the
K-quants), as ggml's own reference dequantizers do.

The kernel modules reach a format by its ggml type number (``Q4_K`` = 12 ...), the number the
GGUF header stores, so a tensor's type goes straight from the file to the kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BlockFormat:
    """One ggml block format: how many weights a block holds and how many bytes it takes."""

    name: str
    ggml_type: int          # the number in the GGUF tensor header (gguf.GGMLQuantizationType)
    block_weights: int      # W: weights per block along K
    block_bytes: int        # B: bytes per block
    sub_block: int          # weights sharing one scale (the sub-block of the K-quants)

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.block_bytes / self.block_weights

    def row_bytes(self, K: int) -> int:
        """Bytes of one row of K weights (K a multiple of block_weights)."""
        if K % self.block_weights:
            raise ValueError(f"{self.name}: row length {K} is not a multiple of {self.block_weights}")
        return K // self.block_weights * self.block_bytes


Q8_0 = BlockFormat("Q8_0", 8, 32, 34, 32)
Q4_0 = BlockFormat("Q4_0", 2, 32, 18, 32)
Q4_1 = BlockFormat("Q4_1", 3, 32, 20, 32)
Q5_0 = BlockFormat("Q5_0", 6, 32, 22, 32)
Q5_1 = BlockFormat("Q5_1", 7, 32, 24, 32)
Q4_K = BlockFormat("Q4_K", 12, 256, 144, 32)
Q5_K = BlockFormat("Q5_K", 13, 256, 176, 32)
Q6_K = BlockFormat("Q6_K", 14, 256, 210, 16)

FORMATS = {f.name: f for f in (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)}
"""The formats cpullm executes as they are, by ggml name."""

BY_TYPE = {f.ggml_type: f for f in FORMATS.values()}
"""The same formats by ggml type number."""


def block_format(fmt) -> BlockFormat:
    """A BlockFormat from itself, its ggml name ("Q4_K") or its ggml type number (12)."""
    if isinstance(fmt, BlockFormat):
        return fmt
    found = FORMATS.get(fmt) if isinstance(fmt, str) else BY_TYPE.get(int(fmt))
    if found is None:
        raise ValueError(f"unsupported ggml block format {fmt!r}; supported: {', '.join(FORMATS)}")
    return found


# ================================================================================================
# numpy reference dequantizers
# ================================================================================================

def _blocks(data, fmt: BlockFormat, N: int, K: int) -> np.ndarray:
    """The raw bytes of an (N, K) matrix as uint8 (N * K / W, B), one block per row."""
    raw = np.ascontiguousarray(np.asarray(data).reshape(-1).view(np.uint8))
    need = N * fmt.row_bytes(K)
    if raw.size != need:
        raise ValueError(f"{fmt.name} ({N}, {K}) needs {need} bytes, got {raw.size}")
    return raw.reshape(-1, fmt.block_bytes)


def _f16(blocks: np.ndarray, off: int) -> np.ndarray:
    """The binary16 field at byte ``off`` of every block, as float32 (nblocks,)."""
    return np.ascontiguousarray(blocks[:, off:off + 2]).view(np.float16)[:, 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """qs u8 (nb, 16) -> q (nb, 32): low nibbles are weights 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 15, qs >> 4], axis=1)


def _bits32(qh: np.ndarray) -> np.ndarray:
    """qh u8 (nb, 4) (a little-endian u32) -> (nb, 32) u8: bit j of the word at column j."""
    return np.unpackbits(qh, axis=1, bitorder="little")


def k_scales_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12-byte ``scales`` field of Q4_K / Q5_K (nb, 12) -> (sc, mn) u8 (nb, 8), 6 bits each.

    Sub-blocks 0-3: sc = bytes 0-3 & 63, mn = bytes 4-7 & 63. Sub-blocks 4-7: the low 4 bits come
    from bytes 8-11 (sc: low nibble, mn: high nibble), the top 2 bits from the top 2 bits of
    bytes 0-3 (sc) and 4-7 (mn).
    """
    s = scales
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)], axis=1)
    mn = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    return sc, mn


def _deq_q8_0(b):
    return b[:, 2:34].view(np.int8).astype(np.float32) * _f16(b, 0)[:, None]


def _deq_q4_0(b):
    q = _nibbles(b[:, 2:18]).astype(np.float32) - np.float32(8)
    return q * _f16(b, 0)[:, None]


def _deq_q4_1(b):
    q = _nibbles(b[:, 4:20]).astype(np.float32)
    return q * _f16(b, 0)[:, None] + _f16(b, 2)[:, None]


def _deq_q5_0(b):
    q = (_nibbles(b[:, 6:22]) | (_bits32(b[:, 2:6]) << 4)).astype(np.float32) - np.float32(16)
    return q * _f16(b, 0)[:, None]


def _deq_q5_1(b):
    q = (_nibbles(b[:, 8:24]) | (_bits32(b[:, 4:8]) << 4)).astype(np.float32)
    return q * _f16(b, 0)[:, None] + _f16(b, 2)[:, None]


def k_low4(qs: np.ndarray) -> np.ndarray:
    """qs u8 (nb, 128) of Q4_K / Q5_K -> low 4 bits of the quants (nb, 8, 32) by sub-block."""
    qs = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([qs & 15, qs >> 4], axis=2).reshape(-1, 8, 32)


def _k_apply(q, b):
    """w = (d sc) q - (dmin mn) for Q4_K / Q5_K; q (nb, 8, 32) -> (nb, 256)."""
    sc, mn = k_scales_mins(b[:, 4:16])
    d1 = _f16(b, 0)[:, None] * sc.astype(np.float32)      # (nb, 8)
    m1 = _f16(b, 2)[:, None] * mn.astype(np.float32)
    return (d1[..., None] * q.astype(np.float32) - m1[..., None]).reshape(-1, 256)


def _deq_q4_k(b):
    return _k_apply(k_low4(b[:, 16:144]), b)


def _deq_q5_k(b):
    qh = b[:, 16:48]                                        # (nb, 32): bit s of qh[l] -> sub-block s
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    return _k_apply(k_low4(b[:, 48:176]) | (high << 4), b)


def q6_k_quants(b: np.ndarray) -> np.ndarray:
    """Q6_K blocks u8 (nb, 210) -> the unsigned 6-bit quants (nb, 256) u8 in weight order."""
    ql = b[:, 0:128].reshape(-1, 2, 2, 32)                  # (nb, half h, k % 2, l)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32)                # (nb, half h, -, l)
    low = np.concatenate([ql & 15, ql >> 4], axis=2)        # (nb, h, k, l): k = 0, 1 low; 2, 3 high
    high = (qh >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3
    return (low | (high << 4)).reshape(-1, 256)


def _deq_q6_k(b):
    q = q6_k_quants(b).astype(np.float32) - np.float32(32)
    dsc = _f16(b, 208)[:, None] * b[:, 192:208].view(np.int8).astype(np.float32)   # (nb, 16)
    return (np.repeat(dsc, 16, axis=1) * q)


_DEQUANT = {"Q8_0": _deq_q8_0, "Q4_0": _deq_q4_0, "Q4_1": _deq_q4_1, "Q5_0": _deq_q5_0,
            "Q5_1": _deq_q5_1, "Q4_K": _deq_q4_k, "Q5_K": _deq_q5_k, "Q6_K": _deq_q6_k}


def dequantize_ref(data, fmt, shape) -> np.ndarray:
    """numpy reference: the raw bytes of a row-major (N, K) matrix in ``fmt`` -> float32 (N, K).

    ``data``: any array or buffer holding exactly N * K / W * B bytes (e.g. the uint8 (N, row
    bytes) view of a GGUF tensor); ``fmt``: a BlockFormat, its name or its ggml type number.
    """
    fmt = block_format(fmt)
    N, K = (int(v) for v in shape)
    blocks = _blocks(data, fmt, N, K)
    return _DEQUANT[fmt.name](blocks).astype(np.float32, copy=False).reshape(N, K)


def dequantize_parts_ref(data, fmt, shape) -> tuple[np.ndarray, np.ndarray]:
    """The weights of a row-major (N, K) ``fmt`` matrix split the way the decode matvec
    (kernels/cpullm_kernels/rows/kquant.py) multiplies them: w = s + c with s the scaled quants (Q6_K: d sc q with q
    unsigned 0..63; Q4_K / Q5_K: d sc q; Q4_0 / Q5_0: d q with q unsigned; Q4_1 / Q5_1: d q; Q8_0:
    d q, q signed) and c the offset the matvec adds through the activation block sums (Q6_K
    -32 d sc; Q4_K / Q5_K -dmin mn; Q4_0 -8 d; Q5_0 -16 d; Q4_1 / Q5_1 m; Q8_0 0). Both float64
    (N, K), every product exact (at most 24 significant bits: a binary16 times a 6-8-bit integer
    times a quant); s + c rounds once in float64. The head screen bounds the matvec's float
    rounding by |s| + |c| (kernels/cpullm_kernels/panels/head_screen.py)."""
    fmt = block_format(fmt)
    N, K = (int(v) for v in shape)
    b = _blocks(data, fmt, N, K)
    f16 = lambda off: _f16(b, off).astype(np.float64)[:, None]        # noqa: E731
    name = fmt.name
    if name == "Q8_0":
        s, c = b[:, 2:34].view(np.int8).astype(np.float64) * f16(0), np.zeros((b.shape[0], 32))
    elif name in ("Q4_0", "Q5_0"):
        q = _nibbles(b[:, 2:18] if name == "Q4_0" else b[:, 6:22]).astype(np.float64)
        if name == "Q5_0":
            q += _bits32(b[:, 2:6]) * 16.0
        s, c = q * f16(0), np.repeat(-(8.0 if name == "Q4_0" else 16.0) * f16(0), 32, axis=1)
    elif name in ("Q4_1", "Q5_1"):
        q = _nibbles(b[:, 4:20] if name == "Q4_1" else b[:, 8:24]).astype(np.float64)
        if name == "Q5_1":
            q += _bits32(b[:, 4:8]) * 16.0
        s, c = q * f16(0), np.repeat(f16(2), 32, axis=1)
    elif name in ("Q4_K", "Q5_K"):
        q = k_low4(b[:, 16:144] if name == "Q4_K" else b[:, 48:176]).astype(np.float64)   # (nb, 8, 32)
        if name == "Q5_K":
            q += ((b[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) * 16.0
        sc, mn = k_scales_mins(b[:, 4:16])
        s = (f16(0) * sc)[..., None] * q
        c = np.broadcast_to(-(f16(2) * mn)[..., None], q.shape)
    else:                                                             # Q6_K
        dsc = np.repeat(f16(208) * b[:, 192:208].view(np.int8).astype(np.float64), 16, axis=1)   # (nb, 256)
        s, c = dsc * q6_k_quants(b).astype(np.float64), -32.0 * dsc
    return s.reshape(N, K), np.ascontiguousarray(c).reshape(N, K)


def random_blocks(fmt, N: int, K: int, rng: np.random.Generator, scale: float = 0.01) -> np.ndarray:
    """Random raw bytes of an (N, K) matrix in ``fmt``, uint8 (N, row bytes), with finite scales.

    Every quant bit is random; the binary16 fields (d, dmin, m) are drawn as |N(0, scale)| (m
    and the ggml d of the legacy formats with a random sign), so dequantized values are finite
    and of a realistic size. For tests and benchmarks.
    """
    fmt = block_format(fmt)
    raw = rng.integers(0, 256, size=(N * fmt.row_bytes(K)), dtype=np.uint8)
    b = raw.reshape(-1, fmt.block_bytes)
    nb = b.shape[0]

    def put(off, signed):
        v = np.abs(rng.standard_normal(nb)) * scale
        if signed:
            v *= rng.choice([-1.0, 1.0], nb)
        b[:, off:off + 2] = v.astype(np.float16).view(np.uint8).reshape(nb, 2)

    offsets = {"Q8_0": [(0, True)], "Q4_0": [(0, True)], "Q5_0": [(0, True)],
               "Q4_1": [(0, True), (2, True)], "Q5_1": [(0, True), (2, True)],
               "Q4_K": [(0, False), (2, False)], "Q5_K": [(0, False), (2, False)], "Q6_K": [(208, False)]}
    for off, signed in offsets[fmt.name]:
        put(off, signed)
    return raw.reshape(N, fmt.row_bytes(K))
