"""The KV cache's storage format: float16 (the default for quantized weights, as llama.cpp's
``--cache-type-k/-v f16``), float32 (the default for ``quant="f32"``, the reference runs) or
8-bit ``q8_0`` (llama.cpp's ``-ctk q8_0 -ctv q8_0``).

Why float16: on Llama 3.2 3B's shape (28 layers, 8 KV heads, head_dim 128) a token of context is
229 KB of float32 keys and values, so at 8k tokens decode reads 1.9 GB of KV per step beside
3.4 GB of INT8 weights; float16 halves that. The kernels widen float16 to float32 as they load
it (cpullm_kernels.attention.attention); softmax and sums stay float32. A float16 region keeps the float32
region's layout (cpullm_kernels.attention.attention.kv_views) in half the bytes: its ``floats`` in the
program's state plan count 4-byte units, each holding two float16 values.

``q8_0`` stores each (position, KV head) row of keys and of values as int8 with a float32
scale per 32 values (max |x| / 127 over the block, symmetric as ggml's Q8_0 block; the same
tiles and rows, then the scales: cpullm_kernels.attention.attention.kv_views_q8): head_dim + 4 *
ceil(head_dim / 32) bytes a row, 0.56x float16 at head_dim 64 and 128. Per-32 blocks rather
than one scale per row: Qwen2.5's keys carry a few channels far larger than the rest, and a
row's single scale follows them (benchmarks/kv_cache.py measures the KL of both, docs/kv-cache.md).
"""
from __future__ import annotations

import numpy as np

KV_DTYPES = ("f16", "f32", "q8_0")

Q8_LAYOUT = "q8_0/32"
"""The 8-bit layout's name in the execution cache's key: int8 with a scale per 32 values (the
first q8_0 layout, one scale per row, had no tag; its entries are not found, not misread)."""


def cache_key_name(kv_dtype: str) -> str:
    """What the execution cache's key records for a KV format: its name, or for q8_0 its layout."""
    return Q8_LAYOUT if kv_dtype == "q8_0" else kv_dtype


def resolve_kv_dtype(kv_dtype: str | None, quant: str) -> str:
    """The KV format to use: ``kv_dtype`` checked, or the default for ``quant`` (f32 weights keep
    a float32 cache, every quantized mode gets float16)."""
    from ..errors import ConfigError
    if kv_dtype is None:
        return "f32" if quant == "f32" else "f16"
    if kv_dtype not in KV_DTYPES:
        raise ConfigError(f"kv_dtype (--cache-type) must be one of {', '.join(KV_DTYPES)}, not {kv_dtype!r}")
    return kv_dtype


def format_code(kv_dtype: str) -> int:
    """The instruction table's ATTENTION_KV_FORMAT code of a format name (kernels.attention.KV_*)."""
    return {"f32": 0, "f16": 1, "q8_0": 2}[kv_dtype]


def format_name(code: int) -> str | None:
    """The format name of an ATTENTION_KV_FORMAT code, None for an unknown code."""
    return {0: "f32", 1: "f16", 2: "q8_0"}.get(int(code))


def region_format(reg: dict) -> str:
    """A ``meta["state_regions"]`` KV entry's format (older plans: float32)."""
    return reg.get("kv_dtype", "f32")


def region_is_f16(reg: dict) -> bool:
    """Whether a ``meta["state_regions"]`` KV entry stores float16 (older plans: float32)."""
    return region_format(reg) == "f16"


def q8_row_bytes(head_dim: int) -> int:
    """Bytes of one q8_0 row of a KV head: head_dim int8 values, then a float32 scale per 32."""
    from cpullm_kernels.attention.attention import q8_blocks
    return int(head_dim) + 4 * q8_blocks(head_dim)


def position_bytes(reg: dict) -> int:
    """Bytes one position takes in a KV region: its keys and values of every KV head (with
    their scales for q8_0)."""
    n_kv, hd = int(reg["n_kv_heads"]), int(reg["head_dim"])
    fmt = region_format(reg)
    if fmt == "q8_0":
        return 2 * n_kv * q8_row_bytes(hd)
    return 2 * n_kv * hd * (2 if fmt == "f16" else 4)


def region_floats(n_kv: int, cap: int, head_dim: int, kv_dtype: str) -> int:
    """4-byte units of a KV region of ``cap`` slots (keys and values; cap a multiple of 16)."""
    if kv_dtype == "q8_0":
        return n_kv * cap * q8_row_bytes(head_dim) // 2
    return (1 if kv_dtype == "f16" else 2) * n_kv * cap * head_dim


