"""Model: the public object returned by ``cpullm.load``.

Resolve the family -> typed Args -> TensorStore -> weight map -> IR graph -> ExecutionProgram
(compiled, or mapped back from the execution cache) -> Forward (the one forward path, over
slots that hold each sequence's state); plus tokenizer and generation.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np

from .compile import head_screen
from .loading import locations, plugins
from .compile.compiler import DEFAULT_CHUNK, QUANT_MODES, Program, compile_graph
from .errors import ConfigError, ModelNotFoundError, PromptError
from .run.executor import Executor
from .loading.family import read_config, resolve_context
from .run.forward import Forward
from .generate.generate import GenerationStats, generate_ids, generate_text
from .generate.sequence import resolve_max_tokens
from .graph.ir import GraphBuilder
from cpullm_kernels.setup.warmup import warmup_for_graph
from .compile.quant_blocks import BLOCK_QUANTS, BlockPlan
from .generate.sampling import SamplingParams
from .loading.tensors import TensorStore
from .loading.tokenize import Tokenizer

DEFAULT_CTX = 4096


def notice(msg: str) -> None:
    """A one-line notice to stderr (the CLI and the API share it)."""
    if os.environ.get("CPULLM_QUIET") != "1":
        print(f"cpullm: {msg}", file=sys.stderr, flush=True)


def resolve_model_dir(path) -> Path:
    """A model directory or GGUF file from a path, or a model-store name (``cpullm pull NAME``)."""
    text = str(path)
    p = Path(os.path.expanduser(text))
    if not p.exists() and ("/" in text or p.is_absolute()):
        raise ModelNotFoundError(f"model directory {p} does not exist; give a path to a Hugging Face "
                                 "checkpoint directory or a name from `cpullm list`")
    return locations.resolve_model(text)


class Model:
    def __init__(self, *, model_dir, config, family, args, graph, program, forward, tokenizer,
                 quant, threads, cache_status, load_s, kernels, weights_info, compile_s=0.0, kernel_units=()):
        self.model_dir = model_dir
        self.config = config
        self.family = family
        self.args = args
        self.graph = graph
        self.program = program
        self.forward = forward             # runs tokens of the slots it is handed
        self.executor = forward.executor   # the program's interpreter (read it; run through forward)
        self.tokenizer = tokenizer
        self.quant = quant
        self.threads = threads
        self.cache_status = cache_status
        self.load_s = load_s
        self.kernels = kernels
        self.weights_info = weights_info
        self.compile_s = compile_s         # of load_s: numba compiling kernels (0.0 when all were cached)
        self.kernel_units = list(kernel_units)   # the kernel groups compiled up front (kernels/cpullm_kernels/setup/warmup.py)
        self.eos_token_ids = _eos_ids(config, tokenizer)
        self.n_ctx = forward.n_ctx
        self.kv_dtype = program.meta.get("kv_dtype", "f32")
        self._slot = None                  # the slot lone generations run in, made on first use
        self._last_prompt: list[int] = []  # the prompt whose state _slot holds (save_prompt_cache)
        self._prompt_cache = None
        from .generate.speculative import resolve
        self.speculative = resolve()       # how generation guesses tokens (speculate())
        from functools import partial
        from .generate.chat import apply_chat_template
        tokenizer.apply_chat_template = partial(apply_chat_template, self)   # transformers' call

    # ---- loading ---------------------------------------------------------------------------
    @classmethod
    def load(cls, path, quant: str | None = None, threads: int | None = None, n_ctx: int | None = None,
             cache_dir=None, use_cache: bool = True, max_chunk: int = DEFAULT_CHUNK,
             mlock: bool = False, mmap: bool = True, plugin_kernels: bool = True,
             kv_dtype: str | None = None) -> "Model":
        """``kv_dtype``: the KV cache's format, "f16", "f32" or "q8_0" (llama.cpp's --cache-type-k/-v);
        default f16 for quantized weights, f32 for quant "f32" (cpullm.compile.kvformat)."""
        from cpullm_kernels.setup.numba_setup import configure
        from .compile.kvformat import format_code, resolve_kv_dtype

        t0 = time.perf_counter()
        if quant is not None and quant not in QUANT_MODES:
            raise ConfigError(f"quant must be one of {', '.join(QUANT_MODES)}, not {quant!r}")
        threads = configure(threads)
        model_dir = resolve_model_dir(path)
        if model_dir.is_dir():               # a store entry kept as its GGUF file
            from .loading.locations import gguf_in_dir
            model_dir = gguf_in_dir(model_dir) or model_dir
        quant, store, config, gguf_tokenizer = _source(model_dir, quant)
        _refuse_bidirectional(config, model_dir)
        kv_dtype = resolve_kv_dtype(kv_dtype, quant)
        registry = plugins.discover()
        family = registry.family_for(config)
        args = family.args(config)
        weights = family.weight_map(args).resolve(store, args)
        if weights.ignored:
            notice(f"ignoring {len(weights.ignored)} tensors this runtime does not use "
                   f"(e.g. {weights.ignored[0]}): only the text model runs")
        g = GraphBuilder()
        graph = family.build_graph(args, g)
        ctx = resolve_context(family, args, n_ctx, DEFAULT_CTX)   # within the family's hard limit
        specs = list(registry.kernels) if plugin_kernels else []
        kernels = {k.name: k for k in specs}
        kernel_fns = {k: v.fn for k, v in kernels.items()}
        # kernels this graph needs, compiled while the weights load (kernels/cpullm_kernels/setup/warmup.py)
        flags = BlockPlan(graph, weights, quant).warmup_flags(graph) if quant in BLOCK_QUANTS else {}
        warm = warmup_for_graph(graph, quant, specs, kv16=format_code(kv_dtype), **flags)
        try:
            tokenizer = gguf_tokenizer() if gguf_tokenizer else Tokenizer(model_dir)

            def calibrate(p: Program):
                warm.finish()                # the calibration runs the program
                return Executor(p, kernel_fns).head_inputs(tokenizer.encode(head_screen.HEAD_CALIBRATION_TEXT))

            def build(workdir=None) -> Program:
                program = compile_graph(graph, weights, quant=quant, n_ctx=ctx, max_chunk=max_chunk,
                                        kernels=specs, workdir=workdir, kv_dtype=kv_dtype)
                # greedy decoding's lm_head screen, its columns from real activations: int8 and
                # q4 programs (q4's Q6_K head if stored row by row: kernels/cpullm_kernels/panels/head_screen_blocks.py;
                # one in 16-row panels reads faster whole); not a GGUF run as
                # it is, whose resident weights stay within 5 % of the file's tensor bytes (Gemma
                # 3 270M's Q8_0 head with a screen: 1.47x)
                if quant in ("int8", "q4"):
                    program = head_screen.attach(program, calibrate)
                return program
            program, cache_status = _program_from_cache(
                build, model_dir=model_dir, config=config, family=family, graph=graph, weights=weights,
                store=store, quant=quant, n_ctx=ctx, max_chunk=max_chunk, kernels=specs, kv_dtype=kv_dtype,
                cache_dir=cache_dir, use_cache=use_cache, mmap=mmap)
            if mlock:
                from .run.memory import mlock_arrays
                mlock_arrays(program.arrays.values(), warn=notice)
            compile_s = warm.finish()
        except BaseException:
            warm.cancel()
            raise
        from .run.memory import check_plan_fits
        check_plan_fits(program.meta)          # the KV cache of n_ctx, planned before it is allocated
        executor = Executor(program, kernel_fns)
        compile_s += executor.warm_up()
        forward = Forward(executor, threads)
        weights_info = {"checkpoint_bytes": store.nbytes(), "params": count_params(weights, store)}
        if gguf_tokenizer:
            weights_info.update(gguf_tensor_bytes=store.tensor_bytes(), gguf_formats=store.format_bytes())
        return cls(model_dir=model_dir, config=config, family=family, args=args, graph=graph,
                   program=program, forward=forward, tokenizer=tokenizer, quant=quant,
                   threads=threads, cache_status=cache_status, load_s=time.perf_counter() - t0,
                   kernels=kernels, weights_info=weights_info, compile_s=compile_s,
                   kernel_units=warm.units)

    # ---- the lone sequence's slot ------------------------------------------------------------
    @property
    def slot(self):
        """The slot :meth:`generate`, :meth:`generate_ids` and :meth:`logits` run in (one at a
        time; its state is what :meth:`save_prompt_cache` saves), made on first use."""
        if self._slot is None:
            self._slot = self.forward.new_slot()
        return self._slot

    # ---- speculative decoding ---------------------------------------------------------------------
    def speculate(self, mode: str | None = None, draft_model=None, draft_max: int | None = None) -> "Model":
        """Set how generation guesses tokens to verify in one pass (cpullm.generate.speculative):
        ``mode`` "off", "lookup" (from the prompt and the text so far), "draft" (``draft_model``:
        a smaller model with this tokenizer, a path, store name or loaded Model) or "auto" (the
        default: lookup, then the draft model if given); at most ``draft_max`` guesses per pass
        (1..32). Greedy output is the same in every mode."""
        from .generate.speculative import DraftModel, resolve
        draft = None
        if draft_model is not None:
            dm = draft_model if isinstance(draft_model, Model) else Model.load(
                draft_model, quant=self.quant if self.quant != "gguf" else None, threads=self.threads,
                n_ctx=self.n_ctx)
            DraftModel.check_pair(dm, self)
            draft = DraftModel(dm)
        self.speculative = resolve(mode, draft_max, draft)
        return self

    # ---- prompt cache ---------------------------------------------------------------------------
    def use_prompt_cache(self, path) -> "Model":
        """Attach the prompt-cache file ``path``: the next prompts restore the state it holds when
        they start with its tokens, and :meth:`save_prompt_cache` writes the last prompt's state
        to it. A file for another model or quant raises CacheError; a stale or damaged one is
        ignored with a notice (and rewritten on save); a missing one is created on save."""
        from .run.prompt_cache import PromptCache
        self._prompt_cache = PromptCache(self, path)
        return self

    def save_prompt_cache(self, path=None):
        """Save the state of the last prompt run by :meth:`generate` / :meth:`generate_ids` to the
        attached prompt cache (or to ``path``); the write is atomic. Returns the path."""
        from .errors import CacheError
        from .run.prompt_cache import PromptCache
        pc = self._prompt_cache
        if pc is None:
            if path is None:
                raise CacheError("no prompt cache is attached: call model.use_prompt_cache(path) "
                                 "before generate(), or pass save_prompt_cache(path)")
            pc = self._prompt_cache = PromptCache(self, path, load=False)
        return pc.save(self._slot, self._last_prompt, path)

    def detach_prompt_cache(self) -> None:
        """Stop restoring from / saving to the attached prompt cache."""
        self._prompt_cache = None

    @property
    def prompt_cache(self):
        """The attached :class:`cpullm.run.prompt_cache.PromptCache`, or None."""
        return self._prompt_cache

    @property
    def prompt_cache_status(self) -> str | None:
        """``HIT (reused k of n prompt tokens)`` or ``MISS (reason)``; None without a prompt cache."""
        pc = self._prompt_cache
        return pc.status if pc is not None else None

    def logits(self, ids) -> np.ndarray:
        """float32 (T, vocab): logits at every position of a fresh sequence ``ids``."""
        ids = [int(i) for i in ids]
        if not ids:
            raise PromptError("logits() needs at least one token id")
        slot = self.slot
        self.forward.reset(slot)
        self._last_prompt = []
        out = self.forward.prefill(slot, ids, all_logits=True)
        self._last_prompt = ids
        return out

    def _run_alone(self, ids: list[int], max_new_tokens: int, params: SamplingParams, stop_ids,
                   stats: GenerationStats | None, constraint=None, logits_processors=(),
                   seq_out: list | None = None) -> Iterator[int]:
        """Token ids of ``ids`` run alone in :attr:`slot` (its prompt restored from the attached
        prompt cache, if any)."""
        self._last_prompt = list(ids)
        return generate_ids(self.forward, self.slot, ids, max_new_tokens, params, stop_ids, stats,
                            prompt_cache=self._prompt_cache, constraint=constraint,
                            logits_processors=logits_processors, seq_out=seq_out,
                            speculative=self.speculative)

    # ---- generation ----------------------------------------------------------------------------
    def _prompt_ids(self, prompt, chat: bool = False, system: str | None = None) -> list[int]:
        if isinstance(prompt, str):
            if not prompt.strip() and not chat:
                raise PromptError("the prompt is empty: give some text (-p 'Hello')")
            if chat:
                from .generate.chat import render_chat
                text = render_chat(self, [*([{"role": "system", "content": system}] if system else []),
                                          {"role": "user", "content": prompt}])
                return self.tokenizer.encode(text, add_special_tokens=False)
            return self.tokenizer.encode(prompt)
        ids = [int(i) for i in prompt]
        if not ids:
            raise PromptError("the prompt is empty: give at least one token id")
        return ids

    # ---- constraints and the sampling surface ----------------------------------------------------
    @property
    def logits_size(self) -> int:
        """Rows of the logits (may exceed the tokenizer's tokens: padded embeddings)."""
        return int(self.program.meta.get("vocab", self.tokenizer.vocab_size))

    def constraint(self, spec: dict):
        """A fresh :class:`cpullm.generate.constraints.Constraint` for one sequence of this model (``spec``
        as :func:`cpullm.generate.constraints.build_constraint` takes it)."""
        from .generate.constraints import build_constraint
        return build_constraint(spec, self.tokenizer, vocab_size=self.logits_size, eos_ids=self.eos_token_ids)

    @staticmethod
    def constraint_spec(json_schema=None, regex=None, grammar=None, choice=None, json_object=False,
                        lark=None) -> dict | None:
        """The constraint spec of the generate keywords (at most one given): ``json_schema`` (a
        dict, or a JSON string), ``regex``, ``grammar`` (GBNF or Lark, told apart by its syntax),
        ``lark`` (Lark only), ``choice`` (strings), ``json_object`` (any JSON object)."""
        from .errors import ConstraintError
        given = {k: v for k, v in (("json_schema", json_schema), ("regex", regex), ("gbnf", grammar),
                                   ("lark", lark), ("choice", choice)) if v is not None}
        if json_object:
            given["json_object"] = True
        if len(given) > 1:
            names = {"gbnf": "grammar"}
            raise ConstraintError("give one constraint (json_schema, regex, grammar, lark, choice or "
                                  f"json_object), got {', '.join(names.get(k, k) for k in given)}")
        if not given:
            return None
        kind, value = next(iter(given.items()))
        if kind == "json_schema" and isinstance(value, str):
            from .limits import parse_json
            try:
                value = parse_json(value)
            except ValueError as exc:
                raise ConstraintError(f"json_schema is not valid JSON: {exc}") from None
        if kind == "choice":
            value = list(value) if isinstance(value, (list, tuple)) else value
        return {kind: value}

    def _sampling_surface(self, temperature, top_k, top_p, min_p, repetition_penalty, seed,
                          presence_penalty=0.0, frequency_penalty=0.0, logit_bias=None, logprobs=None):
        params = SamplingParams(temperature, top_k, top_p, min_p, repetition_penalty, seed,
                                presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                logit_bias=logit_bias, logprobs=logprobs).validate()
        return params.check_surface(self.logits_size)

    def generate(self, prompt, max_tokens: int | None = None, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, min_p: float = 0.0, repetition_penalty: float = 1.0,
                 seed: int | None = None, stop: list[str] | None = None, chat: bool = False,
                 system: str | None = None, stats: GenerationStats | None = None, *,
                 json_schema=None, regex: str | None = None, grammar: str | None = None,
                 choice=None, json_object: bool = False, presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0, logit_bias: dict | None = None,
                 logits_processors=(), logprobs: int | None = None,
                 max_new_tokens: int | None = None) -> Iterator[str]:
        """Yield text pieces for ``prompt`` (text or token ids): at most ``max_tokens`` (default
        128; ``max_new_tokens`` is an alias).

        Constrained output (cpullm.generate.constraints; needs ``cpullm[structured]``): ``json_schema``,
        ``regex``, ``grammar`` (GBNF or Lark), ``choice`` or ``json_object``. The sampling
        surface (cpullm.generate.sampling): ``presence_penalty``, ``frequency_penalty``, ``logit_bias``,
        ``logits_processors`` (callables ``(token_ids, logits) -> logits``); ``logprobs`` is
        used by :meth:`generate_stream`, which yields them per token."""
        tokens, stats, _ = self._start(prompt, max_tokens, temperature, top_k, top_p, min_p, repetition_penalty,
                                       seed, chat, system, stats, json_schema, regex, grammar, choice, json_object,
                                       presence_penalty, frequency_penalty, logit_bias, logits_processors,
                                       logprobs, max_new_tokens)
        return generate_text(self.tokenizer, tokens, stop=stop, stats=stats)

    def generate_stream(self, prompt, max_tokens: int | None = None, stop: list[str] | None = None,
                        stats: GenerationStats | None = None, **options):
        """Like :meth:`generate` (``options``: its other keywords), yielding a
        :class:`cpullm.generate.generate.TokenEvent` per token (id, text, log-probability, ``logprobs``
        likeliest alternatives, seconds since the start)."""
        from .generate.generate import generate_events
        tokens, stats, holder = self._start(prompt, max_tokens, stats=stats, events=True, **options)
        return generate_events(self.tokenizer, tokens, holder, stop=stop, stats=stats)

    def _start(self, prompt, max_tokens=None, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0,
               repetition_penalty=1.0, seed=None, chat=False, system=None, stats=None, json_schema=None,
               regex=None, grammar=None, choice=None, json_object=False, presence_penalty=0.0,
               frequency_penalty=0.0, logit_bias=None, logits_processors=(), logprobs=None,
               max_new_tokens=None, events: bool = False):
        """One sequence alone, started: (its token iterator, its stats, the list its Sequence
        lands in when ``events``, for per-token log-probabilities)."""
        params = self._sampling_surface(temperature, top_k, top_p, min_p, repetition_penalty, seed,
                                        presence_penalty, frequency_penalty, logit_bias, logprobs)
        spec = self.constraint_spec(json_schema, regex, grammar, choice, json_object)
        ids = self._prompt_ids(prompt, chat=chat, system=system)
        cons = self.constraint(spec) if spec else None
        stats = stats if stats is not None else GenerationStats()
        holder: list = []
        tokens = self._run_alone(ids, resolve_max_tokens(max_tokens, max_new_tokens), params, self.eos_token_ids,
                                 stats, cons, logits_processors, seq_out=holder if events else None)
        return tokens, stats, holder

    def generate_ids(self, prompt_ids, max_tokens: int | None = None, temperature: float = 0.0,
                     top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                     repetition_penalty: float = 1.0, seed: int | None = None,
                     stats: GenerationStats | None = None, ignore_eos: bool = False, *,
                     json_schema=None, regex: str | None = None, grammar: str | None = None,
                     choice=None, json_object: bool = False, presence_penalty: float = 0.0,
                     frequency_penalty: float = 0.0, logit_bias: dict | None = None,
                     logits_processors=(), logprobs: int | None = None,
                     max_new_tokens: int | None = None) -> Iterator[int]:
        """Yield token ids from the same sampler as :meth:`generate` (``ignore_eos``: never stop
        early, as a reference comparison with EOS disabled needs)."""
        params = self._sampling_surface(temperature, top_k, top_p, min_p, repetition_penalty, seed,
                                        presence_penalty, frequency_penalty, logit_bias, logprobs)
        spec = self.constraint_spec(json_schema, regex, grammar, choice, json_object)
        cons = self.constraint(spec) if spec else None
        return self._run_alone(self._prompt_ids(prompt_ids), resolve_max_tokens(max_tokens, max_new_tokens), params,
                               () if ignore_eos else self.eos_token_ids, stats, cons, logits_processors)

    SURFACE_KEYS = ("json_schema", "regex", "grammar", "choice", "json_object", "presence_penalty",
                    "frequency_penalty", "logit_bias", "logits_processors", "logprobs")

    def generate_batch(self, prompts, max_tokens: int | None = None, temperature: float = 0.0, top_k: int = 0,
                       top_p: float = 1.0, min_p: float = 0.0, repetition_penalty: float = 1.0,
                       seed: int | None = None, stop: list[str] | None = None, sampling: list[dict] | None = None,
                       parallel: int | None = None, chat: bool = False, system: str | None = None,
                       ignore_eos: bool = False, *, max_new_tokens: int | None = None, **surface) -> list:
        """Generate for every prompt together (continuous batching: ``parallel`` sequences share
        each pass over the weights, the rest join as others finish). Returns a list of strings
        for text prompts, of token-id lists for id prompts. ``sampling``: one dict of sampling
        keywords per prompt (overrides the shared ones). A prompt's greedy output is the same as
        :meth:`generate` gives it alone, constrained or not. ``surface``: :meth:`generate`'s
        constraint and sampling-surface keywords (json_schema, regex, grammar, choice,
        json_object, presence_penalty, frequency_penalty, logit_bias, logits_processors,
        logprobs), shared or per prompt in ``sampling``; each prompt gets its own constraint."""
        from .generate.engine import generate_batch
        from .errors import ConfigError
        from .generate.generate import TextStream
        bad = sorted(set(surface) - set(self.SURFACE_KEYS))
        if bad:
            raise ConfigError(f"generate_batch() got unknown keywords {bad}; it takes {list(self.SURFACE_KEYS)}")
        prompts = list(prompts)
        ids = [self._prompt_ids(p, chat=chat, system=system) for p in prompts]
        base = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                    repetition_penalty=repetition_penalty, seed=seed, **surface)
        per = sampling if sampling is not None else [{}] * len(prompts)
        params, constraints, processors = [], [], []
        for d in per:
            kw = {**base, **dict(d)}
            spec = self.constraint_spec(kw.pop("json_schema", None), kw.pop("regex", None),
                                        kw.pop("grammar", None), kw.pop("choice", None),
                                        kw.pop("json_object", False))
            processors.append(kw.pop("logits_processors", ()))
            constraints.append(self.constraint(spec) if spec else None)
            params.append(SamplingParams(**kw).validate().check_surface(self.logits_size))
        out = generate_batch(self, ids, resolve_max_tokens(max_tokens, max_new_tokens), parallel=parallel,
                             params=params,
                             stop_ids=() if ignore_eos else None, constraints=constraints,
                             logits_processors=processors)
        texts = []
        for p, toks in zip(prompts, out):
            if not isinstance(p, str):
                texts.append(toks)
                continue
            ts = TextStream(self.tokenizer, stop)
            pieces = []
            for t in toks:
                pieces.append(ts.push(t))
                if ts.stopped:
                    break
            pieces.append(ts.flush())
            texts.append("".join(pieces))
        return texts

    # ---- embeddings ------------------------------------------------------------------------------
    def embed(self, texts, pooling: str | None = None, normalize: bool = True,
              dimensions: int | None = None) -> np.ndarray:
        """Embeddings of ``texts`` (a string, a list of strings, or token-id lists): float32
        (n, dims), one row per input. The hidden states after the final norm, pooled by
        ``pooling`` ("last" | "mean" | "cls"; None: what the checkpoint states, else "last"),
        L2-normalized unless ``normalize=False``, cut to ``dimensions`` where the model declares
        Matryoshka sizes. See :mod:`cpullm.generate.embed`."""
        from .generate.embed import token_inputs
        return self.embed_ids(token_inputs(texts, self.tokenizer, self._embed_vocab(), self.n_ctx),
                              pooling=pooling, normalize=normalize, dimensions=dimensions)

    def embed_ids(self, inputs: list[list[int]], pooling: str | None = None, normalize: bool = True,
                  dimensions: int | None = None) -> np.ndarray:
        """:meth:`embed` of token-id lists. Each input runs alone from position 0 on a second
        executor of the same program (so generation on this model is not disturbed)."""
        import threading

        from .generate.embed import check_dimensions, check_pooling, checkpoint_spec, finish, pool
        check_pooling(pooling)
        spec = getattr(self, "_embed_spec", None)
        if spec is None:
            spec = self._embed_spec = checkpoint_spec(Path(str(self.model_dir)), self.config)
        how = pooling or spec.pooling or "last"
        check_dimensions(dimensions, int(self.program.meta["hidden_width"]), spec)
        if getattr(self, "_embed_lock", None) is None:
            self._embed_lock = threading.Lock()
        with self._embed_lock:
            if getattr(self, "_embed_forward", None) is None:
                self._embed_forward = Forward(Executor(self.program, {k: v.fn for k, v in self.kernels.items()}),
                                              self.threads)
            ex = self._embed_forward
            rows = []
            for ids in inputs:
                hidden = ex.prefill_hidden(ids)          # (T, hidden), from position 0
                rows.append(finish(pool(hidden, how), normalize, dimensions))
        return np.stack(rows)

    def _embed_vocab(self) -> int:
        return int(self.program.meta.get("embed_rows") or self.program.meta["vocab"])

    def chat(self, messages, tools=None, tool_choice=None, response_format=None, stream: bool = False,
             max_tokens: int | None = None, parallel_tool_calls: bool = True, reasoning_effort=None,
             chat_template_kwargs: dict | None = None, stats: GenerationStats | None = None, *,
             max_new_tokens: int | None = None, **sampling):
        """Answer a conversation (OpenAI-style ``messages``) as the server's chat endpoint does.

        Returns the assistant message dict: ``content`` (None when the answer is only calls),
        ``tool_calls`` (OpenAI's objects, ``arguments`` a JSON string) when the model called a
        tool, ``reasoning_content`` when it thought. ``tools`` / ``tool_choice`` /
        ``parallel_tool_calls`` / ``reasoning_effort`` / ``chat_template_kwargs`` mean what they
        mean in the OpenAI API (``tool_choice`` "required", a named function or a strict tool
        constrain the call); ``response_format`` is OpenAI's (``{"type": "json_schema", ...}``).
        With ``stream`` it returns an iterator of pieces: ``{"content": str}``,
        ``{"reasoning_content": str}`` or ``{"tool_call": {...}}``. ``sampling``: the keywords of
        :meth:`generate` (temperature, top_p, seed, stop, ...)."""
        from .generate.chat import arguments_as_objects, check_messages, render_chat
        from .generate.chat_tools import plan_chat, tool_request

        body = {"tools": tools, "tool_choice": tool_choice, "parallel_tool_calls": parallel_tool_calls,
                "reasoning_effort": reasoning_effort}
        tools_, choice, parallel = tool_request(body)
        msgs = arguments_as_objects(check_messages(messages))
        plan = plan_chat(self, body, msgs, tools_, choice, parallel, dict(chat_template_kwargs or {}))
        text = render_chat(self, plan.messages, tools=plan.template_tools, **plan.template_kwargs)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        answer, constraint = plan.answer(self, text)
        if response_format is not None:
            rf = _response_format_spec(response_format)
            if rf is not None and constraint is not None:
                raise PromptError("give response_format or tools that constrain the answer "
                                  "(tool_choice 'required', a named function, strict tools), not both")
            if rf is not None:
                constraint = self.constraint(rf)
        stop = sampling.pop("stop", None)
        params = self._sampling_surface(**{**dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0,
                                                  repetition_penalty=1.0, seed=None), **sampling})
        stats = stats if stats is not None else GenerationStats()
        n = resolve_max_tokens(max_tokens, max_new_tokens, default=512)
        pieces = generate_text(self.tokenizer, self._run_alone(ids, n, params, self.eos_token_ids, stats, constraint),
                               stop=stop, stats=stats)
        parser = answer.parser()

        def events():
            for piece in pieces:
                yield from parser.push(piece)
            yield from parser.finish()

        if stream:
            return ({"tool_call": v.openai()} if k == "tool_call" else
                    {"reasoning_content" if k == "reasoning" else "content": v} for k, v in events())
        from .toolcalls import collect
        return collect(events()).message()

    def engine(self, parallel: int | None = None, prefill_chunk: int | None = None,
               prefix_cache_bytes: int | None = None):
        """A :class:`cpullm.generate.engine.Engine` on this model: submit requests from any thread, each
        with its own sampling and cancel handle; ``parallel`` streams decode together (default:
        :func:`cpullm.generate.engine.default_parallel`); prompts sharing leading chunks reuse their KV,
        within ``prefix_cache_bytes`` (default :func:`cpullm.generate.engine.default_prefix_cache_bytes`)."""
        from .generate.engine import Engine
        return Engine(self, parallel=parallel, prefill_chunk=prefill_chunk, prefix_cache_bytes=prefix_cache_bytes)

    # ---- reporting --------------------------------------------------------------------------------
    def info(self) -> dict:
        from .run.memory import memory_report, state_plan
        a = self.args
        return {
            "model_dir": str(self.model_dir),
            "family": self.family.name,
            "plugin": self.family.plugin,
            "model_type": self.config.get("model_type"),
            "params": int(self.weights_info.get("params", 0)),
            "quant": self.quant,
            "threads": self.threads,
            "n_ctx": self.n_ctx,
            "kv_dtype": self.kv_dtype,
            "layers": getattr(a, "num_hidden_layers", None),
            "vocab": self.program.meta["vocab"],
            "cache": self.cache_status,
            "load_s": self.load_s,
            "speculative": self.speculative.mode,
            "compile_s": self.compile_s,
            "prompt_cache": self.prompt_cache_status,
            "weight_formats": weight_format_bytes(self.program),
            **({"gguf_formats": self.weights_info["gguf_formats"]} if "gguf_formats" in self.weights_info else {}),
            "memory": memory_report(self),
            "context_plan": state_plan(self.program.meta),
        }


