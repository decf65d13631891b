"""``python -m benchmarks.compare``: the arguments, then the run in its steps (runtimes that can
run, llama.cpp's GGUFs, the KL reference, the rounds, the paired phase, the report files)."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

from . import paired, workers
from .gguf import _text_config
from .llama_convert import ensure_ggufs, gguf_source
from .report import _fidelity, _ratios, chart, machine_info, markdown, merge_rounds
from .workers import (ALL_RUNTIMES, CONTEXT_TOKENS, FOUR_BIT, GGUF_OF, KL_REFERENCE, RATIO_PAIRS, RESULT_TAG,
                      RUNTIMES, is_llama_cpp)


def say(msg):
    print(f"compare: {msg}", file=sys.stderr, flush=True)


def _available(runtime: str) -> str | None:
    """None if the runtime's package imports, else why it is skipped. cpullm-gguf needs
    llama_cpp for llama.cpp's quantizer (main does not ask when --gguf-q4 gives the file)."""
    import importlib.util
    need = ["llama_cpp"] if is_llama_cpp(runtime) else ["torch", "transformers"] if runtime == "transformers" else []
    if runtime == "cpullm-gguf" and importlib.util.find_spec("llama_cpp") is None:
        return ("skipped: llama_cpp not installed, whose quantizer makes the Q4_K_M GGUF "
                "(pip install 'cpullm[bench]', or give one with --gguf-q4 FILE)")
    missing = [m for m in need if importlib.util.find_spec(m) is None]
    if missing:
        return f"skipped: {', '.join(missing)} not installed (pip install 'cpullm[bench]')"
    return None


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.compare",
                                description="cpullm vs llama.cpp (Q8_0) vs transformers (f32) on one "
                                            "checkpoint; writes compare.md / compare.png / compare.json")
    p.add_argument("model", nargs="?", help="model directory or cpullm store name")
    p.add_argument("--threads", type=int, default=None, help="threads for every runtime (default: physical cores)")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--context-tokens", type=int, default=CONTEXT_TOKENS,
                   help="prefill length before the decode-at-context measurement (default 512)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1,
                   help="run every runtime this many times in turn (each with --repeat runs); the "
                        "report takes medians over rounds and gives each round's ratios (default 1)")
    p.add_argument("--paired", type=int, default=0, metavar="N",
                   help="after the rounds, load every runtime at once and let them take N turns of one "
                        "decode run each (A B, B A, ...); reports each turn's ratio (default 0: off)")
    p.add_argument("--quant", default="int8", help="cpullm weight format (default int8)")
    p.add_argument("--no-mmap", action="store_true",
                   help="cpullm reads its cached program into memory instead of mapping it (cpullm --no-mmap)")
    p.add_argument("--four-bit", action="store_true",
                   help="also run the 4-bit runtimes: " + ", ".join(FOUR_BIT) + " (and the KL pass)")
    p.add_argument("--skip", default="", help="comma-separated runtimes to skip: " + ",".join(ALL_RUNTIMES))
    p.add_argument("--gguf", default=None, help="use this GGUF for llama.cpp instead of converting the checkpoint")
    p.add_argument("--llama-convert", action="store_true",
                   help="make llama.cpp's GGUFs with llama.cpp's own convert_hf_to_gguf.py (fetched once with pip "
                        "from llama-cpp-python's source distribution into --work-dir) even where cpullm's GGUF "
                        "writer knows the architecture; architectures it does not know always take this way")
    p.add_argument("--gguf-q4", default=None, metavar="FILE",
                   help="use this 4-bit GGUF of the same weights for cpullm-gguf and llama.cpp-Q4_K_M instead "
                        "of llama.cpp's Q4_K_M of the checkpoint")
    p.add_argument("--kl-prompts", type=int, default=None, metavar="N",
                   help="KL pass over N prompts (mean KL vs cpullm f32 at every position); default 1 with "
                        "--four-bit, else 0 (off)")
    p.add_argument("--kl-tokens", type=int, default=16, metavar="N",
                   help="greedy tokens of the reference after each KL prompt (default 16)")
    p.add_argument("--work-dir", default=None,
                   help="where the Q8_0 / Q4_K_M / Q4_0 GGUFs are kept (default ~/.cache/cpullm/bench)")
    p.add_argument("--out", default=None, help="output directory (default bench-results/<model>)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per runtime")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    p.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        spec = json.loads(Path(args.spec).read_text())
        res = workers.worker(args.worker, spec)
        print(RESULT_TAG + json.dumps(res, default=float), flush=True)
        return 0
    if args.serve:
        paired.serve(args.serve, json.loads(Path(args.spec).read_text()))
        return 0
    kl_prompts = check_args(args)
    if kl_prompts is None:
        return 2
    model_dir, spec = run_spec(args)
    report = new_report(args, argv, model_dir, spec, kl_prompts)
    out = Path(args.out or Path("bench-results") / model_dir.name)
    out.mkdir(parents=True, exist_ok=True)
    names = list(RUNTIMES) + (list(FOUR_BIT) if args.four_bit else [])
    with tempfile.TemporaryDirectory(prefix="cpullm-compare-") as td:
        td = Path(td)
        rows, runnable = runnable_runtimes(names, args)
        make_ggufs(args, model_dir, spec, report, rows, runnable)
        ref, kl_spec = kl_reference(args, spec, report, kl_prompts, runnable, td)
        runs = run_rounds(args, spec, kl_spec, ref, runnable, td)
        for name in runnable:
            rows[name] = merge_rounds(runs[name])
        report["results"] = [rows[name] for name in names if name in rows]
        report["round_ratios"] = [_ratios({name: runs[name][i] for name in runnable})
                                  for i in range(args.rounds)] if args.rounds > 1 else []
        if args.paired:
            report["paired"] = paired_phase(args, spec, runnable, td)
    report["loadavg_after"] = os.getloadavg()[0]
    write_report(report, out)
    return 0 if any("prefill_tps" in r for r in report["results"]) else 1


