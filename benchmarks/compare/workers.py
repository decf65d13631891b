"""The runtimes compared, each loaded and measured in its own child process (``python -m compare
--worker NAME``), so that no two thread pools ever compete."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from .gguf import gguf_label

RUNTIMES = ("cpullm", "llama.cpp", "transformers")
FOUR_BIT = ("cpullm-q4", "cpullm-gguf", "llama.cpp-Q4_K_M", "llama.cpp-Q4_0")
"""The runtimes --four-bit adds (benchmarks/README.md, "compare: the method")."""
ALL_RUNTIMES = RUNTIMES + FOUR_BIT
GGUF_OF = {"llama.cpp": "Q8_0", "llama.cpp-Q4_K_M": "Q4_K_M", "llama.cpp-Q4_0": "Q4_0", "cpullm-gguf": "Q4_K_M"}
"""The llama.cpp file type of the GGUF a runtime runs (made from the checkpoint by llama_quantize)."""
RATIO_PAIRS = (("cpullm", "llama.cpp"), ("cpullm", "transformers"),
               ("cpullm-q4", "llama.cpp-Q4_K_M"), ("cpullm-gguf", "llama.cpp-Q4_K_M"))
"""The tokens/s ratios reported, numerator / denominator, where both runtimes ran."""
KL_REFERENCE = "kl-reference"
"""The worker that makes the KL pass's token sequences and reference logits (cpullm f32)."""
RESULT_TAG = "CPULLM_COMPARE_RESULT "
BENCHMARKS = Path(__file__).resolve().parents[1]
"""benchmarks/, the folder holding this package and fidelity.py."""
CONTEXT_TOKENS = 512


