"""benchmarks/isa.py: where llama.cpp's files come from (a model that is a GGUF file only, the
llama-quantize tool) and how the rounds' ratios are reported."""
import sys
import types
from pathlib import Path

import pytest

from bench_scripts import load_benchmark, shell_tool


def test_a_model_that_is_one_gguf_is_requantized_from_that_file(tmp_path, monkeypatch):
    """The store's offline models are GGUF files without a checkpoint: both runtimes start from
    the file's values, each format is written once, and no F32 writer is asked for."""
    isa = load_benchmark("isa")
    mdir = tmp_path / "smollm2"
    mdir.mkdir()
    (mdir / "model.Q4_1.gguf").write_bytes(b"GGUF")
    calls = []

    def quantize(src, dst, threads, ftype, allow_requantize=False, tool=None):
        calls.append((Path(src).name, Path(dst).name, ftype, allow_requantize))
        assert tool == "/opt/llama/llama-quantize"
        Path(dst).write_bytes(b"GGUF")

    def no_f32(*a, **k):
        raise AssertionError("a GGUF-only model has no checkpoint to write")

    fake = types.ModuleType("compare.gguf")
    fake.llama_quantize, fake.write_f32_gguf = quantize, no_f32
    monkeypatch.setitem(sys.modules, "compare", types.ModuleType("compare"))
    monkeypatch.setitem(sys.modules, "compare.gguf", fake)
    work = tmp_path / "work"
    out = isa.gguf_for(mdir, "Q8_0", work, 2, ["Q8_0", "Q4_K_M"], tool="/opt/llama/llama-quantize")
    assert out == work / "smollm2-Q8_0.gguf" and out.is_file()
    assert calls == [("model.Q4_1.gguf", "smollm2-Q8_0.gguf", "Q8_0", True),
                     ("model.Q4_1.gguf", "smollm2-Q4_K_M.gguf", "Q4_K_M", True)]
    assert isa.gguf_for(mdir, "Q4_K_M", work, 2, ["Q8_0", "Q4_K_M"], tool="/opt/llama/llama-quantize").is_file()
    assert len(calls) == 2


def test_a_checkpoint_directory_is_not_taken_for_a_gguf_model(tmp_path):
    isa = load_benchmark("isa")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    assert isa._only_gguf(tmp_path) is None
    (tmp_path / "config.json").unlink()
    assert isa._only_gguf(tmp_path) == tmp_path / "model.gguf"
    (tmp_path / "other.gguf").write_bytes(b"GGUF")
    assert isa._only_gguf(tmp_path) is None                  # two files: which one is not guessed


def _tool(tmp_path, body: str) -> str:
    return shell_tool(tmp_path / "llama-quantize", body)


def test_the_llama_quantize_tool_writes_through_a_temporary_name(tmp_path):
    """llama-quantize's arguments as llama.cpp documents them ([--allow-requantize] in out type
    threads), its output renamed into place only when it succeeded."""
    gg = load_benchmark("compare/gguf")
    argv_file = tmp_path / "argv"
    tool = _tool(tmp_path, f'echo "$@" > {argv_file}\necho GGUF > "$3"\n')
    dst = tmp_path / "m-Q8_0.gguf"
    assert gg.llama_quantize(tmp_path / "m.gguf", dst, 2, "Q8_0", allow_requantize=True, tool=tool) == dst
    assert dst.read_text() == "GGUF\n" and not Path(str(dst) + ".tmp").exists()
    assert argv_file.read_text().split() == ["--allow-requantize", str(tmp_path / "m.gguf"), str(dst) + ".tmp",
                                             "Q8_0", "2"]


def test_a_failing_llama_quantize_tool_leaves_nothing_and_says_why(tmp_path):
    gg = load_benchmark("compare/gguf")
    tool = _tool(tmp_path, 'echo "llama_model_quantize: failed to quantize: unknown type" >&2\nexit 1\n')
    dst = tmp_path / "m-Q4_K_M.gguf"
    dst.write_text("the user's file")
    with pytest.raises(SystemExit, match="unknown type"):
        gg.llama_quantize(tmp_path / "m.gguf", dst, 2, "Q4_K_M", tool=tool)
    assert dst.read_text() == "the user's file" and not Path(str(dst) + ".tmp").exists()


def test_the_table_gives_the_median_and_range_of_the_rounds_ratios():
    """The best rates can come from different minutes of a drifting machine; each round's ratio
    comes from two runs made back to back."""
    isa = load_benchmark("isa")
    rounds = [{"prefill": p, "decode": 1.0} for p in (1.84, 1.19, 1.65, 1.39)]
    cell = {"isa": "avx2", "model": "m", "format": "int8", "load": 1.0, "rounds": rounds,
            "cpullm": {"prefill": 85.0, "decode": 18.0}, "llama": {"prefill": 53.3, "decode": 12.0}}
    row = isa.table([cell]).splitlines()[-1]
    assert "| 1.52× (1.19-1.84) |" in row and "| 1.59× |" in row and "| 1.00× (1.00-1.00) |" in row
    assert isa.round_ratios(rounds[:1], "prefill") == "-"
    assert isa.round_ratios(rounds[:3], "prefill") == "1.65× (1.19-1.84)"


def test_an_unusable_llama_quantize_path_is_refused(tmp_path, capsys):
    isa = load_benchmark("isa")
    with pytest.raises(SystemExit):
        isa.parse_args(["--llama-quantize", str(tmp_path / "missing")])
    assert "--llama-quantize" in capsys.readouterr().err
