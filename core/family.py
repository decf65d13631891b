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
    keeps the known keys and ignores the rest; ``derive()`` (override it) fills defaults that
    depend on other fields, in one place. ``config_section`` lets a multimodal wrapper's
    ``text_config`` be read transparently (see :func:`text_config`).
    """

    @classmethod
    def from_config(cls, config: dict) -> "Args":
        names = {f.name for f in attrs.fields(cls)}
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
    """Rotary embedding of one layer kind: ``inv_freq`` (rotary_dim/2,) already scaled."""

    theta: float
    rotary_dim: int
    inv_freq: tuple  # of float, len rotary_dim // 2
    attention_scaling: float = 1.0


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
    """One model family (a set of ``model_type`` strings sharing code).

    name          short name shown by ``cpullm families``
    model_types   config.json ``model_type`` values handled
    args_class    typed Args (``from_config``)
    weight_map    ``(args) -> cpullm.weightmap.WeightMap``
    build_graph   ``(args, g: GraphBuilder) -> None``: adds the nodes from cpullm.blocks
    architectures optional config ``architectures`` names, used when model_type is absent
    priority      resolves two plugins claiming one model_type: higher wins (default 0)
    eos_token_ids optional ``(config) -> list[int]`` extra stop tokens
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
