"""benchmarks/moe.py's arithmetic and its reading of llama.cpp's batched decode (no model run)."""
import pytest

from bench_scripts import load_benchmark, shell_tool


def _tool(tmp_path, body: str) -> str:
    return shell_tool(tmp_path / "llama-batched-bench", body)


def test_llama_batched_reads_the_one_and_many_rows_of_its_jsonl(tmp_path):
    """llama-batched-bench logs its JSON lines among other output (to stderr here): the 1- and
    8-sequence rows' decode rates are taken by their ``pl``, and it is asked for exactly those."""
    moe = load_benchmark("moe")
    argv = tmp_path / "argv"
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    body = (f'echo "$@" > {argv}\n'
            'echo "main: n_kv_max = 400" >&2\n'
            'echo \'{"pp": 16, "tg": 32, "pl": 1, "speed_tg": 10.0, "speed_pp": 50.0}\' >&2\n'
            'echo \'{"pp": 16, "tg": 32, "pl": 8, "speed_tg": 24.0, "speed_pp": 90.0}\' >&2\n')
    out = moe.llama_batched({"Q8_0": gguf}, _tool(tmp_path, body), 2, 16, 32, 8)["Q8_0"]
    assert (out["one_tps"], out["streams_tps"]) == (10.0, 24.0)
    assert out["streams_over_one"] == pytest.approx(2.4) and out["error"] == ""
    args = argv.read_text().split()
    assert args[args.index("-npl") + 1] == "1,8" and args[args.index("-t") + 1] == "2"
    assert int(args[args.index("-c") + 1]) >= 8 * (16 + 32)


def test_llama_batched_without_its_rows_says_what_the_tool_printed(tmp_path):
    moe = load_benchmark("moe")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    out = moe.llama_batched({"Q4_K_M": gguf}, _tool(tmp_path, 'echo "failed to load model" >&2\nexit 1\n'),
                            2, 16, 32, 8)["Q4_K_M"]
    assert out["streams_over_one"] is None and "failed to load model" in out["error"]


def _row(tps: float, per_layer_bytes: float, depth: int) -> dict:
    return {"decode_tps": tps, "streams": 8, "streams_step_s": 8 / (2.5 * tps),
            "bytes_per_token": 300 + per_layer_bytes * depth, "active_bytes": 300 + per_layer_bytes * depth,
            "streams_bytes_per_step": 300 + 6 * per_layer_bytes * depth, "maxrss_mb": 100.0 * depth,
            "rss_mb": 90.0 * depth, "program_bytes": 1000 * depth}


def test_full_depth_extends_seconds_per_token_and_bytes_by_their_per_layer_cost():
    """Seconds per token are linear in depth (a fixed head plus a cost a layer): two depths give
    the full model's. The same for llama.cpp, and the ratio of the two at full depth."""
    moe = load_benchmark("moe")
    # cpullm: 10 ms + 1 ms a layer; llama.cpp: 8 ms + 1.5 ms a layer
    ours = {d: 1 / (0.010 + 0.001 * d) for d in (4, 12)}
    theirs = {d: 1 / (0.008 + 0.0015 * d) for d in (4, 12)}
    depths = {d: {"gguf:Q8_0": _row(ours[d], 50, d), "llama.cpp": {"Q8_0": {"tps": theirs[d]}}} for d in (4, 12)}
    out = moe.full_depth(depths, ["int8", "gguf:Q8_0"], 4, 12, 48)
    assert "int8" not in out                          # measured at one depth only
    ext = out["gguf:Q8_0"]
    assert ext["decode_tps"] == pytest.approx(1 / 0.058)
    assert out["llama.cpp"]["Q8_0"]["decode_tps"] == pytest.approx(1 / 0.080)
    assert ext["over_llama_Q8_0"] == pytest.approx(0.080 / 0.058)
    assert ext["bytes_per_token"] == pytest.approx(300 + 50 * 48)
    assert ext["program_bytes"] == pytest.approx(48000)
    assert ext["streams_over_one"] == pytest.approx(2.5)      # 8 streams a step at 2.5x one's rate, at any depth
    assert ext["streams_bound"] == pytest.approx(8 * (300 + 50 * 48) / (300 + 6 * 50 * 48))
