"""benchmarks/compare.py: the checkpoint -> GGUF writer, llama.cpp on the same weights, the report.
The llama.cpp and transformers parts are skipped, with a reason, when their packages are missing."""
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from cpullm.gguf_file import permute_qk
from cpullm.testing import make_random_checkpoint
from tiny_configs import LLAMA32_LIKE, LLAMA_UNTIED_BIAS

ROOT = Path(__file__).resolve().parents[1]
IDS = [int(x) for x in np.random.default_rng(3).integers(0, 255, 40)]
LLAMA_CPP_REASON = "llama-cpp-python is an optional extra (pip install 'cpullm[bench]')"


def _load_compare():
    spec = importlib.util.spec_from_file_location("cpullm_bench_compare", ROOT / "benchmarks" / "compare.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


compare = _load_compare()

CASES = {"llama32": LLAMA32_LIKE, "untied_bias": LLAMA_UNTIED_BIAS}


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    cfg = dict(CASES[request.param], model_type="llama")
    return make_random_checkpoint(cfg, tmp_path_factory.mktemp(f"cmp_{request.param}"), seed=5)


@pytest.fixture(scope="module")
def f32_gguf(checkpoint, tmp_path_factory):
    return compare.write_f32_gguf(checkpoint, tmp_path_factory.mktemp("gguf") / "model.f32.gguf")


def test_gguf_writer_layout(checkpoint, f32_gguf):
    import gguf

    from cpullm.tensors import TensorStore

    cfg = json.loads((checkpoint / "config.json").read_text())
    r = gguf.GGUFReader(str(f32_gguf))
    tensors = {t.name: t for t in r.tensors}
    n = cfg["num_hidden_layers"]
    expect = {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{leaf}.weight" for i in range(n)
        for leaf in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate",
                     "ffn_up", "ffn_down")}
    assert expect <= set(tensors)
    assert ("output.weight" in tensors) == (not cfg["tie_word_embeddings"])
    assert ("rope_freqs.weight" in tensors) == (cfg["rope_parameters"]["rope_type"] == "llama3")
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in r.tensors)
    store = TensorStore(checkpoint)
    q = store.get("model.layers.0.self_attn.q_proj.weight")
    k = store.get("model.layers.0.self_attn.k_proj.weight")
    got_q = np.asarray(tensors["blk.0.attn_q.weight"].data).reshape(q.shape)
    got_k = np.asarray(tensors["blk.0.attn_k.weight"].data).reshape(k.shape)
    np.testing.assert_array_equal(got_q, permute_qk(q, cfg["num_attention_heads"]))
    np.testing.assert_array_equal(got_k, permute_qk(k, cfg["num_key_value_heads"]))
    field = r.fields["tokenizer.ggml.tokens"]
    assert len(field.data) == cfg["vocab_size"]
    assert r.fields["general.architecture"].contents() == "llama"


