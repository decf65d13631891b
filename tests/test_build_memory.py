"""Building a program streams: peak memory is the final program plus a bounded working set.

A child process loads a scaled-down synthetic Qwen3-1.7B (benchmarks/synth.py, /4 widths: a
151936 x 512 embedding, 2 layers; its lm_head is large enough for the greedy screen, so the
screen's append is in the build) with an empty execution cache, then again with the filled one;
each reports its RSS before the load (imports done) and its peak, in INT8 and in q4. The streamed
build peaks at about 1.3x the program's bytes over the imports; before streaming it peaked at about 4.5x
(every packed part, their concatenation, the float32 copy of the largest matrix and the whole
mapped bf16 checkpoint at once). Row-block packing and file-backed blobs give the same bytes as
the in-memory build.
"""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cpullm
from cpullm.compile import compiler
from cpullm.loading import plugins
from cpullm.graph.ir import GraphBuilder
from cpullm.loading.tensors import TensorStore
from cpullm.testing import make_random_checkpoint

ROOT = Path(__file__).resolve().parents[1]
MB = 1 << 20

_CHILD = r"""
import json, sys
spec = json.loads(sys.argv[1])
import numpy, numba
import cpullm
from cpullm_kernels.program import interpreter    # imports before the baseline
from cpullm_kernels.rows import q8    # imports before the baseline
from cpullm_kernels.panels import head_screen    # imports before the baseline
from cpullm.run.memory import current_rss_bytes, peak_rss_bytes
with open("/proc/self/clear_refs", "w") as fh:              # reset VmHWM: the peak of the load alone
    fh.write("5")
before = current_rss_bytes()
m = cpullm.load(spec["model"], cache_dir=spec["cache"], threads=1, n_ctx=spec["n_ctx"], quant=spec["quant"])
mem = m.info()["memory"]
print("RESULT " + json.dumps({"cache": m.cache_status, "before": before, "peak": peak_rss_bytes(),
      "weights": mem["weights_bytes"], "kv": mem["kv_bytes_max"], "arena": mem["arena_bytes"],
      "program": mem["program_bytes"], "screen": "head_screen" in m.program.meta}))
"""


def _child_load(model_dir, cache_dir, n_ctx=512, quant="int8") -> dict:
    spec = {"model": str(model_dir), "cache": str(cache_dir), "n_ctx": n_ctx, "quant": quant}
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(spec)], capture_output=True,
                          text=True, timeout=600, env={**__import__("os").environ, "CPULLM_QUIET": "1"})
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stderr[-2000:]
    return json.loads(line.split(" ", 1)[1])


@pytest.fixture(scope="module")
def synth_qwen3(tmp_path_factory):
    pytest.importorskip("transformers", reason="benchmarks/synth.py plans tensors with transformers")
    spec = importlib.util.spec_from_file_location("cpullm_bench_synth", ROOT / "benchmarks" / "synth.py")
    synth = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(synth)
    d = tmp_path_factory.mktemp("buildmem") / "qwen3-1.7b-s4"
    synth.write_checkpoint("qwen3-1.7b", d, scale=4, seed=1, progress=False)
    return d


# working set a build may hold over its program, here: int8, one 64 MB row block of float32 and the
# screen's temporaries; q4, a 16 MB row block and its quantizer's temporaries (2-7x its input)
BUILD_ALLOWANCE = {"int8": 96 * MB, "q4": 192 * MB}


@pytest.mark.reference
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc (VmHWM reset)")
@pytest.mark.parametrize("quant", ["int8", "q4"])
def test_build_and_cached_load_peak_within_the_bounds(synth_qwen3, tmp_path, quant):
    # what any load costs over the imports whatever its weights (numba's compiled kernels loaded
    # from its cache, llvmlite, the tokenizer): a model of 0.1 MB, loaded cached
    tiny = make_random_checkpoint(LLAMA, tmp_path / "tiny", seed=1)
    _child_load(tiny, tmp_path / "c0")
    base = _child_load(tiny, tmp_path / "c0")
    runtime = base["peak"] - base["before"]
    miss = _child_load(synth_qwen3, tmp_path / "c1", quant=quant)
    hit = _child_load(synth_qwen3, tmp_path / "c1", quant=quant)
    assert miss["cache"].startswith("MISS") and hit["cache"] == "HIT"
    assert miss["screen"] == (quant == "int8")           # q4's Q6_K lm_head, 61 MiB, is below a screen's size
    w = miss["weights"] + miss["program"]
    assert w > 100 * MB                                  # big enough that the old 4.5x would show
    build = miss["peak"] - miss["before"] - runtime
    cached = hit["peak"] - hit["before"] - runtime
    print(f"\nruntime +{runtime / MB:.0f} MB; program {w / MB:.0f} MB: build +{build / MB:.0f} MB "
          f"({build / w:.2f}x), cached load +{cached / MB:.0f} MB ({cached / w:.2f}x) over the runtime")
    # the bounds cpullm promises: the build at most 1.3x the program + 512 MB of working set, here held to
    # BUILD_ALLOWANCE; a cached load within 1.1x of weights + KV + arena, plus this model's
    # tokenizer (a 151936-token vocabulary: ~25 MB, which the 0.1 MB model's byte-level tokenizer
    # does not have). Before q4 packed row blocks its build peaked at 4.0x a 1.24B model's weights.
    assert build <= 1.3 * w + BUILD_ALLOWANCE[quant], (build, w)
    assert miss["peak"] - miss["before"] <= 1.3 * w + 512 * MB
    assert cached <= 1.1 * (w + hit["kv"] + hit["arena"]) + 32 * MB, (cached, w)


