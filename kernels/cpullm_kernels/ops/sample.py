"""A sampled token from one row of logits in three passes over the vocabulary, without sorting it.

The sampler (cpullm.generate.sampling) draws from ``softmax(x / T)`` after a top-k cut (the k largest
logits and their ties), a top-p cut (the smallest set of the likeliest tokens, likeliest first and
lower id first on ties, whose probabilities reach p) and a min-p cut (tokens at least min_p times
as likely as the likeliest). Done in numpy it sorts the whole vocabulary (an argsort of 152k
floats: ~10 ms, more than half a decode step of a 0.5B model on 2 cores) and makes a dozen
vocabulary-sized temporaries. Here:

1. the largest logit m (numpy's max);
2. every token's weight ``e = exp((x - m) / T)`` (stored) and their sum Z;
3. the smallest "head" ``(m - x) / T < L`` over the levels L = 1, 2, 4, ... 64 (one vectorized
   counting pass each, tried in turn; past 64, the whole vocabulary) that must hold every token a
   cut can keep: with top-k one holding at least k tokens; with top-p one whose weight reaches
   p Z. Only its tokens are collected and sorted (a few to a few thousand on a model's logits; a
   flat distribution whose top-p set spans most of the vocabulary still sorts most of it, as
   numpy's argsort did): they are the start of
   the vocabulary's order, since every token outside is strictly less likely than every token
   inside. The cuts are then made on the head exactly as on the whole sorted vocabulary
   (cumulative weights summed in sorted order). If rounding leaves the head's top-p sum just
   short of p Z (the level's weight was summed in another order), the next level is taken.

The draw: ``u`` (uniform in [0, 1), the caller's seeded generator) times the kept weight, and the
first kept token, in id order, whose running sum passes it (numpy's ``Generator.choice`` with
``p``: a cumulative sum in id order). Nothing is approximated in which tokens are kept or in their
relative probabilities except float arithmetic: ``exp`` is :func:`cpullm_kernels.ops.vmath.exp_f32`
(relative error < 4e-7) on float32 differences, sums in float64. A token below exp(-87) ~ 1e-38
of the likeliest one's probability gets weight 0 (float32's range; the float64 numpy path's limit
was 1e-308); a -inf logit (a banned or masked token) always weight 0.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ..setup import numba_setup  # noqa: F401  (code-generation settings first)
from .vmath import exp_f32

LEVELS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
"""How far below the top, in units of (m - x) / T, the candidate heads reach: the weight and count
of the tokens above each level are summed in the vectorized pass (no per-token histogram)."""

_EXP_FLOOR = np.float32(-87.0)

_FAST = {"nsz", "arcp", "contract", "afn", "reassoc"}   # no nnan/ninf: -inf logits are real


@njit(cache=True, fastmath=_FAST)
def _weights(x, m, inv_t, e):
    """Fills e (vocab,) float32 with exp((x - m) / T) (0 for -inf and below exp(-87)); returns
    their sum Z."""
    n = x.size
    mf = np.float32(m)
    tf = np.float32(inv_t)
    z = 0.0
    for i in range(n):                       # vectorized: no calls, selects only
        d = (x[i] - mf) * tf
        w = exp_f32(d)
        w = w if d >= _EXP_FLOOR else np.float32(0.0)
        e[i] = w
        z += w
    return z


@njit(cache=True, fastmath=_FAST)
def _above(x, m, inv_t, e, lim):
    """(count, weight) of the tokens with (m - x) / T < lim."""
    c = 0
    s = 0.0
    for i in range(x.size):
        inside = (m - np.float64(x[i])) * inv_t < lim
        c += 1 if inside else 0
        s += e[i] if inside else np.float32(0.0)
    return c, s


@njit(cache=True)
def _head(x, m, inv_t, e, nb):
    """Ids of the tokens with (m - x) / T < ``nb``, likeliest first (lower id first on ties)."""
    n = x.size
    cnt = 0
    for i in range(n):
        d = (m - np.float64(x[i])) * inv_t
        if d < nb:
            cnt += 1
    ids = np.empty(cnt, np.int64)
    j = 0
    for i in range(n):
        d = (m - np.float64(x[i])) * inv_t
        if d < nb:
            ids[j] = i
            j += 1
    neg = np.empty(cnt, np.float64)
    for j in range(cnt):
        neg[j] = -np.float64(x[ids[j]])
    order = np.argsort(neg, kind="mergesort")   # stable: lower id first on ties
    return ids[order]


def sample_logits(x, inv_t, top_k, top_p, min_p, u, e) -> int:
    """The token drawn from logits ``x`` (vocab,) float32 or float64, finite or -inf (the caller
    refuses NaN and +inf: cpullm.generate.sampling.check_finite_logits), at temperature 1 / ``inv_t``
    after the top-k (0: off), top-p (1: off) and min-p (0: off) cuts, with ``u`` uniform in
    [0, 1); ``e`` is float32 scratch (vocab,). -1 when every logit is -inf."""
    m = float(x.max())                  # numpy's vectorized max (a numba max loop is scalar)
    if m == -np.inf:
        return -1
    return int(_sample(x, m, float(inv_t), int(top_k), float(top_p), float(min_p), float(u), e))


@njit(cache=True)
def _sample(x, m, inv_t, top_k, top_p, min_p, u, e):
    n = x.size
    z = _weights(x, m, inv_t, e)
    cut_k = 0 < top_k < n
    if not cut_k and top_p >= 1.0:
        # every token stays: min-p keeps weights >= min_p (the top weight is 1)
        total = 0.0
        for i in range(n):
            if e[i] >= min_p:
                total += e[i]
        target = u * total
        acc = 0.0
        last = -1
        for i in range(n):
            if e[i] >= min_p and e[i] > 0.0:
                acc += e[i]
                last = i
                if acc > target:
                    return i
        return last
    # the level whose head holds every token a cut can keep (past the last: all of them)
    levels = np.array(LEVELS)
    nl = levels.size
    lv = nl
    for l in range(nl):                      # one vectorized pass per level tried
        c, w = _above(x, m, inv_t, e, levels[l])
        if (cut_k and c >= top_k) or (not cut_k and w >= top_p * z):
            lv = l
            break
    while True:
        head = _head(x, m, inv_t, e, levels[lv] if lv < nl else np.inf)
        h = head.size
        keep = h
        zk = z
        if cut_k and top_k <= h:            # (fewer finite logits than k: all of them stay)
            kth = x[head[top_k - 1]]
            keep = top_k
            while keep < h and x[head[keep]] >= kth:       # ties of the k-th logit stay
                keep += 1
            zk = 0.0
            for j in range(keep):
                zk += e[head[j]]
        if top_p < 1.0:
            acc = 0.0
            found = -1
            for j in range(keep):
                acc += e[head[j]]
                if acc >= top_p * zk:
                    found = j
                    break
            if found < 0 and not cut_k and lv < nl:
                lv += 1                                     # rounding: the next level
                continue
            if found >= 0:
                keep = found + 1
        break
    # min-p, then the draw over the kept tokens in id order
    kept = np.sort(head[:keep])
    total = 0.0
    for j in range(keep):
        w = e[kept[j]]
        if w >= min_p:
            total += w
    target = u * total
    acc = 0.0
    last = -1
    for j in range(keep):
        w = e[kept[j]]
        if w >= min_p and w > 0.0:
            acc += w
            last = kept[j]
            if acc > target:
                return kept[j]
    return last


def warm_up() -> None:
    """Compile (or load from numba's cache) the draw for float32 logits (the model's) and float64
    ones (after a mask, bias or penalty) now, rather than in a server's first sampled step, where
    it would stall every stream of the batch (a few seconds on a cold cache)."""
    for dtype in (np.float32, np.float64):
        x = np.zeros(4, dtype)
        sample_logits(x, 1.0, 2, 0.5, 0.0, 0.5, np.empty(4, np.float32))


# ================================================================================================
# a draw from a screened head: exact logits of some rows, upper bounds of the others
# ================================================================================================
#
# With an lm_head screen (cpullm_kernels.panels.head_screen.screen_upper) a sampled step knows
# every row's upper bound on its logit and computes exactly only the rows whose bound reaches a
# threshold ``thr`` (the candidates, given by :func:`band_rows`). :func:`sample_screened` returns
# the token :func:`sample_logits` would return on the full logits with the same ``u`` when the
# candidates prove it, else -1 (the caller lowers ``thr`` or reads the full head):
#
# * every other row's logit is below ``thr``, so the candidates at or above ``thr`` (P) are the
#   start of the vocabulary's order (likeliest first, lower id on ties), and the largest
#   candidate is the largest logit m (the caller keeps ``thr`` at or below the largest lower
#   bound);
# * top-k: proven when P holds the k-th logit (its ties too: they are >= thr);
# * top-p alone: the cut is the first j with acc_j >= p Z, Z the weight of the whole vocabulary.
#   The candidates' weights give Z from below, plus the others' weights at their upper bounds
#   from above; the cut is proven when one j lies in P with acc_(j-1) < p Z_lo and acc_j >= p Z_hi
#   (both widened by far more than float64 summation can move Z: 1e-9 relative, and the upper
#   weights by 1e-4 for float32 exp and the rounding of (x - m) / T);
# * min-p alone: proven when a row at ``thr`` is below min_p times the likeliest (it and every
#   other row are then cut).
#
# The weights, the kept tokens' order and the draw are computed by the same code on the same
# float32 logits (the screen's exact rows are the lm_head kernel's numbers bit for bit), so the
# token is the same, not merely as likely. Temperature alone (every token kept) cannot be screened.

SCREEN_Z_SLACK = 1e-9
SCREEN_W_SLACK = 1e-4


@njit(cache=True)
def band_rows(upper, lo, hi, rows, start):
    """Append to rows[start:] the rows n with lo <= upper[n] < hi, ascending; returns the new
    count, or -1 when an upper bound is NaN or +inf (such a row would be neither a candidate nor
    one of the others: the screen is of no use this step)."""
    c = start
    for n in range(upper.size):
        u = upper[n]
        if u != u or u == np.inf:
            return -1
        if lo <= u < hi:
            rows[c] = n
            c += 1
    return c


@njit(cache=True)
def rows_above(upper, top, width, nbins):
    """counts (nbins,) int64: counts[k] = how many rows have upper >= top - width (k + 1) (a
    cumulative histogram in one pass, from which a threshold holding about so many candidate
    rows is picked; :func:`band_rows` then takes exactly the rows at or above it)."""
    c = np.zeros(nbins, np.int64)
    for n in range(upper.size):
        d = (top - np.float64(upper[n])) / width
        if d < nbins:
            c[max(0, int(d))] += 1
    for k in range(1, nbins):
        c[k] += c[k - 1]
    return c


@njit(cache=True, fastmath=_FAST)
def _others_weight(upper, thr, m, inv_t):
    """Sum over the rows with upper < thr of exp((upper - m) / T): their weights' upper bound."""
    mf = np.float32(m)
    tf = np.float32(inv_t)
    z = 0.0
    for i in range(upper.size):
        d = min((upper[i] - mf) * tf, np.float32(0.0))
        w = exp_f32(d)
        z += w if np.float64(upper[i]) < thr else np.float32(0.0)   # as band_rows compares
    return z


