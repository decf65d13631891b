"""One decode step for many sequences: B rows (one token of each), one pass over the weights.

The rows share the executor's arena (row b is sequence b's token); each sequence keeps its own
state (KV caches, linear-attention state) as one row of a (slots, state_floats) array laid out
like the executor's own ``state``. The program is cut into segments:

* ``rows``: instructions that treat rows independently (norms, GLU, residuals, embedding, the
  head's row selection), run by the interpreter over all B rows at once;
* ``linear``: a LINEAR over the B rows through :func:`cpullm_kernels.program.formats.matmul_rows`,
  the kernel a one-token decode runs with one row (q8 and Q4_K / Q6_K panels: the weights read
  once for all rows, every output the same float arithmetic whatever the batch; other raw blocks
  row by row; f32: one pass by :mod:`cpullm_kernels.rows.batch_linear`);
* ``seq``: ops with a position or a state (ROPE, ATTENTION, GATED_DELTA), run once per sequence
  on its row, with its position and its state (:func:`_per_sequence`), exactly as a one-token
  decode of that sequence alone runs them;
* ``external`` / ``plugin``: plugin kernels and plugin ops, called per sequence.

Runs of ``linear``, ``seq`` and serial row segments run as one compiled call (``fused``).

So a row's result does not depend on the other rows: batch invariance by construction, checked
by tests/test_scheduler.py. The core names no family: what makes an op per-sequence is its
opcode (it reads a position or a state), not a model.
"""
from __future__ import annotations

import atexit
import pickle
import subprocess
import sys
import time

import numba
import numpy as np
from numba import njit

from ..compile.head_screen import RowsScreen
from .executor import Executor
from cpullm_kernels.program import interpreter as K
from cpullm_kernels.program import program_table as P
from cpullm_kernels.attention.attention import ATTENTION, attention_signature
from cpullm_kernels.attention.attention_batch import ATTENTION_DECODE_BATCH, attention_decode_batch_signature
from cpullm_kernels.program.formats import MATMUL_ROWS, matmul_rows_signature
from cpullm_kernels.panels.q8_panels import PANELS_MATMUL
from cpullm_kernels.setup.warmup import is_cached
from cpullm_kernels.attention.gated_delta import GATED_DELTA
from cpullm_kernels.program.row_ops import ROW_OP, row_op_signature
from cpullm_kernels.rows.kquant import QUANTIZE_ACT_Q8
from cpullm_kernels.rows.q8 import QUANTIZE_ACT_Q16
from cpullm_kernels.setup.operand_types import WF

PER_SEQUENCE_OPS = (P.OP_ROPE, P.OP_ATTENTION, P.OP_GATED_DELTA, P.OP_POS_EMBED)
# Row-wise ops the interpreter runs as a parallel loop over rows when T > 1. A decode batch has a
# few rows, each op microseconds of work: a parallel region per op costs more than it saves (on a
# loaded 2-core host, 2.6 ms of such ops per step at B = 1 became 190 ms at B = 2), so the
# batch runs them serially through the interpreter's own row-op dispatcher (row_ops.row_op: the
# same row kernels, the same numbers).
SERIAL_ROW_OPS = (P.OP_RMSNORM, P.OP_LAYERNORM, P.OP_GLU, P.OP_ADD, P.OP_SIGMOID_MUL)

# The large kernels a step calls through their address (cpullm_kernels.setup.addressed): linked,
# the fused step compiled them all again (26-30 s of CPU for the default model).
attention_decode_batch_at, gated_delta_at = ATTENTION_DECODE_BATCH.call, GATED_DELTA.call
attention_at, matmul_rows_at = ATTENTION.call, MATMUL_ROWS.call
row_op_at = ROW_OP.call


@njit(cache=True)
def _serial_rows(I, F, a, b, arena, wf, T):
    """Instructions [a, b) (all in SERIAL_ROW_OPS) over rows [0, T), one thread (``wf`` serves
    LAYERNORM too: one specialization of the dispatcher for every program)."""
    z = np.int64(0)
    for r in range(a, b):
        op = I[r, P.COL_OP]
        if not (op == P.OP_RMSNORM or op == P.OP_LAYERNORM or op == P.OP_GLU or op == P.OP_ADD
                or op == P.OP_SIGMOID_MUL):
            raise ValueError("cpullm batch: not a serial row op")
        row_op_at(I, F, r, arena, wf, wf, z, z, T)


