"""cpullm's ``--quant q4``: 4-bit weights from bf16 / f32 checkpoints, stored as ggml Q4_K blocks.

Design
------
**The format is Q4_K** (gguf_blocks.Q4_K: super-blocks of 256 weights = 8 sub-blocks of 32, each
sub-block w = (d sc) q - (dmin mn) with q 4 bits, sc / mn 6 bits, d / dmin binary16 per 256;
144 bytes, 4.5 bits per weight). Why not a format of our own:

* One kernel set. GGUF files run as they are (issue: Q4_K_M = Q4_K + Q6_K), so Q4_K and Q6_K
  already have decode and prefill kernels for every ISA (kernels/cpullm_kernels/panels/kquant_panels.py for matrices
  of whole 16-row panels, kernels/cpullm_kernels/rows/kquant.py and kquant_gemm.py for the rest); a q4 of our own
  would double that code and its tests for no byte saved.
* 4.5 bits per weight is as small as 4-bit blocks with an offset get: a block of 32 with a
  binary16 scale and min (Q4_1's layout) costs 5.0; Q4_0's 4.5 has no min, and its symmetric
  grid wastes a level on skewed blocks (its round-trip RMSE on Gaussian rows is ~1.2x Q4_K's).
  The 6-bit sub-block scales and mins under one binary16 pair per 256 weights give a per-32
  affine grid at 0.5 bit per weight of overhead.
* The q4 program's bytes are then a valid GGUF tensor: what llama.cpp reads, we read.

**The quantizer** (:func:`quantize_q4`, no calibration data, no imatrix) picks each sub-block's
scale a and min b (w ~ a q - b, b >= 0) by least squares weighted by importance rms(sub-block) +
|w_i| (ggml's weighting without imatrix; it, not a lower plain squared error, is what lowered the
KL, see benchmarks/results/2026-12-04-q4-fidelity.md): for 12 candidate grids (15 + t levels
over the sub-block's range [min(x, 0), max x], t from -1 to 1.2) it rounds x to the grid, refits
(a, b) in closed form to the rounded levels (b clamped at 0) and keeps the candidate with the
smallest weighted error; then it re-rounds x to that fit and refits once more. Then d = max a /
63 and dmin = max b / 63 (binary16), sc = rint(a / d), mn = rint(b / dmin), and the quants are
rounded once more against the final scales (d sc, dmin mn) exactly as the dequantizer computes
them. Its weighted error is held within 1 % of llama.cpp's own Q4_K quantizer without imatrix
(``ggml_quantize_chunk``) by a test, where that library is installed.

**Tensor choices** (decided by the compiler from the op, never from family names; their KL
against llama.cpp's Q4_K_M is measured by benchmarks/fidelity.py):

* attention q / k / o and MLP gate / up: Q4_K.
* attention v and MLP down: Q6_K in the layers where llama.cpp's Q4_K_M spends more bits (the
  first and last eighth of the layers and every third in between), Q4_K elsewhere: the same
  bytes per token as Q4_K_M, so its decode-speed comparison is bytes against bytes.
* lm_head: Q6_K (6.56 bits). It is the largest single matrix of the 0.1-4B models with large
  vocabularies (Qwen2.5-0.5B: 136M of 494M weights) and the logits' error is what KL measures.
* embedding: tied to the lm_head, its rows are gathered from the same Q6_K blocks (one row
  dequantized per token, no second copy); untied, Q4_K (a gathered row costs no bandwidth).
* K not a multiple of 256 (hidden sizes 576, 640, 896 of the small models): Q5_0 where Q4_K
  would go and Q8_0 where Q6_K would, llama.cpp's fallbacks. Padding the rows to whole
  super-blocks instead costs about the same bytes (at 576: Q4_K 6.0 bits per weight, Q5_0 5.5;
  at 896: 5.1 against 5.5) on a coarser grid: Gemma 3 270M's q4 KL fell from 0.071 to the
  figure in benchmarks/results/ when its 640-wide rows moved to Q5_0 / Q8_0.

Entry points: ``quantize_q4(w float32 (N, K)) -> uint8 (N, Kp / 256 * 144)``, Kp = K rounded up
to 256, and its reference dequantizer ``dequantize_q4_ref(blocks, N, K) -> float32 (N, K)``
(gguf_blocks.dequantize_ref for Q4_K, the padding dropped); for the tensors kept at 6 bits,
``quantize_q6_k(w) -> uint8 (N, Kp / 256 * 210)`` and ``dequantize_q6_k_ref``. Its quantizer:
each sub-block of 16 gets a signed scale a (w ~ a q, q in -32..31) by least squares over 16
candidate grids (the largest |x| mapped to -32 + t or 31 - t levels), d = -a_peak / 128 (binary16;
a_peak the scale of largest magnitude, whose code is then -128, the full int8 range as ggml's
quantizer uses it, so a dequantized Q6_K tensor comes back as its own blocks), int8
sc = rint(a / d), and the quants are rounded against d sc as the dequantizer computes it.
For rows that are not whole super-blocks, ``quantize_q5_0(w) -> uint8 (N, K / 32 * 22)`` and
``quantize_q8_0(w) -> uint8 (N, K / 32 * 34)`` (dequantized by gguf_blocks.dequantize_ref).
"""
from __future__ import annotations