def test_permute_matches_llama_cpp_interleaving():
    # rows of one head [r0..r7] (two halves rotated together in HF) -> interleaved pairs
    w = np.arange(8, dtype=np.float32)[:, None]
    assert permute_qk(w, 1)[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def test_compare_reports_a_missing_runtime_as_skipped(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(compare, "_available",
                        lambda name: "skipped: llama_cpp not installed" if name == "llama.cpp" else None)
    code = compare.main([str(checkpoint), "--prompt-tokens", "16", "--gen-tokens", "3",
                         "--context-tokens", "32", "--repeat", "1", "--threads", "1",
                         "--skip", "transformers", "--out", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "compare.json").read_text())
    rows = {r["runtime"]: r for r in report["results"]}
    assert rows["llama.cpp"]["skipped"].startswith("skipped: llama_cpp")
    assert rows["cpullm"]["prefill_tps"] > 0 and rows["cpullm"]["decode_tps_at_512"] > 0
    assert rows["cpullm"]["decode_context_tokens"] == 32
    md = (tmp_path / "compare.md").read_text()
    assert "| cpullm |" in md and "| llama.cpp | skipped" in md
    # the memory-bound view: bytes per decode token, the read rate measured in the cpullm process
    assert rows["cpullm"]["decode_weight_bytes"] > 0 and rows["cpullm"]["read_gbps"] > 0
    assert "weight bytes read per decode token" in md and "Read rate:" in md


def test_compare_with_transformers(checkpoint, tmp_path):
    pytest.importorskip("torch", reason="torch is an optional extra (pip install 'cpullm[bench]')")
    pytest.importorskip("transformers", reason="transformers is an optional extra (pip install 'cpullm[bench]')")
    code = compare.main([str(checkpoint), "--prompt-tokens", "16", "--gen-tokens", "3",
                         "--context-tokens", "32", "--repeat", "1", "--threads", "1",
                         "--skip", "llama.cpp", "--out", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "compare.json").read_text())
    rows = {r["runtime"]: r for r in report["results"]}
    assert rows["transformers"]["decode_tps"] > 0
    assert rows["cpullm"]["fidelity"]["cosine"] > 0.98          # the same weights
    assert report["ratios"]["transformers"]["decode"] > 0
    assert "cpullm / transformers" in (tmp_path / "compare.md").read_text()
    # f32 parameters against cpullm's int8 + block scales of the same matrices: ~3.8x the bytes
    assert 3.0 < rows["transformers"]["decode_weight_bytes"] / rows["cpullm"]["decode_weight_bytes"] < 4.2


# ---- llama.cpp -----------------------------------------------------------------------------------
def test_llama_cpp_f32_gguf_matches_cpullm_f32(checkpoint, f32_gguf):
    """The GGUF writer is faithful: llama.cpp on the F32 GGUF gives cpullm's f32 logits."""
    llama_cpp = pytest.importorskip("llama_cpp", reason=LLAMA_CPP_REASON)
    import cpullm

    f32 = llama_cpp.GGML_TYPE_F32                               # llama.cpp's KV cache is f16 by default
    llm = llama_cpp.Llama(model_path=str(f32_gguf), n_ctx=64, n_threads=1, n_threads_batch=1,
                          logits_all=True, type_k=f32, type_v=f32, verbose=False)
    llm.eval(IDS)
    got = np.asarray(llm.scores[: len(IDS)], np.float32)
    ref = cpullm.load(checkpoint, quant="f32", use_cache=False).logits(IDS)
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < 1e-4, f"llama.cpp F32 logits differ from cpullm f32 by {err:.2e} (relative)"


def test_compare_with_llama_cpp_q8_0(checkpoint, tmp_path):
    pytest.importorskip("llama_cpp", reason=LLAMA_CPP_REASON)
    code = compare.main([str(checkpoint), "--prompt-tokens", "16", "--gen-tokens", "3",
                         "--context-tokens", "32", "--repeat", "1", "--threads", "1",
                         "--skip", "transformers", "--out", str(tmp_path / "out"),
                         "--work-dir", str(tmp_path / "work"), "--paired", "2"])
    assert code == 0
    q8 = list((tmp_path / "work").glob("*.Q8_0.gguf"))
    assert len(q8) == 1 and not list((tmp_path / "work").glob("*.partial"))
    import gguf
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(q8[0])).tensors}
    assert types["blk.0.ffn_down.weight"] == gguf.GGMLQuantizationType.Q8_0
    report = json.loads((tmp_path / "out" / "compare.json").read_text())
    rows = {r["runtime"]: r for r in report["results"]}
    assert rows["llama.cpp"]["decode_tps"] > 0 and rows["llama.cpp"]["weights"].startswith("Q8_0")
    # Q8_0 in llama.cpp and INT8 in cpullm of the same weights: (nearly) the same last logits
    assert rows["llama.cpp"]["agreement_with_cpullm"]["cosine"] > 0.98
    assert report["ratios"]["llama.cpp"]["prefill"] > 0
    md = (tmp_path / "out" / "compare.md").read_text()
    assert "cpullm / llama.cpp" in md
    # Q8_0 (34 bytes per 32 values) reads about what cpullm's int8 + binary16 block scales read
    assert 0.9 < rows["llama.cpp"]["decode_weight_bytes"] / rows["cpullm"]["decode_weight_bytes"] < 1.1
    # --paired: both runtimes loaded at once, two turns, a ratio per turn and the read rate
    pd = report["paired"]
    assert len(pd["ratios"]["llama.cpp"]["decode"]) == 2 and min(pd["tps"]["llama.cpp"]["decode_at_512"]) > 0
    assert len(pd["read_gbps"]["decode"]) == 2 and "Paired decode (2 turns)" in md
    assert "| llama.cpp |" in md.split("weight bytes read per decode token")[1]
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "out" / "compare.png").read_bytes()[:4] == b"\x89PNG"


