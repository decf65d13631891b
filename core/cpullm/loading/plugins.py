"""Plugin discovery: a pluggy PluginManager over the ``cpullm`` entry-point group.

One broken plugin is reported (``cpullm families`` lists its error), never fatal: a plugin that
raises on import, misspells a hook, forgets ``@hookimpl``, or returns something that is not a
FamilySpec / KernelSpec gets an ``error`` in its :class:`PluginInfo` and contributes nothing;
every other plugin still works.

Two families claiming one ``model_type`` (or one ``architectures`` name) are resolved
deterministically: the higher :attr:`FamilySpec.priority` wins, a tie goes to the plugin
distribution name in alphabetical order, then to the family name. The loser keeps its other
model_types. Every such conflict is recorded in :attr:`Registry.conflicts` (``cpullm families``
prints it) and emitted as a :class:`PluginConflictWarning` on stderr: never a silent pick.
"""
from __future__ import annotations

import json
import importlib.metadata as importlib_metadata
import threading
import warnings
from pathlib import Path

import attrs
import pluggy

from .. import hookspecs
from ..errors import PluginError, UnknownModelTypeError
from .family import Args, FamilySpec, GGUFArch, KernelSpec, OpSpec, RopeType

ENTRY_POINT_GROUP = "cpullm"
HOOKS = tuple(sorted(n for n in dir(hookspecs) if n.startswith("cpullm_")))


class PluginConflictWarning(UserWarning):
    """Two installed families claim the same model_type or architecture (see the module doc)."""


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
    families: list[FamilySpec]     # conflicts resolved, in precedence order
    kernels: list[KernelSpec]
    conflicts: list[str]           # human-readable notes on model_types claimed twice
    ops: dict = attrs.field(factory=dict)          # OpSpec.name -> OpSpec
    rope_types: dict = attrs.field(factory=dict)   # RopeType.name -> RopeType
    gguf_architectures: dict = attrs.field(factory=dict)   # GGUFArch.name -> GGUFArch

    def pre_tokenizer_splits(self) -> dict:
        """``tokenizer.ggml.pre`` -> split regex, over every installed GGUF architecture."""
        out: dict = {}
        for arch in self.gguf_architectures.values():
            out.update(arch.pre_tokenizer_splits)
        return out

    def end_of_turn_tokens(self) -> tuple:
        """Every installed GGUF architecture's end-of-turn token texts, first mention first."""
        return tuple(dict.fromkeys(t for a in self.gguf_architectures.values() for t in a.end_of_turn_tokens))

    def op(self, name: str) -> OpSpec:
        """The installed plugin op ``name``; a PluginError naming the installed ones otherwise."""
        if name not in self.ops:
            raise PluginError(f"op {name!r} is not provided by any installed plugin (installed ops: "
                              f"{', '.join(sorted(self.ops)) or 'none'}); install the plugin that provides it")
        return self.ops[name]

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
        broken = [f"{p.distribution or p.name} ({p.error})" for p in self.plugins if p.error]
        note = f"; plugins that failed to load: {'; '.join(broken)}" if broken else ""
        raise UnknownModelTypeError(
            f"model_type {model_type!r} is not handled by any installed family "
            f"(installed: {installed}); {hint}{note}"
        )


