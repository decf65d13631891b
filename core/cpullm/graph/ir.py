"""The IR: a small set of ops (the core's, plus plugin ops) over named values of shape (T, width).

Every value is a float32 matrix with one row per token (T rows in the body, the selected rows in
the head). Nodes are frozen and named ``"layers.{i}.{block}.{op}"`` so a graph dump diffs and a
profile reads by name. Families compose :mod:`cpullm.graph.blocks`; an op the core lacks comes from a
plugin (hook ``cpullm_ops``) and enters the graph as a ``PLUGIN`` node (:meth:`GraphBuilder.op`).
"""
from __future__ import annotations

import enum
import json
import os
from typing import Any

import attrs

from ..errors import CpullmError


class Op(enum.IntEnum):
    """The core's op set (plugin ops are PLUGIN nodes). Values are stable: they are the
    interpreter's opcodes."""

    EMBED = 1        # ()               -> (T, H)       weights: table; attrs: scale
    RMSNORM = 2      # (x)              -> x.shape      weights: weight; attrs: eps, group
    LINEAR = 3       # (x (T,K))        -> (T, N)       weights: weight (N,K), [bias (N,)]
    ROPE = 4         # (x (T,h*d))      -> same         attrs: n_heads, head_dim, rope (RopeSpec)
    ATTENTION = 5    # (q, k, v)        -> (T, nh*hd)   attrs: n_heads, n_kv_heads, head_dim, scale, softcap, window, layer
    GLU = 6          # (gate, up)       -> gate.shape   attrs: act ("silu" | "gelu_tanh")
    ADD = 7          # (a, b)           -> a.shape
    SIGMOID_MUL = 8  # (x, gate)        -> x.shape      x * sigmoid(gate)
    SOFTCAP = 9      # (x)              -> x.shape      attrs: cap: cap * tanh(x / cap)
    SLICE = 10       # (x)              -> (T, width)   attrs: start (column view, no copy)
    SELECT_ROWS = 11 # (x)              -> (R, width)   head entry: the rows the executor asks for
    GATED_DELTA = 12 # (qkv, z, b, a)   -> (T, nv*dv)   linear attention (Gated DeltaNet) with conv + recurrent state
    SCALE = 13       # (x)              -> x.shape      attrs: scale
    LAYERNORM = 14   # (x)              -> x.shape      weights: weight, [bias]; attrs: eps, group_size
    ACT = 20         # (x)              -> x.shape      attrs: act ("gelu" | "gelu_tanh" | "relu" | "silu")
    POS_EMBED = 21   # (x)              -> x.shape      x + table[position + offset]; weights: table
                     #                                  (n_positions, width); attrs: n_positions, offset
    PLUGIN = 15      # (inputs...)      -> (T, width)   a plugin's op (cpullm.loading.family.OpSpec): attrs
                     #                                  plugin_op (its name), op_version, its own attrs
    MOE = 16         # (x (T,H))        -> (T, H)       routed experts (cpullm_kernels.program.moe): weights router
                     #                                  (E,H), experts.{e}.{gate,up,down}_proj, [shared.{gate,
                     #                                  up,down}_proj, shared_gate (1,H)]; attrs n_experts,
                     #                                  top_k, intermediate, routing, norm_topk, shared_intermediate, act


# ``layer`` (ATTENTION, GATED_DELTA): the decoder layer's index. The node owns a state region (its
# KV cache, or its recurrent state) in ``program.meta["state_regions"]``, labelled with it for the
# memory report (``model.info()["memory"]``, per layer). A node built outside cpullm.graph.blocks must
# set it to its own layer's index (an int). The region is identified by the node's name.


# Ops whose output is a view of their input (no buffer of their own).
VIEW_OPS = {Op.SLICE}


def _freeze(v: Any):
    if isinstance(v, dict):
        return tuple(sorted((k, _freeze(x)) for k, x in v.items()))
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x) for x in v)
    return v


@attrs.define(frozen=True)
class Node:
    name: str                       # "layers.3.attn.q_proj"
    op: Op
    inputs: tuple                   # value names
    output: str                     # value name (== name unless a view)
    width: int                      # columns of the output
    weights: tuple = ()             # ((role, canonical tensor name), ...)
    attrs: tuple = ()               # ((key, value), ...) frozen
    section: str = "body"           # "body" (every token) | "head" (selected rows only)
    group: str = ""                 # profile group: "qkv", "attention", "o_proj", "mlp_up", ...

    def attr(self, key: str, default=None):
        for k, v in self.attrs:
            if k == key:
                return v
        return default

    def weight(self, role: str, default=None):
        for r, w in self.weights:
            if r == role:
                return w
        return default


