#!/usr/bin/env python
"""Fidelity of a GGUF file in every runtime: mean KL(f32 reference || runtime) in nats over every
position of a few real prompts and their greedy continuations (teacher-forced).

    python benchmarks/fidelity.py FILE.gguf [--model-dir CONVERTED_DIR] [--gen-tokens 24]
        [--prompts 3] [--threads 2] [--skip llama.cpp,q4km] [--work-dir DIR]
        [--check-transformers] [--json OUT.json]

**Reference**: cpullm ``quant="f32"`` on the GGUF, i.e. float32 on the file's dequantized
weights (``--check-transformers`` verifies once that transformers, loading the same GGUF with
``gguf_file=``, gives the same logits). The token sequences are the prompts (tokenized by the
file's own tokenizer) followed by the reference's greedy continuation of ``--gen-tokens``; every
runtime then runs each whole sequence in one teacher-forced pass and its logits at every position
are compared with the reference's.

Runtimes, all fed the same token ids (llama.cpp gets ids through ``Llama.eval``, so no second
tokenizer is involved):

* ``cpullm gguf``: the file run as it is (its block formats executed directly).
* ``cpullm int8``, ``cpullm q4``: the file dequantized and requantized by cpullm.
* ``llama.cpp``: llama-cpp-python on the same file, ``logits_all=True``.

With ``--model-dir`` (the bf16 safetensors of the same weights, ``cpullm pull --convert``), also
the 4-bit formats made by each runtime's own quantizer from those weights:

* ``cpullm q4 (bf16)``: ``cpullm.load(MODEL_DIR, quant="q4")``.
* ``llama.cpp Q4_K_M (bf16)`` and ``Q4_0 (bf16)``: MODEL_DIR written as an F32 GGUF (exact for
  bf16; benchmarks/compare's writer) and quantized by ``llama_cpp.llama_model_quantize``.
* ``cpullm f32 (bf16)``: what the bf16 rounding alone costs against the reference, the floor
  under the two rows above.

"bytes/token" is the weight bytes one decode token reads: cpullm's
``cpullm.bench.decode_weight_bytes``; for llama.cpp every tensor of the file except the token
embedding (a row gather), unless the head is tied to it.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

PROMPTS = (
    "The history of the city begins in the twelfth century, when",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Water boils at a lower temperature on a mountain because",
    "Here is a short list of things to pack for a weekend of hiking:",
    "The theory of evolution by natural selection explains",
)


def log_softmax(x: np.ndarray) -> np.ndarray:
    """(T, V) float logits -> (T, V) float64 log-probabilities."""
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def kl_per_position(ref_logits: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """KL(softmax(ref) || softmax(logits)) in nats for each row: (T, V), (T, V) -> (T,)."""
    if ref_logits.shape != logits.shape:
        raise ValueError(f"logits shapes differ: {ref_logits.shape} vs {logits.shape}")
    lp_ref, lp = log_softmax(ref_logits), log_softmax(logits)
    return (np.exp(lp_ref) * (lp_ref - lp)).sum(axis=-1)


def mean_kl(refs: list, outs: list) -> float:
    """Mean over every position of every sequence."""
    return float(np.concatenate([kl_per_position(r, o) for r, o in zip(refs, outs)]).mean())


def cpullm_logits(model, sequences: list) -> list:
    """Teacher-forced logits (T, vocab) of each sequence from a fresh context."""
    return [np.array(model.forward.logits(ids), dtype=np.float32) for ids in sequences]


def greedy_sequences(model, prompts: list, gen_tokens: int) -> list:
    """Each prompt's ids followed by ``gen_tokens`` greedy tokens of ``model``."""
    tok = model.tokenizer
    seqs = []
    for text in prompts:
        ids = list(tok.encode(text))
        fwd = model.forward
        slot = fwd.new_slot()
        logits = fwd.prefill(slot, ids)
        for _ in range(gen_tokens):
            nxt = int(np.argmax(logits))
            ids.append(nxt)
            logits = fwd.step([slot], [nxt])[0][0]
        seqs.append(ids)
    return seqs


def llama_cpp_logits(path, sequences: list, threads: int) -> list:
    """llama.cpp's logits at every position (``logits_all=True``), token ids fed directly."""
    from llama_cpp import Llama

    n_ctx = max(len(s) for s in sequences) + 8
    llm = Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True, verbose=False)
    out = []
    for ids in sequences:
        llm.reset()
        llm.eval(ids)
        out.append(np.array(llm.scores[: len(ids)], dtype=np.float32))
    del llm
    return out


def gguf_decode_bytes(path) -> int:
    """Bytes of every tensor of a GGUF except the token embedding (read by row), unless the
    file has no separate output matrix, in which case decode reads the embedding as the head."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(str(path)).tensors}
    total = sum(tensors.values())
    if "output.weight" in tensors:
        total -= tensors.get("token_embd.weight", 0)
    return total


def transformers_logits(model, sequences: list) -> list:
    """Teacher-forced logits (T, vocab) float32 of each sequence from a transformers model."""
    import torch

    outs = []
    with torch.inference_mode():
        for ids in sequences:
            outs.append(model(torch.tensor([list(ids)])).logits[0].float().numpy())
    return outs


def transformers_check(path, sequences: list, ref: list) -> dict:
    """transformers float32 on the same GGUF (``gguf_file=``): mean KL against cpullm f32 and the
    largest absolute logit difference, to show the reference is the dequantized weights' f32."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 torch_dtype=torch.float32)
    model.eval()
    outs = transformers_logits(model, sequences)
    return {"mean_kl": mean_kl(ref, outs),
            "max_abs_diff": float(max(np.abs(a - b).max() for a, b in zip(ref, outs)))}