@njit(cache=True)
def _per_sequence(I, F, a, b, arena, states, slots, rows0, nrows, positions, wf, nthreads, has_linear, decode,
                  kv16):
    """Instructions [a, b) (ROPE / ATTENTION / GATED_DELTA) for each sequence s: rows
    [rows0[s], rows0[s] + nrows[s]) of the arena, positions from positions[s], state
    states[slots[s]]. The operands' offsets are moved to the sequence's first row, so each kernel
    sees what a decode of that sequence alone gives it (row 0, T = nrows[s]). ``decode`` (row s
    is sequence s's one token): ATTENTION runs for all of them in one parallel region, with the
    same numbers (kernels.attention_batch)."""
    for r in range(a, b):
        op = I[r, P.COL_OP]
        if decode and op == P.OP_ATTENTION:
            attention_decode_batch_at(arena, states, slots, positions, I[r, P.ATTENTION_Q_OFF],
                                      I[r, P.ATTENTION_Q_ST], I[r, P.ATTENTION_K_OFF], I[r, P.ATTENTION_K_ST],
                                      I[r, P.ATTENTION_V_OFF], I[r, P.ATTENTION_V_ST], I[r, P.ATTENTION_OUT_OFF],
                                      I[r, P.ATTENTION_OUT_ST], I[r, P.ATTENTION_N_HEADS],
                                      I[r, P.ATTENTION_N_KV_HEADS], I[r, P.ATTENTION_HEAD_DIM],
                                      I[r, P.ATTENTION_CACHE_OFF], I[r, P.ATTENTION_CAP], F[r, P.F_ATTENTION_SCALE],
                                      F[r, P.F_ATTENTION_SOFTCAP], np.int64(F[r, P.F_ATTENTION_WINDOW]), nthreads,
                                      kv16)
            continue
        for s in range(slots.shape[0]):
            state = states[slots[s]]
            row0, T, pos0 = rows0[s], nrows[s], positions[s]
            if op == P.OP_ROPE or op == P.OP_POS_EMBED:
                # the row kernels take absolute rows: position pos0 + t for row t, so shift pos0 by row0
                row_op_at(I, F, r, arena, wf, wf, pos0 - row0, row0, row0 + T)
            elif op == P.OP_ATTENTION:
                q_st, k_st = I[r, P.ATTENTION_Q_ST], I[r, P.ATTENTION_K_ST]
                v_st, o_st = I[r, P.ATTENTION_V_ST], I[r, P.ATTENTION_OUT_ST]
                attention_at(arena, state, I[r, P.ATTENTION_Q_OFF] + row0 * q_st, q_st,
                             I[r, P.ATTENTION_K_OFF] + row0 * k_st, k_st, I[r, P.ATTENTION_V_OFF] + row0 * v_st, v_st,
                             I[r, P.ATTENTION_OUT_OFF] + row0 * o_st, o_st, I[r, P.ATTENTION_N_HEADS],
                             I[r, P.ATTENTION_N_KV_HEADS], I[r, P.ATTENTION_HEAD_DIM], I[r, P.ATTENTION_CACHE_OFF],
                             I[r, P.ATTENTION_CAP], F[r, P.F_ATTENTION_SCALE], F[r, P.F_ATTENTION_SOFTCAP],
                             np.int64(F[r, P.F_ATTENTION_WINDOW]), pos0, T, nthreads, kv16)
            elif op == P.OP_GATED_DELTA:
                if has_linear:
                    qkv_st, z_st, b_st = I[r, P.GATED_DELTA_QKV_ST], I[r, P.GATED_DELTA_Z_ST], I[r, P.GATED_DELTA_B_ST]
                    a_st, out_st = I[r, P.GATED_DELTA_A_ST], I[r, P.GATED_DELTA_OUT_ST]
                    gated_delta_at(arena, state, wf, I[r, P.GATED_DELTA_QKV_OFF] + row0 * qkv_st, qkv_st,
                                   I[r, P.GATED_DELTA_Z_OFF] + row0 * z_st, z_st,
                                   I[r, P.GATED_DELTA_B_OFF] + row0 * b_st, b_st,
                                   I[r, P.GATED_DELTA_A_OFF] + row0 * a_st, a_st,
                                   I[r, P.GATED_DELTA_OUT_OFF] + row0 * out_st, out_st,
                                   I[r, P.GATED_DELTA_NK], I[r, P.GATED_DELTA_DK], I[r, P.GATED_DELTA_NV],
                                   I[r, P.GATED_DELTA_DV], I[r, P.GATED_DELTA_CONV_K], I[r, P.GATED_DELTA_CONV_W_OFF],
                                   I[r, P.GATED_DELTA_DT_OFF], I[r, P.GATED_DELTA_ALOG_OFF],
                                   I[r, P.GATED_DELTA_NORM_OFF], I[r, P.GATED_DELTA_STATE_OFF],
                                   F[r, P.F_GATED_DELTA_EPS], T)
            else:
                raise ValueError("cpullm batch: not a per-sequence opcode")


