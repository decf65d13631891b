"""The head screen (kernels/cpullm_kernels/panels/head_screen.py) for an lm_head stored as raw ggml blocks.

``--quant q4`` stores the lm_head as Q6_K (llama.cpp's Q4_K_M does too): 215 MB of a
Llama-3.2-1B-shaped model's ~700 a token, 191 of the ~980 MB of a Qwen2.5-1.5B shape (7.2 of
~34 ms). The screen is the same compact copy (int8 for the k_sel selected columns, 4-bit for the
rest, binary16 block scales; (hq, hs, hb) as in kernels/cpullm_kernels/panels/head_screen.py) and the same bounds pass;
what changes is the exact path it must reproduce, kquant.matvec, and so the bound.

The exact path. ``formats.matmul_rows`` quantizes the lm_head's input x (K,) with
``kquant.quantize_act_q8``: x_q int8 (Kp,) (zero past K), x_s float32 per block of 32 (max|v| /
127), x_m float32 per 16 (x_s times the exact integer sum); the logit of row n is
``kq_row_dot(w, x_q, x_s, x_m, n, fmt, BEST_ISA)``, the row routine of ``kquant.matvec``. The
screen computes its survivors with that very routine on the same three arrays, so its token is
``argmax(kquant.matvec(...))`` bit for bit (lowest index on ties), never an approximation.

The bound. Per row let w be the exact dequantized row (real arithmetic) split as the matvec
multiplies it, w = s + c (gguf_blocks.dequantize_parts_ref: scaled unsigned quants and the
offset it adds through x_m, e.g. Q6_K s = d sc q, c = -32 d sc), m = |s| + |c| elementwise,
v the compact row, x' = x_q * x_s (real) what the matvec reads, xp the permuted x' in float32
(each |xp - x'| <= 2^-24 |x'|) and p what the compact dot reads (xp re-quantized: int16 on the
k_sel columns, int8 on the rest). E the matvec's float32 result, A the compact dot's. Then

    |E - A| <= |E - w.x'| + |(w - v).x'| + |v.(x' - p)| + |v.p - A|
            <= g_E |m| |x'| + E_sel |x'_sel| + E_rest |x'_rest| + |v| (|x' - xp| + |xp - p|) + g_A |v| |p|

with g_E, g_A the float32 rounding of the two dot products: the matvec's integer lane sums are
exact (|q| <= 63, |x_q| <= 127), each term (a lane's sum times its factor d sc x_s, or an offset
c times a block sum of x_m) passes at most nb + 10 roundings for nb = Kp / 32 blocks (its factor,
fmuladd chains of nb / 2 steps per accumulator, twice that if not fused, the horizontal sums),
so |E - w.x'| <= (nb + 11) 2^-24 sum |terms| <= (nb + 11) 2^-24 |m| |x'|; the compact dot is
within (nb + 8) 2^-24 |v| |p| (head_screen.py), twice that unfused. |m| is ~4.4x |w| on a Q6_K
row of Gaussian weights (the offset -32 d sc cancels most of d sc q), so it is not made to
multiply the much larger delta term below: with X = |xp|, X_sel, X_rest its norms on the two
column sets (X_sel + X_rest >= X),

    |E - w.x'| <= rho_E |m| (X_sel + X_rest),   rho_E = (nb + 16) 2^-23,

so hb holds E_sel + rho_E |m|, E_rest + rho_E |m| (the bound's first two terms take it) and
W = max(|w|, |v|), each rounded up, from float64 rows whose only rounding (s + c) is below 2^-53 m.
The step computes, in float64 from xp and p,

    delta = |xp - p|,   extra = delta + rho (X + delta),   rho = (nb + 16) 2^-22

and the bounds pass's bound = (hb0 X_sel + hb1 X_rest + W extra) (1 + 2^-10). rho is 4 (nb + 16)
2^-24: it covers g_A (<= (2 nb + 16) 2^-24 unfused), |x' - xp| (2^-24 X), the float32 rounding
of p's products and of A +- bound on |A| (|p| <= X + delta); the factor 1 + 2^-10 the bound's own
float32 arithmetic and the float64 norms. Rows whose upper bound is below the largest lower
bound cannot be the argmax.

Underflow and overflow are kept out rather than bounded: a step whose activations are not all
finite, or whose block scales x_s are not all zero or within [2^-40, 2^40], returns -1 (the
caller runs the full head), and hb values below 2^-64 are raised to it, so every product of the
bound and of both dots stays a normal float32.

What it buys: the copy is 73-78 % of a Q6_K head's bytes (1228 of 1680 bytes a row at K 2048,
940 of 1260 at K 1536), against 56 % of a q8 head's. Qwen2.5-Coder-0.5B's real head quantized to
Q6_K (rows padded to 1024) with the model's own greedy lm_head inputs: median 8 of 151936 rows
left to compute exactly, 99.1 of 127.6 MB read a step, 0.89-0.955x the full head's time (paired
per step; benchmarks/results/2026-12-04-q4-head-screen.md).

Which programs get one (core/cpullm/compile/head_screen.py): ``quant="q4"`` programs whose lm_head is a
raw-block LINEAR of a format in SCREEN_FORMATS (Q6_K; a Q8_0 head of rows that are not whole
super-blocks is held in q8's layout and takes the q8 screen) stored row by row, i.e. a vocabulary
that is not a multiple of 16: a Q6_K head of whole 16-row panels is stored in
kernels/cpullm_kernels/panels/kquant_panels.py's layout, whose full read beats this screen (a 1.24B model's panel head
takes 0.8x the time of kquant.matvec's, and the screen saves only 5-11 % of the latter). A GGUF file run as it is gets none
by default: its resident weights stay within 5 % of the file's tensor bytes, and a screen adds
56-78 % of the head's.

Kernels:

    build_screen_blocks(w, fmt, Kp, perm, k_sel) -> (hq, hs, hb)        numpy, at compile time
    screen_argmax_blocks(x, perm, sel_blocks, hq, hs, hb, w, fmt, scratch..., nthreads, max_rows)
        -> (token, survivors) as head_screen.screen_argmax: -1 non-finite / out-of-range
        activations or bounds, -2 more than max_rows survivors (run the full head)

with numpy references ``screen_bounds_blocks_ref`` and ``screen_argmax_blocks_ref``
(tests/test_head_screen_blocks.py).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..rows.gguf_blocks import block_format, dequantize_parts_ref
from .head_screen import (ROUNDING_MARGIN, ROW_PREFETCH, build_screen_rows, permuted_bounds, prefetch_row,
                          rounding_term, screen_activations_ref, screen_dots_ref)
from ..rows.kquant import BEST_ISA, kq_row_dot, quantize_act_q8, quantize_act_q8_ref
from ..rows.q8 import QBLOCK

_ISA = BEST_ISA
"""The ISA of kquant.matvec's row routine (``kquant.matvec`` is ``MATVECS[BEST_ISA]``)."""

