"""The KV cache format option (cpullm.kvformat): defaults by quant, a clear error for a bad value,
its place in the execution-cache key and the prompt cache, and INT8 with float16 KV staying close
to float32 KV on a small random model (top-1 agreement, not identical tokens)."""
import json

import numpy as np
import pytest

import cpullm
from cpullm.cli import main
from cpullm.errors import ConfigError
from cpullm.kvformat import resolve_kv_dtype
from cpullm.testing import make_random_checkpoint
from steps import Steps  # noqa: E402

# head_dim 64: the kernels' 16-lane passes (the tiny configs elsewhere have head_dim 8 or 16)
WIDE = dict(model_type="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=300, rms_norm_eps=1e-5,
            max_position_embeddings=1024, tie_word_embeddings=True, rope_theta=10000.0,
            bos_token_id=256, eos_token_id=257)
IDS = [int(t) for t in np.random.default_rng(11).integers(0, 256, 40)]


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    return make_random_checkpoint(WIDE, tmp_path_factory.mktemp("wide"), seed=4, std=0.3)


def test_defaults_and_bad_values():
    assert resolve_kv_dtype(None, "int8") == resolve_kv_dtype(None, "q4") == resolve_kv_dtype(None, "gguf") == "f16"
    assert resolve_kv_dtype(None, "f32") == "f32" and resolve_kv_dtype("f32", "int8") == "f32"
    with pytest.raises(ConfigError, match=r"one of f16, f32, not 'q8_0'"):
        resolve_kv_dtype("q8_0", "int8")


def test_load_reports_the_format_and_rejects_a_bad_one(wide_dir, tmp_path):
    with pytest.raises(ConfigError, match="f16, f32"):
        cpullm.load(wide_dir, kv_dtype="bf16", cache_dir=tmp_path)
    m = cpullm.load(wide_dir, n_ctx=256, cache_dir=tmp_path)
    assert m.info()["kv_dtype"] == "f16" and m.cache_status.startswith("MISS")
    regions = m.program.meta["state_regions"]
    assert all(r["kv_dtype"] == "f16" and r["floats"] == r["n_kv_heads"] * r["cap"] * r["head_dim"] for r in regions)
    # the format is part of the execution-cache key: f32 is another entry, f16 again a HIT
    m32 = cpullm.load(wide_dir, n_ctx=256, cache_dir=tmp_path, kv_dtype="f32")
    assert m32.cache_status == "MISS (changed: kv_dtype)" and m32.info()["kv_dtype"] == "f32"
    assert m32.program.meta["state_floats"] > 1.9 * m.program.meta["state_floats"]
    assert cpullm.load(wide_dir, n_ctx=256, cache_dir=tmp_path).cache_status == "HIT"
    assert cpullm.load(wide_dir, n_ctx=256, cache_dir=tmp_path, quant="f32").info()["kv_dtype"] == "f32"


def _teacher_forced(model, ids, follow):
    """Logits after the prompt ``ids`` and after each token of ``follow`` fed by decode."""
    ex = Steps(model)
    ex.reset()
    out = [ex.prefill(ids).copy()]
    for t in follow:
        out.append(np.array(ex.decode(t)))
    return np.stack(out)


def test_int8_with_f16_kv_stays_close_to_f32_kv(wide_dir, tmp_path):
    m32 = cpullm.load(wide_dir, n_ctx=256, cache_dir=tmp_path, kv_dtype="f32")
    m16 = cpullm.load(wide_dir, n_ctx=256, cache_dir=tmp_path, kv_dtype="f16")
    follow = list(m32.generate_ids(IDS, 24, ignore_eos=True))
    a = _teacher_forced(m32, IDS, follow[:-1])
    b = _teacher_forced(m16, IDS, follow[:-1])
    assert not np.array_equal(a, b)                                   # the format is really in use
    agree = np.mean(a.argmax(-1) == b.argmax(-1))
    rel = np.abs(a - b).max() / np.abs(a).max()
    assert agree >= 0.9 and rel < 0.02, (agree, rel)
    # the float16 run's own greedy tokens: mostly the same ones (a tie may flip one and diverge)
    own = list(m16.generate_ids(IDS, 24, ignore_eos=True))
    assert own[:4] == follow[:4]


def test_prompt_cache_records_the_format(wide_dir, tmp_path, capfd, monkeypatch):
    pc = tmp_path / "p.cache"
    m = cpullm.load(wide_dir, n_ctx=256, cache_dir=tmp_path).use_prompt_cache(pc)
    want = list(m.generate_ids(IDS, 6, ignore_eos=True))
    m.save_prompt_cache()
    raw = pc.read_bytes()
    header = json.loads(raw[24: 24 + int.from_bytes(raw[16:24], "little")])
    assert header["identity"]["kv_dtype"] == "f16"
    assert {r["dtype"] for r in header["regions"]} == {"f16"}
    # f16 round trip: all but the last prompt token restored, the same tokens
    again = cpullm.load(wide_dir, n_ctx=256, cache_dir=tmp_path).use_prompt_cache(pc)
    assert list(again.generate_ids(IDS, 6, ignore_eos=True)) == want
    assert again.prompt_cache_status == f"HIT (reused {len(IDS) - 1} of {len(IDS)} prompt tokens)"
    # a float32-KV model never reads the float16 file: stale, a miss, and its own numbers
    monkeypatch.setenv("CPULLM_QUIET", "0")
    m32 = cpullm.load(wide_dir, n_ctx=256, cache_dir=tmp_path, kv_dtype="f32").use_prompt_cache(pc)
    assert m32.prompt_cache_status.startswith("MISS (stale (changed: kv_dtype)")
    ref = cpullm.load(wide_dir, n_ctx=256, cache_dir=tmp_path, kv_dtype="f32")
    assert list(m32.generate_ids(IDS, 6, ignore_eos=True)) == list(ref.generate_ids(IDS, 6, ignore_eos=True))


def test_cli_cache_type_flag(wide_dir, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["run", str(wide_dir), "--cache-type", "q8_0", "-p", "hi"])
    assert "invalid choice" in capsys.readouterr().err