class GraphError(CpullmError):
    """An IR graph is malformed (a bug in a family plugin, reported with the node name)."""


@attrs.define
class Graph:
    nodes: list
    output: str                      # final value (logits)
    hidden: str                      # last body value (input of the head's SELECT_ROWS)

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def dump(self) -> str:
        """A stable text form, one node per line, for diffs and for the cache key."""
        lines = []
        for n in self.nodes:
            a = json.dumps([list(x) for x in n.attrs], default=str, sort_keys=True)
            w = ",".join(f"{r}={t}" for r, t in n.weights)
            lines.append(f"{n.section} {n.name} = {n.op.name}({', '.join(n.inputs)}) "
                         f"width={n.width} w[{w}] {a} group={n.group}")
        return "\n".join(lines)

    def validate(self) -> None:
        """Check names are unique, inputs are defined before use, widths agree."""
        defined: dict[str, Node] = {}
        names = set()
        for n in self.nodes:
            if n.name in names:
                raise GraphError(f"duplicate node name {n.name!r}")
            names.add(n.name)
            if not isinstance(n.op, Op):
                raise GraphError(f"{n.name}: unknown op {n.op!r}")
            for i in n.inputs:
                if i not in defined:
                    raise GraphError(f"{n.name}: input {i!r} is used before it is defined")
                if n.section == "body" and defined[i].section == "head":
                    raise GraphError(f"{n.name}: a body node cannot read head value {i!r}")
            if n.width <= 0:
                raise GraphError(f"{n.name}: width must be positive")
            w = [defined[i].width for i in n.inputs]
            if n.op in (Op.ADD, Op.GLU, Op.SIGMOID_MUL) and len(set(w)) != 1:
                raise GraphError(f"{n.name}: {n.op.name} inputs have different widths {w}")
            if n.op == Op.SLICE and n.attr("start") + n.width > w[0]:
                raise GraphError(f"{n.name}: slice runs past its input")
            if n.op == Op.SELECT_ROWS and n.section != "head":
                raise GraphError(f"{n.name}: SELECT_ROWS starts the head section")
            if n.op in (Op.ACT, Op.POS_EMBED):
                _check_pointwise(n, tuple(w))
            if n.op == Op.PLUGIN:
                _check_plugin_node(n, tuple(w))
            if n.op == Op.MOE:
                _check_moe_node(n, tuple(w))
            defined[n.output] = n
        if self.output not in defined or self.hidden not in defined:
            raise GraphError("graph output or hidden value is not defined")


MOE_ROUTINGS = ("softmax_topk", "topk_softmax")


def moe_weight_roles(n_experts: int, shared: bool, shared_gate: bool) -> list[str]:
    """The weight roles of a MOE node, in order: the router, each expert's gate, up and down
    projections, then the shared expert's and its gate."""
    roles = ["router"]
    for e in range(n_experts):
        roles += [f"experts.{e}.gate_proj", f"experts.{e}.up_proj", f"experts.{e}.down_proj"]
    if shared:
        roles += ["shared.gate_proj", "shared.up_proj", "shared.down_proj"]
        if shared_gate:
            roles.append("shared_gate")
    return roles


def _check_moe_node(n: Node, widths: tuple) -> None:
    """A MOE node's attributes and weight roles agree (a bug in the family that built it)."""
    E, k = n.attr("n_experts"), n.attr("top_k")
    if not (isinstance(E, int) and isinstance(k, int) and 0 < k <= E):
        raise GraphError(f"{n.name}: MOE needs 0 < top_k <= n_experts, got top_k={k!r}, n_experts={E!r}")
    if n.attr("routing") not in MOE_ROUTINGS:
        raise GraphError(f"{n.name}: MOE routing must be one of {MOE_ROUTINGS}, not {n.attr('routing')!r}")
    if widths != (n.width,):
        raise GraphError(f"{n.name}: MOE reads one value of its own width {n.width}, got widths {widths}")
    shared = int(n.attr("shared_intermediate", 0) or 0) > 0
    roles = moe_weight_roles(E, shared, n.weight("shared_gate") is not None)
    if [r for r, _ in n.weights] != roles:
        raise GraphError(f"{n.name}: MOE weight roles must be {roles[:4]}... ({len(roles)} roles), "
                         f"got {len(n.weights)}")


def plugin_spec(op_name: str, where: str):
    from ..errors import PluginError
    from ..loading.plugins import discover
    try:
        return discover().op(op_name)
    except PluginError as exc:
        raise GraphError(f"{where}: {exc}") from None


