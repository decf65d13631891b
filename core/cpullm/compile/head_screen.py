"""Greedy decoding's lm_head screen, as one stage after compiling: whether a program gets one
(:func:`head_screen_row`), packing it into the program (:func:`attach`, its kept columns chosen from
the lm_head inputs of :data:`HEAD_CALIBRATION_TEXT`), and the executor's runtime view of it
(:class:`HeadScreen`: which head each greedy step reads). The kernels are
:mod:`cpullm_kernels.panels.head_screen`'s (a q8 lm_head) and :mod:`cpullm_kernels.panels.head_screen_blocks`'s
(an lm_head of raw ggml blocks: ``quant="q4"``'s Q6_K). Which programs get one is the caller's
choice (core/cpullm/model.py): int8 and q4 programs, not a GGUF file run as it is (its resident weights
stay within 5 % of the file's tensor bytes; a screen adds 56-78 % of the head's).
"""
from __future__ import annotations

from collections import deque

import numba
import numpy as np

from .compiler import Program, align_up
from cpullm_kernels.program import program_table as P
from cpullm_kernels.program.formats import FORMATS, weight_format
from cpullm_kernels.panels.head_screen import padded_blocks, screen_argmax
from cpullm_kernels.panels.q8_panels import padded_rows

HEAD_CALIBRATION_TEXT = (
    "The history of computing is a story of ideas that became machines. Early calculators could "
    "add and subtract; later designs stored programs in memory, and compilers turned readable "
    "instructions into code. Today a small language model runs on an ordinary laptop.\n\n"
    "Question: What is the capital of France, and why is it famous?\nAnswer: Paris is the capital "
    "of France. It is known for the Eiffel Tower, the Louvre, its cafés and its long history.\n\n"
    "def fibonacci(n: int) -> list[int]:\n    \"\"\"Return the first n Fibonacci numbers.\"\"\"\n"
    "    out, a, b = [], 0, 1\n    for _ in range(n):\n        out.append(a)\n        a, b = b, a + b\n"
    "    return out\n\nprint(fibonacci(10))  # [0, 1, 1, 2, 3, 5, 8, 13, 21, 34]\n\n"
    "Once upon a time, in a village by the sea, there lived an old fisherman and his cat. Every "
    "morning they walked to the harbour together, and every evening they came home with a story."
)
"""Text whose lm_head inputs choose the columns the head screen keeps at 8 bits (compile time only;
it changes how many rows greedy steps recompute exactly, never which token they return)."""


def head_screen_row(program: Program) -> int | None:
    """The instruction a head screen replaces in greedy decoding: the program's last one, if it is
    a LINEAR of the head over q8 weights or raw ggml blocks of a format in
    ``head_screen_blocks.SCREEN_FORMATS`` (Q6_K), without bias or plugin kernel (its output is then
    the logits), of at least ``head_screen.MIN_LM_HEAD_BYTES``; else None."""
    from cpullm_kernels.panels import head_screen
    I = program.I
    r = len(I) - 1
    if (I[r, P.COL_OP] != P.OP_LINEAR or I[r, P.COL_IMPL] != P.IMPL_INTERPRETER
            or I[r, P.COL_SECTION] != P.SECTION_HEAD):
        return None
    lin = P.linear_operands(I[r])
    if (_screen(lin) is None or lin.bias_off >= 0
            or lin.kp > 32 * head_screen.MAX_BLOCKS or lin.kp < 64):
        return None
    if lin.n * row_bytes(lin) < head_screen.MIN_LM_HEAD_BYTES:
        return None
    return r


def _screen(lin) -> str | None:
    """Which screen reads this LINEAR's format: "q8", "blocks" (its ggml type in
    head_screen_blocks.SCREEN_FORMATS) or None (formats.FORMATS' ``screen``)."""
    fmt = FORMATS.get(lin.kind)
    return fmt.screen(lin.s_off) if fmt is not None else None


def row_bytes(lin) -> int:
    """Bytes of one stored row of a LINEAR's matrix (formats.FORMATS' ``row_bytes``)."""
    return weight_format(lin.kind).row_bytes(lin.kp, lin.s_off)


