"""The one module a plugin imports from cpullm: everything a family, op, kernel, RoPE scaling or
GGUF architecture may use, re-exported from the core modules that implement it.

    from cpullm.plugin import hookimpl, Args, FamilySpec, require, W, WeightMap, GraphBuilder, blocks

Names outside this list are the core's own and may change without notice. ``testing`` (the
conformance kit, :mod:`cpullm.testing`) is imported on first use, so that a plugin's entry module
stays cheap to import.
"""
from __future__ import annotations

from . import limits
from .graph import blocks
from .graph.decoder import decoder_stack, glu_silu, lm_head_rule, standard_rules
from .errors import ConfigError, ConversionError, UnsupportedConfigError
from .loading.family import (Args, FamilySpec, GGUFArch, GGUFLayout, KernelSpec, OpSpec, RopeSpec,
                             RopeType, require, text_config)
from .loading.gguf_file import DENSE_LAYER_NAMES, QK_NORM_LAYER_NAMES, meta_int
from .hookspecs import hookimpl
from .graph.ir import GraphBuilder, Op
from .toolcalls import (WS, MalformedCall, ReasoningFormat, ToolCall, ToolFormat, json_rule, lark_string,
                        object_schema, parse_json_call, parse_tagged_json_call, tagged_json_call_body)
from .loading.weightmap import ADD_ONE, Transform, W, WeightMap
from .run.op_matrix import OpMatrix
from .loading.weightmap import TRANSPOSE

__all__ = [
    # the hook marker (the hooks themselves are documented in cpullm.hookspecs)
    "hookimpl",
    # a family: its arguments, its weight map, its graph
    "Args", "FamilySpec", "require", "text_config", "RopeSpec",
    "W", "WeightMap", "Transform", "ADD_ONE", "TRANSPOSE",
    "GraphBuilder", "Op", "blocks", "standard_rules", "lm_head_rule",
    "decoder_stack", "glu_silu",
    # how the family's models write tool calls and thinking (FamilySpec.tool_formats / reasoning_formats)
    "ToolFormat", "ReasoningFormat", "ToolCall", "MalformedCall", "WS", "json_rule", "lark_string",
    "object_schema", "parse_json_call", "parse_tagged_json_call", "tagged_json_call_body",
    # ops, kernels, RoPE scalings, GGUF architectures
    "OpSpec", "OpMatrix", "KernelSpec", "RopeType", "GGUFArch", "GGUFLayout", "DENSE_LAYER_NAMES",
    "QK_NORM_LAYER_NAMES",
    "meta_int", "limits",
    # the errors a plugin raises (each message names the fix)
    "ConfigError", "UnsupportedConfigError", "ConversionError",
    # the conformance kit (imported lazily)
    "testing",
]


def __getattr__(name: str):
    if name == "testing":
        from . import testing
        return testing
    raise AttributeError(f"module 'cpullm.plugin' has no attribute {name!r}")
