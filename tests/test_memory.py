"""The memory report against the real arrays; --mlock (kept resident, or a clear warning when the
system limit refuses); --mmap / --no-mmap give identical logits."""
import ctypes
import json
import os
import resource
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import cpullm
from cpullm.cli import main
from cpullm_kernels.attention.attention import padded_cap
from cpullm_kernels.attention.gated_delta import state_size
from test_cache_family import (HYBRID, WINDOW, _hybrid_registered, hybrid_dir,  # noqa: F401
                               llama_dir)

IDS = [int(t) for t in np.random.default_rng(3).integers(0, 256, 20)]


@pytest.mark.parametrize("max_chunk,kv_dtype", [(512, None), (8, "f32"), (8, "q8_0")])   # None: int8's default, f16
def test_memory_report_matches_the_arrays(hybrid_dir, tmp_path, max_chunk, kv_dtype):
    n_ctx = 64
    m = cpullm.load(hybrid_dir, n_ctx=n_ctx, max_chunk=max_chunk, cache_dir=tmp_path, kv_dtype=kv_dtype)
    ex, a = m.executor, m.program.arrays
    rep = m.info()["memory"]
    # bytes a position of one KV head takes (keys and values; q8_0: int8 with a float32 scale per 32 values)
    row = {None: 2 * 2 * HYBRID["head_dim"], "f32": 2 * 4 * HYBRID["head_dim"],
           "q8_0": 2 * (HYBRID["head_dim"] + 4 * -(-HYBRID["head_dim"] // 32))}[kv_dtype]
    assert m.info()["kv_dtype"] == rep["kv_dtype"] == m.info()["context_plan"]["kv_dtype"] == (kv_dtype or "f16")
    assert rep["weights_bytes"] == a["wq"].nbytes + a["ws"].nbytes + a["wf"].nbytes
    assert rep["program_bytes"] == a["I"].nbytes + a["F"].nbytes
    assert rep["arena_bytes"] == ex.arena.nbytes and rep["state_bytes"] == m.slot.state.nbytes
    assert rep["kv_bytes"] == 0 and rep["n_past"] == 0

    # per layer, from the model's own description: 4 layers, head_dim 8, 2 KV heads
    kinds = HYBRID["layer_kinds"]
    nkv, hd = HYBRID["num_key_value_heads"], HYBRID["head_dim"]
    cap = {"full": padded_cap(n_ctx), "window": padded_cap(min(n_ctx, WINDOW + max_chunk))}   # whole key tiles
    lin = 4 * state_size(HYBRID["lin_k_heads"], HYBRID["lin_k_dim"], HYBRID["lin_v_heads"],
                         HYBRID["lin_v_dim"], HYBRID["conv_kernel"])
    expect = [nkv * cap[k] * row if k != "linear" else lin for k in kinds]
    assert [x["bytes"] for x in rep["layers"]] == expect
    assert [x["kind"] for x in rep["layers"]] == ["full_attention", "sliding_window",
                                                  "linear_attention", "sliding_window"]
    regions = m.program.meta["state_regions"]
    assert [m.slot.region(r).nbytes for r in regions] == expect   # the real views
    assert rep["kv_bytes_max"] == sum(e for e, k in zip(expect, kinds) if k != "linear")
    assert rep["linear_state_bytes"] == lin
    assert sum(expect) <= rep["state_bytes"] < sum(expect) + 64 * 4 * len(expect) + 64

    list(m.generate_ids(IDS, 5, ignore_eos=True))
    rep = m.info()["memory"]
    n = len(IDS) + 4                                   # the last sampled token is not run
    assert rep["n_past"] == m.slot.position == n
    now = [nkv * min(n, cap[k]) * row if k != "linear" else lin for k in kinds]
    assert [x["bytes_now"] for x in rep["layers"]] == now
    assert rep["kv_bytes"] == sum(x for x, k in zip(now, kinds) if k != "linear")
    assert rep["total_bytes"] == (rep["weights_bytes"] + rep["program_bytes"] + rep["state_bytes"]
                                  + rep["arena_bytes"])
    assert rep["peak_rss_bytes"] >= rep["rss_bytes"] > rep["total_bytes"]
    json.dumps(rep)                                    # JSON-able for `bench --json`


def test_mlock_keeps_weights_resident(llama_dir, tmp_path):
    m = cpullm.load(llama_dir, mlock=True, cache_dir=tmp_path)
    rep = m.info()["memory"]
    if rep["locked_bytes"] == 0 and not os.path.exists("/proc/self/status"):
        pytest.skip("VmLck is not reported on this system")
    assert rep["locked_bytes"] >= rep["weights_bytes"] + rep["program_bytes"]


def _limit_memlock():
    """Runs in the child before exec: RLIMIT_MEMLOCK 0, and (as root) no CAP_IPC_LOCK, which
    would bypass the limit: dropping it from the bounding set removes it from the exec'd child."""
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (0, 0))
    if os.geteuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(24, 14, 0, 0, 0)                    # PR_CAPBSET_DROP, CAP_IPC_LOCK


def test_mlock_refused_warns_and_runs(llama_dir, tmp_path):
    code = textwrap.dedent("""
        import sys, cpullm
        m = cpullm.load(sys.argv[1], mlock=True, cache_dir=sys.argv[2])
        print(float(m.logits([1, 2, 3])[-1].sum()), m.info()["memory"]["locked_bytes"])
    """)
    env = dict(os.environ, CPULLM_QUIET="0")
    p = subprocess.run([sys.executable, "-c", code, str(llama_dir), str(tmp_path)], env=env,
                       preexec_fn=_limit_memlock, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = [line for line in p.stderr.splitlines() if "mlock" in line]
    assert len(lines) == 1, p.stderr
    assert "refused to lock" in lines[0] and "ulimit -l" in lines[0] and "without --mlock" in lines[0]
    assert p.stdout.split()[1] == "0"                   # nothing left half locked
    ref = cpullm.load(llama_dir, cache_dir=tmp_path).logits([1, 2, 3])[-1].sum()
    assert float(p.stdout.split()[0]) == float(ref)


def test_cli_mmap_and_no_mmap_identical(llama_dir, tmp_path, capsys):
    base = ["run", str(llama_dir), "-p", "Hello there", "-n", "6", "--json", "--cache-dir", str(tmp_path)]
    outs = []
    for extra in ([], ["--mmap"], ["--no-mmap"], ["--no-mmap", "--mlock"]):
        assert main(base + extra) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert len({o["text"] for o in outs}) == 1
    assert [o["cache"] for o in outs] == ["MISS (no entry)", "HIT", "HIT", "HIT"]
    mapped = cpullm.load(llama_dir, cache_dir=tmp_path, mmap=True)
    read = cpullm.load(llama_dir, cache_dir=tmp_path, mmap=False)
    assert mapped.info()["memory"]["weights_mapped"] and not read.info()["memory"]["weights_mapped"]
    assert np.array_equal(mapped.logits(IDS), read.logits(IDS))
    # the default maps the program (fast start); --no-mmap reads it into private memory
    assert cpullm.load(llama_dir, cache_dir=tmp_path).info()["memory"]["weights_mapped"]