def _refuse_bidirectional(config: dict, model_dir) -> None:
    """A checkpoint whose attention sees every token both ways (EmbeddingGemma) cannot run on
    cpullm's causal attention: its outputs would be silently wrong, so it is refused."""
    sub = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    if config.get("use_bidirectional_attention") or sub.get("use_bidirectional_attention"):
        from .errors import UnsupportedConfigError
        raise UnsupportedConfigError(
            f"{model_dir} uses bidirectional attention (use_bidirectional_attention: an encoder "
            "such as EmbeddingGemma); cpullm's attention is causal only, so this model cannot run")


def _response_format_spec(response_format) -> dict | None:
    """The constraint spec of an OpenAI ``response_format`` (None for ``{"type": "text"}``)."""
    rf = response_format
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise PromptError("response_format must be {'type': 'text' | 'json_object' | 'json_schema', ...}")
    if rf["type"] == "text":
        return None
    if rf["type"] == "json_object":
        return {"json_object": True}
    return {"json_schema": (rf.get("json_schema") or {}).get("schema") or {}}


def _source(model_dir: Path, quant: str | None):
    """(quant, tensor store, config, tokenizer factory or None) of a model directory or GGUF file.

    A GGUF file runs as it is (quant "gguf": its block-format matrices executed in their own
    formats) unless ``quant`` asks for a requantization; a directory defaults to "int8"."""
    from .loading.gguf_model import GGUFStore
    if model_dir.is_file():
        store = GGUFStore(model_dir)
        return quant or "gguf", store, store.config(), store.tokenizer
    if quant == "gguf":
        raise ConfigError(f"quant='gguf' runs a GGUF file as it is, and {model_dir} is a directory; give "
                          "the .gguf file, or use quant int8, q4 or f32")
    return quant or "int8", TensorStore(model_dir), read_config(model_dir), None