def check_args(args) -> int | None:
    """The KL pass's prompt count, or None after printing why the arguments cannot run."""
    if not args.model:
        print("compare: give a model directory or store name", file=sys.stderr)
        return None
    kl_prompts = args.kl_prompts if args.kl_prompts is not None else (1 if args.four_bit else 0)
    n_prompts = len(workers._fidelity_module().PROMPTS)
    if args.rounds < 1 or args.repeat < 1 or args.paired < 0 or not 0 <= kl_prompts <= n_prompts \
            or args.kl_tokens < 0:
        print(f"compare: --rounds and --repeat must be at least 1, --paired and --kl-tokens at least 0, "
              f"--kl-prompts from 0 to {n_prompts}", file=sys.stderr)
        return None
    unknown = _skip(args) - set(ALL_RUNTIMES)
    if unknown:
        print(f"compare: unknown runtime(s) in --skip: {sorted(unknown)}", file=sys.stderr)
        return None
    return kl_prompts


def _skip(args) -> set:
    return {s.strip() for s in args.skip.split(",") if s.strip()}


def run_spec(args) -> tuple[Path, dict]:
    """The checkpoint directory and what every worker is given: the prompt's token ids (and the
    context prefill's), the lengths, the threads and cpullm's settings."""
    from cpullm.bench import prompt_ids
    from cpullm_kernels.setup.numba_setup import physical_cores
    from cpullm.model import resolve_model_dir
    from cpullm.loading.tokenize import Tokenizer

    model_dir = resolve_model_dir(args.model).resolve()
    if not (model_dir / "config.json").is_file():      # a GGUF file, or a store entry kept as GGUF
        sys.exit(f"compare: {model_dir} is not a checkpoint directory; compare runs safetensors "
                 f"checkpoints (store models: `cpullm pull NAME --convert`)")
    config = json.loads((model_dir / "config.json").read_text())
    vocab = int(_text_config(config).get("vocab_size") or 0) or None
    tok = Tokenizer(model_dir)
    ids = prompt_ids(tok, args.prompt_tokens, vocab)
    ctx_ids = ids if args.context_tokens == len(ids) else prompt_ids(tok, args.context_tokens, vocab)
    spec = {"model_dir": str(model_dir), "ids": ids, "context_ids": ctx_ids, "gen_tokens": args.gen_tokens,
            "context_tokens": args.context_tokens, "repeat": args.repeat,
            "threads": int(args.threads or physical_cores()),
            "quant": args.quant, "gguf": args.gguf, "no_mmap": bool(args.no_mmap)}
    return model_dir, spec


