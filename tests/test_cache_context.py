"""One execution-cache entry for every context length: a new --ctx is a cache HIT whose KV
regions are sized at load (cpullm.compile.compiler.with_context), and it computes what a program
compiled for that context computes."""
from __future__ import annotations

import numpy as np

import cpullm
from cpullm.compile import cache_format
from cpullm.compile.compiler import with_context

from test_server_support import chat_model_dir  # noqa: E402


def test_a_new_context_length_is_a_cache_hit_with_the_same_numbers(tmp_path):
    d, cache = chat_model_dir(), tmp_path / "cache"
    small = cpullm.load(d, threads=1, n_ctx=64, cache_dir=cache)
    assert small.cache_status.startswith("MISS")
    big = cpullm.load(d, threads=1, n_ctx=300, cache_dir=cache)
    assert big.cache_status == "HIT" and big.n_ctx == 300
    [entry] = cache_format.list_entries(cache)
    assert entry["n_ctx"] == "any"
    fresh = cpullm.load(d, threads=1, n_ctx=300, use_cache=False)
    assert big.program.meta["state_floats"] == fresh.program.meta["state_floats"]
    assert big.program.meta["state_regions"] == fresh.program.meta["state_regions"]
    assert np.array_equal(big.program.I, fresh.program.I)
    ids = list(np.random.default_rng(0).integers(0, 250, 280))     # beyond the first program's 64
    assert np.array_equal(big.logits(ids), fresh.logits(ids))
    again = cpullm.load(d, threads=1, n_ctx=64, cache_dir=cache)  # and back: still the one entry
    assert again.cache_status == "HIT" and len(cache_format.list_entries(cache)) == 1
    assert np.array_equal(again.logits(ids[:60]), small.logits(ids[:60]))


def test_entries_of_one_context_each_are_replaced_by_the_one_for_all(tmp_path, monkeypatch):
    d, cache = chat_model_dir(), tmp_path / "cache"
    real = cache_format.cache_key_inputs

    def per_context(**kw):                   # the key as it was: one entry per context length
        return {**real(**kw), "n_ctx": kw["n_ctx"]}
    monkeypatch.setattr(cache_format, "cache_key_inputs", per_context)
    cpullm.load(d, threads=1, n_ctx=64, cache_dir=cache)
    cpullm.load(d, threads=1, n_ctx=96, cache_dir=cache)
    assert sorted(e["n_ctx"] for e in cache_format.list_entries(cache)) == [64, 96]
    monkeypatch.setattr(cache_format, "cache_key_inputs", real)
    m = cpullm.load(d, threads=1, n_ctx=128, cache_dir=cache)
    assert m.cache_status == "MISS (changed: n_ctx)"
    assert [e["n_ctx"] for e in cache_format.list_entries(cache)] == ["any"]


def test_with_context_is_identity_at_the_same_length():
    m = cpullm.load(chat_model_dir(), threads=1, n_ctx=64)
    assert with_context(m.program, 64) is m.program
    bigger = with_context(m.program, 1000)
    assert bigger.meta["n_ctx"] == 1000 and bigger.meta["state_floats"] > m.program.meta["state_floats"]
    assert bigger.arrays["wq"] is m.program.arrays["wq"]          # the weights are shared


def test_a_context_dependent_rope_scaling_keeps_the_context_in_the_key():
    import attrs

    from cpullm.compile.compiler import context_free
    from cpullm.graph.ir import Op

    m = cpullm.load(chat_model_dir(), threads=1, n_ctx=64)
    assert context_free(m.graph)
    nodes = [attrs.evolve(n, attrs=(*n.attrs, ("rope_type", "plugin-scaling"))) if n.op == Op.ROPE else n
             for n in m.graph.nodes]
    scaled = attrs.evolve(m.graph, nodes=nodes)
    assert not context_free(scaled)
    kw = dict(config=m.config, family=m.family, weights=_Fingerprint(), store=_Identity(), quant="int8",
              max_chunk=64, kernels=[])
    assert cache_format.cache_key_inputs(graph=m.graph, n_ctx=64, **kw)["n_ctx"] == "any"
    assert cache_format.cache_key_inputs(graph=scaled, n_ctx=64, **kw)["n_ctx"] == 64


class _Fingerprint:
    def fingerprint(self):
        return []


class _Identity:
    def identity(self):
        return []


def test_sliding_window_and_linear_attention_states_move_too(tmp_path):
    """Qwen3.5's gated-delta states and Qwen2's sliding-window KV: relocated, the program equals a
    fresh compile for the new context (same I table and state layout; the rest is shared)."""
    import pytest
    pytest.importorskip("transformers")
    import importlib.util
    from pathlib import Path
    # the qwen plugin's parity module builds these checkpoints (plugins/qwen/tests)
    path = Path(__file__).resolve().parent.parent / "plugins" / "qwen" / "tests" / "test_qwen_parity.py"
    spec = importlib.util.spec_from_file_location("qwen_parity_checkpoints", path)
    parity = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(parity)
    make_checkpoint = parity.make_checkpoint

    for name in ("qwen3_5_text", "qwen2_sliding_untied"):
        d = tmp_path / name
        make_checkpoint(name, "v5", d)
        cache = tmp_path / f"cache-{name}"
        cpullm.load(d, threads=1, n_ctx=64, cache_dir=cache)
        hit = cpullm.load(d, threads=1, n_ctx=200, cache_dir=cache)
        fresh = cpullm.load(d, threads=1, n_ctx=200, use_cache=False)
        assert hit.cache_status == "HIT"
        kinds = {r["kind"] for r in hit.program.meta["state_regions"]}
        assert kinds >= ({"linear"} if name == "qwen3_5_text" else {"kv"})
        if name == "qwen2_sliding_untied":                  # windowed layers keep a short cache
            assert any(r.get("window") for r in hit.program.meta["state_regions"])
        assert hit.program.meta["state_regions"] == fresh.program.meta["state_regions"]
        assert np.array_equal(hit.program.I, fresh.program.I)
        ids = list(range(3, 150))
        assert np.array_equal(hit.logits(ids), fresh.logits(ids))