import numpy as np

from .gguf_blocks import Q4_K, dequantize_ref

SUPER = 256
SUB = 32
_CANDIDATES = np.linspace(-1.0, 1.2, 12, dtype=np.float32)
"""Offsets t of the candidate grids (15 + t levels over a sub-block's range). With the refit
after the search, 12 candidates come within 0.1 % of 24's importance-weighted error on
Gaussian, Student-t and skewed rows, at 2.5x the speed."""
_ROWS_PER_CHUNK_VALUES = 1 << 18
"""Weights quantized per numpy pass (the candidate search holds a few 12 x 4-byte arrays per weight)."""


def padded_k(K: int) -> int:
    """K rounded up to a whole number of 256-weight super-blocks."""
    return (int(K) + SUPER - 1) // SUPER * SUPER


def _refit(x: np.ndarray, r: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Weighted least squares of x ~ a q + c with c <= 0 (the offset may only lower the grid).
    x (M, 1, 32), importance r (M, 1, 32), levels q (M, C, 32) -> a, c, weighted error (M, C)."""
    xr = x * r
    n = r.sum(-1)                                                          # (M, 1)
    n = np.where(n > 0, n, 1)                     # an all-zero sub-block (dropped by the caller)
    sq, sqq = (q * r).sum(-1), (q * q * r).sum(-1)                         # (M, C)
    sx, sqx = xr.sum(-1), (q * xr).sum(-1)
    det = n * sqq - sq * sq
    ok = det > 0
    a = np.where(ok, (n * sqx - sq * sx) / np.where(ok, det, 1), 0)
    c = np.where(ok, (sx - a * sq) / n, sx / n)    # one level only: the offset alone, refit below if > 0
    pos = c > 0
    a = np.where(pos, np.where(sqq > 0, sqx / np.where(sqq > 0, sqq, 1), 0), a)
    c = np.where(pos, 0, c)
    a = np.maximum(a, 0)
    return a, c, (r * (a[..., None] * q + c[..., None] - x) ** 2).sum(-1)


def _fit_sub_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x float32 (M, 32) sub-blocks -> (a, b) float32 (M,): w ~ a q - b, q in 0..15, a, b >= 0,
    fitted by least squares weighted by importance r_i = rms(x) + |x_i| (large weights count
    more: on Qwen2.5-0.5B this weighting took q4's KL from 0.0056 to the figure in
    benchmarks/results/, against an unweighted fit with a lower plain squared error): the best
    of 12 candidate grids, then the levels re-rounded to that fit and refitted once."""
    xmin = np.minimum(x.min(axis=1), 0.0)                                  # (M,)
    span = x.max(axis=1) - xmin
    live = span > 0
    span = np.where(live, span, 1.0).astype(np.float32)
    r = (np.sqrt((x * x).mean(axis=1))[:, None] + np.abs(x))[:, None, :]  # (M, 1, 32) importance
    x3 = x[:, None, :]
    iscale = (np.float32(15) + _CANDIDATES)[None, :] / span[:, None]      # (M, C)
    q = np.clip(np.rint((x3 - xmin[:, None, None]) * iscale[..., None]), 0, 15)   # (M, C, 32)
    a, c, err = _refit(x3, r, q)
    pick = np.arange(x.shape[0])
    best = err.argmin(axis=1)
    a, c, err = a[pick, best], c[pick, best], err[pick, best]              # (M,)
    inv = np.where(a > 0, 1 / np.where(a > 0, a, 1), 0)
    q2 = np.clip(np.rint((x - c[:, None]) * inv[:, None]), 0, 15)[:, None, :]
    a2, c2, err2 = _refit(x3, r, q2)
    better = err2[:, 0] < err
    a, c = np.where(better, a2[:, 0], a), np.where(better, c2[:, 0], c)
    return np.where(live, a, 0).astype(np.float32), np.where(live, -c, -xmin).astype(np.float32)


def _six_bit(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """v float32 (nb, 8) >= 0 -> (binary16 super-scale bits (nb,), 6-bit codes (nb, 8)) with
    super * code ~ v."""
    top = v.max(axis=1) / np.float32(63)
    if not (top <= np.float32(np.finfo(np.float16).max)).all():
        raise ValueError("quantize_q4: a weight block's scale exceeds binary16 (|w| > ~6e7)")
    h = top.astype(np.float16)
    hv = h.astype(np.float32)
    codes = np.where(hv[:, None] > 0, np.rint(v / np.where(hv > 0, hv, 1)[:, None]), 0)
    return h.view(np.uint16), np.clip(codes, 0, 63).astype(np.uint8)


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """(sc, mn) u8 (nb, 8), 6 bits each -> the 12-byte field (inverse of gguf_blocks.k_scales_mins)."""
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 15) | ((mn[:, 4:8] & 15) << 4)
    return out


def _quantize_super_blocks(x: np.ndarray) -> np.ndarray:
    """x float32 (nb, 256) -> Q4_K blocks uint8 (nb, 144)."""
    nb = x.shape[0]
    a, b = _fit_sub_blocks(x.reshape(-1, SUB))
    d_bits, sc = _six_bit(a.reshape(nb, 8))
    m_bits, mn = _six_bit(b.reshape(nb, 8))
    d = d_bits.view(np.float16).astype(np.float32)
    dmin = m_bits.view(np.float16).astype(np.float32)
    scale = d[:, None] * sc.astype(np.float32)            # (nb, 8), as the dequantizer computes them
    shift = dmin[:, None] * mn.astype(np.float32)
    xs = x.reshape(nb, 8, SUB)
    inv = np.where(scale > 0, np.float32(1) / np.where(scale > 0, scale, 1), 0).astype(np.float32)
    q = np.clip(np.rint((xs + shift[..., None]) * inv[..., None]), 0, 15).astype(np.uint8)   # (nb, 8, 32)
    out = np.empty((nb, Q4_K.block_bytes), np.uint8)
    out[:, 0:2] = d_bits.view(np.uint8).reshape(nb, 2)
    out[:, 2:4] = m_bits.view(np.uint8).reshape(nb, 2)
    out[:, 4:16] = _pack_scales(sc, mn)
    pairs = q.reshape(nb, 4, 2, SUB)                      # sub-blocks 2c (low nibble), 2c + 1 (high)
    out[:, 16:144] = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(nb, 128)
    return out


def quantize_q4(w) -> np.ndarray:
    """w float (N, K) -> Q4_K blocks uint8 (N, Kp / 256 * 144), Kp = padded_k(K) (zero padding).

    Any float dtype is converted to float32; non-finite weights, or weights too large for
    binary16 super-scales (|w| > ~6e7), raise ValueError. numpy, in
    chunks of rows (a 151936 x 896 matrix: a few seconds per million rows' worth of 256-blocks).
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"quantize_q4 expects a 2-D matrix, got shape {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("quantize_q4: the matrix holds non-finite values")
    N, K = w.shape
    Kp = padded_k(K)
    nb_row = Kp // SUPER
    out = np.empty((N, nb_row * Q4_K.block_bytes), np.uint8)
    _chunked(w, out, Kp, _quantize_super_blocks)
    return out


def _chunked(w: np.ndarray, out: np.ndarray, Kp: int, quantize_blocks) -> None:
    """out[rows] = quantize_blocks(rows of w zero-padded to Kp, as (n, 256) super-blocks), in
    chunks of rows spread over the configured threads (numpy's array passes release the GIL:
    measured 0.5 M weights/s per thread for Q4_K on a loaded 2-core VM)."""
    from concurrent.futures import ThreadPoolExecutor

    from ..setup.numba_setup import configured_threads
    N, K = w.shape
    step = max(1, _ROWS_PER_CHUNK_VALUES // Kp)

    def one(r0: int) -> None:
        r1 = min(N, r0 + step)
        x = np.zeros((r1 - r0, Kp), np.float32)
        x[:, :K] = w[r0:r1]
        out[r0:r1] = quantize_blocks(x.reshape(-1, SUPER)).reshape(r1 - r0, -1)

    starts = list(range(0, N, step))
    workers = min(len(starts), max(1, configured_threads()))
    if workers <= 1:
        for r0 in starts:
            one(r0)
        return
    with ThreadPoolExecutor(workers) as pool:
        for f in [pool.submit(one, r0) for r0 in starts]:
            f.result()


def dequantize_q4_ref(blocks, N: int, K: int) -> np.ndarray:
    """numpy reference: quantize_q4's blocks of an (N, K) matrix -> float32 (N, K)."""
    return dequantize_ref(blocks, Q4_K, (N, padded_k(K)))[:, :K]


# ================================================================================================
# Q6_K (the tensors the q4 mix keeps at 6 bits)
# ================================================================================================

_SYMMETRIC_STEPS = np.linspace(0.0, 1.5, 8, dtype=np.float32)
"""Candidate grids of a symmetric block (Q6_K sub-block, Q5_0 block): its largest |x| mapped to
level -(2^(bits-1) - t) or 2^(bits-1) - 1 - t."""


def _fit_symmetric(x: np.ndarray, half: int) -> np.ndarray:
    """x float32 (M, n) -> signed scales a (M,): w ~ a q, q integer in -half..half - 1, least
    squares over the candidate grids of _SYMMETRIC_STEPS (Q6_K: half 32, Q5_0: half 16)."""
    peak = x[np.arange(x.shape[0]), np.abs(x).argmax(axis=1)]              # signed largest value
    live = peak != 0
    peak = np.where(live, peak, 1).astype(np.float32)
    levels = np.concatenate([-(half - _SYMMETRIC_STEPS), half - 1 - _SYMMETRIC_STEPS])   # (C,)
    a0 = peak[:, None] / levels[None, :]                                      # (M, C)
    q = np.clip(np.rint(x[:, None, :] / a0[..., None]), -half, half - 1)     # (M, C, n)
    sqq = (q * q).sum(-1)
    a = np.where(sqq > 0, (q * x[:, None, :]).sum(-1) / np.where(sqq > 0, sqq, 1), 0)
    err = ((a[..., None] * q - x[:, None, :]) ** 2).sum(-1)
    best = err.argmin(axis=1)
    return np.where(live, a[np.arange(x.shape[0]), best], 0).astype(np.float32)


def _quantize_q6_super_blocks(x: np.ndarray) -> np.ndarray:
    """x float32 (nb, 256) -> Q6_K blocks uint8 (nb, 210)."""
    nb = x.shape[0]
    a = _fit_symmetric(x.reshape(-1, 16), 32).reshape(nb, 16)
    peak = a[np.arange(nb), np.abs(a).argmax(axis=1)]                         # signed largest scale
    top = -peak / np.float32(128)                                             # its code is -128
    if not (np.abs(top) <= np.float32(np.finfo(np.float16).max)).all():
        raise ValueError("quantize_q6_k: a weight block's scale exceeds binary16 (|w| > ~2e8)")
    h = top.astype(np.float16)
    d = h.astype(np.float32)
    sc = np.where(d[:, None] != 0, np.rint(a / np.where(d != 0, d, 1)[:, None]), 0)
    sc = np.clip(sc, -128, 127).astype(np.int8)
    step = d[:, None] * sc.astype(np.float32)                                # (nb, 16) as dequantized
    inv = np.where(step != 0, np.float32(1) / np.where(step != 0, step, 1), 0).astype(np.float32)
    q = np.clip(np.rint(x.reshape(nb, 16, 16) * inv[..., None]), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(nb, 2, 4, 32)                              # (nb, half h, k, l)
    out = np.empty((nb, 210), np.uint8)
    low = q & 15
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
    out[:, 0:128] = ql.reshape(nb, 128)                                       # ql[64 h + 32 (k % 2) + l]
    high = q >> 4                                                             # 2 bits
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    out[:, 128:192] = qh.reshape(nb, 64)
    out[:, 192:208] = sc.view(np.uint8)
    out[:, 208:210] = h.view(np.uint8).reshape(nb, 2)
    return out


def quantize_q6_k(w) -> np.ndarray:
    """w float (N, K) -> Q6_K blocks uint8 (N, Kp / 256 * 210), Kp = padded_k(K) (zero padding)."""
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"quantize_q6_k expects a 2-D matrix, got shape {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("quantize_q6_k: the matrix holds non-finite values")
    N, K = w.shape
    Kp = padded_k(K)
    out = np.empty((N, Kp // SUPER * 210), np.uint8)
    _chunked(w, out, Kp, _quantize_q6_super_blocks)
    return out


def dequantize_q6_k_ref(blocks, N: int, K: int) -> np.ndarray:
    """numpy reference: quantize_q6_k's blocks of an (N, K) matrix -> float32 (N, K)."""
    return dequantize_ref(blocks, "Q6_K", (N, padded_k(K)))[:, :K]


# ================================================================================================
# Q5_0 and Q8_0 (the q4 mix's formats for rows that are not whole 256-weight super-blocks)
# ================================================================================================

def _blocks_of_32(w, name: str) -> tuple[np.ndarray, int, int]:
    """w float (N, K), K a multiple of 32 -> (float32 (N * K / 32, 32), N, K), checked."""
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % 32:
        raise ValueError(f"{name} expects a 2-D matrix with rows a multiple of 32, got shape {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError(f"{name}: the matrix holds non-finite values")
    if not (np.abs(w) <= np.float32(6e4)).all():
        raise ValueError(f"{name}: a weight's magnitude exceeds what a binary16 block scale can reach (6e4)")
    N, K = w.shape
    return w.reshape(-1, 32), N, K


def _fp16_scale(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Scales float32 (M,) -> (binary16 (M,), the same as float32)."""
    h = a.astype(np.float16)
    return h, h.astype(np.float32)


def quantize_q5_0(w) -> np.ndarray:
    """w float (N, K), K a multiple of 32 -> Q5_0 blocks uint8 (N, K / 32 * 22): per 32 weights
    w ~ d (q - 16), q 5 bits, d binary16. d by least squares over 16 candidate grids (the
    largest |x| mapped to level -(16 - t) or 15 - t), the quants rounded against the binary16 d
    as the dequantizer reads it. Weights already on a Q5_0 grid come back bit for bit."""
    x, N, K = _blocks_of_32(w, "quantize_q5_0")
    out = np.empty((x.shape[0], 22), np.uint8)
    step = _ROWS_PER_CHUNK_VALUES // 32
    for b0 in range(0, x.shape[0], step):
        xb = x[b0: b0 + step]                                               # (M, 32)
        M = xb.shape[0]
        h, dv = _fp16_scale(_fit_symmetric(xb, 16))
        inv = np.where(dv != 0, np.float32(1) / np.where(dv != 0, dv, 1), 0).astype(np.float32)
        qq = (np.clip(np.rint(xb * inv[:, None]), -16, 15) + 16).astype(np.uint8)   # (M, 32) 0..31
        o = out[b0: b0 + M]
        o[:, 0:2] = h.view(np.uint8).reshape(M, 2)
        o[:, 2:6] = np.packbits(qq >> 4, axis=1, bitorder="little")         # bit j: bit 4 of q[j]
        o[:, 6:22] = (qq[:, :16] & 15) | ((qq[:, 16:] & 15) << 4)
    return out.reshape(N, K // 32 * 22)


def quantize_q8_0(w) -> np.ndarray:
    """w float (N, K), K a multiple of 32 -> Q8_0 blocks uint8 (N, K / 32 * 34): per 32 weights
    w ~ d q, q int8 in -127..127, d = max |x| / 127 (binary16), q rounded against that d."""
    x, N, K = _blocks_of_32(w, "quantize_q8_0")
    h, dv = _fp16_scale(np.abs(x).max(axis=1) / np.float32(127))
    inv = np.where(dv != 0, np.float32(1) / np.where(dv != 0, dv, 1), 0).astype(np.float32)
    q = np.clip(np.rint(x * inv[:, None]), -127, 127).astype(np.int8)
    out = np.empty((x.shape[0], 34), np.uint8)
    out[:, 0:2] = h.view(np.uint8).reshape(-1, 2)
    out[:, 2:34] = q.view(np.uint8)
    return out.reshape(N, K // 32 * 34)
