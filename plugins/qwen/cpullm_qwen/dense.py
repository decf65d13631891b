"""The dense Qwen decoder shared by qwen2 and qwen3 (they differ only in options):

    h = embed(ids)
    per layer: h += o_proj(attn(rope(qk_norm?(q)), rope(qk_norm?(k)), v))   (pre-norm, w*n RMSNorm)
               h += down(silu(gate(x)) * up(x))
    logits = lm_head(norm(h))

Options (derived by each model type's Args): ``qkv_bias``, ``o_bias``, ``qk_norm`` (per-head
RMSNorm over head_dim before RoPE), and a per-layer attention window (0 = full causal).
"""
from __future__ import annotations

from cpullm.plugin import GraphBuilder, WeightMap, blocks, decoder_stack, standard_rules

from .common import BUFFER_IGNORES, TEXT_PREFIX_ALIASES, check_layer_types

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


def layer_windows(a) -> tuple:
    """Attention window per layer, as transformers' Qwen2/Qwen3 config computes it: the window
    applies only when ``use_sliding_window`` is true (quirk: ``sliding_window`` alone is ignored),
    to the layers typed ``sliding_attention`` (default: layers i >= ``max_window_layers``)."""
    window = int(a.sliding_window or 0) if a.use_sliding_window else 0
    if a.layer_types is None:
        types = ["sliding_attention" if window and i >= a.max_window_layers else "full_attention"
                 for i in range(a.num_hidden_layers)]
    else:
        types = check_layer_types(a.layer_types, a.num_hidden_layers, ATTENTION_LAYER_TYPES)
    return tuple(window if t == "sliding_attention" else 0 for t in types)


def weight_map(a) -> WeightMap:
    rules = standard_rules(a, qkv_bias=a.qkv_bias, o_bias=a.o_bias, qk_norm=a.qk_norm)
    return WeightMap(rules=rules, n_layers=a.num_hidden_layers, aliases=list(TEXT_PREFIX_ALIASES),
                     ignore=list(BUFFER_IGNORES))


def build_graph(a, g: GraphBuilder):
    def mixer(g, i, x):
        return blocks.attention(g, i, x, hidden=a.hidden_size, n_heads=a.num_attention_heads,
                                n_kv_heads=a.num_key_value_heads, head_dim=a.head_dim,
                                rope_spec=a.rope_spec, scale=a.head_dim ** -0.5, qkv_bias=a.qkv_bias,
                                o_bias=a.o_bias, qk_norm_eps=a.rms_norm_eps if a.qk_norm else None,
                                window=a.layer_windows[i])

    return decoder_stack(g, a, mixer)
