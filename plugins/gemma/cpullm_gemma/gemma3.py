"""Gemma 3 multimodal checkpoint (model_type ``gemma3``, Gemma3ForConditionalGeneration):
google/gemma-3-4b-it and larger. Only its text model runs.

* The text settings sit under ``text_config`` and list only non-default keys: the rest are
  Gemma3TextConfig's defaults (:class:`.gemma3_text.Gemma3TextArgs` carries them).
* Text weights come under either prefix: ``language_model.model.*`` (Hub checkpoints saved by
  transformers 4.5x) or ``model.language_model.*`` (transformers 5 save_pretrained); an untied
  lm_head under ``language_model.lm_head.*`` or ``lm_head.*``.
* The vision tower and the projector are ignored (the core prints a one-line notice).
* The wrapper never applies ``final_logit_softcapping``, and no Gemma 3 attention
  applies ``attn_logit_softcapping``.
"""
from __future__ import annotations

import attrs

from cpullm.plugin import FamilySpec, GraphBuilder, text_config

from . import chat_formats, gemma3_text, tiny_configs

# (prefix found in checkpoints, prefix the weight map's rules use)
TEXT_PREFIXES = [
    ("language_model.model.", "model."),          # Hub (transformers 4.5x)
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),          # transformers 5 save_pretrained
]
# Tensors present on purpose that a text-only runtime does not use.
NON_TEXT = [r"^(model\.)?vision_tower\.", r"^(model\.)?multi_modal_projector\."]


@attrs.define
class Gemma3Args(gemma3_text.Gemma3TextArgs):
    @classmethod
    def from_config(cls, config: dict) -> "Gemma3Args":
        # text_config over the wrapper's keys; unlisted text keys keep Gemma3TextConfig defaults
        return super().from_config(text_config(config))

    def derive(self, config: dict) -> None:
        super().derive(config)
        self.final_softcap = 0.0          # Gemma3ForConditionalGeneration never soft-caps logits


def weight_map(a: Gemma3Args):
    return gemma3_text.weight_map(a, aliases=TEXT_PREFIXES, ignore=NON_TEXT)


def build_graph(a: Gemma3Args, g: GraphBuilder):
    return gemma3_text.build_graph(a, g)


FAMILY = FamilySpec(
    name="gemma3",
    model_types=("gemma3",),
    architectures=("Gemma3ForConditionalGeneration",),
    args_class=Gemma3Args,
    weight_map=weight_map,
    build_graph=build_graph,
    description="Gemma 3 4B+ multimodal checkpoints (text model only)",
    tiny_config=tiny_configs.GEMMA3,
    tool_formats=(chat_formats.TOOL_CALL_JSON,),
)
