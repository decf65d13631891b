"""The prompt cache (cpullm.run.prompt_cache): identical greedy tokens and logits with and without it,
for full-attention, sliding-window (ring, also wrapped) and linear-attention layers; foreign,
stale, damaged and non-cache files; atomic writes; ``cpullm run --prompt-cache``."""
import json
import os
from pathlib import Path

import numpy as np
import pytest

import cpullm
from cpullm.cli import main
from cpullm.errors import CacheError
from test_cache_family import (_hybrid_registered, hybrid_dir, llama_dir)  # noqa: F401  (fixtures)

rng = np.random.default_rng(7)
PROMPT = [int(t) for t in rng.integers(0, 256, 30)]
MORE = [int(t) for t in rng.integers(0, 256, 9)]
N_GEN = 8

# model kind -> (fixture name, load kwargs). max_chunk=8 gives the window-4 layers a ring of
# 12 slots, so a 30-token prompt wraps it.
# "full" runs INT8's default float16 KV; "full_f32_kv" the same model with float32 KV.
KINDS = {"full": ("llama_dir", {}), "full_f32_kv": ("llama_dir", {"kv_dtype": "f32"}), "hybrid": ("hybrid_dir", {}),
         "hybrid_wrapped_ring": ("hybrid_dir", {"max_chunk": 8})}


@pytest.fixture(params=sorted(KINDS))
def kind(request):
    name, kw = KINDS[request.param]
    return request.param, request.getfixturevalue(name), kw


def _load(model_dir, **kw):
    return cpullm.load(model_dir, **kw)


def last_logits(model, ids):
    """What generate() does before sampling: start the sequence in a fresh slot (the prompt cache
    may restore a prefix), prefill the rest, logits of the last token."""
    fwd = model.forward
    slot = fwd.new_slot()
    r = model.prompt_cache.start(fwd, slot, list(ids)) if model.prompt_cache is not None else 0
    return r, fwd.prefill(slot, ids[r:]).copy()


_REFERENCE = {}


def reference(model_dir, ids, **kw):
    """Last-token logits and greedy tokens without a prompt cache (memoised per model and prompt)."""
    key = (str(model_dir), tuple(ids), tuple(sorted(kw.items())))
    if key not in _REFERENCE:
        _REFERENCE[key] = _reference(model_dir, ids, **kw)
    return _REFERENCE[key]


def _reference(model_dir, ids, **kw):
    m = _load(model_dir, **kw)
    logits = m.forward.prefill(m.forward.new_slot(), ids).copy()
    tokens = list(m.generate_ids(ids, N_GEN, ignore_eos=True))
    return logits, tokens


def check_same(model_dir, pc, ids, expect_reused, **kw):
    ref_logits, ref_tokens = reference(model_dir, ids, **kw)
    m = _load(model_dir, **kw).use_prompt_cache(pc)
    r, logits = last_logits(m, ids)
    assert r == expect_reused, m.prompt_cache_status
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=1e-4 * np.abs(ref_logits).max())
    assert logits.argmax() == ref_logits.argmax()
    m = _load(model_dir, **kw).use_prompt_cache(pc)
    assert list(m.generate_ids(ids, N_GEN, ignore_eos=True)) == ref_tokens
    assert m.prompt_cache_status == (f"HIT (reused {expect_reused} of {len(ids)} prompt tokens)"
                                     if expect_reused else m.prompt_cache_status)
    return m


def make_cache(model_dir, pc, ids, **kw):
    m = _load(model_dir, **kw).use_prompt_cache(pc)
    assert m.prompt_cache_status == "MISS (no file)"
    tokens = list(m.generate_ids(ids, N_GEN, ignore_eos=True))
    assert tokens == reference(model_dir, ids, **kw)[1]          # recording changes nothing
    m.save_prompt_cache()
    assert Path(pc).is_file()
    return m


def test_same_prompt_reuses_all_but_the_last_token(kind, tmp_path):
    name, d, kw = kind
    pc = tmp_path / "p.cache"
    make_cache(d, pc, PROMPT, **kw)
    check_same(d, pc, PROMPT, len(PROMPT) - 1, **kw)


