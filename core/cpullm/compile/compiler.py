"""IR + weights -> ExecutionProgram: fuse, quantize, pack, pick kernels, plan every buffer.

The program is plain arrays plus a JSON-able ``meta`` dict, so the execution cache stores it
without pickle (cpullm.compile.cache_format) and maps it back.

Passes, in the order :func:`compile_graph` runs them:
1. fuse   (_fuse_linears) LINEAR nodes of one section that read the same value become one
          matrix (q/k/v, gate/up, Gated DeltaNet input projections); each member's output is a
          column view.
2. layout (_value_layout) every value resolves to a base buffer and a column in it.
3. plan   (_plan_arena) arena offsets by liveness, first fit.
4. emit   (_Emitter) one row of the instruction table per physical op (columns:
          cpullm_kernels.program.program_table). Each row packs its op's weights (_WeightPacker) and
          places its state (_StatePlan: KV caches, full or ring, and linear-attention states) as
          it is written, so blobs and state follow the program's order. Weights go into flat
          blobs: ``wq`` int8 + ``ws`` binary16 scales (q8, block 32; or raw ggml blocks) or
          ``wf`` float32; one copy per tensor identity (source, transform, rows:
          ``ResolvedWeights.identity``), so tied tensors are packed once (embedding and lm_head
          share one matrix) while two canonical tensors read from one stored tensor with
          different transforms stay apart. ``meta["weight_slots"]`` says where each canonical
          tensor went (the conformance kit reads the program back against the weight map).
5. assemble (_assemble) the tables, the built blobs and the meta the executor reads.

The greedy lm_head screen is added afterwards by :func:`cpullm.compile.head_screen.attach` (the caller's step:
its calibration runs the compiled program).
"""
from __future__ import annotations

import hashlib
import os
from typing import Callable

import attrs
import numpy as np

from ..graph.blocks import PRECISIONS
from ..graph.ir import Graph, GraphError, Node, Op, VIEW_OPS, plain_attrs, plugin_spec
from cpullm_kernels.program import program_table as P
from cpullm_kernels.program.formats import weight_format
from .aligned import aligned_empty, aligned_zeros
from .quant_blocks import BLOCK_QUANTS, BlockPlan, q8_0_as_q8, quantize_q4_rows, stored_blocks

QUANT_MODES = ("int8", "f32", "q4", "gguf")     # q4 / gguf: raw ggml blocks (cpullm.compile.quant_blocks)
HEAD_ROWS = 16          # head (final norm + lm_head) runs on at most this many rows at once
DEFAULT_CHUNK = 512     # prefill rows per chunk


@attrs.define
class Program:
    """What the executor runs. ``arrays`` are flat numpy arrays; ``meta`` is JSON-able."""

    arrays: dict
    meta: dict

    @property
    def I(self):
        return self.arrays["I"]

    @property
    def F(self):
        return self.arrays["F"]


def align_up(n: int, a: int = 16) -> int:
    return (n + a - 1) // a * a


class _Blob:
    """Append-only flat buffer builder for one dtype."""

    def __init__(self, dtype):
        self.parts, self.size, self.dtype = [], 0, dtype

    def add(self, arr: np.ndarray) -> int:
        arr = np.ascontiguousarray(arr, dtype=self.dtype).reshape(-1)
        off = self.size
        pad = align_up(arr.size) - arr.size
        self.parts.append(arr)
        if pad:
            self.parts.append(np.zeros(pad, self.dtype))
        self.size += arr.size + pad
        return off

    def extend(self, arr: np.ndarray) -> int:
        """Append without padding (a matrix packed row block by row block stays contiguous)."""
        arr = np.ascontiguousarray(arr, dtype=self.dtype).reshape(-1)
        off = self.size
        self.parts.append(arr)
        self.size += arr.size
        return off

    def pad(self) -> None:
        n = align_up(self.size) - self.size
        if n:
            self.parts.append(np.zeros(n, self.dtype))
            self.size += n

    def build(self) -> np.ndarray:
        if not self.parts:
            return aligned_zeros(16, self.dtype)
        return np.concatenate(self.parts, out=aligned_empty(self.size, self.dtype))


class _Scratch:
    """One float32 buffer for every matrix compile_graph quantizes, one after another: fresh
    memory is slow to touch on some VMs (seconds per GB), and each matrix is dropped once packed."""

    def __init__(self):
        self.buf = np.empty(0, np.float32)

    def take(self, shape: tuple) -> np.ndarray:
        n = int(np.prod(shape))
        if self.buf.size < n:
            self.buf = np.empty(n, np.float32)
        return self.buf[:n].reshape(shape)


ROW_BLOCK_FLOATS = 1 << 24   # float32 values of one matrix held at once while packing q8 (64 MB)
Q4_ROW_BLOCK_FLOATS = 1 << 22  # ... while quantizing q4's blocks (16 MB: their temporaries are 2-7x it)


def _new_blob(workdir, name: str, dtype):
    """A weight blob: in memory (``_Blob``), or written to ``workdir/<name>.bin`` as it grows."""
    if workdir is None:
        return _Blob(dtype)
    from .filearrays import FileBlob
    return FileBlob(os.path.join(str(workdir), f"{name}.bin"), dtype)


