"""What a family plugin declares: FamilySpec, its typed Args, LayerSpec and optional KernelSpecs."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import attrs

from .errors import ConfigError, UnsupportedConfigError


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


@attrs.define(frozen=True)
class LayerSpec:
    """Declared capabilities of one decoder layer (never guessed from weight names)."""

    mixer: str = "attention"          # "attention" | "linear_attention"
    sliding_window: int = 0           # 0 = full causal attention
    rope: RopeSpec | None = None
    attn_softcap: float = 0.0         # 0 = none
    qk_norm: bool = False
    output_gate: bool = False
    mlp: str = "glu"


@attrs.define
class FamilySpec:
    """One model family (a set of ``model_type`` strings sharing one implementation); the
    reference for its fields.

    name          short name shown by ``cpullm families`` and in ``model.info()``
    model_types   tuple of config.json ``model_type`` values it handles
    args_class    a subclass of :class:`Args` (see there); its ``derive`` refuses at load, with
                  :class:`cpullm.errors.UnsupportedConfigError` naming the config key
                  (:func:`require`), any setting the family cannot run faithfully
    weight_map    ``(args) -> cpullm.weightmap.WeightMap``: checkpoint names to canonical names,
                  as data (module docstring of :mod:`cpullm.weightmap`)
    build_graph   ``(args, g: cpullm.ir.GraphBuilder) -> cpullm.ir.Graph``: adds the model's
                  nodes (from :mod:`cpullm.blocks`) and returns ``g.build(logits)``
    architectures tuple of config ``architectures`` names; a config whose ``model_type`` no
                  installed family claims goes to the family claiming one of its architectures
    priority      int, default 0: when two installed families claim one model_type (or
                  architecture), the higher priority wins; a tie goes to the plugin distribution
                  name in alphabetical order, then the family name; never silently (a
                  :class:`cpullm.plugins.PluginConflictWarning`, listed by ``cpullm families``)
    description   one line shown by ``cpullm families``
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
    plugin: str | None = None
    plugin_version: str | None = None

    def args(self, config: dict) -> Args:
        return self.args_class.from_config(config)


@attrs.define
class KernelSpec:
    """An optional fused kernel that replaces the core's reference kernel for ``op``.

    ``fn`` takes exactly the reference kernel's arguments; ``supports(node)`` says where it applies.
    """

    name: str
    op: Any                    # cpullm.ir.Op
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
               float32 arrays in ``weight_roles`` order, ``params`` a float64 array of the node's
               ``params`` attributes in order, ``pos0`` an int
    decode     optional fast kernel for one row (decode steps), same arguments as ``prefill``
    weight_roles  ``(input_widths, attrs) -> {role: shape}``: the weights a node reads (default none)
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
               :func:`cpullm.blocks.rope_parameters` returns, plus anything the family adds,
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


def read_config(model_dir: Path) -> dict:
    """config.json as a dict, with errors that name the fix."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path} is missing: a model directory needs the checkpoint's config.json")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc}); restore the file from the checkpoint") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        try:
            config["_generation_config"] = json.loads(gen.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            config["_generation_config"] = {}
    return config