def test_extended_prompt_prefills_only_the_rest(kind, tmp_path):
    name, d, kw = kind
    pc = tmp_path / "p.cache"
    make_cache(d, pc, PROMPT, **kw)
    # full attention restores every saved position; ring / linear state exists after n-1 tokens
    expect = len(PROMPT) if name.startswith("full") else len(PROMPT) - 1
    m = check_same(d, pc, PROMPT + MORE, expect, **kw)
    m.save_prompt_cache()                         # the longer prompt replaces the saved one
    check_same(d, pc, PROMPT + MORE, len(PROMPT + MORE) - 1, **kw)


def test_diverging_prompt(kind, tmp_path):
    name, d, kw = kind
    pc = tmp_path / "p.cache"
    make_cache(d, pc, PROMPT, **kw)
    other = PROMPT[:12] + [(t + 1) % 256 for t in PROMPT[12:]]
    # full attention: any common prefix is exact; a linear-attention state only at its own point
    expect = 12 if name.startswith("full") else 0
    m = check_same(d, pc, other, expect, **kw)
    if not expect:
        assert m.prompt_cache_status == "MISS (the prompt differs from the cached one at token 12)"


def test_ring_only_model_reuses_prefix_until_it_wraps(hybrid_dir, tmp_path):
    """Without linear-attention layers, a ring that has not wrapped holds every position."""
    import shutil
    d = Path(shutil.copytree(hybrid_dir, tmp_path / "ring"))
    cfg = json.loads((d / "config.json").read_text())
    cfg["layer_kinds"] = ["window", "full"]
    (d / "config.json").write_text(json.dumps(cfg))
    for f in (d / "model.safetensors",):
        f.unlink()
    from cpullm.testing import make_random_checkpoint
    make_random_checkpoint(cfg, d, seed=3, std=0.3)
    pc = tmp_path / "p.cache"
    make_cache(d, pc, PROMPT)
    check_same(d, pc, PROMPT[:12] + MORE, 12)             # ring of 516 slots: no wrap
    make_cache(d, tmp_path / "w.cache", PROMPT, max_chunk=8)
    check_same(d, tmp_path / "w.cache", PROMPT[:12] + MORE, 0, max_chunk=8)   # 12 slots: wrapped


def test_cache_works_across_context_sizes(hybrid_dir, tmp_path):
    pc = tmp_path / "p.cache"
    make_cache(hybrid_dir, pc, PROMPT, n_ctx=256)
    check_same(hybrid_dir, pc, PROMPT + MORE, len(PROMPT) - 1, n_ctx=128, max_chunk=16)


def test_one_process_many_prompts(hybrid_dir, tmp_path):
    m = _load(hybrid_dir).use_prompt_cache(tmp_path / "p.cache")
    ref = reference(hybrid_dir, PROMPT + MORE)[1]
    list(m.generate_ids(PROMPT, 3))
    m.save_prompt_cache()
    assert list(m.generate_ids(PROMPT + MORE, N_GEN, ignore_eos=True)) == ref
    assert m.prompt_cache_status == f"HIT (reused {len(PROMPT) - 1} of {len(PROMPT + MORE)} prompt tokens)"
    assert m.info()["prompt_cache"] == m.prompt_cache_status
    # logits() between generate and save runs another sequence: refuse rather than mix states
    m.logits([1, 2, 3])
    with pytest.raises(CacheError, match="use_prompt_cache"):
        m.save_prompt_cache()


# ---- refusing and rebuilding files --------------------------------------------------------------
def test_file_from_another_model_or_quant_is_refused(hybrid_dir, llama_dir, tmp_path):
    pc = tmp_path / "p.cache"
    make_cache(llama_dir, pc, PROMPT)
    before = pc.read_bytes()
    with pytest.raises(CacheError, match="another model or quant.*differs in: family"):
        _load(hybrid_dir).use_prompt_cache(pc)
    with pytest.raises(CacheError, match=r"another model or quant.*quant int8.*differs in: quant"):
        _load(llama_dir, quant="f32").use_prompt_cache(pc)
    assert pc.read_bytes() == before


def test_cli_refuses_foreign_file(hybrid_dir, llama_dir, tmp_path, capsys):
    pc = tmp_path / "p.cache"
    make_cache(llama_dir, pc, PROMPT)
    assert main(["run", str(hybrid_dir), "-p", "Hello", "-n", "2", "--prompt-cache", str(pc),
                 "--no-cache"]) == 2
    err = capsys.readouterr().err
    assert "another model or quant" in err and "give another --prompt-cache file" in err
    assert len(err.strip().splitlines()) == 1