def screen_can_sample(top_k, top_p, min_p, vocab) -> bool:
    """True when a draw with these cuts can come from a screened head (some cut leaves tokens out)."""
    return 0 < top_k < vocab or top_p < 1.0 or min_p > 0.0


@njit(cache=True)
def sample_screened(rows, vals, count, upper, thr, inv_t, top_k, top_p, min_p, u, e):
    """The token :func:`sample_logits` draws from the full logits with the same arguments, from the
    exact logits vals[:count] of rows[:count] (every row with upper >= thr, none other) and the
    upper bounds ``upper`` (vocab,) of all rows; -1 when these rows do not prove it. ``thr`` is at
    or below the largest lower bound; ``e`` float32 scratch (>= count)."""
    n = upper.size
    if count == 0:
        return -1
    xc = vals[:count]
    m = -np.inf
    for j in range(count):
        v = np.float64(xc[j])
        if v != v:
            return -1
        m = max(m, v)
    if m == -np.inf or m < thr:
        return -1
    ec = e[:count]
    zc = _weights(xc, m, inv_t, ec)
    # candidates in the vocabulary's order: by id, then likeliest first (stable: lower id on ties)
    by_id = np.argsort(rows[:count])
    neg = np.empty(count, np.float64)
    for j in range(count):
        neg[j] = -np.float64(xc[by_id[j]])
    order = by_id[np.argsort(neg, kind="mergesort")]
    hp = 0                                   # P: the candidates at or above thr
    while hp < count and np.float64(xc[order[hp]]) >= thr:
        hp += 1
    cut_k = 0 < top_k < n
    if not cut_k and top_p >= 1.0:
        if not min_p > 0.0:
            return -1
        w_thr = np.exp(min((thr - m) * inv_t, 0.0)) * (1.0 + SCREEN_W_SLACK)
        if w_thr >= min_p:
            return -1
        return _draw_in_id_order(rows, ec, by_id, count, min_p, u)
    keep = hp
    if cut_k:
        if top_k > hp:
            return -1
        kth = xc[order[top_k - 1]]
        keep = top_k
        while keep < hp and xc[order[keep]] >= kth:
            keep += 1
        zk = 0.0
        for j in range(keep):
            zk += ec[order[j]]
        if top_p < 1.0:
            acc = 0.0
            for j in range(keep):
                acc += ec[order[j]]
                if acc >= top_p * zk:
                    keep = j + 1
                    break
    else:
        z_lo = zc * (1.0 - SCREEN_Z_SLACK)
        z_hi = (zc + _others_weight(upper, thr, m, inv_t) * (1.0 + SCREEN_W_SLACK)) * (1.0 + SCREEN_Z_SLACK)
        acc = 0.0
        found = -1
        for j in range(hp):
            prev = acc
            acc += ec[order[j]]
            if acc >= top_p * z_hi:
                if prev >= top_p * z_lo and j > 0:
                    return -1                  # the cut could be at an earlier token
                found = j
                break
            if acc >= top_p * z_lo:
                return -1                      # the cut could be here or later: not proven
        if found < 0:
            return -1
        keep = found + 1
    kept = order[:keep]                        # positions in rows/vals, drawn in id order
    by = np.argsort(rows[:count][kept])
    return _draw_in_id_order(rows, ec, kept[by], keep, min_p, u)


@njit(cache=True)
def _draw_in_id_order(rows, ec, idx, k, min_p, u):
    """The draw of :func:`_sample` over the tokens rows[idx[:k]] (ascending ids) of weights ec[idx]."""
    total = 0.0
    for j in range(k):
        w = ec[idx[j]]
        if w >= min_p:
            total += w
    target = u * total
    acc = 0.0
    last = -1
    for j in range(k):
        w = ec[idx[j]]
        if w >= min_p and w > 0.0:
            acc += w
            last = rows[idx[j]]
            if acc > target:
                return rows[idx[j]]
    return last