def numpy_dtype(reg: dict):
    """The element type of :func:`read_positions`' arrays for this region."""
    return {"f16": np.float16, "q8_0": np.int8}.get(region_format(reg), np.float32)


def read_positions(region: np.ndarray, reg: dict, lo: int, hi: int) -> np.ndarray:
    """A copy of the keys and values of positions [lo, hi) of one KV region (its flat float32
    memory ``region``), exactly as stored: (2, n_kv_heads, hi - lo, head_dim) float32 or
    float16; for q8_0 (2, n_kv_heads, hi - lo, q8_row_bytes(head_dim)) int8, each row's int8
    values then the bytes of its float32 scales, one per 32 values. The caller makes sure the
    region still holds them (hi - lo <= cap, hi <= the sequence's position)."""
    from cpullm_kernels.attention.attention import TILE, kv_views, kv_views_q8
    n_kv, cap, hd = reg["n_kv_heads"], reg["cap"], reg["head_dim"]
    slots = np.arange(lo, hi) % cap
    if region_format(reg) == "q8_0":
        k, v, ks, vs = kv_views_q8(region, n_kv, cap, hd)
        out = np.empty((2, n_kv, hi - lo, q8_row_bytes(hd)), np.int8)
        out[0, :, :, :hd] = k[:, slots // TILE, :, slots % TILE].transpose(1, 0, 2)
        out[1, :, :, :hd] = v[:, slots, :]
        kscales = ks[:, slots // TILE, :, slots % TILE].transpose(1, 0, 2)      # (n_kv, n, n_blocks)
        out[0, :, :, hd:] = np.ascontiguousarray(kscales).view(np.int8)
        out[1, :, :, hd:] = np.ascontiguousarray(vs[:, slots, :]).view(np.int8)
        return out
    k, v = kv_views(region, n_kv, cap, hd, region_is_f16(reg))
    keys = k[:, slots // TILE, :, slots % TILE]          # (n, n_kv, head_dim)
    return np.stack([keys.transpose(1, 0, 2), v[:, slots, :]])


def encode_q8(kv: np.ndarray) -> np.ndarray:
    """Float keys and values (2, n_kv, n, head_dim) as q8_0 rows (:func:`read_positions`' int8
    form), rounded as the kernels round them (cpullm_kernels.attention.attention.q8_rows_ref)."""
    from cpullm_kernels.attention.attention import q8_rows_ref
    q, scales = q8_rows_ref(kv)
    return np.concatenate([q, np.ascontiguousarray(scales).view(np.int8)], axis=-1)


def write_positions(region: np.ndarray, reg: dict, lo: int, kv: np.ndarray) -> None:
    """Put keys and values of positions [lo, lo + n) as :func:`read_positions` returns them
    into their ring slots. Float arrays of another float format are converted (rounded to
    nearest even into float16; into a q8_0 region quantized as the kernels do, :func:`encode_q8`);
    q8_0 rows go into a q8_0 region bit for bit."""
    from cpullm_kernels.attention.attention import TILE, kv_views, kv_views_q8
    n_kv, cap, hd = reg["n_kv_heads"], reg["cap"], reg["head_dim"]
    slots = np.arange(lo, lo + kv.shape[2]) % cap
    if region_format(reg) == "q8_0":
        row = q8_row_bytes(hd)
        if kv.dtype != np.int8 and kv.dtype.kind == "f" and kv.shape[3] == hd:
            kv = encode_q8(kv)
        if kv.dtype != np.int8 or kv.shape[3] != row:
            raise ValueError(f"a q8_0 KV region takes int8 rows of {row} bytes, not {kv.dtype} {kv.shape}")
        k, v, ks, vs = kv_views_q8(region, n_kv, cap, hd)
        k[:, slots // TILE, :, slots % TILE] = kv[0, :, :, :hd].transpose(1, 0, 2)
        v[:, slots, :] = kv[1, :, :, :hd]
        ks[:, slots // TILE, :, slots % TILE] = np.ascontiguousarray(kv[0, :, :, hd:]).view(np.float32).transpose(1, 0, 2)
        vs[:, slots, :] = np.ascontiguousarray(kv[1, :, :, hd:]).view(np.float32)
        return
    k, v = kv_views(region, n_kv, cap, hd, region_is_f16(reg))
    k[:, slots // TILE, :, slots % TILE] = kv[0].transpose(1, 0, 2)
    v[:, slots, :] = kv[1]