def _float_row_blocks(weights, canonicals: list[str], scratch, max_floats: int):
    """The row-stacked matrix of ``canonicals`` as float32 row blocks of at most ``max_floats``
    values, each read into ``scratch`` (so valid until the next one); a tensor's mapped source
    pages are released once its rows are read. Yields (rows, K) arrays."""
    K = int(weights.shape(canonicals[0])[1])
    step = max(16, max_floats // max(K, 1) // 16 * 16)      # whole panels of 16 rows (kquant_panels)
    get_rows = getattr(weights, "get_rows", None)
    for c in canonicals:
        n = int(weights.shape(c)[0])
        if get_rows is None:                                    # a plain mapping of tensors
            mat = scratch.take((n, K))
            weights.get(c, out=mat)
            yield mat
        else:
            for r0 in range(0, n, step):
                mat = scratch.take((min(n, r0 + step) - r0, K))
                get_rows(c, r0, r0 + mat.shape[0], mat)
                yield mat
        if hasattr(weights, "release"):
            weights.release(c)


class _PanelWriter:
    """Appends q8 rows to ``wq``/``ws`` in the panel layout the q8 kernels read
    (cpullm_kernels.panels.q8_panels: 16 rows interleaved by pairs of values, rows padded with zeros to a
    multiple of 64), as row blocks arrive: rows wait until a whole 64-row group is there."""

    def __init__(self, wq, ws):
        self.wq, self.ws = wq, ws
        self.q, self.s = [], []
        self.waiting = 0
        self.w_off = self.s_off = None
        self.rows = 0

    def add(self, q, s) -> None:
        """q int8 (rows, Kp), s uint16 (rows, Kp // 32)."""
        from cpullm_kernels.panels.q8_panels import ROW_ALIGN
        self.q.append(q)
        self.s.append(s)
        self.waiting += q.shape[0]
        self.rows += q.shape[0]
        if self.waiting >= ROW_ALIGN:
            self._flush(self.waiting // ROW_ALIGN * ROW_ALIGN)

    def _flush(self, n: int) -> None:
        q = self.q[0] if len(self.q) == 1 else np.concatenate(self.q)
        s = self.s[0] if len(self.s) == 1 else np.concatenate(self.s)
        packed = weight_format(P.WEIGHT_Q8).pack(-1, q[:n], s[:n])
        wo, so = self.wq.extend(packed["wq"]), self.ws.extend(packed["ws"])
        self.w_off = wo if self.w_off is None else self.w_off
        self.s_off = so if self.s_off is None else self.s_off
        self.q, self.s = [q[n:]], [s[n:]]
        self.waiting -= n

    def finish(self) -> tuple[int, int]:
        """(wq offset, ws offset) of the matrix, its last group padded with zero rows."""
        if self.waiting:
            self._flush(self.waiting)
        if self.w_off is None:                                  # no rows at all
            self.w_off, self.s_off = self.wq.size, self.ws.size
        self.wq.pad()
        self.ws.pad()
        return self.w_off, self.s_off


def _pack_q8_rows(weights, canonicals: list[str], quantize, wq, ws, scratch) -> tuple:
    """Quantize the row-stacked matrix of ``canonicals`` into ``wq``/``ws`` (panel layout) one row
    block at a time (at most ROW_BLOCK_FLOATS float32 values: q8 scales are per row and block of
    32, so row blocks give the same bytes as the whole matrix), releasing each block's source
    pages once read. Returns (wq offset, ws offset, Kp, rows). A 128256 x 3072 embedding is
    1.6 GB as one float32 matrix, 64 MB a block."""
    from cpullm_kernels.rows.q8 import padded_k
    writer = _PanelWriter(wq, ws)
    for mat in _float_row_blocks(weights, canonicals, scratch, ROW_BLOCK_FLOATS):
        writer.add(*quantize(mat))                              # (rows, Kp) int8, (rows, Kp/32) uint16
    w_off, s_off = writer.finish()
    return w_off, s_off, padded_k(int(weights.shape(canonicals[0])[1])), writer.rows


@attrs.define
class _Phys:
    """A physical op to emit: one IR node, or a fused group of LINEAR nodes."""

    nodes: list            # member IR nodes (1 unless fused)
    output: str            # value holding the (fused) output
    width: int


def _fuse_linears(graph: Graph, weight_format: Callable | None = None) -> tuple[list[_Phys], dict]:
    """Group LINEARs reading the same value in one section (and, given ``weight_format(node)``,
    stored in the same block format); returns physical ops and the views
    {member output: (fused output, column start)}."""
    fmt = weight_format or (lambda n: None)
    groups: dict[tuple, list[Node]] = {}
    for n in graph.nodes:
        if n.op == Op.LINEAR and n.name != "lm_head":
            groups.setdefault((n.section, n.inputs[0], n.attr("precision"), fmt(n)), []).append(n)
    views, emitted, phys = {}, set(), []
    for n in graph.nodes:
        if n.name in emitted:
            continue
        key = ((n.section, n.inputs[0], n.attr("precision"), fmt(n))
               if n.op == Op.LINEAR and n.name != "lm_head" else None)
        members = groups.get(key, [n]) if key else [n]
        if len(members) > 1:
            fused = "+".join(m.name for m in members)
            start = 0
            for m in members:
                views[m.output] = (fused, start)
                start += m.width
                emitted.add(m.name)
            phys.append(_Phys(nodes=members, output=fused, width=start))
        else:
            emitted.add(n.name)
            phys.append(_Phys(nodes=[n], output=n.output, width=n.width))
    return phys, views


def compile_graph(graph: Graph, weights, *, quant: str = "int8", n_ctx: int = 4096,
                  max_chunk: int = DEFAULT_CHUNK, kernels: list | None = None,
                  quantize: Callable | None = None, progress: Callable | None = None,
                  workdir=None, kv_dtype: str = "f32") -> Program:
    """Compile ``graph`` with ``weights`` (cpullm.loading.weightmap.ResolvedWeights).

    ``quant``: "int8" (q8 block-32 weights for every LINEAR and the embedding), "f32", or a mode
    with raw ggml-block matrices (cpullm.compile.quant_blocks: "q4", "gguf"; a matrix it leaves out is int8).
    ``kernels``: KernelSpecs from plugins; the first whose ``supports(node)`` is true replaces
    the reference kernel of that node.
    A LINEAR or EMBED node's ``precision`` attribute overrides ``quant`` for its weights
    (``"f32"``: kept float32 in every mode); only LINEARs of equal precision are fused. A PLUGIN
    node's ``OpSpec.matrices`` are packed like LINEAR matrices (its precision applies; in q4 mode
    Q4_K or Q5_0 by row length, in gguf mode the file's own blocks).
    ``workdir``: a directory where the weight blobs are written as they are packed
    (``<name>.bin``) and mapped back (cpullm.compile.filearrays), instead of joined in memory: the build
    then holds one row block of a matrix at a time, not the model.
    ``kv_dtype``: the KV caches' format, "f32" or "f16" (cpullm.compile.kvformat; cpullm.load picks the
    default by quant).
    """
    from cpullm_kernels.rows.q8 import quantize_weight_q8
    from .kvformat import resolve_kv_dtype

    _check_quant(quant)
    kv_dtype = resolve_kv_dtype(kv_dtype, quant)
    block_plan = _block_plan(graph, weights, quant)
    phys, views = _fuse_linears(graph, block_plan.fmt if block_plan else None)            # 1. fuse
    layout = _value_layout(graph, phys, views)                                             # 2. layout
    order = [p for p in phys if p.nodes[0].op not in VIEW_OPS]     # the ops that get a row
    _plan_arena(graph, order, layout, max_chunk)                                           # 3. plan
    packer = _WeightPacker(weights, quant, block_plan, quantize or quantize_weight_q8, workdir, progress)
    emitter = _Emitter(layout, packer, weights, kernels or [], n_ctx=n_ctx, max_chunk=max_chunk,
                       kv_dtype=kv_dtype)
    for p in order:                                                                        # 4. emit
        emitter.emit(p)
    return _assemble(graph, layout, packer, emitter, quant=quant, n_ctx=n_ctx, max_chunk=max_chunk)  # 5.


def _check_quant(quant: str) -> None:
    """Reject a quant mode the compiler does not know."""
    if quant not in QUANT_MODES:
        from ..errors import ConfigError
        raise ConfigError(f"quant must be one of {', '.join(QUANT_MODES)}, not {quant!r}")


@attrs.define
class _Layout:
    """Where every value lives: its base buffer (a physical op's output) plus a column offset, and
    each base buffer's width, section and arena offset (filled by :func:`_plan_arena`)."""

    views: dict             # fused member output -> (fused output, column start)
    nodes_by_out: dict      # value -> the IR node writing it
    widths: dict            # base buffer -> row width (floats)
    section_of: dict        # base buffer -> "body" | "head"
    offsets: dict = attrs.Factory(dict)     # base buffer -> arena offset (floats)
    arena_size: int = 0

    def base_of(self, value: str) -> tuple[str, int]:
        """(base buffer, column offset) of ``value``: views resolve to what they view."""
        if value in self.views:
            return self.views[value]
        n = self.nodes_by_out.get(value)
        if n is not None and n.op in VIEW_OPS:
            b, c = self.base_of(n.inputs[0])
            return b, c + n.attr("start")
        return value, 0

    def loc(self, value: str) -> tuple[int, int]:
        """(arena offset, row stride) of ``value``."""
        b, c = self.base_of(value)
        return self.offsets[b] + c, self.widths[b]

    def rows(self, base: str, max_chunk: int) -> int:
        """Rows a base buffer holds: a prefill chunk in the body, HEAD_ROWS in the head."""
        return max_chunk if self.section_of[base] == "body" else HEAD_ROWS


def _value_layout(graph: Graph, phys: list[_Phys], views: dict) -> _Layout:
    """Resolve values to base buffers: one per physical op that is not a view."""
    return _Layout(views=views, nodes_by_out={n.output: n for n in graph.nodes},
                   widths={p.output: p.width for p in phys if p.nodes[0].op not in VIEW_OPS},
                   section_of={p.output: p.nodes[0].section for p in phys})


def _plan_arena(graph: Graph, order: list[_Phys], layout: _Layout, max_chunk: int) -> None:
    """Place every base buffer in the arena, first fit, reusing a buffer's space after its last
    reader (the hidden state and the logits stay live through the head, which re-reads hidden)."""
    base_of = layout.base_of
    last_use: dict[str, int] = {}
    for idx, p in enumerate(order):
        for m in p.nodes:
            for inp in m.inputs:
                last_use[base_of(inp)[0]] = idx
    head_end = len(order)
    hidden_base = base_of(graph.hidden)[0]
    last_use[hidden_base] = head_end            # the head re-reads hidden for each row group
    last_use[base_of(graph.output)[0]] = head_end

    offsets, free, arena_size = layout.offsets, [], 0       # free: list of (offset, size)
    for idx, p in enumerate(order):
        size = align_up(layout.rows(p.output, max_chunk) * layout.widths[p.output], 64)
        spot = None
        for j, (off, sz) in enumerate(free):
            if sz >= size:
                spot = off
                if sz == size:
                    free.pop(j)
                else:
                    free[j] = (off + size, sz - size)
                break
        if spot is None:
            spot, arena_size = arena_size, arena_size + size
        offsets[p.output] = spot
        for m in p.nodes:
            for inp in m.inputs:
                b = base_of(inp)[0]
                if last_use.get(b) == idx and b in offsets and b not in (hidden_base,):
                    free.append((offsets[b], align_up(layout.rows(b, max_chunk) * layout.widths[b], 64)))
                    last_use[b] = -1
        free.sort()
        free = _merge(free)
    layout.arena_size = arena_size


class _WeightPacker:
    """Packs weights into the flat blobs ``wq`` (int8 / raw block bytes), ``ws`` (binary16 scales)
    and ``wf`` (float32), one copy per tensor identity, and records where each canonical tensor
    went (``meta["weight_slots"]``)."""

    def __init__(self, weights, quant: str, block_plan, quantize: Callable, workdir, progress):
        self.weights, self.quant, self.block_plan = weights, quant, block_plan
        self.quantize, self.progress = quantize, progress
        self.wq, self.ws, self.wf = (_new_blob(workdir, name, dtype)
                                     for name, dtype in (("wq", np.int8), ("ws", np.uint16), ("wf", np.float32)))
        self.scratch = _Scratch()
        self.packed: dict[tuple, tuple] = {}    # (identities, kind) -> (kind, w_off, s_off, Kp, rows)
        self.block_bytes: dict[str, int] = {}   # block format -> bytes of raw-block matrices
        self.fparams: dict = {}                 # identity -> (wf offset, size)
        # canonical -> [kind "f32" | "q8", offset, size, row length, scale offset or -1]: where
        # each matrix and float parameter went (read back by the conformance kit); a q8 slot's
        # offsets are its (fused) matrix's, in the panel layout, and a sixth item is its first row
        self.slots: dict[str, list] = {}
        self.identity = getattr(weights, "identity", weights.source_of)

    def f32_param(self, canonical: str) -> int:
        """wf offset of a float32 parameter (norm weight, bias, ...), packed once per identity."""
        weights = self.weights
        key = self.identity(canonical) if canonical in weights else canonical
        if key not in self.fparams:
            arr = weights.get(canonical)
            self.fparams[key] = (self.wf.add(arr), int(arr.size))
        off, size = self.fparams[key]
        self.slots.setdefault(canonical, ["f32", off, size, size, -1])
        return off

    def matrix(self, canonicals: list[str], node: Node | None = None, block_fmt: str | None = None) -> tuple:
        """(kind, w_off, s_off, Kp, rows) of the row-stacked matrix of ``canonicals``, in the
        weight mode of ``node`` (its precision, else the quant mode); ``block_fmt``: the block
        format of a matrix the BlockPlan does not place (a plugin op's), None: the plan's."""
        quant, block_plan = self.quant, self.block_plan
        mode = _precision(node, quant) if node is not None else quant
        fmt = block_plan.fmt(node) if block_plan and node is not None and mode == quant else None
        if block_fmt is not None and block_plan and mode == quant:
            fmt = block_fmt
        if mode in BLOCK_QUANTS:
            mode = f"blocks:{fmt}" if fmt else "int8"
        key = (tuple(self.identity(c) for c in canonicals), mode)
        if key not in self.packed:
            self.packed[key] = self._pack_blocks(canonicals, fmt) if fmt else self._pack(canonicals, mode)
            if self.progress:
                self.progress(canonicals[0])
        kind, w_off, s_off, Kp, _ = self.packed[key]
        slot = weight_format(kind).slot
        r0 = 0
        for c in canonicals:                # member rows of a fused matrix, for the weight slots
            n = int(self.weights.shape(c)[0])
            self.slots.setdefault(c, slot(w_off, s_off, Kp, r0, n))
            r0 += n
        return self.packed[key]

    def bias(self, nodes: list[Node]) -> int:
        """wf offset of the fused bias of LINEAR ``nodes`` (zeros for a member without one), or
        -1 when none has a bias."""
        if not any(m.weight("bias") for m in nodes):
            return -1
        bias = np.concatenate([self.weights.get(m.weight("bias")) if m.weight("bias")
                               else np.zeros(m.width, np.float32) for m in nodes])
        return self.wf.add(bias)

    def _pack_blocks(self, canonicals: list[str], fmt: str) -> tuple:
        """(kind, w_off, s_off, Kp, rows) of a raw-block matrix: the file's blocks (gguf mode) or
        quantized a row block at a time (q4 mode). Q8_0 goes in as q8, the same values (q8's
        kernels); q4's quantizer keeps |q| <= 127, and a file's Q8_0 with a -128 stays blocks."""
        from cpullm_kernels.panels import kquant_panels
        from cpullm_kernels.rows.gguf_blocks import block_format
        # Q4_K / Q6_K in panels of 16 rows (the file's bytes in another order): every member's
        # rows whole panels, so that each row block below is too
        ggml = block_format(fmt).ggml_type
        paneled = (ggml in kquant_panels.FORMATS
                   and all(int(self.weights.shape(c)[0]) % kquant_panels.PANEL == 0 for c in canonicals))
        if self.quant == "gguf":
            data, Kp = stored_blocks(self.weights, canonicals, fmt)          # uint8 (N, row bytes)
            parts = [(data, Kp)]
        else:
            parts = (quantize_q4_rows(mat, fmt)
                     for mat in _float_row_blocks(self.weights, canonicals, self.scratch, Q4_ROW_BLOCK_FLOATS))
        w_off = s_off = None
        kind, Kp, rows = None, 0, 0
        panels = _PanelWriter(self.wq, self.ws)
        for data, Kp in parts:
            as_q8 = q8_0_as_q8(data, Kp) if fmt == "Q8_0" else None
            if as_q8 is None:
                self.block_bytes[fmt] = self.block_bytes.get(fmt, 0) + int(data.size)
            if kind is None:
                kind = P.WEIGHT_Q8 if as_q8 is not None else P.WEIGHT_BLOCKS
            if (as_q8 is not None) != (kind == P.WEIGHT_Q8):
                raise ValueError(f"{canonicals}: Q8_0 row blocks neither all q8 nor all raw")
            rows += data.shape[0]           # (N, row bytes): counted before a panel pack regroups them
            if kind == P.WEIGHT_Q8:
                panels.add(*as_q8)
            else:
                so = ggml + kquant_panels.PANELED * paneled
                wo = self.wq.extend(weight_format(P.WEIGHT_BLOCKS).pack(so, data)["wq"])
                w_off = wo if w_off is None else w_off
                s_off = so if s_off is None else s_off
        if kind == P.WEIGHT_Q8:             # Q8_0 as q8 panels: what they hold, padding rows included
            from cpullm_kernels.panels.q8_panels import padded_rows
            w_off, s_off = panels.finish()
            self.block_bytes[fmt] = self.block_bytes.get(fmt, 0) + padded_rows(rows) * (Kp + Kp // 16)
        if kind is None:                    # no rows
            kind, w_off, s_off = P.WEIGHT_BLOCKS, self.wq.size, block_format(fmt).ggml_type
        self.wq.pad()
        self.ws.pad()
        return kind, w_off, s_off, Kp, rows

    def _pack(self, canonicals: list[str], mode: str) -> tuple:
        if mode == "int8":                 # row blocks of float32 only live until quantized
            w_off, s_off, Kp, n = _pack_q8_rows(self.weights, canonicals, self.quantize, self.wq, self.ws,
                                                self.scratch)
            return P.WEIGHT_Q8, w_off, s_off, Kp, n
        mats = [self.weights.get(c) for c in canonicals]
        mat = mats[0] if len(mats) == 1 else np.concatenate(mats, axis=0)
        w_off = self.wf.add(weight_format(P.WEIGHT_F32).pack(-1, mat)["wf"])
        return P.WEIGHT_F32, w_off, -1, mat.shape[1], mat.shape[0]


class _StatePlan:
    """The ``state`` array's regions: KV caches and linear-attention states, one per node."""

    def __init__(self):
        self.regions: list[dict] = []
        self.size = 0

    def add(self, node: Node, floats: int, kind: str, **info) -> int:
        """Offset of a new region of ``floats`` for ``node`` (64-float aligned)."""
        off = self.size
        self.size = align_up(self.size + floats, 64)
        self.regions.append({"node": node.name, "kind": kind, "offset": off, "floats": floats, **info})
        return off


class _Emitter:
    """Writes the instruction table, one row per physical op (columns: cpullm_kernels.program.program_table),
    packing each op's weights and placing its state as it goes, so blobs and state follow the
    program's order."""

    def __init__(self, layout: _Layout, packer: _WeightPacker, weights, kernels: list, *, n_ctx: int,
                 max_chunk: int, kv_dtype: str = "f32"):
        self.layout, self.packer, self.weights, self.kernels = layout, packer, weights, kernels
        self.n_ctx, self.max_chunk, self.kv_dtype = n_ctx, max_chunk, kv_dtype
        self.states = _StatePlan()
        self.rows_I, self.rows_F, self.names, self.groups = [], [], [], []
        self.external: dict[int, str] = {}       # row -> KernelSpec name replacing its kernel
        self.plugin_calls: dict[str, dict] = {}  # row -> how the executor calls a plugin op
        self.moe_calls: dict[str, dict] = {}     # row -> a MOE's operands and expert table (kernels.moe)
        self.max_k, self.embed_rows = 32, 0
        self.position_limit = 0                  # POS_EMBED: positions its tables hold (0: none)

    def emit(self, p: _Phys) -> None:
        """Append the row of physical op ``p``."""
        n = p.nodes[0]
        method = _EMITTERS.get(n.op)
        if method is None:
            raise GraphError(f"{n.name}: the compiler has no emitter for op {n.op.name}")
        Ir = np.full(P.NI, -1, np.int64)
        Fr = np.zeros(P.NF, np.float64)
        _fill(Ir, {P.COL_OP: int(n.op), P.COL_IMPL: P.IMPL_INTERPRETER,
                   P.COL_SECTION: P.SECTION_BODY if n.section == "body" else P.SECTION_HEAD})
        getattr(self, method)(p, n, Ir, Fr, *self.layout.loc(p.output))
        for spec in self.kernels:
            if int(spec.op) == int(n.op) and spec.supports(n):
                Ir[P.COL_IMPL] = P.IMPL_EXTERNAL
                self.external[len(self.rows_I)] = spec.name
                break
        self.rows_I.append(Ir)
        self.rows_F.append(Fr)
        self.names.append(p.output)
        self.groups.append(n.group or n.op.name.lower())

    # One method per column layout: (physical op, its first node, its I row, its F row, output offset, stride).
    def linear(self, phys, n, Ir, Fr, out_off, out_st):
        x_off, x_st = self.layout.loc(n.inputs[0])
        Kdim = self.layout.nodes_by_out[n.inputs[0]].width
        kind, w_off, s_off, Kp, _ = self.packer.matrix([m.weight("weight") for m in phys.nodes], n)
        bias_off = self.packer.bias(phys.nodes)
        _fill(Ir, {P.LINEAR_X_OFF: x_off, P.LINEAR_X_ST: x_st, P.LINEAR_OUT_OFF: out_off,
                   P.LINEAR_OUT_ST: out_st, P.LINEAR_K: Kdim, P.LINEAR_N: phys.width, P.LINEAR_KIND: kind,
                   P.LINEAR_W_OFF: w_off, P.LINEAR_S_OFF: s_off, P.LINEAR_KP: Kp, P.LINEAR_BIAS_OFF: bias_off})
        self.max_k = max(self.max_k, Kp)

    def embed(self, phys, n, Ir, Fr, out_off, out_st):
        kind, w_off, s_off, Kp, self.embed_rows = self.packer.matrix([n.weight("table")], n)
        _fill(Ir, {P.EMBED_OUT_OFF: out_off, P.EMBED_OUT_ST: out_st, P.EMBED_WIDTH: n.width,
                   P.EMBED_KIND: kind, P.EMBED_W_OFF: w_off, P.EMBED_S_OFF: s_off, P.EMBED_KP: Kp})
        Fr[P.F_EMBED_SCALE] = n.attr("scale", 1.0)

    def norm(self, phys, n, Ir, Fr, out_off, out_st):
        x_off, x_st = self.layout.loc(n.inputs[0])
        _fill(Ir, {P.NORM_X_OFF: x_off, P.NORM_X_ST: x_st, P.NORM_OUT_OFF: out_off, P.NORM_OUT_ST: out_st,
                   P.NORM_WIDTH: n.width, P.NORM_GROUP: n.attr("group_size"),
                   P.NORM_W_OFF: self.packer.f32_param(n.weight("weight"))})
        if n.op == Op.LAYERNORM:
            bias = n.weight("bias")
            Ir[P.NORM_BIAS_OFF] = self.packer.f32_param(bias) if bias else -1
        Fr[P.F_NORM_EPS] = n.attr("eps")

    def rope(self, phys, n, Ir, Fr, out_off, out_st):
        x_off, x_st = self.layout.loc(n.inputs[0])
        inv, scaling = _rope_freqs(n, self.n_ctx)
        _fill(Ir, {P.ROPE_X_OFF: x_off, P.ROPE_X_ST: x_st, P.ROPE_OUT_OFF: out_off, P.ROPE_OUT_ST: out_st,
                   P.ROPE_N_HEADS: n.attr("n_heads"), P.ROPE_HEAD_DIM: n.attr("head_dim"),
                   P.ROPE_ROTARY_DIM: n.attr("rotary_dim"), P.ROPE_FREQ_OFF: self.packer.wf.add(inv)})
        Fr[P.F_ROPE_SCALING] = scaling

    def attention(self, phys, n, Ir, Fr, out_off, out_st):
        from cpullm_kernels.attention.attention import padded_cap
        from .kvformat import format_code, region_floats
        (q_off, q_st), (k_off, k_st), (v_off, v_st) = (self.layout.loc(i) for i in n.inputs)
        nkv, hd, window = n.attr("n_kv_heads"), n.attr("head_dim"), n.attr("window")
        n_ctx = self.n_ctx
        cap = padded_cap(n_ctx if not window else min(n_ctx, window + self.max_chunk))   # whole key tiles
        c_off = self.states.add(n, region_floats(nkv, cap, hd, self.kv_dtype), "kv", cap=cap, n_kv_heads=nkv,
                                head_dim=hd, window=window, layer=n.attr("layer"), kv_dtype=self.kv_dtype)
        _fill(Ir, {P.ATTENTION_Q_OFF: q_off, P.ATTENTION_Q_ST: q_st, P.ATTENTION_K_OFF: k_off,
                   P.ATTENTION_K_ST: k_st, P.ATTENTION_V_OFF: v_off, P.ATTENTION_V_ST: v_st,
                   P.ATTENTION_OUT_OFF: out_off, P.ATTENTION_OUT_ST: out_st,
                   P.ATTENTION_N_HEADS: n.attr("n_heads"), P.ATTENTION_N_KV_HEADS: nkv,
                   P.ATTENTION_HEAD_DIM: hd, P.ATTENTION_CACHE_OFF: c_off, P.ATTENTION_CAP: cap,
                   P.ATTENTION_KV_FORMAT: format_code(self.kv_dtype)})
        _fill(Fr, {P.F_ATTENTION_SCALE: n.attr("scale"), P.F_ATTENTION_SOFTCAP: n.attr("softcap"),
                   P.F_ATTENTION_WINDOW: window})

    def glu(self, phys, n, Ir, Fr, out_off, out_st):
        (g_off, g_st), (u_off, u_st) = (self.layout.loc(i) for i in n.inputs)
        act = {"silu": P.GLU_ACT_SILU, "gelu_tanh": P.GLU_ACT_GELU_TANH}[n.attr("act")]
        _fill(Ir, {P.GLU_GATE_OFF: g_off, P.GLU_GATE_ST: g_st, P.GLU_UP_OFF: u_off, P.GLU_UP_ST: u_st,
                   P.GLU_OUT_OFF: out_off, P.GLU_OUT_ST: out_st, P.GLU_WIDTH: n.width, P.GLU_ACT: act})

    def binary(self, phys, n, Ir, Fr, out_off, out_st):
        (a_off, a_st), (b_off, b_st) = (self.layout.loc(i) for i in n.inputs)
        _fill(Ir, {P.BINARY_A_OFF: a_off, P.BINARY_A_ST: a_st, P.BINARY_B_OFF: b_off, P.BINARY_B_ST: b_st,
                   P.BINARY_OUT_OFF: out_off, P.BINARY_OUT_ST: out_st, P.BINARY_WIDTH: n.width})

    def unary(self, phys, n, Ir, Fr, out_off, out_st):
        x_off, x_st = self.layout.loc(n.inputs[0])
        _fill(Ir, {P.UNARY_X_OFF: x_off, P.UNARY_X_ST: x_st, P.UNARY_OUT_OFF: out_off,
                   P.UNARY_OUT_ST: out_st, P.UNARY_WIDTH: n.width})
        if n.op != Op.SELECT_ROWS:
            Fr[P.F_UNARY_PARAM] = n.attr("cap") if n.op == Op.SOFTCAP else n.attr("scale")

    def act(self, phys, n, Ir, Fr, out_off, out_st):
        from cpullm_kernels.ops.pointwise import ACT_KINDS
        x_off, x_st = self.layout.loc(n.inputs[0])
        _fill(Ir, {P.UNARY_X_OFF: x_off, P.UNARY_X_ST: x_st, P.UNARY_OUT_OFF: out_off,
                   P.UNARY_OUT_ST: out_st, P.UNARY_WIDTH: n.width, P.ACT_KIND: ACT_KINDS[n.attr("act")]})

    def pos_embed(self, phys, n, Ir, Fr, out_off, out_st):
        """x + the learned position table's rows; the context must fit the table (a position past
        it has no embedding)."""
        x_off, x_st = self.layout.loc(n.inputs[0])
        rows, offset = n.attr("n_positions"), n.attr("offset", 0)
        shape = tuple(self.weights.shape(n.weight("table")))
        if shape != (rows, n.width):
            raise GraphError(f"{n.name}: position table {n.weight('table')} is {shape}, the node "
                             f"says ({rows}, {n.width})")
        if self.n_ctx + offset > rows:
            from ..errors import ConfigError
            raise ConfigError(f"n_ctx {self.n_ctx} is more than the {rows - offset} positions this model's "
                              f"learned position table holds; load with n_ctx <= {rows - offset} "
                              f"(cpullm.load(..., n_ctx=N) / --ctx N)")
        self.position_limit = min(self.position_limit or rows - offset, rows - offset)
        _fill(Ir, {P.UNARY_X_OFF: x_off, P.UNARY_X_ST: x_st, P.UNARY_OUT_OFF: out_off,
                   P.UNARY_OUT_ST: out_st, P.UNARY_WIDTH: n.width,
                   P.POS_TABLE_OFF: self.packer.f32_param(n.weight("table")), P.POS_OFFSET: offset,
                   P.POS_ROWS: rows})

    def gated_delta(self, phys, n, Ir, Fr, out_off, out_st):
        from cpullm_kernels.attention.gated_delta import state_size
        (qkv_off, qkv_st), (z_off, z_st), (b_off, b_st), (a_off, a_st) = (self.layout.loc(i) for i in n.inputs)
        nk, dk, nv, dv, ck = (n.attr(a) for a in ("n_k_heads", "k_head_dim", "n_v_heads", "v_head_dim", "conv_kernel"))
        conv = self.weights.get(n.weight("conv")).reshape(2 * nk * dk + nv * dv, ck)
        s_off = self.states.add(n, state_size(nk, dk, nv, dv, ck), "linear", layer=n.attr("layer"))
        f32_param = self.packer.f32_param
        _fill(Ir, {P.GATED_DELTA_QKV_OFF: qkv_off, P.GATED_DELTA_QKV_ST: qkv_st,
                   P.GATED_DELTA_Z_OFF: z_off, P.GATED_DELTA_Z_ST: z_st,
                   P.GATED_DELTA_B_OFF: b_off, P.GATED_DELTA_B_ST: b_st,
                   P.GATED_DELTA_A_OFF: a_off, P.GATED_DELTA_A_ST: a_st,
                   P.GATED_DELTA_OUT_OFF: out_off, P.GATED_DELTA_OUT_ST: out_st,
                   P.GATED_DELTA_NK: nk, P.GATED_DELTA_DK: dk, P.GATED_DELTA_NV: nv, P.GATED_DELTA_DV: dv,
                   P.GATED_DELTA_CONV_K: ck, P.GATED_DELTA_CONV_W_OFF: self.packer.wf.add(conv),
                   P.GATED_DELTA_DT_OFF: f32_param(n.weight("dt_bias")),
                   P.GATED_DELTA_ALOG_OFF: f32_param(n.weight("A_log")),
                   P.GATED_DELTA_NORM_OFF: f32_param(n.weight("norm")), P.GATED_DELTA_STATE_OFF: s_off})
        Fr[P.F_GATED_DELTA_EPS] = n.attr("eps")

    def moe(self, phys, n, Ir, Fr, out_off, out_st):
        """Routed experts: every expert matrix packed as a LINEAR's would be (its format chosen by
        the block plan for a LINEAR of that group), the router and the shared gate float32; the
        expert table and sizes go to ``meta["moe"][row]`` (cpullm_kernels.program.moe)."""
        from cpullm_kernels.program import moe as M
        x_off, x_st = self.layout.loc(n.inputs[0])
        E, inter = n.attr("n_experts"), n.attr("intermediate")
        shared_i = int(n.attr("shared_intermediate", 0) or 0)
        table = []
        for e in list(range(E)) + ([E] if shared_i else []):
            prefix = f"experts.{e}" if e < E else "shared"
            row = []
            for part in ("gate_proj", "up_proj", "down_proj"):
                canonical = n.weight(f"{prefix}.{part}")
                kind, w_off, s_off, Kp, _ = self.packer.matrix([canonical], _expert_node(n, prefix, part, canonical))
                row += [int(kind), int(w_off), int(s_off), int(Kp)]
                self.max_k = max(self.max_k, Kp)
            table.append(row)
        shared_gate = n.weight("shared_gate")
        prm = [-1] * M.NPRM
        for col, value in ((M.PRM_X_OFF, x_off), (M.PRM_X_ST, x_st), (M.PRM_OUT_OFF, out_off),
                           (M.PRM_OUT_ST, out_st), (M.PRM_T, 0), (M.PRM_H, n.width), (M.PRM_E, E),
                           (M.PRM_K, n.attr("top_k")), (M.PRM_I, inter), (M.PRM_SHARED_I, shared_i),
                           (M.PRM_ROUTING, M.ROUTINGS[n.attr("routing")]), (M.PRM_NORM_TOPK, int(bool(n.attr("norm_topk")))),
                           (M.PRM_ROUTER_OFF, self.packer.f32_param(n.weight("router"))),
                           (M.PRM_SHARED_GATE_OFF, self.packer.f32_param(shared_gate) if shared_gate else -1),
                           (M.PRM_ACT, {"silu": P.GLU_ACT_SILU}[n.attr("act")])):
            prm[col] = int(value)
        self.moe_calls[str(len(self.rows_I))] = {"node": n.name, "prm": prm, "table": table}
        _fill(Ir, {P.MOE_X_OFF: x_off, P.MOE_X_ST: x_st, P.MOE_OUT_OFF: out_off, P.MOE_OUT_ST: out_st,
                   P.MOE_WIDTH: n.width})

    def plugin(self, phys, n, Ir, Fr, out_off, out_st):
        self.plugin_calls[str(len(self.rows_I))] = _plugin_call(
            n, self.layout.loc, self.layout.nodes_by_out, self.weights, self.packer.f32_param, (out_off, out_st),
            packer=self.packer)
        Ir[P.COL_IMPL] = P.IMPL_PLUGIN_OP


# IR op -> the _Emitter method writing its row (ops sharing a column layout share a method)
_EMITTERS = {
    Op.LINEAR: "linear", Op.EMBED: "embed", Op.RMSNORM: "norm", Op.LAYERNORM: "norm", Op.ROPE: "rope",
    Op.ATTENTION: "attention", Op.GLU: "glu", Op.ADD: "binary", Op.SIGMOID_MUL: "binary",
    Op.SOFTCAP: "unary", Op.SCALE: "unary", Op.SELECT_ROWS: "unary", Op.GATED_DELTA: "gated_delta",
    Op.PLUGIN: "plugin", Op.MOE: "moe",
}
_EMITTERS.update({Op.ACT: "act", Op.POS_EMBED: "pos_embed"})


def _expert_node(n: Node, prefix: str, part: str, canonical: str) -> Node:
    """One expert matrix of MOE node ``n`` as the LINEAR it is (for the block plan's choice of
    format and the packer's precision): group mlp_down for the down projection, else mlp_up."""
    name = f"{n.name}.{prefix}.{part}"
    precision = n.attr("precision")
    return Node(name=name, op=Op.LINEAR, inputs=n.inputs, output=name, width=1,
                weights=(("weight", canonical),), attrs=(("precision", precision),) if precision else (),
                section=n.section, group="mlp_down" if part == "down_proj" else "mlp_up")


def _assemble(graph: Graph, layout: _Layout, packer: _WeightPacker, emitter: _Emitter, *, quant: str,
              n_ctx: int, max_chunk: int) -> Program:
    """The Program: the emitted tables, the built blobs and the meta the executor reads."""
    rows_I = emitter.rows_I
    logits_off, _ = layout.loc(graph.output)
    hidden_off, hidden_st = layout.loc(graph.hidden)
    first_head = next(i for i, row in enumerate(rows_I) if row[P.COL_SECTION] == P.SECTION_HEAD)
    nodes_by_out = layout.nodes_by_out
    meta = {
        "names": emitter.names,
        "groups": emitter.groups,
        "external": {str(k): v for k, v in emitter.external.items()},
        "first_head": first_head,
        "logits_offset": logits_off,
        "vocab": nodes_by_out[graph.output].width,
        "hidden_offset": hidden_off,
        "hidden_width": nodes_by_out[graph.hidden].width,
        "arena_floats": int(layout.arena_size),
        "state_floats": int(emitter.states.size),
        "state_regions": emitter.states.regions,
        "max_chunk": int(max_chunk),
        "head_rows": HEAD_ROWS,
        "n_ctx": int(n_ctx),
        "quant": quant,
        "kv_dtype": emitter.kv_dtype,
        "max_k": int(emitter.max_k),
        "embed_rows": int(emitter.embed_rows),
        "weight_slots": packer.slots,
        "plugin_ops": emitter.plugin_calls,
        "moe": emitter.moe_calls,
        "block_bytes": packer.block_bytes,
    }
    if emitter.position_limit:
        meta["position_limit"] = int(emitter.position_limit)      # with_context refuses more
    arrays = {
        "I": np.stack(rows_I), "F": np.stack(emitter.rows_F),
        "wq": packer.wq.build(), "ws": packer.ws.build(), "wf": packer.wf.build(),
    }
    return Program(arrays=arrays, meta=meta)


def context_free(graph: Graph) -> bool:
    """Whether a program of ``graph`` is the same for every context length but for its KV
    regions (which :func:`with_context` resizes): false when a RoPE's frequencies come from a
    plugin's scaling, which may depend on the context (they are packed into the program)."""
    return not any(n.op == Op.ROPE and n.attr("rope_type") for n in graph.nodes)


def with_context(program: Program, n_ctx: int) -> Program:
    """``program`` for a context of ``n_ctx`` tokens: its KV regions resized (each attention's
    capacity as :meth:`_Emitter.attention` computes it), the ``state`` regions laid out again in
    the same order and alignment, the ATTENTION / GATED_DELTA rows pointed at them. The weights
    and the instruction stream are shared; only the small I table is copied. Valid for programs
    of a :func:`context_free` graph."""
    from cpullm_kernels.attention.attention import padded_cap
    from .kvformat import region_floats

    meta = program.meta
    if int(meta["n_ctx"]) == int(n_ctx):
        return program
    limit = meta.get("position_limit")
    if limit and int(n_ctx) > int(limit):
        from ..errors import ConfigError
        raise ConfigError(f"n_ctx {n_ctx} is more than the {limit} positions this model's learned position "
                          f"table holds; load with n_ctx <= {limit} (cpullm.load(..., n_ctx=N) / --ctx N)")
    moved: dict[int, tuple[int, int | None]] = {}      # old offset -> (new offset, new cap)
    regions, size = [], 0
    for reg in meta["state_regions"]:
        reg = dict(reg)
        cap = None
        if reg["kind"] == "kv":
            window = reg.get("window") or 0
            cap = padded_cap(n_ctx if not window else min(n_ctx, window + int(meta["max_chunk"])))
            reg.update(cap=cap, floats=region_floats(reg["n_kv_heads"], cap, reg["head_dim"],
                                                     reg.get("kv_dtype", "f32")))
        moved[int(reg["offset"])] = (size, cap)
        reg["offset"] = size
        size = align_up(size + int(reg["floats"]), 64)
        regions.append(reg)
    I = np.array(program.arrays["I"], copy=True)
    for r in range(len(I)):
        op = I[r, P.COL_OP]
        if op == P.OP_ATTENTION:
            off, cap = moved[int(I[r, P.ATTENTION_CACHE_OFF])]
            I[r, P.ATTENTION_CACHE_OFF], I[r, P.ATTENTION_CAP] = off, cap
        elif op == P.OP_GATED_DELTA:
            I[r, P.GATED_DELTA_STATE_OFF] = moved[int(I[r, P.GATED_DELTA_STATE_OFF])][0]
    I.setflags(write=False)
    return Program(arrays={**program.arrays, "I": I},
                   meta={**meta, "n_ctx": int(n_ctx), "state_regions": regions, "state_floats": int(size)})


def _rope_freqs(n: Node, n_ctx: int) -> tuple[np.ndarray, float]:
    """A ROPE node's (inv_freq, attention_scaling): its own attributes, or, for a plugin's RoPE
    scaling (``rope_type`` attribute), the plugin's frequencies for a context of ``n_ctx``."""
    name = n.attr("rope_type")
    if not name:
        return np.asarray(n.attr("inv_freq"), np.float32), n.attr("attention_scaling", 1.0)
    import json

    from ..graph.blocks import plugin_rope_freqs
    from ..loading.plugins import discover
    rt = discover().rope_types.get(name)
    if rt is None or rt.version != n.attr("rope_version"):
        have = f"version {rt.version!r}" if rt is not None else "none"
        raise GraphError(f"{n.name}: RoPE scaling {name!r} version {n.attr('rope_version')!r} is not "
                         f"installed ({have}); install the plugin that provides it")
    return plugin_rope_freqs(rt, json.loads(n.attr("rope_params")), n.attr("rotary_dim"), n_ctx)


def _plugin_call(n: Node, loc, nodes_by_out, weights, f32_param, out, packer=None) -> dict:
    """How the executor calls a PLUGIN node's kernels (``meta["plugin_ops"][row]``): its op, the
    (offset, row stride, width) of each input and of the output, its weights (role, wf offset,
    shape; a role of ``OpSpec.matrices``: role, -1, shape, [kind, w_off, s_off, Kp] as a LINEAR's
    matrix, packed by ``packer``), the float params of the fast kernels and the attributes of the
    reference."""
    spec = plugin_spec(n.attr("plugin_op"), n.name)
    widths = tuple(nodes_by_out[i].width for i in n.inputs)
    attributes = plain_attrs(n)
    packed = []
    roles = spec.weight_roles(widths, attributes)
    if set(spec.matrices) - set(roles):
        raise GraphError(f"{n.name}: {spec.name} declares matrices {sorted(set(spec.matrices) - set(roles))} "
                         f"that its weight_roles do not give")
    for role, shape in roles.items():
        canonical = n.weight(role)
        if tuple(weights.shape(canonical)) != tuple(shape):
            raise GraphError(f"{n.name}: {spec.name} expects weight {role} of shape {tuple(shape)}, "
                             f"{canonical} is {tuple(weights.shape(canonical))}")
        if role in spec.matrices:
            packed.append(_plugin_matrix(n, role, canonical, shape, weights, packer))
            continue
        packed.append([role, f32_param(canonical), [int(d) for d in shape]])
    try:
        params = [float(attributes[p]) for p in spec.params]
    except (KeyError, TypeError, ValueError) as exc:
        raise GraphError(f"{n.name}: {spec.name} needs numeric attributes {list(spec.params)} ({exc})") from None
    return {"op": spec.name, "version": spec.version, "node": n.name,
            "inputs": [[*loc(i), nodes_by_out[i].width] for i in n.inputs],
            "out": [out[0], out[1], n.width], "weights": packed, "params": params, "attrs": attributes}


def _plugin_matrix(n: Node, role: str, canonical: str, shape, weights, packer) -> list:
    """A plugin op's matrix weight packed as a LINEAR's would be in this quant mode (``n``'s
    precision applies): [role, -1, shape, [kind, w_off, s_off, Kp]]."""
    if len(shape) != 2:
        raise GraphError(f"{n.name}: matrix weight {role} must be 2-D (N, K), its shape rule gives {tuple(shape)}")
    mode = _precision(n, packer.quant)
    kind, w_off, s_off, Kp, _ = packer.matrix([canonical], n, block_fmt=_op_matrix_format(weights, canonical, mode))
    return [role, -1, [int(d) for d in shape], [int(kind), int(w_off), int(s_off), int(Kp)]]


def _op_matrix_format(weights, canonical: str, mode: str) -> str | None:
    """Block format of a plugin op's matrix in a raw-block mode: a GGUF file's own blocks, q4's
    Q4_K (rows of whole 256-weight super-blocks) or Q5_0 (of 32); None: the int8 way."""
    if mode == "gguf":
        found = weights.blocks(canonical) if hasattr(weights, "blocks") else None
        return found[0] if found is not None else None
    if mode != "q4":
        return None
    K = int(weights.shape(canonical)[1])
    return None if K % 32 else "Q4_K" if K % 256 == 0 else "Q5_0"


def _block_plan(graph: Graph, weights, quant: str):
    """A quant_blocks.BlockPlan for the raw-block modes, else None."""
    return BlockPlan(graph, weights, quant) if quant in BLOCK_QUANTS else None


def _precision(node: Node, quant: str) -> str:
    """The weight mode of one LINEAR/EMBED node: its ``precision`` attribute, else ``quant``."""
    p = node.attr("precision")
    if p is None:
        return quant
    if p not in PRECISIONS:
        raise GraphError(f"{node.name}: precision {p!r} is not one of {', '.join(PRECISIONS)}")
    return p


def _fill(row: np.ndarray, columns: dict) -> None:
    """Write ``{column: value}`` into one instruction's row of I or F (column names:
    cpullm_kernels.program.program_table)."""
    for column, value in columns.items():
        row[column] = value


def _merge(free: list) -> list:
    out = []
    for off, sz in free:
        if out and out[-1][0] + out[-1][1] == off:
            out[-1] = (out[-1][0], out[-1][1] + sz)
        else:
            out.append((off, sz))
    return out


def graph_hash(graph: Graph) -> str:
    return hashlib.sha256(graph.dump().encode()).hexdigest()[:16]
