"""The first run: kernels compiled up front (only those the model needs, one signature each, in
two processes), the progress line, compile time kept out of the prefill rate; plus the checks a
first run meets early (chat template), the parameter count, and bench's child process started
from a folder holding a ``cpullm/`` directory."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import numba
import pytest

from cpullm_kernels.setup import warmup
from cpullm.testing import make_random_checkpoint
from tiny_configs import LLAMA_UNTIED_BIAS, SMOLLM2_LIKE

LLAMA_OPS = {"EMBED", "RMSNORM", "LINEAR", "ROPE", "ATTENTION", "GLU", "ADD", "SELECT_ROWS"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_random_checkpoint(dict(SMOLLM2_LIKE, model_type="llama"), tmp_path_factory.mktemp("tiny"))


# ---- which kernels, where ------------------------------------------------------------------------------
def test_units_follow_the_graph_ops():
    units = warmup.units_for(LLAMA_OPS, "int8", linear_state=False)
    assert "gated_delta" not in units and units[-1] == "run"
    hybrid = warmup.units_for(LLAMA_OPS | {"GATED_DELTA", "SIGMOID_MUL"}, "int8", linear_state=True)
    assert "gated_delta" in hybrid and hybrid[-1] == "run+linear_state"
    assert "layernorm" not in units and warmup.units_for(LLAMA_OPS | {"LAYERNORM"}, "int8", False)[-1] == "run+layernorm"
    gguf = warmup.units_for(LLAMA_OPS, "gguf", False, q8_prefill=False, blocks=True, embed_blocks=False)
    assert gguf[-1] == "run+blocks+panels" and "embed_blocks" not in gguf and "gemm" not in gguf
    assert "gemm" not in warmup.units_for(LLAMA_OPS, "f32", linear_state=False)   # f32 prefill: sgemm
    # the KV format: only its own attention specialization (float32 caches: kv16 None)
    assert "attention" in units and "attention_f16" not in units
    f16 = warmup.units_for(LLAMA_OPS, "gguf", False, q8_prefill=False, blocks=True, embed_blocks=False, kv16=True)
    assert "attention_f16" in f16 and "attention" not in f16 and f16[-1] == "run+blocks+panels+kv16"
    q8 = warmup.units_for(LLAMA_OPS, "int8", False, kv16=2)                  # attention.KV_Q8
    assert "attention_q8" in q8 and not {"attention", "attention_f16"} & set(q8) and q8[-1] == "run+kv8"
    assert warmup._kernels("run+kv8")[0][1][-1] == warmup._kernels("attention_q8")[0][1][-1] == numba.types.int8
    # the Q4_K / Q6_K panel GEMM only for a program that may hold such panels
    q4 = warmup.units_for(LLAMA_OPS, "q4", False)                                        # default: as blocks
    assert {"kpanels_gemm", "blocks_panels"} <= set(q4) and "blocks" not in q4 and q4[-1] == "run+blocks+panels+embed_blocks"
    q4_1 = warmup.units_for(LLAMA_OPS, "gguf", False, q8_prefill=False, blocks=True, embed_blocks=False, panels=False)
    assert "kpanels_gemm" not in q4_1 and "blocks" in q4_1 and "blocks_panels" not in q4_1
    assert "kquant_gemm" in q4_1 and "kquant_gemm_q6k" not in q4_1 and "kquant_gemm_q6k" in q4
    assert q4_1[-1] == "run+blocks"
    # and the decode driver without the panel kernel: its operand None, as the executor passes it
    assert warmup._kernels("blocks")[-1][1][7] == numba.types.none != warmup._kernels("blocks_panels")[-1][1][7]
    # the block driver's specialization holds the q8 and f32 rows: no separate q8 driver beside it
    assert "linear" not in q4_1 and "linear" in warmup.units_for(LLAMA_OPS, "int8", False)
    assert "kpanels_gemm" not in warmup.units_for(LLAMA_OPS, "int8", False, panels=True)  # no blocks at all
    # the row kernels of the graph's ops only; the raw-block matvec of the program's formats only
    assert {"norm", "rope", "glu", "binary"} <= set(units)
    assert not {"act", "pos_embed", "unary", "layernorm"} & set(units)
    assert "act" in warmup.units_for(LLAMA_OPS | {"ACT"}, "int8", False)
    one = warmup.units_for(LLAMA_OPS, "gguf", False, q8_prefill=False, blocks=True, block_formats=["Q4_1"])
    assert [u for u in one if u.startswith("block_matvec")] == ["block_matvec_q4_1"]
    assert len([u for u in q4 if u.startswith("block_matvec")]) == 8          # formats not known: all
    assert not any(u.startswith("block_matvec") for u in units)


def test_split_gives_each_unit_to_one_process_and_keeps_groups_together():
    units = warmup.units_for(LLAMA_OPS | {"GATED_DELTA", "SOFTCAP", "LAYERNORM"}, "gguf", linear_state=True)
    assert {"gemm", "blocks_panels", "norm", "layernorm"} <= set(units) and "linear" not in units
    for locked in (True, False):
        mine, child = warmup.split(units, cache_locked=locked)
        assert sorted(mine + child) == sorted(u for u in units if not u.startswith("run"))
        assert not set(mine) & set(child)
        for a, b in (("blocks_panels", "gemm"), ("kquant_gemm", "kquant_gemm_q6k"), ("norm", "layernorm")):
            if a in units and b in units:                         # one group: their shared helpers once
                assert (a in mine) == (b in mine), (a, b, locked)
    # with the cache lock the prefill GEMMs (which interpreter.run does not call) go to the child,
    # after the units run links, so run compiles here while the child compiles them
    mine, child = warmup.split(units, cache_locked=True)
    assert {"gemm", "kquant_gemm"} <= set(child)
    linked = [warmup.called_by_run(u) for u in child]
    assert linked == sorted(linked, reverse=True)
    # without it the q8 and block helpers, which the load compiles too (weight quantizer, head
    # screen, GGUF dequantizer), stay in this process
    mine, child = warmup.split(units, cache_locked=False)
    assert {"gemm", "blocks_panels", "kquant_gemm", "act_q16", "act_q8"} <= set(mine)
    assert "attention" in child                    # the largest movable unit


def test_the_two_processes_share_what_is_left(monkeypatch):
    """Out of its own units, each side takes one from the back of the other's list (the costs
    are an estimate); a unit is handed out once; ``run`` compiles once the units it calls are.
    Only with numba's cache lock: without it two processes never compile the same helper at once."""
    monkeypatch.setattr(warmup.numba_cache_lock, "INSTALLED", True)
    w = warmup.Warmup([], parallel=False)
    w.mine, w.theirs = ["attention", "norm"], ["blocks", "kquant_gemm"]
    assert w._next_for_child() == "blocks" and w._next_here() == "attention" and w._next_here() == "norm"
    assert w._next_here() == "kquant_gemm"                      # taken from the back of the child's
    assert w._next_for_child() == "" and w._next_here() == "" and w.child_units == ["blocks"]
    w.mine, w.theirs, w.child_units = ["attention", "copy"], [], []
    assert w._next_for_child() == "copy" and w.child_units == ["copy"] and w.mine == ["attention"]
    monkeypatch.setattr(warmup.numba_cache_lock, "INSTALLED", False)
    assert w._next_for_child() == "" and w.mine == ["attention"]

    compiled = []                    # no child: this process compiles all, run after its callees
    monkeypatch.setattr(warmup, "compile_unit", compiled.append)
    monkeypatch.setattr(warmup, "unit_cached", lambda u: False)
    monkeypatch.setattr(warmup, "split", lambda todo: (["kquant_gemm", "norm"], ["q8_panels", "gemm"]))
    w = warmup.Warmup(["q8_panels", "gemm", "kquant_gemm", "norm", "run"], parallel=False).start()
    w.finish()
    assert sorted(compiled) == ["gemm", "kquant_gemm", "norm", "q8_panels", "run"]
    assert compiled.index("run") > max(compiled.index("q8_panels"), compiled.index("norm"))


