"""Mixture-of-experts decode at the real shapes: Qwen3-30B-A3B's exact published config
(``benchmarks/moe_configs/qwen3-30b-a3b``) with synthetic weights (benchmarks/synth.py's
statistics), cut to a few layers so that it fits this machine, measured at two depths and
extrapolated to the full 48.

For each depth and each quant mode (int8, q4):
* bytes read per decode token, counted: every dense matrix the token reads (attention, the
  routers, the lm_head) plus the expert matrices the MOE kernel read (``Executor.moe[r].bytes_read``),
  against the bytes of the active weights (the dense ones plus top_k experts per layer);
* decode tokens/s of one stream (``--gen`` greedy steps after a ``--prompt``-token prompt, the
  prefill not timed), and of ``--streams`` streams decoded together (``Forward.step`` over all
  their slots: one pass over the weights a step), both with ``--threads`` threads;
* the program's resident bytes and the build's peak RSS;
* quant modes: ``int8`` / ``q4`` are cpullm's own quantizations of the safetensors checkpoint;
  ``gguf:Q8_0`` / ``gguf:Q4_K_M`` run llama.cpp's files of it as they are (the very bytes
  llama.cpp runs: its 3-D expert tensors, one expert's slice read per choice);
* with ``--llama-bench PATH``: llama.cpp's Q8_0 and Q4_K_M made from the same checkpoint by its
  own converter and quantizer (benchmarks/compare), decode tok/s by ``llama-bench -n GEN -p 0
  -t THREADS -r 1`` (one run), right after cpullm's runs of that depth;
* with ``--llama-batched-bench PATH``: llama.cpp's own 1 and ``--streams`` sequences decoded
  together (``llama-batched-bench -npl 1,STREAMS``, random prompts of ``--prompt`` tokens), so
  the streams' gain over one stream has its peer.

The streams' gain has a ceiling set by the routing, not the runtime: a step of N streams reads
the experts any of them chose (with 128 experts, top 8 and routing spread evenly, 8 streams choose
about 52 distinct experts a layer, 6.4 times one stream's), so when both are bound by the bytes
they read, N streams decode at most ``streams_bound`` = N x bytes_per_token /
streams_bytes_per_step times one stream's rate. The more layers, the more the experts weigh
against the lm_head that every stream shares, and the lower that ceiling.

``--cache-dir DIR`` keeps the built programs (cpullm's cache): a first run without the bench lock
builds them (``--build-only``), the timed run under the lock then loads them (HIT).

From two depths d1 < d2: per-layer cost = (x(d2) - x(d1)) / (d2 - d1), full = x(d1) + (48 - d1) *
per-layer, for memory and for seconds per token.

    python benchmarks/moe.py --depths 2 4 --work /root/moe-work --quants int8 gguf:Q4_K_M \
        --cache-dir /root/moe-work/cache --build-only
    flock /work/wt/bench.lock python benchmarks/moe.py --depths 2 4 --work /root/moe-work \
        --quants int8 gguf:Q4_K_M --cache-dir /root/moe-work/cache --llama-bench /path/llama-bench

Never a test (timings): results go to benchmarks/results/.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIG_DIR = HERE / "moe_configs"
LLAMA_PEER = {"int8": "Q8_0", "gguf:Q8_0": "Q8_0", "q4": "Q4_K_M", "gguf:Q4_K_M": "Q4_K_M"}
"""The llama.cpp file each cpullm mode is compared with: equal bytes per weight."""


def write_synthetic(name: str, depth: int, out: Path, seed: int = 0) -> Path:
    """The checkpoint of ``moe_configs/<name>`` cut to its first ``depth`` layers (synth.py's
    plan, statistics and tokenizer), written once."""
    sys.path.insert(0, str(HERE))
    import synth

    if out.exists():
        return out
    config = json.loads((CONFIG_DIR / name / "config.json").read_text())
    layout = json.loads((CONFIG_DIR / name / "layout.json").read_text())
    config = synth.with_layers(config, depth)
    plan = synth.tensor_plan(config, layout)
    shards = synth.shard_plan(plan, "BF16", layout["max_shard_bytes"])
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    tmp.mkdir(parents=True)
    total = sum(math.prod(s) for _, s in plan) * 2
    prog = synth.Progress(f"synth {name} x{depth}", total, True)
    stats = synth.WeightStats(config, seed)
    if layout.get("store_tied_lm_head"):
        stats.alias.update({"lm_head.weight": "model.embed_tokens.weight"})
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for fname, shard in zip(files, shards):
        synth._write_shard(tmp / fname, shard, "BF16", stats, prog)
        weight_map.update({n: fname for n, _ in shard})
    prog.close()
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    synth.write_tokenizer(tmp, config, layout)
    os.replace(tmp, out)
    return out


def _dense_bytes(ex) -> int:
    """Bytes of the LINEAR matrices one decode token reads (the lm_head in full)."""
    from cpullm_kernels.program import program_table as P
    from cpullm_kernels.rows.gguf_blocks import block_format
    from cpullm_kernels.panels.kquant_panels import PANELED
    from cpullm_kernels.panels.q8_panels import padded_rows
    total = 0
    for r in ex.linear_rows:
        lin = P.linear_operands(ex.I[r])
        if lin.kind == P.WEIGHT_Q8:
            total += padded_rows(lin.n) * (lin.kp + lin.kp // 16)
        elif lin.kind == P.WEIGHT_BLOCKS:
            total += lin.n * block_format(lin.s_off % PANELED).row_bytes(lin.kp)
        else:
            total += 4 * lin.n * lin.k
    return total


def measure(model_dir: Path, quant: str, threads: int, prompt: int, gen: int, streams: int,
            cache_dir: str = "", build_only: bool = False) -> dict:
    """One quant mode of one checkpoint (``model_dir``: a directory, or a GGUF file for the gguf
    modes), in this process."""
    import numpy as np

    import cpullm
    from cpullm_kernels.program import moe as M

    t0 = time.perf_counter()
    cache = dict(cache_dir=cache_dir) if cache_dir else dict(use_cache=False)
    model = cpullm.load(model_dir, quant=quant.partition(":")[0], threads=threads, n_ctx=1024, **cache)
    build_s = time.perf_counter() - t0
    if build_only:
        return {"quant": quant, "build_s": round(build_s, 1), "cache": model.cache_status,
                "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    ex = model.forward.executor
    calls = list(ex.moe.values())
    router = sum(4 * int(c.prm[M.PRM_E]) * int(c.prm[M.PRM_H]) for c in calls)
    dense = _dense_bytes(ex)
    k = int(calls[0].prm[M.PRM_K])
    active = dense + router + sum(k * int(c.expert_bytes[0]) for c in calls)
    fwd = model.forward
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(1000, 100000, prompt)] for _ in range(streams)]

    def decode(B: int, steps: int) -> tuple[float, float]:
        """(seconds, expert bytes read) of ``steps`` greedy decode steps of B streams after
        their prompts (prefill not timed)."""
        slots = fwd.slots(B) if B > 1 else [fwd.new_slot()]
        toks = []
        for s, ids in zip(slots, prompts):
            toks.append(int(np.argmax(fwd.prefill(s, ids))))
        before = sum(c.bytes_read for c in calls)
        t = time.perf_counter()
        for _ in range(steps):
            toks = fwd.step(slots, toks, greedy=[True] * B)[1]
        return time.perf_counter() - t, sum(c.bytes_read for c in calls) - before

    for arr in model.forward.executor.program.arrays.values():
        _touch(arr)                             # every expert in the page cache before any timing
    decode(1, 2)                                # warm-up: compiles
    decode(streams, 2)
    one_s, one_read = decode(1, gen)
    many_s, many_read = decode(streams, gen)
    per_token_experts = one_read / gen
    read = dense + router + per_token_experts
    many_bytes = dense + router + many_read / gen

    return {"quant": quant, "weight_formats": model.info()["weight_formats"], "cache": model.cache_status,
            "build_s": round(build_s, 1), "decode_tps": gen / one_s,
            "streams": streams, "streams_tps": streams * gen / many_s, "streams_step_s": many_s / gen,
            "streams_bytes_per_step": many_bytes, "streams_bound": streams * read / many_bytes,
            "bytes_per_token": read, "active_bytes": active, "read_over_active": read / active,
            "dense_bytes": dense, "router_bytes": router, "experts_per_token": per_token_experts,
            "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "rss_mb": _rss_mb(), "program_bytes": sum(int(a.nbytes) for a in model.forward.executor.program.arrays.values())}


def _touch(arr) -> None:
    """Read one byte of every 4 KiB page of ``arr`` (a mapped program array): a decode step reads
    experts no earlier step chose, and a page first read from disk inside a timed step would time
    the disk. 12 layers of Qwen3-30B-A3B at Q8_0 are 8.6 GB, which the page cache of a 24 GB
    machine keeps."""
    import numpy as np
    b = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    int(b[::4096].sum())


def _page_in(path: Path) -> None:
    """Read ``path`` through once, so that llama.cpp's mapped file is in the page cache before its
    timed run, as cpullm's program is (:func:`_touch`)."""
    with open(path, "rb") as fh:
        while fh.read(1 << 24):
            pass


