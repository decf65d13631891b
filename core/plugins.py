"""Plugin discovery: a pluggy PluginManager over the ``cpullm`` entry-point group.

One broken plugin is reported (``cpullm families`` lists its error), never fatal.
"""
from __future__ import annotations

import importlib.metadata as importlib_metadata
import threading
import warnings

import attrs
import pluggy

from . import hookspecs
from .errors import PluginError, UnknownModelTypeError
from .family import FamilySpec, KernelSpec

ENTRY_POINT_GROUP = "cpullm"


@attrs.define
class PluginInfo:
    name: str                      # entry-point name
    distribution: str | None       # e.g. "cpullm-plugin-llama"
    version: str | None
    module: str
    error: str | None = None       # "ImportError: ..." when the plugin failed to load
    families: list = attrs.field(factory=list)


@attrs.define
class Registry:
    """Everything discovered from installed plugins."""

    plugins: list[PluginInfo]
    families: list[FamilySpec]
    kernels: list[KernelSpec]
    conflicts: list[str]           # human-readable notes on model_types claimed twice

    def family_for(self, config: dict) -> FamilySpec:
        """The family handling ``config['model_type']`` (or, failing that, its ``architectures``)."""
        model_type = config.get("model_type")
        for fam in self.families:
            if model_type in fam.model_types:
                return fam
        archs = config.get("architectures") or []
        for fam in self.families:
            if any(a in fam.architectures for a in archs):
                return fam
        installed = ", ".join(sorted({f.name for f in self.families})) or "none"
        hint = _install_hint(model_type)
        raise UnknownModelTypeError(
            f"model_type {model_type!r} is not handled by any installed family "
            f"(installed: {installed}); {hint}"
        )


# Which published plugin handles a model_type: only used to word the error message.
_KNOWN_PLUGINS = {
    "cpullm-plugin-llama": ("llama", "mistral"),
    "cpullm-plugin-qwen": ("qwen2", "qwen3", "qwen3_5", "qwen3_5_text"),
    "cpullm-plugin-gemma": ("gemma", "gemma2", "gemma3", "gemma3_text"),
}


def _install_hint(model_type) -> str:
    for dist, types in _KNOWN_PLUGINS.items():
        if model_type in types:
            return f"install {dist} (pip install {dist})"
    return "install a cpullm plugin for it (see `cpullm families` and CONTRIBUTING.md)"


_lock = threading.Lock()
_registry: Registry | None = None
_extra_plugins: list = []   # modules/objects registered in-process (tests), on top of entry points


def _entry_points():
    return importlib_metadata.entry_points(group=ENTRY_POINT_GROUP)


def discover(refresh: bool = False) -> Registry:
    """Load every plugin once per process (or again with ``refresh``) and collect its hooks."""
    global _registry
    with _lock:
        if _registry is not None and not refresh:
            return _registry
        pm = pluggy.PluginManager("cpullm")
        pm.add_hookspecs(hookspecs)
        infos: list[PluginInfo] = []
        for ep in sorted(_entry_points(), key=lambda e: (e.name, e.value)):
            dist = getattr(ep, "dist", None)
            info = PluginInfo(
                name=ep.name,
                distribution=dist.metadata["Name"] if dist is not None else None,
                version=dist.version if dist is not None else None,
                module=ep.value,
            )
            try:
                module = ep.load()
                pm.register(module, name=f"{info.distribution or '?'}:{ep.name}")
            except Exception as exc:  # a broken plugin is reported, never fatal
                info.error = f"{type(exc).__name__}: {exc}"
            infos.append(info)
        for obj in _extra_plugins:
            info = PluginInfo(name=getattr(obj, "__name__", repr(obj)), distribution=None,
                              version=None, module=getattr(obj, "__name__", "?"))
            pm.register(obj)
            infos.append(info)
        try:
            pm.check_pending()
        except pluggy.PluginValidationError as exc:
            warnings.warn(f"cpullm plugin hook not recognised: {exc}", stacklevel=2)

        families, kernels = [], []
        by_name = {pm.get_name(p): p for p in pm.get_plugins()}
        for info in infos:
            plugin = _plugin_for(info, by_name)
            if plugin is None:
                continue
            try:
                fams = list(_call(plugin, "cpullm_families"))
                for fam in fams:
                    if not isinstance(fam, FamilySpec):
                        raise PluginError(f"cpullm_families returned {type(fam).__name__}, not FamilySpec")
                    fam.plugin = info.distribution or info.name
                    fam.plugin_version = info.version
                info.families = fams
                families.extend(fams)
                for k in _call(plugin, "cpullm_kernels"):
                    k.plugin = info.distribution or info.name
                    kernels.append(k)
            except Exception as exc:
                info.error = f"{type(exc).__name__}: {exc}"
                info.families = []
        families, conflicts = _resolve_conflicts(families)
        _registry = Registry(plugins=infos, families=families, kernels=kernels, conflicts=conflicts)
        return _registry


def _plugin_for(info: PluginInfo, by_name: dict):
    if info.error:
        return None
    for key in (f"{info.distribution or '?'}:{info.name}", info.name):
        if key in by_name:
            return by_name[key]
    return None


def _call(plugin, hook: str):
    fn = getattr(plugin, hook, None)
    return (fn() or []) if fn is not None else []


def _resolve_conflicts(families: list[FamilySpec]):
    """Two families claiming one model_type: the higher ``priority`` wins, ties go to the plugin
    distribution name in alphabetical order; the loser keeps its other model_types and a warning
    is recorded (and shown by ``cpullm families``)."""
    owner: dict[str, FamilySpec] = {}
    conflicts = []
    ordered = sorted(families, key=lambda f: (-f.priority, f.plugin or "", f.name))
    for fam in ordered:
        for mt in fam.model_types:
            if mt in owner:
                winner = owner[mt]
                msg = (f"model_type {mt!r} is claimed by {winner.plugin}:{winner.name} and "
                       f"{fam.plugin}:{fam.name}; using {winner.plugin}:{winner.name} "
                       f"(higher priority, then plugin name order)")
                conflicts.append(msg)
                warnings.warn(msg, stacklevel=3)
            else:
                owner[mt] = fam
    resolved = []
    for fam in ordered:
        kept = tuple(mt for mt in fam.model_types if owner.get(mt) is fam)
        if kept != fam.model_types:
            fam = attrs.evolve(fam, model_types=kept)
        if kept or not fam.model_types:
            resolved.append(fam)
    return resolved, conflicts


def register_for_tests(plugin_obj) -> None:
    """Register a plugin object in this process (tests and notebooks only; entry points are the
    real mechanism). Call :func:`discover(refresh=True)` afterwards."""
    _extra_plugins.append(plugin_obj)


def unregister_for_tests(plugin_obj) -> None:
    if plugin_obj in _extra_plugins:
        _extra_plugins.remove(plugin_obj)
