"""The KV cache format option (cpullm.compile.kvformat): defaults by quant, a clear error for a bad value,
its place in the execution-cache key and the prompt cache (a file of another format refused),
llama.cpp's -ctk/-ctv spellings, and INT8 with float16 or 8-bit KV staying close to float32 KV
on a small random model (top-1 agreement, not identical tokens)."""
import json

import numpy as np
import pytest

import cpullm
from cpullm.cli import main
from cpullm.errors import CacheError, ConfigError
from cpullm.compile.kvformat import read_positions, region_floats, resolve_kv_dtype, write_positions
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
    assert resolve_kv_dtype("q8_0", "int8") == "q8_0"
    with pytest.raises(ConfigError, match=r"one of f16, f32, q8_0, not 'q8'"):
        resolve_kv_dtype("q8", "int8")


def test_load_reports_the_format_and_rejects_a_bad_one(wide_dir, tmp_path):
    with pytest.raises(ConfigError, match="f16, f32, q8_0"):
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
    m8 = cpullm.load(wide_dir, n_ctx=256, cache_dir=tmp_path, kv_dtype="q8_0")
    assert m8.cache_status == "MISS (changed: kv_dtype)" and m8.info()["kv_dtype"] == "q8_0"
    # int8 keys and values with a float32 scale per 32 values: (head_dim + 4 * ceil(head_dim / 32)) bytes a row
    assert all(r["kv_dtype"] == "q8_0" and
               r["floats"] == r["n_kv_heads"] * r["cap"] * (r["head_dim"] + 4 * -(-r["head_dim"] // 32)) // 2
               for r in m8.program.meta["state_regions"])
    # the load-time bounds check accepts the 8-bit regions, refuses an unknown format code and a
    # region too small for its format (the kernels do not bounds-check)
    from cpullm.compile.cache_format import check_program_bounds
    from cpullm_kernels.program import program_table as P
    arrays, meta = dict(m8.program.arrays), m8.program.meta
    check_program_bounds(arrays, meta)
    att = np.nonzero(arrays["I"][:, P.COL_OP] == P.OP_ATTENTION)[0][0]
    for col, value in ((P.ATTENTION_KV_FORMAT, 7), (P.ATTENTION_CAP, int(arrays["I"][att, P.ATTENTION_CAP]) * 2)):
        bad = arrays["I"].copy()
        bad[att, col] = value
        with pytest.raises(CacheError, match=f"instruction {att} reaches outside its arrays"):
            check_program_bounds({**arrays, "I": bad}, meta)
    assert cpullm.load(wide_dir, n_ctx=256, cache_dir=tmp_path, quant="f32").info()["kv_dtype"] == "f32"


def _teacher_forced(model, ids, follow):
    """Logits after the prompt ``ids`` and after each token of ``follow`` fed by decode."""
    ex = Steps(model)
    ex.reset()
    out = [ex.prefill(ids).copy()]
    for t in follow:
        out.append(np.array(ex.decode(t)))
    return np.stack(out)


@pytest.mark.parametrize("kv_dtype", ["f16", "q8_0"])
def test_int8_with_smaller_kv_stays_close_to_f32_kv(wide_dir, tmp_path, kv_dtype):
    m32 = cpullm.load(wide_dir, n_ctx=256, cache_dir=tmp_path, kv_dtype="f32")
    m16 = cpullm.load(wide_dir, n_ctx=256, cache_dir=tmp_path, kv_dtype=kv_dtype)
    follow = list(m32.generate_ids(IDS, 24, ignore_eos=True))
    a = _teacher_forced(m32, IDS, follow[:-1])
    b = _teacher_forced(m16, IDS, follow[:-1])
    assert not np.array_equal(a, b)                                   # the format is really in use
    agree = np.mean(a.argmax(-1) == b.argmax(-1))
    rel = np.abs(a - b).max() / np.abs(a).max()
    # this random model's attention is far sharper than a trained one's (weights of std 0.3), so
    # 8-bit keys move its logits more; real models: benchmarks/results/2026-12-06-kv-cache.md
    min_agree, max_rel = {"f16": (0.9, 0.02), "q8_0": (0.75, 0.2)}[kv_dtype]
    assert agree >= min_agree and rel < max_rel, (agree, rel)
    # the smaller format's own greedy tokens: mostly the same ones (a tie may flip one and diverge)
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
    # a model with another KV format refuses the file, in one line naming the fix
    for other in ("f32", "q8_0"):
        m2 = cpullm.load(wide_dir, n_ctx=256, cache_dir=tmp_path, kv_dtype=other)
        with pytest.raises(CacheError, match=f"saved with KV cache type f16, this model runs {other}; "
                                             "load with --cache-type f16") as e:
            m2.use_prompt_cache(pc)
        assert "\n" not in str(e.value)


def test_prompt_cache_q8_round_trip(wide_dir, tmp_path):
    """An 8-bit file stores the cache's int8 rows and scales: the restored run gives the same tokens."""
    pc = tmp_path / "q8.cache"
    m = cpullm.load(wide_dir, n_ctx=256, cache_dir=tmp_path, kv_dtype="q8_0").use_prompt_cache(pc)
    want = list(m.generate_ids(IDS, 6, ignore_eos=True))
    m.save_prompt_cache()
    raw = pc.read_bytes()
    header = json.loads(raw[24: 24 + int.from_bytes(raw[16:24], "little")])
    assert header["identity"]["kv_dtype"] == "q8_0" and {r["dtype"] for r in header["regions"]} == {"q8_0"}
    assert all(r["shape"][-1] == r["head_dim"] + 4 * -(-r["head_dim"] // 32) for r in header["regions"])
    again = cpullm.load(wide_dir, n_ctx=256, cache_dir=tmp_path, kv_dtype="q8_0").use_prompt_cache(pc)
    assert list(again.generate_ids(IDS, 6, ignore_eos=True)) == want
    assert again.prompt_cache_status == f"HIT (reused {len(IDS) - 1} of {len(IDS)} prompt tokens)"
    # a file of format version 2 (q8_0 rows with one scale each) is stale: not read, rewritten on save
    old = bytearray(raw)
    old[8:12] = (2).to_bytes(4, "little")
    pc.write_bytes(bytes(old))
    stale = cpullm.load(wide_dir, n_ctx=256, cache_dir=tmp_path, kv_dtype="q8_0").use_prompt_cache(pc)
    assert stale.prompt_cache_status == "MISS (of format version 2, not 3)"
    assert list(stale.generate_ids(IDS, 6, ignore_eos=True)) == want
    stale.save_prompt_cache()
    assert pc.read_bytes()[8:12] == (3).to_bytes(4, "little")
    with pytest.raises(CacheError, match="saved with KV cache type q8_0, this model runs f16"):
        cpullm.load(wide_dir, n_ctx=256, cache_dir=tmp_path).use_prompt_cache(pc)


def test_q8_positions_round_trip_bit_for_bit():
    """read_positions / write_positions of an 8-bit region (the prefix and prompt caches' copy):
    int8 rows and their block scales come back exactly, in ring slots that wrap, and sit where the
    kernels read them; float rows written into it are rounded as the kernels round them."""
    from cpullm_kernels.attention.attention import kv_views_q8, q8_rows_ref
    r = np.random.default_rng(3)
    reg = {"n_kv_heads": 2, "cap": 32, "head_dim": 64, "kv_dtype": "q8_0"}
    region = np.zeros(region_floats(2, 32, 64, "q8_0"), np.float32)
    kv = r.integers(-127, 128, (2, 2, 20, 72)).astype(np.int8)       # 64 values, 2 scales of 4 bytes
    kv[..., 64:] = r.random((2, 2, 20, 2)).astype(np.float32).view(np.int8)
    write_positions(region, reg, 25, kv)                      # positions 25..44: slots 25..31, 0..12
    np.testing.assert_array_equal(read_positions(region, reg, 25, 45), kv)
    np.testing.assert_array_equal(read_positions(region, reg, 30, 40), kv[:, :, 5:15])
    k, v, ks, vs = kv_views_q8(region, 2, 32, 64)
    np.testing.assert_array_equal(ks[1, 0, :, 3], kv[0, 1, 10, 64:].view(np.float32))    # position 35: slot 3
    np.testing.assert_array_equal(vs[1, 3], kv[1, 1, 10, 64:].view(np.float32))
    np.testing.assert_array_equal(k[1, 0, :, 3], kv[0, 1, 10, :64])
    with pytest.raises(ValueError, match="q8_0 KV region takes int8 rows of 72 bytes"):
        write_positions(region, reg, 0, np.zeros((2, 2, 1, 68), np.int8))
    x = r.standard_normal((2, 2, 3, 64)).astype(np.float32)
    write_positions(region, reg, 0, x)
    q, sc = q8_rows_ref(x)
    got = read_positions(region, reg, 0, 3)
    np.testing.assert_array_equal(got[..., :64], q)
    np.testing.assert_array_equal(np.ascontiguousarray(got[..., 64:]).view(np.float32), sc)


def test_cli_cache_type_flag(wide_dir, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["run", str(wide_dir), "--cache-type", "q4_0", "-p", "hi"])
    assert "invalid choice" in capsys.readouterr().err
    # llama.cpp's -ctk/-ctv: one format for keys and values, differing ones refused in one line
    assert main(["run", str(wide_dir), "-ctk", "q8_0", "-ctv", "f16", "-p", "hi", "--cache-dir", str(tmp_path)]) != 0
    err = capsys.readouterr().err.strip()
    assert "-ctk q8_0, -ctv f16 differ" in err and "\n" not in err


@pytest.mark.parametrize("argv,want", [(["-ctk", "q8_0", "-ctv", "q8_0"], "q8_0"), (["--cache-type-k", "f32"], "f32"),
                                       (["--cache-type", "q8_0", "-ctv", "q8_0"], "q8_0"), ([], None)])
def test_cache_type_spellings(argv, want):
    import argparse

    from cpullm.cli.commands.common import add_model_options, settle_model_args
    p = argparse.ArgumentParser(allow_abbrev=False)
    add_model_options(p)
    args = p.parse_args(["m", *argv])
    settle_model_args(args)
    assert args.kv_dtype == want
