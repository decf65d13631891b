"""Shared builders every family composes: norms, RoPE variants, attention, MLP, decoder layers,
the head, and the Gated DeltaNet mixer. Canonical weight names used here:

    embed, final_norm, lm_head  [final_norm_bias lm_head_bias]
    [pos_embed]  [layers.{i}.mlp.{up,down}_bias]     (learned positions; a plain MLP with biases)
    layers.{i}.attn_norm  layers.{i}.mlp_norm  [layers.{i}.post_attn_norm  layers.{i}.post_mlp_norm]
    [layers.{i}.{attn_norm,mlp_norm,post_attn_norm,post_mlp_norm}_bias]   (LayerNorm with bias)
    layers.{i}.attn.{q,k,v,o}_proj  [.{q,k,v}_bias]  [.q_norm .k_norm]
    layers.{i}.mlp.{gate,up,down}_proj
    layers.{i}.moe.router  layers.{i}.moe.experts.{e}.{gate,up,down}_proj
    [layers.{i}.moe.shared.{gate,up,down}_proj  [layers.{i}.moe.shared_gate]]    (routed experts)
    layers.{i}.linear_attn.{in_qkv,in_z,in_b,in_a,conv,dt_bias,A_log,norm,out_proj}
"""
from __future__ import annotations

import json
import math

import numpy as np

from ..errors import ConfigError, UnsupportedConfigError
from ..loading.family import RopeSpec
from .ir import GraphBuilder, Op

# ---------------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------------


def default_inv_freq(theta: float, rotary_dim: int) -> np.ndarray:
    """(rotary_dim/2,) float32: 1 / theta^(2i/d), computed in float32 as transformers does."""
    exponent = np.arange(0, rotary_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(rotary_dim)
    return (np.float32(1.0) / (np.float32(theta) ** exponent)).astype(np.float32)


def rope_number(params: dict, key: str, default: float | None = None) -> float:
    """A RoPE setting as a finite positive float; ConfigError naming the key otherwise (the
    values come from an untrusted config: NaN, strings or zero would poison every position)."""
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"config RoPE setting {key!r} = {value!r} must be a finite positive number; "
                          "restore config.json from the checkpoint")
    return float(value)