def test_busy_flag_uses_the_measured_cpu_time_before_the_run():
    m = {"logical_cpus": 2}
    assert compare._busy({"cpu_busy_before": 0.6, "loadavg_before": 0.0, "machine": m})
    assert not compare._busy({"cpu_busy_before": 0.05, "loadavg_before": 1.5, "machine": m})  # a run that just ended
    assert compare._busy({"cpu_busy_before": None, "loadavg_before": 1.5, "machine": m})      # no /proc/stat
    from cpullm.bench import cpu_busy
    busy = cpu_busy(0.2)
    assert busy is None or 0.0 <= busy <= 1.0


def test_rounds_take_medians_and_keep_every_rounds_ratio():
    runs = [{"runtime": "cpullm", "prefill_tps": p, "decode_tps": d, "decode_tps_at_512": d, "ttft_s": 0.1,
             "load_s": 1.0, "weights": "int8"} for p, d in ((100.0, 10.0), (300.0, 30.0), (200.0, 50.0))]
    row = compare.merge_rounds(runs + [{"runtime": "cpullm", "error": "exit 1: boom"}])
    assert row["prefill_tps"] == 200.0 and row["decode_tps"] == 30.0 and row["weights"] == "int8"
    assert row["rounds"]["decode_tps"] == [10.0, 30.0, 50.0]
    assert row["rounds_ok"] == 3 and row["rounds_failed"] == 1
    assert compare.merge_rounds([{"runtime": "x", "error": "e"}])["error"] == "e"
    assert "rounds" not in compare.merge_rounds(runs[:1])                   # one round: as it was
    llama = [{"runtime": "llama.cpp", "prefill_tps": 100.0, "decode_tps": 20.0, "decode_tps_at_512": 25.0}]
    per = [compare._ratios({"cpullm": runs[i], "llama.cpp": llama[0]}) for i in range(3)]
    assert [r["llama.cpp"]["decode"] for r in per] == [0.5, 1.5, 2.5]
    lines = "\n".join(compare._round_lines({"round_ratios": per}))
    assert "| 2 | 3.00x | 1.50x | 1.20x |" in lines
    assert "| min | 1.00x | 0.50x | 0.40x |" in lines and "| max | 3.00x | 2.50x | 2.00x |" in lines


def test_compare_rounds_run_every_runtime_again(checkpoint, tmp_path, monkeypatch):
    calls = []
    real = compare.run_worker

    def counted(name, spec, workdir, timeout):
        calls.append(name)
        return real(name, spec, workdir, timeout)
    monkeypatch.setattr(compare, "run_worker", counted)
    code = compare.main([str(checkpoint), "--prompt-tokens", "16", "--gen-tokens", "3",
                         "--context-tokens", "32", "--repeat", "1", "--threads", "1", "--rounds", "2",
                         "--skip", "llama.cpp,transformers", "--out", str(tmp_path), "--paired", "1"])
    assert code == 0 and calls == ["cpullm", "cpullm"]
    report = json.loads((tmp_path / "compare.json").read_text())
    row = report["results"][0]
    assert len(row["rounds"]["decode_tps"]) == 2 and row["decode_tps"] == pytest.approx(
        float(np.median(row["rounds"]["decode_tps"])))
    assert report["settings"]["rounds"] == 2
    assert "median over 2 rounds" in (tmp_path / "compare.md").read_text()
    assert "Paired decode: not run (it needs cpullm and at least one other runtime)" in (
        tmp_path / "compare.md").read_text()
    assert compare.main([str(checkpoint), "--rounds", "0", "--out", str(tmp_path)]) == 2
    assert compare.main([str(checkpoint), "--paired", "-1", "--out", str(tmp_path)]) == 2


def test_compare_no_mmap_reaches_cpullm(checkpoint, tmp_path, monkeypatch):
    loads = []
    import cpullm
    real = cpullm.load

    def spy(*a, **kw):
        loads.append(kw.get("mmap"))
        return real(*a, **kw)
    monkeypatch.setattr(cpullm, "load", spy)
    spec = {"model_dir": str(checkpoint), "ids": IDS[:8], "context_ids": IDS[:16], "gen_tokens": 2,
            "context_tokens": 16, "repeat": 1, "threads": 1, "quant": "int8", "gguf": None, "no_mmap": True,
            "logits_out": str(tmp_path / "l.npy")}
    res = compare.worker("cpullm", spec)
    assert loads == [False] and res["weights"] == "int8 (cpullm, --no-mmap)" and res["decode_tps"] > 0


