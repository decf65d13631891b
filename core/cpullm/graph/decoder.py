"""The standard decoder's tensors, written once, so that a family file states only what differs.

Most Hugging Face decoders (Llama, Qwen2/3, Gemma, ...) store the same tensors under the same
names: ``model.embed_tokens``, ``model.norm``, ``lm_head`` and per layer the two norms, the four
attention projections and the three GLU projections (optional biases, optional per-head q/k
norms). :func:`standard_rules` returns those rules; a family adds its own rules (or writes its own
table where its checkpoints differ) and passes the list to :class:`~cpullm.loading.weightmap.WeightMap`.

Tied embeddings follow transformers (``PreTrainedModel.tie_weights`` in transformers 5): when
``tie_word_embeddings`` is true and the checkpoint stores no ``lm_head.weight``, the head is the
embedding; when it stores one that differs from the embedding, transformers does not tie and uses
the stored head. :func:`lm_head_rule` is that rule, in one place.

:func:`decoder_stack` builds the standard graph around a family's own attention (and MLP).
"""
from __future__ import annotations

from . import blocks
from .ir import GraphBuilder
from ..loading.weightmap import Transform, W

STANDARD_NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}


def lm_head_rule(tied: bool, vocab: int, hidden: int) -> W:
    """lm_head (V, H): the stored ``lm_head.weight`` when present; tied and absent -> the
    embedding; untied and absent -> a missing-tensor error."""
    return W("lm_head", "lm_head.weight", (vocab, hidden), tied_to="embed" if tied else None)


def standard_rules(a, prefix: str = "model.layers.{i}.", *, norm: Transform | None = None,
                   norms: dict | None = None, qkv_bias: bool = False, o_bias: bool = False,
                   qk_norm: bool = False) -> list[W]:
    """The standard decoder's rules for args ``a`` (hidden_size, vocab_size, intermediate_size,
    num_attention_heads, num_key_value_heads, head_dim, tie_word_embeddings).

    ``norm`` transforms every RMSNorm weight (``ADD_ONE`` for zero-centred ``1 + w`` norms);
    ``norms`` maps the canonical per-layer norm names to the stored module names (default: the
    pre-attention and pre-MLP norms); ``qkv_bias`` / ``o_bias`` add the projection biases,
    ``qk_norm`` the per-head q/k norms (head_dim,)."""
    H, V, I, D = a.hidden_size, a.vocab_size, a.intermediate_size, a.head_dim
    q, kv = a.num_attention_heads * D, a.num_key_value_heads * D
    L = prefix
    rules = [
        W("embed", "model.embed_tokens.weight", (V, H)),
        W("final_norm", "model.norm.weight", (H,), transform=norm),
        lm_head_rule(a.tie_word_embeddings, V, H),
    ]
    rules += [W(f"layers.{{i}}.{canonical}", f"{L}{stored}.weight", (H,), transform=norm)
              for canonical, stored in (STANDARD_NORMS if norms is None else norms).items()]
    rules += [
        W("layers.{i}.attn.q_proj", L + "self_attn.q_proj.weight", (q, H)),
        W("layers.{i}.attn.k_proj", L + "self_attn.k_proj.weight", (kv, H)),
        W("layers.{i}.attn.v_proj", L + "self_attn.v_proj.weight", (kv, H)),
        W("layers.{i}.attn.o_proj", L + "self_attn.o_proj.weight", (H, q)),
        W("layers.{i}.mlp.gate_proj", L + "mlp.gate_proj.weight", (I, H)),
        W("layers.{i}.mlp.up_proj", L + "mlp.up_proj.weight", (I, H)),
        W("layers.{i}.mlp.down_proj", L + "mlp.down_proj.weight", (H, I)),
    ]
    if qkv_bias:
        rules += [W("layers.{i}.attn.q_bias", L + "self_attn.q_proj.bias", (q,)),
                  W("layers.{i}.attn.k_bias", L + "self_attn.k_proj.bias", (kv,)),
                  W("layers.{i}.attn.v_bias", L + "self_attn.v_proj.bias", (kv,))]
    if o_bias:
        rules.append(W("layers.{i}.attn.o_bias", L + "self_attn.o_proj.bias", (H,)))
    if qk_norm:
        rules += [W("layers.{i}.attn.q_norm", L + "self_attn.q_norm.weight", (D,), transform=norm),
                  W("layers.{i}.attn.k_norm", L + "self_attn.k_norm.weight", (D,), transform=norm)]
    return rules


def glu_silu(a):
    """The standard MLP, SwiGLU over (hidden_size, intermediate_size): mlp(g, i, x) -> (T, H)."""
    def mlp(g, i, x):
        return blocks.glu_mlp(g, i, x, a.hidden_size, a.intermediate_size, act="silu")
    return mlp


def decoder_stack(g: GraphBuilder, a, mixer, mlp=None, *, embed_scale: float = 1.0,
                  sandwich: bool = False, final_softcap: float = 0.0):
    """The standard decoder graph: embed [* embed_scale] -> num_hidden_layers pre-norm (or
    ``sandwich``) layers of ``mixer(g, i, x)`` and ``mlp(g, i, x)`` (default: :func:`glu_silu`),
    each (T, H) -> (T, H), norms with ``a.rms_norm_eps`` -> final norm -> lm_head
    [-> final soft-cap]; returns the built graph (logits (R, V))."""
    eps = a.rms_norm_eps
    mlp = glu_silu(a) if mlp is None else mlp
    h = blocks.embed(g, a.hidden_size, scale=embed_scale)                         # (T, H)
    for i in range(a.num_hidden_layers):
        h = blocks.decoder_layer(g, i, h, mixer, mlp, eps, sandwich=sandwich)
    return g.build(blocks.lm_head(g, h, a.vocab_size, eps, final_softcap=final_softcap))
