"""Write a GGUF file laid out as llama.cpp's ``convert_hf_to_gguf.py`` lays it out, from tensors
under transformers' names: the one writer behind the test suite's tiny GGUFs and the F32 GGUF
that ``benchmarks/compare/`` hands to llama.cpp.

    from cpullm.gguf_writer import write_gguf
    write_gguf("tiny.gguf", "llama", {"block_count": 2, "head_count": 4, "head_count_kv": 2, ...},
               {"model.embed_tokens.weight": emb, ...})

Built on the ``gguf`` package's GGUFWriter. The architecture's :class:`cpullm.loading.family.GGUFArch`
(from the installed plugins: the same table ``cpullm convert`` reads) names the tensors and says
which of llama.cpp's layout changes to apply (q/k row permutation, ``1 + w`` norms), so writing a
checkpoint and converting the file back gives the checkpoint again.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable, Iterable, Mapping

import numpy as np

from ..loading.gguf_file import (EXPERT_INDEX, GLOBAL_TENSOR_NAMES, arch_spec, gguf_architectures, import_gguf,
                                 permute_qk)
from ..errors import ConversionError
from ..loading.family import GGUFArch


# Tensors llama.cpp's converter always writes as F32, whatever the file type: expert routers, the
# shared expert's gate, convolution kernels, and tensors not named ``.weight``. Rows that are not
# whole blocks are also kept F32 (llama.cpp falls back to F16 there).
ALWAYS_F32 = re.compile(r"\.(ffn_gate_inp|ffn_gate_inp_shexp|ssm_conv1d)\.weight$|^(?!.*\.weight$)")


def gguf_arch_for_model_type(model_type: str) -> GGUFArch:
    """The installed GGUFArch whose converted checkpoints have ``model_type``."""
    for arch in gguf_architectures().values():
        if arch.model_type == model_type:
            return arch
    known = sorted(a.model_type for a in gguf_architectures().values())
    raise ConversionError(f"no installed plugin writes model_type {model_type!r} as GGUF (they write: "
                          f"{', '.join(known) or 'none'}); install its family's cpullm plugin")


def gguf_tensor_name(hf_name: str, layout: GGUFArch) -> str | None:
    """The GGUF name of a transformers tensor (the inverse of ``cpullm.loading.gguf_file.hf_tensor_name``),
    or None when the table has no entry: ``model.layers.3.self_attn.q_proj.weight`` ->
    ``blk.3.attn_q.weight``."""
    for gguf_base, hf_base in GLOBAL_TENSOR_NAMES.items():
        if hf_name.startswith(hf_base + ".") and hf_name.count(".") == hf_base.count(".") + 1:
            return gguf_base + hf_name[len(hf_base):]
    parts = hf_name.split(".")
    if len(parts) < 5 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
        return None
    whole = {hf: g for g, hf in layout.layer_names.items()}.get(".".join(parts[3:]))
    if whole is not None:                   # an entry naming the whole tensor (GGUFArch.layer_names)
        return f"blk.{parts[2]}.{whole}"
    leaf, kind = ".".join(parts[3:-1]), parts[-1]
    inverse = {hf: g for g, hf in layout.layer_names.items() if "." not in g}
    if leaf in inverse:
        return f"blk.{parts[2]}.{inverse[leaf]}.{kind}"
    stacked = _expert_leaf(leaf, layout)
    return None if stacked is None else f"blk.{parts[2]}.{stacked[0]}.{kind}"


def _expert_leaf(leaf: str, layout: GGUFArch) -> tuple[str, int] | None:
    """(GGUF leaf, expert index) of one expert's matrix (``mlp.experts.5.gate_proj`` ->
    ``("ffn_gate_exps", 5)``) when the table stacks that leaf's experts, else None."""
    for g, hf in layout.layer_names.items():
        if EXPERT_INDEX in hf:
            head, tail = hf.split(EXPERT_INDEX)
            index = leaf[len(head): len(leaf) - len(tail)]
            if leaf.startswith(head) and leaf.endswith(tail) and index.isdigit():
                return g, int(index)
    return None


def expert_index(hf_name: str, layout: GGUFArch) -> int | None:
    """The expert a transformers tensor belongs to when the table stacks it into a 3-D GGUF
    tensor (cpullm.loading.gguf_file.EXPERT_INDEX), else None."""
    parts = hf_name.split(".")
    if len(parts) < 5 or parts[:2] != ["model", "layers"]:
        return None
    stacked = _expert_leaf(".".join(parts[3:-1]), layout)
    return None if stacked is None else stacked[1]


def to_gguf_layout(gguf_name: str, w: np.ndarray, layout: GGUFArch, n_head: int, n_head_kv: int,
                   tensor_layouts: Mapping | None = None) -> np.ndarray:
    """One float32 tensor in llama.cpp's layout: q/k rows permuted, norms stored as ``1 + w``, and
    the architecture's own reorders, rescales and reshapes (``GGUFArch.tensor_layouts``, computed
    from the file's metadata) applied as the inverse of reading."""
    w = np.asarray(w, dtype=np.float32)
    if layout.permute_qk and ".attn_q." in gguf_name:
        w = permute_qk(w, n_head)
    elif layout.permute_qk and ".attn_k." in gguf_name:
        w = permute_qk(w, n_head_kv)
    if layout.norm_offset and gguf_name.endswith("norm.weight"):
        w = w + np.float32(1.0)
    own = (tensor_layouts or {}).get(re.sub(r"^blk\.\d+\.", "", gguf_name))
    if own is not None:
        if own.gguf_shape is not None:
            w = w.reshape(own.gguf_shape)
        if own.add_one:
            w = w + np.float32(1.0)
        if own.to_gguf is not None:
            w = np.asarray(own.to_gguf(w), dtype=np.float32)
        if own.columns is not None:
            w = w[..., np.argsort(own.columns)]
        if own.rows is not None:
            w = w[np.argsort(own.rows)]
    return np.ascontiguousarray(w, dtype=np.float32)


