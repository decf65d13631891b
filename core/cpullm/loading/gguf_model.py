"""A GGUF file as a model source: tensors under transformers' names, config and tokenizer from its
metadata (the same code as ``cpullm convert``, cpullm.convert), no conversion step.

:class:`GGUFStore` stands in for cpullm.loading.tensors.TensorStore: ``names / shape / dtype / get``
(float32, dequantized and transformed exactly as ``convert`` writes them) plus
:meth:`GGUFStore.blocks`, the stored bytes of a matrix in a block format the runtime executes as
it is (cpullm_kernels.rows.gguf_blocks.FORMATS). Those are views of the file's memory map, except for
llama's q / k matrices, whose rows llama.cpp permuted: their rows are put back in transformers'
order (a row permutation moves whole rows of blocks; nothing is requantized).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..errors import ConfigError, ConversionError, ModelNotFoundError


def is_gguf_file(path) -> bool:
    """True for a regular file whose first 4 bytes are the GGUF magic."""
    p = Path(path)
    try:
        if not p.is_file():
            return False
        with open(p, "rb") as fh:
            return fh.read(4) == b"GGUF"
    except OSError:
        return False


class GGUFStore:
    """The tensors of one GGUF file under the names ``convert`` gives them (TensorStore's API)."""

    def __init__(self, path):
        from .gguf_file import (ARCH_SPECS, SUPPORTED_ARCHITECTURES, hyperparameters, open_gguf,
                              plan_tensors, read_metadata)
        from ..limits import shown
        self.path = Path(os.path.expanduser(str(path)))
        if not self.path.is_file():
            raise ModelNotFoundError(f"{self.path} does not exist; give the path to a .gguf file")
        self.reader = open_gguf(self.path)
        self.meta = read_metadata(self.reader)
        arch = self.meta.get("general.architecture")
        if not isinstance(arch, str) or arch not in ARCH_SPECS:
            raise ConversionError(f"GGUF architecture {shown(arch)} is not supported; cpullm runs "
                                  f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        self.spec = ARCH_SPECS[arch]
        self.hp = hyperparameters(self.meta, self.reader)
        plan, self.tied = plan_tensors(self.reader, self.spec, self.hp)
        self._plan = {p.hf_name: p for p in plan}

    # ---- config and tokenizer ---------------------------------------------------------------------
    def config(self) -> dict:
        """config.json as ``convert`` writes it, checked like a directory's, with
        ``_generation_config`` from the tokenizer metadata."""
        from .gguf_file import build_config
        from .gguf_vocab import build_tokenizer, generation_config
        from .family import check_config
        config = build_config(self.meta, self.reader, self.spec, self.hp, self.tied)
        try:
            check_config(config, f"the config of {self.path.name}")
        except ConfigError as exc:
            raise ConversionError(f"{exc} (from the GGUF metadata)") from None
        self._tok = build_tokenizer(self.meta)
        config["_generation_config"] = generation_config(self._tok[2])
        return config

    def tokenizer(self):
        """cpullm.loading.tokenize.Tokenizer built from the vocabulary in the metadata."""
        from .gguf_vocab import build_tokenizer
        from .tokenize import Tokenizer
        tok, tok_config, _ = getattr(self, "_tok", None) or build_tokenizer(self.meta)
        return Tokenizer.from_objects(tok, tok_config)

    # ---- TensorStore API ---------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._plan)

    def __contains__(self, name: str) -> bool:
        return name in self._plan

    def shape(self, name: str) -> tuple:
        return tuple(self._plan[name].shape)

    def dtype(self, name: str) -> str:
        return self._plan[name].source.tensor_type.name

    def get(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        """The tensor as float32 in transformers' shape and convention (what ``convert`` writes,
        before its bf16 rounding): the supported block formats dequantized by the runtime's own
        parallel kernel, others by the ``gguf`` package."""
        from .gguf_file import materialize, to_hf
        from cpullm_kernels.rows.gguf_blocks import FORMATS
        p = self._plan[name]
        t = p.source
        stored = p.stored_shape or p.shape
        if t.tensor_type.name in FORMATS and len(stored) == 2:
            from cpullm_kernels.tiles.kquant_gemm import dequantize
            w = to_hf(p, dequantize(FORMATS[t.tensor_type.name], np.ascontiguousarray(t.data), stored[1]))
        else:
            w = materialize(p)
        if out is None:
            return np.ascontiguousarray(w, dtype=np.float32)
        out[...] = w
        return out

    def get_rows(self, name: str, r0: int, r1: int, out: np.ndarray) -> np.ndarray:
        """Rows ``r0:r1`` of the tensor as float32 into ``out`` (the row-block build's TensorStore
        API): the tensor is dequantized whole once (head un-permuting mixes rows) and kept until
        :meth:`release` or the next tensor."""
        if getattr(self, "_whole", (None,))[0] != name:
            self._whole = (None,)
            self._whole = (name, self.get(name))
        out[...] = self._whole[1][r0:r1]
        return out

    def release(self, name: str) -> None:
        """Drop the whole tensor :meth:`get_rows` kept."""
        self._whole = (None,)

    def blocks(self, name: str):
        """(format name, uint8 (rows, row bytes)) for a matrix stored in a block format the runtime
        executes as it is, else None (F32 / F16 / BF16 and other ggml types, vectors, tensors
        ``convert`` transforms by value or reorders within blocks); rows an architecture's layout
        reorders are moved whole (cpullm.loading.gguf_file.reorder_blocks)."""
        from .gguf_file import reorder_blocks, unpermute_qk
        from cpullm_kernels.rows.gguf_blocks import FORMATS
        p = self._plan.get(name)
        if p is None or len(p.shape) != 2 or p.subtract_one or p.stored_shape is not None:
            return None
        fmt = p.source.tensor_type.name
        if fmt not in FORMATS:
            return None
        data = p.source.data                                     # (rows, row bytes), a view of the map
        if data.shape != (p.shape[0], FORMATS[fmt].row_bytes(p.shape[1])):
            raise ConversionError(f"tensor {p.source.name}: {data.shape} bytes do not hold {fmt} rows of "
                                  f"shape {p.shape}; the file is damaged")
        if p.permute_heads:
            data = np.ascontiguousarray(unpermute_qk(data, p.permute_heads))
        data = reorder_blocks(p, data, FORMATS[fmt])
        return None if data is None else (fmt, data)

    def nbytes(self) -> int:
        """Bytes of the tensors the model reads (a tied output tensor counted once)."""
        return int(sum(p.source.n_bytes for p in self._plan.values()))

    def tensor_bytes(self) -> int:
        """Bytes of every tensor in the file."""
        return int(sum(t.n_bytes for t in self.reader.tensors))

    def format_bytes(self) -> dict:
        """Stored bytes per ggml type of the tensors the model reads."""
        out: dict[str, int] = {}
        for p in self._plan.values():
            k = p.source.tensor_type.name
            out[k] = out.get(k, 0) + int(p.source.n_bytes)
        return out

    def identity(self) -> list:
        """File identity for cache keys: (name, size, mtime_ns)."""
        st = self.path.stat()
        return [[self.path.name, st.st_size, st.st_mtime_ns]]
