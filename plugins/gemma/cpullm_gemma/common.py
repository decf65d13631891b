"""What the Gemma model types share: activation and layer-pattern rules, the weight map as data,
and the decoder graph built from :mod:`cpullm.graph.blocks`.

Conventions (as transformers 5.24's Gemma models compute):

* every RMSNorm is zero-centred, ``n * (1 + w)``: the weight map folds ``1 + w`` once at load
  (``ADD_ONE``), so the graph uses the core's plain ``n * w`` norm;
* embeddings are multiplied by ``sqrt(hidden_size)``. transformers casts that scale to the weight
  dtype, so a *bf16* run uses the bf16-rounded value (sqrt(640) = 25.298 -> 25.25), while a
  *float32* run uses the exact value. cpullm computes in float32 (INT8 weights are dequantized to
  float32 too), so it uses the exact float32 ``sqrt(hidden_size)``: the same number transformers
  uses when it runs in float32, which is the parity reference (plugins/gemma/tests/test_gemma_parity.py) and
  how the real-model test loads gemma-3-270m. Versus a bf16 transformers run the difference is
  about 0.1-0.2 % of the embedding scale, well inside bf16's own rounding noise;
* the MLP is GeGLU with the tanh approximation of GELU.
"""
from __future__ import annotations

import math

import attrs

from cpullm.plugin import (ADD_ONE, ConfigError, GraphBuilder, RopeSpec,
                           UnsupportedConfigError, WeightMap, blocks, decoder_stack,
                           require, standard_rules)

SLIDING = "sliding_attention"
FULL = "full_attention"
LAYER_TYPES = (SLIDING, FULL)

# ``hidden_act`` / ``hidden_activation`` values that mean the tanh approximation of GELU in
# transformers (ACT2FN): gelu_pytorch_tanh and gelu_new compute the same formula.
GELU_TANH_NAMES = ("gelu_pytorch_tanh", "gelu_new")

# Checkpoint norm names per canonical norm (canonical names: cpullm.graph.blocks docstring).
PRE_NORM_NAMES = {                       # Gemma 1: pre-norm only
    "attn_norm": "input_layernorm",
    "mlp_norm": "post_attention_layernorm",       # despite its name, the norm before the MLP
}
SANDWICH_NORM_NAMES = {                  # Gemma 2 and 3: pre- and post- attention/MLP norms
    "attn_norm": "input_layernorm",
    "post_attn_norm": "post_attention_layernorm",
    "mlp_norm": "pre_feedforward_layernorm",
    "post_mlp_norm": "post_feedforward_layernorm",
}


def embed_scale(hidden_size: int) -> float:
    """sqrt(hidden_size), applied in float32 by the EMBED kernel (see the module docstring)."""
    return math.sqrt(hidden_size)


def glu_act(name: str, key: str, gelu_means_tanh: bool = False) -> str:
    """The GLU activation for a config's activation name. ``gelu_means_tanh``: Gemma 1's config
    class rewrites ``"gelu"`` to ``"gelu_pytorch_tanh"``."""
    if name in GELU_TANH_NAMES or (gelu_means_tanh and name == "gelu"):
        return "gelu_tanh"
    supported = ", ".join(GELU_TANH_NAMES + (("gelu",) if gelu_means_tanh else ()))
    require(False, key, name, supported)
    return ""  # pragma: no cover


def check_heads(a) -> None:
    """Shared sanity checks on the attention shape and unsupported modes."""
    require(not getattr(a, "use_bidirectional_attention", False), "use_bidirectional_attention",
            a.use_bidirectional_attention, "false (causal language models only)")
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size"):
        v = getattr(a, key)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"config key {key!r} must be a positive integer, got {v!r}; "
                              "fix config.json")
    require(a.num_attention_heads % a.num_key_value_heads == 0, "num_key_value_heads",
            a.num_key_value_heads, "a divisor of num_attention_heads")


def number(value, key: str, optional: bool = False) -> float:
    """A positive number from config.json (``None`` -> 0.0 when ``optional``), else a ConfigError
    naming the key."""
    if value is None and optional:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"config key {key!r} must be a positive number"
                          f"{' or null' if optional else ''}, got {value!r}; fix config.json")
    return float(value)


