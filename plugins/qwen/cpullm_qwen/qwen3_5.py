"""Qwen3.5 multimodal wrapper: model_type ``qwen3_5`` (``Qwen3_5ForConditionalGeneration``), the
form every Hub Qwen3.5 checkpoint takes. Only the text model runs: its settings are read from
``text_config`` (wrapper keys such as token ids kept), its weights from ``model.language_model.*``;
the vision tower (``model.visual.*``) and the multi-token-prediction head (``mtp.*``) are ignored
with a one-line notice. Tying follows the wrapper's own ``tie_word_embeddings`` (what transformers
reads for this class), else the text config's.
"""
from __future__ import annotations

import attrs

from cpullm.plugin import FamilySpec, text_config

from . import chat_formats, qwen3_5_text, tiny_configs


@attrs.define
class Qwen35Args(qwen3_5_text.Qwen35TextArgs):
    @classmethod
    def from_config(cls, config: dict) -> "Qwen35Args":
        merged = text_config(config)
        if "tie_word_embeddings" in config and isinstance(config.get("text_config"), dict):
            merged = dict(merged, tie_word_embeddings=config["tie_word_embeddings"])
        return super().from_config(merged)


FAMILY = FamilySpec(
    name="qwen3_5",
    model_types=("qwen3_5",),
    architectures=("Qwen3_5ForConditionalGeneration",),
    args_class=Qwen35Args,
    weight_map=qwen3_5_text.weight_map,
    build_graph=qwen3_5_text.build_graph,
    description="Qwen3.5 multimodal checkpoints: the text model (vision tower and MTP head ignored)",
    tiny_config=tiny_configs.QWEN3_5,
    tool_formats=(chat_formats.XML, chat_formats.HERMES),
    reasoning_formats=(chat_formats.THINK,),
)