class _FakeRuntime:
    """A served runtime whose runs return preset tokens/s, recording the order it was asked in."""
    asked: list = []

    def __init__(self, name, spec, workdir, speeds):
        self.name, self.speeds = name, list(speeds)

    def run(self, kind):
        _FakeRuntime.asked.append((self.name, kind))
        out = {"tps": self.speeds.pop(0)}
        if self.name == "cpullm":
            out["read_gbps"] = 30.0
        return out

    def close(self):
        pass


def test_paired_decode_alternates_and_takes_ratios_within_each_turn(tmp_path):
    # cpullm: turn 1 (decode, ctx) = 60, 50; turn 2 = 30, 25 (the machine slowed down); llama.cpp half of it
    speeds = {"cpullm": [60.0, 50.0, 30.0, 25.0], "llama.cpp": [30.0, 25.0, 15.0, 12.5]}
    _FakeRuntime.asked = []
    pd = compare.paired_decode(["cpullm", "llama.cpp"], {}, tmp_path, 2, 0, say=lambda m: None,
                               start=lambda n, spec, wd: _FakeRuntime(n, spec, wd, speeds[n]))
    assert _FakeRuntime.asked == [("cpullm", "decode"), ("llama.cpp", "decode"),
                                  ("cpullm", "decode_at_512"), ("llama.cpp", "decode_at_512"),
                                  ("llama.cpp", "decode"), ("cpullm", "decode"),
                                  ("llama.cpp", "decode_at_512"), ("cpullm", "decode_at_512")]
    assert pd["ratios"]["llama.cpp"] == {"decode": [2.0, 2.0], "decode_at_512": [2.0, 2.0]}
    assert pd["tps"]["cpullm"]["decode"] == [60.0, 30.0] and pd["read_gbps"]["decode"] == [30.0, 30.0]
    report = {"paired": pd, "settings": {"gen_tokens": 8, "context_tokens": 32}}
    md = "\n".join(compare._paired_lines(report))
    assert "| cpullm / llama.cpp | 2.00x | 2.00x | 2.00x | 2.00x | 2.00x | 2.00x |" in md
    assert "| 2 | 30.0 / 30.0 | 30.0 / 25.0 | 15.0 / 12.5 | 2.00x / 2.00x |" in md
    assert "| cpullm | 45.0 | 37.5 |" in md                  # medians over the turns
    # a runtime that stops is reported, not raised
    def broken(n, spec, wd):
        raise RuntimeError(f"{n} stopped (exit 1): boom")
    pd = compare.paired_decode(["cpullm", "llama.cpp"], {}, tmp_path, 2, 0, say=lambda m: None, start=broken)
    assert pd == {"error": "cpullm stopped (exit 1): boom"}
    assert "not run (cpullm stopped" in "\n".join(compare._paired_lines({"paired": pd}))


def test_serve_times_runs_on_command(checkpoint, tmp_path):
    import io
    spec = {"model_dir": str(checkpoint), "ids": IDS[:8], "context_ids": IDS[:16], "gen_tokens": 2,
            "context_tokens": 16, "repeat": 1, "threads": 1, "quant": "int8", "gguf": None}
    out = io.StringIO()
    compare.serve("cpullm", spec, stdin=io.StringIO("decode\ndecode_at_512\nquit\ndecode\n"), stdout=out)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith(compare.READY_TAG) and json.loads(lines[0][len(compare.READY_TAG):])["load_s"] > 0
    res = [json.loads(ln[len(compare.RESULT_TAG):]) for ln in lines[1:]]
    assert [r["kind"] for r in res] == ["decode", "decode_at_512"]          # nothing after quit
    assert all(r["tps"] > 0 and r["read_gbps"] > 0 for r in res)


def test_a_served_runtime_that_fails_to_load_names_its_error(tmp_path):
    spec = {"model_dir": str(tmp_path / "missing"), "ids": IDS[:8], "gen_tokens": 2, "context_tokens": 16,
            "repeat": 1, "threads": 1, "quant": "int8", "gguf": None}
    pd = compare.paired_decode(["cpullm", "llama.cpp"], spec, tmp_path, 1, 60, say=lambda m: None)
    assert pd["error"].startswith("cpullm stopped (exit 1)") and "missing" in pd["error"]