def _check_plugin_node(n: Node, widths: tuple) -> None:
    """A PLUGIN node agrees with its installed OpSpec: version, weight roles, width."""
    spec = plugin_spec(n.attr("plugin_op"), n.name)
    if n.attr("op_version") != spec.version:
        raise GraphError(f"{n.name}: built for {spec.name} version {n.attr('op_version')!r}, "
                         f"installed {spec.version!r}")
    attributes = plain_attrs(n)
    roles = dict(spec.weight_roles(widths, attributes))
    if set(roles) != {r for r, _ in n.weights}:
        raise GraphError(f"{n.name}: {spec.name} reads weights {sorted(roles)}, the node gives "
                         f"{sorted(r for r, _ in n.weights)}")
    if spec.width(widths, attributes) != n.width:
        raise GraphError(f"{n.name}: {spec.name}'s shape rule gives width "
                         f"{spec.width(widths, attributes)}, the node has {n.width}")


def plain_attrs(n: Node) -> dict:
    """A node's attributes as JSON values (what an OpSpec's width, weight_roles and reference get)."""
    own = {k: v for k, v in n.attrs if k not in ("plugin_op", "op_version")}
    return json.loads(json.dumps(own, default=str))


def _check_pointwise(n: Node, widths: tuple) -> None:
    """An ACT names a known activation; a POS_EMBED reads its table in the body; both keep the width."""
    from cpullm_kernels.ops.pointwise import ACT_KINDS
    if widths != (n.width,):
        raise GraphError(f"{n.name}: {n.op.name} takes one input of its own width {n.width}, got {list(widths)}")
    if n.op == Op.ACT and n.attr("act") not in ACT_KINDS:
        raise GraphError(f"{n.name}: activation {n.attr('act')!r} is not one of {', '.join(ACT_KINDS)}")
    if n.op == Op.POS_EMBED:
        if n.section != "body" or n.weight("table") is None:
            raise GraphError(f"{n.name}: POS_EMBED runs in the body and reads a 'table' weight")
        positions, offset = n.attr("n_positions"), n.attr("offset", 0)
        if not (isinstance(positions, int) and isinstance(offset, int) and 0 <= offset < positions):
            raise GraphError(f"{n.name}: POS_EMBED needs integer n_positions > offset >= 0, "
                             f"got {positions!r}, {offset!r}")


class GraphBuilder:
    """Appends named nodes; every method returns the output value name."""

    def __init__(self):
        self.nodes: list[Node] = []
        self.widths: dict[str, int] = {}
        self.section = "body"
        self.hidden: str | None = None

    def add(self, name: str, op: Op, inputs=(), width: int | None = None, weights=None,
            group: str = "", **attributes) -> str:
        if width is None:
            width = self.widths[inputs[0]]
        node = Node(name=name, op=op, inputs=tuple(inputs), output=name, width=int(width),
                    weights=tuple((weights or {}).items()), attrs=_freeze(attributes),
                    section=self.section, group=group)
        self.nodes.append(node)
        self.widths[name] = int(width)
        return name

    def width(self, value: str) -> int:
        return self.widths[value]

    def op(self, name: str, op_name: str, inputs, weights=None, group: str | None = None,
           **attributes) -> str:
        """A node of the plugin op ``op_name`` (cpullm.loading.family.OpSpec, hook ``cpullm_ops``); its
        width comes from the op's shape rule, its version is recorded (``op_version``)."""
        spec = plugin_spec(op_name, name)
        widths = tuple(self.widths[i] for i in inputs)
        plain = json.loads(json.dumps(attributes, default=str))
        try:
            width = int(spec.width(widths, plain))
        except (ValueError, TypeError) as exc:
            raise GraphError(f"{name}: {op_name} refuses inputs of widths {widths}: {exc}") from None
        return self.add(name, Op.PLUGIN, inputs, width=width, weights=weights,
                        group=group or spec.group or op_name, plugin_op=op_name,
                        op_version=spec.version, **attributes)

    def begin_head(self, hidden: str) -> str:
        """End the per-token body; the head runs on the rows the executor selects."""
        self.hidden = hidden
        self.section = "head"
        return self.add("head.select", Op.SELECT_ROWS, [hidden], group="lm_head")

    def build(self, output: str) -> Graph:
        if self.hidden is None:
            raise GraphError("the graph has no head: call begin_head(hidden) before the final norm")
        g = Graph(nodes=list(self.nodes), output=output, hidden=self.hidden)
        if os.environ.get("CPULLM_VALIDATE", "1") != "0":
            g.validate()
        return g
