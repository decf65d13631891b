"""The whole plugin contract of cpullm.

A plugin is a module registered under the entry-point group ``cpullm`` of its distribution::

    [project.entry-points.cpullm]
    mymodel = "cpullm_mymodel.plugin"

and implements any of the hooks below, each marked with ``@hookimpl``::

    from cpullm.plugin import hookimpl

    @hookimpl
    def cpullm_families():
        from .mymodel import FAMILY      # import lazily: listing plugins must stay cheap
        return [FAMILY]

Each hook's docstring is its documentation (CONTRIBUTING.md walks through them). Rules that hold
for every hook:

* Plugins import cheaply: build nothing heavy at import time (no numba compilation, no arrays).
* Hooks are called once per process, when plugins are first discovered
  (:func:`cpullm.loading.plugins.discover`), and take no arguments.
* A plugin that raises on import or in a hook, misspells a hook name, forgets ``@hookimpl``, or
  returns anything but a list of the documented type is *reported* (``cpullm families`` shows
  its error) and contributes nothing; every other plugin keeps working.
"""
from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("cpullm")
hookimpl = pluggy.HookimplMarker("cpullm")


@hookspec
def cpullm_families():
    """Return a list of :class:`cpullm.loading.family.FamilySpec`, one per family (a set of
    ``model_type`` strings sharing one implementation). The FamilySpec docstring is the reference
    for its fields (name, model_types, architectures, args_class, weight_map, build_graph,
    priority, description, tool_formats, reasoning_formats); CONTRIBUTING.md walks through
    writing each one. How a family's checkpoints write tool calls and mark their thinking is
    declared there too: ``tool_formats`` (:class:`cpullm.toolcalls.ToolFormat`: the trigger, an
    incremental parser, the Lark grammar of a call) and ``reasoning_formats``
    (:class:`cpullm.toolcalls.ReasoningFormat`), each chosen per checkpoint by its chat template.
    """


@hookspec
def cpullm_kernels():
    """Return a list of :class:`cpullm.loading.family.KernelSpec`: optional fused kernels.

    A KernelSpec replaces the core's reference kernel for one IR op (``op``, a
    :class:`cpullm.graph.ir.Op`) on the nodes for which ``supports(node)`` is true. Only the ops listed
    in :data:`cpullm_kernels.program.interpreter.EXTERNAL_SIGNATURES` can be replaced (any other ``op`` is
    reported as a plugin error). ``fn`` takes exactly the arguments of the reference kernel it
    replaces (listed there), writes its output in place like it, and is called by the executor
    in prefill (T rows) and in decode (one row). ``name`` must be unique across plugins (prefix it
    with the plugin's name); ``version`` enters the execution-cache key, so bump it whenever the
    kernel's results change. Kernels apply to every family whose graph has a supported node,
    not only the plugin's own. ``cpullm.testing.check_plugin_kernels`` compares each kernel with
    the reference kernel, in prefill and decode; every kernel needs that test.
    """


@hookspec
def cpullm_ops():
    """Return a list of :class:`cpullm.loading.family.OpSpec`: IR ops the core does not have.

    A family's graph adds a node of such an op with ``g.op(node_name, op_name, inputs,
    weights={role: canonical name}, **attrs)``; the compiler plans its buffer, packs its weights
    as float32 and records the call, and the executor runs the op's fast kernels (``prefill``
    for batched rows, ``decode`` for one) or its numpy ``reference``. The OpSpec docstring is the
    reference for its fields and calling conventions. ``name`` is unique across plugins (prefix
    it with the plugin's name); a second plugin registering a name is an error of that plugin.
    The op's ``version`` enters the execution-cache key through the graph. The conformance kit
    compares the fast kernels with the reference on every checkpoint whose graph uses the op, in
    prefill and decode. Ops apply to any family whose graph names them, not only the plugin's own.
    """


@hookspec
def cpullm_rope_types():
    """Return a list of :class:`cpullm.loading.family.RopeType`: RoPE scalings selected by a config's
    ``rope_type`` that the core does not have (the core has "default", "linear", "llama3").

    :func:`cpullm.graph.blocks.make_rope` looks ``rope_type`` up here when it is not a core type; the
    frequencies are computed when the program is compiled, for its context length, so a scaling
    may depend on the sequence length the program can hold (Phi-3's ``longrope``). The RopeType
    docstring is the reference for its fields. Names are unique across plugins.
    """


@hookspec
def cpullm_gguf_architectures():
    """Return a list of :class:`cpullm.loading.family.GGUFArch`: GGUF architectures ``cpullm convert``
    turns into checkpoints of the plugin's families.

    The core reads the GGUF container, checks every value and writes the checkpoint; everything
    that depends on the architecture comes from here: the ``general.architecture`` name, the
    model_type and architectures written to config.json, the tensor name table, llama.cpp's
    layout changes to undo (q/k row permutation, ``1 + w`` norms), the config keys beyond the
    shared ones, and the tokenizer's specifics. The GGUFArch docstring is the reference for its
    fields. ``name`` is unique across plugins; a second plugin registering one is an error of
    that plugin. Only installed plugins' architectures are convertible.
    """