def _llama3_inv_freq(inv: np.ndarray, p: dict) -> np.ndarray:
    factor = rope_number(p, "factor")
    low = rope_number(p, "low_freq_factor", 1.0)
    high = rope_number(p, "high_freq_factor", 4.0)
    orig = rope_number(p, "original_max_position_embeddings")
    if high == low:
        raise ConfigError("config RoPE settings low_freq_factor and high_freq_factor are equal "
                          f"({low}); llama3 RoPE needs them to differ")
    low_wl, high_wl = orig / low, orig / high
    wavelen = 2 * math.pi / inv
    inv_l = np.where(wavelen > low_wl, inv / factor, inv)
    smooth = (orig / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
    medium = (wavelen >= high_wl) & (wavelen <= low_wl)
    return np.where(medium, smoothed, inv_l).astype(np.float32)


def rope_parameters(config: dict, layer_type: str | None = None) -> dict:
    """The RoPE settings for one layer type, from either checkpoint layout:

    transformers 5: ``rope_parameters`` (flat, or nested by layer type: {"full_attention": {...}});
    legacy: ``rope_theta`` + ``rope_scaling`` (+ ``rope_local_base_freq`` handled by the family).
    Returns a dict with at least ``rope_type`` and ``rope_theta``.
    """
    rp = config.get("rope_parameters")
    if isinstance(rp, dict) and rp:
        if layer_type is not None and isinstance(rp.get(layer_type), dict):
            rp = rp[layer_type]
        elif all(isinstance(v, dict) for v in rp.values()):
            rp = next(iter(rp.values()))
        out = dict(rp)
        out.setdefault("rope_type", out.get("type", "default"))
        if "rope_theta" not in out:
            out["rope_theta"] = config.get("rope_theta", 10000.0)
        return out
    out = {"rope_type": "default", "rope_theta": config.get("rope_theta", 10000.0)}
    scaling = config.get("rope_scaling")
    if isinstance(scaling, dict):
        out.update(scaling)
        out["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
    return out


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def plugin_rope_freqs(rope_type, params: dict, rotary_dim: int, n_ctx: int) -> tuple[np.ndarray, float]:
    """A plugin RopeType's (inv_freq (rotary_dim/2,) float32, attention_scaling) for a context of
    ``n_ctx``, checked: an UnsupportedConfigError naming the rope type otherwise."""
    inv, scaling = rope_type.inv_freq(dict(params), int(rotary_dim), int(n_ctx))
    inv = np.asarray(inv, np.float32).reshape(-1)
    scaling = float(scaling)
    if inv.shape != (rotary_dim // 2,) or not np.isfinite(inv).all() or not np.isfinite(scaling):
        raise UnsupportedConfigError(
            f"rope_type {rope_type.name!r} ({rope_type.plugin}) gave {inv.shape[0]} frequencies "
            f"(need {rotary_dim // 2}, finite) or a non-finite attention scaling {scaling!r}: check the "
            f"config's rope parameters")
    return inv, scaling


def make_rope(params: dict, head_dim: int, partial_rotary_factor: float = 1.0) -> RopeSpec:
    """RopeSpec from rope parameters; an unknown ``rope_type`` fails at load, naming the key.
    A ``rope_type`` the core lacks may come from a plugin (hook ``cpullm_rope_types``)."""
    rope_type = params.get("rope_type", "default")
    factor = rope_number(params, "partial_rotary_factor", partial_rotary_factor)
    rotary_dim = int(head_dim * factor)
    if not 0 < rotary_dim <= head_dim:
        raise ConfigError(f"config RoPE setting 'partial_rotary_factor' = {factor!r} gives {rotary_dim} "
                          f"rotary dimensions of a {head_dim}-wide head; it must be in (0, 1]")
    theta = rope_number(params, "rope_theta")
    inv = default_inv_freq(theta, rotary_dim)
    if rope_type == "default":
        pass
    elif rope_type == "linear":
        inv = (inv / np.float32(rope_number(params, "factor"))).astype(np.float32)
    elif rope_type == "llama3":
        inv = _llama3_inv_freq(inv, params)
    else:
        from ..loading.plugins import discover
        plugin_types = discover().rope_types
        if rope_type not in plugin_types:
            raise UnsupportedConfigError(
                f"config key 'rope_scaling.rope_type' (or rope_parameters) = {rope_type!r} is not "
                f"supported (supported: {', '.join(SUPPORTED_ROPE_TYPES + tuple(sorted(plugin_types)))}; "
                f"a plugin may add it)")
        rt = plugin_types[rope_type]
        plain = json.loads(json.dumps(params, default=str))
        inv, scaling = plugin_rope_freqs(rt, plain, rotary_dim, 0)
        return RopeSpec(theta=theta, rotary_dim=rotary_dim, inv_freq=tuple(float(x) for x in inv),
                        attention_scaling=scaling, scaling=rope_type,
                        scaling_params=json.dumps(plain, sort_keys=True), scaling_version=rt.version)
    return RopeSpec(theta=theta, rotary_dim=rotary_dim, inv_freq=tuple(float(x) for x in inv),
                    attention_scaling=1.0)


# ---------------------------------------------------------------------------------------------
# Elementary blocks
# ---------------------------------------------------------------------------------------------


def embed(g: GraphBuilder, hidden: int, scale: float = 1.0) -> str:
    return g.add("embed", Op.EMBED, [], width=hidden, weights={"table": "embed"},
                 group="embedding", scale=float(scale))


def rmsnorm(g: GraphBuilder, name: str, x: str, weight: str, eps: float, group_size: int | None = None) -> str:
    """RMSNorm over the last dim, or over each group of ``group_size`` columns (per-head norms).
    Zero-centred (1 + w) weights are folded by the weight map (ADD_ONE), never here."""
    width = g.width(x)
    return g.add(name, Op.RMSNORM, [x], weights={"weight": weight}, group="norm",
                 eps=float(eps), group_size=int(group_size or width))


def layernorm(g: GraphBuilder, name: str, x: str, weight: str, eps: float, bias: str | None = None,
              group_size: int | None = None) -> str:
    """LayerNorm over the last dim (or each group of ``group_size`` columns):
    ``(x - mean) / sqrt(var + eps) * w (+ bias)``, the biased variance, as torch computes it."""
    width = g.width(x)
    weights = {"weight": weight, **({"bias": bias} if bias else {})}
    return g.add(name, Op.LAYERNORM, [x], weights=weights, group="norm", eps=float(eps),
                 group_size=int(group_size or width))


def norm(g: GraphBuilder, name: str, x: str, eps: float, kind: str = "rms", bias: bool = False,
         group_size: int | None = None) -> str:
    """The norm ``kind`` ("rms" | "layer") named ``name`` with the canonical weight ``name`` and,
    with ``bias`` (LayerNorm only), ``name + "_bias"``."""
    if kind == "rms":
        if bias:
            raise ValueError(f"{name}: an RMSNorm has no bias")
        return rmsnorm(g, name, x, name, eps, group_size=group_size)
    if kind == "layer":
        return layernorm(g, name, x, name, eps, bias=f"{name}_bias" if bias else None, group_size=group_size)
    raise ValueError(f"{name}: norm kind {kind!r} is not 'rms' or 'layer'")


PRECISIONS = ("f32",)      # node attribute ``precision``: per-node override of the quant mode


def linear(g: GraphBuilder, name: str, x: str, weight: str, out_features: int,
           bias: str | None = None, group: str = "", precision: str | None = None) -> str:
    """x (T, K) @ weight.T (+ bias) -> (T, out_features). ``precision="f32"`` keeps this one
    matrix float32 whatever the quant mode (a layer the model is sensitive to); LINEARs of equal
    precision that share an input are still fused."""
    w = {"weight": weight}
    if bias:
        w["bias"] = bias
    if precision is None:
        return g.add(name, Op.LINEAR, [x], width=out_features, weights=w, group=group)
    if precision not in PRECISIONS:
        raise ValueError(f"{name}: precision {precision!r} is not one of {', '.join(PRECISIONS)} (or None)")
    return g.add(name, Op.LINEAR, [x], width=out_features, weights=w, group=group, precision=precision)


# Activation names as transformers' ``hidden_act`` / ``activation_function`` spell them -> the ACT
# op's (cpullm_kernels.ops.pointwise.ACT_KINDS); a family maps its config value with this table.
HF_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                  "relu": "relu", "silu": "silu", "swish": "silu"}


def activation(g: GraphBuilder, name: str, x: str, act: str, group: str = "mlp_act") -> str:
    """ACT node: ``act`` ("gelu" exact, "gelu_tanh", "relu", "silu") of every value of x."""
    from cpullm_kernels.ops.pointwise import ACT_KINDS
    if act not in ACT_KINDS:
        raise ValueError(f"{name}: activation {act!r} is not one of {', '.join(ACT_KINDS)}")
    return g.add(name, Op.ACT, [x], group=group, act=act)


def position_embed(g: GraphBuilder, x: str, n_positions: int, offset: int = 0,
                   weight: str = "pos_embed", name: str = "pos_embed") -> str:
    """POS_EMBED node: x (T, H) plus the learned absolute position embedding of each row's
    position, rows of ``weight`` (n_positions, H) starting at row ``offset`` for position 0 (GPT-2,
    GPT-Neo, StarCoder: 0; OPT: 2). The context a program is compiled for must fit the table:
    declare ``FamilySpec.context_limit`` so a too-long n_ctx is refused at load, naming the fix."""
    return g.add(name, Op.POS_EMBED, [x], weights={"table": weight}, group="embedding",
                 n_positions=int(n_positions), offset=int(offset))


def mlp(g: GraphBuilder, i: int, x: str, hidden: int, intermediate: int, act: str, bias: bool = False) -> str:
    """down(act(up(x))) (GPT-2, OPT, GPT-Neo, StarCoder): weights ``layers.{i}.mlp.{up,down}_proj``
    and, with ``bias``, ``layers.{i}.mlp.{up,down}_bias``; ``act`` as :func:`activation`."""
    p = f"layers.{i}.mlp"
    up = linear(g, f"{p}.up_proj", x, f"{p}.up_proj", intermediate, group="mlp_up",
                bias=f"{p}.up_bias" if bias else None)                           # (T, I)
    h = activation(g, f"{p}.act", up, act)
    return linear(g, f"{p}.down_proj", h, f"{p}.down_proj", hidden, group="mlp_down",
                  bias=f"{p}.down_bias" if bias else None)                        # (T, H)


def rope(g: GraphBuilder, name: str, x: str, n_heads: int, head_dim: int, spec: RopeSpec) -> str:
    """ROPE node; a plugin scaling (``spec.scaling``) also records its name, version and
    parameters, from which the compiler computes the frequencies for the program's context."""
    scaling = ({"rope_type": spec.scaling, "rope_version": spec.scaling_version,
                "rope_params": spec.scaling_params} if spec.scaling else {})
    return g.add(name, Op.ROPE, [x], group="rope", n_heads=n_heads, head_dim=head_dim,
                 rotary_dim=spec.rotary_dim, inv_freq=spec.inv_freq,
                 attention_scaling=spec.attention_scaling, **scaling)


def glu_mlp(g: GraphBuilder, i: int, x: str, hidden: int, intermediate: int, act: str) -> str:
    """down(act(gate(x)) * up(x)); gate and up share an input and are fused by the compiler."""
    p = f"layers.{i}.mlp"
    gate = linear(g, f"{p}.gate_proj", x, f"{p}.gate_proj", intermediate, group="mlp_up")
    up = linear(g, f"{p}.up_proj", x, f"{p}.up_proj", intermediate, group="mlp_up")
    h = g.add(f"{p}.act", Op.GLU, [gate, up], group="mlp_act", act=act)
    return linear(g, f"{p}.down_proj", h, f"{p}.down_proj", hidden, group="mlp_down")


def moe_mlp(g: GraphBuilder, i: int, x: str, *, hidden: int, n_experts: int, top_k: int, intermediate: int,
            routing: str = "softmax_topk", norm_topk: bool = True, shared_intermediate: int = 0,
            shared_gate: bool = True, act: str = "silu") -> str:
    """Routed experts in place of the MLP (Op.MOE, cpullm_kernels.program.moe): the router's top_k of
    n_experts gated MLPs (act(gate) * up -> down, width ``intermediate``) per token, weighted;
    ``routing`` "softmax_topk" (softmax over all, then the k largest; ``norm_topk`` renormalizes
    them) or "topk_softmax" (the k largest logits, softmax over them: Mixtral). A shared expert of
    width ``shared_intermediate`` (> 0) runs on every token, scaled by sigmoid(x . shared_gate)
    when ``shared_gate``. Weights ``layers.{i}.moe.*`` (module docstring); the router stays float32,
    the expert matrices are quantized like LINEAR weights."""
    from .ir import moe_weight_roles
    if act != "silu":
        raise UnsupportedConfigError(f"routed experts support the silu activation, not {act!r}")
    p = f"layers.{i}.moe"
    roles = moe_weight_roles(n_experts, shared_intermediate > 0, shared_gate)
    return g.add(p, Op.MOE, [x], width=hidden, weights={r: f"{p}.{r}" for r in roles}, group="moe",
                 n_experts=int(n_experts), top_k=int(top_k), intermediate=int(intermediate), routing=routing,
                 norm_topk=bool(norm_topk), shared_intermediate=int(shared_intermediate), act=act)


def attention(g: GraphBuilder, i: int, x: str, *, hidden: int, n_heads: int, n_kv_heads: int,
              head_dim: int, rope_spec: RopeSpec | None, scale: float, qkv_bias: bool = False,
              o_bias: bool = False, qk_norm_eps: float | None = None, softcap: float = 0.0, window: int = 0,
              output_gate: bool = False, qk_norm_per_head: bool = True) -> str:
    """Grouped-query self-attention with the options the families need.

    output_gate: the q projection's rows are [q (n_heads*head_dim) | gate (n_heads*head_dim)]
    (the family's weight map puts them in that order); the output is o_proj(attn * sigmoid(gate)).
    qk_norm_eps: RMSNorm q and k (weights ``q_norm``, ``k_norm``) before RoPE: over each head
    (weights (head_dim,), Qwen3 / Gemma 3), or with ``qk_norm_per_head=False`` over the whole
    projection (weights (n_heads*head_dim,) and (n_kv_heads*head_dim,), OLMo 2).
    The ATTENTION node carries ``layer=i`` (see :mod:`cpullm.graph.ir`: it labels the KV cache).
    """
    p = f"layers.{i}.attn"
    q_width = n_heads * head_dim
    kv_width = n_kv_heads * head_dim
    bias = (lambda n: f"{p}.{n}_bias") if qkv_bias else (lambda n: None)
    q_out = linear(g, f"{p}.q_proj", x, f"{p}.q_proj", q_width * (2 if output_gate else 1),
                   bias=bias("q"), group="qkv")
    k = linear(g, f"{p}.k_proj", x, f"{p}.k_proj", kv_width, bias=bias("k"), group="qkv")
    v = linear(g, f"{p}.v_proj", x, f"{p}.v_proj", kv_width, bias=bias("v"), group="qkv")
    gate = None
    if output_gate:
        q = g.add(f"{p}.q", Op.SLICE, [q_out], width=q_width, group="qkv", start=0)
        gate = g.add(f"{p}.gate", Op.SLICE, [q_out], width=q_width, group="qkv", start=q_width)
    else:
        q = q_out
    if qk_norm_eps is not None:
        group = head_dim if qk_norm_per_head else None
        q = rmsnorm(g, f"{p}.q_norm", q, f"{p}.q_norm", qk_norm_eps, group_size=group)
        k = rmsnorm(g, f"{p}.k_norm", k, f"{p}.k_norm", qk_norm_eps, group_size=group)
    if rope_spec is not None:
        q = rope(g, f"{p}.q_rope", q, n_heads, head_dim, rope_spec)
        k = rope(g, f"{p}.k_rope", k, n_kv_heads, head_dim, rope_spec)
    a = g.add(f"{p}.sdpa", Op.ATTENTION, [q, k, v], width=q_width, group="attention",
              n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, scale=float(scale),
              softcap=float(softcap or 0.0), window=int(window or 0), layer=i)
    if gate is not None:
        a = g.add(f"{p}.gated", Op.SIGMOID_MUL, [a, gate], group="attention")
    return linear(g, f"{p}.o_proj", a, f"{p}.o_proj", hidden, group="o_proj",
                  bias=f"{p}.o_bias" if o_bias else None)


def gated_delta(g: GraphBuilder, i: int, x: str, *, hidden: int, n_k_heads: int, k_head_dim: int,
                n_v_heads: int, v_head_dim: int, conv_kernel: int, norm_eps: float) -> str:
    """Gated DeltaNet linear attention (Qwen3.5-style), with a causal depthwise conv state and a
    fixed-size recurrent state per layer. The projections are ordinary LINEAR nodes; the mixer is
    one GATED_DELTA node whose reference kernel lives in cpullm_kernels.attention.gated_delta."""
    p = f"layers.{i}.linear_attn"
    key_dim, value_dim = n_k_heads * k_head_dim, n_v_heads * v_head_dim
    conv_dim = 2 * key_dim + value_dim
    qkv = linear(g, f"{p}.in_qkv", x, f"{p}.in_qkv", conv_dim, group="linear_attn_proj")
    z = linear(g, f"{p}.in_z", x, f"{p}.in_z", value_dim, group="linear_attn_proj")
    b = linear(g, f"{p}.in_b", x, f"{p}.in_b", n_v_heads, group="linear_attn_proj")
    a = linear(g, f"{p}.in_a", x, f"{p}.in_a", n_v_heads, group="linear_attn_proj")
    o = g.add(f"{p}.mixer", Op.GATED_DELTA, [qkv, z, b, a], width=value_dim, group="linear_attn",
              weights={"conv": f"{p}.conv", "dt_bias": f"{p}.dt_bias", "A_log": f"{p}.A_log",
                       "norm": f"{p}.norm"},
              n_k_heads=n_k_heads, k_head_dim=k_head_dim, n_v_heads=n_v_heads,
              v_head_dim=v_head_dim, conv_kernel=conv_kernel, eps=float(norm_eps), layer=i)
    return linear(g, f"{p}.out_proj", o, f"{p}.out_proj", hidden, group="linear_attn_proj")


LAYOUTS = ("pre", "sandwich", "post")


def decoder_layer(g: GraphBuilder, i: int, h: str, mixer, mlp, eps: float, sandwich: bool = False,
                  *, layout: str | None = None, norm_kind: str = "rms", norm_bias: bool = False) -> str:
    """One decoder layer; ``mixer`` and ``mlp`` are ``(g, i, x) -> value`` callables.

    layout "pre" (default):  h += mixer(attn_norm(h)); h += mlp(mlp_norm(h))
           "sandwich" (Gemma 2/3; ``sandwich=True``):
                             h += post_attn_norm(mixer(attn_norm(h))); h += post_mlp_norm(mlp(mlp_norm(h)))
           "post" (OLMo 2):  h += post_attn_norm(mixer(h)); h += post_mlp_norm(mlp(h))
    norm_kind "rms" | "layer" (LayerNorm); norm_bias: LayerNorms with a bias
    (``layers.{i}.attn_norm_bias``, ...). Canonical norm names: the module docstring.
    """
    layout = layout or ("sandwich" if sandwich else "pre")
    if layout not in LAYOUTS:
        raise ValueError(f"layer layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    p = f"layers.{i}"

    def nrm(name, x):
        return norm(g, f"{p}.{name}", x, eps, kind=norm_kind, bias=norm_bias)

    x = h if layout == "post" else nrm("attn_norm", h)
    a = mixer(g, i, x)
    if layout != "pre":
        a = nrm("post_attn_norm", a)
    h = g.add(f"{p}.attn_residual", Op.ADD, [h, a], group="residual")
    x = h if layout == "post" else nrm("mlp_norm", h)
    m = mlp(g, i, x)
    if layout != "pre":
        m = nrm("post_mlp_norm", m)
    return g.add(f"{p}.mlp_residual", Op.ADD, [h, m], group="residual")


def lm_head(g: GraphBuilder, h: str, vocab: int, eps: float, final_softcap: float = 0.0, *,
            norm_kind: str = "rms", norm_bias: bool = False, bias: bool = False) -> str:
    """Final norm (``norm_kind``, ``norm_bias`` as in :func:`decoder_layer`), lm_head (tied or
    not: the weight map decides; ``bias``: ``lm_head_bias``), optional logit soft-capping."""
    x = g.begin_head(h)
    x = norm(g, "final_norm", x, eps, kind=norm_kind, bias=norm_bias)
    logits = linear(g, "lm_head", x, "lm_head", vocab, group="lm_head", bias="lm_head_bias" if bias else None)
    if final_softcap:
        logits = g.add("final_softcap", Op.SOFTCAP, [logits], group="lm_head", cap=float(final_softcap))
    return logits