@njit(cache=True)
def _linear_batch(I, r, arena, wq, ws, wf, wb, wbp, xq, xs, T, nthreads):
    """LINEAR r over rows [0, T) (formats.matmul_rows, every weight format): q8, Q4_K / Q6_K panels
    and f32 in one pass over the weights for all rows, other raw blocks a row at a time; every q8
    or block row equals a lone decode's bit for bit. Then the bias."""
    x_off, x_st, o_off, o_st = I[r, P.LINEAR_X_OFF], I[r, P.LINEAR_X_ST], I[r, P.LINEAR_OUT_OFF], I[r, P.LINEAR_OUT_ST]
    Kd, N = I[r, P.LINEAR_K], I[r, P.LINEAR_N]
    b_off = I[r, P.LINEAR_BIAS_OFF]
    x = arena[x_off: x_off + T * x_st].reshape((T, x_st))[:, :Kd]
    rows = arena[o_off: o_off + T * o_st].reshape((T, o_st))      # C-contiguous: the kernels' one specialization
    matmul_rows_at(I[r, P.LINEAR_KIND], I[r, P.LINEAR_W_OFF], I[r, P.LINEAR_S_OFF], I[r, P.LINEAR_KP], N, wq, ws, wf,
                   wb, wbp, x, rows, xq.reshape(-1), xs.reshape(-1), False, nthreads)
    if b_off >= 0:
        for t in range(T):
            for n in range(N):
                rows[t, n] += wf[b_off + n]


@njit(cache=True)
def _fused(I, F, a, b, arena, states, slots, rows0, nrows, positions, wq, ws, wf, wb, wbp, xq, xs, T, nthreads,
           has_linear, decode, kv16):
    """Instructions [a, b) of a batch in one compiled call: LINEARs, SERIAL_ROW_OPS and
    PER_SEQUENCE_OPS, as the separate segments run them (no Python between ops)."""
    for r in range(a, b):
        op = I[r, P.COL_OP]
        if op == P.OP_LINEAR:
            _linear_batch(I, r, arena, wq, ws, wf, wb, wbp, xq, xs, T, nthreads)
        elif op == P.OP_ROPE or op == P.OP_ATTENTION or op == P.OP_GATED_DELTA or op == P.OP_POS_EMBED:
            _per_sequence(I, F, r, r + 1, arena, states, slots, rows0, nrows, positions, wf, nthreads, has_linear,
                          decode, kv16)
        else:
            _serial_rows(I, F, r, r + 1, arena, wf, T)


_COMPILE_CHILD = r"""
import os, pickle, sys
os.nice(10)                    # below the decoding parent
if sys.path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]            # the working directory must not shadow the installed package
from cpullm_kernels.setup import warmup  # noqa: F401  (the cache lock, the code-generation settings)
import numba
numba.get_num_threads()        # starts the threading layer: parallel callees loaded from the cache link to it
from cpullm.run.batch import _fused, fused_callees
sig = pickle.loads(bytes.fromhex(sys.argv[1]))
_fused.compile(sig)
for callee, argtypes in fused_callees(sig):
    callee.bind(argtypes)
"""


