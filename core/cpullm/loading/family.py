"""What a family plugin declares: FamilySpec, its typed Args and optional KernelSpecs."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import attrs

from .. import limits
from ..errors import ConfigError, CpullmError, UnsupportedConfigError


@attrs.define
class Args:
    """Base of a family's typed arguments.

    Subclasses are ``@attrs.define`` classes whose fields are config.json keys. ``from_config``
    keeps the keys that name an ``__init__`` argument and ignores the rest, including keys that
    match a derived field declared ``attrs.field(init=False)``; ``derive()`` (override it) fills
    defaults that depend on other fields, in one place. A multimodal wrapper's ``text_config`` is
    read with :func:`text_config` by the family.
    """

    @classmethod
    def from_config(cls, config: dict) -> "Args":
        names = {f.alias or f.name for f in attrs.fields(cls) if f.init}
        kwargs = {k: v for k, v in config.items() if k in names}
        try:
            args = cls(**kwargs)
        except TypeError as exc:
            raise ConfigError(f"config.json does not fit {cls.__qualname__}: {exc}") from None
        args.derive(config)
        return args

    def derive(self, config: dict) -> None:
        """Fill derived defaults (head_dim from hidden/heads, layer types, ...). Override."""


def text_config(config: dict) -> dict:
    """The text model's settings: ``config['text_config']`` merged over the wrapper's keys when the
    checkpoint is a multimodal wrapper, else ``config`` itself. Token ids set only on the wrapper
    (eos_token_id, ...) are kept."""
    sub = config.get("text_config")
    if not isinstance(sub, dict):
        return config
    merged = {k: v for k, v in config.items() if k not in ("text_config", "vision_config")}
    merged.update(sub)
    return merged


def require(condition: bool, key: str, value: Any, supported: str) -> None:
    """Raise an UnsupportedConfigError naming the config key when ``condition`` is false."""
    if not condition:
        raise UnsupportedConfigError(
            f"config key {key!r} = {value!r} is not supported by this family (supported: {supported})"
        )


@attrs.define(frozen=True)
class RopeSpec:
    """Rotary embedding of one layer kind: ``inv_freq`` (rotary_dim/2,) already scaled.

    A plugin's RoPE scaling (:class:`RopeType`) sets ``scaling`` (its name), ``scaling_params``
    (the rope parameters as sorted JSON) and ``scaling_version``: the compiler then computes the
    frequencies for the program's context length, and ``inv_freq`` / ``attention_scaling`` hold
    them for context 0 (what Args validation evaluated).
    """

    theta: float
    rotary_dim: int
    inv_freq: tuple  # of float, len rotary_dim // 2
    attention_scaling: float = 1.0
    scaling: str = ""
    scaling_params: str = ""
    scaling_version: str = ""


def _formats(value, kind: str, field: str) -> tuple:
    """A FamilySpec format field checked at construction (a wrong entry fails the plugin's hook,
    which ``cpullm families`` reports)."""
    from .. import toolcalls
    return toolcalls.check_formats(value, getattr(toolcalls, kind), field)


@attrs.define
class FamilySpec:
    """One model family (a set of ``model_type`` strings sharing one implementation); the
    reference for its fields.

    name          short name shown by ``cpullm families`` and in ``model.info()``
    model_types   tuple of config.json ``model_type`` values it handles
    args_class    a subclass of :class:`Args` (see there); its ``derive`` refuses at load, with
                  :class:`cpullm.errors.UnsupportedConfigError` naming the config key
                  (:func:`require`), any setting the family cannot run faithfully
    weight_map    ``(args) -> cpullm.loading.weightmap.WeightMap``: checkpoint names to canonical names,
                  as data (module docstring of :mod:`cpullm.loading.weightmap`)
    build_graph   ``(args, g: cpullm.graph.ir.GraphBuilder) -> cpullm.graph.ir.Graph``: adds the model's
                  nodes (from :mod:`cpullm.graph.blocks`) and returns ``g.build(logits)``
    architectures tuple of config ``architectures`` names; a config whose ``model_type`` no
                  installed family claims goes to the family claiming one of its architectures
    priority      int, default 0: when two installed families claim one model_type (or
                  architecture), the higher priority wins; a tie goes to the plugin distribution
                  name in alphabetical order, then the family name; never silently (a
                  :class:`cpullm.loading.plugins.PluginConflictWarning`, listed by ``cpullm families``)
    description   one line shown by ``cpullm families``
    tiny_config   a tiny config.json (dict) of the family: a few layers, small widths, a
                  vocabulary of at most 384 (the byte-level test tokenizer's), built like the real
                  checkpoints (head layout, RoPE kind, tying). cpullm's registry-coverage test
                  runs the conformance kit (:func:`cpullm.testing.run_family_conformance`) on it
                  for every installed family; a family without one fails that test
    tool_formats  tuple of :class:`cpullm.toolcalls.ToolFormat`: how the family's checkpoints
                  write a tool call; the first whose ``detect`` accepts the checkpoint's chat
                  template applies (none: tool calls are read only from fenced JSON blocks)
    reasoning_formats  tuple of :class:`cpullm.toolcalls.ReasoningFormat`: how the checkpoints
                  that think mark their thinking, chosen the same way (none: the model does not
                  think; ``enable_thinking`` and ``reasoning_effort`` are refused)
    context_limit  ``(args) -> int | None``: the most positions the checkpoint can address, when
                  it has a hard limit (a learned position table: GPT-2's ``n_positions``); the core
                  loads it with at most that context by default and refuses a larger ``n_ctx`` at
                  load with a one-line ConfigError naming the fix. None (default): no hard limit
                  (RoPE models run past ``max_position_embeddings`` if asked to)
    config_keys   ``{key: bound}`` for config.json keys under this family's own names
                  (GPT-2's ``n_embd``, ``n_layer``, ...), which the core's common checks do not
                  know: ``bound`` is a common key whose check applies (``"hidden_size"``,
                  ``"num_hidden_layers"``, ``"max_position_embeddings"``, ``"layer_norm_eps"``...:
                  the ranges of cpullm.limits), or an explicit ``(lowest, highest)`` integer
                  range. Checked before the Args are built, so no family allocates from an
                  absurd value; a bad value is a ConfigError naming the key
    plugin, plugin_version  filled in by cpullm from the plugin's distribution
    """

    name: str
    model_types: tuple
    args_class: type
    weight_map: Callable
    build_graph: Callable
    architectures: tuple = ()
    priority: int = 0
    description: str = ""
    tiny_config: dict | None = None
    tool_formats: tuple = attrs.field(default=(), converter=lambda v: _formats(v, "ToolFormat", "tool_formats"))
    reasoning_formats: tuple = attrs.field(
        default=(), converter=lambda v: _formats(v, "ReasoningFormat", "reasoning_formats"))
    plugin: str | None = None
    plugin_version: str | None = None
    context_limit: Callable | None = None
    config_keys: dict = attrs.field(factory=dict, converter=lambda v: _config_keys(v))

    def args(self, config: dict) -> Args:
        """Typed Args; a config value the family cannot use (a type it does not expect, a zero it
        divides by) is a ConfigError naming the family, never a traceback."""
        check_family_keys(config, self.config_keys)
        try:
            return self.args_class.from_config(config)
        except CpullmError:
            raise
        except (TypeError, ValueError, ZeroDivisionError, OverflowError, KeyError, IndexError) as exc:
            raise ConfigError(f"config.json does not fit the {self.name} family "
                              f"({type(exc).__name__}: {exc}); check the config's values against "
                              "the checkpoint") from None


def _config_keys(value) -> dict:
    """FamilySpec.config_keys checked at construction (a wrong entry fails the plugin's hook)."""
    if not isinstance(value, dict):
        raise TypeError("FamilySpec.config_keys must be a dict {config key: bound}")
    for key, bound in value.items():
        ok = (bound in _INT_RANGES or bound in _FLOAT_RANGES if isinstance(bound, str) else
              isinstance(bound, tuple) and len(bound) == 2 and all(limits.is_int(b) for b in bound))
        if not ok:
            raise ValueError(f"FamilySpec.config_keys[{key!r}] = {bound!r}: give a common key whose check "
                             f"applies ({', '.join(sorted(_INT_RANGES) + sorted(_FLOAT_RANGES))}) or a "
                             "(lowest, highest) integer range")
    return dict(value)


def check_family_keys(config: dict, keys: dict, where: str = "config.json") -> None:
    """Raise ConfigError when a family-specific key (FamilySpec.config_keys) has the wrong type or
    a value outside its bound; in a multimodal wrapper's text_config as well."""
    if not keys:
        return
    sections = [(where, config)]
    if isinstance(config.get("text_config"), dict):
        sections.append((f"{where} (text_config)", text_config(config)))
    for place, cfg in sections:
        for key, bound in keys.items():
            value = cfg.get(key)
            if isinstance(bound, tuple):
                _check_int(place, key, value, *bound)
            elif bound in _INT_RANGES:
                _check_int(place, key, value, *_INT_RANGES[bound])
            else:
                _check_float(place, key, value, *_FLOAT_RANGES[bound])


def resolve_context(family: "FamilySpec", args: Args, n_ctx: int | None, default: int) -> int:
    """The context a model loads with: ``n_ctx``, else the smallest of ``default``, the
    checkpoint's ``max_position_embeddings`` and the family's hard limit. An ``n_ctx`` over the
    hard limit (FamilySpec.context_limit) is a one-line ConfigError naming the fix."""
    limit = family.context_limit(args) if family.context_limit is not None else None
    if n_ctx is None or n_ctx == 0:
        own = int(getattr(args, "max_position_embeddings", 0) or default)
        ctx = min(default, own, int(limit) if limit else default)
    else:
        ctx = int(n_ctx)
    if ctx <= 0:
        raise ConfigError(f"n_ctx must be positive, got {ctx}")
    if limit and ctx > int(limit):
        raise ConfigError(f"n_ctx {ctx} is more than the {int(limit)} positions a {family.name} checkpoint can "
                          f"address; load with n_ctx <= {int(limit)} (cpullm.load(..., n_ctx=N) / --ctx N)")
    return ctx


@attrs.define
class KernelSpec:
    """An optional fused kernel that replaces the core's reference kernel for ``op``.

    ``fn`` takes exactly the reference kernel's arguments; ``supports(node)`` says where it applies.
    """

    name: str
    op: Any                    # cpullm.graph.ir.Op
    fn: Callable
    supports: Callable = lambda node: True
    version: str = "1"
    plugin: str | None = None


@attrs.define
class OpSpec:
    """An IR op contributed by a plugin (hook ``cpullm_ops``): a graph adds it with
    ``g.op(node_name, spec.name, inputs, weights={role: canonical}, **attrs)``.

    name       unique across plugins; prefix it with the plugin's name ("myplugin.gelu_erf")
    width      shape rule ``(input_widths: tuple[int], attrs: dict) -> int``: the output's
               columns (every value is a (T, width) float32 matrix); raise ValueError to refuse
    reference  numpy reference ``(inputs, weights, attrs, pos0) -> (T, width) array``: ``inputs``
               a list of (T, w_i) float32 arrays, ``weights`` role -> float32 array (its shape),
               ``attrs`` the node's attributes (JSON values: tuples arrive as lists), ``pos0`` the
               sequence position of row 0 (rows are consecutive positions in the body)
    prefill    optional fast kernel for T rows (numba ``@njit`` functions fit; compile lazily):
               ``fn(out, *inputs, *weights, params, pos0)`` writing ``out`` (T, width) in place;
               inputs and out are row-strided float32 views of the activation arena, weights
               in ``weight_roles`` order (float32 arrays; an OpMatrix for a role of
               ``matrices``), ``params`` a float64 array of the node's
               ``params`` attributes in order, ``pos0`` an int
    decode     optional fast kernel for one row (decode steps), same arguments as ``prefill``
    weight_roles  ``(input_widths, attrs) -> {role: shape}``: the weights a node reads (default none)
    matrices   roles (of ``weight_roles``) that are matrices (N, K) multiplied by activations:
               the compiler packs them like LINEAR weights (int8 panels, 4-bit blocks, a GGUF's
               own blocks; float32 under "f32" or the node's ``precision="f32"``), and the fast
               kernels receive each as a :class:`cpullm.run.op_matrix.OpMatrix` (``w.matmul(x, out)``:
               out (T, N) = x (T, K) @ W.T by the core's LINEAR kernels; ``w.shape``), the
               reference as float32 (N, K), the values the program holds. Other roles stay float32
    params     names of the numeric node attributes the fast kernels receive, in order
    group      profile group of its nodes (default: the op's name)
    version    enters the execution-cache key through the graph (``op_version`` attribute):
               bump it whenever the op's results change

    Plugin ops are stateless (no KV cache or recurrent state of their own) and row-wise in
    decode. A missing fast kernel falls back to the other one, then to the reference. Each call
    is one Python call per node and step: performance-critical standard ops belong in the core
    (docs/INTERNALS.md, "Which ops live where").
    """

    name: str
    width: Callable
    reference: Callable
    prefill: Callable | None = None
    decode: Callable | None = None
    weight_roles: Callable = lambda widths, attrs: {}
    matrices: tuple = ()
    params: tuple = ()
    group: str = ""
    version: str = "1"
    plugin: str | None = None


@attrs.define
class RopeType:
    """A RoPE scaling contributed by a plugin (hook ``cpullm_rope_types``), selected by a
    config's ``rope_type`` (``rope_parameters`` / ``rope_scaling``) like the core's own.

    name       the ``rope_type`` value it handles; the core's ("default", "linear", "llama3")
               cannot be replaced
    inv_freq   ``(params: dict, rotary_dim: int, n_ctx: int) -> (inv_freq, attention_scaling)``:
               the (rotary_dim/2,) frequencies and the factor cos and sin are multiplied by.
               ``params`` are the layer type's rope parameters (what
               :func:`cpullm.graph.blocks.rope_parameters` returns, plus anything the family adds,
               such as ``original_max_position_embeddings``); ``n_ctx`` is the context the
               program is compiled for, so a scaling that depends on the sequence length (Phi-3's
               ``longrope``: short factors up to the original context, long ones beyond) picks
               its variant here. Called when the family's Args are built (``n_ctx=0``, to refuse
               bad parameters at load with :class:`cpullm.errors.UnsupportedConfigError`) and
               when the program is compiled.
    version    enters the execution-cache key through the graph: bump it when results change
    """

    name: str
    inv_freq: Callable
    version: str = "1"
    plugin: str | None = None


@attrs.frozen
class GGUFLayout:
    """How llama.cpp stores one tensor other than transformers does, beyond its name (an entry
    of :attr:`GGUFArch.tensor_layouts`). Reading applies, in order: the row and column gathers,
    ``to_hf`` on the values, ``- 1`` for ``add_one``, the reshape to ``hf_shape``; cpullm's writer
    applies the inverse (``to_gguf``, scatters, reshape to ``gguf_shape``).

    gguf_shape  the stored shape (numpy order, ggml's ne reversed); a file whose tensor has
                another is refused, naming it (None: not checked)
    hf_shape    transformers' shape when it differs from the stored one (same number of values)
    rows        int array: transformers row i is stored row ``rows[i]`` (a permutation; whole rows
                of quantized blocks move, so the tensor still runs as it is stored)
    columns     int array: the same over the last axis (runs as stored only when it moves whole blocks)
    to_hf       elementwise function of the stored float32 values (``np.log(-a)``); its inverse is
    to_gguf     the writer's (both or neither)
    add_one     stored as ``1 + w``
    """

    gguf_shape: tuple | None = None
    hf_shape: tuple | None = None
    rows: Any = None
    columns: Any = None
    to_hf: Callable | None = None
    to_gguf: Callable | None = None
    add_one: bool = False

    @property
    def moves_values(self) -> bool:
        """True when the stored bytes cannot be run as they are (values change, not just order)."""
        return self.to_hf is not None or self.add_one


@attrs.define
class GGUFArch:
    """How one GGUF ``general.architecture`` becomes a Hugging Face checkpoint (hook
    ``cpullm_gguf_architectures``): ``cpullm convert`` converts exactly the architectures that
    installed plugins declare, and writes test/benchmark GGUFs with the same tables in reverse.

    name             the GGUF ``general.architecture`` value ("qwen2"); unique across plugins
    model_type       config.json ``model_type`` of the converted checkpoint
    architectures    config.json ``architectures`` of the converted checkpoint
    layer_names      GGUF layer leaf -> transformers leaf (``blk.N.<leaf>.weight`` ->
                     ``model.layers.N.<hf leaf>.weight``); :data:`cpullm.loading.gguf_file.DENSE_LAYER_NAMES`
                     and ``QK_NORM_LAYER_NAMES`` hold llama.cpp's standard ones to build on. A key
                     with its kind (``"ssm_dt.bias"``) or a tensor stored without one (``"ssm_a"``,
                     ``blk.N.ssm_a``) maps to the whole transformers name after ``model.layers.N.``
    required_layer_leaves  GGUF leaves every layer must have (a file missing one is refused)
    layer_tensors    ``(meta, layer) -> names after "blk.N."`` a layer must have, for architectures
                     whose layers differ (hybrid); given, it replaces ``required_layer_leaves``
    tensor_layouts   ``(meta) -> {name: GGUFLayout}``: tensors llama.cpp reorders, rescales or
                     reshapes, by name without ``blk.N.`` (``"attn_qkv.weight"``, ``"ssm_a"``,
                     ``"output_norm.weight"``), from the file's metadata; read with ``meta_int``
    permute_qk       llama.cpp permuted the q/k rows of this architecture (undone on convert)
    norm_offset      llama.cpp stores this architecture's norm weights as ``1 + w``
    head_dim_keys    metadata keys (after ``{name}.``) that give head_dim, first present wins;
                     none present: hidden / heads
    config_extras    ``(meta, hp, tensor_names) -> dict``: config.json keys beyond the shared
                     ones (``meta`` the GGUF metadata, ``hp`` the checked hyperparameters under
                     transformers' names plus ``"arch"``, ``tensor_names`` the file's tensors);
                     read numbers with :func:`cpullm.loading.gguf_file.meta_int` so bad files are refused
    sentencepiece    for ``tokenizer.ggml.model == "llama"`` vocabularies: "metaspace"
                     (Metaspace pre-tokenizer, merges from scores) or "replace_spaces" (a
                     normalizer turns " " into "▁"; merges rebuilt from token order)
    pre_tokenizer_splits  ``tokenizer.ggml.pre`` value -> split regex of byte-level vocabularies
                     (the union over installed plugins is used; an unlisted one gets GPT-2's)
    end_of_turn_tokens  token texts that end a chat turn; each one a converted chat template
                     uses is added to generation_config's eos ids (union over installed plugins)
    """

    name: str
    model_type: str
    architectures: tuple
    layer_names: dict
    required_layer_leaves: tuple
    permute_qk: bool = False
    norm_offset: bool = False
    head_dim_keys: tuple = ("attention.key_length",)
    config_extras: Callable = lambda meta, hp, tensor_names: {}
    layer_tensors: Callable | None = None
    tensor_layouts: Callable = lambda meta: {}
    sentencepiece: str = "metaspace"
    pre_tokenizer_splits: dict = attrs.field(factory=dict)
    end_of_turn_tokens: tuple = ()
    plugin: str | None = None


def read_config(model_dir: Path) -> dict:
    """config.json as a dict, checked by :func:`check_config`, with errors that name the fix.

    config.json is untrusted: it is read only if it is a regular file of bounded size, and every
    shape setting is checked against cpullm.limits before a family allocates anything from it.
    """
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path} is missing: a model directory needs the checkpoint's config.json")
    try:
        config = limits.read_json_file(path)
    except OSError as exc:
        raise ConfigError(f"cannot read {path} ({exc.strerror or exc}); restore the file from the "
                          "checkpoint") from None
    except ValueError as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc}); restore the file from the checkpoint") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    check_config(config, str(path))
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        try:
            gen_config = limits.read_json_file(gen)
        except (OSError, ValueError):
            gen_config = {}
        config["_generation_config"] = gen_config if isinstance(gen_config, dict) else {}
    return config


# ---------------------------------------------------------------------------------------------
# Sanity checks of an untrusted config (family-independent: the common Hugging Face keys)
# ---------------------------------------------------------------------------------------------

# key -> (smallest, largest) for integer settings; None (absent / null) is always accepted.
_INT_RANGES = {
    "num_hidden_layers": (1, limits.MAX_LAYERS),
    "hidden_size": (1, limits.MAX_HIDDEN),
    "intermediate_size": (1, limits.MAX_INTERMEDIATE),
    "num_attention_heads": (1, limits.MAX_HEADS),
    "num_key_value_heads": (1, limits.MAX_HEADS),
    "head_dim": (1, limits.MAX_HEAD_DIM),
    "vocab_size": (1, limits.MAX_VOCAB),
    "max_position_embeddings": (1, limits.MAX_CONTEXT),
    "sliding_window": (0, limits.MAX_CONTEXT),
    "max_window_layers": (0, limits.MAX_LAYERS),
    "linear_num_key_heads": (1, limits.MAX_HEADS),
    "linear_num_value_heads": (1, limits.MAX_HEADS),
    "linear_key_head_dim": (1, limits.MAX_HEAD_DIM),
    "linear_value_head_dim": (1, limits.MAX_HEAD_DIM),
    "linear_conv_kernel_dim": (1, 64),
    "full_attention_interval": (1, limits.MAX_LAYERS),
    "sliding_window_pattern": (1, limits.MAX_LAYERS),
}
# key -> (lowest allowed, lowest is allowed itself) for finite float settings.
_POSITIVE = (0.0, False)
_NON_NEGATIVE = (0.0, True)
_FLOAT_RANGES = {
    "rms_norm_eps": _POSITIVE,
    "layer_norm_eps": _POSITIVE,
    "norm_eps": _POSITIVE,
    "rope_theta": _POSITIVE,
    "rope_local_base_freq": _POSITIVE,
    "partial_rotary_factor": _POSITIVE,
    "query_pre_attn_scalar": _POSITIVE,
    "final_logit_softcapping": _NON_NEGATIVE,
    "attn_logit_softcapping": _NON_NEGATIVE,
}
_BOOL_KEYS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")
_STR_KEYS = ("model_type", "hidden_act", "hidden_activation")
_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
# numeric fields of a rope_scaling / rope_parameters dict
_ROPE_FLOATS = {"factor": _POSITIVE, "rope_theta": _POSITIVE, "low_freq_factor": _POSITIVE,
                "high_freq_factor": _POSITIVE, "partial_rotary_factor": _POSITIVE,
                "attention_factor": _POSITIVE, "beta_fast": _POSITIVE, "beta_slow": _POSITIVE,
                "mscale": _POSITIVE, "mscale_all_dim": _NON_NEGATIVE}


def _bad(where: str, key: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(f"{where}: config key {key!r} = {limits.shown(value)} is invalid ({expected}); the "
                       "config is damaged or not for this runtime: restore it from the checkpoint")


# Keys whose null means "derive it" or "none" (transformers reads them so); any other key that is
# present must hold a value: null there reaches the family as None.
_NULLABLE = {"num_key_value_heads", "head_dim", "sliding_window", "max_window_layers", "sliding_window_pattern",
             "final_logit_softcapping", "attn_logit_softcapping", "query_pre_attn_scalar",
             "rope_scaling", "rope_parameters", "layer_types", "bos_token_id", "eos_token_id",
             "pad_token_id", "text_config", "architectures", "model_type", *_BOOL_KEYS}


def _check_present(where: str, cfg: dict) -> None:
    for key in (*_INT_RANGES, *_FLOAT_RANGES, *_BOOL_KEYS, *_STR_KEYS):
        if key in cfg and cfg[key] is None and key not in _NULLABLE:
            raise _bad(where, key, None, "expected a value: remove the key to use the default")


def _check_int(where: str, key: str, value: Any, lo: int, hi: int) -> None:
    if value is None:
        return
    if not limits.is_int(value) or not lo <= value <= hi:
        raise _bad(where, key, value, f"expected an integer from {lo} to {hi}")


def _check_float(where: str, key: str, value: Any, lowest: float, inclusive: bool) -> None:
    if value is None:
        return
    ok = limits.is_number(value) and (value >= lowest if inclusive else value > lowest)
    if not ok:
        relation = ">=" if inclusive else ">"
        raise _bad(where, key, value, f"expected a finite number {relation} {lowest:g}")


def _check_rope_dict(where: str, key: str, rope: Any, nested_ok: bool) -> None:
    """A rope_scaling / rope_parameters dict: flat, or (rope_parameters) one level by layer type."""
    if rope is None:
        return
    if not isinstance(rope, dict):
        raise _bad(where, key, rope, "expected an object or null")
    if nested_ok and rope and all(isinstance(v, dict) for v in rope.values()):
        for layer_type, sub in rope.items():
            _check_rope_dict(where, f"{key}.{layer_type}", sub, nested_ok=False)
        return
    for name in ("rope_type", "type"):
        if name in rope and not isinstance(rope[name], str):
            raise _bad(where, f"{key}.{name}", rope[name], "expected a string")
    for name, (lowest, inclusive) in _ROPE_FLOATS.items():
        _check_float(where, f"{key}.{name}", rope.get(name), lowest, inclusive)
    _check_int(where, f"{key}.original_max_position_embeddings",
               rope.get("original_max_position_embeddings"), 1, limits.MAX_CONTEXT)
    for name in ("short_factor", "long_factor", "mrope_section"):
        values = rope.get(name)
        if values is not None and not (isinstance(values, list) and len(values) <= limits.MAX_HEAD_DIM
                                       and all(limits.is_number(v) for v in values)):
            raise _bad(where, f"{key}.{name}", values, "expected a list of finite numbers")


def _check_section(where: str, cfg: dict) -> None:
    _check_present(where, cfg)
    for key, (lo, hi) in _INT_RANGES.items():
        _check_int(where, key, cfg.get(key), lo, hi)
    for key, (lowest, inclusive) in _FLOAT_RANGES.items():
        _check_float(where, key, cfg.get(key), lowest, inclusive)
    for key in _BOOL_KEYS:
        if cfg.get(key) is not None and not isinstance(cfg[key], bool):
            raise _bad(where, key, cfg[key], "expected true or false")
    for key in _STR_KEYS:
        if cfg.get(key) is not None and not isinstance(cfg[key], str):
            raise _bad(where, key, cfg[key], "expected a string")
    archs = cfg.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise _bad(where, "architectures", archs, "expected a list of strings")
    for key in _TOKEN_ID_KEYS:
        v = cfg.get(key)
        ids = v if isinstance(v, list) else [v]
        if v is not None and not (len(ids) <= limits.MAX_HEADS and all(limits.is_int(i) for i in ids)):
            raise _bad(where, key, v, "expected a token id or a list of token ids")
    _check_rope_dict(where, "rope_scaling", cfg.get("rope_scaling"), nested_ok=False)
    _check_rope_dict(where, "rope_parameters", cfg.get("rope_parameters"), nested_ok=True)
    _check_heads(where, cfg)
    layer_types, layers = cfg.get("layer_types"), cfg.get("num_hidden_layers")
    if layer_types is not None:
        if not (isinstance(layer_types, list) and all(isinstance(t, str) for t in layer_types)
                and len(layer_types) <= limits.MAX_LAYERS):
            raise _bad(where, "layer_types", layer_types, "expected a list of strings, one per layer")
        if layers is not None and len(layer_types) != layers:
            raise _bad(where, "layer_types", f"{len(layer_types)} entries", f"expected one per layer ({layers})")


def _check_heads(where: str, cfg: dict) -> None:
    """Head counts that divide: queries share each KV head, and head_dim derives from hidden."""
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if heads is not None and kv is not None and heads % kv:
        raise ConfigError(f"{where}: num_attention_heads = {heads} is not a multiple of "
                          f"num_key_value_heads = {kv}; the config is damaged: restore it from the checkpoint")
    hidden = cfg.get("hidden_size")
    if cfg.get("head_dim") is None and heads is not None and hidden is not None and hidden % heads:
        raise ConfigError(f"{where}: hidden_size = {hidden} is not a multiple of num_attention_heads = "
                          f"{heads} and no head_dim is given; the config is damaged: restore it from the checkpoint")


def check_config(config: dict, where: str = "config.json") -> None:
    """Raise ConfigError when a common setting has the wrong type or an absurd value.

    Counts and sizes must be integers within cpullm.limits, epsilons and RoPE settings finite and
    positive, head counts must divide, and a multimodal wrapper's ``text_config`` is checked the
    same way (over the wrapper's keys, as :func:`text_config` merges them). A family still checks
    what it alone reads; this runs first, so no family allocates from an absurd value.
    """
    sub = config.get("text_config")
    if sub is not None and not isinstance(sub, dict):
        raise _bad(where, "text_config", sub, "expected an object")
    _check_section(where, config)
    if isinstance(sub, dict):
        _check_section(f"{where} (text_config)", text_config(config))
