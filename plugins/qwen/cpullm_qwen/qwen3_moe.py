"""Qwen3-MoE: model_type ``qwen3_moe``, ``Qwen3MoeForCausalLM`` (Qwen3-30B-A3B, Qwen3-235B-A22B).

Qwen3's attention (per-head q/k norm, explicit head_dim) with routed experts in place of the MLP,
exactly as transformers 5 computes it:

    sparse layer (i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0, num_experts > 0):
        p = softmax(x @ gate.T) over num_experts; the num_experts_per_tok largest;
        renormalized to sum 1 when norm_topk_prob; out = sum_j p_j * down_j(silu(gate_j x) * up_j x)
    other layers: the dense SwiGLU MLP of width intermediate_size

Checkpoints store each expert's projections as their own tensors
(``mlp.experts.{e}.{gate,up,down}_proj.weight``) and the router as ``mlp.gate.weight``; the core's
MOE op (:func:`cpullm.graph.blocks.moe_mlp`) reads them as canonical ``layers.{i}.moe.*``.
"""
from __future__ import annotations

import attrs

from cpullm.plugin import FamilySpec, GraphBuilder, W, WeightMap, blocks, decoder_stack, require, standard_rules

from . import chat_formats, dense, tiny_configs
from .common import BUFFER_IGNORES, TEXT_PREFIX_ALIASES
from .qwen3 import Qwen3Args

MAX_EXPERTS = 4096          # bounds a config's expert count before the weight map expands it


@attrs.define
class Qwen3MoeArgs(Qwen3Args):
    num_experts: int = 128                  # transformers 5 saves it as num_local_experts
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = False            # transformers' default (Qwen3-30B-A3B sets true)
    decoder_sparse_step: int = 1
    mlp_only_layers: list | None = None
    # derived in derive()
    sparse_layers: tuple = attrs.field(init=False, default=())
    dense_layers: tuple = attrs.field(init=False, default=())

    def derive(self, config: dict) -> None:
        super().derive(config)
        self.num_experts = config.get("num_local_experts", self.num_experts)
        require(isinstance(self.num_experts, int) and 0 <= self.num_experts <= MAX_EXPERTS, "num_experts",
                self.num_experts, f"an integer in 0..{MAX_EXPERTS}")
        require(self.num_experts == 0 or 0 < self.num_experts_per_tok <= self.num_experts,
                "num_experts_per_tok", self.num_experts_per_tok, "between 1 and num_experts")
        require(int(self.decoder_sparse_step) > 0, "decoder_sparse_step", self.decoder_sparse_step,
                "a positive integer")
        only = self.mlp_only_layers or []
        require(isinstance(only, list) and all(isinstance(i, int) and 0 <= i < self.num_hidden_layers for i in only),
                "mlp_only_layers", only, "a list of layer indices")
        only = set(only)
        sparse = tuple(i for i in range(self.num_hidden_layers)
                       if i not in only and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0)
        self.sparse_layers = sparse
        self.dense_layers = tuple(i for i in range(self.num_hidden_layers) if i not in sparse)


def expert_rules(a, layers: tuple, stored: str = "model.layers.{i}.mlp.") -> list[W]:
    """The router and per-expert projections of ``layers`` as stored one tensor per expert."""
    H, E, I = a.hidden_size, a.num_experts, a.moe_intermediate_size
    rules = [W("layers.{i}.moe.router", stored + "gate.weight", (E, H), layers=layers)]
    for e in range(E):
        rules += [W(f"layers.{{i}}.moe.experts.{e}.gate_proj", f"{stored}experts.{e}.gate_proj.weight", (I, H), layers=layers),
                  W(f"layers.{{i}}.moe.experts.{e}.up_proj", f"{stored}experts.{e}.up_proj.weight", (I, H), layers=layers),
                  W(f"layers.{{i}}.moe.experts.{e}.down_proj", f"{stored}experts.{e}.down_proj.weight", (H, I), layers=layers)]
    return rules


def weight_map(a: Qwen3MoeArgs) -> WeightMap:
    rules = [r for r in standard_rules(a, qkv_bias=a.qkv_bias, o_bias=a.o_bias, qk_norm=a.qk_norm)
             if ".mlp." not in r.canonical]
    L = "model.layers.{i}.mlp."
    H, I = a.hidden_size, a.intermediate_size
    dense_layers = a.dense_layers
    rules += [W("layers.{i}.mlp.gate_proj", L + "gate_proj.weight", (I, H), layers=dense_layers),
              W("layers.{i}.mlp.up_proj", L + "up_proj.weight", (I, H), layers=dense_layers),
              W("layers.{i}.mlp.down_proj", L + "down_proj.weight", (H, I), layers=dense_layers)]
    rules += expert_rules(a, a.sparse_layers)
    return WeightMap(rules=rules, n_layers=a.num_hidden_layers, aliases=list(TEXT_PREFIX_ALIASES),
                     ignore=list(BUFFER_IGNORES))


def build_graph(a: Qwen3MoeArgs, g: GraphBuilder):
    sparse = set(a.sparse_layers)

    def mixer(g, i, x):
        return blocks.attention(g, i, x, hidden=a.hidden_size, n_heads=a.num_attention_heads,
                                n_kv_heads=a.num_key_value_heads, head_dim=a.head_dim,
                                rope_spec=a.rope_spec, scale=a.head_dim ** -0.5, qkv_bias=a.qkv_bias,
                                o_bias=a.o_bias, qk_norm_eps=a.rms_norm_eps if a.qk_norm else None,
                                window=a.layer_windows[i])

    def mlp(g, i, x):
        if i in sparse:
            return blocks.moe_mlp(g, i, x, hidden=a.hidden_size, n_experts=a.num_experts,
                                  top_k=a.num_experts_per_tok, intermediate=a.moe_intermediate_size,
                                  routing="softmax_topk", norm_topk=bool(a.norm_topk_prob))
        return blocks.glu_mlp(g, i, x, a.hidden_size, a.intermediate_size, act="silu")

    return decoder_stack(g, a, mixer, mlp)


FAMILY = FamilySpec(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    architectures=("Qwen3MoeForCausalLM",),
    args_class=Qwen3MoeArgs,
    weight_map=weight_map,
    build_graph=build_graph,
    description="Qwen3 mixture-of-experts Qwen3MoeForCausalLM checkpoints (routed experts, q/k norm)",
    tiny_config=tiny_configs.QWEN3_MOE,
    tool_formats=(chat_formats.HERMES,),
    reasoning_formats=(chat_formats.THINK,),
)
