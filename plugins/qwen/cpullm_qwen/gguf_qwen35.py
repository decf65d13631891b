"""How llama.cpp's ``qwen35`` and ``qwen35moe`` GGUF architectures (its converter's
``Qwen3_5TextModel`` / ``Qwen3_5MoeTextModel``) convert to transformers' ``qwen3_5_text`` and
``qwen3_5_moe_text`` checkpoints.

Hybrid layers: ``{arch}.attention.recurrent_layers`` (one bool per block) marks the Gated DeltaNet
layers, the others are gated full attention. llama.cpp stores the Gated DeltaNet tensors under its
own names and changes them (undone here, as data: :func:`tensor_layouts`):

    attn_qkv      in_proj_qkv (conv_dim, H), its V rows reordered (below)
    attn_gate     in_proj_z (nv*dv, H), V rows reordered
    ssm_beta / ssm_alpha   in_proj_b / in_proj_a (nv, H), one row per V head, reordered
    ssm_a         -exp(A_log) (nv,), reordered; stored without ``.weight``
    ssm_dt.bias   dt_bias (nv,), reordered
    ssm_conv1d    conv1d (conv_dim, 1, K) squeezed to (conv_dim, K), V channels reordered
    ssm_norm      norm (dv,), plain w
    ssm_out       out_proj (H, nv*dv), its V columns reordered

V heads: transformers groups the nv value heads by the key head they share ([k0: v0..v{r-1},
k1: ...], r = nv / nk); llama.cpp tiles them ([k0 v0, k1 v0, ..., k0 v1, k1 v1, ...]) so that
ggml broadcasts the key heads. Transformers' head h = k*r + j is stored at j*nk + k.

Norms: llama.cpp folds the ``1 + w`` of Qwen3.5's zero-centred RMSNorm into the stored weight
(attn_norm, post_attention_norm, output_norm, attn_q_norm, attn_k_norm; not ssm_norm).
The multi-token-prediction block the converter may append (``nextn_predict_layers``) is not run.
"""
from __future__ import annotations

import numpy as np

from cpullm.plugin import (DENSE_LAYER_NAMES, QK_NORM_LAYER_NAMES, ConversionError, GGUFArch, GGUFLayout,
                           limits, meta_int)

from .gguf_arch import END_OF_TURN_TOKENS, PRE_TOKENIZER_SPLITS, SOFTMAX_GATING
from .qwen3_moe import MAX_EXPERTS

ATTENTION_NAMES = {
    **{k: v for k, v in DENSE_LAYER_NAMES.items() if k != "ffn_norm"},
    **QK_NORM_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
}
LINEAR_ATTENTION_NAMES = {
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_dt.bias": "linear_attn.dt_bias",      # whole names: no ".weight" kind
    "ssm_a": "linear_attn.A_log",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
MOE_MLP_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
    "ffn_up_exps": "mlp.experts.{e}.up_proj",
    "ffn_down_exps": "mlp.experts.{e}.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
DENSE_NAMES = {**ATTENTION_NAMES, **LINEAR_ATTENTION_NAMES}
MOE_NAMES = {**{k: v for k, v in DENSE_NAMES.items() if not k.startswith("ffn_")}, **MOE_MLP_NAMES}

# Tensors each kind of layer must have (names after "blk.N.").
EVERY_LAYER = ("attn_norm.weight", "post_attention_norm.weight")
FULL_ATTENTION = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                  "attn_q_norm.weight", "attn_k_norm.weight")
LINEAR_ATTENTION = ("attn_qkv.weight", "attn_gate.weight", "ssm_beta.weight", "ssm_alpha.weight",
                    "ssm_conv1d.weight", "ssm_dt.bias", "ssm_a", "ssm_norm.weight", "ssm_out.weight")
DENSE_MLP = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
MOE_MLP = tuple(f"{k}.weight" for k in MOE_MLP_NAMES)

ONE_PLUS_W_NORMS = ("attn_norm.weight", "post_attention_norm.weight", "output_norm.weight",
                    "attn_q_norm.weight", "attn_k_norm.weight")


def decoder_layers(meta: dict) -> int:
    """Blocks the decoder runs: block_count less the multi-token-prediction ones."""
    arch = meta.get("general.architecture")
    blocks = meta_int(meta, arch, "block_count", 1, limits.MAX_LAYERS)
    return blocks - meta_int(meta, arch, "nextn_predict_layers", 0, blocks - 1, default=0)