def _add_metadata(writer, key: str, value) -> None:
    if isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, list):
        writer.add_array(key, value)
    else:
        writer.add_uint32(key, value)


def write_gguf(path: str | os.PathLike, arch: str, fields: Mapping[str, object],
               tensors: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]], *,
               layout: GGUFArch | None = None, qtype: str = "F32", metadata: Mapping | None = None,
               extra_tensors: Mapping[str, np.ndarray] | None = None, skip: tuple[str, ...] = (),
               add_metadata: Callable | None = None) -> Path:
    """Write ``tensors`` (transformers names -> float32 arrays) as the GGUF file ``path``.

    arch        the file's ``general.architecture``
    fields      GGUFWriter adders by name without ``add_`` -> value, written in order
                (``{"block_count": 2, "token_list": tokens, "add_bos_token": False}``);
                ``head_count`` and ``head_count_kv`` also size the q/k permutation
    layout      the GGUFArch naming the tensors (default: the installed one named ``arch``)
    qtype       ggml type of 2-D tensors ("F32" keeps float32; "Q8_0" etc. quantize with gguf)
    metadata    {full key: value} written with its Python type (str, bool, float as float32,
                list as an array, int as uint32)
    extra_tensors  {GGUF name: array} written as given (rope_freqs, or tensors no table names)
    skip        GGUF tensor names left out
    add_metadata   called with the GGUFWriter after ``fields`` (``gguf.SpecialVocab.add_to_gguf``)

    A tensor the table has no GGUF name for is a ConversionError naming it.
    """
    gguf = import_gguf()
    layout = layout or arch_spec(arch)
    n_head = int(fields["head_count"])
    n_head_kv = int(fields.get("head_count_kv", n_head))
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")    # the file at ``path`` is replaced only whole
    try:
        _write(gguf, tmp, arch, fields, tensors, layout, qtype, metadata, extra_tensors, skip, add_metadata,
               n_head, n_head_kv)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _write(gguf, path, arch, fields, tensors, layout, qtype, metadata, extra_tensors, skip, add_metadata,
           n_head, n_head_kv) -> None:
    writer = gguf.GGUFWriter(str(path), arch)   # looked up at call time: tests may subclass it
    for name, value in fields.items():
        getattr(writer, f"add_{name}")(value)
    for key, value in (metadata or {}).items():
        _add_metadata(writer, key, value)
    if add_metadata is not None:
        add_metadata(writer)
    written = {k: v.value for k, v in writer.kv_data[0].items()}
    tensor_layouts = layout.tensor_layouts(written)
    def add(g: str, w: np.ndarray) -> None:
        t = gguf.GGMLQuantizationType[qtype]
        whole_blocks = w.shape[-1] % gguf.GGML_QUANT_SIZES[t][0] == 0 if w.ndim else False
        if w.ndim >= 2 and qtype != "F32" and whole_blocks and not ALWAYS_F32.search(g):
            q = gguf.quants.quantize(w.reshape(-1, w.shape[-1]), t)     # row by row, any leading dims
            writer.add_tensor(g, q.reshape(*w.shape[:-1], q.shape[-1]), raw_dtype=t)
        else:
            writer.add_tensor(g, w)

    unnamed, stacks = [], {}
    for hf_name, w in (tensors.items() if isinstance(tensors, Mapping) else tensors):
        g = gguf_tensor_name(hf_name, layout)
        if g is None:
            unnamed.append(hf_name)
            continue
        if g in skip:
            continue
        w = to_gguf_layout(g, np.asarray(w), layout, n_head, n_head_kv, tensor_layouts)
        e = expert_index(hf_name, layout)
        if e is None:
            add(g, w)
        else:                                   # llama.cpp's routed experts: one 3-D tensor
            stacks.setdefault(g, {})[e] = w
    gaps = [g for g, parts in stacks.items() if sorted(parts) != list(range(len(parts)))]
    if gaps:
        writer.close()
        raise ConversionError(f"the experts of {gaps[0]} are not numbered 0..E-1 (got "
                              f"{sorted(stacks[gaps[0]])[:8]}...); give every expert's matrix, or none")
    for g, parts in stacks.items():
        shapes = {parts[e].shape for e in parts}
        if len(shapes) > 1:
            writer.close()
            raise ConversionError(f"the experts of {g} differ in shape ({sorted(shapes)[:3]}); every expert's "
                                  "matrix of one kind has the same shape")
        add(g, np.stack([parts[e] for e in range(len(parts))]))
    if unnamed:
        writer.close()
        raise ConversionError(f"no GGUF name for {len(unnamed)} tensors of architecture {arch!r}, e.g. "
                              f"{unnamed[:3]}; the {layout.name} table of its plugin does not list them")
    for g, w in (extra_tensors or {}).items():
        writer.add_tensor(g, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
