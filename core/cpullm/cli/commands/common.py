"""Options shared by the commands that load a model, in our spelling and llama.cpp's
(``-m/--model``, ``-t/--threads``, ``-c/--ctx-size``, ``-s/--seed``, ``--temp``,
``--repeat-penalty``; ``-ngl`` is accepted with a notice: this runtime has no GPU)."""
from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    v = int(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def non_negative_int(text: str) -> int:
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="model directory, .gguf file or store name (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("-m", "--model", dest="model_flag", default=None, metavar="MODEL",
                   help="the model, as an option (llama.cpp's spelling)")
    p.add_argument("--quant", choices=["int8", "q4", "f32", "gguf"], default=None,
                   help="weight format (default: int8 for a checkpoint directory; gguf for a .gguf file, "
                        "whose quantized tensors run in their own block formats)")
    p.add_argument("-t", "--threads", type=positive_int, default=None, help="threads (default: physical cores)")
    p.add_argument("-c", "--ctx", "--ctx-size", dest="ctx", type=positive_int, default=None,
                   help="context length (default: min(4096, model max))")
    p.add_argument("-ngl", "--n-gpu-layers", "--gpu-layers", dest="n_gpu_layers", type=non_negative_int,
                   default=None, metavar="N", help="accepted for llama.cpp scripts and ignored: cpullm runs on the CPU")
    add_cache_type_options(p)
    p.add_argument("--cache-dir", default=None, help="execution cache root (default ~/.cache/cpullm, or $CPULLM_CACHE_DIR)")
    p.add_argument("--no-cache", action="store_true", help="compile without reading or writing the execution cache")
    p.add_argument("--mlock", action="store_true", help="keep the weights resident in RAM")
    p.add_argument("--mmap", dest="mmap", action="store_true", default=True,
                   help="map the cached program (default: starts fast, shares the page cache)")
    p.add_argument("--no-mmap", dest="mmap", action="store_false",
                   help="read the cached program into private memory: decode may run faster, loading is "
                        "slower (new memory is slow to fault in)")


def add_cache_type_options(p: argparse.ArgumentParser) -> None:
    """``--cache-type`` and llama.cpp's ``-ctk/--cache-type-k``, ``-ctv/--cache-type-v``
    (keys and values share one format here: :func:`settle_model_args` merges them)."""
    from cpullm.compile.kvformat import KV_DTYPES
    p.add_argument("--cache-type", "--kv-dtype", dest="kv_dtype", choices=KV_DTYPES, default=None,
                   help="KV cache format (default: f16; f32 with --quant f32). f16 halves the KV bytes a "
                        "decode step reads at long context, q8_0 (int8, a scale per 32 values) about quarters them")
    p.add_argument("-ctk", "--cache-type-k", dest="kv_dtype_k", choices=KV_DTYPES, default=None,
                   help="llama.cpp's spelling of --cache-type for the keys (must equal -ctv if both are given)")
    p.add_argument("-ctv", "--cache-type-v", dest="kv_dtype_v", choices=KV_DTYPES, default=None,
                   help="llama.cpp's spelling of --cache-type for the values")


def settle_cache_type(args) -> None:
    """Merge ``-ctk``/``-ctv`` into ``args.kv_dtype``: one format for keys and values, so
    differing values are an error naming the fix."""
    from cpullm.errors import ConfigError

    given = {flag: v for flag, v in (("--cache-type", getattr(args, "kv_dtype", None)),
                                     ("-ctk", getattr(args, "kv_dtype_k", None)),
                                     ("-ctv", getattr(args, "kv_dtype_v", None))) if v is not None}
    if len(set(given.values())) > 1:
        raise ConfigError("cpullm stores keys and values in one format, but "
                          + ", ".join(f"{f} {v}" for f, v in given.items()) + " differ; give one type "
                          "(e.g. -ctk q8_0 -ctv q8_0, or --cache-type q8_0)")
    if hasattr(args, "kv_dtype_k") or hasattr(args, "kv_dtype_v"):
        args.kv_dtype = next(iter(given.values()), None)
        args.kv_dtype_k = args.kv_dtype_v = None