# Which published plugin handles a model_type: only used to word the error message.
def _install_hint(model_type) -> str:
    """Which published plugin handles ``model_type``, from the index shipped as data
    (plugin_index.json beside this module), or the general hint."""
    try:
        index = json.loads((Path(__file__).parent / "plugin_index.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        index = {}
    for dist, types in index.items():
        if isinstance(types, list) and model_type in types:
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
        loaded: list[tuple[PluginInfo, object]] = []
        for ep in sorted(_entry_points(), key=lambda e: (e.name, e.value)):
            dist = getattr(ep, "dist", None)
            info = PluginInfo(
                name=ep.name,
                distribution=dist.metadata["Name"] if dist is not None else None,
                version=dist.version if dist is not None else None,
                module=ep.value,
            )
            try:
                plugin = ep.load()
            except (Exception, SystemExit) as exc:  # a broken plugin is reported, never fatal
                info.error = f"{type(exc).__name__}: {exc}"
                plugin = None
            loaded.append((info, plugin))
        for obj in _extra_plugins:
            name = getattr(obj, "__name__", None) or repr(obj)
            loaded.append((PluginInfo(name=name, distribution=None, version=None, module=name), obj))

        infos: list[PluginInfo] = []
        families: list[FamilySpec] = []
        kernels: list[KernelSpec] = []
        ops: dict[str, OpSpec] = {}
        rope_types: dict[str, RopeType] = {}
        gguf_archs: dict[str, GGUFArch] = {}
        for info, plugin in loaded:
            infos.append(info)
            if plugin is None:
                continue
            try:
                _check_hooks(plugin)
                pm.register(plugin, name=f"{info.distribution or '?'}:{info.name}")
                unknown = [hc.name for hc in pm.get_hookcallers(plugin) or [] if not hc.has_spec()]
                if unknown:
                    raise PluginError(f"{', '.join(unknown)}: not a cpullm hook "
                                      f"(hooks: {', '.join(HOOKS)})")
                fams = [_check_family(f) for f in _call(pm, plugin, "cpullm_families")]
                owner = info.distribution or info.name
                for fam in fams:
                    fam.plugin = owner
                    fam.plugin_version = info.version
                kerns = [_check_kernel(k) for k in _call(pm, plugin, "cpullm_kernels")]
                for k in kerns:
                    other = next((o for o in kernels if o.name == k.name), None)
                    if other is not None:
                        raise PluginError(f"kernel name {k.name!r} is already registered by "
                                          f"{other.plugin}; prefix kernel names with the plugin's")
                    k.plugin = owner
                new_ops = _named(owner, "op", [_check_op(o) for o in _call(pm, plugin, "cpullm_ops")], ops)
                new_ropes = _named(owner, "rope type",
                                   [_check_rope_type(r) for r in _call(pm, plugin, "cpullm_rope_types")],
                                   rope_types)
                new_archs = _named(owner, "GGUF architecture",
                                   [_check_gguf_arch(a) for a in _call(pm, plugin, "cpullm_gguf_architectures")],
                                   gguf_archs)
                _check_pre_tokenizers(owner, new_archs, gguf_archs)
            except Exception as exc:
                info.error = f"{type(exc).__name__}: {exc}"
                continue
            info.families = fams
            families.extend(fams)
            kernels.extend(kerns)
            ops.update(new_ops)
            rope_types.update(new_ropes)
            gguf_archs.update(new_archs)
        families, conflicts = _resolve_conflicts(families)
        _registry = Registry(plugins=infos, families=families, kernels=kernels, conflicts=conflicts,
                             ops=ops, rope_types=rope_types, gguf_architectures=gguf_archs)
        return _registry


def _check_hooks(plugin) -> None:
    """A misspelled hook, or a hook without ``@hookimpl`` (pluggy would silently skip it), is an
    error of that plugin, named in ``cpullm families``."""
    problems = []
    for attr in dir(plugin):
        if not attr.startswith("cpullm_"):
            continue
        fn = getattr(plugin, attr, None)
        if not callable(fn) or hasattr(fn, "cpullm_spec"):   # hookspecs re-exported: fine
            continue
        if attr not in HOOKS:
            problems.append(f"{attr} is not a cpullm hook (hooks: {', '.join(HOOKS)})")
        elif not hasattr(fn, "cpullm_impl"):
            problems.append(f"{attr} is not marked with @hookimpl "
                            "(from cpullm.hookspecs import hookimpl)")
    if problems:
        raise PluginError("; ".join(problems))


def _call(pm: pluggy.PluginManager, plugin, hook: str) -> list:
    """The results of one plugin's implementation of ``hook`` (each plugin separately, so one
    plugin's failure is attributed to it alone)."""
    out = []
    for impl in getattr(pm.hook, hook).get_hookimpls():
        if impl.plugin is plugin:
            result = impl.function()
            if result is None:
                continue
            if not isinstance(result, (list, tuple)):
                raise PluginError(f"{hook} must return a list, not {type(result).__name__}")
            out.extend(result)
    return out


def _check_family(fam) -> FamilySpec:
    if not isinstance(fam, FamilySpec):
        raise PluginError(f"cpullm_families returned {type(fam).__name__}, not FamilySpec")
    if not isinstance(fam.name, str) or not fam.name:
        raise PluginError(f"FamilySpec.name must be a non-empty string, not {fam.name!r}")
    for field in ("model_types", "architectures"):
        value = getattr(fam, field)
        if isinstance(value, str) or not all(isinstance(v, str) for v in value):
            raise PluginError(f"FamilySpec {fam.name!r}: {field} must be a tuple of strings, "
                              f"not {value!r}")
        setattr(fam, field, tuple(value))
    if not (isinstance(fam.args_class, type) and issubclass(fam.args_class, Args)):
        raise PluginError(f"FamilySpec {fam.name!r}: args_class must subclass cpullm.loading.family.Args")
    for field in ("weight_map", "build_graph"):
        if not callable(getattr(fam, field)):
            raise PluginError(f"FamilySpec {fam.name!r}: {field} must be callable")
    if not isinstance(fam.priority, int):
        raise PluginError(f"FamilySpec {fam.name!r}: priority must be an int, not {fam.priority!r}")
    return fam


def _check_kernel(k) -> KernelSpec:
    if not isinstance(k, KernelSpec):
        raise PluginError(f"cpullm_kernels returned {type(k).__name__}, not KernelSpec")
    if not callable(k.fn) or not callable(k.supports):
        raise PluginError(f"KernelSpec {k.name!r}: fn and supports must be callable")
    from cpullm_kernels.program.interpreter import EXTERNAL_SIGNATURES   # only paid when a plugin has kernels

    if not isinstance(k.op, int) or int(k.op) not in EXTERNAL_SIGNATURES:
        # each signature starts with the kernel's name, the op's name in lower case; naming the
        # op through cpullm.graph.ir instead would make the registry and the IR import each other
        allowed = ", ".join(sig.split("(")[0].upper() for sig in EXTERNAL_SIGNATURES.values())
        raise PluginError(f"KernelSpec {k.name!r}: op {getattr(k.op, 'name', k.op)} cannot be "
                          f"replaced by a plugin kernel (replaceable: {allowed})")
    return k


def _named(owner: str, kind: str, specs: list, taken: dict) -> dict:
    """{name: spec} of one plugin's ops or rope types, each tagged with its plugin; a name another
    plugin (or this one) already registered is an error of this plugin."""
    out = {}
    for spec in specs:
        if spec.name in taken or spec.name in out:
            other = taken[spec.name].plugin if spec.name in taken else owner
            raise PluginError(f"{kind} name {spec.name!r} is already registered by {other}; "
                              f"prefix {kind} names with the plugin's")
        spec.plugin = owner
        out[spec.name] = spec
    return out


def _check_op(op) -> OpSpec:
    if not isinstance(op, OpSpec):
        raise PluginError(f"cpullm_ops returned {type(op).__name__}, not OpSpec")
    if not isinstance(op.name, str) or not op.name:
        raise PluginError(f"OpSpec.name must be a non-empty string, not {op.name!r}")
    for field in ("width", "reference", "weight_roles"):
        if not callable(getattr(op, field)):
            raise PluginError(f"OpSpec {op.name!r}: {field} must be callable")
    for field in ("prefill", "decode"):
        if getattr(op, field) is not None and not callable(getattr(op, field)):
            raise PluginError(f"OpSpec {op.name!r}: {field} must be callable or None")
    if isinstance(op.params, str) or not all(isinstance(p, str) for p in op.params):
        raise PluginError(f"OpSpec {op.name!r}: params must be a tuple of attribute names")
    op.params = tuple(op.params)
    return op


def _check_gguf_arch(arch) -> GGUFArch:
    if not isinstance(arch, GGUFArch):
        raise PluginError(f"cpullm_gguf_architectures returned {type(arch).__name__}, not GGUFArch")
    if not isinstance(arch.name, str) or not arch.name or not isinstance(arch.model_type, str):
        raise PluginError(f"GGUFArch name and model_type must be non-empty strings, not "
                          f"{arch.name!r}, {arch.model_type!r}")
    for field in ("architectures", "required_layer_leaves", "head_dim_keys", "end_of_turn_tokens"):
        value = getattr(arch, field)
        if isinstance(value, str) or not all(isinstance(v, str) for v in value):
            raise PluginError(f"GGUFArch {arch.name!r}: {field} must be a tuple of strings, not {value!r}")
        setattr(arch, field, tuple(value))
    for field in ("layer_names", "pre_tokenizer_splits"):
        value = getattr(arch, field)
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                  for k, v in value.items()):
            raise PluginError(f"GGUFArch {arch.name!r}: {field} must map strings to strings")
    missing = [leaf for leaf in arch.required_layer_leaves if leaf not in arch.layer_names]
    if missing:
        raise PluginError(f"GGUFArch {arch.name!r}: required_layer_leaves {missing} have no entry "
                          "in layer_names")
    for field in ("config_extras", "tensor_layouts"):
        if not callable(getattr(arch, field)):
            raise PluginError(f"GGUFArch {arch.name!r}: {field} must be callable")
    if arch.layer_tensors is not None and not callable(arch.layer_tensors):
        raise PluginError(f"GGUFArch {arch.name!r}: layer_tensors must be callable or None")
    if arch.sentencepiece not in SENTENCEPIECE_STYLES:
        raise PluginError(f"GGUFArch {arch.name!r}: sentencepiece must be one of "
                          f"{', '.join(SENTENCEPIECE_STYLES)}, not {arch.sentencepiece!r}")
    return arch


SENTENCEPIECE_STYLES = ("metaspace", "replace_spaces")   # cpullm.convert's SentencePiece backends


def _check_pre_tokenizers(owner: str, new: dict, taken: dict) -> None:
    """A ``tokenizer.ggml.pre`` name that an installed plugin already splits differently is an
    error of the later plugin: the same file must not tokenize one way or another by install order."""
    known = {}
    for arch in taken.values():
        for pre, regex in arch.pre_tokenizer_splits.items():
            known.setdefault(pre, (regex, arch.plugin))
    for arch in new.values():
        for pre, regex in arch.pre_tokenizer_splits.items():
            if pre in known and known[pre][0] != regex:
                raise PluginError(f"GGUFArch {arch.name!r}: pre-tokenizer {pre!r} is already split "
                                  f"differently by {known[pre][1]}; use another name")
            known.setdefault(pre, (regex, owner))


CORE_ROPE_TYPES = ("default", "linear", "llama3")     # cpullm.graph.blocks.SUPPORTED_ROPE_TYPES


def _check_rope_type(rt) -> RopeType:
    if not isinstance(rt, RopeType):
        raise PluginError(f"cpullm_rope_types returned {type(rt).__name__}, not RopeType")
    if not isinstance(rt.name, str) or not rt.name or rt.name in CORE_ROPE_TYPES:
        raise PluginError(f"RopeType name {rt.name!r} must be a non-empty string other than the "
                          f"core's ({', '.join(CORE_ROPE_TYPES)})")
    if not callable(rt.inv_freq):
        raise PluginError(f"RopeType {rt.name!r}: inv_freq must be callable")
    return rt


def _precedence(fam: FamilySpec):
    return (-fam.priority, fam.plugin or "", fam.name)


def _resolve_conflicts(families: list[FamilySpec]):
    """Two families claiming one model_type: the higher ``priority`` wins, ties go to the plugin
    distribution name in alphabetical order (then the family name); the loser keeps its other
    model_types. Each conflict is recorded (``cpullm families`` shows it) and warned about
    (:class:`PluginConflictWarning`). Architectures claimed twice are resolved the same way."""
    ordered = sorted(families, key=_precedence)
    conflicts = []

    def claim(kind: str, key_fn):
        owner: dict[str, FamilySpec] = {}
        for fam in ordered:
            for key in key_fn(fam):
                if key in owner:
                    win = owner[key]
                    conflicts.append(
                        f"{kind} {key!r} is claimed by {win.plugin}:{win.name} (priority "
                        f"{win.priority}) and {fam.plugin}:{fam.name} (priority {fam.priority}); "
                        f"using {win.plugin}:{win.name} (higher priority, then plugin name order)")
                else:
                    owner[key] = fam
        return owner

    mt_owner = claim("model_type", lambda f: f.model_types)
    arch_owner = claim("architecture", lambda f: f.architectures)
    resolved = []
    for fam in ordered:
        kept = tuple(mt for mt in fam.model_types if mt_owner.get(mt) is fam)
        archs = tuple(a for a in fam.architectures if arch_owner.get(a) is fam)
        if kept != fam.model_types or archs != fam.architectures:
            fam = attrs.evolve(fam, model_types=kept, architectures=archs)
        if kept or archs or not fam.model_types:
            resolved.append(fam)
    for msg in conflicts:
        # one line on stderr ("cpullm: PluginConflictWarning: ..."), not a source excerpt
        warnings.warn_explicit(msg, PluginConflictWarning, filename="cpullm", lineno=0,
                               module="cpullm.loading.plugins")
    return resolved, conflicts


def register_for_tests(plugin_obj) -> None:
    """Register a plugin object in this process (tests and notebooks only; entry points are the
    real mechanism). Call :func:`discover(refresh=True)` afterwards."""
    _extra_plugins.append(plugin_obj)


def unregister_for_tests(plugin_obj) -> None:
    if plugin_obj in _extra_plugins:
        _extra_plugins.remove(plugin_obj)
