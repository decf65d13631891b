"""``cpullm run [MODEL] [PROMPT]``: generate text from a prompt, streaming, with a one-line summary.

The prompt is the argument after the model, or ``-p``; without one, a terminal opens the chat
(``cpullm chat``, as Ollama's ``run`` does) and piped standard input is read as the prompt."""
from __future__ import annotations

import sys

from .common import (add_model_options, add_sampling_options, add_speculative_options, compile_first,
                     load_model, progress_printer)


def add_parser(sub):
    p = sub.add_parser("run", help="generate text from a prompt")
    add_model_options(p)
    add_speculative_options(p)
    p.add_argument("prompt_text", nargs="?", default=None, metavar="PROMPT",
                   help="the prompt (or -p; none: read piped stdin, or chat on a terminal)")
    p.add_argument("-p", "--prompt", default=None, help="the prompt text")
    p.add_argument("-n", "--max-tokens", "--n-predict", dest="max_tokens", type=int, default=None,
                   help="tokens to generate (default 64; 512 per answer in the chat)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--prompt-cache", default=None, metavar="FILE",
                   help="save/restore the KV cache of the prompt in FILE")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    add_sampling_options(p, temperature=None)
    p.add_argument("--no-stats", action="store_true", help="do not print the speed summary")
    p.set_defaults(model_spare="prompt_text")
    add_constraint_options(p)
    return p


MAX_STDIN_PROMPT_BYTES = 16 * 2**20


def _stdin_is_terminal() -> bool:
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except (OSError, ValueError):
        return False


def read_stdin_prompt() -> str:
    """Standard input as the prompt (at most MAX_STDIN_PROMPT_BYTES; UTF-8)."""
    from cpullm.errors import PromptError

    from .chat import require_utf8
    data = sys.stdin.buffer.read(MAX_STDIN_PROMPT_BYTES + 1) if sys.stdin is not None else b""
    if len(data) > MAX_STDIN_PROMPT_BYTES:
        raise PromptError(f"the prompt on stdin is over {MAX_STDIN_PROMPT_BYTES >> 20} MiB; give a shorter one")
    text = data.decode("utf-8", errors="surrogateescape")
    require_utf8("stdin", text)
    return text


def settle_prompt(args) -> bool:
    """Set ``args.prompt`` from the argument, -p or piped stdin; False when there is none and
    stdin is a terminal (the chat opens instead)."""
    from cpullm.errors import PromptError

    if args.prompt_text is not None:
        if args.prompt is not None:
            raise PromptError("give the prompt once: after the model or with -p, not both")
        args.prompt = args.prompt_text
    if args.prompt is None:
        if _stdin_is_terminal():
            return False
        args.prompt = read_stdin_prompt()
    return True


def open_chat(args) -> int:
    """``cpullm run MODEL`` on a terminal without a prompt: the interactive chat."""
    from cpullm.errors import PromptError

    from . import chat
    for flag, given in (("--json", args.json), ("--prompt-cache", args.prompt_cache),
                        ("--stop", args.stop), ("--chat", args.chat)):
        if given:
            raise PromptError(f"{flag} needs a prompt: give one after the model, with -p, or on stdin")
    args.max_tokens = 512 if args.max_tokens is None else args.max_tokens
    args.temperature = 0.7 if args.temperature is None else args.temperature
    if args.max_tokens <= 0:
        raise PromptError(f"-n must be >= 1, got {args.max_tokens}")
    return chat.run(args)


def add_constraint_options(p) -> None:
    """Constrained output (needs cpullm[structured]): at most one of these."""
    g = p.add_argument_group("constrained output (pip install 'cpullm[structured]')")
    one = g.add_mutually_exclusive_group()
    one.add_argument("--json-schema", metavar="FILE", default=None,
                     help="answer with JSON valid under the JSON schema in FILE")
    one.add_argument("--json-object", action="store_true", help="answer with any JSON object")
    one.add_argument("--grammar", metavar="FILE", default=None,
                     help="answer in the grammar in FILE: llama.cpp GBNF or llguidance Lark (told apart "
                          "by its syntax: GBNF rules use ::=, Lark rules a colon)")
    one.add_argument("--regex", metavar="RE", default=None, help="answer matching the regular expression RE")
    one.add_argument("--choice", metavar="A,B,...", default=None,
                     help="answer with exactly one of these comma-separated strings")