def add_sampling_options(p: argparse.ArgumentParser, temperature: float | None = 0.0) -> None:
    p.add_argument("--temperature", "--temp", dest="temperature", type=float, default=temperature,
                   help=f"0 = greedy (default {temperature})" if temperature is not None else "0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", "--repeat-penalty", dest="repetition_penalty", type=float, default=1.0)
    p.add_argument("-s", "--seed", type=int, default=None)


def add_speculative_options(p: argparse.ArgumentParser) -> None:
    """``--speculative``, ``--draft-model``, ``--draft-max`` (docs/speculative.md)."""
    from cpullm.generate.speculative import DEFAULT_DRAFT_MAX, DEFAULT_MODE, MAX_DRAFT_MAX, MODES
    p.add_argument("--speculative", "--spec", dest="speculative", choices=list(MODES), default=None,
                   help=f"guess tokens and verify them in one pass, output unchanged: lookup (from the prompt "
                        f"and text so far), draft (--draft-model), auto (lookup, then the draft model), off "
                        f"(default {DEFAULT_MODE})")
    p.add_argument("--draft-model", "-md", "--model-draft", dest="draft_model", default=None, metavar="MODEL",
                   help="a smaller model with the same tokenizer that drafts guesses")
    p.add_argument("--draft-max", "--draft", dest="draft_max", type=int, default=None,
                   help=f"guesses per verify pass at most, 1..{MAX_DRAFT_MAX} (default {DEFAULT_DRAFT_MAX})")


def settle_model_args(args, spare: str | None = None) -> None:
    """Merge ``-m/--model`` into ``args.model`` (the positional). With ``-m`` given, a positional
    that was taken as the model moves to ``args.<spare>`` (``cpullm run -m MODEL "prompt"``).
    ``-ngl`` prints its notice here, once; ``-ctk``/``-ctv`` become ``args.kv_dtype``."""
    from cpullm.errors import ConfigError

    settle_cache_type(args)
    flag = getattr(args, "model_flag", None)
    if flag is not None:
        if args.model is not None:
            if spare is None or getattr(args, spare, None) is not None:
                raise ConfigError(f"two models given ({args.model!r} and -m {flag!r}); give one")
            setattr(args, spare, args.model)
        args.model = flag
        args.model_flag = None
    if getattr(args, "n_gpu_layers", None) is not None:
        from cpullm.model import notice
        notice(f"-ngl {args.n_gpu_layers} ignored: cpullm runs on the CPU (use -t/--threads)")
        args.n_gpu_layers = None


def compile_first(model):
    """Make a lone stream decode plainly while the batched step that verifies speculative guesses
    is compiled in a child process (a fresh machine's first run keeps decoding instead of
    stopping for it: cpullm.generate.speculative.SpecConfig.compile_first)."""
    import attrs
    model.speculative = attrs.evolve(model.speculative, compile_first=True)
    return model


def load_model(args):
    import cpullm

    name = args.model
    if name is None:
        from cpullm.store import ensure_default_model
        with progress_printer("default model") as progress:
            name = ensure_default_model(progress=progress)
    spec = getattr(args, "speculative", None), getattr(args, "draft_model", None), getattr(args, "draft_max", None)
    if any(v is not None for v in spec):
        from cpullm.generate.speculative import resolve
        resolve(spec[0] or ("draft" if spec[1] else None), spec[2], spec[1])   # bad flags fail before loading
    speculation = {}
    if any(v is not None for v in spec):
        speculation = dict(zip(("speculative", "draft_model", "draft_max"), spec))
    return cpullm.load(name, quant=args.quant, threads=args.threads, n_ctx=args.ctx,
                       cache_dir=args.cache_dir, use_cache=not args.no_cache, mlock=args.mlock,
                       mmap=args.mmap, kv_dtype=getattr(args, "kv_dtype", None), **speculation)


def progress_printer(label: str):
    """Progress on stderr for ``label``: a bar redrawn in place on a terminal, plain lines
    otherwise. Use it as a context manager so an error printed afterwards starts a new line."""
    from cpullm.store import text_progress
    return text_progress(label)