def _uptime() -> str:
    """The load average now (the host is shared: every timing is reported with it)."""
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _rss_mb() -> float:
    """Resident set size now (MB): the built program and the planned state, mapped and touched."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def truncated_gguf(src: Path, dst: Path, depth: int) -> Path:
    """``src`` (a GGUF llama.cpp made) cut to its first ``depth`` layers: every metadata value and
    tensor copied byte for byte but ``{arch}.block_count`` and the tensors of deeper layers. Where
    the disk holds one checkpoint but not two, the shallower depth's files come from the deeper
    one's this way (the same bytes llama.cpp's converter and quantizer wrote for those layers)."""
    import re

    import gguf

    if dst.is_file():
        return dst
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    tmp = dst.with_name(dst.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        if field.name == f"{arch}.block_count":
            writer.add_uint32(field.name, depth)
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    keep = [t for t in reader.tensors if not (m := re.match(r"blk\.(\d+)\.", t.name)) or int(m.group(1)) < depth]
    for t in keep:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in keep:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    os.replace(tmp, dst)
    return dst


def llama_files(model_dir: Path, work: Path, threads: int, truncate_from: Path | None = None,
                depth: int = 0) -> dict:
    """{"Q8_0": path, "Q4_K_M": path}: llama.cpp's converter and quantizer run on the checkpoint,
    or (``truncate_from``, the deeper checkpoint) that checkpoint's files cut to ``depth`` layers."""
    sys.path.insert(0, str(HERE))
    from compare.llama_convert import ensure_ggufs
    if truncate_from is None:
        return ensure_ggufs(model_dir, work, threads, ("Q8_0", "Q4_K_M"), llama_convert=True)
    deep = ensure_ggufs(truncate_from, work, threads, ("Q8_0", "Q4_K_M"), llama_convert=True)
    return {ft: truncated_gguf(p, p.with_name(p.name.replace(".gguf", f".first{depth}.gguf")), depth)
            for ft, p in deep.items()}


