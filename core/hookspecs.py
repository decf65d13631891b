"""The whole plugin contract of cpullm.

A plugin is a module registered under the entry-point group ``cpullm``::

    [project.entry-points.cpullm]
    mymodel = "cpullm_mymodel.plugin"

and implements any of the hooks below with ``@cpullm.hookimpl``. Each hook's docstring is its
documentation. Plugins must import cheaply: build nothing heavy at import time.
"""
from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("cpullm")
hookimpl = pluggy.HookimplMarker("cpullm")


@hookspec
def cpullm_families():
    """Return a list of :class:`cpullm.family.FamilySpec`, one per ``model_type`` family.

    A FamilySpec names the ``model_type`` strings (and optionally ``architectures``) it handles,
    its typed ``Args`` class (built by ``Args.from_config(config)``), its declarative weight map
    (``weight_map(args) -> cpullm.weightmap.WeightMap``) and its graph builder
    (``build_graph(args, g: cpullm.ir.GraphBuilder)``), which assembles the model from the shared
    blocks in :mod:`cpullm.blocks`. Called once per process when families are first listed.
    """


@hookspec
def cpullm_kernels():
    """Return a list of :class:`cpullm.family.KernelSpec`: optional fused kernels.

    A KernelSpec replaces the core's reference kernel for one IR op (``op``) on the nodes for which
    ``supports(node)`` is true. Its ``fn`` takes exactly the arguments of the reference kernel it
    replaces (listed in :data:`cpullm.kernels.interpreter.EXTERNAL_SIGNATURES`), so the executor can
    call either, and the conformance kit compares them. ``version`` enters the execution-cache key.
    """
