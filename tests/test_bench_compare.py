"""benchmarks/compare: the checkpoint -> GGUF writer, llama.cpp on the same weights, the report.
The llama.cpp and transformers parts are skipped, with a reason, when their packages are missing."""
import importlib
import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from cpullm.loading.gguf_file import permute_qk
from cpullm.testing import make_random_checkpoint
from cpullm_llama.tiny_configs import LLAMA
from tiny_configs import LLAMA_UNTIED_BIAS

ROOT = Path(__file__).resolve().parents[1]
IDS = [int(x) for x in np.random.default_rng(3).integers(0, 255, 40)]
LLAMA_CPP_REASON = "llama-cpp-python is an optional extra (pip install 'cpullm[bench]')"


def _load_compare():
    """The benchmarks/compare package, under a name of its own (the repository root stays off sys.path)."""
    pkg = ROOT / "benchmarks" / "compare"
    spec = importlib.util.spec_from_file_location("cpullm_bench_compare", pkg / "__init__.py",
                                                  submodule_search_locations=[str(pkg)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


compare = _load_compare()
cli, gguf, llama_convert, paired, reporting, workers = (
    importlib.import_module(f"{compare.__name__}.{m}")
    for m in ("cli", "gguf", "llama_convert", "paired", "report", "workers"))

CASES = {"llama32": LLAMA, "untied_bias": LLAMA_UNTIED_BIAS}


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    cfg = dict(CASES[request.param], model_type="llama")
    return make_random_checkpoint(cfg, tmp_path_factory.mktemp(f"cmp_{request.param}"), seed=5)


@pytest.fixture(scope="module")
def f32_gguf(checkpoint, tmp_path_factory):
    return gguf.write_f32_gguf(checkpoint, tmp_path_factory.mktemp("gguf") / "model.f32.gguf")


def test_gguf_writer_layout(checkpoint, f32_gguf):
    import gguf

    from cpullm.loading.tensors import TensorStore

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
    monkeypatch.setattr(cli, "_available",
                        lambda name: "skipped: llama_cpp not installed" if name == "llama.cpp" else None)
    code = cli.main([str(checkpoint), "--prompt-tokens", "16", "--gen-tokens", "3",
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


@pytest.mark.reference
def test_compare_with_transformers(checkpoint, tmp_path):
    pytest.importorskip("torch", reason="torch is an optional extra (pip install 'cpullm[bench]')")
    pytest.importorskip("transformers", reason="transformers is an optional extra (pip install 'cpullm[bench]')")
    code = cli.main([str(checkpoint), "--prompt-tokens", "16", "--gen-tokens", "3",
                         "--context-tokens", "32", "--repeat", "1", "--threads", "1",
                         "--skip", "llama.cpp", "--out", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "compare.json").read_text())
    rows = {r["runtime"]: r for r in report["results"]}
    assert rows["transformers"]["decode_tps"] > 0
    assert rows["cpullm"]["fidelity"]["cosine"] > 0.98          # the same weights
    assert report["ratios"]["cpullm / transformers"]["decode"] > 0
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
    code = cli.main([str(checkpoint), "--prompt-tokens", "16", "--gen-tokens", "3",
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
    assert report["ratios"]["cpullm / llama.cpp"]["prefill"] > 0
    md = (tmp_path / "out" / "compare.md").read_text()
    assert "cpullm / llama.cpp" in md
    # Q8_0 (34 bytes per 32 values) reads about what cpullm's int8 + binary16 block scales read;
    # cpullm's q8 panels pad each matrix to 64 rows, which this tiny model's 144-row matrices feel
    # (real models' row counts are multiples of 64)
    assert 0.8 < rows["llama.cpp"]["decode_weight_bytes"] / rows["cpullm"]["decode_weight_bytes"] < 1.1
    # --paired: both runtimes loaded at once, two turns, a ratio per turn and the read rate
    pd = report["paired"]
    assert len(pd["ratios"]["cpullm / llama.cpp"]["decode"]) == 2 and min(pd["tps"]["llama.cpp"]["decode_at_512"]) > 0
    assert len(pd["read_gbps"]["decode"]) == 2 and "Paired decode (2 turns)" in md
    assert "| llama.cpp |" in md.split("weight bytes read per decode token")[1]
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "out" / "compare.png").read_bytes()[:4] == b"\x89PNG"


# ---- 4-bit (--four-bit) ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama32_checkpoint(tmp_path_factory):
    return make_random_checkpoint(dict(LLAMA), tmp_path_factory.mktemp("cmp4"), seed=5)


def _kl_ok(row):
    return math.isfinite(row["kl"]) and row["kl"] >= 0.0


def test_compare_four_bit_cpullm_runtimes(llama32_checkpoint, tmp_path, monkeypatch):
    """cpullm-q4 and cpullm-gguf (on a Q4_0 GGUF the gguf package writes: no llama.cpp needed)
    beside cpullm int8, with the KL pass; the llama.cpp runtimes reported as missing."""
    monkeypatch.setattr(cli, "_available", lambda name: (
        "skipped: llama_cpp not installed" if workers.is_llama_cpp(name) else None))
    q4_0 = gguf.write_f32_gguf(llama32_checkpoint, tmp_path / "model.Q4_0.gguf", qtype="Q4_0")
    code = cli.main([str(llama32_checkpoint), "--four-bit", "--gguf-q4", str(q4_0), "--kl-tokens", "4",
                         "--prompt-tokens", "16", "--gen-tokens", "3", "--context-tokens", "32", "--repeat", "1",
                         "--threads", "1", "--skip", "transformers", "--out", str(tmp_path / "out")])
    assert code == 0
    report = json.loads((tmp_path / "out" / "compare.json").read_text())
    rows = {r["runtime"]: r for r in report["results"]}
    assert list(rows) == list(workers.ALL_RUNTIMES)
    for name in ("llama.cpp", "llama.cpp-Q4_K_M", "llama.cpp-Q4_0"):
        assert rows[name]["skipped"].startswith("skipped: llama_cpp")
    for name in ("cpullm", "cpullm-q4", "cpullm-gguf"):
        assert rows[name]["prefill_tps"] > 0 and rows[name]["decode_tps"] > 0, name
        assert rows[name]["decode_weight_bytes"] > 0 and _kl_ok(rows[name]), name
    assert rows["cpullm-q4"]["weights"].startswith("q4") and rows["cpullm-gguf"]["gguf"] == str(q4_0)
    assert rows["cpullm-gguf"]["weights"].startswith("Q4_0 GGUF as it is")
    # 4-bit blocks (Q5_0 / Q8_0 where rows are not whole 256-weight super-blocks) read fewer bytes than int8
    assert rows["cpullm-q4"]["decode_weight_bytes"] < rows["cpullm"]["decode_weight_bytes"]
    assert rows["cpullm-gguf"]["decode_weight_bytes"] < rows["cpullm"]["decode_weight_bytes"]
    # the KL pass: one prompt (the default with --four-bit) followed by 4 greedy tokens of cpullm f32
    kl = report["kl"]
    assert kl["prompts"] == 1 and len(kl["sequence_lengths"]) == 1 and kl["positions"] > 4
    assert "f32" in kl["reference"]
    assert report["ratios"] == {}                          # no llama.cpp: no ratio of the 4-bit pairs
    md = (tmp_path / "out" / "compare.md").read_text()
    assert "KL vs f32 (nats)" in md and "weight MB / decode token" in md and "| cpullm-q4 | q4" in md
    assert "| llama.cpp-Q4_K_M | skipped" in md and f"over all {kl['positions']} positions" in md


def test_compare_four_bit_kl_pass_can_be_turned_off(llama32_checkpoint, tmp_path):
    code = cli.main([str(llama32_checkpoint), "--four-bit", "--kl-prompts", "0", "--prompt-tokens", "16",
                         "--gen-tokens", "3", "--context-tokens", "32", "--repeat", "1", "--threads", "1",
                         "--skip", "cpullm,transformers,cpullm-gguf,llama.cpp,llama.cpp-Q4_K_M,llama.cpp-Q4_0",
                         "--out", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "compare.json").read_text())
    rows = {r["runtime"]: r for r in report["results"]}
    assert rows["cpullm-q4"]["decode_tps"] > 0 and "kl" not in rows["cpullm-q4"] and "kl" not in report
    assert cli.main([str(llama32_checkpoint), "--skip", "cpullm-q8", "--out", str(tmp_path)]) == 2
    assert cli.main([str(llama32_checkpoint), "--four-bit", "--kl-prompts", "6", "--out", str(tmp_path)]) == 2


def test_four_bit_ratios_pair_each_runtime_with_its_llama_cpp_counterpart():
    by = {n: {"runtime": n, "prefill_tps": p, "decode_tps": d, "decode_tps_at_512": d}
          for n, p, d in (("cpullm-q4", 300.0, 30.0), ("cpullm-gguf", 200.0, 24.0),
                          ("llama.cpp-Q4_K_M", 100.0, 20.0), ("llama.cpp-Q4_0", 100.0, 10.0))}
    rat = reporting._ratios(by)
    assert set(rat) == {"cpullm-q4 / llama.cpp-Q4_K_M", "cpullm-gguf / llama.cpp-Q4_K_M"}
    assert rat["cpullm-q4 / llama.cpp-Q4_K_M"] == {"prefill": 3.0, "decode": 1.5, "decode_at_512": 1.5}
    assert rat["cpullm-gguf / llama.cpp-Q4_K_M"]["decode"] == pytest.approx(1.2)
    assert paired.ratio_pairs(["cpullm-q4", "llama.cpp-Q4_0"]) == []


def test_compare_four_bit_with_llama_cpp(llama32_checkpoint, tmp_path):
    """The four 4-bit runtimes on llama.cpp's own Q4_K_M and Q4_0 of the checkpoint, the KL pass,
    and paired decode over all of them."""
    pytest.importorskip("llama_cpp", reason=LLAMA_CPP_REASON)
    import gguf

    code = cli.main([str(llama32_checkpoint), "--four-bit", "--kl-tokens", "4", "--prompt-tokens", "16",
                         "--gen-tokens", "3", "--context-tokens", "32", "--repeat", "1", "--threads", "1",
                         "--skip", "transformers", "--paired", "1", "--out", str(tmp_path / "out"),
                         "--work-dir", str(tmp_path / "work")])
    assert code == 0
    work = tmp_path / "work"
    files = {ft: list(work.glob(f"*.{ft}.gguf")) for ft in ("Q8_0", "Q4_K_M", "Q4_0")}
    assert all(len(f) == 1 for f in files.values()) and not list(work.glob("*.partial")) \
        and not list(work.glob("*.tmp"))
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(files["Q4_0"][0])).tensors}
    assert types["blk.0.ffn_gate.weight"] == gguf.GGMLQuantizationType.Q4_0
    report = json.loads((tmp_path / "out" / "compare.json").read_text())
    rows = {r["runtime"]: r for r in report["results"]}
    for name in ("cpullm", "llama.cpp") + workers.FOUR_BIT:
        assert rows[name]["decode_tps"] > 0 and rows[name]["decode_weight_bytes"] > 0 and _kl_ok(rows[name]), name
    assert rows["llama.cpp-Q4_K_M"]["weights"].startswith("Q4_K_M") and rows["llama.cpp-Q4_0"]["weights"].startswith("Q4_0")
    assert rows["cpullm-gguf"]["gguf"] == rows["llama.cpp-Q4_K_M"]["gguf"] == str(files["Q4_K_M"][0])
    # the same file: the bytes cpullm's decode reads are the bytes llama.cpp's reads (norms aside)
    assert 0.9 < rows["cpullm-gguf"]["decode_weight_bytes"] / rows["llama.cpp-Q4_K_M"]["decode_weight_bytes"] < 1.1
    for name in ("llama.cpp-Q4_K_M", "llama.cpp-Q4_0"):
        assert rows[name]["decode_weight_bytes"] < rows["llama.cpp"]["decode_weight_bytes"]
    for label in ("cpullm / llama.cpp", "cpullm-q4 / llama.cpp-Q4_K_M", "cpullm-gguf / llama.cpp-Q4_K_M"):
        assert report["ratios"][label]["prefill"] > 0 and report["ratios"][label]["decode"] > 0
        assert len(report["paired"]["ratios"][label]["decode"]) == 1
    md = (tmp_path / "out" / "compare.md").read_text()
    assert "| cpullm-q4 / llama.cpp-Q4_K_M |" in md and "| cpullm-gguf / llama.cpp-Q4_K_M |" in md
    assert "Paired decode (1 turns)" in md


def test_busy_flag_uses_the_measured_cpu_time_before_the_run():
    m = {"logical_cpus": 2}
    assert reporting._busy({"cpu_busy_before": 0.6, "loadavg_before": 0.0, "machine": m})
    assert not reporting._busy({"cpu_busy_before": 0.05, "loadavg_before": 1.5, "machine": m})  # a run that just ended
    assert reporting._busy({"cpu_busy_before": None, "loadavg_before": 1.5, "machine": m})      # no /proc/stat
    from cpullm.bench import cpu_busy
    busy = cpu_busy(0.2)
    assert busy is None or 0.0 <= busy <= 1.0


def test_rounds_take_medians_and_keep_every_rounds_ratio():
    runs = [{"runtime": "cpullm", "prefill_tps": p, "decode_tps": d, "decode_tps_at_512": d, "ttft_s": 0.1,
             "load_s": 1.0, "weights": "int8"} for p, d in ((100.0, 10.0), (300.0, 30.0), (200.0, 50.0))]
    row = reporting.merge_rounds(runs + [{"runtime": "cpullm", "error": "exit 1: boom"}])
    assert row["prefill_tps"] == 200.0 and row["decode_tps"] == 30.0 and row["weights"] == "int8"
    assert row["rounds"]["decode_tps"] == [10.0, 30.0, 50.0]
    assert row["rounds_ok"] == 3 and row["rounds_failed"] == 1
    assert reporting.merge_rounds([{"runtime": "x", "error": "e"}])["error"] == "e"
    assert "rounds" not in reporting.merge_rounds(runs[:1])                   # one round: as it was
    llama = [{"runtime": "llama.cpp", "prefill_tps": 100.0, "decode_tps": 20.0, "decode_tps_at_512": 25.0}]
    per = [reporting._ratios({"cpullm": runs[i], "llama.cpp": llama[0]}) for i in range(3)]
    assert [r["cpullm / llama.cpp"]["decode"] for r in per] == [0.5, 1.5, 2.5]
    lines = "\n".join(reporting._round_lines({"round_ratios": per}))
    assert "| 2 | 3.00x | 1.50x | 1.20x |" in lines
    assert "| min | 1.00x | 0.50x | 0.40x |" in lines and "| max | 3.00x | 2.50x | 2.00x |" in lines


def test_compare_rounds_run_every_runtime_again(checkpoint, tmp_path, monkeypatch):
    calls = []
    real = workers.run_worker

    def counted(name, spec, workdir, timeout):
        calls.append(name)
        return real(name, spec, workdir, timeout)
    monkeypatch.setattr(workers, "run_worker", counted)
    code = cli.main([str(checkpoint), "--prompt-tokens", "16", "--gen-tokens", "3",
                         "--context-tokens", "32", "--repeat", "1", "--threads", "1", "--rounds", "2",
                         "--skip", "llama.cpp,transformers", "--out", str(tmp_path), "--paired", "1"])
    assert code == 0 and calls == ["cpullm", "cpullm"]
    report = json.loads((tmp_path / "compare.json").read_text())
    row = report["results"][0]
    assert len(row["rounds"]["decode_tps"]) == 2 and row["decode_tps"] == pytest.approx(
        float(np.median(row["rounds"]["decode_tps"])))
    assert report["settings"]["rounds"] == 2
    assert "median over 2 rounds" in (tmp_path / "compare.md").read_text()
    assert "Paired decode: not run (it needs both runtimes of a ratio: cpullm and llama.cpp" in (
        tmp_path / "compare.md").read_text()
    assert cli.main([str(checkpoint), "--rounds", "0", "--out", str(tmp_path)]) == 2
    assert cli.main([str(checkpoint), "--paired", "-1", "--out", str(tmp_path)]) == 2


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
    res = workers.worker("cpullm", spec)
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
    pd = paired.paired_decode(["cpullm", "llama.cpp"], {}, tmp_path, 2, 0, say=lambda m: None,
                               start=lambda n, spec, wd: _FakeRuntime(n, spec, wd, speeds[n]))
    assert _FakeRuntime.asked == [("cpullm", "decode"), ("llama.cpp", "decode"),
                                  ("cpullm", "decode_at_512"), ("llama.cpp", "decode_at_512"),
                                  ("llama.cpp", "decode"), ("cpullm", "decode"),
                                  ("llama.cpp", "decode_at_512"), ("cpullm", "decode_at_512")]
    assert pd["ratios"]["cpullm / llama.cpp"] == {"decode": [2.0, 2.0], "decode_at_512": [2.0, 2.0]}
    assert pd["tps"]["cpullm"]["decode"] == [60.0, 30.0] and pd["read_gbps"]["decode"] == [30.0, 30.0]
    report = {"paired": pd, "settings": {"gen_tokens": 8, "context_tokens": 32}}
    md = "\n".join(reporting._paired_lines(report))
    assert "| cpullm / llama.cpp | 2.00x | 2.00x | 2.00x | 2.00x | 2.00x | 2.00x |" in md
    assert "| 2 | 30.0 / 30.0 | 30.0 / 25.0 | 15.0 / 12.5 | 2.00x / 2.00x |" in md
    assert "| cpullm | 45.0 | 37.5 |" in md                  # medians over the turns
    # a runtime that stops is reported, not raised
    def broken(n, spec, wd):
        raise RuntimeError(f"{n} stopped (exit 1): boom")
    pd = paired.paired_decode(["cpullm", "llama.cpp"], {}, tmp_path, 2, 0, say=lambda m: None, start=broken)
    assert pd == {"error": "cpullm stopped (exit 1): boom"}
    assert "not run (cpullm stopped" in "\n".join(reporting._paired_lines({"paired": pd}))


def test_serve_times_runs_on_command(checkpoint, tmp_path):
    import io
    spec = {"model_dir": str(checkpoint), "ids": IDS[:8], "context_ids": IDS[:16], "gen_tokens": 2,
            "context_tokens": 16, "repeat": 1, "threads": 1, "quant": "int8", "gguf": None}
    out = io.StringIO()
    paired.serve("cpullm", spec, stdin=io.StringIO("decode\ndecode_at_512\nquit\ndecode\n"), stdout=out)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith(paired.READY_TAG) and json.loads(lines[0][len(paired.READY_TAG):])["load_s"] > 0
    res = [json.loads(ln[len(workers.RESULT_TAG):]) for ln in lines[1:]]
    assert [r["kind"] for r in res] == ["decode", "decode_at_512"]          # nothing after quit
    assert all(r["tps"] > 0 and r["read_gbps"] > 0 for r in res)


def test_a_served_runtime_that_fails_to_load_names_its_error(tmp_path):
    spec = {"model_dir": str(tmp_path / "missing"), "ids": IDS[:8], "gen_tokens": 2, "context_tokens": 16,
            "repeat": 1, "threads": 1, "quant": "int8", "gguf": None}
    pd = paired.paired_decode(["cpullm", "llama.cpp"], spec, tmp_path, 1, 60, say=lambda m: None)
    assert pd["error"].startswith("cpullm stopped (exit 1)") and "missing" in pd["error"]


# ---- llama.cpp's own converter (architectures cpullm's GGUF writer has no table for) ---------------
def test_llama_cpp_converter_makes_the_q8_0_of_a_gemma2_checkpoint(tmp_path, request):
    """Gemma 2 has no GGUF table in the plugins: ensure_q8_gguf takes llama.cpp's convert_hf_to_gguf.py
    (its vocabulary step rejects the byte-level test tokenizer: tokenizer.json's vocabulary is used),
    then llama_model_quantize; llama.cpp runs the file (sliding window of 8, soft-capping, query
    scale 24 != head_dim 32) and its logits are cpullm f32's within Q8_0 rounding."""
    llama_cpp = pytest.importorskip("llama_cpp", reason=LLAMA_CPP_REASON)
    pytest.importorskip("torch", reason="llama.cpp's convert_hf_to_gguf.py needs torch (pip install 'cpullm[bench]')")
    pytest.importorskip("transformers", reason="llama.cpp's convert_hf_to_gguf.py needs transformers")
    import gguf

    import cpullm
    from cpullm_gemma.tiny_configs import GEMMA2

    llama_ckpt = make_random_checkpoint(dict(LLAMA), tmp_path / "llama", seed=5)
    ckpt = make_random_checkpoint(dict(GEMMA2), tmp_path / "gemma2", seed=5)
    assert llama_convert.writer_has_table(llama_ckpt) and not llama_convert.writer_has_table(ckpt)
    cached = request.config.cache.mkdir("llama-cpp-converter")   # fetched (~77 MB) once, in .pytest_cache
    try:
        src = llama_convert.llama_cpp_converter(cached, say=lambda msg: None)
    except SystemExit as exc:
        pytest.skip(f"llama.cpp's converter source (llama-cpp-python's sdist) could not be fetched: {exc}")
    work = tmp_path / "work"
    work.mkdir()
    (work / src.name).symlink_to(src, target_is_directory=True)
    said = []
    q8 = llama_convert.ensure_q8_gguf(ckpt, work, 1, say=said.append)
    assert q8.name.endswith("-hfconv.Q8_0.gguf") and not list(work.glob("*.partial"))
    assert any("written from tokenizer.json" in m for m in said), said
    r = gguf.GGUFReader(str(q8))
    assert r.fields["general.architecture"].contents() == "gemma2"
    types = {t.name: t.tensor_type for t in r.tensors}
    assert types["blk.0.ffn_down.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert len(r.fields["tokenizer.ggml.tokens"].data) == GEMMA2["vocab_size"]
    llm = llama_cpp.Llama(model_path=str(q8), n_ctx=64, n_threads=1, n_threads_batch=1, logits_all=True,
                          verbose=False)
    llm.eval(IDS)
    got = np.asarray(llm.scores[: len(IDS)], np.float32)
    ref = cpullm.load(ckpt, quant="f32", use_cache=False).logits(IDS)
    fid = reporting._fidelity(got[-1], ref[-1])
    assert fid["cosine"] > 0.99 and fid["same_top1"], fid
    assert llama_convert.gguf_source(ckpt).startswith("llama.cpp's convert_hf_to_gguf.py")


def test_llama_cpp_converter_and_cpullm_writer_give_the_same_q8_0(tmp_path, request):
    """--llama-convert on an architecture both know: the Q8_0 tensors of llama.cpp's converter (BF16
    out) and of cpullm's writer (F32 out) are bit-identical (llama3 rope factors included)."""
    pytest.importorskip("llama_cpp", reason=LLAMA_CPP_REASON)
    pytest.importorskip("torch", reason="llama.cpp's convert_hf_to_gguf.py needs torch (pip install 'cpullm[bench]')")
    pytest.importorskip("transformers", reason="llama.cpp's convert_hf_to_gguf.py needs transformers")
    import gguf

    ckpt = make_random_checkpoint(dict(LLAMA),
                                  tmp_path / "llama", seed=5)
    try:
        src = llama_convert.llama_cpp_converter(request.config.cache.mkdir("llama-cpp-converter"), say=lambda msg: None)
    except SystemExit as exc:
        pytest.skip(f"llama.cpp's converter source (llama-cpp-python's sdist) could not be fetched: {exc}")
    work = tmp_path / "work"
    work.mkdir()
    (work / src.name).symlink_to(src, target_is_directory=True)
    files = {way: llama_convert.ensure_q8_gguf(ckpt, work, 1, say=lambda msg: None, llama_convert=way)
             for way in (True, False)}
    assert files[True] != files[False]
    tensors = {way: {t.name: t for t in gguf.GGUFReader(str(f)).tensors} for way, f in files.items()}
    assert set(tensors[True]) == set(tensors[False]) and "rope_freqs.weight" in tensors[True]
    for name, t in tensors[True].items():
        w = tensors[False][name]
        assert t.tensor_type == w.tensor_type, name
        np.testing.assert_array_equal(np.asarray(t.data), np.asarray(w.data), err_msg=name)
