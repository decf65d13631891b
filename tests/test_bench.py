"""`cpullm bench` on a tiny random Llama checkpoint: JSON keys and types, profile shares, the PNG.
No timing is asserted anywhere."""
import json
import os

import numpy as np
import pytest

from cpullm import bench
from cpullm.bench import startup
from cpullm.cli import main
from cpullm.testing import make_random_checkpoint
from tiny_configs import SMOLLM2_LIKE

SMALL = ["--prompt-tokens", "24", "--gen-tokens", "4", "--repeat", "2"]
GROUPS = {"embedding", "norm", "qkv", "rope", "attention", "o_proj", "mlp_up", "mlp_act", "mlp_down",
          "residual", "lm_head", "sampling"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_random_checkpoint(dict(SMOLLM2_LIKE, model_type="llama"), tmp_path_factory.mktemp("tiny_llama"))


def _bench_json(capsys, *argv) -> dict:
    assert main(["bench", *map(str, argv), "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    return json.loads(out[-1])


def _q8_decode_bytes(a: dict) -> int:
    """A Llama's matrices at q8 (int8 values + a 2-byte scale per 32, K padded to 32, rows to the
    panels' 64): q, k, v, o, gate, up, down per layer and the (tied) lm_head (too small for a head
    screen)."""
    from cpullm_kernels.rows.q8 import padded_k
    from cpullm_kernels.panels.q8_panels import padded_rows
    h, f, hd = a["hidden_size"], a["intermediate_size"], a["head_dim"]
    q, kv = a["num_attention_heads"] * hd, a["num_key_value_heads"] * hd
    mats = [(q + 2 * kv, h), (h, q), (2 * f, h), (h, f)] * a["num_hidden_layers"] + [(a["vocab_size"], h)]
    return sum(padded_rows(N) * (padded_k(K) + 2 * (padded_k(K) // 32)) for N, K in mats)


def test_json_keys_and_types_with_load_timing(tiny, capsys):
    r = _bench_json(capsys, tiny, *SMALL, "--threads", "1", "--no-compile-timing")
    for key in ("prefill_tps", "decode_tps", "decode_tps_at_512", "decode_logits_tps", "ttft_s", "load_s",
                "load_s_hit", "load_s_miss"):
        assert isinstance(r[key], float) and r[key] > 0, key
    for key in ("weights_bytes", "kv_bytes", "kv_bytes_max", "arena_bytes", "peak_rss_bytes", "params"):
        assert isinstance(r[key], int) and r[key] > 0, key
    assert r["cache"] in ("HIT", "MISS")
    assert r["cache_miss_status"] == "MISS" and r["cache_hit_status"] == "HIT"
    assert r["warmup_compile_s"] is None                      # skipped by --no-compile-timing
    assert r["threads"] == 1 and r["quant"] == "int8"
    assert r["family"] == "llama" and r["model"] == str(tiny)
    assert r["prompt_tokens"] == 24 and r["gen_tokens"] == 4 and r["repeat"] == 2
    assert r["decode_context_tokens"] == 512
    assert len(r["runs"]) == 2
    assert "profile" not in r
    # the memory bound: the weight bytes one token reads, and decode's share of the read rate
    assert r["decode_weight_bytes"] == _q8_decode_bytes(SMOLLM2_LIKE)
    assert r["head_screen"] is False and r["memory_bound_head_steps"] == {"plain": 4}   # too small for one
    assert "screen" not in bench.format_report(r)
    for key in ("read_gbps", "read_gbps_best", "decode_gbps", "decode_tps_bound", "decode_bound_share"):
        assert isinstance(r[key], float) and r[key] > 0, key
    assert r["decode_bound_share"] == pytest.approx(r["decode_gbps"] / r["read_gbps"])
    assert r["decode_tps_bound"] == pytest.approx(r["read_gbps"] * 1e9 / r["decode_weight_bytes"])
    assert r["read_gbps_best"] >= r["read_gbps"] and r["memory_bound_steps"] == 4
    # KV in use after the 512-context run: 512 + 4 positions of every layer's K and V, float16
    a = SMOLLM2_LIKE
    assert r["kv_dtype"] == "f16" and "KV cache f16" in bench.format_report(r)
    assert r["kv_bytes"] == a["num_hidden_layers"] * 2 * a["num_key_value_heads"] * a["head_dim"] * 516 * 2
    # the build's peak RSS (the MISS child) and the HIT child's, and the context's memory plan
    assert isinstance(r["build_peak_rss_bytes"], int) and r["build_peak_rss_bytes"] > r["weights_bytes"]
    assert isinstance(r["peak_rss_bytes_hit_process"], int) and r["peak_rss_bytes_hit_process"] > 0
    plan = r["context_plan"]
    assert plan["n_ctx"] == r["n_ctx"] and plan["kv_bytes_max"] == r["kv_bytes_max"]
    assert plan["kv_full_attention_bytes"] == r["kv_bytes_max"] and plan["kv_sliding_window_bytes"] == 0
    assert "build peak RSS" in bench.format_report(r) and "context plan" in bench.format_report(r)


def test_decode_at_a_chosen_context(tiny, capsys):
    r = _bench_json(capsys, tiny, *SMALL, "--threads", "1", "--ctx", "1024", "--context-tokens", "900",
                    "--no-load-timing", "--no-compile-timing")
    assert r["decode_context_tokens"] == 900 and r["n_ctx"] == 1024
    assert r["build_peak_rss_bytes"] is None                  # no MISS child without load timing
    a = SMOLLM2_LIKE
    assert r["kv_bytes"] == a["num_hidden_layers"] * 2 * a["num_key_value_heads"] * a["head_dim"] * 904 * 2


def test_profile_shares_sum_to_one_and_plot(tiny, tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (the [plot] extra)")
    png = tmp_path / "profile.png"
    r = _bench_json(capsys, tiny, *SMALL, "--profile", "--plot", png, "--no-load-timing",
                    "--no-compile-timing")
    assert r["load_s_hit"] is None and r["load_s_miss"] is None
    prof = r["profile"]
    for phase in ("decode", "prefill"):
        groups = prof[phase]["groups"]
        assert set(groups) <= GROUPS, set(groups) - GROUPS
        assert {"qkv", "attention", "o_proj", "mlp_up", "mlp_down", "lm_head", "sampling"} <= set(groups)
        assert sum(g["share"] for g in groups.values()) == pytest.approx(1.0, abs=1e-9)
        assert all(g["seconds"] >= 0 and 0 <= g["share"] <= 1 for g in groups.values())
    assert prof["decode"]["tokens"] == 4 and prof["prefill"]["tokens"] == 512
    assert all("ms_per_token" in g for g in prof["decode"]["groups"].values())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and r["plot"] == str(png)


def test_text_report_with_profile_table(tiny, capsys):
    assert main(["bench", str(tiny), *SMALL, "--profile", "--no-load-timing", "--no-compile-timing"]) == 0
    out = capsys.readouterr().out
    for text in ("prefill", "decode (short context)", "decode @512", "time to first token", "tokens/s",
                 "per-op profile", "QKV projection", "MLP up/gate", "lm_head", "sampling", "peak RSS",
                 "of weights per token", "of that rate"):
        assert text in out, text


def test_prompt_that_does_not_fit_is_a_one_line_error(tiny, capsys):
    code = main(["bench", str(tiny), "--ctx", "32", "--prompt-tokens", "30", "--gen-tokens", "8",
                 "--no-load-timing", "--no-compile-timing", "--json"])
    assert code == 2
    assert "exceed the context of 32" in capsys.readouterr().err


def test_short_context_clips_the_decode_context(tiny, capsys):
    r = _bench_json(capsys, tiny, "--ctx", "64", "--prompt-tokens", "16", "--gen-tokens", "4", "--repeat", "1",
                    "--no-load-timing", "--no-compile-timing")
    assert r["decode_context_tokens"] == 60 and r["n_ctx"] == 64


def test_prompt_ids_are_deterministic_and_exact():
    class Tok:
        def encode(self, text, add_special_tokens=True):
            assert not add_special_tokens
            return [ord(c) for c in text[:50]]

    a, b = bench.prompt_ids(Tok(), 123), bench.prompt_ids(Tok(), 123)
    assert a == b and len(a) == 123 and a[:50] == a[50:100]
    assert bench.prompt_ids(Tok(), 7, vocab=100) == [t for t in a if t < 100][:7]


class FakeRunner:
    """Counts calls; logits make the greedy pick deterministic."""

    def __init__(self, n_ctx=1024, vocab=16):
        self.n_ctx, self.vocab = n_ctx, vocab
        self.pos, self.prefills, self.decodes, self.max_pos = 0, [], 0, 0

    def reset(self):
        self.pos = 0

    def _logits(self):
        x = np.zeros(self.vocab, np.float32)
        x[self.pos % self.vocab] = 1
        return x

    def prefill(self, ids):
        self.prefills.append(len(ids))
        self.pos += len(ids)
        return self._logits()

    def decode(self, tok):
        self.decodes += 1
        self.pos += 1
        self.max_pos = max(self.max_pos, self.pos)
        return self._logits()


def test_measure_speed_protocol():
    r = FakeRunner()
    ids = list(range(100))
    out = bench.measure_speed(r, ids, gen_tokens=5, repeat=3)
    # warm-up prefill, then per repeat: 1-token prompt, the prompt, the 512-token context
    assert r.prefills == [100] + [1, 100, 512] * 3
    assert r.decodes == min(4, 5) + 3 * (5 + 5)
    assert r.max_pos == 512 + 5
    for key in ("prefill_tps", "decode_tps", "decode_tps_at_512", "ttft_s"):
        assert out[key] > 0
    assert out["decode_context_tokens"] == 512 and len(out["runs"]) == 3


def test_measure_speed_reuses_a_512_token_prompt():
    r = FakeRunner()
    bench.measure_speed(r, list(range(512)), gen_tokens=2, repeat=1, warmup=False)
    assert r.prefills == [1, 512]


def test_compile_time_is_cold_minus_warm_ready_time(monkeypatch, tmp_path):
    calls, specs = [], []

    def fake_child(spec, env_extra=None, timeout=0):
        calls.append(env_extra or {})
        specs.append(spec)
        cold = bool(env_extra and "NUMBA_CACHE_DIR" in env_extra)
        n = len(calls)
        return {"ready_s": 9.0 if cold else (3.0 if n == 1 else 2.0), "load_s": 1.0,
                "cache": "MISS" if n == 1 else "HIT", "first_forward_s": 5.0 if cold else 0.2,
                "second_forward_s": 0.1, "peak_rss_bytes": 1, "uncacheable": ["run"] if cold else [],
                "first_token_s": 8.5 if cold else 1.5, "compile_s": 6.5 if cold else 0.0}

    monkeypatch.setattr(startup, "_child_load", fake_child)
    r = bench.load_timings(tmp_path, "int8", 1, 64, [1, 2, 3])
    assert r["load_s_miss"] == 3.0 and r["load_s_hit"] == 2.0
    assert r["warmup_compile_s"] == pytest.approx(6.0)             # cold minus MISS ready time
    assert r["cold_start_s"] == 8.5 and r["cold_start_compile_s"] == 6.5   # the cold child's first token
    assert r["first_forward_compile_s"] == pytest.approx(4.9)
    assert r["numba_uncacheable"] == ["run"]                 # what the cold child could not cache
    assert specs[2]["cache_dir"] != specs[0]["cache_dir"]    # a first run: both caches empty
    numba_dir = calls[2]["NUMBA_CACHE_DIR"]
    assert not os.path.exists(numba_dir)                      # the temporary dirs are removed


@pytest.mark.slow      # a child process compiles every kernel with an empty numba cache (~1-2 min)
def test_cold_numba_compile_time_real(tiny):
    r = bench.load_timings(tiny, "int8", 1, 256, [1, 2, 3, 4])
    assert r["warmup_compile_s"] > 0 and r["load_s_cold_numba"] > r["load_s_hit"]
    assert r["numba_uncacheable"] == []       # a second start compiles nothing


def test_uncacheable_functions_are_read_from_numba_warnings(monkeypatch):
    """The cold child's stderr names what numba could not cache; the report lists it."""
    import subprocess
    stderr = ('x.py:1: NumbaWarning: Cannot cache compiled function "run" as it uses dynamic globals\n'
              'x.py:2: NumbaWarning: Cannot cache compiled function "_matvec_q8_avx2" as it uses ...\n'
              'x.py:1: NumbaWarning: Cannot cache compiled function "run" as it uses dynamic globals\n')
    line = 'CPULLM_BENCH_CHILD {"ready_wall": 1.0, "load_s": 0.5}'
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, line, stderr))
    assert startup._child_load({})["uncacheable"] == ["_matvec_q8_avx2", "run"]


def test_decode_weight_bytes_f32_with_biases(tmp_path):
    """f32 weights (4 bytes per value, no padding) and the attention biases of an untied Llama:
    the spans of the program cover exactly those bytes, merged into few long runs."""
    import cpullm
    from tiny_configs import LLAMA_UNTIED_BIAS as a
    d = make_random_checkpoint(dict(a, model_type="llama"), tmp_path / "m")
    m = cpullm.load(d, quant="f32", threads=1, n_ctx=64, cache_dir=tmp_path / "cache")
    h, f, hd = a["hidden_size"], a["intermediate_size"], a["head_dim"]
    q, kv = a["num_attention_heads"] * hd, a["num_key_value_heads"] * hd
    mats = [(q + 2 * kv, h), (h, q), (2 * f, h), (h, f)] * a["num_hidden_layers"] + [(a["vocab_size"], h)]
    biases = (q + 2 * kv + h) * a["num_hidden_layers"]        # attention_bias: q, k, v and o
    assert bench.decode_weight_bytes(m.program) == 4 * sum(N * K for N, K in mats) + 4 * biases
    spans = bench.decode_weight_spans(m.program)
    assert len(spans) < len(mats)
    assert all(s.dtype == np.float32 for s in spans)


def test_report_names_what_numba_could_not_cache():
    r = {"model": "m", "family": "llama", "model_type": "llama", "quant": "int8", "threads": 2, "n_ctx": 64,
         "prompt_tokens": 8, "gen_tokens": 2, "repeat": 1, "prefill_tps": 1.0, "decode_tps": 1.0,
         "decode_context_tokens": 8, "decode_tps_at_512": 1.0, "ttft_s": 1.0, "load_s": 1.0, "cache": "HIT",
         "weights_bytes": 1, "kv_bytes": 1, "kv_bytes_max": 1, "arena_bytes": 1, "peak_rss_bytes": 1}
    assert "could not cache" not in bench.format_report(dict(r, numba_uncacheable=[]))
    line = [ln for ln in bench.format_report(dict(r, numba_uncacheable=["run", "x"])).splitlines()
            if "could not cache" in ln]
    assert line == ["  numba could not cache (recompiled at every start): run, x"]
