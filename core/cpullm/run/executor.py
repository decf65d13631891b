"""Runs an ExecutionProgram: batched prefill (matrix-matrix) and one-token decode of one
sequence whose state array and position the caller passes (:class:`cpullm.run.forward.Forward` is the
public door: it holds them in a Slot and sets the thread count).

Decode is one compiled call for the whole token (every layer and the head) unless a plugin kernel
replaces an op or the graph has plugin ops (cpullm.loading.family.OpSpec), in which case the token runs as
a few segments between those calls. Prefill
runs chunks of up to ``max_chunk`` tokens: LINEAR ops as batched matmuls, everything else
through the same interpreter, then the head on the rows asked for, ``head_rows`` at a time.
"""
from __future__ import annotations

import time

import numba
import numpy as np

from ..compile.aligned import aligned_zeros
from ..compile.compiler import Program
from ..errors import ContextOverflowError, PromptError
from cpullm_kernels.program import interpreter as K
from cpullm_kernels.attention.attention import kv_operand
from cpullm_kernels.setup.warmup import run_flags
from ..compile.head_screen import HeadScreen
from cpullm_kernels.program import program_table as P
from cpullm_kernels.program.formats import matrix_bytes, weight_format


class Executor:
    def __init__(self, program: Program, kernels: dict | None = None, ops: dict | None = None,
                 op_impl: str = "fast"):
        """``kernels``: KernelSpec name -> function (plugin kernels the program uses); ``ops``:
        OpSpec name -> OpSpec for the program's plugin ops (default: the installed ones);
        ``op_impl``: "fast" runs their fast kernels where they have them, "reference" their numpy
        references (the conformance kit compares the two)."""
        self.program = program
        a = program.arrays
        m = program.meta
        # read-only views whether or not the program came from the (read-only) execution cache:
        # the kernels then have one specialization per op, which numba's cache keeps
        self.I, self.F, self.wq, self.ws, self.wf = (_read_only(a[k]) for k in ("I", "F", "wq", "ws", "wf"))
        self.n_instr = len(self.I)
        self.first_head = m["first_head"]
        self.n_ctx = m["n_ctx"]
        self.max_chunk = m["max_chunk"]
        self.head_rows = m["head_rows"]
        self.vocab = m["vocab"]
        self.arena = aligned_zeros(m["arena_floats"])
        self.state_floats = max(m["state_floats"], 16)   # a sequence's KV caches + linear states
        self.xq = aligned_zeros(m["max_k"], np.int16)
        self.xs = aligned_zeros(m["max_k"] // 32 * 3)     # block scales (+ 16-sums: raw blocks)
        self.tokens = np.zeros(self.max_chunk, np.int64)
        self.rt = np.zeros(5, np.int64)             # [T, pos0, head_row0, head_rows, threads]
        kernels = kernels or {}
        self.external = {int(r): kernels[name] for r, name in m["external"].items() if name in kernels}
        missing = set(m["external"].values()) - set(kernels)
        if missing:
            from ..errors import PluginError
            raise PluginError(f"the program uses plugin kernels that are not installed: {sorted(missing)}; "
                              "install the plugin again or clear the cache (`cpullm cache clear`)")
        self.plugin_ops = _plugin_calls(self, m.get("plugin_ops") or {}, ops, op_impl)
        self.linear_rows = np.nonzero(self.I[:, P.COL_OP] == P.OP_LINEAR)[0]
        self.moe = {int(r): _MoeCall(self, call) for r, call in (m.get("moe") or {}).items()}
        # run()'s optional operands: each None unless the program has the instructions that read
        # it, and numba then compiles run() without their branch (kernels.warmup.run_flags)
        flags = run_flags(self.I)
        wb = _read_only(self.wq.view(np.uint8)) if flags["blocks"] or flags["embed_blocks"] else None
        self.wb = wb if flags["blocks"] else None                  # LINEARs over raw ggml blocks
        self.wbp = wb if flags["panels"] else None                 # ... Q4_K / Q6_K ones (panels)
        self.wb_embed = wb if flags["embed_blocks"] else None      # an EMBED table of raw blocks
        self.wf_layernorm = self.wf if flags["layernorm"] else None
        self.has_linear_state = bool(flags["linear_state"])              # GATED_DELTA reads the state
        self.kv16 = kv_operand(flags["kv16"])         # the KV caches' format (code; False/0: float32)
        self._decode_segments = self._segments(0, self.n_instr, batched=False)
        self._body_segments = self._segments(0, self.first_head, batched=True)
        self._head_segments = self._segments(self.first_head, self.n_instr, batched=True)
        self._head_segments_1 = self._segments(self.first_head, self.n_instr, batched=False)
        self.profile: dict | None = None
        self.screen = HeadScreen(self, m["head_screen"]) if m.get("head_screen") else None
        self.screen_survivors = 0           # rows the last screened step computed exactly
        # which lm_head the last decode step read: (the screen's compact copy, the lm_head itself);
        # a screened step that fell back read both (cpullm.bench.memory_bound counts what was read)
        self.head_read = (False, True)
        self.sample_times = None            # sampled steps' choice of head (HeadTimes), on first use

    def warm_up(self) -> float:
        """Compile (or load from numba's cache) the head screen's kernel for this program's
        argument types now rather than in the first greedy step; the interpreter's kernels are
        compiled by cpullm_kernels.setup.warmup. Returns the seconds spent compiling."""
        if self.screen is None:
            return 0.0
        from cpullm_kernels.setup.warmup import compile_seconds
        c0 = compile_seconds()
        self.screen.compile_kernel()
        return compile_seconds() - c0

    # ---- segmentation -------------------------------------------------------------------------
    def _segments(self, start: int, end: int, batched: bool) -> list:
        """[("interp", a, b) | ("linear", r) | ("external", r) | ("plugin", r, batched)] covering
        [start, end). Batched segments run LINEARs as matrix products (their weight format's
        ``prefill``, cpullm_kernels.program.formats) and plugin ops through their prefill kernel."""
        out, a = [], start
        for r in range(start, end):
            special = None
            if r in self.external:
                special = ("external", r)
            elif r in self.plugin_ops:
                special = ("plugin", r, batched)
            elif r in self.moe:
                special = ("moe", r)
            elif batched and self.I[r, P.COL_OP] == P.OP_LINEAR:
                special = ("linear", r)
            if special:
                if a < r:
                    out.append(("interp", a, r))
                out.append(special)
                a = r + 1
        if a < end:
            out.append(("interp", a, end))
        return out

    def linear_kinds(self) -> set:
        """The weight kinds (program_table.WEIGHT_*) of the program's LINEARs."""
        return {int(self.I[r, P.LINEAR_KIND]) for r in self.linear_rows}

    def row_at_a_time_share(self) -> float:
        """The share of the LINEARs' weight bytes that a batch of rows reads once per row
        (formats.WeightFormat.one_pass): 0 for an INT8 program, 0.44 for Qwen2.5-0.5B's Q5_0 GGUF
        (its Q8_0 lm_head is read once), 0.69 for SmolLM2-135M's Q4_1 one."""
        total = per_row = 0
        for r in self.linear_rows:
            kind, s_off = int(self.I[r, P.LINEAR_KIND]), int(self.I[r, P.LINEAR_S_OFF])
            n = matrix_bytes(kind, *(int(self.I[r, c]) for c in (P.LINEAR_N, P.LINEAR_K, P.LINEAR_KP,
                                                                  P.LINEAR_W_OFF)), s_off)
            total += n
            if not weight_format(kind).one_pass(s_off):
                per_row += n
        return per_row / total if total else 0.0

    def _run_segments(self, segments, T: int, state: np.ndarray):
        prof = self.profile
        for seg in segments:
            t0 = time.perf_counter() if prof is not None else 0.0
            if seg[0] == "interp":
                if prof is not None:          # per instruction, for the per-op profile
                    for r in range(seg[1], seg[2]):
                        t1 = time.perf_counter()
                        self._interp(r, r + 1, state)
                        prof[r] = prof.get(r, 0.0) + time.perf_counter() - t1
                    continue
                self._interp(seg[1], seg[2], state)
            elif seg[0] == "linear":
                self._linear_batched(seg[1])
            elif seg[0] == "moe":
                self.moe[seg[1]](self, self._rows(seg[1]))
            elif seg[0] == "plugin":
                r = seg[1]
                pos0 = int(self.rt[1] + (self.rt[2] if self.I[r, P.COL_SECTION] == P.SECTION_HEAD else 0))
                self.plugin_ops[r](self.arena, self._rows(r), pos0, seg[2])
            else:
                self._external(seg[1], state)
            if prof is not None:
                prof[seg[1]] = prof.get(seg[1], 0.0) + time.perf_counter() - t0

    def _interp(self, a: int, b: int, state: np.ndarray):
        self.rt[4] = numba.get_num_threads()
        K.run(self.I, self.F, a, b, self.tokens, self.rt, self.arena, state,
              self.wq, self.ws, self.wf, self.xq, self.xs, *self.optional_operands(state))

    def optional_operands(self, state: np.ndarray) -> tuple:
        """run()'s last arguments: linear_state (``state`` where GATED_DELTA reads it), wb, wb_panels,
        wb_embed, wf_layernorm (None where unused), kv16."""
        return (state if self.has_linear_state else None, self.wb, self.wbp, self.wb_embed, self.wf_layernorm,
                self.kv16)

    def _rows(self, r: int) -> int:
        return int(self.rt[0] if self.I[r, P.COL_SECTION] == P.SECTION_BODY else self.rt[3])

    def _linear_batched(self, r: int):
        x_off, x_st, o_off, o_st, Kd, N, kind, w_off, s_off, Kp, b_off = P.linear_operands(self.I[r])
        T = self._rows(r)
        # row-strided views of the arena, written in place (the compiler never places an op's
        # output over its inputs): no (T, N) temporary, which for T = 512 costs page faults
        x = self.arena[x_off: x_off + T * x_st].reshape(T, x_st)[:, :Kd]
        rows = self.arena[o_off: o_off + T * o_st].reshape(T, o_st)    # the full rows: one kernel specialization
        weight_format(kind).prefill(self.wq, self.ws, self.wf, w_off, s_off, Kp, N, x, rows)
        if b_off >= 0:
            rows[:, :N] += self.wf[b_off: b_off + N]

    def _external(self, r: int, state: np.ndarray):
        fn = self.external[r]
        I, F = self.I[r], self.F[r]
        T = self._rows(r)
        if I[P.COL_OP] == P.OP_GATED_DELTA:
            fn(self.arena, state, self.wf, *(int(I[c]) for c in P.GATED_DELTA_KERNEL_COLUMNS),
               float(F[P.F_GATED_DELTA_EPS]), T)
        else:  # pragma: no cover - guarded by EXTERNAL_SIGNATURES at compile time
            raise RuntimeError(f"no external calling convention for opcode {I[P.COL_OP]}")

    # ---- public ------------------------------------------------------------------------------
    def _check_room(self, pos: int, n: int):
        if pos + n > self.n_ctx:
            raise ContextOverflowError(
                f"{pos + n} tokens do not fit in the context of {self.n_ctx}; "
                f"shorten the prompt or load with a larger n_ctx (cpullm.load(..., n_ctx=N) / --ctx N)")

    def _checked(self, tokens, pos: int, what: str) -> np.ndarray:
        """``tokens`` as int64 (T,), refused when empty, out of the vocabulary's range, or past
        the context from ``pos``."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if tokens.size == 0:
            raise PromptError(f"the {what} is empty: give at least one token")
        if tokens.min() < 0 or tokens.max() >= self.embed_rows:
            raise PromptError(f"token id out of range 0..{self.embed_rows - 1}")
        self._check_room(pos, tokens.size)
        return tokens

    def prefill(self, state: np.ndarray, pos: int, tokens, all_logits: bool = False) -> np.ndarray:
        """Run ``tokens`` at positions pos, pos + 1, ... of the sequence whose state is ``state``.
        Returns float32 logits (T, vocab) if ``all_logits`` else (vocab,) for the last token."""
        tokens = self._checked(tokens, pos, "prompt")
        outs = []
        for c0 in range(0, tokens.size, self.max_chunk):
            chunk = tokens[c0: c0 + self.max_chunk]
            T = chunk.size
            self.tokens[:T] = chunk
            self.rt[:4] = (T, pos + c0, 0, 0)
            self._run_segments(self._body_segments, T, state)
            last_chunk = c0 + self.max_chunk >= tokens.size
            if all_logits:
                outs.append(self._head(0, T, state))
            elif last_chunk:
                outs.append(self._head(T - 1, 1, state)[0])
        return np.concatenate(outs) if all_logits else outs[-1]

    def prefill_hidden(self, state: np.ndarray, pos: int, tokens) -> np.ndarray:
        """Run ``tokens`` at positions pos, pos + 1, ... of the sequence whose state is ``state``
        and return their hidden states after the final norm, the lm_head's input: float32
        (T, hidden). The head runs only up to the lm_head (embeddings need no logits)."""
        tokens = self._checked(tokens, pos, "input")
        names = self.program.meta["names"]
        lm = next(r for r in range(self.first_head, self.n_instr)
                  if names[r] == "lm_head" and self.I[r, P.COL_OP] == P.OP_LINEAR)
        x_off, x_st, width = (int(self.I[lm, c]) for c in (P.LINEAR_X_OFF, P.LINEAR_X_ST, P.LINEAR_K))
        segs = {True: self._segments(self.first_head, lm, batched=True),
                False: self._segments(self.first_head, lm, batched=False)}
        out = np.empty((tokens.size, width), np.float32)
        for c0 in range(0, tokens.size, self.max_chunk):
            chunk = tokens[c0: c0 + self.max_chunk]
            T = chunk.size
            self.tokens[:T] = chunk
            self.rt[:4] = (T, pos + c0, 0, 0)
            self._run_segments(self._body_segments, T, state)
            for g0 in range(0, T, self.head_rows):
                rows = min(self.head_rows, T - g0)
                self.rt[2], self.rt[3] = g0, rows
                self._run_segments(segs[rows > 1], rows, state)
                out[c0 + g0: c0 + g0 + rows] = _rows_view(self.arena, x_off, x_st, width, rows)
        return out

    def _head(self, row0: int, n: int, state: np.ndarray) -> np.ndarray:
        out = np.empty((n, self.vocab), np.float32)
        lo = self.program.meta["logits_offset"]
        for g0 in range(0, n, self.head_rows):
            rows = min(self.head_rows, n - g0)
            self.rt[2], self.rt[3] = row0 + g0, rows
            self._run_segments(self._head_segments if rows > 1 else self._head_segments_1, rows, state)
            out[g0: g0 + rows] = self.arena[lo: lo + rows * self.vocab].reshape(rows, self.vocab)
        return out

    def _run_token(self, state: np.ndarray, pos: int, token: int, segments: list) -> None:
        """Run one token at position ``pos`` through ``segments`` (decode segments from
        instruction 0): a single compiled call unless plugin kernels or the profile split it."""
        self._check_room(pos, 1)
        if not 0 <= token < self.embed_rows:
            raise PromptError(f"token id {token} out of range 0..{self.embed_rows - 1}")
        self.tokens[0] = token
        self.rt[:4] = (1, pos, 0, 1)
        if len(segments) == 1 and segments[0][0] == "interp" and self.profile is None:
            self._interp(segments[0][1], segments[0][2], state)
        else:
            self._run_segments(segments, 1, state)

    def decode(self, state: np.ndarray, pos: int, token: int) -> np.ndarray:
        """One token at position ``pos``; returns its logits (vocab,) (a view, copy to keep)."""
        self._run_token(state, pos, token, self._decode_segments)
        self.head_read = (False, True)
        lo = self.program.meta["logits_offset"]
        return self.arena[lo: lo + self.vocab]

    def head_inputs(self, ids) -> np.ndarray | None:
        """The lm_head's input rows (T, K) for ``ids`` (one prefill chunk at most) run as a fresh
        sequence, or None when the program does not end in a LINEAR."""
        r = self.n_instr - 1
        if self.I[r, P.COL_OP] != P.OP_LINEAR or r < self.first_head:
            return None
        ids = np.asarray(ids, np.int64).reshape(-1)[: self.max_chunk]
        ids = ids[(ids >= 0) & (ids < self.embed_rows)]
        if ids.size == 0:
            return None
        lin = P.linear_operands(self.I[r])
        x_off, x_st, Kd = lin.x_off, lin.x_st, lin.k
        state = lazy_zeros(self.state_floats)            # a fresh sequence of its own
        T = ids.size
        self.tokens[:T] = ids
        self.rt[:4] = (T, 0, 0, 0)
        self._run_segments(self._body_segments, T, state)
        before_lm_head = self._segments(self.first_head, r, batched=True)
        out = np.empty((T, Kd), np.float32)
        for g0 in range(0, T, self.head_rows):
            rows = min(self.head_rows, T - g0)
            self.rt[2], self.rt[3] = g0, rows
            self._run_segments(before_lm_head, rows, state)
            out[g0: g0 + rows] = self.arena[x_off: x_off + rows * x_st].reshape(rows, x_st)[:, :Kd]
        return out

    def decode_argmax(self, state: np.ndarray, pos: int, token: int) -> int:
        """One token at position ``pos``, as :meth:`decode`, returning only the argmax of its logits
        (lowest index on ties), which is greedy decoding's next token. With a head screen
        (``program.meta["head_screen"]``) the lm_head may be read through it (the same token; the
        logits buffer is then left unwritten): the executor times both heads as it goes and uses
        the faster one (:class:`cpullm.compile.head_screen.HeadScreen`)."""
        sc = self.screen
        if sc is None:
            return int(np.argmax(self.decode(state, pos, token)))
        self._run_token(state, pos, token, sc.segments)
        use_screen = sc.choose()
        t0 = time.perf_counter()
        tok = -1
        if use_screen:
            tok, self.screen_survivors = sc.argmax(numba.get_num_threads())
        plain = tok < 0
        if plain:            # the plain head (or non-finite bounds, or too many rows left)
            self._interp(sc.row, self.n_instr, state)
            lo = self.program.meta["logits_offset"]
            tok = int(np.argmax(self.arena[lo: lo + self.vocab]))
        dt = time.perf_counter() - t0
        sc.record(use_screen, dt)
        self.head_read = (use_screen, plain)
        if self.profile is not None:
            self.profile[sc.row] = self.profile.get(sc.row, 0.0) + dt
        return int(tok)

    def decode_sample(self, state: np.ndarray, pos: int, token: int, cuts: tuple, draw) -> int:
        """One token at position ``pos``, as :meth:`decode`, returning the sampled next token.
        ``cuts`` = (1 / temperature, top_k, top_p, min_p, u): with a head screen of a q8 lm_head
        the token may be drawn through it (cpullm.compile.head_screen.sample_through_screen:
        exactly the token the full logits give for ``u``); else, or when the screen cannot prove
        it, ``draw(logits)`` draws from the full logits (vocab,) (a view). Each way is timed,
        draw included, and the faster one used (:class:`cpullm.compile.head_screen.HeadTimes`)."""
        from ..compile.head_screen import HeadTimes, sample_through_screen
        sc = self.screen
        if sc is None or sc.blocks or sc.rows != self.vocab:
            return int(draw(self.decode(state, pos, token)))
        if self.sample_times is None:
            self.sample_times = HeadTimes()
        self._run_token(state, pos, token, sc.segments)
        use_screen = self.sample_times.choose()
        t0 = time.perf_counter()
        tok = -1
        if use_screen:
            tok, self.screen_survivors = sample_through_screen(sc, numba.get_num_threads(), *cuts)
        plain = tok < 0
        if plain:
            self._interp(sc.row, self.n_instr, state)
            lo = self.program.meta["logits_offset"]
            tok = int(draw(self.arena[lo: lo + self.vocab]))
        self.sample_times.record(use_screen, time.perf_counter() - t0)
        self.head_read = (use_screen, plain)
        return tok

    def last_step_logits(self, state: np.ndarray) -> np.ndarray:
        """The full logits (vocab,) of the step :meth:`decode_argmax` just ran on ``state`` (a
        view, copy to keep): the plain head's output if it ran, else the plain head run now on
        the lm_head input the step left in the arena (the same numbers as :meth:`decode`'s).
        Call it before anything else runs on this executor."""
        lo = self.program.meta["logits_offset"]
        sc = self.screen
        if sc is not None and not self.head_read[1]:     # the screen answered: no logits yet
            self._interp(sc.row, self.n_instr, state)
            self.head_read = (self.head_read[0], True)
        return self.arena[lo: lo + self.vocab]

    @property
    def embed_rows(self) -> int:
        """Rows of the token embedding: the ids a prompt may hold are 0..embed_rows - 1."""
        return int(self.program.meta.get("embed_rows", self.vocab))

    # ---- profile ------------------------------------------------------------------------------
    def start_profile(self):
        self.profile = {}

    def stop_profile(self) -> dict:
        """Seconds per profile group (qkv, attention, o_proj, mlp_up, ...) since start_profile."""
        prof, self.profile = self.profile or {}, None
        groups = self.program.meta["groups"]
        out: dict[str, float] = {}
        for r, sec in prof.items():
            out[groups[r]] = out.get(groups[r], 0.0) + sec
        return out


def _rows_view(arena: np.ndarray, off: int, st: int, width: int, T: int) -> np.ndarray:
    """(T, width) float32 view of the arena at (offset, row stride)."""
    span = arena[off: off + (T - 1) * st + width]
    if span.size != (T - 1) * st + width:
        raise RuntimeError("plugin op operand runs past the arena")      # a compiler bug
    return np.lib.stride_tricks.as_strided(span, shape=(T, width), strides=(st * 4, 4), writeable=True)


class _MoeCall:
    """One MOE instruction: its operands and expert table as arrays (cpullm_kernels.program.moe), and the
    expert matrices' bytes, to count what each call reads (``bytes_read``)."""

    def __init__(self, ex: Executor, call: dict):
        from cpullm_kernels.program import moe as M
        self.M = M
        self.prm = np.asarray(call["prm"], np.int64)
        self.table = _read_only(np.asarray(call["table"], np.int64))
        E = int(self.prm[M.PRM_E])
        self.counts = np.zeros(E + 1, np.int64)
        kinds = np.unique(self.table[:, [M.TABLE_GATE, M.TABLE_UP, M.TABLE_DOWN]])
        blocks = any(weight_format(k).run_flag == "blocks" for k in kinds)     # an expert reads wq's bytes
        self.wb = _read_only(ex.wq.view(np.uint8)) if blocks else None
        H, inter, shared_i = (int(self.prm[c]) for c in (M.PRM_H, M.PRM_I, M.PRM_SHARED_I))
        self.expert_bytes = np.array([_expert_bytes(row, H, inter if e < E else shared_i)
                                      for e, row in enumerate(self.table)] + ([0] if not shared_i else []), np.int64)
        self.bytes_read = 0             # expert matrix bytes read since the executor started

    def __call__(self, ex: Executor, T: int, row0: int = 0) -> None:
        """Rows [row0, row0 + T) of the operands."""
        M, prm = self.M, self.prm.copy()
        prm[M.PRM_T] = T
        prm[M.PRM_X_OFF] += row0 * prm[M.PRM_X_ST]
        prm[M.PRM_OUT_OFF] += row0 * prm[M.PRM_OUT_ST]
        M.moe(ex.arena, prm, self.table, ex.wq, ex.ws, ex.wf, self.wb, self.counts, numba.get_num_threads())
        self.bytes_read += int(self.expert_bytes[self.counts > 0].sum())


def _expert_bytes(row, H: int, inter: int) -> int:
    """Bytes of one expert's gate, up and down matrices as stored (formats.matrix_bytes)."""
    return sum(matrix_bytes(row[c], N, K, row[c + 3], row[c + 1], row[c + 2])
               for c, N, K in ((0, inter, H), (4, inter, H), (8, H, inter)))


class _PluginCall:
    """One PLUGIN instruction: its weights and params as arrays, its kernels chosen once."""

    def __init__(self, ex: Executor, call: dict, spec, impl: str):
        from ..errors import PluginError
        if spec.version != call["version"]:
            raise PluginError(f"the program was compiled for op {spec.name} version {call['version']!r}, "
                              f"installed {spec.version!r}; clear the cache (`cpullm cache clear`)")
        self.spec, self.call = spec, call
        self.weights = [_plugin_weight(ex, w) for w in call["weights"]]
        self.roles = [w[0] for w in call["weights"]]
        self._named = None
        self.params = np.asarray(call["params"], np.float64)
        fast = impl == "fast"
        self.batched_fn = (spec.prefill or spec.decode) if fast else None
        self.single_fn = (spec.decode or spec.prefill) if fast else None

    @property
    def named(self) -> dict:
        """role -> float32 array for the reference (a matrix dequantized: what the program holds)."""
        if self._named is None:
            self._named = {role: (w.dense() if hasattr(w, "dense") else w) for role, w in zip(self.roles, self.weights)}
        return self._named

    def __call__(self, arena: np.ndarray, T: int, pos0: int, batched: bool, row0: int = 0) -> None:
        """Rows [row0, row0 + T) of the operands, the first at position pos0."""
        ins = [_rows_view(arena, off + row0 * st, st, w, T) for off, st, w in self.call["inputs"]]
        o_off, o_st, o_w = self.call["out"]
        out = _rows_view(arena, o_off + row0 * o_st, o_st, o_w, T)
        fn = self.batched_fn if batched else self.single_fn
        if fn is not None:
            fn(out, *ins, *self.weights, self.params, pos0)
            return
        res = np.asarray(self.spec.reference([np.array(x) for x in ins], self.named, self.call["attrs"], pos0))
        if res.shape != out.shape:
            from ..errors import PluginError
            raise PluginError(f"op {self.spec.name}'s reference returned shape {res.shape} for node "
                              f"{self.call['node']}, expected {out.shape}")
        out[...] = res


def _plugin_weight(ex: Executor, entry: list):
    """A plugin op's weight: float32 array from wf, or for a role of OpSpec.matrices (packed like a
    LINEAR's matrix: entry [role, -1, shape, [kind, w_off, s_off, Kp]]) a cpullm.run.op_matrix.OpMatrix."""
    role, off, shape = entry[:3]
    if len(entry) > 3:
        from .op_matrix import OpMatrix
        return OpMatrix(ex, *entry[3], *shape)
    return ex.wf[off: off + int(np.prod(shape))].reshape(shape)


def _plugin_calls(ex: Executor, calls: dict, ops: dict | None, impl: str) -> dict:
    if not calls:
        return {}
    if impl not in ("fast", "reference"):
        raise ValueError(f"op_impl must be 'fast' or 'reference', not {impl!r}")
    if ops is None:
        from ..loading.plugins import discover
        ops = discover().ops
    missing = sorted({c["op"] for c in calls.values()} - set(ops))
    if missing:
        from ..errors import PluginError
        raise PluginError(f"the program uses plugin ops that are not installed: {missing}; install the "
                          "plugin again or clear the cache (`cpullm cache clear`)")
    return {int(r): _PluginCall(ex, c, ops[c["op"]], impl) for r, c in calls.items()}


def lazy_zeros(n: int) -> np.ndarray:
    """float32 (n,) zeros in anonymous mapped memory, resident only where written, in 4 KiB pages.
    numpy madvises arrays of 4 MB and more MADV_HUGEPAGE, so with transparent huge pages on
    ``madvise`` (the common default) the first token written to a KV cache faulted in 2 MiB of
    every head's keys and every head's values: a synthetic Qwen3-1.7B at n_ctx 4096 went from
    2.46 to 3.38 GB RSS on an 8-token prompt, the whole 0.94 GB cache. Decode at 8k context
    measured the same either way on this VM (0.7B synthetic, three alternations, within noise)."""
    import mmap
    if n * 4 < 1 << 22:
        return aligned_zeros(n)
    return np.frombuffer(mmap.mmap(-1, n * 4), np.float32)


def _read_only(a: np.ndarray) -> np.ndarray:
    if not a.flags.writeable:
        return a
    v = a.view()
    v.flags.writeable = False
    return v
