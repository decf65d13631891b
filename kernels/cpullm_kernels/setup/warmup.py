"""Compile the kernels a program needs before it runs: only those, once each, counted, and on a
machine with two cores or more shared with a child process through numba's on-disk cache.

Every kernel is ``@njit(cache=True)``: the first process compiles it (seconds each; a cold start
of a small Llama spends almost all its time here) and later ones load it from the cache. Left to
itself numba compiles lazily on the first call, so a cold start is silent and its time lands in
whatever call came first (the first prefill). :class:`Warmup` instead compiles, up front:

* only the kernel groups (:data:`UNITS`) the model needs: a model without linear attention never
  compiles the gated-delta kernels (:func:`cpullm_kernels.program.interpreter.run` gets
  ``linear_state=None`` and numba prunes that branch), an f32 model not the q8 GEMM;
* each with the exact signature the executor calls it with (:func:`signature`; read-only program
  arrays, int64 scalars), so nothing is compiled twice;
* the groups balanced between this process and a child (numba writes each compiled kernel to
  its cache, the parent then loads it; the child starts while the parent still reads the
  weights), and shared as they go: a side out of units takes one the other has not started
  (:class:`Warmup`); :func:`cpullm_kernels.program.interpreter.run` last. It links the EMBED
  and SELECT_ROWS kernels and calls the others (attention, the LINEAR driver, the row ops)
  through their address (:mod:`cpullm_kernels.setup.addressed`), so it compiles without them,
  and they need only be compiled (here or by the child) before its first call.

Units that call the same helpers form one group and go to one process (compiled in both they
would cost twice; only a side that would otherwise wait takes a unit of the other's group).
Two processes writing one numba cache are safe only with
:mod:`cpullm_kernels.setup.numba_cache_lock`; without it the groups whose helpers the load itself
compiles stay here. ``CPULLM_COMPILE_PROCESSES=1`` keeps everything in this process.

Progress goes to stderr as one line rewritten in place, only when stderr is a terminal and only
when something is compiled. :func:`compile_seconds` is the process's total numba compile time
(top-level compilations, from numba's event stream), which the generation stats use to report
compile time apart from prefill.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from . import numba_setup  # noqa: F401  (code-generation settings first)
from . import numba_cache_lock  # noqa: E402
from ..program import program_table as P  # noqa: E402

import numba  # noqa: E402
from numba import types as nt  # noqa: E402
from numba.core import event as _event  # noqa: E402

# ---- the process's compile time ------------------------------------------------------------------


class _CompileClock(_event.Listener):
    """Sums the wall time of top-level numba compilations (nested callee compilations are inside
    their caller's interval and not added again)."""

    def __init__(self):
        self.depth = 0
        self.t0 = 0.0
        self.total = 0.0
        self.count = 0

    def on_start(self, ev):
        if self.depth == 0:
            self.t0 = time.perf_counter()
        self.depth += 1

    def on_end(self, ev):
        self.depth -= 1
        self.count += 1
        if self.depth == 0:
            self.total += time.perf_counter() - self.t0


_CLOCK = _CompileClock()
_event.register("numba:compile", _CLOCK)


def compile_seconds() -> float:
    """Seconds this process has spent compiling numba functions so far (loads from the on-disk
    cache are not compilations and do not count)."""
    return _CLOCK.total


# ---- the signatures the executor calls the kernels with --------------------------------------------


from .operand_types import (  # noqa: E402  (the signatures' operand types)
    ARENA, INTS, PROG_F, PROG_I, WB, WF, WQ, WS, XQ, array as _arr, f64, i64,
)
BLOCK_QUANTS = ("q4", "gguf")             # quant modes whose programs hold raw-block weights


RUN_FLAGS = ("linear_state", "blocks", "panels", "embed_blocks", "layernorm", "kv16")
"""interpreter.run's optional operands, in its argument order: each an array for a program with
the instructions that read it (GATED_DELTA run by the interpreter; a LINEAR over raw ggml blocks;
one of Q4_K / Q6_K blocks, which the compiler may store in panels; an EMBED table of raw blocks;
LAYERNORM), None otherwise, and numba compiles one specialization
of run per combination, without the kernels of the None ones. ``kv16``: the KV caches' format
code (attention.KV_*; 0 or False: float32), whose operand (attention.kv_operand) is None for
float32 caches, an int64 for float16 ones, an int8 for 8-bit ones."""


def run_flags(I) -> dict:
    """Which of RUN_FLAGS a compiled program's instruction table ``I`` needs (the executor passes
    the operands accordingly)."""
    import numpy as np
    from ..attention.attention import KV_F32
    from ..panels.kquant_panels import FORMATS as PANEL_FORMATS, PANELED
    from ..program.formats import weight_format
    mine = I[:, P.COL_IMPL] == P.IMPL_INTERPRETER
    op = I[:, P.COL_OP]
    flags = {"linear_state": bool(np.any(mine & (op == P.OP_GATED_DELTA))), "blocks": False,
             "embed_blocks": False, "layernorm": bool(np.any(mine & (op == P.OP_LAYERNORM))),
             "kv16": int(np.max(I[op == P.OP_ATTENTION, P.ATTENTION_KV_FORMAT], initial=KV_F32))}
    for opcode, kind_col, flag in ((P.OP_LINEAR, P.LINEAR_KIND, "run_flag"), (P.OP_EMBED, P.EMBED_KIND, "embed_flag")):
        for kind in np.unique(I[mine & (op == opcode), kind_col]):       # the operands its formats read
            name = getattr(weight_format(kind), flag)
            if name:
                flags[name] = True
    # the same test as the compiler's BlockPlan.warmup_flags: the format, paneled or not
    blocks = mine & (op == P.OP_LINEAR) & (I[:, P.LINEAR_KIND] == P.WEIGHT_BLOCKS)
    flags["panels"] = bool(np.isin(I[blocks, P.LINEAR_S_OFF] % PANELED, PANEL_FORMATS).any())
    return flags


def run_unit(flags: dict) -> str:
    """The warm-up unit of interpreter.run with these RUN_FLAGS, e.g. ``run+blocks+layernorm``."""
    return "run" + "".join(f"+{_flag_name(f, flags[f])}" for f in RUN_FLAGS if flags.get(f))


def _flag_name(flag: str, value) -> str:
    """A RUN_FLAGS entry's part of a unit name (the 8-bit KV format's: ``kv8``)."""
    from ..attention.attention import KV_Q8
    return "kv8" if flag == "kv16" and value == KV_Q8 else flag


def run_signature(flags: dict) -> tuple:
    """The signature of interpreter.run as the executor calls it with these RUN_FLAGS."""
    from ..attention.attention import KV_Q8
    optional = {"linear_state": ARENA, "blocks": WB, "panels": WB, "embed_blocks": WB, "layernorm": WF,
                "kv16": nt.int8 if flags.get("kv16") == KV_Q8 else i64}
    return (PROG_I, PROG_F, i64, i64, INTS, INTS, ARENA, ARENA, WQ, WS, WF, XQ, ARENA,
            *(optional[f] if flags.get(f) else nt.none for f in RUN_FLAGS))


def _addressed(*callees) -> list:
    """[(dispatcher, signature)] of kernels called through their address with one declared
    signature each (the matrix kernels formats.matmul_rows calls)."""
    return [(c.dispatcher, c.signatures[0]) for c in callees]


def _attention_kernels(attention, kv) -> list:
    """attention.attention for the KV operand type ``kv``, after the attend_part it calls by address."""
    return [(attention.attend_part, attention.attend_part_signature(kv)),
            (attention.attend_chunk, attention.attend_chunk_signature(kv)),
            (attention.attention, attention.attention_signature(kv))]


def _linear_driver(formats, interpreter, wb, wbp) -> list:
    """The LINEAR decode driver (interpreter.linear_rows) for the operand types ``wb`` / ``wbp``,
    after the matmul_rows it calls by address (one C-contiguous row)."""
    return [(formats.matmul_rows, formats.matmul_rows_signature(wb, wbp)),
            (interpreter.linear_rows, interpreter.linear_rows_signature(wb, wbp))]


def _kernels(unit: str) -> list:
    """[(dispatcher, signature)] of one unit, callees before callers where both are listed."""
    from ..attention import attention, gated_delta
    from ..ops import elementwise, norm, pointwise, rope
    from ..panels import kquant_panels, q8_panels
    from ..rows import kquant, q8
    from ..program import formats, interpreter, moe, row_ops
    from ..tiles import kquant_gemm, q8_gemm
    if unit.startswith("run"):
        parts = unit.split("+")[1:]
        flags = {f: True for f in parts if f != "kv8"}
        if "kv8" in parts:
            flags["kv16"] = attention.KV_Q8
        return [(interpreter.run, run_signature(flags))]
    f32_2, i16_2, wb2 = _arr(nt.float32, 2), _arr(nt.int16, 2), _arr(nt.uint8, 2, readonly=True)
    table = {
        # LINEAR's decode driver, as interpreter.run calls it: without raw blocks, and (unit "blocks") with
        "linear": _linear_driver(formats, interpreter, nt.none, nt.none),
        # the row kernels (row_ops calls each through its address)
        "norm": _addressed(norm.RMSNORM_ROWS),
        "layernorm": _addressed(norm.LAYERNORM_ROWS),
        "rope": _addressed(rope.ROPE_ROWS),
        # (attend_part, which attention calls through its address, then attention)
        "attention": _attention_kernels(attention, nt.none),
        "attention_f16": _attention_kernels(attention, i64),
        "attention_q8": _attention_kernels(attention, nt.int8),
        "glu": _addressed(elementwise.GLU_ROWS),
        "binary": _addressed(elementwise.BINARY_ROWS),
        "unary": _addressed(elementwise.UNARY_ROWS),
        "copy": [(elementwise.copy_rows, (ARENA, *[i64] * 7))],
        "act": _addressed(pointwise.ACT_ROWS),
        "pos_embed": _addressed(pointwise.POS_EMBED_ROWS),
        # the row ops' dispatcher, one row range (decode) or every row in one parallel region
        # (prefill): interpreter.run calls both through their address; without and with LAYERNORM
        "row_ops": [(row_ops.row_op, row_ops.row_op_signature(nt.none)),
                    (row_ops.row_op_par, row_ops.row_op_par_signature(nt.none))],
        "row_ops_layernorm": [(row_ops.row_op, row_ops.row_op_signature(WF)),
                              (row_ops.row_op_par, row_ops.row_op_par_signature(WF))],
        "gated_delta": [(gated_delta.gated_delta, (ARENA, ARENA, WF, *[i64] * 20, f64, i64))],
        # the q8 panel kernels (matmul_rows calls them through their address, so each compiles
        # once, anywhere): one row (decode, the head), and two rows or more (prefill's batched q8
        # LINEARs, routed experts), with prefill's row quantizer (row-contiguous activations, as
        # every LINEAR of the shared blocks reads and writes whole buffers)
        "q8_panels": _addressed(q8_panels.PANELS_MATVEC),
        "q8_panels_rows": _addressed(q8_panels.PANELS_MATMUL),
        "gemm": [(q8_panels.quantize_rows_par, (f32_2, i16_2, f32_2))],
        # each format's raw-block matvec (matmul_rows and the short prompts' kquant_matvec_rows
        # call it by address)
        **{block_matvec_unit(f): _addressed(kquant.MATVEC[getattr(kquant, f)]) for f in BLOCK_MATVEC_FORMATS},
        # each row's activations for the q8 / raw-block matrices (matmul_rows and the short
        # prompts' kquant_matvec_rows call them by address)
        "act_q16": _addressed(q8.QUANTIZE_ACT_Q16),
        "act_q8": _addressed(kquant.QUANTIZE_ACT_Q8),
        # the float32 LINEAR's decode matvec (matmul_rows calls it by address; a program without
        # float32 LINEARs never compiles it)
        "f32_rows": _addressed(formats.F32_MATVEC),
        # prefill's batched raw-block LINEARs (kquant_gemm's integer GEMM, the k-quant panels) and short prompts
        "kquant_gemm": [(q8_gemm.quantize_rows_q16, (f32_2, i16_2, f32_2)),
                        (kquant_gemm.kquant_gemm_blocks, (i64, i16_2, f32_2, wb2, i64, f32_2, f32_2, i64, nt.none)),
                        (kquant_gemm.kquant_block_sums, (i16_2, f32_2, i64, f32_2)),
                        (kquant_gemm.kquant_matvec_rows, (i64, f32_2, wb2, f32_2, _arr(nt.int8), ARENA, ARENA))],
        # ... its activation quantizer for Q6_K matrices (kquant_gemm.matmul_int), only a program
        # that may hold Q6_K blocks
        "kquant_gemm_q6k": [(kquant_gemm.quantize_rows_i8, (f32_2, i16_2, f32_2, i64)),
                            (kquant_gemm.kquant_gemm_blocks, (i64, i16_2, f32_2, wb2, i64, f32_2, f32_2, i64,
                                                              nt.boolean))],
        # prefill's Q4_K / Q6_K LINEARs in panels: rows quantized, then the panel kernel into a
        # row-strided view of the arena (only a program with such panels)
        "kpanels_gemm": [(kquant_panels.quantize_rows_q8k, (f32_2, _arr(nt.int8, 2), f32_2, f32_2)),
                         (kquant_panels.matmul, (i64, WB, _arr(nt.int8, 2), f32_2, f32_2,
                                                 nt.Array(nt.float32, 2, "A"), i64))],
        # the raw-block LINEAR and EMBED rows, as interpreter.run calls them (the matrix kernels first:
        # formats.matmul_rows calls them through their address)
        # (without and with the Q4_K / Q6_K panel kernel; either also holds the q8 and f32 rows)
        "blocks": _linear_driver(formats, interpreter, WB, nt.none),
        "blocks_panels": [*_addressed(kquant_panels.MATMUL), *_linear_driver(formats, interpreter, WB, WB)],
        "embed_blocks": [(formats.embed_row_into, (*[i64] * 4, WQ, WS, WF, WB, i64, nt.float32, ARENA))],
        # routed experts (kernels.moe), called by the executor: q8 / f32 experts, and raw blocks
        "moe": [(moe.moe, (ARENA, INTS, PROG_I, WQ, WS, WF, nt.none, INTS, i64))],
        "moe_blocks": [(moe.moe, (ARENA, INTS, PROG_I, WQ, WS, WF, WB, INTS, i64))],
    }
    return table[unit]


BLOCK_MATVEC_FORMATS = ("Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q5_K", "Q4_1", "Q5_0", "Q5_1")
"""The raw-block formats of kquant.matvec, a warm-up unit each (:func:`block_matvec_unit`)."""


def block_matvec_unit(fmt: str) -> str:
    """The warm-up unit of kquant.matvec for the format named ``fmt`` (ggml's name)."""
    return f"block_matvec_{fmt.lower()}"


UNITS = {
    # unit: (IR op names that need it, None: every program (interpreter.run calls its kernels
    # whatever the ops), compile cost (CPU seconds of the compiling thread, each unit compiled in
    # warm-up order into an empty cache on the 2-core Ice Lake (AVX-512 VNNI) of
    # benchmarks/results/2026-12-07-cold-start-row-ops.md; the default model's units and the
    # attention ones re-measured in benchmarks/results/2026-12-07-cold-start-formats.md), sharing
    # group, called by interpreter.run). Units of one group link the same helpers (the q8 GEMM's
    # helpers, the block dequantizer), so they go to the same process: compiled twice they would
    # cost twice. Kernels called through their address (the q8 panels, the block matvec, each
    # row's activation quantizers, attend_part) are units of their own: compiled once anywhere,
    # loaded by the others. The prefill GEMMs are called by the executor, not by
    # interpreter.run, so run can compile while they do.
    "q8_panels": (None, 1.8, "q8_panels", True),
    "q8_panels_rows": (("LINEAR", "MOE"), 3.8, "q8_panels_rows", False),
    **{block_matvec_unit(f): (None, 0.8, "block_matvec", True) for f in BLOCK_MATVEC_FORMATS},
    "act_q16": (None, 1.0, "act_q16", True),
    "act_q8": (None, 0.8, "act_q8", True),
    "f32_rows": (("LINEAR", "MOE"), 0.8, "f32_rows", True),
    "linear": (None, 3.6, "matmul", True),
    "gemm": (("LINEAR",), 1.2, "matmul", False),
    # the block driver with the q8 / f32 rows; + the Q4_K / Q6_K panel kernel
    "blocks": (None, 2.8, "matmul", True),
    "blocks_panels": (None, 15.8, "matmul", True),
    "embed_blocks": (None, 3.5, "matmul", True),
    "kquant_gemm": (("LINEAR",), 5.3, "kquant_gemm", False),
    "kquant_gemm_q6k": (("LINEAR",), 6.1, "kquant_gemm", False),
    "kpanels_gemm": (("LINEAR",), 7.6, "matmul", False),
    # the row kernels and their dispatcher (which calls them through their address, binding only
    # the kernel of the instruction at hand): one group, a kernel only where its ops are
    "norm": (("RMSNORM",), 0.3, "rows", True),
    "layernorm": (("LAYERNORM",), 0.65, "rows", True),
    "rope": (("ROPE",), 0.6, "rows", True),
    "glu": (("GLU",), 0.6, "rows", True),
    "binary": (("ADD", "SIGMOID_MUL"), 0.3, "rows", True),
    "unary": (("SOFTCAP", "SCALE"), 0.35, "rows", True),
    "act": (("ACT",), 0.7, "rows", True),
    "pos_embed": (("POS_EMBED",), 0.25, "rows", True),
    "row_ops": (None, 1.4, "rows", True),
    "row_ops_layernorm": (("LAYERNORM",), 1.85, "rows", True),
    "attention": (None, 5.1, "attention", True),          # float32 KV caches
    "attention_f16": (None, 5.1, "attention", True),      # float16 KV caches
    "attention_q8": (None, 5.3, "attention", True),       # 8-bit KV caches
    "copy": (None, 0.2, "copy", True),
    "gated_delta": (("GATED_DELTA",), 5.3, "gated_delta", True),
    "moe": (("MOE",), 21.3, "moe", False),
    "moe_blocks": (("MOE",), 37.2, "moe", False),
}
LOAD_GROUPS = ("matmul", "kquant_gemm", "act_q16", "act_q8")
"""Groups whose helpers the loading process may compile itself while the child runs (the INT8
and 4-bit weight quantizers, the head screen, the GGUF dequantizer). Without the cache lock
(:mod:`cpullm_kernels.setup.numba_cache_lock`) they stay in this process: two processes must then never
compile signatures of one function at the same time."""
RUN_COST = 1.3
"""interpreter.run itself (it links the EMBED and SELECT_ROWS kernels; the others it calls by address)."""
PARENT_HEAD_START = 0.6
"""Seconds of other work (weights, checksums, the loader's own kernels) this process does before
it compiles, less the child's own start (Python and numba imported afresh): the split gives the
child that much more. Traced cold starts of the default model: the child's first compile began
0.6 s before this process's, in a slow spell and a fast one."""


def units_for(op_names, quant: str, linear_state: bool, q8_prefill: bool = True, blocks: bool | None = None,
              embed_blocks: bool | None = None, kv16: int = 0, panels: bool | None = None,
              f32_linear: bool | None = None, block_formats=None) -> list[str]:
    """The units a graph with these op names needs, ``run`` last. ``linear_state``: it has
    GATED_DELTA ops the interpreter runs, not a plugin kernel; ``q8_prefill``: a body LINEAR of a
    GGUF run as it is has q8 weights (Q8_0), so prefill needs the q8 GEMM; ``blocks`` /
    ``embed_blocks``: a LINEAR / the EMBED reads raw ggml blocks (default: quant is a block mode);
    ``kv16``: the KV caches' format code (attention.KV_*; True: float16; only that attention
    specialization is compiled); ``panels``: a LINEAR may hold Q4_K / Q6_K blocks, which the
    compiler stores in panels of 16 rows, so prefill needs the panel GEMM (default: as
    ``blocks``; a file of Q4_0 / Q4_1 / Q5 blocks never runs it); ``f32_linear``: a LINEAR keeps
    float32 weights (default: quant is "f32"); ``block_formats``: the ggml names of the formats a
    LINEAR's raw blocks may have (default: every format), each a kquant.matvec unit."""
    from ..tiles.q8_gemm import GEMM_ISA
    ops = set(op_names)
    if blocks is None:
        blocks = quant in BLOCK_QUANTS
    if embed_blocks is None:
        embed_blocks = quant in BLOCK_QUANTS
    if panels is None:
        panels = blocks
    if f32_linear is None:
        f32_linear = quant == "f32"
    q8_gemm = not (quant == "f32" or (quant in BLOCK_QUANTS and not q8_prefill))    # prefill's q8 GEMM runs
    matvecs = {block_matvec_unit(f) for f in (BLOCK_MATVEC_FORMATS if block_formats is None else block_formats)
               } if blocks else set()                                          # the raw-block matvecs
    out = []
    for unit, (needs, *_) in UNITS.items():
        if unit == "gated_delta" and not linear_state:
            continue
        if unit == "gemm" and not q8_gemm:
            continue
        if unit == "q8_panels_rows" and not q8_gemm and "MOE" not in ops:   # the GEMM's or the experts'
            continue
        if unit == ("moe" if blocks else "moe_blocks"):       # one of the two specializations
            continue
        if unit in ("kquant_gemm", "kquant_gemm_q6k", "blocks", "blocks_panels", "act_q8") and (
                not blocks or (unit.startswith("kquant_gemm") and GEMM_ISA is None)):
            continue
        if unit.startswith("block_matvec_") and unit not in matvecs:
            continue
        if unit == ("blocks" if panels else "blocks_panels"):   # one of the two specializations
            continue
        if unit == "linear" and blocks:          # the block driver's specialization holds q8 and f32 too
            continue
        if unit in ("kpanels_gemm", "kquant_gemm_q6k") and not (blocks and panels):
            continue
        if unit == "embed_blocks" and not embed_blocks:
            continue
        if unit == ("row_ops_layernorm" if "LAYERNORM" not in ops else "row_ops"):   # one of the two
            continue
        if unit == "f32_rows" and not f32_linear:
            continue
        if unit.startswith("attention") and unit != ("attention", "attention_f16", "attention_q8")[int(kv16)]:
            continue
        if needs is None or ops & set(needs):
            out.append(unit)
    out.append(run_unit({"linear_state": linear_state, "blocks": blocks, "panels": blocks and panels,
                         "embed_blocks": embed_blocks,
                         "layernorm": "LAYERNORM" in ops, "kv16": kv16}))
    return out


def called_by_run(unit: str) -> bool:
    """Whether interpreter.run calls the unit's kernels (so they are loaded before its first call)."""
    return UNITS[unit][3]


def split(units: list[str], cache_locked: bool | None = None) -> tuple[list[str], list[str]]:
    """(this process's units, the child's), whole groups each. With the cache lock the groups
    holding a unit ``run`` does not call go to the child (this process compiles ``run`` meanwhile),
    then the others, largest first, to the side with less work so far (this process starts with
    PARENT_HEAD_START and RUN_COST). Without the lock the :data:`LOAD_GROUPS` stay here. The
    child's list has the units ``run`` calls first, so the first step can run before the child ends."""
    if cache_locked is None:
        cache_locked = numba_cache_lock.INSTALLED
    groups: dict[str, list[str]] = {}
    for u in units:
        if u in UNITS:
            groups.setdefault(UNITS[u][2], []).append(u)
    cost = {g: sum(UNITS[u][1] for u in us) for g, us in groups.items()}
    if cache_locked:
        here, there = [], [g for g, us in groups.items() if not all(map(called_by_run, us))]
    else:
        here, there = [g for g in groups if g in LOAD_GROUPS], []
    load_here = PARENT_HEAD_START + RUN_COST + sum(cost[g] for g in here)
    load_child = sum(cost[g] for g in there)
    for g in sorted((g for g in groups if g not in here and g not in there), key=lambda g: -cost[g]):
        if load_child < load_here:
            there.append(g)
            load_child += cost[g]
        else:
            here.append(g)
            load_here += cost[g]
    mine = [u for g in here for u in groups[g]]
    child = [u for g in there for u in groups[g]]
    return mine, sorted(child, key=lambda u: not called_by_run(u))


# ---- the cache ---------------------------------------------------------------------------------------


def is_cached(dispatcher, sig) -> bool:
    """True when ``dispatcher`` has ``sig`` compiled in this process or in numba's on-disk cache
    (numba internals; False when they cannot tell, which only costs a progress line)."""
    sig = tuple(sig)
    try:
        if sig in dispatcher.overloads:
            return True
        cache = dispatcher._cache
        key = cache._index_key(sig, dispatcher.targetctx.codegen())
        return key in cache._cache_file._load_index()
    except Exception:  # noqa: BLE001 - numba internals moved: assume not cached
        return False


def unit_cached(unit: str) -> bool:
    return all(is_cached(d, s) for d, s in _kernels(unit))


def compile_unit(unit: str) -> None:
    """Compile (or load from the cache) every kernel of ``unit``."""
    for dispatcher, sig in _kernels(unit):
        dispatcher.compile(sig)


# ---- progress -------------------------------------------------------------------------------------------


class _Progress:
    """``cpullm: compiling kernels 7/12 (first run only; cached afterwards)`` on stderr, rewritten
    in place; nothing unless stderr is a terminal."""

    def __init__(self, total: int, stream=None):
        self.stream = stream or sys.stderr
        self.total, self.done = total, 0
        self.lock = threading.Lock()
        try:
            self.live = self.stream.isatty() and os.environ.get("CPULLM_QUIET") != "1"
        except (AttributeError, ValueError):
            self.live = False
        self.shown = False

    def step(self, n: int = 1) -> None:
        with self.lock:
            self.done = min(self.total, self.done + n)
            if self.live:
                self.stream.write(f"\rcpullm: compiling kernels {self.done}/{self.total} "
                                  "(first run only; cached afterwards)")
                self.stream.flush()
                self.shown = True

    def close(self) -> None:
        with self.lock:
            if self.shown:
                self.stream.write("\n")
                self.stream.flush()
                self.shown = False


# ---- the child process ---------------------------------------------------------------------------------

_CHILD = r"""
import os, sys
if sys.path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]            # the working directory must not shadow the installed package
from cpullm_kernels.setup import warmup
while True:                    # ask for a unit, compile it, report it; an empty answer ends
    print("next", flush=True)
    unit = sys.stdin.readline().strip()
    if not unit:
        break
    warmup.compile_unit(unit)
    print("done", unit, flush=True)
"""


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def use_child() -> bool:
    """Compile in two processes: two CPUs or more, unless CPULLM_COMPILE_PROCESSES=1."""
    return os.environ.get("CPULLM_COMPILE_PROCESSES", "2") != "1" and _cpus() >= 2


class Warmup:
    """Compile ``units`` (from :func:`units_for`): :meth:`start` splits them (:func:`split`) and
    starts the child (nothing happens when every unit is cached); :meth:`finish` compiles the
    rest here, ``run`` once the units it calls are compiled, and waits for the child. ``seconds``
    is the compile time it spent (0.0 when everything came from the cache).

    The split is an estimate (the costs are one machine's, and two compiling processes slow each
    other down differently on each), so the two sides share the work as they go: the child asks
    for its next unit and gets the front of its own list, else a unit from the back of this
    process's; this process, out of its own units, takes one from the back of the child's list
    (the prefill GEMMs, which ``run`` does not wait for). A unit is handed out once."""

    def __init__(self, units: list[str], parallel: bool | None = None):
        self.units = list(units)
        self.parallel = use_child() if parallel is None else parallel
        self.child: subprocess.Popen | None = None
        self.child_units: list[str] = []        # handed to the child, in order
        self.reader: threading.Thread | None = None
        self.progress: _Progress | None = None
        self.todo: list[str] = []
        self.mine: list[str] = []               # not handed out yet: this process's share ...
        self.theirs: list[str] = []             # ... and the child's
        self.runs: list[str] = []
        self.reported: set = set()
        self.reported_change = threading.Condition()   # guards mine, theirs, child_units, reported
        self.compiled_before = 0.0
        self.seconds = 0.0
        self.finished = False

    def start(self) -> "Warmup":
        self.compiled_before = compile_seconds()
        self.todo = [u for u in self.units if not unit_cached(u)]
        if not self.todo:
            return self
        self.progress = _Progress(len(self.units))
        self.progress.step(len(self.units) - len(self.todo))
        self.runs = [u for u in self.todo if u.startswith("run")]
        mine, child = split(self.todo)
        self.mine = [u for u in mine if u not in self.runs]
        self.theirs = list(child)
        if self.parallel and child:
            self._spawn()
        return self

    def _next_for_child(self) -> str:
        """The child's next unit ('' when none is left): the front of its list, else the back of
        this process's."""
        with self.reported_change:
            if self.theirs:
                unit = self.theirs.pop(0)
            elif self.mine and numba_cache_lock.INSTALLED:    # (without the lock: never the same helper
                unit = self.mine.pop()                        # in both processes at once)
            else:
                return ""
            self.child_units.append(unit)
            return unit

    def _next_here(self) -> str:
        """This process's next unit ('' when none is left): the front of its list, else the back
        of the child's (or all of it, without a child)."""
        with self.reported_change:
            if self.mine:
                return self.mine.pop(0)
            if self.theirs and (numba_cache_lock.INSTALLED or self.child is None or self.child.poll() is not None):
                return self.theirs.pop()
            return ""

    def _spawn(self) -> None:
        try:
            self.child = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, stdin=subprocess.PIPE, text=True)
        except OSError:
            self.child = None
            return

        def serve():
            try:
                for line in self.child.stdout:
                    word, _, unit = line.strip().partition(" ")
                    if word == "next":
                        self.child.stdin.write(self._next_for_child() + "\n")
                        self.child.stdin.flush()
                    elif word == "done" and unit in self.child_units and unit not in self.reported:
                        with self.reported_change:
                            self.reported.add(unit)
                            self.reported_change.notify_all()
                        self.progress.step()
            except (OSError, ValueError):       # the child is gone (or being killed)
                pass
            with self.reported_change:           # end of file: the child is gone
                self.reported_change.notify_all()

        self.reader = threading.Thread(target=serve, name="cpullm-compile-share", daemon=True)
        self.reader.start()

    def finish(self) -> float:
        """Compile what is left. Returns the compile time of the warm-up: the time spent here
        (compiling, or waiting for the child) plus what this process compiled since
        :meth:`start` (the weight quantizer, say); 0.0 when every kernel came from the cache."""
        if self.finished:
            return self.seconds
        self.finished = True
        if not self.todo:
            for u in self.units:           # load from the cache now, not on the first call
                compile_unit(u)
            return 0.0
        t0 = time.perf_counter()
        meanwhile = compile_seconds() - self.compiled_before
        try:
            runs = list(self.runs)
            while True:
                if runs and self._run_callees_ready():       # (it links the copy and EMBED kernels, maybe the child's)
                    self._load_child_units(lambda u: called_by_run(u))
                    compile_unit(runs.pop(0))
                    self.progress.step()
                    continue
                unit = self._next_here()
                if unit:
                    compile_unit(unit)
                    self.progress.step()
                elif runs:                 # nothing left to take: wait for run's callees
                    self._wait_for_child([u for u in self.child_units + self.theirs if called_by_run(u)])
                elif self.theirs and self.child is not None and self.child.poll() is None:
                    self._wait_for_child(self.child_units + self.theirs)    # (no cache lock: not shared)
                else:
                    break
            self._wait_for_child(self.child_units)
            self._load_child_units(lambda u: True)
            for u in self.units:
                if u not in self.todo:
                    compile_unit(u)
        finally:
            if self.child is not None and self.child.poll() is None:
                self.child.kill()
                self.child.wait()
            self.progress.close()
        self.seconds = meanwhile + time.perf_counter() - t0
        return self.seconds

    def _run_callees_ready(self) -> bool:
        """Whether every unit ``run`` calls is compiled: none waits to be handed out, and the
        child reported those it was handed (or is gone)."""
        with self.reported_change:
            if any(called_by_run(u) for u in self.mine + self.theirs):
                return False
            gone = self.child is None or self.child.poll() is not None
            return gone or all(u in self.reported for u in self.child_units if called_by_run(u))

    def _load_child_units(self, which) -> None:
        """Load what the child wrote (compiling here what it did not) of its units that ``which``
        selects."""
        for u in list(self.child_units):
            if which(u):
                compile_unit(u)
                with self.reported_change:
                    new = u not in self.reported
                    self.reported.add(u)
                if new:
                    self.progress.step()

    def _wait_for_child(self, units: list[str]) -> None:
        """Until the child reported every unit of ``units`` or ended."""
        if self.child is None:
            return
        with self.reported_change:
            while not set(units) <= self.reported and self.child.poll() is None:
                self.reported_change.wait(timeout=0.5)
        if not set(units) <= self.reported:
            self.child.wait()
            if self.reader is not None:
                self.reader.join(timeout=5)

    def cancel(self) -> None:
        """Stop the child (the load failed): nothing it wrote is half-written (numba replaces
        cache files whole)."""
        self.finished = True
        if self.child is not None and self.child.poll() is None:
            self.child.kill()
            self.child.wait()
        if self.progress is not None:
            self.progress.close()


def warmup_for_graph(graph, quant: str, kernels=(), q8_prefill: bool = True, blocks: bool | None = None,
                     embed_blocks: bool | None = None, kv16: int = 0, panels: bool | None = None,
                     block_formats=None) -> Warmup:
    """A started :class:`Warmup` for the units ``graph`` needs (``kernels``: plugin KernelSpecs,
    whose ops the interpreter does not run; the rest: see :func:`units_for`)."""
    ops, linear_state, f32_linear = set(), False, quant == "f32"
    for n in graph.nodes:
        ops.add(n.op.name)
        if n.op.name == "GATED_DELTA" and not any(int(k.op) == int(n.op) and k.supports(n) for k in kernels):
            linear_state = True
        if n.op.name == "LINEAR" and n.attr("precision") == "f32":      # kept float32 in every mode
            f32_linear = True
    kv16 = int(kv16) if "ATTENTION" in ops else 0      # as run_flags reads it off the compiled program
    return Warmup(units_for(ops, quant, linear_state, q8_prefill, blocks, embed_blocks, kv16, panels,
                            f32_linear, block_formats)).start()


__all__ = ["Warmup", "compile_seconds", "compile_unit", "is_cached", "units_for", "split",
           "warmup_for_graph"]
