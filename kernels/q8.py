"""INT8 (q8 block-32) linear kernels: baseline plain-numba version with numpy references."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

BLOCK = 32


def quantize_weight_q8(w):
    N, K = w.shape
    Kp = (K + 31) // 32 * 32
    wp = np.zeros((N, Kp), np.float32)
    wp[:, :K] = w
    blocks = wp.reshape(N, Kp // 32, 32)
    amax = np.abs(blocks).max(-1)
    scale = (amax / 127.0).astype(np.float32)
    inv = np.where(scale > 0, 1.0 / np.where(scale > 0, scale, 1), 0).astype(np.float32)
    q = np.rint(blocks * inv[..., None]).astype(np.int8).reshape(N, Kp)
    return q, scale


def dequantize_weight_q8(w_q, w_s):
    N, Kp = w_q.shape
    return (w_q.reshape(N, Kp // 32, 32).astype(np.float32) * w_s[..., None]).reshape(N, Kp)


@njit(cache=True)
def quantize_act_q8(x, x_q, x_s):
    K = x.size
    nb = x_q.size // 32
    for b in range(nb):
        amax = np.float32(0.0)
        for j in range(32):
            i = b * 32 + j
            if i < K:
                a = abs(x[i])
                if a > amax:
                    amax = a
        s = amax / np.float32(127.0)
        x_s[b] = s
        inv = np.float32(1.0) / s if s > 0 else np.float32(0.0)
        for j in range(32):
            i = b * 32 + j
            x_q[i] = np.int8(np.rint(x[i] * inv)) if i < K else np.int8(0)


@njit(cache=True, parallel=True, fastmath=True)
def matvec_q8(w_q, w_s, x_q, x_s, out):
    N, Kp = w_q.shape
    nb = Kp // 32
    for n in prange(N):
        acc = np.float32(0.0)
        for b in range(nb):
            t = np.int32(0)
            for j in range(32):
                t += np.int32(w_q[n, b * 32 + j]) * np.int32(x_q[b * 32 + j])
            acc += np.float32(t) * w_s[n, b] * x_s[b]
        out[n] = acc


@njit(cache=True, parallel=True, fastmath=True)
def matvec_f32(w, x, out):
    N, K = w.shape
    for n in prange(N):
        acc = np.float32(0.0)
        for k in range(K):
            acc += w[n, k] * x[k]
        out[n] = acc


def matmul_q8(x, w_q, w_s, out):
    T, K = x.shape
    w = dequantize_weight_q8(w_q, w_s)[:, :K]
    np.matmul(x, w.T, out=out)


def matmul_f32(x, w, out):
    np.matmul(x, w.T, out=out)