def test_progress_line_only_on_a_terminal(monkeypatch):
    monkeypatch.delenv("CPULLM_QUIET", raising=False)      # (CPULLM_QUIET=1 silences it too)

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty, pipe = Tty(), io.StringIO()
    for stream in (tty, pipe):
        p = warmup._Progress(3, stream=stream)
        p.step()
        p.step(2)
        p.close()
    assert pipe.getvalue() == ""
    out = tty.getvalue()
    assert out.startswith("\rcpullm: compiling kernels 1/3 (first run only; cached afterwards)")
    assert out.endswith("\rcpullm: compiling kernels 3/3 (first run only; cached afterwards)\n")


_SIGNATURES = r"""
import json, sys
import cpullm
from cpullm_kernels.setup import warmup
from numba.core import event

compiled = []      # (phase, nested in another compile, "module.qualname", signature) of every numba compile


class Compiles(event.Listener):
    depth = 0

    def on_start(self, ev):
        Compiles.depth += 1

    def on_end(self, ev):
        Compiles.depth -= 1
        f = ev.data["dispatcher"].py_func
        compiled.append((phase, Compiles.depth > 0, f"{f.__module__}.{f.__qualname__}", str(tuple(ev.data["args"]))))


phase = "load"
event.register("numba:compile", Compiles())
m = cpullm.load(sys.argv[1], threads=1, n_ctx=128, cache_dir=sys.argv[2],
                quant=sys.argv[3] if len(sys.argv) > 3 else None)
phase = "run"
fwd = m.forward
for n in (9, 2, 1):                     # batched prefill (GEMM), a short prompt, one row
    slot = fwd.new_slot()
    fwd.step([slot], [int(fwd.prefill(slot, list(range(1, n + 1))).argmax())])
used = {}
for unit in list(warmup.UNITS) + ["run"]:
    for disp, sig in warmup._kernels(unit):
        used[f"{disp.py_func.__module__}.{disp.py_func.__qualname__}"] = [str(s) for s in disp.signatures]
want = {}
assert warmup.run_unit(warmup.run_flags(m.executor.I)) == m.kernel_units[-1]
for unit in m.kernel_units:
    for disp, sig in warmup._kernels(unit):
        want.setdefault(f"{disp.py_func.__module__}.{disp.py_func.__qualname__}", set()).add(str(tuple(sig)))
print(json.dumps({"used": used, "want": {k: sorted(v) for k, v in want.items()}, "compiled": compiled}))
"""