def layer_types(meta: dict) -> list[str]:
    """transformers' ``layer_types`` from ``attention.recurrent_layers`` (else the
    ``full_attention_interval`` pattern: layer i full iff (i + 1) % interval == 0)."""
    arch = meta.get("general.architecture")
    n = decoder_layers(meta)
    recurrent = meta.get(f"{arch}.attention.recurrent_layers")
    if recurrent is None:
        interval = meta_int(meta, arch, "full_attention_interval", 1, limits.MAX_LAYERS, default=4)
        return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    if not isinstance(recurrent, list) or len(recurrent) < n or not all(isinstance(r, bool) for r in recurrent):
        raise ConversionError(f"GGUF {arch}.attention.recurrent_layers = {limits.shown(recurrent)} is not one "
                              f"boolean per layer ({n} layers); the file is damaged")
    return ["linear_attention" if r else "full_attention" for r in recurrent[:n]]


def linear_heads(meta: dict) -> dict:
    """The Gated DeltaNet shape from the ``ssm.*`` keys, under transformers' names."""
    arch = meta.get("general.architecture")
    nk = meta_int(meta, arch, "ssm.group_count", 1, limits.MAX_HEADS)
    nv = meta_int(meta, arch, "ssm.time_step_rank", 1, limits.MAX_HEADS)
    inner = meta_int(meta, arch, "ssm.inner_size", 1, limits.MAX_HIDDEN)
    if nv % nk or inner % nv:
        raise ConversionError(f"GGUF {arch}.ssm.time_step_rank = {nv} is not a multiple of ssm.group_count = {nk}, "
                              f"or ssm.inner_size = {inner} not of time_step_rank; the file is damaged")
    return {"linear_num_key_heads": nk, "linear_num_value_heads": nv,
            "linear_key_head_dim": meta_int(meta, arch, "ssm.state_size", 1, limits.MAX_HEAD_DIM),
            "linear_value_head_dim": inner // nv,
            "linear_conv_kernel_dim": meta_int(meta, arch, "ssm.conv_kernel", 1, 64)}


def grouped_from_tiled(nk: int, nv: int, head_dim: int) -> np.ndarray | None:
    """Rows of transformers' grouped V-head order as indices into llama.cpp's tiled order
    (None when nk == nv: nothing moved). Head h = k * r + j (r = nv / nk) is stored at j * nk + k."""
    if nk == nv:
        return None
    r = nv // nk
    h = np.arange(nv)
    stored_head = (h % r) * nk + h // r
    return (stored_head[:, None] * head_dim + np.arange(head_dim)).reshape(-1)


def _log_of_minus(a: np.ndarray) -> np.ndarray:
    """A_log from llama.cpp's ssm_a = -exp(A_log)."""
    if not np.all(a < 0):
        raise ConversionError("a GGUF ssm_a tensor holds values >= 0; llama.cpp stores -exp(A_log), always "
                              "negative: the file is damaged")
    return np.log(-a)


def tensor_layouts(meta: dict) -> dict:
    """GGUFArch.tensor_layouts of qwen35 / qwen35moe: the transforms of the module docstring."""
    arch = meta.get("general.architecture")
    hidden = meta_int(meta, arch, "embedding_length", 1, limits.MAX_HIDDEN)
    d = linear_heads(meta)
    nk, nv, dk, dv, K = (d["linear_num_key_heads"], d["linear_num_value_heads"], d["linear_key_head_dim"],
                         d["linear_value_head_dim"], d["linear_conv_kernel_dim"])
    qk = 2 * nk * dk
    conv_dim = qk + nv * dv
    v_rows, v_heads = grouped_from_tiled(nk, nv, dv), grouped_from_tiled(nk, nv, 1)
    qkv_rows = None if v_rows is None else np.concatenate([np.arange(qk), qk + v_rows])
    out = {
        "attn_qkv.weight": GGUFLayout(gguf_shape=(conv_dim, hidden), rows=qkv_rows),
        "attn_gate.weight": GGUFLayout(gguf_shape=(nv * dv, hidden), rows=v_rows),
        "ssm_beta.weight": GGUFLayout(gguf_shape=(nv, hidden), rows=v_heads),
        "ssm_alpha.weight": GGUFLayout(gguf_shape=(nv, hidden), rows=v_heads),
        "ssm_a": GGUFLayout(gguf_shape=(nv,), rows=v_heads, to_hf=_log_of_minus, to_gguf=lambda w: -np.exp(w)),
        "ssm_dt.bias": GGUFLayout(gguf_shape=(nv,), rows=v_heads),
        "ssm_conv1d.weight": GGUFLayout(gguf_shape=(conv_dim, K), hf_shape=(conv_dim, 1, K), rows=qkv_rows),
        "ssm_norm.weight": GGUFLayout(gguf_shape=(dv,)),
        "ssm_out.weight": GGUFLayout(gguf_shape=(hidden, nv * dv), columns=v_rows),
    }
    out.update({name: GGUFLayout(add_one=True) for name in ONE_PLUS_W_NORMS})
    return out