# ---- the streamed build writes the same program ------------------------------------------------------
LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=300, rms_norm_eps=1e-5,
             max_position_embeddings=512, tie_word_embeddings=True, rope_theta=10000.0)


def _compile(model_dir, **kw):
    from cpullm.loading.family import read_config
    config = read_config(model_dir)
    family = plugins.discover().family_for(config)
    args = family.args(config)
    weights = family.weight_map(args).resolve(TensorStore(model_dir), args)
    graph = family.build_graph(args, GraphBuilder())
    return compiler.compile_graph(graph, weights, n_ctx=64, **kw)


# hidden and intermediate sizes that q4 stores as whole 256-blocks (Q4_K, Q6_K); LLAMA's 64 take Q5_0 / Q8_0
LLAMA_256 = dict(LLAMA, hidden_size=256, intermediate_size=512)


@pytest.mark.parametrize("quant,config", [("int8", LLAMA), ("q4", LLAMA), ("q4", LLAMA_256)])
def test_row_blocks_into_files_give_the_in_memory_program(tmp_path, monkeypatch, quant, config):
    d = make_random_checkpoint(config, tmp_path / "m", seed=2)
    whole = _compile(d, quant=quant)
    K = config["hidden_size"]
    monkeypatch.setattr(compiler, "ROW_BLOCK_FLOATS", K * 7)      # 7 rows a block: ragged last block
    monkeypatch.setattr(compiler, "Q4_ROW_BLOCK_FLOATS", K * 7)
    work = tmp_path / "work"
    work.mkdir()
    streamed = _compile(d, workdir=work, quant=quant)
    if quant == "q4":               # the raw-block formats q4 stores here, each packed 7 rows at a time
        assert set(streamed.meta["block_bytes"]) == ({"Q4_K", "Q6_K"} if K % 256 == 0 else {"Q5_0", "Q8_0"})
    from cpullm.compile.filearrays import backing_path
    for name in ("wq", "ws", "wf"):
        assert backing_path(streamed.arrays[name]) == str(work / f"{name}.bin")
        assert not streamed.arrays[name].flags.writeable
        np.testing.assert_array_equal(streamed.arrays[name], whole.arrays[name])
    np.testing.assert_array_equal(streamed.I, whole.I)
    assert streamed.meta == whole.meta


def test_screen_appended_to_files_equals_concatenated(tmp_path, monkeypatch):
    from cpullm.compile import head_screen
    from cpullm_kernels.panels import head_screen as screen_kernels
    monkeypatch.setattr(screen_kernels, "MIN_LM_HEAD_BYTES", 0)   # a screen for this tiny head
    d = make_random_checkpoint(LLAMA, tmp_path / "m", seed=4)
    work = tmp_path / "work"
    work.mkdir()
    mem = head_screen.attach(_compile(d))
    streamed = head_screen.attach(_compile(d, workdir=work))
    assert mem.meta["head_screen"] == streamed.meta["head_screen"]
    for name in ("wq", "ws", "wf"):
        np.testing.assert_array_equal(streamed.arrays[name], mem.arrays[name])


def test_a_miss_runs_the_same_logits_as_a_hit(tmp_path):
    d = make_random_checkpoint(LLAMA, tmp_path / "m", seed=6)
    ids = [1, 5, 77, 200, 3]
    miss = cpullm.load(d, cache_dir=tmp_path / "c")
    hit = cpullm.load(d, cache_dir=tmp_path / "c")
    off = cpullm.load(d, use_cache=False)
    assert miss.cache_status.startswith("MISS") and hit.cache_status == "HIT"
    assert not list((tmp_path / "c" / "exec").glob(".tmp.*"))      # the build's directory became the entry
    np.testing.assert_array_equal(miss.logits(ids), hit.logits(ids))
    np.testing.assert_array_equal(miss.logits(ids), off.logits(ids))


def test_sweep_keeps_a_long_build_that_is_still_writing(tmp_path):
    """A build writes into its temporary entry directory for as long as it packs; the sweep of
    another process removes it only once nothing in it was written for an hour."""
    import os
    import time

    from cpullm.compile import cache_format
    old = time.time() - 2 * 3600
    live = tmp_path / f".tmp.k1.otherhost.{os.getpid()}.aaaa"     # another host: liveness unknown
    stale = tmp_path / f".tmp.k2.otherhost.{os.getpid()}.bbbb"
    for d in (live, stale):
        d.mkdir()
        (d / "wq.bin").write_bytes(b"x")
        os.utime(d, (old, old))
    os.utime(stale / "wq.bin", (old, old))                         # live's wq.bin was just written
    assert cache_format.sweep(tmp_path) == 1
    assert live.exists() and not stale.exists()
