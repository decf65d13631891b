"""Cold start of ``cpullm run``: process start to first token with an empty numba cache, two
builds side by side.

Each run is ``PYTHON -m cpullm.cli run MODEL -p PROMPT -n 1 --threads N`` in a fresh process with
``NUMBA_CACHE_DIR`` set to a new empty directory (numba otherwise caches next to the sources, in
``__pycache__``), so every kernel is compiled; ``-n 1`` ends the process right after the first
token. The execution cache is empty too (``--exec-cache cold``: a first run on a fresh machine)
or filled once beforehand per build (``warm``: only the numba cache is cold).

Runs alternate between the builds (ABAB..., the order flipped every other round) so that both see
the same machine. Reported per build: wall time, and CPU time (user + sys of the whole process
tree, from ``getrusage(RUSAGE_CHILDREN)``: the compile child included), each run and the medians.
On a shared machine wall time moves with the load; CPU time much less.

    python benchmarks/cold_start.py --build old=/path/to/python --build new=.venv/bin/python --reps 3

A build may name its own model (``--build old=PYTHON@MODEL``): the default model as each build's
README command runs it (a converted INT8 directory before, the GGUF file as it is now).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_once(python: str, model: str, prompt: str, threads: int, numba_dir: Path, exec_dir: Path,
             cwd: Path, env_extra: dict | None = None) -> dict:
    """One process: returns wall and CPU seconds and the stats line."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(numba_dir), CPULLM_CACHE_DIR=str(exec_dir))
    env.pop("CPULLM_QUIET", None)
    env.update(env_extra or {})
    cmd = [python, "-m", "cpullm.cli", "run", model, "-p", prompt, "-n", "1", "--threads", str(threads)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    stats = next((ln for ln in proc.stderr.splitlines()[::-1] if ln.startswith("[")), "")
    return {"wall_s": wall,
            "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "stats": stats}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", action="append", required=True, metavar="NAME=PYTHON[@MODEL]",
                    help="a build to time: a name, the interpreter whose cpullm it runs, and optionally "
                         "its own model (else --model) (repeatable)")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model (default: the default model)")
    ap.add_argument("--prompt", default="What is the capital of France?")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3, help="runs per build (default 3)")
    ap.add_argument("--exec-cache", choices=["cold", "warm"], default="cold",
                    help="execution cache empty for every run (cold) or filled once per build (warm)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    builds, models = {}, {}
    for b in args.build:
        name, _, rest = b.partition("=")
        builds[name], _, model = rest.partition("@")
        models[name] = model or args.model
    tmp = Path(tempfile.mkdtemp(prefix="cpullm-coldstart-"))
    cwd = tmp / "cwd"                  # not the repository: its folders must not shadow a build
    cwd.mkdir()
    results = {name: [] for name in builds}
    try:
        warm_exec = {}
        if args.exec_cache == "warm":
            for name, py in builds.items():
                warm_exec[name] = tmp / f"exec-{name}"
                run_once(py, models[name], args.prompt, args.threads, tmp / f"numba-fill-{name}",
                         warm_exec[name], cwd)
        order = list(builds)
        for rep in range(args.reps):
            for name in (order if rep % 2 == 0 else order[::-1]):
                numba_dir = tmp / f"numba-{name}-{rep}"
                exec_dir = warm_exec.get(name) or tmp / f"exec-{name}-{rep}"
                r = run_once(builds[name], models[name], args.prompt, args.threads, numba_dir, exec_dir, cwd)
                results[name].append(r)
                shutil.rmtree(numba_dir, ignore_errors=True)
                print(f"{name:>6} run {rep + 1}: wall {r['wall_s']:6.1f} s, cpu {r['cpu_s']:6.1f} s  {r['stats']}",
                      file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    summary = {name: {"wall_s_median": statistics.median(r["wall_s"] for r in rs),
                      "cpu_s_median": statistics.median(r["cpu_s"] for r in rs), "runs": rs}
               for name, rs in results.items()}
    if args.json:
        print(json.dumps({"models": models, "threads": args.threads, "exec_cache": args.exec_cache,
                          "builds": builds, "results": summary}))
        return 0
    print(f"cold start of `cpullm run MODEL -n 1`, empty numba cache, execution cache "
          f"{args.exec_cache}, {args.threads} threads, {args.reps} alternating runs per build (medians)")
    for name, s in summary.items():
        print(f"  {name:>8}: wall {s['wall_s_median']:6.1f} s   cpu {s['cpu_s_median']:6.1f} s   {models[name]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
