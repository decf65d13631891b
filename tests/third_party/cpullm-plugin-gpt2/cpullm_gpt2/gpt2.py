"""gpt2 (GPT-2, DistilGPT-2): model_type ``gpt2``, as transformers' GPT2LMHeadModel computes it.

    learned absolute position embeddings (``wpe``, n_positions rows: the context cannot exceed
    them, declared as the family's context limit); pre-LayerNorms with bias; one fused
    ``c_attn`` projection; attention, MLP and projection biases; a plain MLP with GPT-2's tanh
    GELU ("gelu_new"); the lm_head tied to ``wte``.

The checkpoint's matrices are Conv1D weights, stored (in, out): the TRANSPOSE transform turns
each into the (out, in) a core LINEAR reads, so every matrix quantizes like any other model's.
config.json names its keys its own way (``n_embd``, ``n_layer``, ``n_head``, ``n_positions``,
``n_inner``, ``layer_norm_epsilon``); ``config_keys`` bounds them as the core bounds the common
names.

Checkpoint tensors (L layers, H = n_embd, I = n_inner or 4H, V vocab, P = n_positions; older
checkpoints lack the ``transformer.`` prefix)::

    transformer.wte.weight                          (V, H)
    transformer.wpe.weight                          (P, H)
    transformer.h.{i}.ln_1.{weight,bias}            (H,)
    transformer.h.{i}.attn.c_attn.{weight,bias}     (H, 3H), (3H,)   columns [q | k | v]
    transformer.h.{i}.attn.c_proj.{weight,bias}     (H, H), (H,)
    transformer.h.{i}.ln_2.{weight,bias}            (H,)
    transformer.h.{i}.mlp.c_fc.{weight,bias}        (H, I), (I,)
    transformer.h.{i}.mlp.c_proj.{weight,bias}      (I, H), (H,)
    transformer.ln_f.{weight,bias}                  (H,)
    [lm_head.weight                                 (V, H)]          tied to wte
"""
from __future__ import annotations

import attrs

from cpullm.plugin import TRANSPOSE, W, Args, FamilySpec, GraphBuilder, WeightMap, blocks, require


@attrs.define
class GPT2Args(Args):
    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    tie_word_embeddings: bool = True
    add_cross_attention: bool = False
    head_dim: int = attrs.field(init=False, default=0)          # derived
    intermediate: int = attrs.field(init=False, default=0)      # derived: n_inner or 4 n_embd
    act: str = attrs.field(init=False, default="")              # derived: the core ACT op's name

    def derive(self, config: dict) -> None:
        require(self.n_embd % self.n_head == 0, "n_head", self.n_head, "a divisor of n_embd")
        require(self.activation_function in blocks.HF_ACTIVATIONS, "activation_function",
                self.activation_function, ", ".join(blocks.HF_ACTIVATIONS))
        require(not self.add_cross_attention, "add_cross_attention", True, "false (a decoder-only model)")
        self.head_dim = self.n_embd // self.n_head
        self.intermediate = self.n_inner or 4 * self.n_embd
        self.act = blocks.HF_ACTIVATIONS[self.activation_function]

    def attention_scale(self, i: int) -> float:
        """1/sqrt(head_dim) (or 1 without scale_attn_weights), divided by i + 1 with
        scale_attn_by_inverse_layer_idx, as transformers scales layer i's scores."""
        scale = self.head_dim ** -0.5 if self.scale_attn_weights else 1.0
        return scale / (i + 1) if self.scale_attn_by_inverse_layer_idx else scale


