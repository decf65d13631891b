"""Long contexts: the KV memory of ``n_ctx`` is planned before it is allocated, reported by
``model.info()``, refused with the context that would fit when it does not; Gemma 3's
sliding-window layers hold only their window (plus one prefill chunk), whatever ``n_ctx``."""
import importlib.util
import json
from pathlib import Path

import pytest

import cpullm
from cpullm.errors import ContextMemoryError
from cpullm_kernels.attention.attention import padded_cap
from cpullm.run.memory import check_plan_fits, state_plan
from cpullm.testing import make_random_checkpoint

ROOT = Path(__file__).resolve().parents[1]
LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=300, rms_norm_eps=1e-5,
             max_position_embeddings=32768, tie_word_embeddings=True, rope_theta=10000.0)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    pytest.importorskip("transformers", reason="benchmarks/synth.py plans tensors with transformers")
    spec = importlib.util.spec_from_file_location("cpullm_bench_synth", ROOT / "benchmarks" / "synth.py")
    synth = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(synth)
    d = tmp_path_factory.mktemp("longctx") / "gemma-3-4b-it"
    synth.write_checkpoint("gemma-3-4b-it", d, scale=16, seed=2, progress=False, layers=6)
    return d


@pytest.mark.reference
def test_gemma3_sliding_layers_hold_their_window_at_32k(gemma3):
    cfg = json.loads((gemma3 / "config.json").read_text())["text_config"]
    window = cfg["sliding_window"]
    m = cpullm.load(gemma3, n_ctx=32768, use_cache=False, max_chunk=64)
    info = m.info()
    plan, layers = info["context_plan"], info["memory"]["layers"]
    regions = m.program.meta["state_regions"]
    hd, nkv = regions[0]["head_dim"], regions[0]["n_kv_heads"]
    assert hd == cfg["head_dim"] and [r["window"] for r in regions] == [window] * 5 + [0]
    assert info["kv_dtype"] == plan["kv_dtype"] == "f16"              # INT8's default KV format
    per_slot = 2 * nkv * hd * 2                                       # K and V, float16
    expect = {"sliding_window": padded_cap(window + 64) * per_slot, "full_attention": padded_cap(32768) * per_slot}
    assert [x["kind"] for x in layers] == ["sliding_window"] * 5 + ["full_attention"]   # Gemma 3's period
    assert [x["bytes"] for x in layers] == [expect[x["kind"]] for x in layers]
    assert plan["n_ctx"] == 32768
    assert plan["kv_sliding_window_bytes"] == 5 * expect["sliding_window"] < expect["full_attention"] // 50
    assert plan["kv_full_attention_bytes"] == expect["full_attention"]
    assert plan["kv_bytes_max"] == info["memory"]["kv_bytes_max"]
    # decoding past the window keeps working in the ring (the numerics: test_gemma_parity)
    out = list(m.generate_ids(list(range(2, 2 + window + 8)), max_new_tokens=4, ignore_eos=True))
    assert len(out) == 4


def test_plan_is_checked_against_available_memory(tmp_path, monkeypatch):
    d = make_random_checkpoint(LLAMA, tmp_path / "m", seed=1)
    m = cpullm.load(d, n_ctx=32768, use_cache=False, kv_dtype="f32")
    plan = state_plan(m.program.meta)
    need = plan["state_bytes"] + plan["arena_bytes"]
    assert plan["kv_bytes_max"] == 2 * padded_cap(32768) * 2 * 2 * 16 * 4     # 2 layers, 2 KV heads of 16
    assert check_plan_fits(m.program.meta, available=need) == plan
    # a third of the need, 80 % of it for KV at 512 bytes a token after the arena: 6.9k tokens -> 4096
    with pytest.raises(ContextMemoryError, match=r"--ctx 4096\b") as err:
        check_plan_fits(m.program.meta, available=need // 3)
    assert "32768-token context" in str(err.value) and "--cache-type f16" in str(err.value)
    # float16 KV: half the bytes a token, so the same memory suggests twice the context
    m16 = cpullm.load(d, n_ctx=32768, use_cache=False)
    plan16 = state_plan(m16.program.meta)
    assert plan16["kv_dtype"] == "f16" and plan16["kv_bytes_max"] == plan["kv_bytes_max"] // 2
    with pytest.raises(ContextMemoryError, match=r"--ctx 8192\b") as err:
        check_plan_fits(m16.program.meta, available=need // 3)
    assert "--cache-type q8_0" in str(err.value)          # the next smaller cache it can suggest
    from cpullm.run import memory
    monkeypatch.setattr(memory, "available_bytes", lambda: need // 3)
    with pytest.raises(ContextMemoryError):
        cpullm.load(d, n_ctx=32768, use_cache=False, kv_dtype="f32")
    cpullm.load(d, n_ctx=4096, use_cache=False, kv_dtype="f32")       # a context that fits loads


def test_kv_cache_is_resident_only_where_written(tmp_path):
    """A long context costs memory as it fills: the state (KV caches) is mapped memory that only
    written 4 KiB pages make resident. numpy's np.zeros of 4 MB and more is madvised
    MADV_HUGEPAGE, and there one written float faulted in up to 2 MiB (the whole 0.94 GB KV cache
    of a synthetic Qwen3-1.7B at n_ctx 4096 on an 8-token prompt)."""
    import mmap

    from cpullm.run.executor import lazy_zeros
    from cpullm.run.memory import _status_kib
    d = make_random_checkpoint(LLAMA, tmp_path / "m", seed=3)
    m = cpullm.load(d, n_ctx=131072, use_cache=False)
    st = m.slot.state.base                              # the slot's (1, state_floats) table
    assert st.nbytes >= 32 << 20 and isinstance(getattr(st.base, "obj", st.base), mmap.mmap)
    z = lazy_zeros(64 << 18)                             # 64 MiB
    before = _status_kib("RssAnon")
    z[:: (2 << 20) // 4] = 1.0                           # one float every 2 MiB: 32 pages
    grown = _status_kib("RssAnon") - before
    assert grown < 1 << 20, grown                        # bytes (np.zeros: all 64 MiB here)
    small = lazy_zeros(10)                               # small states stay in the heap
    assert z.sum() == 32 and small.size == 10 and not isinstance(getattr(small.base, "base", None), mmap.mmap)
