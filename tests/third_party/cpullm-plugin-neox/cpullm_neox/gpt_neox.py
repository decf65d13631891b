"""gpt_neox (GPT-NeoX, Pythia): model_type ``gpt_neox``, as transformers computes it.

    LayerNorms with bias; partial rotary (``partial_rotary_factor``, 0.25) over the first dims of
    each head; one fused ``query_key_value`` projection whose rows interleave q, k, v per head;
    attention and MLP biases; a plain MLP with the exact (erf) GELU, the op this plugin adds
    (ops.py); parallel residual by default: h + attn(ln1(h)) + mlp(ln2(h)); untied ``embed_out``.

Checkpoint tensors (L layers, H hidden, nh heads, hd = H / nh, I intermediate, V vocab)::

    gpt_neox.embed_in.weight                              (V, H)
    gpt_neox.layers.{i}.input_layernorm.{weight,bias}     (H,)
    gpt_neox.layers.{i}.attention.query_key_value.weight  (3H, H)  rows: head 0 [q k v], head 1 ...
    gpt_neox.layers.{i}.attention.query_key_value.bias    (3H,)
    gpt_neox.layers.{i}.attention.dense.{weight,bias}     (H, H), (H,)
    gpt_neox.layers.{i}.post_attention_layernorm.{weight,bias}  (H,)
    gpt_neox.layers.{i}.mlp.dense_h_to_4h.{weight,bias}   (I, H), (I,)
    gpt_neox.layers.{i}.mlp.dense_4h_to_h.{weight,bias}   (H, I), (H,)
    gpt_neox.final_layer_norm.{weight,bias}               (H,)
    embed_out.weight                                      (V, H)
"""
from __future__ import annotations

import attrs
import numpy as np

from cpullm.plugin import W, Args, FamilySpec, GraphBuilder, Op, Transform, WeightMap, blocks, require


@attrs.define
class NeoXArgs(Args):
    vocab_size: int = 50432
    hidden_size: int = 6144
    num_hidden_layers: int = 44
    num_attention_heads: int = 64
    intermediate_size: int = 24576
    hidden_act: str = "gelu"
    max_position_embeddings: int = 2048
    layer_norm_eps: float = 1e-5
    use_parallel_residual: bool = True
    attention_bias: bool = True
    tie_word_embeddings: bool = False
    head_dim: int = attrs.field(init=False, default=0)            # derived
    rope: object = attrs.field(init=False, default=None)          # derived: RopeSpec

    def derive(self, config: dict) -> None:
        require(self.hidden_size % self.num_attention_heads == 0, "num_attention_heads",
                self.num_attention_heads, "a divisor of hidden_size")
        require(self.hidden_act == "gelu", "hidden_act", self.hidden_act, "gelu (exact, erf)")
        require(not self.tie_word_embeddings, "tie_word_embeddings", True, "false")
        self.head_dim = self.hidden_size // self.num_attention_heads
        params = blocks.rope_parameters(config)
        partial = params.get("partial_rotary_factor", config.get("rotary_pct", 1.0))
        self.rope = blocks.make_rope(params, self.head_dim, partial_rotary_factor=partial)


def _per_head_qkv_to_blocks(w: np.ndarray, a: NeoXArgs) -> np.ndarray:
    """(3H, ...) rows [head0 q k v | head1 q k v | ...] -> [all q | all k | all v] (same shape),
    so that W(rows=...) can take q, k and v as row ranges."""
    nh, hd = a.num_attention_heads, a.head_dim
    rest = w.shape[1:]
    return w.reshape(nh, 3, hd, *rest).swapaxes(0, 1).reshape(w.shape)


QKV_BLOCKS = Transform("neox_qkv_blocks", _per_head_qkv_to_blocks)


