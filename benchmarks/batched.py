"""Many streams at once: cpullm's scheduler against llama.cpp's batched decode, same weights,
same machine, one run.

For each N of ``--streams``, N distinct ``--prompt-tokens``-token prompts, ``--gen-tokens`` greedy
tokens each (end of text ignored), on ``--threads`` threads, each engine in a fresh process, the
engines alternating:

* **cpullm**: ``cpullm bench --concurrency N``'s measurement (:func:`cpullm.bench.concurrency.
  run_concurrency`): the scheduler with N slots, prompts prefilled in chunks between decode
  steps, every decode step one pass over the weights for all active streams. INT8 from the
  checkpoint directory.
* **llama.cpp** (llama-cpp-python's C API): one context with N sequences (``n_seq_max`` = N, one
  unified KV cache), every prompt prefilled, then each step one ``llama_decode`` of a batch with
  one token per sequence, greedy from each row's logits: how llama.cpp's batched-bench and its
  server with N parallel slots decode. Q8_0 made from the same checkpoint by llama.cpp's own
  quantizer (benchmarks/compare's ``ensure_q8_gguf``).

Reported per engine and N: aggregate decode tokens/s (every stream decoding), per-stream decode
tokens/s, time to each stream's first token (median, p95) and the speedup over one stream; and
cpullm / llama.cpp. A 2-core machine shared with other work gives meaningless absolute rates:
run it on a quiet machine.

    python benchmarks/batched.py ~/.cache/cpullm/models/qwen2.5-coder-0.5b-instruct --streams 1,2,4,8,16
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _prompts(model_dir: str, n: int, prompt_tokens: int) -> list[list[int]]:
    from cpullm.bench import prompt_ids
    from cpullm.loading.tokenize import Tokenizer
    base = prompt_ids(Tokenizer(Path(model_dir)), prompt_tokens + n, None)
    return [list(map(int, base[i: i + prompt_tokens])) for i in range(n)]


def _percentile(xs, q):
    import numpy as np
    return float(np.percentile(np.asarray(xs, np.float64), q)) if xs else 0.0


def run_cpullm(spec: dict) -> dict:
    import cpullm
    from cpullm.bench import run_concurrency
    model = cpullm.load(spec["model_dir"], quant="int8", threads=spec["threads"],
                        n_ctx=spec["prompt_tokens"] + spec["gen_tokens"] + 16)
    return run_concurrency(model, spec["n"], spec["prompt_tokens"], spec["gen_tokens"])


def run_llama_cpp(spec: dict) -> dict:
    import ctypes

    import llama_cpp as L
    import numpy as np

    n, threads = spec["n"], spec["threads"]
    prompts = spec["prompts"]
    L.llama_backend_init()
    mparams = L.llama_model_default_params()
    model = L.llama_model_load_from_file(spec["gguf"].encode(), mparams)
    if not model:
        raise SystemExit(f"llama.cpp could not load {spec['gguf']}")
    per_seq = spec["prompt_tokens"] + spec["gen_tokens"] + 16
    cparams = L.llama_context_default_params()
    cparams.n_ctx = n * per_seq
    cparams.n_seq_max = n
    cparams.kv_unified = True
    cparams.n_batch = cparams.n_ubatch = max(512, n)
    cparams.n_threads = cparams.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, cparams)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(max(512, n), 0, n)

    def fill(entries):       # entries: (token, pos, seq, wants_logits)
        batch.n_tokens = len(entries)
        for i, (tok, pos, seq, out) in enumerate(entries):
            batch.token[i], batch.pos[i] = tok, pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = 1 if out else 0

    def argmax(i) -> int:
        ptr = L.llama_get_logits_ith(ctx, i)
        return int(np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (n_vocab,)).argmax())

    def warm():              # page in weights, build the graphs, outside the measurement
        fill([(t, p, 0, p == 7) for p, t in enumerate(prompts[0][:8])])
        L.llama_decode(ctx, batch)
        L.llama_memory_clear(L.llama_get_memory(ctx), True)

    warm()
    t0 = time.perf_counter()
    last_tok, stamps = [], [[] for _ in range(n)]
    for s, ids in enumerate(prompts):           # prompts prefilled one after another, as slots fill
        for c in range(0, len(ids), 512):
            chunk = ids[c:c + 512]
            fill([(t, c + j, s, c + j == len(ids) - 1) for j, t in enumerate(chunk)])
            if L.llama_decode(ctx, batch) != 0:
                raise SystemExit("llama_decode failed (prefill)")
        last_tok.append(argmax(len(chunk) - 1))
        stamps[s].append(time.perf_counter())
    pos = [len(p) for p in prompts]
    t_dec = time.perf_counter()
    for _ in range(spec["gen_tokens"] - 1):
        fill([(last_tok[s], pos[s], s, True) for s in range(n)])
        if L.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed (decode)")
        now = time.perf_counter()
        for s in range(n):
            last_tok[s] = argmax(s)
            pos[s] += 1
            stamps[s].append(now)
    t_end = time.perf_counter()
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    steps = spec["gen_tokens"] - 1
    ttft = [ts[0] - t0 for ts in stamps]
    return {"concurrency": n, "aggregate_decode_tps": n * steps / (t_end - t_dec) if steps else 0.0,
            "per_stream_decode_tps": steps / (t_end - t_dec) if steps else 0.0,
            "ttft_median_s": _percentile(ttft, 50), "ttft_p95_s": _percentile(ttft, 95),
            "throughput_tps": n * spec["gen_tokens"] / (t_end - t0)}


ENGINES = {"cpullm": run_cpullm, "llama.cpp": run_llama_cpp}


def _worker(name: str, spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    print(json.dumps(ENGINES[name](spec)), flush=True)


def run_in_process(name: str, spec: dict, workdir: Path, timeout: float) -> dict:
    path = workdir / f"spec-{name}-{spec['n']}.json"
    path.write_text(json.dumps(spec))
    env = dict(os.environ, CPULLM_QUIET="1", OMP_NUM_THREADS=str(spec["threads"]))
    r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", name, str(path)],
                       capture_output=True, text=True, timeout=timeout, env=env, cwd=workdir)
    if r.returncode != 0:
        raise SystemExit(f"{name} with {spec['n']} streams failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], sys.argv[3])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", help="a checkpoint directory (safetensors + config + tokenizer)")
    ap.add_argument("--streams", default="1,2,4,8,16", help="N values, comma-separated")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gguf", help="llama.cpp's Q8_0 GGUF of the same weights (default: made with "
                                   "llama.cpp's quantizer into --work-dir)")
    ap.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "cpullm-compare"))
    ap.add_argument("--engines", default="cpullm,llama.cpp")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    streams = [int(x) for x in args.streams.split(",")]
    engines = args.engines.split(",")
    model_dir = str(Path(args.model_dir).expanduser().resolve())
    gguf = args.gguf
    if "llama.cpp" in engines and not gguf:
        sys.path.insert(0, str(HERE))
        from compare.llama_convert import ensure_q8_gguf
        gguf = str(ensure_q8_gguf(Path(model_dir), Path(args.work_dir), args.threads,
                                  say=lambda m: print(m, file=sys.stderr)))
    results: dict = {e: {} for e in engines}
    with tempfile.TemporaryDirectory(prefix="cpullm-batched-") as tmp:
        for i, n in enumerate(streams):
            spec = {"model_dir": model_dir, "gguf": gguf, "n": n, "threads": args.threads,
                    "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens,
                    "prompts": _prompts(model_dir, n, args.prompt_tokens)}
            for name in (engines if i % 2 == 0 else engines[::-1]):
                res = run_in_process(name, spec, Path(tmp), args.timeout)
                results[name][n] = res
                print(f"{name:>9} N={n:<3} aggregate {res['aggregate_decode_tps']:7.1f} tok/s, per stream "
                      f"{res['per_stream_decode_tps']:6.1f}, TTFT median {res['ttft_median_s']:6.2f} s "
                      f"p95 {res['ttft_p95_s']:6.2f} s", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"model_dir": model_dir, "gguf": gguf, "threads": args.threads,
                          "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens,
                          "results": results}))
        return 0
    print(f"{Path(model_dir).name}, {args.threads} threads, {args.prompt_tokens}-token prompts, "
          f"{args.gen_tokens} new tokens per stream; aggregate decode tok/s (x one stream)")
    head = "| streams | " + " | ".join(f"{e} aggregate | {e} per stream | {e} TTFT median / p95 s"
                                       for e in engines)
    if len(engines) == 2:
        head += f" | {engines[0]} / {engines[1]}"
    print(head + " |")
    print("|---:" * (1 + 3 * len(engines) + (len(engines) == 2)) + "|")
    for n in streams:
        cells = []
        for e in engines:
            r, one = results[e][n], results[e].get(streams[0])
            x = r["aggregate_decode_tps"] / one["aggregate_decode_tps"] if one and one["aggregate_decode_tps"] else 0
            cells += [f"{r['aggregate_decode_tps']:.1f} ({x:.2f}x)", f"{r['per_stream_decode_tps']:.1f}",
                      f"{r['ttft_median_s']:.2f} / {r['ttft_p95_s']:.2f}"]
        if len(engines) == 2:
            a, b = (results[e][n]["aggregate_decode_tps"] for e in engines)
            cells.append(f"{a / b:.2f}" if b else "-")
        print(f"| {n} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