SCALE_MIN, SCALE_MAX = 2.0 ** -40, 2.0 ** 40
"""Activation block scales a screened step accepts (zero blocks aside); else the full head."""
HB_FLOOR = 2.0 ** -64
"""hb values are at least this (raising a bound is always safe): no subnormal products."""


def exact_rounding(Kp: int) -> float:
    """rho_E of the module docstring: the matvec's float rounding per unit of |m| (X_sel + X_rest)."""
    return (Kp // QBLOCK + 16) * 2.0 ** -23


def build_screen_blocks(w, fmt, Kp: int, perm, k_sel: int, rows_per_chunk: int | None = None):
    """(hq, hs, hb) of the raw-block matrix w uint8 (N, row bytes) of format ``fmt`` (Kp weights a
    row) with columns ``perm`` (k_sel at 8 bits), from float64 rows dequantized a chunk at a time
    (~8 MB per temporary; never the whole matrix). Both error norms carry rho_E ||s| + |c|| (the
    matvec's float rounding: module docstring). Raises ValueError when a row is not finite (a
    file's inf / nan scales)."""
    fmt = block_format(fmt)
    N = w.shape[0]
    if w.shape[1] != fmt.row_bytes(Kp):
        raise ValueError(f"build_screen_blocks: rows of {w.shape[1]} bytes are not {Kp} {fmt.name} weights")

    def exact_rows(n0, n1):
        with np.errstate(invalid="ignore", over="ignore"):       # non-finite rows: raised below
            s, c = dequantize_parts_ref(w[n0:n1], fmt, (n1 - n0, Kp))
            exact = s + c
            m = np.add(np.abs(s, out=s), np.abs(c, out=c), out=s)            # |s| + |c|, in place
            mags = np.sqrt(np.einsum("ij,ij->i", m, m))
        if not (np.isfinite(exact).all() and np.isfinite(mags).all()):
            raise ValueError(f"build_screen_blocks: rows {n0}..{n1} hold non-finite weights")
        return exact, exact_rounding(Kp) * mags
    hq, hs, hb = build_screen_rows(exact_rows, N, Kp, perm, k_sel, rows_per_chunk)
    np.maximum(hb, np.float32(HB_FLOOR), out=hb)
    return hq, hs, hb


# ================================================================================================
# numpy reference
# ================================================================================================

def _exact_activations_ref(x, Kp):
    """(x_q int8 (Kp,), x_s (Kp//32,), x_m (Kp//16,)) as formats.matmul_rows builds them (zero past K)."""
    K = x.size
    q, s, m = quantize_act_q8_ref(x)
    x_q, x_s, x_m = np.zeros(Kp, np.int8), np.zeros(Kp // 32, np.float32), np.zeros(Kp // 16, np.float32)
    x_q[:K], x_s[:K // 32], x_m[:K // 16] = q, s, m
    return x_q, x_s, x_m


def screen_bounds_blocks_ref(x, perm, k_sel: int, hq, hs, hb):
    """(approx (N,), bound (N,), (x_q, x_s, x_m)) in float64 as the kernel defines them; bound None
    when the kernel would fall back (activations not finite, block scales out of range)."""
    Kp = perm.size
    if not np.isfinite(np.asarray(x, np.float32)).all():
        return None, None, (None, None, None)
    x_q, x_s, x_m = _exact_activations_ref(np.asarray(x, np.float32), Kp)
    nz = x_s[x_s != 0]
    if not np.all((nz >= SCALE_MIN) & (nz <= SCALE_MAX)):
        return None, None, (x_q, x_s, x_m)
    xd = (x_q.reshape(-1, QBLOCK).astype(np.float32) * x_s[:, None]).reshape(-1)      # float32, as the kernel
    xp = xd[perm]
    p_q, p_s = screen_activations_ref(xp, k_sel)
    pd = (p_q.reshape(-1, QBLOCK).astype(np.float32) * p_s[:, None]).reshape(-1)
    xp64 = xp.astype(np.float64)
    n_sel = np.sqrt((xp64[:k_sel] ** 2).sum())
    n_rest = np.sqrt((xp64[k_sel:] ** 2).sum())
    delta = np.sqrt(((xp64 - pd.astype(np.float64)) ** 2).sum())
    extra = delta + rounding_term(Kp) * (np.sqrt(n_sel ** 2 + n_rest ** 2) + delta)
    hb64 = hb.astype(np.float64)
    bound = (hb64[:, 0] * n_sel + hb64[:, 1] * n_rest + hb64[:, 2] * extra) * ROUNDING_MARGIN
    return screen_dots_ref(hq, hs, p_q, p_s, k_sel), bound, (x_q, x_s, x_m)


def screen_argmax_blocks_ref(x, perm, k_sel: int, hq, hs, hb, w, fmt):
    """numpy reference: (argmax of the float64 raw-block logits found through the screen, survivors),
    or (-1, 0) where the kernel falls back."""
    from ..rows.kquant import matvec_ref
    approx, bound, (x_q, x_s, _) = screen_bounds_blocks_ref(x, perm, k_sel, hq, hs, hb)
    if bound is None:
        return -1, 0
    lower = (approx - bound).max()
    keep = np.nonzero(approx + bound >= lower)[0]
    Kp = perm.size
    exact = matvec_ref(w[keep], fmt, (keep.size, Kp), x_q, x_s)
    return int(keep[np.argmax(exact)]), keep.size


# ================================================================================================
# numba kernels
# ================================================================================================

SCREEN_FORMATS = (14,)
"""ggml types whose heads a screen reads: Q6_K, ``--quant q4``'s head (and the head of llama.cpp's
K-quant mixes). The bound holds for every kquant format (tests/test_head_screen_blocks.py checks
all eight), but each row routine compiled into the screen costs cold-start time (the screen
kernel compiles in 10 s with all eight, 7-8 s with one); any other format
returns -1 (the full head), and core/cpullm/compile/head_screen.py gives it no screen."""


@njit(cache=True, inline="always")
def _row_logit(fmt, w, x_q, x_s, x_m, n):
    """kquant.matvec's value of row n of a Q6_K matrix: the same row routine (format and ISA
    compile-time constants)."""
    return kq_row_dot(w, x_q, x_s, x_m, n, 14, _ISA)


@njit(cache=True, parallel=True)
def _exact_rows_blocks(fmt, w, x_q, x_s, x_m, rows, vals, counts, nthreads):
    """vals[i] = kquant.matvec's logit of row rows[i] for each thread's survivors (head_screen._exact_rows)."""
    N = rows.size
    per = (N + nthreads - 1) // nthreads
    for t in prange(nthreads):
        lo = min(N, t * per)
        end = lo + counts[t]
        for i in range(lo, end):
            if i + ROW_PREFETCH < end:
                prefetch_row(w, rows[i + ROW_PREFETCH])
            vals[i] = _row_logit(fmt, w, x_q, x_s, x_m, rows[i])


@njit(cache=True)
def screen_argmax_blocks(x, perm, sel_blocks, hq, hs, hb, w, fmt, x_q, x_s, x_m, p_q, p_s, xp,
                         upper, rows, vals, lower_max, counts, nthreads, max_rows):
    """(token, survivors): the argmax (lowest index on ties) of ``kquant.matvec(fmt, w, ...)`` on
    the activations x as ``formats.matmul_rows`` quantizes them, found through the screen; (-1, 0)
    when fmt is not one of SCREEN_FORMATS, the activations are not finite or their block scales
    out of range, or the bounds are not finite, (-2, survivors)
    when more than ``max_rows`` rows survive: the caller then runs the full lm_head.

    x float32 (K,); perm int64 (Kp,); w uint8 (N, row bytes) the raw blocks, fmt their ggml type;
    scratch: x_q int8 (Kp,), x_s float32 (Kp//32,), x_m float32 (Kp//16,), p_q int16 (Kp,),
    p_s float32 (padded_blocks(Kp),), xp float32 (Kp,), upper float32 (N,), rows int64 (N,),
    vals float32 (N,), lower_max float32 / counts int64 (>= nthreads,).
    """
    if fmt != 14:                                       # SCREEN_FORMATS
        return -1, 0
    K = x.size
    Kp = perm.size
    nb = Kp // QBLOCK
    for j in range(K):                                  # a NaN would not show in the block scales
        if not np.isfinite(x[j]):
            return -1, 0
    for j in range(K, Kp):                              # exactly what the matvec reads
        x_q[j] = 0
    for j in range(K // 32, nb):
        x_s[j] = 0.0
    for j in range(K // 16, Kp // 16):
        x_m[j] = 0.0
    quantize_act_q8(x, x_q[:K], x_s[:K // 32], x_m[:K // 16])
    for i in range(nb):
        s = x_s[i]
        if s != 0.0 and not (s >= SCALE_MIN and s <= SCALE_MAX):
            return -1, 0
    for k in range(Kp):
        c = perm[k]
        xp[k] = np.float32(x_q[c]) * x_s[c // QBLOCK]
    lower = permuted_bounds(xp, p_q, p_s, sel_blocks, hq, hs, hb, True, upper, lower_max, nthreads)
    if not np.isfinite(lower):
        return -1, 0
    _survivor_rows_ge(upper, lower, rows, counts, nthreads)
    total = 0
    for t in range(nthreads):
        total += counts[t]
    if total > max_rows:
        return -2, total
    _exact_rows_blocks(fmt, w, x_q, x_s, x_m, rows, vals, counts, nthreads)
    N = upper.size
    per = (N + nthreads - 1) // nthreads
    best, best_v = -1, np.float32(0.0)
    for t in range(nthreads):                           # rows ascending: strict > keeps the lowest index
        lo = min(N, t * per)
        for i in range(lo, lo + counts[t]):
            v = vals[i]
            if best < 0 or v > best_v or (np.isnan(v) and not np.isnan(best_v)):
                best, best_v = rows[i], v
    return best, total


@njit(cache=True, parallel=True)
def _survivor_rows_ge(upper, lower, rows, counts, nthreads):
    """head_screen._survivor_rows, except that a row whose upper bound is NaN survives too."""
    N = upper.size
    per = (N + nthreads - 1) // nthreads
    for t in prange(nthreads):
        lo = min(N, t * per)
        hi = min(N, lo + per)
        c = 0
        for n in range(lo, hi):
            if not upper[n] < lower:
                rows[lo + c] = n
                c += 1
        counts[t] = c
