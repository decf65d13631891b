"""Paired decode (``--paired N``): every runtime loaded at once, each in its own child process
(``python -m compare --serve NAME``), taking turns of one timed decode run each (A B, B A, ...)."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from .workers import RATIO_PAIRS, RESULT_TAG, child_command, child_env, is_cpullm, load_runner

READY_TAG = "CPULLM_COMPARE_READY "
PAIR_KINDS = ("decode", "decode_at_512")
"""What one turn of the paired phase times: ``decode`` (gen_tokens steps after a one-token prompt)
or ``decode_at_512`` (the same after the context_ids prefill), as measure_speed defines them."""


def serve(name: str, spec: dict, stdin=None, stdout=None) -> None:
    """A runtime kept loaded for the paired phase: warms up, prints READY_TAG, then times one
    decode run per command read from ``stdin`` (a PAIR_KINDS name; ``quit`` or end of input
    stops) and prints its tokens/s after RESULT_TAG. One cpullm runtime (``spec["read_probe"]``,
    default "cpullm") also times, right after each run, a plain parallel read of the bytes its
    decode reads (``read_gbps``: the machine's memory bandwidth at that moment, as
    ``cpullm.bench.memory_bound`` measures it)."""
    from cpullm.bench import greedy, next_token

    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    runner, info = load_runner(name, spec)
    ids, gen = spec["ids"], spec["gen_tokens"]
    ctx_n = spec["context_tokens"]
    ctx_ids = spec.get("context_ids") or (list(ids) * -(-ctx_n // len(ids)))[:ctx_n]

    def timed(prompt) -> float:
        runner.reset()
        tok = greedy(runner.prefill(prompt))
        t0 = time.perf_counter()
        for _ in range(gen):
            tok = next_token(runner, tok)
        return gen / (time.perf_counter() - t0)

    read = _read_rate_probe(runner) if name == spec.get("read_probe", "cpullm") else None
    timed(ids[:1])                                    # untimed warm-up of both paths
    print(READY_TAG + json.dumps(info, default=float), file=stdout, flush=True)
    for line in stdin:
        cmd = line.strip()
        if cmd not in PAIR_KINDS:
            break
        out = {"kind": cmd, "tps": timed(ids[:1] if cmd == "decode" else ctx_ids)}
        if read is not None:
            out["read_gbps"] = read()
        print(RESULT_TAG + json.dumps(out), file=stdout, flush=True)


def _read_rate_probe(runner):
    """A function timing 3 plain parallel reads of the weight bytes one cpullm decode token reads;
    returns their median GB/s."""
    import numba

    from cpullm.bench import decode_weight_spans
    from cpullm_kernels.setup.bandwidth import as_words, read_sum_u32

    words = [as_words(v) for v in decode_weight_spans(runner.model.program)]
    nbytes, nth = sum(w.nbytes for w in words), numba.get_num_threads()

    def read() -> float:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            for w in words:
                read_sum_u32(w, nth)
            times.append(time.perf_counter() - t0)
        return nbytes / float(np.median(times)) / 1e9
    read()                                            # compiles (or loads) the read kernel
    return read


class ServedRuntime:
    """One runtime in its own child process (``python -m compare --serve NAME``), asked for timed runs."""

    def __init__(self, name: str, spec: dict, workdir: Path):
        self.name = name
        spec_path = workdir / f"{name}.serve.json"
        spec_path.write_text(json.dumps(spec))
        # stderr to a file: a pipe nobody reads while the runs go on could fill and stall the child
        self.err_path = workdir / f"{name}.serve.err"
        with open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(child_command("--serve", name, "--spec", str(spec_path)),
                                         env=child_env(spec["threads"]), stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, text=True)
        self.info = json.loads(self._line(READY_TAG))

    def _line(self, tag: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(tag):
                return line[len(tag):]
        self.proc.wait()
        tail = "\n".join(self.err_path.read_text(errors="replace").strip().splitlines()[-8:])
        raise RuntimeError(f"{self.name} stopped (exit {self.proc.returncode}): {tail}")

    def run(self, kind: str) -> dict:
        """{"tps": tokens/s of one timed run of ``kind``, "read_gbps" (cpullm only)}."""
        self.proc.stdin.write(kind + "\n")
        self.proc.stdin.flush()
        return json.loads(self._line(RESULT_TAG))

    def close(self) -> None:
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


def turn_order(names: list, i: int) -> list:
    """The order of turn ``i``: as given on even turns, reversed on odd ones (A B, B A, A B, ...),
    so that a drift of the machine's speed during a pair favours neither runtime."""
    return list(names) if i % 2 == 0 else list(reversed(names))


def ratio_pairs(names) -> list:
    """The RATIO_PAIRS (numerator, denominator) whose two runtimes are both in ``names``."""
    return [(a, b) for a, b in RATIO_PAIRS if a in names and b in names]


def paired_decode(names: list, spec: dict, workdir: Path, pairs: int, timeout: float, say=print,
                  start=ServedRuntime) -> dict:
    """Every runtime in ``names`` loaded at once in its own process; ``pairs`` turns in which each
    times one decode run of every PAIR_KINDS kind in turn_order, with nothing else running. Each
    ratio of RATIO_PAIRS present (cpullm / llama.cpp, cpullm-q4 / llama.cpp-Q4_K_M, ...) is taken
    within each turn (runs seconds apart), then its median, min and max over the turns. Returns
    {"pairs", "tps": {name: {kind: [...]}}, "ratios": {"A / B": {kind: [...]}}, "read_gbps":
    {kind: [...]}} (one value per turn; the read rate measured by the first cpullm runtime right
    after its run) or {"error": ...}."""
    served, killer = [], None
    spec = dict(spec, read_probe=next((n for n in names if is_cpullm(n)), None))
    try:
        for name in names:
            say(f"paired decode: loading {name}")
            served.append(start(name, spec, workdir))
        if timeout:
            import threading
            killer = threading.Timer(timeout, lambda: [s.proc.kill() for s in served if hasattr(s, "proc")])
            killer.daemon = True
            killer.start()
        tps = {s.name: {k: [] for k in PAIR_KINDS} for s in served}
        read = {k: [] for k in PAIR_KINDS}
        for i in range(pairs):
            for kind in PAIR_KINDS:
                for s in turn_order(served, i):
                    res = s.run(kind)
                    tps[s.name][kind].append(float(res["tps"]))
                    if res.get("read_gbps") is not None:
                        read[kind].append(float(res["read_gbps"]))
            say(f"paired decode: turn {i + 1} of {pairs}: " + ", ".join(
                f"{n} {v['decode'][-1]:.1f} / {v['decode_at_512'][-1]:.1f}" for n, v in tps.items()) + " tok/s")
    except (RuntimeError, OSError, ValueError) as exc:
        return {"error": str(exc)}
    finally:
        if killer is not None:
            killer.cancel()
        for s in served:
            s.close()
    ratios = {f"{a} / {b}": {k: [x / y for x, y in zip(tps[a][k], tps[b][k])] for k in PAIR_KINDS}
              for a, b in ratio_pairs(tps)}
    return {"pairs": pairs, "tps": tps, "ratios": ratios, "read_gbps": read}


