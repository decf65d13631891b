"""cpullm-plugin-gemma: the Gemma families for cpullm.

One module per ``model_type``: :mod:`.gemma` (Gemma 1), :mod:`.gemma2`, :mod:`.gemma3_text`
(Gemma3ForCausalLM) and :mod:`.gemma3` (Gemma3ForConditionalGeneration: its text model only).
:mod:`.common` holds what they share (weight-map tables, layer patterns, the graph).
"""
__version__ = "0.1.0"