def new_report(args, argv, model_dir: Path, spec: dict, kl_prompts: int) -> dict:
    """The report before any run: the command, the machine, its load and the settings."""
    from cpullm.bench import cpu_busy as bench_cpu_busy

    return {"model_name": model_dir.name, "model_dir": str(model_dir),
            "command": "python -m benchmarks.compare " + " ".join(
                shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine_info(),
            "cpu_busy_before": bench_cpu_busy(), "loadavg_before": os.getloadavg()[0],
            "settings": {k: spec[k] for k in ("gen_tokens", "context_tokens", "repeat", "threads", "quant", "no_mmap")}
            | {"prompt_tokens": len(spec["ids"]), "rounds": args.rounds, "paired": args.paired,
               "four_bit": args.four_bit, "kl_prompts": kl_prompts, "kl_tokens": args.kl_tokens},
            "results": [], "ratios": {}}


def runnable_runtimes(names: list, args) -> tuple[dict, list]:
    """({name: row} of the runtimes skipped by --skip or for a missing package, [the others])."""
    rows: dict[str, dict] = {}
    runnable = []
    skip = _skip(args)
    for name in names:
        if name in skip:
            rows[name] = {"runtime": name, "skipped": "skipped (--skip)"}
            continue
        why = None if name == "cpullm-gguf" and args.gguf_q4 else _available(name)
        if why:
            say(f"{name}: {why}")
            rows[name] = {"runtime": name, "skipped": why}
            continue
        runnable.append(name)
    return rows, runnable


def make_ggufs(args, model_dir: Path, spec: dict, report: dict, rows: dict, runnable: list) -> None:
    """The GGUF files the llama.cpp runtimes (and cpullm-gguf) run, given or made from the
    checkpoint (``ensure_ggufs``), into ``spec``; a runtime whose file could not be made becomes
    an error row."""
    gguf_files = {ft: f for ft, f in (("Q8_0", args.gguf), ("Q4_K_M", args.gguf_q4)) if f}
    need = sorted({GGUF_OF[n] for n in runnable if n in GGUF_OF} - set(gguf_files), key=list(GGUF_OF.values()).index)
    if need:
        work_dir = Path(os.path.expanduser(args.work_dir or "~/.cache/cpullm/bench"))
        try:
            llama_convert = True if args.llama_convert else None
            gguf_files.update({ft: str(f) for ft, f in ensure_ggufs(model_dir, work_dir, spec["threads"], need, say,
                                                                    llama_convert).items()})
            report["gguf_source"] = gguf_source(model_dir, llama_convert)
        except SystemExit as exc:
            for name in [n for n in runnable if GGUF_OF.get(n) in need]:
                rows[name] = {"runtime": name, "error": str(exc)}
                runnable.remove(name)
    spec.update(gguf=gguf_files.get("Q8_0"), gguf_files=gguf_files)


def kl_reference(args, spec: dict, report: dict, kl_prompts: int, runnable: list, td: Path):
    """The KL pass's reference run (cpullm f32 in its own process): (its teacher-forced logits,
    the spec of a round that computes the runtimes' own), or (None, None) without the pass."""
    if not (kl_prompts and runnable):
        return None, None
    say(f"KL pass: reference cpullm f32, {kl_prompts} prompt(s) + {args.kl_tokens} greedy tokens")
    res = workers.run_worker(KL_REFERENCE, dict(spec, kl_prompts=kl_prompts, kl_tokens=args.kl_tokens), td,
                             args.timeout)
    if "error" in res or not res.get("_kl_logits"):
        report["kl"] = {"error": res.get("error", "the reference wrote no logits")}
        say(f"KL pass: {report['kl']['error']}")
        return None, None
    report["kl"] = {"reference": "cpullm quant=f32 on the checkpoint (float32 on its weights, as "
                                 "transformers f32)",
                    "prompts": kl_prompts, "gen_tokens": args.kl_tokens,
                    "sequence_lengths": [len(q) for q in res["sequences"]],
                    "positions": sum(len(q) for q in res["sequences"])}
    return res["_kl_logits"], dict(spec, kl_sequences=res["sequences"])


def run_rounds(args, spec: dict, kl_spec: dict | None, ref, runnable: list, td: Path) -> dict:
    """{name: [one result per round]}: every runtime in turn, --rounds times; the first round also
    takes the KL pass when there is a reference."""
    runs: dict[str, list] = {name: [] for name in runnable}
    for rnd in range(args.rounds):
        for name in runnable:
            say(f"running {name} ({spec['threads']} thread(s))"
                + (f", round {rnd + 1} of {args.rounds}" if args.rounds > 1 else ""))
            res = workers.run_worker(name, kl_spec if ref is not None and rnd == 0 else spec, td, args.timeout)
            outs = res.pop("_kl_logits", None)
            if outs is not None:
                res["kl"] = workers._fidelity_module().mean_kl(ref, outs)
            if "error" in res:
                say(f"{name} failed: {res['error']}")
            else:
                say(f"{name}: prefill {res['prefill_tps']:.1f} tok/s, decode {res['decode_tps']:.1f} tok/s, "
                    f"decode@{res['decode_context_tokens']} {res['decode_tps_at_512']:.1f} tok/s"
                    + (f", KL {res['kl']:.3g}" if res.get("kl") is not None else ""))
            runs[name].append(res)
    return runs


def paired_phase(args, spec: dict, runnable: list, td: Path) -> dict:
    """The --paired turns, or why they could not run."""
    if paired.ratio_pairs(runnable):
        res = paired.paired_decode(runnable, spec, td, args.paired, args.timeout, say)
    else:
        res = {"error": "it needs both runtimes of a ratio: " + ", ".join(f"{a} and {b}" for a, b in RATIO_PAIRS)}
    if "error" in res:
        say(f"paired decode: {res['error']}")
    return res


def write_report(report: dict, out: Path) -> None:
    """Each row's fidelity against transformers and agreement with cpullm (last-position logits),
    the ratios, then compare.md (also printed), compare.png and compare.json in ``out``."""
    by = {r["runtime"]: r for r in report["results"] if "prefill_tps" in r}
    ref = by.get("transformers", {}).get("_logits")
    ours = by.get("cpullm", {}).get("_logits")
    for r in report["results"]:
        lg = r.pop("_logits", None)
        if lg is not None and ref is not None and r["runtime"] != "transformers":
            r["fidelity"] = _fidelity(lg, ref)
        if lg is not None and ours is not None and r["runtime"] != "cpullm":
            r["agreement_with_cpullm"] = _fidelity(lg, ours)
    report["ratios"] = _ratios(by)
    md = markdown(report)
    png = chart(report, out / "compare.png")
    (out / "compare.md").write_text(md)
    report["outputs"] = {"markdown": str(out / "compare.md"), "json": str(out / "compare.json"),
                         "chart": str(png) if png else None}
    (out / "compare.json").write_text(json.dumps(report, indent=2, default=float))
    print(md)
    say(f"wrote {out / 'compare.md'}, {out / 'compare.json'}" + (f", {png}" if png else
                                                                  " (no chart: matplotlib not installed)"))
