"""GGUF file -> Hugging Face model directory (config.json, bf16 model.safetensors, tokenizer files).

    from cpullm.convert import convert_gguf
    convert_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2/")

The output is what transformers' own GGUF loader builds in memory, saved the way
``save_pretrained`` would save a bf16 checkpoint:

* tensors are dequantized with the ``gguf`` package, renamed to transformers' names, llama.cpp's
  Q/K row permutation and ``1 + w`` norms are undone where the architecture has them; every
  tensor is written as bf16 (round to nearest even, like torch);
* the tokenizer is rebuilt from the GGUF vocabulary with the ``tokenizers`` library alone
  (transformers is *not* needed), giving the same token ids as transformers' GGUF tokenizer;
* everything is written into a hidden sibling directory first and renamed into place, so an
  interrupted conversion leaves nothing under the output name.

Reading the file, planning its tensors and building the config are :mod:`cpullm.loading.gguf_file`'s, the
tokenizer :mod:`cpullm.loading.gguf_vocab`'s (the runtime uses both to run a GGUF as it is); this module
writes the directory. Everything that depends on the GGUF architecture comes from the installed
plugins' :class:`cpullm.loading.family.GGUFArch` (hook ``cpullm_gguf_architectures``): the architectures
``cpullm convert`` supports are theirs.

The converter in two modules: :mod:`~cpullm.convert.directory` (GGUF -> checkpoint directory,
``cpullm convert``) and :mod:`~cpullm.convert.gguf_writer` (checkpoint -> GGUF, one writer for the
tests and the benchmarks).
"""
from .directory import convert_gguf, safetensors_header, write_safetensors

__all__ = ["convert_gguf", "safetensors_header", "write_safetensors"]
