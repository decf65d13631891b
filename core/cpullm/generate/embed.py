"""Text embeddings from any family: the hidden states after the final norm (the lm_head's input,
:meth:`cpullm.run.executor.Executor.prefill_hidden`), pooled over the tokens and L2-normalized.

Pooling is read from the checkpoint where it says so: sentence-transformers' ``modules.json``
naming a ``Pooling`` module whose ``config.json`` sets one ``pooling_mode_*`` (Qwen3-Embedding:
last token), or a GGUF's ``<arch>.pooling_type``; else the last token (in a causal model the
only one that has seen the whole text). What cannot be reproduced is refused rather than
approximated: a ``Dense`` projection after the pooling, more than one pooling mode at once.

``dimensions`` (Matryoshka truncation, then normalization again) is accepted only from a model
that declares the sizes it was trained for: ``matryoshka_dimensions`` (or ``matryoshka_dims``)
in ``config.json`` or ``config_sentence_transformers.json``.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import ConfigError, PromptError, UnsupportedConfigError

POOLINGS = ("last", "mean", "cls")
# sentence-transformers' Pooling config keys -> ours
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
             "pooling_mode_cls_token": "cls"}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                   "pooling_mode_weightedmean_tokens")
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}       # llama.cpp's enum llama_pooling_type
MAX_INPUTS = 2048                                       # texts per call (OpenAI's limit)


class EmbeddingSpec:
    """How a checkpoint wants its embeddings made: ``pooling`` (None: not stated),
    ``normalize`` (None: not stated), ``matryoshka`` (the sizes it supports truncation to)."""

    def __init__(self, pooling: str | None = None, normalize: bool | None = None,
                 matryoshka: tuple[int, ...] = ()):
        self.pooling, self.normalize, self.matryoshka = pooling, normalize, matryoshka


def _read_json(path: Path):
    from ..limits import read_json_file
    try:
        return read_json_file(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot be read as JSON ({exc}); repair or remove it") from None


def checkpoint_spec(model_dir: Path, config: dict) -> EmbeddingSpec:
    """The embedding recipe ``model_dir`` (a directory or GGUF file) states."""
    model_dir = Path(model_dir)
    if model_dir.is_file():
        return _gguf_spec(model_dir)
    spec = EmbeddingSpec(matryoshka=_matryoshka(model_dir, config))
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return spec
    modules = _read_json(modules_file)
    if not isinstance(modules, list):
        raise ConfigError(f"{modules_file} is not a list of modules; repair or remove it")
    for m in modules:
        kind = str(m.get("type", "")) if isinstance(m, dict) else ""
        short = kind.rsplit(".", 1)[-1]
        if short == "Pooling":
            spec.pooling = _st_pooling(model_dir / str(m.get("path", "")) / "config.json")
        elif short == "Normalize":
            spec.normalize = True
        elif short not in ("Transformer", ""):
            raise UnsupportedConfigError(
                f"{modules_file} adds a {short} module after the transformer, which cpullm does "
                "not apply: its embeddings would differ from sentence-transformers'")
    return spec


def _st_pooling(path: Path) -> str:
    cfg = _read_json(path) if path.is_file() else None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path} (the Pooling module's config) is missing or not an object")
    for key in _ST_UNSUPPORTED:
        if cfg.get(key):
            raise UnsupportedConfigError(f"{path} asks for {key}, which cpullm does not implement "
                                         f"(it pools by {', '.join(POOLINGS)})")
    modes = [ours for key, ours in _ST_MODES.items() if cfg.get(key)]
    if len(modes) != 1:
        raise UnsupportedConfigError(f"{path} sets {len(modes)} pooling modes; cpullm needs exactly "
                                     f"one of {', '.join(_ST_MODES)}")
    return modes[0]


def _matryoshka(model_dir: Path, config: dict) -> tuple[int, ...]:
    sources = [config]
    st = model_dir / "config_sentence_transformers.json"
    if st.is_file():
        data = _read_json(st)
        sources.append(data if isinstance(data, dict) else {})
    for src in sources:
        for key in ("matryoshka_dimensions", "matryoshka_dims"):
            dims = src.get(key)
            if isinstance(dims, list) and dims and all(isinstance(d, int) and d > 0 for d in dims):
                return tuple(sorted(set(dims)))
    return ()


def _gguf_spec(path: Path) -> EmbeddingSpec:
    from ..loading.gguf_file import open_gguf

    meta = open_gguf(path).metadata
    arch = meta.get("general.architecture")
    code = meta.get(f"{arch}.pooling_type")
    if code is None or code == 0:
        return EmbeddingSpec()
    if code not in _GGUF_POOLING:
        raise UnsupportedConfigError(f"{path.name} asks for pooling type {code}, which cpullm does "
                                     f"not implement (it pools by {', '.join(POOLINGS)})")
    return EmbeddingSpec(pooling=_GGUF_POOLING[code])


def check_pooling(pooling: str | None) -> None:
    if pooling is not None and pooling not in POOLINGS:
        raise PromptError(f"pooling must be one of {', '.join(POOLINGS)} (or None: the checkpoint's), "
                          f"got {pooling!r}")


def pool(hidden: np.ndarray, pooling: str) -> np.ndarray:
    """(T, H) hidden states -> (H,) float32 by ``pooling``."""
    if pooling == "last":
        return hidden[-1].astype(np.float32)
    if pooling == "cls":
        return hidden[0].astype(np.float32)
    return hidden.astype(np.float64).mean(axis=0).astype(np.float32)


def finish(vec: np.ndarray, normalize: bool, dimensions: int | None) -> np.ndarray:
    """Truncate to ``dimensions`` (Matryoshka), then L2-normalize if ``normalize``."""
    if dimensions is not None:
        vec = vec[:dimensions]
    if normalize:
        n = float(np.linalg.norm(vec.astype(np.float64)))
        vec = vec / n if n > 0 else vec
    return vec.astype(np.float32)


def check_dimensions(dimensions: int | None, width: int, spec: EmbeddingSpec) -> None:
    """``dimensions`` must be one the model was trained to be cut to (or its full width)."""
    if dimensions is None or dimensions == width:
        return
    if isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions <= 0:
        raise PromptError(f"dimensions must be a positive integer, got {dimensions!r}")
    if not spec.matryoshka:
        raise PromptError(f"this model's embeddings have {width} dimensions and it does not declare "
                          "Matryoshka training (matryoshka_dimensions), so they cannot be shortened; "
                          "omit dimensions")
    if dimensions > width or dimensions not in spec.matryoshka:
        raise PromptError(f"dimensions={dimensions} is not one of the sizes this model supports: "
                          f"{', '.join(map(str, [*spec.matryoshka, width]))}")


def token_inputs(texts, tokenizer, vocab: int, n_ctx: int) -> list[list[int]]:
    """Token ids of each input: a string (tokenized with the tokenizer's special tokens, as
    sentence-transformers does) or a list of token ids; one input or a list of them."""
    if isinstance(texts, str) or (isinstance(texts, list) and texts and isinstance(texts[0], int)
                                  and not isinstance(texts[0], bool)):
        texts = [texts]
    texts = list(texts)
    if not texts:
        raise PromptError("no input to embed: give a string or a list of strings")
    if len(texts) > MAX_INPUTS:
        raise PromptError(f"{len(texts)} inputs in one call; the limit is {MAX_INPUTS}")
    out = []
    for i, t in enumerate(texts):
        if isinstance(t, str):
            ids = tokenizer.encode(t, add_special_tokens=True) if t else []
        elif isinstance(t, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in t):
            ids = [int(x) for x in t]
            bad = next((x for x in ids if not 0 <= x < vocab), None)
            if bad is not None:
                raise PromptError(f"input {i}: token id {bad} is outside the vocabulary [0, {vocab})")
        else:
            raise PromptError(f"input {i} must be a string or a list of token ids, got "
                              f"{type(t).__name__}")
        if not ids:
            raise PromptError(f"input {i} is empty: give some text")
        if len(ids) > n_ctx:
            raise PromptError(f"input {i} is {len(ids)} tokens, over the context of {n_ctx}; shorten "
                              "it or load the model with a larger context (--ctx)")
        out.append(ids)
    return out