def weight_map(a: GPT2Args) -> WeightMap:
    H, V, I, P = a.n_embd, a.vocab_size, a.intermediate, a.n_positions
    L = "transformer.h.{i}."
    A = "layers.{i}.attn."
    M = "layers.{i}.mlp."
    rules = [
        W("embed", "transformer.wte.weight", (V, H)),
        W("pos_embed", "transformer.wpe.weight", (P, H)),
        W("final_norm", "transformer.ln_f.weight", (H,)),
        W("final_norm_bias", "transformer.ln_f.bias", (H,)),
        W("lm_head", "lm_head.weight", (V, H), tied_to="embed" if a.tie_word_embeddings else None),
        W("layers.{i}.attn_norm", L + "ln_1.weight", (H,)),
        W("layers.{i}.attn_norm_bias", L + "ln_1.bias", (H,)),
        W("layers.{i}.mlp_norm", L + "ln_2.weight", (H,)),
        W("layers.{i}.mlp_norm_bias", L + "ln_2.bias", (H,)),
        # Conv1D matrices are stored (in, out): TRANSPOSE gives the (out, in) of a LINEAR
        W(A + "o_proj", L + "attn.c_proj.weight", (H, H), transform=TRANSPOSE),
        W(A + "o_bias", L + "attn.c_proj.bias", (H,)),
        W(M + "up_proj", L + "mlp.c_fc.weight", (H, I), transform=TRANSPOSE),
        W(M + "up_bias", L + "mlp.c_fc.bias", (I,)),
        W(M + "down_proj", L + "mlp.c_proj.weight", (I, H), transform=TRANSPOSE),
        W(M + "down_bias", L + "mlp.c_proj.bias", (H,)),
    ]
    for n, (r0, r1) in (("q", (0, H)), ("k", (H, 2 * H)), ("v", (2 * H, 3 * H))):
        # c_attn (H, 3H) transposed is (3H, H), rows [q | k | v]: rows of the canonical tensor
        rules.append(W(A + f"{n}_proj", L + "attn.c_attn.weight", (H, 3 * H), transform=TRANSPOSE, rows=(r0, r1)))
        rules.append(W(A + f"{n}_bias", L + "attn.c_attn.bias", (3 * H,), rows=(r0, r1)))
    return WeightMap(rules=rules, n_layers=a.n_layer,
                     aliases=[(p, "transformer." + p) for p in ("h.", "wte.", "wpe.", "ln_f.")],
                     ignore=[r"\.attn\.(masked_)?bias$"])


def build_graph(a: GPT2Args, g: GraphBuilder):
    H, eps = a.n_embd, a.layer_norm_epsilon

    def mixer(g, i, x):                                                   # (T, H) -> (T, H)
        return blocks.attention(g, i, x, hidden=H, n_heads=a.n_head, n_kv_heads=a.n_head,
                                head_dim=a.head_dim, rope_spec=None, scale=a.attention_scale(i),
                                qkv_bias=True, o_bias=True)

    def mlp(g, i, x):                                                     # (T, H) -> (T, H)
        return blocks.mlp(g, i, x, H, a.intermediate, a.act, bias=True)

    h = blocks.embed(g, H)                                                # (T, H)
    h = blocks.position_embed(g, h, a.n_positions)                        # + wpe[position]
    for i in range(a.n_layer):
        h = blocks.decoder_layer(g, i, h, mixer, mlp, eps, norm_kind="layer", norm_bias=True)
    return g.build(blocks.lm_head(g, h, a.vocab_size, eps, norm_kind="layer", norm_bias=True))  # (T, V)


FAMILY = FamilySpec(
    name="gpt2",
    model_types=("gpt2",),
    architectures=("GPT2LMHeadModel",),
    args_class=GPT2Args,
    weight_map=weight_map,
    build_graph=build_graph,
    context_limit=lambda a: a.n_positions,                # wpe has no row past n_positions
    config_keys={"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
                 "n_inner": "intermediate_size", "n_positions": "max_position_embeddings",
                 "n_ctx": "max_position_embeddings", "layer_norm_epsilon": "layer_norm_eps"},
    description="GPT-2 / DistilGPT-2: Conv1D matrices transposed into LINEARs, learned positions, tanh GELU",
    tiny_config=dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=256, n_positions=128,
                     n_embd=64, n_layer=2, n_head=4, activation_function="gelu_new",
                     layer_norm_epsilon=1e-5, tie_word_embeddings=True),
)