def llama_decode(files: dict, bench: str, threads: int, gen: int) -> dict:
    """llama-bench decode tok/s of each file (one run)."""
    out = {}
    for ftype, path in files.items():
        _page_in(path)
        cmd = [bench, "-m", str(path), "-t", str(threads), "-n", str(gen), "-p", "0", "-r", "1", "-o", "json"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        rows = json.loads(proc.stdout) if proc.returncode == 0 else []
        out[ftype] = {"cmd": " ".join(cmd), "tps": rows[0]["avg_ts"] if rows else None,
                      "bytes": Path(path).stat().st_size, "error": proc.stderr[-300:] if not rows else ""}
    return out


def llama_batched(files: dict, tool: str, threads: int, prompt: int, gen: int, streams: int) -> dict:
    """llama-batched-bench's decode tok/s (every sequence's tokens) of 1 and ``streams`` sequences
    of each file, and their ratio (one run)."""
    out = {}
    for ftype, path in files.items():
        _page_in(path)
        ctx = streams * (prompt + gen) + 16
        cmd = [tool, "-m", str(path), "-t", str(threads), "-c", str(ctx), "-npp", str(prompt), "-ntg", str(gen),
               "-npl", f"1,{streams}", "--output-format", "jsonl"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        rows = {}
        for line in (proc.stdout + "\n" + proc.stderr).splitlines():
            if line.startswith("{") and '"speed_tg"' in line:
                row = json.loads(line)
                rows[row["pl"]] = row["speed_tg"]
        one, many = rows.get(1), rows.get(streams)
        out[ftype] = {"cmd": " ".join(cmd), "one_tps": one, "streams_tps": many,
                      "streams_over_one": many / one if one and many else None,
                      "error": proc.stderr[-300:] if not (one and many) else ""}
    return out


def full_depth(depths: dict, quants, d1: int, d2: int, full: int) -> dict:
    """Each mode measured at depths d1 < d2 (``depths[d][quant]``, and ``depths[d]["llama.cpp"]``)
    extrapolated to ``full`` layers: bytes and memory grow by their per-layer difference, seconds
    per token and per streams' step likewise; llama.cpp's decode the same way, and each cpullm
    mode's ratio to its LLAMA_PEER file at full depth."""
    out = {}
    for quant in quants:
        if quant not in depths[d1] or quant not in depths[d2]:
            continue
        a, b = depths[d1][quant], depths[d2][quant]
        ext = {}
        for key in ("bytes_per_token", "active_bytes", "streams_bytes_per_step", "maxrss_mb", "rss_mb",
                    "program_bytes"):
            ext[key] = a[key] + (full - d1) * (b[key] - a[key]) / (d2 - d1)
        spt = (1 / b["decode_tps"] - 1 / a["decode_tps"]) / (d2 - d1)
        ext["decode_tps"] = 1 / (1 / a["decode_tps"] + (full - d1) * spt)
        step = (b["streams_step_s"] - a["streams_step_s"]) / (d2 - d1)
        ext["streams_tps"] = a["streams"] / (a["streams_step_s"] + (full - d1) * step)
        ext["streams_over_one"] = ext["streams_tps"] / ext["decode_tps"]
        ext["streams_bound"] = a["streams"] * ext["bytes_per_token"] / ext["streams_bytes_per_step"]
        out[quant] = ext
    theirs = [depths[d].get("llama.cpp", {}) for d in (d1, d2)]
    for ft in ("Q8_0", "Q4_K_M"):
        a, b = (t.get(ft, {}).get("tps") for t in theirs)
        if not (a and b):
            continue
        spt = (1 / b - 1 / a) / (d2 - d1)
        tps = 1 / (1 / a + (full - d1) * spt)
        out.setdefault("llama.cpp", {})[ft] = {"decode_tps": tps}
        for quant in quants:
            if quant in out and LLAMA_PEER.get(quant) == ft:
                out[quant][f"over_llama_{ft}"] = out[quant]["decode_tps"] / tps
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(d.name for d in CONFIG_DIR.iterdir()))
    p.add_argument("--depths", type=int, nargs=2, default=[1, 2])
    p.add_argument("--quants", nargs="+", default=["int8", "q4"])
    p.add_argument("--work", type=Path, required=True, help="where the synthetic checkpoints and GGUFs go")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--gen", type=int, default=32)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH"), help="llama-bench binary (optional)")
    p.add_argument("--llama-batched-bench", help="llama-batched-bench binary (optional): llama.cpp's own "
                                                 "1 and --streams sequences decoded together")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--cache-dir", default="", help="cpullm's program cache (default: no cache, build each time)")
    p.add_argument("--build-only", action="store_true", help="only build (and cache) the programs and GGUFs")
    p.add_argument("--truncate", action="store_true",
                   help="the shallower depths' llama.cpp files cut from the deepest's (truncated_gguf); their "
                        "cpullm runs only the gguf modes")
    args = p.parse_args(argv)
    full = json.loads((CONFIG_DIR / args.model / "config.json").read_text())["num_hidden_layers"]
    results = {"model": args.model, "full_layers": full, "threads": args.threads, "gen": args.gen,
               "uptime": [_uptime()], "depths": {}}
    for depth in args.depths:
        deepest = args.work / f"{args.model}-x{max(args.depths)}"
        truncate = args.truncate and depth < max(args.depths)
        d = (write_synthetic(args.model, max(args.depths), deepest) if truncate
             else write_synthetic(args.model, depth, args.work / f"{args.model}-x{depth}"))
        ggufs = {}
        if args.llama_bench or args.llama_batched_bench or any(q.startswith("gguf:") for q in args.quants):
            ggufs = llama_files(d, args.work / "gguf", args.threads, deepest if truncate else None, depth)
        row = {}
        for quant in args.quants:      # one process per build, so each peak RSS is its own
            if truncate and not quant.startswith("gguf:"):
                continue                # no safetensors checkpoint of this depth
            src = ggufs[quant.partition(":")[2]] if quant.startswith("gguf:") else d
            cmd = [sys.executable, __file__, "--one", str(src), quant, str(args.threads), str(args.prompt),
                   str(args.gen), str(args.streams), args.cache_dir, "1" if args.build_only else "0"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"moe.py: {quant} at depth {depth} failed: {proc.stderr[-800:]}")
            row[quant] = json.loads(proc.stdout.strip().splitlines()[-1])
            row[quant]["uptime"] = _uptime()
            print(f"depth {depth} {quant}: {json.dumps(row[quant])}", flush=True)
        if args.llama_bench and not args.build_only:
            row["llama.cpp"] = llama_decode(ggufs, args.llama_bench, args.threads, args.gen)
            row["llama.cpp"]["uptime"] = _uptime()
            print(f"depth {depth} llama.cpp: {json.dumps(row['llama.cpp'])}", flush=True)
            for quant in row:
                ft = LLAMA_PEER.get(quant)
                theirs = row["llama.cpp"].get(ft, {}).get("tps")
                if ft and theirs:
                    row[quant][f"over_llama_{ft}"] = row[quant]["decode_tps"] / theirs
                    print(f"depth {depth} {quant} / llama.cpp {ft}: {row[quant][f'over_llama_{ft}']:.3f}x", flush=True)
        if args.llama_batched_bench and not args.build_only:
            row["llama.cpp batched"] = llama_batched(ggufs, args.llama_batched_bench, args.threads, args.prompt,
                                                     args.gen, args.streams)
            row["llama.cpp batched"]["uptime"] = _uptime()
            print(f"depth {depth} llama.cpp batched: {json.dumps(row['llama.cpp batched'])}", flush=True)
        results["depths"][depth] = row
    if args.build_only:
        return 0
    d1, d2 = args.depths
    results["full_depth"] = full_depth(results["depths"], args.quants, d1, d2, full)
    for name, ext in results["full_depth"].items():
        print(f"full depth {full} {name}: {json.dumps(ext)}", flush=True)
    if args.json:
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=2))
        os.replace(tmp, args.json)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        d, quant, threads, prompt, gen, streams, cache_dir, build_only = sys.argv[2:10]
        print(json.dumps(measure(Path(d), quant, int(threads), int(prompt), int(gen), int(streams), cache_dir,
                                 build_only == "1")))
        raise SystemExit(0)
    raise SystemExit(main())
