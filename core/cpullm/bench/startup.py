"""Load, build and cold-start times, measured in child processes (fresh execution cache,
warm or empty numba cache)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


from .harness import BenchError


# ---- load and compile times in child processes ------------------------------------------------------
_CHILD = r"""
import os, sys
if sys.path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]        # a cpullm/ folder in the working directory must not shadow the package
import json, time
spec = json.loads(sys.argv[1])
import cpullm
from cpullm.run.memory import peak_rss_bytes
t0 = time.perf_counter()
m = cpullm.load(spec["model"], quant=spec["quant"], threads=spec["threads"], n_ctx=spec["n_ctx"],
                cache_dir=spec["cache_dir"], kv_dtype=spec.get("kv_dtype"))
load_s = time.perf_counter() - t0
fwd = m.forward
slot = fwd.new_slot()
first_token = []
def forward():
    fwd.reset(slot)
    tok = int(fwd.prefill(slot, spec["ids"]).argmax())
    first_token.append(time.time())
    fwd.step([slot], [tok])
t1 = time.perf_counter()
forward()
first_s = time.perf_counter() - t1
ready = time.time()
t2 = time.perf_counter()
forward()
second_s = time.perf_counter() - t2
print("CPULLM_BENCH_CHILD " + json.dumps({"ready_wall": ready, "first_token_wall": first_token[0],
      "load_s": load_s, "compile_s": m.compile_s, "cache": m.cache_status, "first_forward_s": first_s,
      "second_forward_s": second_s, "peak_rss_bytes": peak_rss_bytes()}))
"""


def _child_load(spec: dict, env_extra: dict | None = None, timeout: float = 3600) -> dict:
    env = dict(os.environ)
    env["CPULLM_QUIET"] = "1"
    env.update(env_extra or {})
    t_spawn = time.time()
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(spec)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("CPULLM_BENCH_CHILD ")), None)
    if proc.returncode != 0 or line is None:
        tail = "\n".join((proc.stderr or "").strip().splitlines()[-5:])
        raise BenchError(f"the load-time child process failed (exit {proc.returncode}): {tail}")
    out = json.loads(line.split(" ", 1)[1])
    out["ready_s"] = out["ready_wall"] - t_spawn
    if "first_token_wall" in out:
        out["first_token_s"] = out["first_token_wall"] - t_spawn
    out["uncacheable"] = sorted(set(_UNCACHEABLE.findall(proc.stderr or "")))
    return out


_UNCACHEABLE = re.compile(r'Cannot cache compiled function "([^"]+)"')
"""numba's warning for a function it compiled but cannot write to its on-disk cache."""


def load_timings(model_dir, quant: str, threads: int, n_ctx: int, probe_ids: list[int],
                 load: bool = True, compile: bool = True, progress=None, kv_dtype: str | None = None) -> dict:
    """MISS / HIT process-start-to-ready times and the cold numba compile time (see module doc)."""
    res: dict = {}
    if not (load or compile):
        return res
    tmp = Path(tempfile.mkdtemp(prefix="cpullm-bench-"))
    try:
        spec = {"model": str(model_dir), "quant": quant, "threads": threads, "n_ctx": n_ctx,
                "cache_dir": str(tmp / "exec-cache"), "ids": list(probe_ids), "kv_dtype": kv_dtype}
        say = progress or (lambda msg: None)
        say("load time, execution cache MISS (child process)")
        miss = _child_load(spec)
        say("load time, execution cache HIT (child process)")
        hit = _child_load(spec)
        if load:
            res.update(load_s_miss=miss["ready_s"], load_s_hit=hit["ready_s"],
                       load_s_miss_inproc=miss["load_s"], load_s_hit_inproc=hit["load_s"],
                       cache_miss_status=str(miss["cache"]).split()[0],
                       cache_hit_status=str(hit["cache"]).split()[0],
                       peak_rss_bytes_hit_process=hit["peak_rss_bytes"],
                       build_peak_rss_bytes=miss["peak_rss_bytes"])
        if compile:
            say("cold start: empty numba cache and execution cache (child process)")
            numba_dir = tmp / "numba-cache"
            numba_dir.mkdir()
            cold = _child_load(dict(spec, cache_dir=str(tmp / "exec-cache-cold")),
                               {"NUMBA_CACHE_DIR": str(numba_dir)})
            res.update(warmup_compile_s=max(0.0, cold["ready_s"] - miss["ready_s"]),
                       load_s_cold_numba=cold["ready_s"], numba_uncacheable=cold["uncacheable"],
                       cold_start_s=cold.get("first_token_s"), cold_start_compile_s=cold.get("compile_s"),
                       first_forward_compile_s=max(0.0, cold["first_forward_s"] - cold["second_forward_s"]))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return res