def test_not_a_prompt_cache_is_refused_and_kept(llama_dir, tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("my precious notes")
    with pytest.raises(CacheError, match="not a cpullm prompt cache"):
        _load(llama_dir).use_prompt_cache(f)
    assert f.read_text() == "my precious notes"
    with pytest.raises(CacheError, match="is a directory"):
        _load(llama_dir).use_prompt_cache(tmp_path)
    with pytest.raises(CacheError, match="does not exist"):
        _load(llama_dir).use_prompt_cache(tmp_path / "nope" / "p.cache")


def _flip(pc: Path):
    b = bytearray(pc.read_bytes())
    b[-5] ^= 0x40                                    # inside the last state array
    pc.write_bytes(bytes(b))


def _truncate(pc: Path):
    pc.write_bytes(pc.read_bytes()[:-100])


def _stale(pc: Path, monkeypatch):
    monkeypatch.setattr(cpullm, "__version__", "99.0.0")


@pytest.mark.parametrize("how,word", [("flip", "damaged"), ("truncate", "truncated"), ("stale", "stale")])
def test_damaged_or_stale_file_is_ignored_then_rewritten(hybrid_dir, tmp_path, monkeypatch, capfd, how, word):
    pc = tmp_path / "p.cache"
    make_cache(hybrid_dir, pc, PROMPT)
    if how == "stale":
        _stale(pc, monkeypatch)
    else:
        {"flip": _flip, "truncate": _truncate}[how](pc)
    monkeypatch.setenv("CPULLM_QUIET", "0")
    capfd.readouterr()
    m = _load(hybrid_dir, use_cache=False).use_prompt_cache(pc)
    assert m.prompt_cache_status.startswith(f"MISS ({word}")
    notices = [line for line in capfd.readouterr().err.splitlines() if "prompt cache" in line]
    assert len(notices) == 1 and word in notices[0] and "rewritten" in notices[0]
    assert list(m.generate_ids(PROMPT, N_GEN, ignore_eos=True)) == reference(hybrid_dir, PROMPT, use_cache=False)[1]
    m.save_prompt_cache()
    m2 = _load(hybrid_dir, use_cache=False).use_prompt_cache(pc)
    assert last_logits(m2, PROMPT)[0] == len(PROMPT) - 1


def test_save_is_atomic(llama_dir, tmp_path, monkeypatch):
    pc = tmp_path / "p.cache"
    make_cache(llama_dir, pc, PROMPT)
    before = pc.read_bytes()
    m = _load(llama_dir).use_prompt_cache(pc)
    list(m.generate_ids(PROMPT + MORE, 2))

    def failing_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(CacheError, match="cannot write the prompt cache"):
        m.save_prompt_cache()
    monkeypatch.undo()
    assert pc.read_bytes() == before                      # the old file is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.cache"]   # no temporary left


def test_save_without_attaching(llama_dir, hybrid_dir, tmp_path):
    m = _load(llama_dir)
    with pytest.raises(CacheError, match="no prompt cache is attached"):
        m.save_prompt_cache()
    list(m.generate_ids(PROMPT, 2))
    m.save_prompt_cache(tmp_path / "a.cache")             # full attention: saved from the KV cache
    check_same(llama_dir, tmp_path / "a.cache", PROMPT, len(PROMPT) - 1)
    h = _load(hybrid_dir)
    list(h.generate_ids(PROMPT, 2))
    with pytest.raises(CacheError, match="sliding-window or linear-attention"):
        h.save_prompt_cache(tmp_path / "b.cache")


def test_cli_run_prompt_cache(hybrid_dir, tmp_path, capsys):
    pc = tmp_path / "p.cache"
    argv = ["run", str(hybrid_dir), "-p", "The quick brown fox", "-n", "6", "--json",
            "--prompt-cache", str(pc)]
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["prompt_cache"] == "MISS (no file)" and first["reused_tokens"] == 0 and pc.is_file()
    assert main(argv) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["text"] == first["text"]
    assert second["reused_tokens"] == second["prompt_tokens"] - 1
    assert second["prompt_cache"].startswith("HIT (reused")
    assert main(argv[:-3] + ["--prompt-cache", str(pc)]) == 0   # streaming mode
    captured = capsys.readouterr()
    assert first["text"] in captured.out and "prompt cache HIT" in captured.err