# =================================================================================================
# Workers (each runs in its own process)
# =================================================================================================
class LlamaCppRunner:
    """llama-cpp-python's ``Llama.eval`` (its usual decode path); the last position's logits are
    read from the context with ``llama_get_logits_ith(ctx, -1)`` (a view, no copy): recent
    llama-cpp-python no longer copies them into ``Llama.scores`` unless ``logits_all``."""

    name = "llama.cpp"

    def __init__(self, llm):
        import llama_cpp

        self.llm = llm
        self.n_ctx = llm.n_ctx()
        self.n_vocab = llm.n_vocab()
        self._get = llama_cpp.llama_get_logits_ith

    def reset(self):
        self.llm.reset()

    def _last_logits(self):
        ptr = self._get(self.llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def prefill(self, ids):
        self.llm.eval(list(ids))
        return self._last_logits()

    def decode(self, tok):
        self.llm.eval([int(tok)])
        return self._last_logits()


class TransformersRunner:
    name = "transformers"

    def __init__(self, model, torch, n_ctx: int):
        self.model, self.torch, self.n_ctx = model, torch, n_ctx
        self.past = None
        self._keep = True

    def reset(self):
        self.past = None

    def _forward(self, ids):
        torch = self.torch
        kw = dict(input_ids=torch.tensor([list(ids)], dtype=torch.long), past_key_values=self.past,
                  use_cache=True)
        with torch.inference_mode():
            if self._keep:
                try:
                    out = self.model(**kw, logits_to_keep=1)
                except TypeError:
                    self._keep = False
                    out = self.model(**kw)
            else:
                out = self.model(**kw)
        self.past = out.past_key_values
        return out.logits[0, -1].float().numpy()

    def prefill(self, ids):
        return self._forward(ids)

    def decode(self, tok):
        return self._forward([int(tok)])


def _n_ctx_needed(spec) -> int:
    need = max(len(spec["ids"]), spec["context_tokens"]) + spec["gen_tokens"] + 8
    return int(-(-need // 256) * 256)


def is_cpullm(name: str) -> bool:
    return name == "cpullm" or name.startswith("cpullm-")


def is_llama_cpp(name: str) -> bool:
    return name == "llama.cpp" or name.startswith("llama.cpp-")


def gguf_path(name: str, spec: dict) -> str:
    """The GGUF file runtime ``name`` runs (llama.cpp's Q8_0 in ``spec["gguf"]``, the 4-bit
    files in ``spec["gguf_files"]`` by file type)."""
    if name == "llama.cpp":
        return spec["gguf"]
    return spec["gguf_files"][GGUF_OF[name]]


def load_runner(name: str, spec: dict):
    """(runner, info): the runtime ``name`` loaded as ``spec`` says, and what the report states
    about it (weights, version, threads, ``load_s``)."""
    from cpullm.bench import CpullmRunner

    threads = spec["threads"]
    info: dict = {"runtime": name}
    t0 = time.perf_counter()
    if is_cpullm(name):
        import cpullm
        if name == "cpullm-gguf":
            source, quant = gguf_path(name, spec), "gguf"
        else:
            source, quant = spec["model_dir"], "q4" if name == "cpullm-q4" else spec["quant"]
        model = cpullm.load(source, quant=quant, threads=threads, mmap=not spec.get("no_mmap", False))
        runner = CpullmRunner(model)
        no_mmap = ", --no-mmap" if spec.get("no_mmap") else ""
        weights = f"{gguf_label(source)} GGUF as it is" if quant == "gguf" else model.quant
        info.update(weights=f"{weights} (cpullm{no_mmap})", version=cpullm.__version__,
                    cache=str(model.cache_status).split()[0], threads=model.threads,
                    head_screen=model.executor.screen is not None)
        if quant == "gguf":
            info["gguf"] = source
    elif is_llama_cpp(name):
        import llama_cpp
        path = gguf_path(name, spec)
        llm = llama_cpp.Llama(model_path=path, n_ctx=_n_ctx_needed(spec), n_threads=threads,
                              n_threads_batch=threads, n_batch=512, n_ubatch=512, verbose=False)
        runner = LlamaCppRunner(llm)
        info.update(weights=f"{gguf_label(path)} (GGUF)", version=f"llama-cpp-python {llama_cpp.__version__}",
                    threads=threads, gguf=path, n_ctx=runner.n_ctx)
    elif name == "transformers":
        import torch
        import transformers
        torch.set_num_threads(threads)
        from transformers import AutoModelForCausalLM
        try:
            model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
        except TypeError:
            model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], torch_dtype=torch.float32)
        model.eval()
        runner = TransformersRunner(model, torch, _n_ctx_needed(spec))
        info.update(weights="f32 (torch)", version=f"{transformers.__version__} (torch {torch.__version__})",
                    threads=torch.get_num_threads())
    else:
        raise SystemExit(f"unknown runtime {name!r}")
    info["load_s"] = time.perf_counter() - t0
    return runner, info


def _fidelity_module():
    """benchmarks/fidelity.py (KL, teacher-forced logits, GGUF decode bytes), imported from
    the folder that holds this package."""
    here = str(BENCHMARKS)
    if here not in sys.path:
        sys.path.insert(0, here)
    import fidelity
    return fidelity


def worker(name: str, spec: dict) -> dict:
    from cpullm.bench import measure_speed

    if name == KL_REFERENCE:
        return kl_reference(spec)
    ids, gen = spec["ids"], spec["gen_tokens"]
    runner, info = load_runner(name, spec)
    if not is_cpullm(name):     # cpullm's comes with its memory-bound pass below
        info["decode_weight_bytes"] = _decode_weight_bytes(name, runner, spec)
    ctx_n = spec["context_tokens"]
    ctx_ids = spec.get("context_ids") or (ids if len(ids) == ctx_n else None)
    speed = measure_speed(runner, ids, gen, repeat=spec["repeat"], context_tokens=ctx_n,
                          context_ids=ctx_ids)
    if is_cpullm(name):     # this machine's streaming read rate, over cpullm's decode bytes
        from cpullm.bench import memory_bound
        mb = memory_bound(runner.model, steps=min(32, gen), token=ids[0])
        info.update(decode_weight_bytes=mb["decode_weight_bytes"], read_gbps=mb["read_gbps"],
                    decode_bound_share=mb["decode_bound_share"])
    runner.reset()
    last = np.asarray(runner.prefill(ids), np.float32).copy()
    np.save(spec["logits_out"], last)
    info.update({k: v for k, v in speed.items()})
    if spec.get("kl_sequences"):
        np.savez(spec["kl_logits_out"], *teacher_forced_logits(name, runner, spec))
    return info


def kl_reference(spec: dict) -> dict:
    """The KL pass's reference, in its own process: cpullm ``quant="f32"`` on the checkpoint
    makes the token sequences (``kl_prompts`` of fidelity.py's prompts, each followed by its
    ``kl_tokens`` greedy tokens) and their teacher-forced logits (saved to ``kl_logits_out``)."""
    import cpullm

    fid = _fidelity_module()
    t0 = time.perf_counter()
    model = cpullm.load(spec["model_dir"], quant="f32", threads=spec["threads"])
    sequences = fid.greedy_sequences(model, list(fid.PROMPTS[: spec["kl_prompts"]]), spec["kl_tokens"])
    np.savez(spec["kl_logits_out"], *fid.cpullm_logits(model, sequences))
    return {"runtime": KL_REFERENCE, "sequences": sequences, "load_s": time.perf_counter() - t0}


def teacher_forced_logits(name: str, runner, spec: dict) -> list:
    """Logits (T, vocab) at every position of each of ``spec["kl_sequences"]``, each run from a
    fresh context in one pass (fidelity.py's functions; llama.cpp loads the file again with
    ``logits_all``)."""
    fid = _fidelity_module()
    seqs = spec["kl_sequences"]
    if is_cpullm(name):
        return fid.cpullm_logits(runner.model, seqs)
    if is_llama_cpp(name):
        return fid.llama_cpp_logits(gguf_path(name, spec), seqs, spec["threads"])
    return fid.transformers_logits(runner.model, seqs)


def _decode_weight_bytes(name: str, runner, spec: dict) -> int | None:
    """Weight bytes one decode token reads in llama.cpp and transformers (cpullm's:
    ``cpullm.bench.memory_bound``): every GGUF tensor but a token embedding that has a separate
    output matrix (llama.cpp reads one row of it: fidelity.gguf_decode_bytes); every torch
    parameter, counted once, but an input embedding that is not also the lm_head."""
    try:
        if is_llama_cpp(name):
            return _fidelity_module().gguf_decode_bytes(gguf_path(name, spec))
        model = runner.model
        sizes = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
        emb, head = model.get_input_embeddings().weight, model.get_output_embeddings()
        if head is None or head.weight.data_ptr() != emb.data_ptr():
            sizes.pop(emb.data_ptr(), None)
        return sum(sizes.values())
    except Exception:          # an optional figure: never fail the run for it
        return None


def child_command(*args: str) -> list:
    """This package run in a new Python process (``python -m compare ARGS``, benchmarks/ on its
    path): the worker and paired-decode children."""
    return [sys.executable, "-m", "compare", *args]


def child_env(threads: int) -> dict:
    """The children's environment: quiet cpullm, OpenMP on ``threads``, benchmarks/ first on the
    module path and no working directory on it (PYTHONSAFEPATH: the repository root holds a
    kernels/ folder that would hide the installed package of that name)."""
    path = os.pathsep.join(p for p in (str(BENCHMARKS), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, CPULLM_QUIET="1", OMP_NUM_THREADS=str(threads), PYTHONPATH=path,
                PYTHONSAFEPATH="1")


def run_worker(name: str, spec: dict, workdir: Path, timeout: float) -> dict:
    """Runs ``worker(name, spec)`` in a child process: its result, with the last-position logits
    under "_logits" and, when the spec asks for the KL pass, the teacher-forced logits of each
    sequence under "_kl_logits"; {"runtime", "error"} when the child failed."""
    spec = dict(spec, logits_out=str(workdir / f"{name}.logits.npy"),
                kl_logits_out=str(workdir / f"{name}.kl.npz"))
    spec_path = workdir / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run(child_command("--worker", name, "--spec", str(spec_path)),
                          env=child_env(spec["threads"]), capture_output=True, text=True, timeout=timeout)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)), None)
    if proc.returncode != 0 or line is None:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-8:])
        return {"runtime": name, "error": f"exit {proc.returncode}: {tail}"}
    res = json.loads(line[len(RESULT_TAG):])
    try:
        res["_logits"] = np.load(spec["logits_out"])
    except OSError:
        pass
    try:
        with np.load(spec["kl_logits_out"]) as z:
            res["_kl_logits"] = [z[f"arr_{i}"] for i in range(len(z.files))]
        os.unlink(spec["kl_logits_out"])
    except OSError:
        pass
    return res