def weight_map(a: NeoXArgs) -> WeightMap:
    H, V, I = a.hidden_size, a.vocab_size, a.intermediate_size
    L = "gpt_neox.layers.{i}."
    A = "layers.{i}.attn."
    qkv = L + "attention.query_key_value."
    rules = [
        W("embed", "gpt_neox.embed_in.weight", (V, H)),
        W("final_norm", "gpt_neox.final_layer_norm.weight", (H,)),
        W("final_norm_bias", "gpt_neox.final_layer_norm.bias", (H,)),
        W("lm_head", "embed_out.weight", (V, H)),
        W("layers.{i}.attn_norm", L + "input_layernorm.weight", (H,)),
        W("layers.{i}.attn_norm_bias", L + "input_layernorm.bias", (H,)),
        W("layers.{i}.mlp_norm", L + "post_attention_layernorm.weight", (H,)),
        W("layers.{i}.mlp_norm_bias", L + "post_attention_layernorm.bias", (H,)),
        W(A + "o_proj", L + "attention.dense.weight", (H, H)),
        W("layers.{i}.mlp.up_proj", L + "mlp.dense_h_to_4h.weight", (I, H)),
        W("layers.{i}.mlp.up_bias", L + "mlp.dense_h_to_4h.bias", (I,)),
        W("layers.{i}.mlp.down_proj", L + "mlp.dense_4h_to_h.weight", (H, I)),
        W("layers.{i}.mlp.down_bias", L + "mlp.dense_4h_to_h.bias", (H,)),
    ]
    for n, (r0, r1) in (("q", (0, H)), ("k", (H, 2 * H)), ("v", (2 * H, 3 * H))):
        rules.append(W(A + f"{n}_proj", qkv + "weight", (3 * H, H), transform=QKV_BLOCKS, rows=(r0, r1)))
        if a.attention_bias:
            rules.append(W(A + f"{n}_bias", qkv + "bias", (3 * H,), transform=QKV_BLOCKS, rows=(r0, r1)))
    if a.attention_bias:
        rules.append(W(A + "o_bias", L + "attention.dense.bias", (H,)))
    return WeightMap(rules=rules, n_layers=a.num_hidden_layers,
                     ignore=[r"rotary_emb\.inv_freq$", r"attention\.(masked_)?bias$"])


def build_graph(a: NeoXArgs, g: GraphBuilder):
    H, eps = a.hidden_size, a.layer_norm_eps

    def mixer(g, i, x):                                                   # (T, H) -> (T, H)
        return blocks.attention(g, i, x, hidden=H, n_heads=a.num_attention_heads,
                                n_kv_heads=a.num_attention_heads, head_dim=a.head_dim, rope_spec=a.rope,
                                scale=a.head_dim ** -0.5, qkv_bias=a.attention_bias,
                                o_bias=a.attention_bias)

    def mlp(g, i, x):                                                     # (T, H) -> (T, H)
        p = f"layers.{i}.mlp"
        up = blocks.linear(g, f"{p}.up_proj", x, f"{p}.up_proj", a.intermediate_size,
                           bias=f"{p}.up_bias", group="mlp_up")          # (T, I)
        act = g.op(f"{p}.act", "neox.gelu_erf", [up])                     # the plugin's op
        return blocks.linear(g, f"{p}.down_proj", act, f"{p}.down_proj", H, bias=f"{p}.down_bias",
                             group="mlp_down")

    h = blocks.embed(g, H)                                                # (T, H)
    for i in range(a.num_hidden_layers):
        if not a.use_parallel_residual:
            h = blocks.decoder_layer(g, i, h, mixer, mlp, eps, norm_kind="layer", norm_bias=True)
            continue
        p = f"layers.{i}"
        attn = mixer(g, i, blocks.norm(g, f"{p}.attn_norm", h, eps, kind="layer", bias=True))
        m = mlp(g, i, blocks.norm(g, f"{p}.mlp_norm", h, eps, kind="layer", bias=True))
        h = g.add(f"{p}.attn_residual", Op.ADD, [h, attn], group="residual")
        h = g.add(f"{p}.mlp_residual", Op.ADD, [h, m], group="residual")
    return g.build(blocks.lm_head(g, h, a.vocab_size, eps, norm_kind="layer", norm_bias=True))  # (T, V)


FAMILY = FamilySpec(
    name="gpt_neox",
    model_types=("gpt_neox",),
    architectures=("GPTNeoXForCausalLM",),
    args_class=NeoXArgs,
    weight_map=weight_map,
    build_graph=build_graph,
    description="GPT-NeoX / Pythia: LayerNorm with bias, partial rotary, parallel residual, exact GELU (plugin op)",
)
