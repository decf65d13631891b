"""An independent numpy forward pass of tinyllama_variant (float64), the reference the
conformance kit compares cpullm's f32 logits with. It shares no code with cpullm: it reads the
safetensors file and config.json itself."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np


def read_safetensors(path) -> dict:
    """name -> float64 array, for F32 / F16 / BF16 tensors."""
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        a, b = e["data_offsets"]
        buf = raw[8 + n + a: 8 + n + b]
        if e["dtype"] == "BF16":
            arr = (np.frombuffer(buf, np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            arr = np.frombuffer(buf, {"F32": np.float32, "F16": np.float16}[e["dtype"]])
        out[name] = arr.astype(np.float64).reshape(e["shape"])
    return out


def _rmsnorm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1.0 + w)


def _rope(x, pos, theta, head_dim):
    """x (T, heads, head_dim): rotate-half RoPE, the layout Hugging Face checkpoints use."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    ang = pos[:, None] * inv[None, :]
    cos = np.cos(np.concatenate([ang, ang], -1))[:, None, :]
    sin = np.sin(np.concatenate([ang, ang], -1))[:, None, :]
    half = head_dim // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


def reference_logits(model_dir, ids) -> np.ndarray:
    """(T, vocab) float32 logits of ``ids`` (default rope only, like the test configs)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    w = read_safetensors(Path(model_dir) / "model.safetensors")
    H, L, eps = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["rms_norm_eps"]
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nh
    hd = cfg.get("head_dim") or H // nh
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
    types = cfg.get("layer_types") or ["full_attention"] * L
    T = len(ids)
    pos = np.arange(T, dtype=np.float64)
    qi, ki = np.arange(T)[:, None], np.arange(T)[None, :]
    h = w["transformer.wte.weight"][np.asarray(ids)]
    for i in range(L):
        p = f"transformer.h.{i}."
        x = _rmsnorm(h, w[p + "ln_1.weight"], eps)
        q = _rope((x @ w[p + "attn.wq.weight"].T).reshape(T, nh, hd), pos, theta, hd)
        k = _rope((x @ w[p + "attn.wk.weight"].T).reshape(T, nkv, hd), pos, theta, hd)
        v = (x @ w[p + "attn.wv.weight"].T).reshape(T, nkv, hd)
        k, v = np.repeat(k, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1)
        allowed = ki <= qi
        if types[i] == "sliding_attention":
            allowed &= ki > qi - cfg["sliding_window"]
        scores = np.einsum("qhd,khd->hqk", q, k) * hd ** -0.5
        scores = np.where(allowed[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        att = np.einsum("hqk,khd->qhd", probs, v).reshape(T, nh * hd)
        h = h + att @ w[p + "attn.wo.weight"].T
        x = _rmsnorm(h, w[p + "ln_2.weight"], eps)
        gate, up = x @ w[p + "mlp.w1.weight"].T, x @ w[p + "mlp.w3.weight"].T
        h = h + (gate / (1.0 + np.exp(-gate)) * up) @ w[p + "mlp.w2.weight"].T
    head = w.get("lm_head.weight", w["transformer.wte.weight"])
    return (_rmsnorm(h, w["transformer.ln_f.weight"], eps) @ head.T).astype(np.float32)