def used_kernel_signatures(model_path, cache_dir, quant: str | None = None) -> dict:
    """In a fresh process, after prefills and decodes of several lengths: {kernel: signatures it
    has}, having checked that nothing compiled after the load and that every unit kernel the load
    compiled on its own (not as a callee inside another kernel's compile, which depends on what
    numba's cache already held) has a signature of the warm-up's units (Model.kernel_units): a
    kernel run with another signature would compile on its first call."""
    args = [sys.executable, "-c", _SIGNATURES, str(model_path), str(cache_dir)] + ([quant] if quant else [])
    r = subprocess.run(args, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    used, want = out["used"], out["want"]
    assert [c for c in out["compiled"] if c[0] != "load"] == []
    for _, nested, name, sig in out["compiled"]:          # (used: every unit's kernels; the load's own
        assert nested or name not in used or sig in want.get(name, []), (name, sig)   # quantizers aside)
    for name, sigs in want.items():
        assert set(sigs) <= set(used[name]), name
    return used


@pytest.mark.parametrize("quant", ["int8", "q4"])
def test_the_executor_calls_each_kernel_with_the_warmed_signature_only(tiny, tmp_path, quant):
    """Every kernel runs with exactly the signature the warm-up compiled, and the gated-delta
    kernel (absent op) not at all."""
    used = used_kernel_signatures(tiny, tmp_path / "cache", quant)
    # (kernels keyed by module and name)
    assert used["cpullm_kernels.panels.q8_panels.panels_matvec"] != []     # decode's q8 head
    assert used["cpullm_kernels.attention.gated_delta.gated_delta"] == [] and used["cpullm_kernels.attention.attention.attention"] != []
    # rows of 144 weights: q4 stores Q5_0 / Q8_0 blocks, never Q4_K / Q6_K panels, so the panel
    # GEMM is neither warmed nor run
    assert used["cpullm_kernels.panels.kquant_panels.matmul"] == []



# ---- compile time apart from prefill ------------------------------------------------------------------
def test_compile_time_is_not_prefill_time(tiny, monkeypatch):
    """A compilation during prefill (simulated through the compile clock) counts as compile_s,
    not as prefill time."""
    import cpullm
    from cpullm.generate import generate, scheduler

    m = cpullm.load(tiny, threads=1, n_ctx=128)
    clock = {"t": 0.0}
    monkeypatch.setattr(scheduler, "compile_seconds", lambda: clock["t"])    # the clock generate's steps read
    real_prefill = m.forward.prefill

    def slow_compile_prefill(slot, ids, *a, **kw):
        import time
        time.sleep(0.2)
        clock["t"] += 0.2                              # all of that sleep was "compiling"
        return real_prefill(slot, ids, *a, **kw)

    monkeypatch.setattr(m.forward, "prefill", slow_compile_prefill)
    stats = generate.GenerationStats()
    list(m.generate_ids([1, 2, 3, 4], max_new_tokens=2, stats=stats))
    assert stats.compile_s == pytest.approx(0.2)
    assert stats.prefill_s < 0.2                       # the tiny model's prefill itself is quick


def test_run_stats_line_names_compile_time():
    from cpullm.cli.commands.run import compiled_note
    assert compiled_note(0.0) == ""
    assert compiled_note(21.26) == ", kernels compiled in 21.3 s (first run only)"


# ---- parameter count ------------------------------------------------------------------------------------
def _llama_params(a: dict, tied: bool) -> int:
    h, f, hd, V, L = (a["hidden_size"], a["intermediate_size"], a["head_dim"], a["vocab_size"],
                      a["num_hidden_layers"])
    q, kv = a["num_attention_heads"] * hd, a["num_key_value_heads"] * hd
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * f + 2 * h
    if a.get("attention_bias"):
        per_layer += q + 2 * kv + h
    return L * per_layer + V * h * (1 if tied else 2) + h


@pytest.mark.parametrize("cfg,tied", [(SMOLLM2_LIKE, True), (LLAMA_UNTIED_BIAS, False)])
def test_info_reports_the_parameter_count(cfg, tied, tmp_path):
    import cpullm
    d = make_random_checkpoint(dict(cfg, model_type="llama"), tmp_path / "m")
    m = cpullm.load(d, threads=1, n_ctx=64, cache_dir=tmp_path / "cache")
    assert m.info()["params"] == _llama_params(cfg, tied)
    again = cpullm.load(d, threads=1, n_ctx=64, cache_dir=tmp_path / "cache")     # a cache HIT too
    assert again.cache_status == "HIT" and again.info()["params"] == m.info()["params"]


@pytest.mark.reference
def test_parameter_count_matches_transformers(tmp_path):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import cpullm
    from hf_reference import save_tiny
    config = transformers.LlamaConfig(**SMOLLM2_LIKE)
    d = save_tiny(config, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_config(config)
    m = cpullm.load(d, threads=1, n_ctx=64, cache_dir=tmp_path / "cache")
    assert m.info()["params"] == hf.num_parameters()


# ---- run --chat refuses before loading ---------------------------------------------------------------------
def _no_load(*a, **k):
    raise AssertionError("the model was loaded (and its kernels compiled) before the chat check")


def test_run_chat_without_template_refuses_before_loading(tiny, tmp_path, monkeypatch, capsys):
    from cpullm.cli import main
    from cpullm.model import Model
    from test_chat_templates import GEMMA2
    base = tmp_path / "base"
    base.mkdir()
    for f in tiny.iterdir():
        if f.name != "tokenizer_config.json":
            os.symlink(f, base / f.name)
    (base / "tokenizer_config.json").write_text("{}")
    monkeypatch.setattr(Model, "load", classmethod(_no_load))
    assert main(["run", str(base), "-p", "hi", "--chat"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("cpullm: error: ") and "has no chat template" in err and "\n" not in err
    (base / "tokenizer_config.json").write_text(json.dumps({"chat_template": GEMMA2}))
    assert main(["run", str(base), "-p", "hi", "--chat", "--system", "Be brief."]) == 2
    assert "System role not supported" in capsys.readouterr().err


# ---- bench's child process and the working directory -----------------------------------------------------------
def test_bench_child_ignores_a_cpullm_folder_in_the_working_directory(tiny, tmp_path, monkeypatch):
    """Started from a clone's parent (a ``cpullm/`` folder without ``__init__``, which Python
    would import as a namespace package), the child still imports the installed package."""
    from cpullm.bench import startup
    parent = tmp_path / "parent"
    (parent / "cpullm" / "core").mkdir(parents=True)
    monkeypatch.chdir(parent)
    spec = {"model": str(tiny), "quant": "int8", "threads": 1, "n_ctx": 64,
            "cache_dir": str(tmp_path / "cache"), "ids": [1, 2, 3]}
    out = startup._child_load(spec)
    assert out["ready_s"] > 0 and out["first_token_s"] > 0 and out["cache"].startswith("MISS")


def test_warmup_child_ignores_a_cpullm_folder_in_the_working_directory(tmp_path):
    (tmp_path / "cpullm").mkdir()
    # the child asks for a unit, compiles it, reports it; an empty answer ends it
    r = subprocess.run([sys.executable, "-c", warmup._CHILD], cwd=tmp_path, input="copy\n\n",
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines() == ["next", "done copy", "next"]


@pytest.mark.cold
@pytest.mark.slow      # compiles every kernel of a small Llama with an empty numba cache (~1 min)
def test_cold_start_in_two_processes_then_nothing_to_compile(tiny, tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"), CPULLM_QUIET="1")
    code = ("import sys, json, cpullm; m = cpullm.load(sys.argv[1], threads=1, n_ctx=64, cache_dir=sys.argv[2]); "
            "print(json.dumps({'compile_s': m.compile_s}))")
    first = subprocess.run([sys.executable, "-c", code, str(tiny), str(tmp_path / "c")], env=env,
                           capture_output=True, text=True, timeout=1800)
    assert first.returncode == 0, first.stderr[-2000:]
    assert json.loads(first.stdout.splitlines()[-1])["compile_s"] > 0
    second = subprocess.run([sys.executable, "-c", code, str(tiny), str(tmp_path / "c")], env=env,
                            capture_output=True, text=True, timeout=600)
    assert json.loads(second.stdout.splitlines()[-1])["compile_s"] == 0.0


# ---- what a first run compiles, and when ---------------------------------------------------------------
_COMPILED_WHEN = r"""
import json, sys
import cpullm
from numba.core import event

compiled = []                                  # (phase, "module.qualname") of every numba compile


class Names(event.Listener):
    def on_start(self, ev):
        pass

    def on_end(self, ev):
        f = getattr(ev.data["dispatcher"], "py_func", None)
        compiled.append((phase, f"{f.__module__}.{f.__qualname__}" if f else "?"))


phase = "load"
event.register("numba:compile", Names())
m = cpullm.load(sys.argv[1], threads=1, n_ctx=64, cache_dir=sys.argv[2])
fwd = m.forward
phase = "first token"                          # prefill, its head, one lone decode step
slot = fwd.new_slot()
token = int(fwd.prefill(slot, [1, 5, 9, 17, 33, 65, 100, 7]).argmax())
fwd.step([slot], [token], greedy=[True])
phase = "batch"                                # the batched step (scheduler, speculation's verify)
a, b = fwd.slots(2)
fwd.prefill(a, [1, 5])
fwd.prefill(b, [9, 17, 33])
fwd.step([a, b], [7, 8])
print(json.dumps({"compiled": compiled, "units": m.kernel_units}))
"""


@pytest.mark.cold
@pytest.mark.slow      # compiles every kernel of a tiny Q4_1 GGUF with an empty numba cache (minutes)
def test_a_first_run_compiles_up_front_only_what_the_first_token_needs(tmp_path, monkeypatch):
    """From an empty numba cache, in one process (the event API sees every compile): the load
    compiles all the first token needs (nothing compiles during its prefill and decode step); the
    Q4_K / Q6_K panel kernels (prefill's and decode's), which a file of Q4_1 blocks never runs, are
    never compiled; the
    batched decode step is compiled only when first used."""
    pytest.importorskip("gguf")
    import numpy as np
    import test_convert as tc
    from test_gguf_run import SHAPES
    monkeypatch.setitem(tc.TINY_SHAPES, "llama", SHAPES["llama"])    # rows of whole blocks
    weights = {k: v * np.float32(0.25) if v.ndim == 2 else v
               for k, v in tc.tiny_hf_weights("llama", 2, len(tc.byte_level_vocab()[0]), 0, True).items()}
    path = tmp_path / "tiny-Q4_1.gguf"
    tc.write_tiny_gguf(path, "llama", qtype="Q4_1", tied=True, weights=weights)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"), CPULLM_COMPILE_PROCESSES="1", CPULLM_QUIET="1")
    r = subprocess.run([sys.executable, "-c", _COMPILED_WHEN, str(path), str(tmp_path / "c")], env=env,
                       capture_output=True, text=True, timeout=3600)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.splitlines()[-1])
    by_phase: dict = {}
    for phase, compiled in out["compiled"]:
        by_phase.setdefault(phase, set()).add(compiled)
    from cpullm.run import batch
    from cpullm_kernels.panels import kquant_panels
    from cpullm_kernels.program import interpreter
    from cpullm_kernels.tiles import kquant_gemm

    def name(dispatcher):                       # a renamed kernel fails here, not silently below
        f = dispatcher.py_func
        return f"{f.__module__}.{f.__qualname__}"
    assert "kpanels_gemm" not in out["units"] and "kquant_gemm" in out["units"]
    assert name(interpreter.run) in by_phase["load"]
    assert name(kquant_gemm.kquant_gemm_blocks) in by_phase["load"]
    assert by_phase.get("first token", set()) == set()
    everything = set().union(*by_phase.values())
    assert name(kquant_panels.quantize_rows_q8k) not in everything      # the panel GEMM's
    assert name(kquant_panels.matmul) not in everything                 # nor decode's panel kernel
    assert name(kquant_gemm.quantize_rows_i8) not in everything         # nor the Q6_K GEMM's quantizer
    assert "linear" not in out["units"] and "blocks" in out["units"]     # one LINEAR driver: the block one
    assert name(batch._fused) in by_phase["batch"] and name(batch._fused) not in by_phase["load"]