def constraint_spec(args) -> dict | None:
    """model.generate's constraint keyword the flags ask for, files read and bounded (None:
    unconstrained)."""
    from pathlib import Path

    from cpullm.errors import ConstraintError
    from cpullm.limits import MAX_CONSTRAINT_BYTES, parse_json, read_untrusted_bytes

    def read(flag, path):
        try:
            data = read_untrusted_bytes(Path(path), MAX_CONSTRAINT_BYTES)
            return data.decode("utf-8")
        except OSError as exc:
            raise ConstraintError(f"{flag} {path}: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise ConstraintError(f"{flag} {path} is not UTF-8 text") from None

    if getattr(args, "json_schema", None):
        text = read("--json-schema", args.json_schema)
        try:
            return {"json_schema": parse_json(text)}
        except ValueError as exc:
            raise ConstraintError(f"--json-schema {args.json_schema} is not valid JSON: {exc}") from None
    if getattr(args, "json_object", False):
        return {"json_object": True}
    if getattr(args, "grammar", None):
        return {"grammar": read("--grammar", args.grammar)}
    if getattr(args, "regex", None) is not None:
        return {"regex": args.regex}
    if getattr(args, "choice", None) is not None:
        return {"choice": [c for c in args.choice.split(",")]}
    return None


def compiled_note(seconds: float) -> str:
    """The stats line's note on numba compile time (a cold kernel cache: first run only); prefill
    and decode rates never include it."""
    return f", kernels compiled in {seconds:.1f} s (first run only)" if seconds >= 0.05 else ""


def check_chat_template(args) -> None:
    """Refuse --chat before loading (which compiles): the model needs a chat template, and that
    template must accept this conversation (some reject a system message). Resolves a store name
    or the default model into ``args.model`` so the load that follows uses the same directory."""
    from cpullm.generate.chat import render_template, require_template
    from cpullm.model import resolve_model_dir

    if args.model is None:
        from cpullm.store import ensure_default_model
        args.model = str(ensure_default_model(progress=progress_printer("default model")))
    template = require_template(resolve_model_dir(args.model))
    messages = [*([{"role": "system", "content": args.system}] if args.system else []),
                {"role": "user", "content": args.prompt}]
    render_template(template, messages)


def run(args) -> int:
    from cpullm.errors import PromptError
    from cpullm.generate.generate import GenerationStats

    if not settle_prompt(args):
        return open_chat(args)
    args.max_tokens = 64 if args.max_tokens is None else args.max_tokens
    args.temperature = 0.0 if args.temperature is None else args.temperature
    if args.max_tokens <= 0:
        raise PromptError(f"-n must be >= 1, got {args.max_tokens}")
    from .chat import require_utf8
    require_utf8("-p", args.prompt)
    require_utf8("--system", args.system)
    if not args.prompt.strip():
        raise PromptError("the prompt is empty: give some text after the model, with -p, or on stdin")
    from cpullm.generate.sampling import SamplingParams
    SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p, args.repetition_penalty,
                   args.seed).validate()                 # refused before loading, on one line
    if args.chat:
        check_chat_template(args)
    spec = constraint_spec(args)
    if spec is not None:
        from cpullm.generate.constraints import load_llguidance
        load_llguidance()                   # a missing extra is an error before the model loads
    model = compile_first(load_model(args))
    if args.prompt_cache:
        model.use_prompt_cache(args.prompt_cache)
    stats = GenerationStats()
    surface = spec or {}                # model.generate's keywords
    pieces = model.generate(args.prompt, max_new_tokens=args.max_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            repetition_penalty=args.repetition_penalty, seed=args.seed,
                            stop=args.stop, chat=args.chat, system=args.system, stats=stats, **surface)
    if args.json:
        text = "".join(pieces)
        out = {"model": str(model.model_dir), "family": model.family.name, "quant": model.quant,
               "text": text, "cache": model.cache_status, **stats.as_dict(),
               "load_s": model.load_s, "load_compile_s": model.compile_s}
        if args.prompt_cache:
            out["prompt_cache"] = model.prompt_cache_status
        if args.prompt_cache:
            model.save_prompt_cache()
        from ...serve.openai import json_text

        print(json_text(out))
        return 0
    from .chat import terminal_safe
    for piece in pieces:            # a model's text must not drive the terminal (--json: exact, escaped)
        sys.stdout.write(terminal_safe(piece))
        sys.stdout.flush()
    if args.prompt_cache:
        model.save_prompt_cache()
    sys.stdout.write("\n")
    if args.no_stats:
        return 0
    print(f"[{stats.prompt_tokens} prompt tokens, prefill {stats.prefill_tps:.1f} tok/s, "
          f"{stats.generated_tokens} generated, decode {stats.decode_tps:.1f} tok/s, "
          f"{model.quant}, {model.threads} threads, cache {model.cache_status}"
          + (f", prompt cache {model.prompt_cache_status}" if args.prompt_cache else "")
          + compiled_note(model.compile_s + stats.compile_s) + "]",
          file=sys.stderr)
    return 0
