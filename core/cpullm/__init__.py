"""cpullm: run small language models fast on the CPU, from Hugging Face checkpoints.

    import cpullm
    model = cpullm.load("path/to/model_dir", quant="int8")
    for piece in model.generate("The capital of France is", max_tokens=16):
        print(piece, end="")
"""
from __future__ import annotations

# Thread-pool and code-generation settings must be in place before numpy/numba load (cheap: it
# imports only os/sys/warnings until a kernel is actually used).
from cpullm_kernels.setup import numba_setup as _numba_setup  # noqa: E402,F401

__version__ = "0.1.0"

from .errors import CpullmError  # noqa: E402


def load(path, quant: str | None = None, threads: int | None = None, **kwargs):
    """Load a model directory, a GGUF file (or a model-store name) and return a ready
    :class:`cpullm.model.Model`.

    ``quant`` is ``"int8"`` (INT8 weights, one scale per block of 32; a directory's default),
    ``"q4"`` (4-bit Q4_K blocks, cpullm_kernels.rows.q4), ``"f32"`` (reference) or ``"gguf"`` (a GGUF
    file's default: its quantized tensors run in their own block formats, not requantized).
    ``threads`` defaults to the number of physical cores. Other keyword arguments are passed to
    :meth:`cpullm.model.Model.load` (``n_ctx``, ``kv_dtype`` ("f16", "f32" or "q8_0": the KV cache's
    format, as llama.cpp's --cache-type-k/-v; default f16, f32 for quant "f32"), ``cache_dir``,
    ``use_cache``, ``mlock``, ``mmap``). ``speculative`` ("off", "lookup", "draft", "auto"),
    ``draft_model`` and ``draft_max`` set speculative decoding (:meth:`cpullm.model.Model.speculate`).
    """
    from cpullm_kernels.setup.numba_setup import on_passing_thread

    from .model import Model

    def load_it():
        spec = {k: kwargs.pop(k) for k in ("speculative", "draft_model", "draft_max") if k in kwargs}
        model = Model.load(path, quant=quant, threads=threads, **kwargs)
        if spec:
            model.speculate(spec.get("speculative"), spec.get("draft_model"), spec.get("draft_max"))
        return model
    # the load's kernels run on a thread that ends with it, so the thread that decodes later, this one
    # or another, holds the process's only OpenMP team (numba_setup.on_passing_thread says why)
    return on_passing_thread(load_it)


# The package's layout (scripts/code_stats.py and tests/test_stages.py read it): the stage
# folders in the order data flows through them, and the root modules every stage may use. A
# module imports only from its own stage, an earlier one and BASE; the rest of the root (this
# module, model, plugin, testing, store) and the shell packages beside the stages (cli, serve,
# convert, bench, ray) may import from all of them.
STAGES = ('loading', 'graph', 'compile', 'run', 'generate')
BASE = ('errors', 'limits', 'notices', 'hookspecs', 'toolcalls')

__all__ = ["load", "CpullmError", "__version__"]
