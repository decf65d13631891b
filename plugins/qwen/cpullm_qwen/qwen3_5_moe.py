"""Qwen3.5-MoE: model_type ``qwen3_5_moe`` (``Qwen3_5MoeForConditionalGeneration``, the Hub's
form: the text model in ``text_config``, vision tower and MTP head ignored) and
``qwen3_5_moe_text`` (``Qwen3_5MoeForCausalLM``).

Qwen3.5's hybrid decoder (Gated DeltaNet and gated-attention layers, qwen3_5_text.py) with routed
experts in every layer's MLP, as transformers 5 computes it:

    p = softmax(x @ gate.T) over num_experts; the num_experts_per_tok largest, renormalized to 1
    out = sum_j p_j * down_j(silu(gate_j x) * up_j x)
          + sigmoid(x . shared_expert_gate) * shared_expert(x)     (width shared_expert_intermediate_size)

Tensors: ``mlp.gate.weight`` (router), ``mlp.experts.{e}.{gate,up,down}_proj.weight``,
``mlp.shared_expert.{gate,up,down}_proj.weight``, ``mlp.shared_expert_gate.weight`` (1, H).
"""
from __future__ import annotations

import attrs

from cpullm.plugin import FamilySpec, GraphBuilder, W, WeightMap, blocks, decoder_stack, require, text_config

from . import chat_formats, qwen3_5_text, tiny_configs
from .qwen3_moe import MAX_EXPERTS, expert_rules


@attrs.define
class Qwen35MoeTextArgs(qwen3_5_text.Qwen35TextArgs):
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512

    def derive(self, config: dict) -> None:
        super().derive(config)
        require(isinstance(self.num_experts, int) and 0 < self.num_experts <= MAX_EXPERTS, "num_experts",
                self.num_experts, f"an integer in 1..{MAX_EXPERTS}")
        require(0 < self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok",
                self.num_experts_per_tok, "between 1 and num_experts")
        require(int(self.shared_expert_intermediate_size) > 0, "shared_expert_intermediate_size",
                self.shared_expert_intermediate_size, "a positive integer")


@attrs.define
class Qwen35MoeArgs(Qwen35MoeTextArgs):
    @classmethod
    def from_config(cls, config: dict) -> "Qwen35MoeArgs":
        merged = text_config(config)
        if "tie_word_embeddings" in config and isinstance(config.get("text_config"), dict):
            merged = dict(merged, tie_word_embeddings=config["tie_word_embeddings"])
        return super().from_config(merged)


def weight_map(a: Qwen35MoeTextArgs) -> WeightMap:
    dense = qwen3_5_text.weight_map(a)
    rules = [r for r in dense.rules if ".mlp." not in r.canonical]
    every = tuple(range(a.num_hidden_layers))
    rules += expert_rules(a, every)
    H, S = a.hidden_size, a.shared_expert_intermediate_size
    L = "model.layers.{i}.mlp."
    rules += [W("layers.{i}.moe.shared.gate_proj", L + "shared_expert.gate_proj.weight", (S, H)),
              W("layers.{i}.moe.shared.up_proj", L + "shared_expert.up_proj.weight", (S, H)),
              W("layers.{i}.moe.shared.down_proj", L + "shared_expert.down_proj.weight", (H, S)),
              W("layers.{i}.moe.shared_gate", L + "shared_expert_gate.weight", (1, H))]
    return attrs.evolve(dense, rules=rules)


def build_graph(a: Qwen35MoeTextArgs, g: GraphBuilder):
    full = set(a.full_layers)

    def mixer(g, i, x):
        return qwen3_5_text.mixer(a, g, i, x, full)

    def mlp(g, i, x):
        return blocks.moe_mlp(g, i, x, hidden=a.hidden_size, n_experts=a.num_experts,
                              top_k=a.num_experts_per_tok, intermediate=a.moe_intermediate_size,
                              routing="softmax_topk", norm_topk=True,
                              shared_intermediate=a.shared_expert_intermediate_size, shared_gate=True)

    return decoder_stack(g, a, mixer, mlp)


FAMILY = FamilySpec(
    name="qwen3_5_moe",
    model_types=("qwen3_5_moe",),
    architectures=("Qwen3_5MoeForConditionalGeneration",),
    args_class=Qwen35MoeArgs,
    weight_map=weight_map,
    build_graph=build_graph,
    description="Qwen3.5 mixture-of-experts multimodal checkpoints: the text model (hybrid linear "
                "attention, routed + shared experts; vision tower and MTP head ignored)",
    tiny_config=tiny_configs.QWEN3_5_MOE,
    tool_formats=(chat_formats.XML, chat_formats.HERMES),
    reasoning_formats=(chat_formats.THINK,),
)
TEXT_FAMILY = FamilySpec(
    name="qwen3_5_moe_text",
    model_types=("qwen3_5_moe_text",),
    architectures=("Qwen3_5MoeForCausalLM",),
    args_class=Qwen35MoeTextArgs,
    weight_map=weight_map,
    build_graph=build_graph,
    description="Qwen3.5 mixture-of-experts text-only checkpoints (hybrid linear attention, routed + shared experts)",
    tiny_config=tiny_configs.QWEN3_5_MOE_TEXT,
    tool_formats=(chat_formats.XML, chat_formats.HERMES),
    reasoning_formats=(chat_formats.THINK,),
)