def _layer_tensors(mlp: tuple):
    def layer_tensors(meta: dict, layer: int) -> tuple:
        mixer = LINEAR_ATTENTION if layer_types(meta)[layer] == "linear_attention" else FULL_ATTENTION
        return EVERY_LAYER + mixer + mlp
    return layer_tensors


def config_extras(meta: dict, hp: dict, tensor_names: tuple) -> dict:
    """qwen3_5_text's config keys: layer pattern, Gated DeltaNet shape, partial rotary."""
    arch = hp["arch"]
    rotary = meta_int(meta, arch, "rope.dimension_count", 2, hp["head_dim"], default=hp["head_dim"] // 4)
    return {"hidden_act": "silu", "layer_types": layer_types(meta),
            "attention_bias": any(n.endswith("attn_q.bias") for n in tensor_names),
            "partial_rotary_factor": rotary / hp["head_dim"], **linear_heads(meta)}


def moe_config_extras(meta: dict, hp: dict, tensor_names: tuple) -> dict:
    """qwen3_5_moe_text's: those of qwen35 plus the experts, as llama.cpp runs them (softmax over
    all experts, the top ``expert_used_count`` renormalized, a sigmoid-gated shared expert)."""
    arch = hp["arch"]
    gating = meta.get(f"{arch}.expert_gating_func", SOFTMAX_GATING)
    if gating != SOFTMAX_GATING:
        raise ConversionError(f"GGUF {arch}.expert_gating_func = {limits.shown(gating)}: cpullm runs {arch} with "
                              f"softmax gating ({SOFTMAX_GATING}) only; the file is not a Qwen3.5-MoE model")
    n_experts = meta_int(meta, arch, "expert_count", 1, MAX_EXPERTS)
    return {**config_extras(meta, hp, tensor_names),
            "intermediate_size": hp["intermediate_size"],      # None (no dense MLP): left out
            "num_experts": n_experts,
            "num_experts_per_tok": meta_int(meta, arch, "expert_used_count", 1, n_experts),
            "moe_intermediate_size": meta_int(meta, arch, "expert_feed_forward_length", 1, 1 << 20),
            "shared_expert_intermediate_size": meta_int(meta, arch, "expert_shared_feed_forward_length",
                                                        1, 1 << 20)}


def _hybrid_arch(name: str, model_type: str, architecture: str, layer_names: dict, mlp, extras) -> GGUFArch:
    """A llama.cpp Qwen3.5 architecture: what the dense and the MoE one differ in is their MLP."""
    return GGUFArch(
        name=name,
        model_type=model_type,
        architectures=(architecture,),
        layer_names=layer_names,
        required_layer_leaves=("attn_norm", "post_attention_norm"),
        layer_tensors=_layer_tensors(mlp),
        tensor_layouts=tensor_layouts,
        config_extras=extras,
        pre_tokenizer_splits=PRE_TOKENIZER_SPLITS,
        end_of_turn_tokens=END_OF_TURN_TOKENS,
    )


QWEN35 = _hybrid_arch("qwen35", "qwen3_5_text", "Qwen3_5ForCausalLM", DENSE_NAMES, DENSE_MLP, config_extras)
QWEN35_MOE = _hybrid_arch("qwen35moe", "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", MOE_NAMES, MOE_MLP,
                          moe_config_extras)
