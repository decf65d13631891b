"""Routed experts (MOE): router -> top-k -> only the chosen experts' gated MLPs -> weighted sum,
plus an optional shared expert scaled by its own sigmoid gate (Qwen2-MoE / Qwen3.5-MoE).

    logits = x @ router.T                          (T, E), float32, ROUTER_LANES partial sums
                                                   a logit, in a fixed order (router_logits)
    routing ROUTE_SOFTMAX_TOPK: p = softmax(logits); the k largest p; weights = those p
            ROUTE_TOPK_SOFTMAX: the k largest logits; weights = softmax over those k
    norm_topk: weights /= their sum                (softmax-then-top-k families declare it)
    out[t] = sum_j weights[t, j] * down_e(act(gate_e(x[t])) * up_e(x[t]))   over j in rank order
           [+ sigmoid(x[t] . shared_gate) * down_s(act(gate_s(x[t])) * up_s(x[t]))]

Every expert matrix is stored like a LINEAR's (``table``: kind, offset, scale offset / ggml type,
Kp for gate, up and down of each expert, row E the shared expert) and multiplied by the LINEAR
kernels: q8 panels (``q8_panels.panels_matmul``, int16 activations), Q4_K / Q6_K panels
(``kquant_panels.matmul``), other raw ggml blocks row by row (``kquant.matvec``), float32
(``q8.matvec_f32``). The rows of a step are grouped by expert: each chosen expert's matrices are
read once for all the rows routed to it, and nothing of an expert no row chose is read. When the
chosen experts' matrices are all q8 or Q4_K / Q6_K panels (formats.many_at_once), every gate and
up goes through one parallel region and every down through another (formats.matmul_many): at
Qwen3-30B-A3B's shape three calls an expert had cost a 2-layer Q4_K_M decode 2.38 ms a token in
this op, against 1.81 ms with the router's lanes and the two regions (`cpullm bench --profile`,
Zen 4, 2 threads, the same memory rate). Each row's
activations are quantized on their own and the panel kernels compute every row as they would
alone, and a row's expert outputs are summed in its own rank order: a row's result does not depend
on the other rows of its batch (batched decode is bit-identical to decode alone).

``prm`` (int64): the operands, see the PRM_* names. ``counts`` (int64 (E + 1,)) receives how many
rows chose each expert (the shared expert: every row) so a caller can count the bytes it read.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..ops.elementwise import ACT_SILU, apply_act
from ..panels.kquant_panels import PANELED
from .formats import many_at_once, matmul_many, matmul_rows
from .program_table import WEIGHT_BLOCKS

ROUTE_SOFTMAX_TOPK = 0      # softmax over every expert, then the k largest (Qwen-MoE)
ROUTE_TOPK_SOFTMAX = 1      # the k largest logits, then softmax over them (Mixtral)
ROUTINGS = {"softmax_topk": ROUTE_SOFTMAX_TOPK, "topk_softmax": ROUTE_TOPK_SOFTMAX}

# prm columns
PRM_X_OFF, PRM_X_ST, PRM_OUT_OFF, PRM_OUT_ST = 0, 1, 2, 3
PRM_T = 4                   # rows this call runs (set per call)
PRM_H = 5                   # hidden width (input and output)
PRM_E = 6                   # routed experts
PRM_K = 7                   # experts per row
PRM_I = 8                   # a routed expert's intermediate width
PRM_SHARED_I = 9            # the shared expert's intermediate width, 0: none
PRM_ROUTING = 10            # ROUTE_*
PRM_NORM_TOPK = 11          # 1: renormalize the chosen weights to sum 1
PRM_ROUTER_OFF = 12         # router (E, H) float32 in wf
PRM_SHARED_GATE_OFF = 13    # shared expert gate (H,) in wf, -1: the shared expert is not gated
PRM_ACT = 14                # elementwise.ACT_*
NPRM = 15

# table columns: per matrix (kind, offset, scale offset or ggml type, Kp), gate, up, down
TABLE_GATE, TABLE_UP, TABLE_DOWN = 0, 4, 8
NTABLE = 12


@njit(cache=True)
def _matmul(wq, ws, wf, wb, kind, w_off, s_off, Kp, N, x, out, nthreads):
    """out (B, N) = x (B, K) @ W.T for one stored matrix (any weight format:
    formats.matmul_rows); each row's activations quantized on their own, exactly as the one-token
    decode quantizes them."""
    B = x.shape[0]
    xq = np.zeros(B * Kp, np.int16)
    xs = np.zeros(B * (Kp // 32) * 3, np.float32)
    matmul_rows(kind, w_off, s_off, Kp, N, wq, ws, wf, wb, wb, x, out, xq, xs, True, nthreads)


@njit(cache=True)
def _expert(wq, ws, wf, wb, table, e, inter, act, x, out, nthreads):
    """out (B, H) = down(act(gate(x)) * up(x)) of expert ``e`` (a row of ``table``) for rows x (B, H)."""
    B, H = x.shape
    g = np.empty((B, inter), np.float32)
    u = np.empty((B, inter), np.float32)
    row = table[e]
    _matmul(wq, ws, wf, wb, row[TABLE_GATE], row[TABLE_GATE + 1], row[TABLE_GATE + 2], row[TABLE_GATE + 3],
            inter, x, g, nthreads)
    _matmul(wq, ws, wf, wb, row[TABLE_UP], row[TABLE_UP + 1], row[TABLE_UP + 2], row[TABLE_UP + 3],
            inter, x, u, nthreads)
    for b in range(B):
        for j in range(inter):
            g[b, j] = apply_act(g[b, j], act) * u[b, j]
    _matmul(wq, ws, wf, wb, row[TABLE_DOWN], row[TABLE_DOWN + 1], row[TABLE_DOWN + 2], row[TABLE_DOWN + 3],
            H, g, out, nthreads)


ROUTER_LANES = 16
"""Partial sums of a router logit: lane l adds the products h = l mod 16 in order, then the lanes
meet in a fixed tree. Independent lanes vectorize without reordering any float step, so the bits
are the same on every ISA and for every batch. One sum in order waits an add latency per product:
Qwen3-30B-A3B's 128 x 2048 router took 0.21 ms a token and layer that way, 0.02-0.04 ms in
lanes split over 2 threads (Zen 4), where the whole op takes about 0.9 ms a layer (Q4_K_M)."""


@njit(cache=True, inline="always")
def _router_logit(w, x):
    """w (H,) . x (H,) as ROUTER_LANES partial sums (ROUTER_LANES docstring); float32."""
    H = x.shape[0]
    part = np.zeros(ROUTER_LANES, np.float32)
    full = H - H % ROUTER_LANES
    for h0 in range(0, full, ROUTER_LANES):
        for lane in range(ROUTER_LANES):
            part[lane] += w[h0 + lane] * x[h0 + lane]
    for h in range(full, H):
        part[h - full] += w[h] * x[h]
    width = ROUTER_LANES
    while width > 1:
        width //= 2
        for lane in range(width):
            part[lane] += part[lane + width]
    return part[0]


@njit(cache=True, parallel=True, error_model="numpy")
def router_logits(x, router, logits):
    """logits (T, E) = x (T, H) @ router (E, H).T, each logit alone (:func:`_router_logit`), the
    (row, expert) pairs split across threads (decode has one row and E of them)."""
    T = x.shape[0]
    E = router.shape[0]
    for i in prange(T * E):
        t = i // E
        e = i - t * E
        logits[t, e] = _router_logit(router[e], x[t])


@njit(cache=True, error_model="numpy")
def route(x, router, k, routing, norm_topk, idx, wts):
    """Rows x (T, H), router (E, H) -> idx int64 (T, k) the chosen experts in rank order (ties: the
    lower index first), wts float32 (T, k) their weights. Each row on its own, in a fixed order."""
    T = x.shape[0]
    E = router.shape[0]
    all_logits = np.empty((T, E), np.float32)
    router_logits(x, router, all_logits)
    for t in range(T):
        logits = all_logits[t]
        taken = np.zeros(E, np.bool_)
        for j in range(k):
            best = -1
            for e in range(E):
                if not taken[e] and (best < 0 or logits[e] > logits[best]):
                    best = e
            taken[best] = True
            idx[t, j] = best
        m = np.float64(logits[idx[t, 0]])       # the largest logit
        if routing == ROUTE_SOFTMAX_TOPK:
            denom = 0.0
            for e in range(E):
                denom += np.exp(np.float64(logits[e]) - m)
        else:
            denom = 0.0
            for j in range(k):
                denom += np.exp(np.float64(logits[idx[t, j]]) - m)
        chosen = 0.0
        for j in range(k):
            p = np.exp(np.float64(logits[idx[t, j]]) - m) / denom
            wts[t, j] = np.float32(p)
            chosen += p
        if norm_topk and routing == ROUTE_SOFTMAX_TOPK:
            for j in range(k):
                wts[t, j] = np.float32(np.exp(np.float64(logits[idx[t, j]]) - m) / denom / chosen)


@njit(cache=True)
def _all_at_once(table, counts, E, inter, H):
    """Whether the chosen experts' matrices can go through formats.matmul_many: every gate and up
    of one kind, Kp (and ggml type, for raw blocks), every down likewise, each taken by
    formats.many_at_once."""
    ref = -1
    for e in range(E):
        if counts[e] == 0:
            continue
        if ref < 0:
            ref = e
        for col in (TABLE_GATE, TABLE_UP, TABLE_DOWN):
            base = TABLE_DOWN if col == TABLE_DOWN else TABLE_GATE
            kind, s_off, Kp = table[e, col], table[e, col + 2], table[e, col + 3]
            if not many_at_once(kind, s_off, H if col == TABLE_DOWN else inter):
                return False
            if kind != table[ref, base] or Kp != table[ref, base + 3]:
                return False
            if kind == WEIGHT_BLOCKS and s_off != table[ref, base + 2]:
                return False
    return ref >= 0


@njit(cache=True)
def _chosen_at_once(wq, ws, wb, table, counts, start, pairs, x, k, inter, act, ys, nthreads):
    """Every chosen expert's gate and up in one formats.matmul_many, then every down in another:
    two thread starts a layer, not three an expert. ys (T k, H) by (row, rank), the numbers
    :func:`_expert` gives (each row quantized alone, the same kernels' rows)."""
    T, H = x.shape
    E = counts.shape[0] - 1
    P = T * k
    chosen = 0
    ref = -1
    for e in range(E):
        if counts[e] > 0:
            chosen += 1
            if ref < 0:
                ref = e
    one = T == 1                        # decode: every expert reads the one row
    if one:
        xr = x
    else:
        xr = np.empty((P, H), np.float32)
        for p in range(P):
            xr[p] = x[pairs[p] // k]
    mats = np.empty((2 * chosen, 7), np.int64)
    down = np.empty((chosen, 7), np.int64)
    i = 0
    for e in range(E):
        c = counts[e]
        if c == 0:
            continue
        for half in range(2):
            col = TABLE_GATE if half == 0 else TABLE_UP
            m = mats[2 * i + half]
            m[0], m[1], m[2] = table[e, col + 1], table[e, col + 2], inter
            m[3], m[4], m[5], m[6] = 0 if one else start[e], c, start[e], half * inter
        d = down[i]
        d[0], d[1], d[2] = table[e, TABLE_DOWN + 1], table[e, TABLE_DOWN + 2], H
        d[3], d[4], d[5], d[6] = start[e], c, start[e], 0
        i += 1
    kind, s_off, Kp = table[ref, TABLE_GATE], table[ref, TABLE_GATE + 2], table[ref, TABLE_GATE + 3]
    gu = np.empty((P, 2 * inter), np.float32)
    R = xr.shape[0]
    matmul_many(kind, s_off % PANELED, Kp, wq, ws, wb, mats, xr, gu, np.empty(R * Kp, np.int16),
                np.empty(R * (Kp // 32) * 3, np.float32), nthreads)
    h = np.empty((P, inter), np.float32)
    for p in range(P):
        for j in range(inter):
            h[p, j] = apply_act(gu[p, j], act) * gu[p, inter + j]
    kind, s_off, Kp = table[ref, TABLE_DOWN], table[ref, TABLE_DOWN + 2], table[ref, TABLE_DOWN + 3]
    y = np.empty((P, H), np.float32)
    matmul_many(kind, s_off % PANELED, Kp, wq, ws, wb, down, h, y, np.empty(P * Kp, np.int16),
                np.empty(P * (Kp // 32) * 3, np.float32), nthreads)
    for p in range(P):
        ys[pairs[p]] = y[p]


@njit(cache=True)
def moe(arena, prm, table, wq, ws, wf, wb, counts, nthreads):
    """The MOE op on rows [0, prm[PRM_T]) of its operands in the arena (module docstring)."""
    x_off, x_st, o_off, o_st = prm[PRM_X_OFF], prm[PRM_X_ST], prm[PRM_OUT_OFF], prm[PRM_OUT_ST]
    T, H, E, k, inter = prm[PRM_T], prm[PRM_H], prm[PRM_E], prm[PRM_K], prm[PRM_I]
    act = prm[PRM_ACT]
    x = np.empty((T, H), np.float32)
    for t in range(T):
        x[t] = arena[x_off + t * x_st: x_off + t * x_st + H]
    router = wf[prm[PRM_ROUTER_OFF]: prm[PRM_ROUTER_OFF] + E * H].reshape(E, H)
    idx = np.empty((T, k), np.int64)
    wts = np.empty((T, k), np.float32)
    route(x, router, k, prm[PRM_ROUTING], prm[PRM_NORM_TOPK] != 0, idx, wts)
    # group the (row, rank) pairs by expert, rows ascending
    for e in range(E + 1):
        counts[e] = 0
    for t in range(T):
        for j in range(k):
            counts[idx[t, j]] += 1
    start = np.zeros(E + 1, np.int64)
    for e in range(E):
        start[e + 1] = start[e] + counts[e]
    fill = start[:E].copy()
    pairs = np.empty(T * k, np.int64)               # t * k + j
    for t in range(T):
        for j in range(k):
            e = idx[t, j]
            pairs[fill[e]] = t * k + j
            fill[e] += 1
    ys = np.empty((T * k, H), np.float32)           # each (row, rank)'s expert output
    if _all_at_once(table, counts, E, inter, H):
        _chosen_at_once(wq, ws, wb, table, counts, start, pairs, x, k, inter, act, ys, nthreads)
    else:
        for e in range(E):
            c = counts[e]
            if c == 0:
                continue
            xg = np.empty((c, H), np.float32)
            for i in range(c):
                xg[i] = x[pairs[start[e] + i] // k]
            yg = np.empty((c, H), np.float32)
            _expert(wq, ws, wf, wb, table, e, inter, act, xg, yg, nthreads)
            for i in range(c):
                ys[pairs[start[e] + i]] = yg[i]
    shared_i = prm[PRM_SHARED_I]
    ysh = np.empty((T if shared_i > 0 else 0, H), np.float32)
    if shared_i > 0:
        counts[E] = T
        _expert(wq, ws, wf, wb, table, E, shared_i, act, x, ysh, nthreads)
    g_off = prm[PRM_SHARED_GATE_OFF]
    for t in range(T):
        o = arena[o_off + t * o_st: o_off + t * o_st + H]
        for h in range(H):
            o[h] = np.float32(0.0)
        for j in range(k):
            w = wts[t, j]
            y = ys[t * k + j]
            for h in range(H):
                o[h] += w * y[h]
        if shared_i > 0:
            gate = np.float32(1.0)
            if g_off >= 0:
                acc = np.float32(0.0)
                for h in range(H):
                    acc += wf[g_off + h] * x[t, h]
                gate = np.float32(1.0) / (np.float32(1.0) + np.exp(-acc))
            for h in range(H):
                o[h] += gate * ysh[t, h]


# ---- numpy reference ---------------------------------------------------------------------------

def moe_ref(x, router, experts, *, k: int, routing: str = "softmax_topk", norm_topk: bool = True,
            shared=None, shared_gate=None) -> np.ndarray:
    """float64 reference. x (T, H); router (E, H); experts: E tuples (gate (I, H), up (I, H),
    down (H, I)); shared: such a tuple or None; shared_gate (H,) or None. Returns (T, H)."""
    x = np.asarray(x, np.float64)
    logits = x @ np.asarray(router, np.float64).T
    out = np.zeros_like(x)

    def mlp(m, rows):
        g, u, d = (np.asarray(a, np.float64) for a in m)
        a = rows @ g.T
        return ((a / (1.0 + np.exp(-a))) * (rows @ u.T)) @ d.T

    for t in range(x.shape[0]):
        order = np.argsort(-logits[t], kind="stable")[:k]
        z = np.exp(logits[t] - logits[t].max())
        if routing == "softmax_topk":
            w = (z / z.sum())[order]
            if norm_topk:
                w = w / w.sum()
        else:
            w = z[order] / z[order].sum()
        for j, e in enumerate(order):
            out[t] += w[j] * mlp(experts[e], x[t: t + 1])[0]
    if shared is not None:
        ys = mlp(shared, x)
        if shared_gate is not None:
            ys = ys / (1.0 + np.exp(-(x @ np.asarray(shared_gate, np.float64))))[:, None]
        out += ys
    return out
