"""cpullm-plugin-qwen: the Qwen families for cpullm.

model_type  module            checkpoints
qwen2       qwen2.py          Qwen2, Qwen2.5 (incl. Coder)  Qwen2ForCausalLM
qwen3       qwen3.py          Qwen3 dense                   Qwen3ForCausalLM
qwen3_5     qwen3_5.py        Qwen3.5 (multimodal wrapper: the text model runs)
qwen3_5_text qwen3_5_text.py  Qwen3.5 text-only             Qwen3_5ForCausalLM
"""
__version__ = "0.1.0"