def weight_format_bytes(program: Program) -> dict:
    """Bytes of the program's weights per storage format: each raw ggml block format, "int8"
    (q8 quants + binary16 scales), "f32" (float32 weights, norms, biases, RoPE tables) and, with
    one, "head_screen" (greedy decoding's compact lm_head copy, not in the others)."""
    blocks = {k: int(v) for k, v in (program.meta.get("block_bytes") or {}).items()}
    a = program.arrays
    out = dict(blocks)
    sc = program.meta.get("head_screen")
    screen_q = screen_f = 0
    if sc:                         # greedy decoding's lm_head screen: its own entry
        n = int(program.meta["vocab"])
        screen_q, screen_f = n * (int(sc["q_cols"]) + 2 * int(sc["s_cols"])), 12 * n
        out["head_screen"] = screen_q + screen_f
    q8 = int(a["wq"].nbytes) - sum(blocks.values()) + int(a["ws"].nbytes) - screen_q
    if q8 > 4096:                  # (not the alignment padding of Q8_0 matrices held as q8)
        out["int8"] = q8
    out["f32"] = int(a["wf"].nbytes) - screen_f
    return out


def count_params(weights, store) -> int:
    """Parameters of the model that runs: the elements of every checkpoint tensor the weight map
    uses, each counted once (a tied lm_head shares the embedding's; tensors the runtime ignores,
    such as a vision tower, are not counted)."""
    sources = {stored for stored, _ in weights.found.values()}
    return int(sum(int(np.prod(store.shape(name), dtype=np.int64)) for name in sources))


def _eos_ids(config: dict, tokenizer) -> list[int]:
    ids: list[int] = []
    for src in (config, config.get("text_config") or {}, config.get("_generation_config") or {}):
        v = src.get("eos_token_id")
        if isinstance(v, int):
            ids.append(v)
        elif isinstance(v, list):
            ids.extend(int(x) for x in v if isinstance(x, int))
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))





def _program_from_cache(build, **kw) -> tuple[Program, str]:
    """The execution cache (cpullm.compile.cache_format) when enabled, else a fresh compile."""
    if not kw.get("use_cache"):
        return build(), "OFF"
    from .compile.cache_format import load_or_build
    return load_or_build(build, **kw)