def fused_callees(sig: tuple) -> list:
    """[(Addressed, argument types)] that :func:`_fused` called with argument types ``sig`` calls
    through their address, besides the gated-delta kernel (a warm-up unit of the models that have
    it): the matmul of a step's rows, its q8 panel kernel of several rows, its quantizer of each
    row (rows of a strided view: the "A" specializations), attention one sequence at a time, the
    batch's attention, the row ops."""
    wb, wbp, kv = sig[13], sig[14], sig[21]
    quantizers = [QUANTIZE_ACT_Q16] + ([QUANTIZE_ACT_Q8] if wb != numba.types.none else [])
    return [(MATMUL_ROWS, matmul_rows_signature(wb, wbp, "A")), (PANELS_MATMUL, PANELS_MATMUL.signatures[0]),
            *((q, q.signatures[1]) for q in quantizers), (ATTENTION, attention_signature(kv)),
            (ATTENTION_DECODE_BATCH, attention_decode_batch_signature(kv)), (ROW_OP, row_op_signature(WF))]


class BatchDecoder:
    """Decode steps of many sequences on one executor's program (its arena and weights; each
    sequence's state is its own)."""

    def __init__(self, ex: Executor):
        self.ex = ex
        self.has_linear = ex.has_linear_state
        self.body = self._fused_segments(self._segments(0, ex.first_head))
        self.head = self._fused_segments(self._segments(ex.first_head, ex.n_instr))
        rows = ex.max_chunk
        self.xq = np.zeros((rows, ex.xq.size), np.int16)         # batch rows' int16 activations
        self.xs = np.zeros((rows, ex.xs.size), np.float32)
        self.rt = np.zeros(5, np.int64)
        self._compiler: subprocess.Popen | None = None      # compile_in_background's child
        # greedy rows' lm_head through the executor's head screen (decode_argmax): the head cut at
        # the screened LINEAR, the rest run only when the screen cannot answer
        sc = ex.program.meta.get("head_screen")
        self.rows_screen = RowsScreen(ex, sc, ex.head_rows) if sc and RowsScreen.allowed(sc, ex) else None
        if self.rows_screen is not None:
            self.head_pre = self._fused_segments(self._segments(ex.first_head, self.rows_screen.row))
            self.head_lm = self._fused_segments(self._segments(self.rows_screen.row, ex.n_instr))

    # ---- compiling the step ---------------------------------------------------------------------
    def fused_signature(self, states: np.ndarray) -> tuple:
        """The argument types :func:`_fused` is called with on this program and ``states`` (a
        slot table), as :meth:`_run` calls it."""
        ex = self.ex
        seq = np.zeros(1, np.int64)
        args = (ex.I, ex.F, 0, 0, ex.arena, states, seq, seq, seq, seq, ex.wq, ex.ws, ex.wf, ex.wb, ex.wbp, self.xq,
                self.xs, np.int64(1), numba.get_num_threads(), self.has_linear, True, ex.kv16)
        return tuple(numba.typeof(a) for a in args)

    def compiled(self, states: np.ndarray) -> bool:
        """Whether a step on ``states`` would run without compiling: the batched step is in this
        process or numba's cache, or a child started by :meth:`compile_in_background` is done
        (if it failed, the step compiles here on first use, as without it)."""
        child = self._compiler
        if child is not None:
            return child.poll() is not None
        sig = self.fused_signature(states)
        return is_cached(_fused, sig) and all(c.bound(a) or is_cached(c.dispatcher, a) for c, a in fused_callees(sig))

    def compile_in_background(self, states: np.ndarray) -> None:
        """Compile the batched step for ``states`` into numba's cache in a child process at a
        lower priority, once: the first verify pass of a fresh machine otherwise stops decoding
        while it compiles (11-15 s of CPU for SmolLM2's Q4_1 GGUF on 2 cores, the kernels it calls
        by address included: benchmarks/results/2026-12-07-cold-start-addressed.md). The child is
        stopped at exit; numba replaces cache files whole, so a stopped child leaves none
        half-written."""
        if self._compiler is not None:
            return
        sig = pickle.dumps(self.fused_signature(states)).hex()
        try:
            self._compiler = subprocess.Popen([sys.executable, "-c", _COMPILE_CHILD, sig],
                                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                              stderr=subprocess.DEVNULL)
        except OSError:
            return                  # compiled here on first use instead
        atexit.register(_stop, self._compiler)

    @property
    def max_rows(self) -> int:
        """Sequences one step can decode (the arena's body rows)."""
        return self.ex.max_chunk

    def _segments(self, start: int, end: int) -> list:
        ex, out, a = self.ex, [], start
        I = ex.I
        for r in range(start, end):
            op = int(I[r, P.COL_OP])
            if r in ex.external:
                special = ("external", r)
            elif r in ex.plugin_ops:
                special = ("plugin", r)
            elif r in ex.moe:
                special = ("moe", r)        # rows grouped by expert inside (kernels.moe): row-wise
            elif op == P.OP_LINEAR:
                special = ("linear", r)
            elif op in PER_SEQUENCE_OPS:
                if out and out[-1][0] == "seq" and out[-1][2] == r and a == r:
                    out[-1] = ("seq", out[-1][1], r + 1)
                    a = r + 1
                    continue
                special = ("seq", r, r + 1)
            else:
                continue
            if a < r:
                out.extend(self._row_segments(a, r))
            out.append(special)
            a = r + 1
        if a < end:
            out.extend(self._row_segments(a, end))
        return out

    def _fused_segments(self, segments: list) -> list:
        """Runs of "serial", "seq" and "linear" segments become one "fused" segment, executed by one
        compiled call (:func:`_fused`)."""
        out = []
        for seg in segments:
            a, b = (seg[1], seg[1] + 1) if seg[0] == "linear" else (seg[1], seg[2]) if len(seg) == 3 else (None, None)
            ok = seg[0] in ("serial", "seq", "linear")
            if ok and out and out[-1][0] == "fused" and out[-1][2] == a:
                out[-1] = ("fused", out[-1][1], b)
            elif ok:
                out.append(("fused", a, b))
            else:
                out.append(seg)
        return out

    def _row_segments(self, a: int, b: int) -> list:
        """[a, b) as runs of SERIAL_ROW_OPS ("serial") and of other row-wise ops ("rows")."""
        out = []
        for r in range(a, b):
            kind = "serial" if int(self.ex.I[r, P.COL_OP]) in SERIAL_ROW_OPS else "rows"
            if out and out[-1][0] == kind:
                out[-1] = (kind, out[-1][1], r + 1)
            else:
                out.append((kind, r, r + 1))
        return out

    def decode(self, states: np.ndarray, slots, positions, tokens) -> np.ndarray:
        """One token for each of B sequences: ``tokens[b]`` at position ``positions[b]`` of the
        sequence whose state is ``states[slots[b]]``. Returns float32 logits (B, vocab) (a copy)."""
        ex = self.ex
        B, seqs = self._body(states, slots, positions, tokens)
        out = np.empty((B, ex.vocab), np.float32)
        lo = ex.program.meta["logits_offset"]
        for g0 in range(0, B, ex.head_rows):
            n = min(ex.head_rows, B - g0)
            self.rt[2], self.rt[3] = g0, n
            self._run(self.head, n, states, seqs)
            out[g0: g0 + n] = ex.arena[lo: lo + n * ex.vocab].reshape(n, ex.vocab)
        return out

    def decode_argmax(self, states: np.ndarray, slots, positions, tokens) -> np.ndarray:
        """As :meth:`decode`, returning only each row's argmax (lowest index on ties): int64 (B,).
        With a q8 head screen a group of rows may read the lm_head through it
        (:class:`cpullm.compile.head_screen.RowsScreen`, timed against the full head as it goes):
        the same tokens as the argmax of :meth:`decode`'s logits."""
        rs = self.rows_screen
        if rs is None:
            return self.decode(states, slots, positions, tokens).argmax(1)
        ex = self.ex
        B, seqs = self._body(states, slots, positions, tokens)
        out = np.empty(B, np.int64)
        lo = ex.program.meta["logits_offset"]
        for g0 in range(0, B, ex.head_rows):
            n = min(ex.head_rows, B - g0)
            self.rt[2], self.rt[3] = g0, n
            self._run(self.head_pre, n, states, seqs)
            t0 = time.perf_counter()
            screened = rs.choose(n)
            toks = rs.argmax(ex.arena, n, numba.get_num_threads()) if screened else None
            if toks is None:                    # the full lm_head
                self._run(self.head_lm, n, states, seqs)
                toks = ex.arena[lo: lo + n * ex.vocab].reshape(n, ex.vocab).argmax(1)
            rs.record(n, screened, time.perf_counter() - t0)
            out[g0: g0 + n] = toks
        return out

    def _body(self, states, slots, positions, tokens) -> tuple[int, tuple]:
        """The body (every layer) of a step's B rows; returns (B, the per-sequence operands)."""
        ex = self.ex
        B = len(tokens)
        if not 0 < B <= self.max_rows:
            raise ValueError(f"a decode step takes 1..{self.max_rows} sequences, got {B}")
        slots = np.asarray(slots, np.int64)
        positions = np.asarray(positions, np.int64)
        if np.any(positions >= ex.n_ctx):
            raise ValueError("a sequence is at the end of its context")
        ex.tokens[:B] = tokens
        seqs = (slots, np.arange(B, dtype=np.int64), np.ones(B, np.int64), positions)
        self.rt[:4] = (B, 0, 0, 0)
        self._run(self.body, B, states, seqs)
        return B, seqs

    def _run(self, segments, T: int, states, seqs):
        ex = self.ex
        for seg in segments:
            kind = seg[0]
            if kind == "rows":
                self.rt[4] = numba.get_num_threads()
                K.run(ex.I, ex.F, seg[1], seg[2], ex.tokens, self.rt, ex.arena, states[0], ex.wq, ex.ws, ex.wf,
                      ex.xq, ex.xs, *ex.optional_operands(states[0]))     # (row ops: no state read)
            elif kind == "fused":
                _fused(ex.I, ex.F, seg[1], seg[2], ex.arena, states, *seqs, ex.wq, ex.ws, ex.wf, ex.wb, ex.wbp, self.xq,
                       self.xs, np.int64(T), numba.get_num_threads(), self.has_linear, True, ex.kv16)
            elif kind == "serial":
                _serial_rows(ex.I, ex.F, seg[1], seg[2], ex.arena, ex.wf, np.int64(T))
            elif kind == "seq":
                _per_sequence(ex.I, ex.F, seg[1], seg[2], ex.arena, states, *seqs, ex.wf,
                              numba.get_num_threads(), self.has_linear, True, ex.kv16)
            elif kind == "external":
                self._external(seg[1], states, seqs)
            elif kind == "moe":
                ex.moe[seg[1]](ex, T)
            else:
                self._plugin(seg[1], seqs)

    def _external(self, r: int, states, seqs):
        ex = self.ex
        fn = ex.external[r]
        I, F = ex.I[r], ex.F[r]
        slots, rows0, nrows, _ = seqs
        for s in range(len(slots)):
            cols = {c: int(I[c]) for c in P.GATED_DELTA_KERNEL_COLUMNS}     # in the kernel's argument order
            for off_col, st_col in P.GATED_DELTA_ROW_OPERANDS:              # moved to the sequence's first row
                cols[off_col] += int(rows0[s]) * cols[st_col]
            fn(ex.arena, states[slots[s]], ex.wf, *cols.values(), float(F[P.F_GATED_DELTA_EPS]), int(nrows[s]))

    def _plugin(self, r: int, seqs):
        ex = self.ex
        call = ex.plugin_ops[r]
        slots, rows0, nrows, positions = seqs
        for s in range(len(slots)):
            call(ex.arena, int(nrows[s]), int(positions[s]), False, row0=int(rows0[s]))


def _stop(child: subprocess.Popen) -> None:
    if child.poll() is None:
        child.kill()
        child.wait()