def layer_types(config: dict, n_layers: int, pattern: int) -> tuple:
    """Per-layer ``sliding_attention`` / ``full_attention``: the config's ``layer_types`` list
    (transformers 5 writes it) or the implicit pattern of older configs: layer i slides unless
    ``(i + 1) % pattern == 0`` (Gemma 2: pattern 2; Gemma 3: ``sliding_window_pattern``, 6)."""
    explicit = config.get("layer_types")
    if explicit is None:
        if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern <= 0:
            raise ConfigError(f"config key 'sliding_window_pattern' must be a positive integer, "
                              f"got {pattern!r}; fix config.json or give an explicit layer_types list")
        return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(n_layers))
    if not isinstance(explicit, list) or len(explicit) != n_layers:
        raise ConfigError(f"config key 'layer_types' must list one entry per layer "
                          f"({n_layers}), got {explicit!r}; fix config.json")
    for t in explicit:
        require(t in LAYER_TYPES, "layer_types", t, ", ".join(LAYER_TYPES))
    return tuple(explicit)


def sliding_window(value, types: tuple) -> int:
    """The window of sliding layers (0 when no layer slides); a sliding layer needs one."""
    if SLIDING not in types:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"config key 'sliding_window' = {value!r}: sliding_attention layers need a "
                          "positive window; set sliding_window (or make every layer full_attention "
                          "in layer_types)")
    return value


@attrs.define(frozen=True)
class LayerSpec:
    """What one Gemma layer's attention declares (from the config, never guessed from weights)."""

    sliding_window: int = 0           # 0 = full causal attention
    rope: RopeSpec | None = None
    attn_softcap: float = 0.0         # 0 = none
    qk_norm: bool = False


def layer_specs(types: tuple, window: int, ropes: dict, attn_softcap: float, qk_norm: bool) -> tuple:
    """One LayerSpec per layer; ``ropes`` maps layer type -> RopeSpec."""
    return tuple(LayerSpec(sliding_window=window if t == SLIDING else 0, rope=ropes[t],
                           attn_softcap=float(attn_softcap or 0.0), qk_norm=qk_norm) for t in types)


def rope_spec(params: dict, head_dim: int, key: str = "rope_parameters (or rope_theta / rope_scaling)") -> RopeSpec:
    """RopeSpec from one layer type's rope parameters (``type`` accepted for ``rope_type``)."""
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    number(params.get("rope_theta"), f"{key}.rope_theta")
    if params["rope_type"] == "linear":
        number(params.get("factor"), f"{key}.factor")
    return blocks.make_rope(params, head_dim)


# ---------------------------------------------------------------------------------------------
# Weight map (data)
# ---------------------------------------------------------------------------------------------
def weight_map(a, norm_names: dict, qk_norm: bool = False, aliases=(), ignore=()) -> WeightMap:
    """Gemma checkpoint names -> canonical names: the standard decoder tensors with the family's
    own per-layer norms (``norm_names``: canonical -> stored module), every norm ``1 + w``."""
    rules = standard_rules(a, norm=ADD_ONE, norms=norm_names, qkv_bias=a.attention_bias,
                           o_bias=a.attention_bias, qk_norm=qk_norm)
    ignored = [r"rotary_emb\.[a-z_]*inv_freq$"]          # buffers some old checkpoints saved
    return WeightMap(rules=rules, n_layers=a.num_hidden_layers, aliases=list(aliases),
                     ignore=ignored + list(ignore))


# ---------------------------------------------------------------------------------------------
# Graph
# ---------------------------------------------------------------------------------------------
def build_graph(a, g: GraphBuilder, *, sandwich: bool, final_softcap: float):
    """embed * sqrt(H) -> layers (per-layer window / RoPE / softcap / q-k norm from
    ``a.layer_specs``) -> final norm -> lm_head [-> final soft-cap]."""
    eps = a.rms_norm_eps

    def mlp(g, i, x):                                      # (T, H) -> (T, H)
        return blocks.glu_mlp(g, i, x, a.hidden_size, a.intermediate_size, act=a.glu_act)

    def mixer(g, i, x):                                    # (T, H) -> (T, H)
        spec = a.layer_specs[i]
        return blocks.attention(
            g, i, x, hidden=a.hidden_size, n_heads=a.num_attention_heads,
            n_kv_heads=a.num_key_value_heads, head_dim=a.head_dim, rope_spec=spec.rope,
            scale=a.attn_scale, qkv_bias=a.attention_bias, o_bias=a.attention_bias,
            qk_norm_eps=eps if spec.qk_norm else None, softcap=spec.attn_softcap,
            window=spec.sliding_window)

    return decoder_stack(g, a, mixer, mlp, embed_scale=a.embed_scale, sandwich=sandwich,
                         final_softcap=final_softcap)


def unsupported_rope(key: str, value) -> UnsupportedConfigError:
    return UnsupportedConfigError(
        f"config key {key!r} = {value!r} is not supported by the Gemma families; give "
        "rope_parameters nested by layer type ({'full_attention': {...}, 'sliding_attention': {...}}) "
        "or the legacy rope_theta / rope_local_base_freq / rope_scaling keys")
