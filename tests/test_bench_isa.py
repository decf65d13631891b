"""benchmarks/isa.py: where llama.cpp's files come from for a model that is a GGUF file only."""
import sys
import types
from pathlib import Path

from bench_scripts import load_benchmark


def test_a_model_that_is_one_gguf_is_requantized_from_that_file(tmp_path, monkeypatch):
    """The store's offline models are GGUF files without a checkpoint: both runtimes start from
    the file's values, each format is written once, and no F32 writer is asked for."""
    isa = load_benchmark("isa")
    mdir = tmp_path / "smollm2"
    mdir.mkdir()
    (mdir / "model.Q4_1.gguf").write_bytes(b"GGUF")
    calls = []

    def quantize(src, dst, threads, ftype, allow_requantize=False):
        calls.append((Path(src).name, Path(dst).name, ftype, allow_requantize))
        Path(dst).write_bytes(b"GGUF")

    def no_f32(*a, **k):
        raise AssertionError("a GGUF-only model has no checkpoint to write")

    fake = types.ModuleType("compare.gguf")
    fake.llama_quantize, fake.write_f32_gguf = quantize, no_f32
    monkeypatch.setitem(sys.modules, "compare", types.ModuleType("compare"))
    monkeypatch.setitem(sys.modules, "compare.gguf", fake)
    work = tmp_path / "work"
    out = isa.gguf_for(mdir, "Q8_0", work, 2, ["Q8_0", "Q4_K_M"])
    assert out == work / "smollm2-Q8_0.gguf" and out.is_file()
    assert calls == [("model.Q4_1.gguf", "smollm2-Q8_0.gguf", "Q8_0", True),
                     ("model.Q4_1.gguf", "smollm2-Q4_K_M.gguf", "Q4_K_M", True)]
    assert isa.gguf_for(mdir, "Q4_K_M", work, 2, ["Q8_0", "Q4_K_M"]).is_file() and len(calls) == 2


def test_a_checkpoint_directory_is_not_taken_for_a_gguf_model(tmp_path):
    isa = load_benchmark("isa")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    assert isa._only_gguf(tmp_path) is None
    (tmp_path / "config.json").unlink()
    assert isa._only_gguf(tmp_path) == tmp_path / "model.gguf"
    (tmp_path / "other.gguf").write_bytes(b"GGUF")
    assert isa._only_gguf(tmp_path) is None                  # two files: which one is not guessed