def attach(program: Program, calibration=None) -> Program:
    """Pack greedy decoding's lm_head screen (cpullm_kernels.panels.head_screen) into ``program`` (its
    arrays grow; ``meta["head_screen"]`` says where) when :func:`head_screen_row` allows one.

    ``calibration(program)`` returns lm_head inputs (T, K) of some real text, or None: the columns
    kept at 8 bits are where those carry the most energy, which decides how many rows the screen
    leaves to compute exactly (never which token it returns). Without it, where the final norm's
    weights are largest."""
    from cpullm_kernels.panels.head_screen import build_screen_rows, screen_columns, sel_columns
    r = head_screen_row(program)
    if r is None:
        return program
    a, I = program.arrays, program.I
    lin = P.linear_operands(I[r])
    Kdim, N, w_off, s_off, Kp, x_off = lin.k, lin.n, lin.w_off, lin.s_off, lin.kp, lin.x_off
    x = calibration(program) if calibration is not None else None
    if x is not None and len(x):
        importance = np.sqrt((np.asarray(x, np.float64)[:, :Kdim] ** 2).mean(0))
        source = f"calibration ({len(x)} rows)"
    else:
        prev = r - 1
        if (prev >= 0 and I[prev, P.COL_OP] == P.OP_RMSNORM and int(I[prev, P.NORM_OUT_OFF]) == x_off
                and int(I[prev, P.NORM_WIDTH]) == Kdim):
            norm_w = int(I[prev, P.NORM_W_OFF])
            importance = np.abs(a["wf"][norm_w: norm_w + Kdim])
            source = "final norm weights"
        else:
            importance = np.ones(Kdim)
            source = "none"
    k_sel = sel_columns(Kp)
    perm = screen_columns(importance, Kp, k_sel)
    if _screen(lin) == "blocks":                    # s_off: the ggml type; w_off counts bytes
        from cpullm_kernels.panels.head_screen_blocks import build_screen_blocks
        rb = row_bytes(lin)
        w = a["wq"].view(np.uint8)[w_off: w_off + N * rb].reshape(N, rb)
        hq, hs, hb = build_screen_blocks(w, s_off, Kp, perm, k_sel)
    else:                                           # q8 panels
        from cpullm_kernels.panels.q8_panels import dequantized_rows
        Np = padded_rows(N)
        w_p = a["wq"][w_off: w_off + Np * Kp]
        s_p = a["ws"][s_off: s_off + Np * (Kp // 32)]
        hq, hs, hb = build_screen_rows(lambda n0, n1: (dequantized_rows(w_p, s_p, Kp, n0, n1), None),
                                       N, Kp, perm, k_sel)
    meta = dict(program.meta)
    arrays = dict(a)
    offs = {}
    for name, arr in (("wq", hq), ("ws", hs), ("wf", hb)):
        arrays[name], offs[name] = _append_array(arrays[name], arr, 64)
    meta["head_screen"] = {"row": r, "k_sel": int(k_sel), "perm": [int(v) for v in perm],
                           "columns_from": source, "q_off": offs["wq"], "q_cols": int(hq.shape[1]),
                           "s_off": offs["ws"], "s_cols": int(hs.shape[1]), "b_off": offs["wf"]}
    return Program(arrays=arrays, meta=meta)


def _append_array(base: np.ndarray, arr: np.ndarray, align: int) -> tuple[np.ndarray, int]:
    """(``base`` + zeros to a multiple of ``align`` + ``arr``, offset of ``arr``): appended to
    its file when ``base`` was built into one (compile_graph's ``workdir``), else concatenated."""
    from .filearrays import append_mapped, backing_path
    if backing_path(base) is not None:
        return append_mapped(base, arr, align)
    start = align_up(base.size, align)
    return np.concatenate([base, np.zeros(start - base.size, base.dtype), arr.reshape(-1)]), start


class HeadScreen:
    """The executor's views of a head screen (cpullm_kernels.panels.head_screen, or head_screen_blocks for
    an lm_head of raw ggml blocks) and its scratch."""

    def __init__(self, ex, sc: dict):
        self.row = int(sc["row"])
        lin = P.linear_operands(ex.I[self.row])
        x_off, Kd, N, w_off, s_off, Kp = lin.x_off, lin.k, lin.n, lin.w_off, lin.s_off, lin.kp
        nb = Kp // 32
        self.segments = ex._segments(0, self.row, batched=False)
        self.blocks = _screen(lin) == "blocks"
        screen = (
            ex.arena[x_off: x_off + Kd],                                    # x: the lm_head's input row
            np.asarray(sc["perm"], np.int64), int(sc["k_sel"]) // 32,
            ex.wq[sc["q_off"]: sc["q_off"] + N * sc["q_cols"]].reshape(N, sc["q_cols"]),
            ex.ws[sc["s_off"]: sc["s_off"] + N * sc["s_cols"]].reshape(N, sc["s_cols"]),
            ex.wf[sc["b_off"]: sc["b_off"] + 3 * N].reshape(N, 3),
        )
        results = (np.zeros(N, np.float32), np.zeros(N, np.int64), np.zeros(N, np.float32))
        permuted = (np.zeros(Kp, np.int16), np.zeros(padded_blocks(Kp), np.float32))  # permuted activations
        if self.blocks:                                                     # raw ggml blocks (q4's Q6_K)
            rb = row_bytes(lin)
            exact = (ex.wq.view(np.uint8)[w_off: w_off + N * rb].reshape(N, rb), s_off,
                     np.zeros(Kp, np.int8), np.zeros(nb, np.float32), np.zeros(Kp // 16, np.float32))
            self.args = screen + exact + permuted + (np.zeros(Kp, np.float32),) + results
        else:
            Np = padded_rows(N)                                             # q8 panels
            exact = (ex.wq[w_off: w_off + Np * Kp], ex.ws[s_off: s_off + Np * nb],
                     np.zeros(Kp, np.int16), np.zeros(nb, np.float32))
            self.args = screen + exact + permuted + (np.zeros(Kp, np.float32), np.zeros(Kp, np.float32)) + results
        self.rows, self.steps = N, 0
        self.t_screen: deque = deque(maxlen=self.WINDOW)     # the head's last times per step
        self.t_plain: deque = deque(maxlen=self.WINDOW)
        threads = max(1, numba.config.NUMBA_NUM_THREADS)
        self.lower_max = np.zeros(threads, np.float32)
        self.counts = np.zeros(threads, np.int64)

    # Which head a greedy step uses. The screen pays where its bounds leave few rows to compute
    # exactly (out of order, ~0.3 us a row on 2 threads) and the lm_head is large next to the
    # caches: it depends on the model, the machine and the text. Each step's head is timed; the
    # one with the lower median over its last WINDOW steps is used, the other one every
    # EXPLORE-th step, so the choice follows the text (medians: a shared host's stalls do not
    # flip it). A screened step that leaves more than MAX_ROWS_FRACTION of the rows runs the
    # plain head instead of computing them.
    MAX_ROWS_FRACTION, EXPLORE, WINDOW = 1 / 16, 16, 8

    def choose(self) -> bool:
        """True: read the lm_head through the screen this step."""
        self.steps += 1
        if len(self.t_screen) < 2 or len(self.t_plain) < 2:     # a first look at both
            return len(self.t_screen) <= len(self.t_plain)
        faster = _median(self.t_screen) <= _median(self.t_plain)
        return faster if self.steps % self.EXPLORE else not faster

    def record(self, screened: bool, seconds: float) -> None:
        (self.t_screen if screened else self.t_plain).append(seconds)

    def _kernel(self):
        if self.blocks:
            from cpullm_kernels.panels.head_screen_blocks import screen_argmax_blocks
            return screen_argmax_blocks
        return screen_argmax

    def compile_kernel(self) -> None:
        """Compile (or load from numba's cache) the screen's kernel for these argument types now."""
        self._kernel().compile(tuple(numba.typeof(a) for a in (*self.args, self.lower_max, self.counts, 1, 1)))

    def argmax(self, nthreads: int) -> tuple[int, int]:
        tok, survivors = self._kernel()(*self.args, self.lower_max, self.counts, nthreads,
                                        int(self.MAX_ROWS_FRACTION * self.rows))
        return int(tok), int(survivors)


def _median(xs) -> float:
    v = sorted(xs)
    return v[len(v) // 2]


class RowsScreen:
    """A verify pass's greedy rows through a q8 head screen
    (:func:`cpullm_kernels.panels.head_screen.screen_argmax_rows`): each row's exact argmax, the
    compact head read once for all of them. Which head a pass of M rows reads follows the
    timings, as :class:`HeadScreen`'s choice for one row, kept per M: scoring a tile of the
    compact head against M rows costs M row routines, so past a few rows the full lm_head (read
    once by the batched matmul) can be the cheaper one on a given machine."""

    MAX_ROWS_FRACTION, EXPLORE, WINDOW = HeadScreen.MAX_ROWS_FRACTION, HeadScreen.EXPLORE, HeadScreen.WINDOW

    def __init__(self, ex, sc: dict, max_rows: int):
        self.row = int(sc["row"])
        lin = P.linear_operands(ex.I[self.row])
        N, Kp, nb = lin.n, lin.kp, lin.kp // 32
        self.x_off, self.x_st, self.k = lin.x_off, lin.x_st, lin.k
        self.n_rows, self.max_m = N, int(max_rows)
        Np = padded_rows(N)
        self.head = (np.asarray(sc["perm"], np.int64), int(sc["k_sel"]) // 32,
                     ex.wq[sc["q_off"]: sc["q_off"] + N * sc["q_cols"]].reshape(N, sc["q_cols"]),
                     ex.ws[sc["s_off"]: sc["s_off"] + N * sc["s_cols"]].reshape(N, sc["s_cols"]),
                     ex.wf[sc["b_off"]: sc["b_off"] + 3 * N].reshape(N, 3),
                     ex.wq[lin.w_off: lin.w_off + Np * Kp], ex.ws[lin.s_off: lin.s_off + Np * nb])
        self.kp = Kp
        self.X = self.scratch = None    # the lm_head inputs of a group and the kernel's scratch (first use)
        self.tokens = np.zeros(self.max_m, np.int64)
        self.times: dict[int, tuple[deque, deque]] = {}              # M -> (screened, plain) head times
        self.passes: dict[int, int] = {}
        self.survivors = 0              # rows the last screened group computed exactly

    @staticmethod
    def allowed(sc: dict, ex) -> bool:
        """A multi-row screen exists for q8 lm_heads (a head of raw ggml blocks reads it whole)."""
        return _screen(P.linear_operands(ex.I[int(sc["row"])])) == "q8"

    def choose(self, m: int) -> bool:
        """True: read the lm_head of a group of ``m`` rows through the screen. Until both heads
        were timed twice at ``m``, the screen counts as slower when it was slower at fewer rows
        (its cost grows with the rows, the full head's barely): a lookup run's passes come in
        many sizes, and timing the screen twice at each cost a code edit's 36 passes 6 %."""
        ts, tp = self._times(m)
        self.passes[m] = n = self.passes.get(m, 0) + 1
        if len(ts) >= 2 and len(tp) >= 2:
            faster = _median(ts) <= _median(tp)
        elif self._slower_below(m):
            faster = False
        else:
            return len(ts) <= len(tp)
        return faster if n % self.EXPLORE else not faster

    def _slower_below(self, m: int) -> bool:
        return any(k < m and len(ts) >= 2 and len(tp) >= 2 and _median(ts) > _median(tp)
                   for k, (ts, tp) in self.times.items())

    def record(self, m: int, screened: bool, seconds: float) -> None:
        self._times(m)[0 if screened else 1].append(seconds)

    def _times(self, m: int) -> tuple[deque, deque]:
        return self.times.setdefault(m, (deque(maxlen=self.WINDOW), deque(maxlen=self.WINDOW)))

    def argmax(self, arena: np.ndarray, m: int, nthreads: int) -> np.ndarray | None:
        """int64 (m,): the argmax of each of the ``m`` rows whose lm_head inputs the arena holds
        (rows 0..m-1 of the head section), or None when the full lm_head must run (non-finite
        bounds, or too many rows left to compute exactly)."""
        from cpullm_kernels.panels.head_screen import rows_scratch, screen_argmax_rows
        if self.scratch is None:
            self.X = np.zeros((self.max_m, self.k), np.float32)
            self.scratch = rows_scratch(self.max_m, self.n_rows, self.kp, max(1, numba.config.NUMBA_NUM_THREADS))
        X = self.X[:m]
        X[:] = arena[self.x_off: self.x_off + m * self.x_st].reshape(m, self.x_st)[:, :self.k]
        got = screen_argmax_rows(self.X, m, *self.head, *self.scratch, self.tokens, nthreads,
                                 int(self.MAX_ROWS_FRACTION * self.n_rows))
        if got < 0:
            return None
        self.survivors = int(got)
        return self.tokens[:m].copy()


class HeadTimes:
    """Which lm_head a kind of step reads, by the same rule as :meth:`HeadScreen.choose` (the
    lower median of the last WINDOW times, the other head every EXPLORE-th step), with times of
    its own: a sampled step's screen computes more rows than a greedy one's."""

    def __init__(self, window: int = HeadScreen.WINDOW, explore: int = HeadScreen.EXPLORE):
        self.t_screen: deque = deque(maxlen=window)
        self.t_plain: deque = deque(maxlen=window)
        self.explore, self.steps = explore, 0

    def choose(self) -> bool:
        """True: read the lm_head through the screen this step."""
        self.steps += 1
        if len(self.t_screen) < 2 or len(self.t_plain) < 2:
            return len(self.t_screen) <= len(self.t_plain)
        faster = _median(self.t_screen) <= _median(self.t_plain)
        return faster if self.steps % self.explore else not faster

    def record(self, screened: bool, seconds: float) -> None:
        (self.t_screen if screened else self.t_plain).append(seconds)


SAMPLE_BUDGETS = (256, 1024, 4096)
"""Rows a sampled step's screen computes exactly, tried in turn (then MAX_ROWS_FRACTION of the
rows) until they prove the draw: the threshold is the lowest one, on a grid of half a
temperature below the largest lower bound, holding at most so many rows. Past the last, the full
head. The bounds are loose next to a temperature (on Qwen2.5-0.5B a row's upper bound is ~6
above its logit, a factor e^(6/T) on its weight), so a flat distribution's draw is seldom proven
within them; a peaked one's is within the first."""
SAMPLE_GRID = 0.5, 128             # (step in temperatures, steps) of the thresholds tried


def sample_through_screen(sc: HeadScreen, nthreads: int, inv_t: float, top_k: int, top_p: float,
                          min_p: float, u: float) -> tuple[int, int]:
    """The token ``cpullm_kernels.ops.sample.sample_logits`` would draw from this step's full
    logits with these arguments, found through the head screen of a q8 lm_head (exactly that
    token: cpullm_kernels.ops.sample.sample_screened), and how many rows it computed exactly;
    token -1 when the screen cannot prove it within ``MAX_ROWS_FRACTION`` of the rows (or its
    bounds are not finite): run the full head."""
    from cpullm_kernels.ops.sample import band_rows, rows_above, sample_screened
    from cpullm_kernels.panels.head_screen import exact_logits, screen_upper
    if sc.blocks:
        return -1, 0
    (x, perm, sel_blocks, hq, hs, hb, w_q, w_s, x_q, x_s, p_q, p_s, xd, xp, upper, rows, vals) = sc.args
    lower = float(screen_upper(x, perm, sel_blocks, hq, hs, hb, x_q, x_s, p_q, p_s, xd, xp, upper,
                               sc.lower_max, nthreads))
    if not np.isfinite(lower):
        return -1, 0
    t = 1.0 / inv_t
    max_rows = int(sc.MAX_ROWS_FRACTION * sc.rows)
    width, nbins = SAMPLE_GRID[0] * t, SAMPLE_GRID[1]
    above = rows_above(upper, lower, width, nbins)
    count, hi = 0, np.inf
    for budget in (*SAMPLE_BUDGETS, max_rows):
        k = int(np.searchsorted(above, min(budget, max_rows), side="right")) - 1   # last level within it
        if k < 0:
            continue
        thr = float(np.float32(lower - width * (k + 1)))    # a float32 value: compared alike everywhere
        if thr >= hi:
            continue
        start = count
        count = int(band_rows(upper, thr, hi, rows, start))
        if count < 0 or count > max_rows:
            return -1, max(count, start)
        exact_logits(w_q, w_s, x_q, x_s, rows, start, count, vals)
        tok = int(sample_screened(rows, vals, count, upper, thr, inv_t, top_k, top_p, min_p, u,
                                  np.empty(max(count, 1), np.float32)))
        if tok >= 0:
            return tok, count
        hi = thr
    return -1, count


def compile_sample_kernels(sc: HeadScreen) -> None:
    """Compile (or load from numba's cache) :func:`sample_through_screen`'s kernels for this
    screen's argument types now, rather than in a server's first sampled step."""
    from cpullm_kernels.ops.sample import band_rows, rows_above, sample_screened
    from cpullm_kernels.panels.head_screen import exact_logits, screen_upper
    if sc.blocks:
        return
    a = sc.args
    typed = lambda *vs: tuple(numba.typeof(v) for v in vs)      # noqa: E731
    screen_upper.compile(typed(*a[:6], *a[8:15], sc.lower_max, 1))
    exact_logits.compile(typed(a[6], a[7], a[8], a[9], a[15], 1, 1, a[16]))
    rows_above.compile(typed(a[14], 1.0, 1.0, 1))
    band_rows.compile(typed(a[14], 1.0, 1.0, a[15], 1))
    sample_screened.compile(typed(a[15], a[16], 1, a[14], 1.0, 1.0, 1, 1.0, 1.0, 1.0, a[16]))
