"""Where a program build's memory goes: RSS sampled while ``cpullm.load`` compiles a checkpoint.

    python benchmarks/build_memory.py MODEL_DIR [--quant int8] [--interval 0.05] [--json]

Loads MODEL_DIR with an empty execution cache (a MISS: quantize, pack, screen, write, map back)
while a thread samples this process's RSS every ``interval`` seconds, split into anonymous memory
(heap: float32 scratch, packed arrays, concatenations) and file-backed pages (the mapped bf16
checkpoint and the mapped program), together with the innermost cpullm functions the main thread
is in. Prints the peak, the phase each maximum was reached in, and the final program's weight
bytes, so the peak can be read as a multiple of them.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import traceback


def _status() -> dict:
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def _where(frame) -> str:
    """The innermost three cpullm frames of a stack: the phase the build is in."""
    names = [f"{os.path.basename(fs.filename)}:{fs.name}" for fs in traceback.extract_stack(frame)
             if "cpullm" in fs.filename or "/core/" in fs.filename or "/kernels/" in fs.filename]
    return " > ".join(names[-3:]) or "?"


def sample_load(model_dir: str, quant: str, interval: float, cache_dir: str | None = None) -> dict:
    import cpullm

    main_id = threading.get_ident()
    samples, stop = [], threading.Event()

    def run():
        while not stop.is_set():
            st = _status()
            frame = sys._current_frames().get(main_id)
            samples.append((time.perf_counter(), st, _where(frame) if frame is not None else "?"))
            stop.wait(interval)

    with tempfile.TemporaryDirectory(prefix="cpullm-build-mem-") as tmp:
        cache = cache_dir or tmp
        before = _status()["VmRSS"]
        t = threading.Thread(target=run, daemon=True)
        t0 = time.perf_counter()
        t.start()
        model = cpullm.load(model_dir, quant=quant, cache_dir=cache)
        load_s = time.perf_counter() - t0
        stop.set()
        t.join()
        mem = model.info()["memory"]
        final = _status()
    peak = max(samples, key=lambda s: s[1]["VmRSS"])
    by_phase: dict = {}
    for _, st, where in samples:
        cur = by_phase.setdefault(where, {"rss": 0, "anon": 0, "file": 0})
        cur["rss"] = max(cur["rss"], st["VmRSS"])
        cur["anon"] = max(cur["anon"], st.get("RssAnon", 0))
        cur["file"] = max(cur["file"], st.get("RssFile", 0))
    return {"model": model_dir, "quant": quant, "load_s": load_s, "cache": model.cache_status,
            "weights_bytes": mem["weights_bytes"], "peak_rss_bytes": final["VmHWM"], "rss_before": before,
            "peak_sample": {"rss": peak[1]["VmRSS"], "anon": peak[1].get("RssAnon", 0),
                            "file": peak[1].get("RssFile", 0), "where": peak[2]},
            "phases": by_phase, "samples": len(samples)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--quant", default="int8")
    p.add_argument("--interval", type=float, default=0.05)
    p.add_argument("--json", action="store_true")
    p.add_argument("--cache-dir", default=None,
                   help="execution cache root to use (a second run with the same one samples a HIT); "
                        "default: a fresh temporary one (a MISS)")
    a = p.parse_args(argv)
    r = sample_load(a.model, a.quant, a.interval, a.cache_dir)
    if a.json:
        print(json.dumps(r, indent=1))
        return 0
    w = r["weights_bytes"]
    mb = lambda n: f"{n / 1e6:8.0f} MB"                                  # noqa: E731
    print(f"{r['model']} {r['quant']}: load {r['load_s']:.1f} s ({r['cache']}), weights {mb(w)}")
    print(f"peak RSS {mb(r['peak_rss_bytes'])} = {r['peak_rss_bytes'] / w:.2f}x weights; "
          f"RSS before the load (imports) {mb(r['rss_before'])}")
    ps = r["peak_sample"]
    print(f"at the peak sample: anon {mb(ps['anon'])}, file-backed {mb(ps['file'])}, in {ps['where']}")
    print("max RSS by phase (innermost cpullm frames):")
    for where, v in sorted(r["phases"].items(), key=lambda kv: -kv[1]["rss"])[:12]:
        print(f"  {mb(v['rss'])}  anon {mb(v['anon'])}  file {mb(v['file'])}  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