def run(args) -> dict:
    import cpullm
    from cpullm.bench import decode_weight_bytes

    skip = set(filter(None, args.skip.split(",")))
    path = Path(args.gguf)
    model_name = path.name
    rows = []

    def say(msg):
        print(msg, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    ref_model = cpullm.load(path, quant="f32", threads=args.threads)
    sequences = greedy_sequences(ref_model, list(PROMPTS[: args.prompts]), args.gen_tokens)
    ref = cpullm_logits(ref_model, sequences)
    del ref_model
    n_pos = sum(len(s) for s in sequences)
    say(f"reference f32: {len(sequences)} sequences, {n_pos} positions ({time.perf_counter() - t0:.0f} s)")
    report = {"model": model_name, "gguf": str(path), "positions": n_pos,
              "sequence_lengths": [len(s) for s in sequences], "gen_tokens": args.gen_tokens,
              "reference": "cpullm quant=f32 on the GGUF (dequantized weights)", "rows": rows}

    if args.check_transformers:
        report["transformers_check"] = transformers_check(path, sequences, ref)
        say(f"transformers f32 vs cpullm f32: {report['transformers_check']}")

    def add(runtime, outs, nbytes):
        rows.append({"model": model_name, "runtime": runtime, "mean_kl": mean_kl(ref, outs),
                     "bytes_per_token": nbytes})
        say(f"  {runtime}: mean KL {_kl(rows[-1]['mean_kl'])}")

    for quant in ("gguf", "int8", "q4"):
        if quant in skip:
            continue
        m = cpullm.load(path, quant=quant, threads=args.threads)
        add(f"cpullm {quant}", cpullm_logits(m, sequences), decode_weight_bytes(m.program))
        del m
    if "llama.cpp" not in skip:
        add("llama.cpp", llama_cpp_logits(path, sequences, args.threads), gguf_decode_bytes(path))

    if args.model_dir:
        model_dir = Path(args.model_dir)
        if "cpullm-bf16" not in skip:
            for quant in ("f32", "q4"):
                m = cpullm.load(model_dir, quant=quant, threads=args.threads)
                add(f"cpullm {quant} (bf16)", cpullm_logits(m, sequences), decode_weight_bytes(m.program))
                del m
        if "q4km" not in skip:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from compare.gguf import checkpoint_identity, llama_quantize, write_f32_gguf

            work = Path(args.work_dir).expanduser() / checkpoint_identity(model_dir)
            work.mkdir(parents=True, exist_ok=True)
            f32 = work / "model-f32.gguf"
            for ftype in ("Q4_K_M", "Q4_0"):
                qpath = work / f"model-{ftype}.gguf"
                if not qpath.is_file():
                    if not f32.is_file():
                        write_f32_gguf(model_dir, f32)
                    llama_quantize(f32, qpath, args.threads, ftype)
                add(f"llama.cpp {ftype} (bf16)", llama_cpp_logits(qpath, sequences, args.threads),
                    gguf_decode_bytes(qpath))
            f32.unlink(missing_ok=True)
    return report


def _kl(x: float) -> str:
    return f"{x:.5f}" if x >= 1e-3 else f"{x:.2e}"


def table(reports: list) -> str:
    lines = ["| model | runtime | mean KL (nats) | weight bytes / token |", "|---|---|---:|---:|"]
    for rep in reports:
        for r in rep["rows"]:
            nb = r["bytes_per_token"]
            size = f"{nb / 1e6:.1f} MB" if nb else "n/a"
            lines.append(f"| {r['model']} | {r['runtime']} | {_kl(r['mean_kl'])} | {size} |")
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf", nargs="+", help="GGUF file(s); give --model-dir once per file in order")
    ap.add_argument("--model-dir", action="append", default=[],
                    help="bf16 safetensors of the same weights (cpullm pull --convert), one per GGUF")
    ap.add_argument("--gen-tokens", type=int, default=24)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip", default="", help="comma list of: gguf,int8,q4,llama.cpp,cpullm-bf16,q4km")
    ap.add_argument("--work-dir", default="~/.cache/cpullm/bench/fidelity")
    ap.add_argument("--check-transformers", action="store_true")
    ap.add_argument("--json", help="write the reports here")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.model_dir and len(args.model_dir) != len(args.gguf):
        raise SystemExit("fidelity.py: give one --model-dir per GGUF file, in the same order")
    reports = []
    for i, g in enumerate(args.gguf):
        one = argparse.Namespace(**vars(args))
        one.gguf = g
        one.model_dir = args.model_dir[i] if args.model_dir else None
        reports.append(run(one))
        if args.json:
            Path(args.json).write_text(json.dumps(reports, indent=1))
    print(table(reports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
