"""GGUF file -> Hugging Face model directory (config.json, bf16 model.safetensors, tokenizer files).

    from cpullm.convert import convert_gguf
    convert_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2/")

The output is what transformers' own GGUF loader builds in memory, saved the way
``save_pretrained`` would save a bf16 checkpoint:

* tensors are dequantized with the ``gguf`` package, renamed to transformers' names, llama.cpp's
  Q/K row permutation and ``1 + w`` norms are undone where the architecture has them; every
  tensor is written as bf16 (round to nearest even, like torch);
* the tokenizer is rebuilt from the GGUF vocabulary with the ``tokenizers`` library alone
  (transformers is *not* needed), giving the same token ids as transformers' GGUF tokenizer;
* everything is written into a hidden sibling directory first and renamed into place, so an
  interrupted conversion leaves nothing under the output name.

Everything that depends on the GGUF architecture (tensor names, layout changes, config keys,
tokenizer specifics) comes from the installed plugins' :class:`cpullm.family.GGUFArch` (hook
``cpullm_gguf_architectures``): the architectures ``cpullm convert`` supports are theirs.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from . import limits
from .errors import ConfigError, ConversionError
from .family import GGUFArch, check_config
from .plugins import discover

Progress = Callable[[str, float], None]

# ggml quantization types this converter accepts (names of gguf.GGMLQuantizationType).
SUPPORTED_TENSOR_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K",
)

# ---------------------------------------------------------------------------------------------
# Tensor names: GGUF -> transformers. llama.cpp's standard names; each GGUFArch picks its table.
# ---------------------------------------------------------------------------------------------

GLOBAL_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# GGUF tensors that have no transformers counterpart and are dropped (rope_freqs is folded into
# config.rope_scaling for llama3-style files).
DROPPED_TENSORS = re.compile(r"^(rope_freqs\.weight|blk\.\d+\.attn_rot_embd\.weight)$")

DENSE_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

QK_NORM_LAYER_NAMES = {
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}

# The plugins' spec of one GGUF architecture (the name this module always used for it).
ArchSpec = GGUFArch


def gguf_architectures() -> dict[str, GGUFArch]:
    """``general.architecture`` -> GGUFArch, over every installed plugin (hook
    ``cpullm_gguf_architectures``)."""
    return dict(discover().gguf_architectures)


def supported_architectures() -> tuple[str, ...]:
    """The GGUF architectures the installed plugins make convertible, sorted."""
    return tuple(sorted(discover().gguf_architectures))


def arch_spec(arch: Any) -> GGUFArch:
    """The installed plugins' GGUFArch for ``arch``; a ConversionError naming the fix otherwise."""
    specs = discover().gguf_architectures
    if not isinstance(arch, str) or arch not in specs:
        supported = ", ".join(sorted(specs)) or "none"
        raise ConversionError(f"GGUF architecture {_shown(arch)} is not supported; cpullm converts "
                              f"{supported} (the installed plugins' architectures); install the cpullm "
                              "plugin of its family (`cpullm families` lists the installed ones)")
    return specs[arch]


def __getattr__(name: str):
    # Former module constants, now computed from the installed plugins.
    if name == "ARCH_SPECS":
        return gguf_architectures()
    if name == "SUPPORTED_ARCHITECTURES":
        return supported_architectures()
    if name == "PRE_TOKENIZER_SPLITS":
        return discover().pre_tokenizer_splits()
    if name == "END_OF_TURN_TOKENS":
        return discover().end_of_turn_tokens()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)$")
_GLOBAL_TENSOR = re.compile(r"^([a-z0-9_]+)\.(weight|bias)$")


def hf_tensor_name(gguf_name: str, spec: ArchSpec) -> str | None:
    """The transformers name of a GGUF tensor, or None when the table has no entry.

    ``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``
    """
    m = _LAYER_TENSOR.match(gguf_name)
    if m:
        layer, leaf, kind = m.groups()
        hf_leaf = spec.layer_names.get(leaf)
        return None if hf_leaf is None else f"model.layers.{layer}.{hf_leaf}.{kind}"
    m = _GLOBAL_TENSOR.match(gguf_name)
    if m:
        base = GLOBAL_TENSOR_NAMES.get(m.group(1))
        return None if base is None else f"{base}.{m.group(2)}"
    return None


# ---------------------------------------------------------------------------------------------
# Reading the GGUF file
# ---------------------------------------------------------------------------------------------

def _import_gguf():
    try:
        import gguf  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConversionError("converting a GGUF file needs the gguf package: "
                              "pip install 'cpullm[gguf]' (or pip install gguf)") from exc
    return gguf


# GGUF value types (gguf.GGUFValueType) -> struct format of one scalar.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_GGUF_VERSIONS = (2, 3)


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor's header entry; ``data`` maps its bytes (uint8, or f32/f16 typed) without copying."""

    name: str
    tensor_type: Any                # gguf.GGMLQuantizationType
    shape: tuple[int, ...]          # ggml ne (innermost first), as in the file
    n_bytes: int
    data_offset: int                # absolute, in the file
    _file: "GGUFFile" = field(repr=False, compare=False)

    @property
    def data(self) -> np.ndarray:
        """The stored bytes shaped like gguf.GGUFReader shapes them (rows, bytes per row)."""
        gguf = _import_gguf()
        raw = self._file.mm[self.data_offset:self.data_offset + self.n_bytes]
        np_shape = tuple(reversed(self.shape))
        if self.tensor_type == gguf.GGMLQuantizationType.F32:
            return raw.view(np.float32).reshape(np_shape)
        if self.tensor_type == gguf.GGMLQuantizationType.F16:
            return raw.view(np.float16).reshape(np_shape)
        return raw.reshape(gguf.quants.quant_shape_to_byte_shape(np_shape, self.tensor_type))


class GGUFFile:
    """A fast, strict GGUF (v2/v3, little-endian) header reader over a read-only memory map.

    gguf.GGUFReader builds a numpy view for every vocabulary string, which takes 20-30 s for a
    262k-token vocabulary; this reads the same header in about a second. Tensor data stays
    mapped and is dequantized with ``gguf.quants.dequantize``. Every length is checked against
    the file size, so a damaged file raises ConversionError instead of reading garbage.
    """

    def __init__(self, path: Path):
        self.path = path
        self.size = path.stat().st_size
        self.mm = np.memmap(path, dtype=np.uint8, mode="r") if self.size else np.zeros(0, np.uint8)
        self.buf = memoryview(self.mm) if self.size else memoryview(b"")
        self.pos = 0
        self.metadata: dict[str, Any] = {}
        self.tensors: list[GGUFTensor] = []
        self._parse()

    # -- primitive reads, each bounds-checked -------------------------------------------------
    def _need(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            raise ConversionError(f"{self.path} is truncated or damaged: its header wants {n} bytes at "
                                  f"offset {self.pos} but the file has {self.size}; download it again")

    def _scalar(self, fmt: str):
        n = struct.calcsize("<" + fmt)
        self._need(n)
        (v,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += n
        return v

    def _string(self) -> str:
        n = self._scalar("Q")
        if n > limits.MAX_GGUF_STRING:
            raise ConversionError(f"{self.path} is damaged: a metadata string at offset {self.pos} claims "
                                  f"{n} bytes (at most {limits.MAX_GGUF_STRING} are read); download it again")
        self._need(n)
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def _value(self, vtype: int, depth: int = 0):
        if vtype in _SCALAR_FORMATS:
            return self._scalar(_SCALAR_FORMATS[vtype])
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            sub, count = self._scalar("I"), self._scalar("Q")
            if depth >= limits.MAX_GGUF_NESTING and sub == _ARRAY:
                raise ConversionError(f"{self.path} is damaged: metadata arrays nested more than "
                                      f"{limits.MAX_GGUF_NESTING} deep at offset {self.pos}; download it again")
            if count > limits.MAX_GGUF_ARRAY:
                raise ConversionError(f"{self.path} is damaged: a metadata array at offset {self.pos} claims "
                                      f"{count} elements (at most {limits.MAX_GGUF_ARRAY} are read); download it again")
            if sub in _SCALAR_FORMATS:
                fmt = _SCALAR_FORMATS[sub]
                width = struct.calcsize("<" + fmt)
                self._need(count * width)
                dtype = np.dtype("<" + fmt) if fmt != "?" else np.dtype(np.bool_)
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                self.pos += count * width
                return arr.tolist()
            if sub not in (_STRING, _ARRAY):
                raise ConversionError(f"{self.path} is damaged: unknown metadata array element type {sub} "
                                      f"at offset {self.pos}; download it again")
            self._need(count * 8)  # every remaining element takes at least 8 bytes
            return [self._value(sub, depth + 1) for _ in range(count)]
        raise ConversionError(f"{self.path} is damaged: unknown metadata value type {vtype} at offset "
                              f"{self.pos}; download it again")

    # -- the header ---------------------------------------------------------------------------
    def _parse(self) -> None:
        gguf = _import_gguf()
        if self.size < 4 or bytes(self.buf[:4]) != b"GGUF":
            raise ConversionError(f"{self.path} is not a GGUF file (it does not start with the GGUF "
                                  "magic); give a .gguf model file")
        self.pos = 4
        version = self._scalar("I")
        if version not in _GGUF_VERSIONS:
            hint = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
            raise ConversionError(f"{self.path}: GGUF version {version}{hint} is not supported; "
                                  "use a little-endian GGUF v2 or v3 file")
        n_tensors, n_kv = self._scalar("Q"), self._scalar("Q")
        if n_tensors > limits.MAX_TENSORS or n_kv > limits.MAX_GGUF_KV:
            raise ConversionError(f"{self.path} is damaged: its header claims {n_tensors} tensors and {n_kv} "
                                  f"metadata keys (at most {limits.MAX_TENSORS} and {limits.MAX_GGUF_KV} are "
                                  "read); download it again")
        self._need(n_kv * 12 + n_tensors * 24)  # lower bound of their encoded size
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._scalar("I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._scalar("I")
            if n_dims > limits.MAX_DIMS:
                raise ConversionError(f"{self.path} is damaged: tensor {limits.shown(name, 80)} has {n_dims} dimensions")
            ne = tuple(self._scalar("Q") for _ in range(n_dims))
            infos.append((name, ne, self._scalar("I"), self._scalar("Q")))
        align = self.metadata.get("general.alignment", 32)
        if not limits.is_int(align) or not 0 < align <= 1 << 16 or align & (align - 1):
            raise ConversionError(f"{self.path} is damaged: bad general.alignment {align!r}")
        data_start = -(-self.pos // align) * align
        seen = set()
        for name, ne, raw_type, offset in infos:
            try:
                qtype = gguf.GGMLQuantizationType(raw_type)
                block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError) as exc:
                raise ConversionError(f"{self.path}: tensor {limits.shown(name, 80)} has unknown ggml type {raw_type}; "
                                      "the file is damaged or from a newer llama.cpp") from exc
            n_elems = limits.checked_product(ne)   # exact: (2**32, 2**32) must not wrap to 0
            if name in seen or n_elems is None or (ne and ne[0] % block):
                raise ConversionError(f"{self.path} is damaged: tensor {limits.shown(name, 80)} is duplicated or has a "
                                      f"shape {list(ne)} that does not fit its type {qtype.name}")
            seen.add(name)
            n_bytes = n_elems // block * type_size
            start = data_start + offset
            if start + n_bytes > self.size:
                raise ConversionError(f"{self.path} is truncated: tensor {limits.shown(name, 80)} ends at byte "
                                      f"{start + n_bytes} but the file has {self.size} bytes; "
                                      "download it again")
            self.tensors.append(GGUFTensor(name, qtype, ne, n_bytes, start, self))


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Open and validate a GGUF file (magic, version, header, every tensor inside the file).

    Any failure is a ConversionError naming the file and the fix.
    """
    path = Path(path)
    if not path.is_file():
        raise ConversionError(f"{path} does not exist or is not a file; give the path to a .gguf file")
    try:
        return GGUFFile(path)
    except ConversionError:
        raise
    except (ValueError, OverflowError, struct.error, MemoryError, RecursionError) as exc:
        raise ConversionError(f"{path} is a damaged GGUF file ({type(exc).__name__}: {exc}); "
                              "download it again") from exc


def read_metadata(reader: GGUFFile) -> dict[str, Any]:
    """Every metadata field of the file (``{"general.architecture": "llama", ...}``)."""
    return dict(reader.metadata)


def _clean_float(value: float) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (9.99999975e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


# ---------------------------------------------------------------------------------------------
# Tensor transforms and bf16
# ---------------------------------------------------------------------------------------------

def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (convert_hf_to_gguf ``LlamaModel.permute``).

    llama.cpp reorders each head's rows from rotate-half order [x0..x_{d/2-1}, y0..] to interleaved
    pairs [x0, y0, x1, y1, ...]. Here: rows [n_head * d] (+ trailing dims) back to HF order.
    """
    rows = w.shape[0]
    half = rows // n_head // 2
    # [n_head, half, 2, ...] -> [n_head, 2, half, ...]
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's permutation (HF -> GGUF), the inverse of ``unpermute_qk``; used by tests."""
    rows = w.shape[0]
    half = rows // n_head // 2
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 array -> bf16 bit patterns (uint16), rounding to nearest even exactly like torch."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    rounding = ((u >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)
    out = ((u + rounding) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = np.uint16(0x7FC0) | (((u[nan] >> np.uint32(16)) & np.uint32(0x8000)).astype(np.uint16))
    return out


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) -> float32 (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


@dataclass
class PlannedTensor:
    """One output tensor: where it comes from and what is done to it."""

    hf_name: str
    source: "GGUFTensor"
    shape: tuple[int, ...]          # HF (row-major) shape
    permute_heads: int = 0          # >0: unpermute rows with this many heads
    subtract_one: bool = False

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * 2  # bf16


def _dequantize(t) -> np.ndarray:
    """A GGUF tensor as float32 in HF (row-major) shape."""
    gguf = _import_gguf()
    type_name = t.tensor_type.name
    if type_name not in SUPPORTED_TENSOR_TYPES:
        raise ConversionError(f"tensor {t.name} has ggml type {type_name}, which cpullm cannot convert; "
                              f"supported: {', '.join(SUPPORTED_TENSOR_TYPES)}. Use a GGUF with one of those")
    try:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
    except (NotImplementedError, ValueError) as exc:
        raise ConversionError(f"cannot dequantize tensor {t.name} ({type_name}): {exc}") from exc
    return np.asarray(arr, dtype=np.float32)


def materialize(p: PlannedTensor) -> np.ndarray:
    """Dequantize and transform one planned tensor: float32 array of shape ``p.shape``."""
    w = _dequantize(p.source)
    if tuple(w.shape) != p.shape:
        try:
            w = w.reshape(p.shape)
        except ValueError as exc:
            raise ConversionError(f"tensor {p.source.name}: dequantized to shape {w.shape}, expected "
                                  f"{p.shape}; the file is damaged") from exc
    if p.permute_heads:
        w = unpermute_qk(w, p.permute_heads)
    if p.subtract_one:
        w = w - np.float32(1.0)
    return w


# ---------------------------------------------------------------------------------------------
# Planning: names, shapes, tied embeddings
# ---------------------------------------------------------------------------------------------

def _hf_shape(t) -> tuple[int, ...]:
    """GGUF stores ggml's ne (innermost first); HF/numpy shape is the reverse."""
    return tuple(int(d) for d in reversed(t.shape))


def _tensors_identical(a, b) -> bool:
    if a.tensor_type != b.tensor_type or a.shape != b.shape:
        return False
    mm = a._file.mm
    return np.array_equal(mm[a.data_offset:a.data_offset + a.n_bytes], mm[b.data_offset:b.data_offset + b.n_bytes])


def plan_tensors(reader, spec: ArchSpec, hp: dict) -> tuple[list[PlannedTensor], bool]:
    """Map every GGUF tensor to its HF name and transform; returns (plan, tie_word_embeddings).

    All unknown names and all missing required tensors are reported in one ConversionError.
    """
    by_name = {t.name: t for t in reader.tensors}
    unknown, plan, bad_types = [], [], []
    tied = "output.weight" not in by_name
    if not tied and "token_embd.weight" in by_name:
        tied = _tensors_identical(by_name["output.weight"], by_name["token_embd.weight"])
    for t in reader.tensors:
        if DROPPED_TENSORS.match(t.name) or (tied and t.name == "output.weight"):
            continue
        hf = hf_tensor_name(t.name, spec)
        if hf is None:
            unknown.append(t.name)
            continue
        if t.tensor_type.name not in SUPPORTED_TENSOR_TYPES:
            bad_types.append(f"{t.name} ({t.tensor_type.name})")
        p = PlannedTensor(hf, t, _hf_shape(t))
        if spec.permute_qk and re.search(r"\.attn_q\.", t.name):
            p.permute_heads = hp["num_attention_heads"]
        elif spec.permute_qk and re.search(r"\.attn_k\.", t.name):
            p.permute_heads = hp["num_key_value_heads"]
        if spec.norm_offset and t.name.endswith("norm.weight"):
            p.subtract_one = True
        plan.append(p)
    if bad_types:
        raise ConversionError(f"cannot convert tensors of these ggml types: {', '.join(bad_types[:8])}; "
                              f"supported: {', '.join(SUPPORTED_TENSOR_TYPES)}. Use a GGUF quantized with one of those")
    missing = _missing_tensors(by_name, spec, hp["num_hidden_layers"])
    if unknown or missing:
        parts = []
        if unknown:
            parts.append(f"unexpected tensors for architecture {hp['arch']}: {', '.join(unknown[:12])}"
                         + (f" (+{len(unknown) - 12} more)" if len(unknown) > 12 else ""))
        if missing:
            parts.append(f"missing tensors: {', '.join(missing[:12])}"
                         + (f" (+{len(missing) - 12} more)" if len(missing) > 12 else ""))
        raise ConversionError("cannot convert this GGUF: " + "; ".join(parts)
                              + ". It is not a plain dense model of a supported architecture")
    return plan, tied


def _missing_tensors(by_name: dict, spec: ArchSpec, n_layers: int) -> list[str]:
    need = ["token_embd.weight", "output_norm.weight"]
    need += [f"blk.{i}.{leaf}.weight" for i in range(n_layers) for leaf in spec.required_layer_leaves]
    return [n for n in need if n not in by_name]


# ---------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------

def _md(meta: dict, arch: str, key: str, default: Any = None) -> Any:
    return meta.get(f"{arch}.{key}", default)


def _shown(value: Any) -> str:
    """A metadata value for an error message, cut short (it comes from an untrusted file)."""
    return limits.shown(value)


def _meta_int(meta: dict, arch: str, key: str, lo: int, hi: int, default: Any = None,
              per_layer: bool = False) -> int:
    """``{arch}.{key}`` as an int in [lo, hi]; ``per_layer`` also accepts one equal value per layer.

    Checked before anything is sized from it: a 227-byte file may claim 2**40 layers."""
    full = f"{arch}.{key}"
    value = meta.get(full, default)
    if value is None:
        raise ConversionError(f"the GGUF metadata lacks {full}; the file is incomplete or damaged")
    if per_layer and isinstance(value, list):
        if not value or not all(limits.is_int(v) for v in value) or len(set(value)) != 1:
            raise ConversionError(f"GGUF {full} = {_shown(value)} varies per layer or is not a list of "
                                  "integers; cpullm cannot convert such models")
        value = value[0]
    if not limits.is_int(value) or not lo <= value <= hi:
        raise ConversionError(f"GGUF {full} = {_shown(value)} is invalid (expected an integer from {lo} "
                              f"to {hi}); the file is damaged")
    return value


meta_int = _meta_int   # public: GGUFArch.config_extras read their numbers with it


def _meta_float(meta: dict, arch: str, key: str, default: float) -> float:
    """``{arch}.{key}`` as a finite positive float (shortest round-tripping decimal)."""
    full = f"{arch}.{key}"
    value = meta.get(full, default)
    if not limits.is_number(value) or value <= 0 or not math.isfinite(_clean_float(value)):
        raise ConversionError(f"GGUF {full} = {_shown(value)} is invalid (expected a finite positive "
                              "number); the file is damaged")
    return _clean_float(value)


meta_float = _meta_float


def hyperparameters(meta: dict, reader, spec: GGUFArch | None = None) -> dict:
    """The architecture's shape from the GGUF metadata, under transformers' names, every value
    checked against cpullm.limits (and head counts against each other). ``spec`` defaults to
    the installed plugins' GGUFArch of the file's architecture."""
    arch = meta.get("general.architecture")
    spec = spec or arch_spec(arch)
    hidden = _meta_int(meta, arch, "embedding_length", 1, limits.MAX_HIDDEN)
    heads = _meta_int(meta, arch, "attention.head_count", 1, limits.MAX_HEADS, per_layer=True)
    kv = _meta_int(meta, arch, "attention.head_count_kv", 1, limits.MAX_HEADS, default=heads, per_layer=True)
    if heads % kv:
        raise ConversionError(f"GGUF {arch}.attention.head_count = {heads} is not a multiple of "
                              f"head_count_kv = {kv}; the file is damaged")
    hp = {
        "arch": arch,
        "hidden_size": hidden,
        "intermediate_size": _meta_int(meta, arch, "feed_forward_length", 1, limits.MAX_INTERMEDIATE,
                                       per_layer=True),
        "num_hidden_layers": _meta_int(meta, arch, "block_count", 1, limits.MAX_LAYERS),
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "max_position_embeddings": _meta_int(meta, arch, "context_length", 1, limits.MAX_CONTEXT, default=2048),
        "rms_norm_eps": _meta_float(meta, arch, "attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": _meta_float(meta, arch, "rope.freq_base", 10000.0),
    }
    head_dim_key = next((k for k in spec.head_dim_keys if meta.get(f"{arch}.{k}") is not None), None)
    if head_dim_key is not None:
        hp["head_dim"] = _meta_int(meta, arch, head_dim_key, 1, limits.MAX_HEAD_DIM)
    elif hidden % heads:
        raise ConversionError(f"GGUF {arch}.embedding_length = {hidden} is not a multiple of "
                              f"attention.head_count = {heads} and no key_length is given; the file is damaged")
    else:
        hp["head_dim"] = hidden // heads
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is not None:
        vocab = _hf_shape(embd)[0]
    else:
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab = _meta_int(meta, arch, "vocab_size", 1, limits.MAX_VOCAB,
                          default=len(tokens) if isinstance(tokens, list) else None)
    if not 1 <= vocab <= limits.MAX_VOCAB:
        raise ConversionError(f"this GGUF's vocabulary has {vocab} tokens, outside 1..{limits.MAX_VOCAB}; "
                              "the file is damaged")
    hp["vocab_size"] = vocab
    return hp


def rope_scaling(meta: dict, arch: str, reader, hp: dict) -> dict | None:
    """transformers' rope_scaling dict from the GGUF's rope.scaling.* keys or llama3 rope_freqs."""
    kind = _md(meta, arch, "rope.scaling.type")
    factor = _md(meta, arch, "rope.scaling.factor")
    orig = _md(meta, arch, "rope.scaling.original_context_length")
    if orig is not None:
        orig = _meta_int(meta, arch, "rope.scaling.original_context_length", 1, limits.MAX_CONTEXT)
    if kind in ("linear", "yarn") and factor:
        out = {"rope_type": kind, "factor": _meta_float(meta, arch, "rope.scaling.factor", 1.0)}
        if kind == "yarn" and orig:
            out["original_max_position_embeddings"] = orig
        return out
    if kind not in (None, "none"):
        raise ConversionError(f"rope scaling type {_shown(kind)} in this GGUF is not supported; "
                              "supported: linear, yarn, llama3")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None:
        return None
    return _llama3_rope_from_factors(np.asarray(_dequantize(freqs)).reshape(-1), hp, orig)


def _llama3_rope_from_factors(factors: np.ndarray, hp: dict, orig: int | None) -> dict:
    """Recover Llama 3 rope scaling from llama.cpp's per-frequency rope_freqs tensor.

    llama.cpp divides each inverse frequency by factors[i]; the factors follow the Llama 3 rule
    (1 for short wavelengths, ``factor`` for long ones, smooth in between). We rebuild that rule
    with the usual low/high frequency factors (1, 4) and check it reproduces the tensor.
    """
    factor = float(factors.max()) if factors.size else float("nan")
    if not (math.isfinite(factor) and factor > 0):
        raise ConversionError("this GGUF's rope_freqs tensor holds no finite positive factor; the file is damaged")
    orig = int(orig or 8192)
    low, high = 1.0, 4.0
    dim = hp["head_dim"]
    inv = 1.0 / hp["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    expected = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < orig / high:
            expected.append(1.0)
        elif wavelen > orig / low:
            expected.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            expected.append(1.0 / ((1 - smooth) / factor + smooth))
    if len(expected) != factors.size or not np.allclose(expected, factors, rtol=1e-3, atol=1e-4):
        raise ConversionError("this GGUF's rope_freqs tensor does not follow Llama 3 rope scaling; "
                              "cpullm cannot convert it")
    return {"rope_type": "llama3", "factor": _clean_float(factor), "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": orig}


def _token_id(meta: dict, key: str) -> int | None:
    v = meta.get(f"tokenizer.ggml.{key}")
    if v is None:
        return None
    if not limits.is_int(v) or not 0 <= v < limits.MAX_VOCAB:
        raise ConversionError(f"GGUF tokenizer.ggml.{key} = {_shown(v)} is not a token id; the file is damaged")
    return v


def build_config(meta: dict, reader, spec: ArchSpec, hp: dict, tied: bool) -> dict:
    """config.json as transformers would write it (legacy keys: rope_theta, rope_scaling, torch_dtype)."""
    arch = hp["arch"]
    cfg = {
        "architectures": list(spec.architectures),
        "model_type": spec.model_type,
        "hidden_size": hp["hidden_size"],
        "intermediate_size": hp["intermediate_size"],
        "num_hidden_layers": hp["num_hidden_layers"],
        "num_attention_heads": hp["num_attention_heads"],
        "num_key_value_heads": hp["num_key_value_heads"],
        "head_dim": hp["head_dim"],
        "rms_norm_eps": hp["rms_norm_eps"],
        "rope_theta": hp["rope_theta"],
        "rope_scaling": rope_scaling(meta, arch, reader, hp),
        "max_position_embeddings": hp["max_position_embeddings"],
        "vocab_size": hp["vocab_size"],
        "tie_word_embeddings": tied,
        "bos_token_id": _token_id(meta, "bos_token_id"),
        "eos_token_id": _token_id(meta, "eos_token_id"),
        "pad_token_id": _token_id(meta, "padding_token_id"),
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "bfloat16",
    }
    cfg.update(spec.config_extras(meta, hp, tuple(t.name for t in reader.tensors)))
    return cfg


# ---------------------------------------------------------------------------------------------
# Tokenizer (tokenizers library only)
# ---------------------------------------------------------------------------------------------

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabularies."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
                 + list(range(ord("\xae"), ord("\xff") + 1)))
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@dataclass
class TokenizerSpec:
    """What the GGUF says about its tokenizer (``tokenizer.ggml.*`` and ``tokenizer.chat_template``)."""

    model: str                          # "gpt2" (byte-level BPE) | "llama" (SentencePiece BPE)
    pre: str | None
    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None
    merges: list[str] | None
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    chat_template: str | None
    extra_eos_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_metadata(cls, meta: dict) -> "TokenizerSpec":
        model = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not model or not tokens:
            raise ConversionError("this GGUF has no tokenizer (tokenizer.ggml.model/tokens missing); "
                                  "cpullm needs a GGUF that embeds its vocabulary")
        _check_tokenizer_metadata(meta)
        add_bos = meta.get("tokenizer.ggml.add_bos_token")
        if add_bos is None:
            # older SentencePiece files carry no flag; llama.cpp then adds BOS
            add_bos = model == "llama"
        extra = [_token_id(meta, k) for k in ("eot_token_id", "eom_token_id")]
        return cls(
            model=model, pre=meta.get("tokenizer.ggml.pre"), tokens=tokens,
            token_types=meta.get("tokenizer.ggml.token_type") or [],
            scores=meta.get("tokenizer.ggml.scores"), merges=meta.get("tokenizer.ggml.merges"),
            bos_id=_token_id(meta, "bos_token_id"), eos_id=_token_id(meta, "eos_token_id"),
            unk_id=_token_id(meta, "unknown_token_id"), pad_id=_token_id(meta, "padding_token_id"),
            add_bos=bool(add_bos), add_eos=bool(meta.get("tokenizer.ggml.add_eos_token") or False),
            chat_template=meta.get("tokenizer.chat_template"),
            extra_eos_ids=[int(x) for x in extra if x is not None],
        )

    def token(self, idx: int | None) -> str | None:
        return self.tokens[idx] if idx is not None and 0 <= idx < len(self.tokens) else None


MAX_TOKEN_CHARS = 4096   # one vocabulary entry; real ones are < 300 (rebuilding merges is quadratic in it)

# tokenizer.ggml.* key -> (what each element must be, a description for the error)
_TOKENIZER_LISTS = {
    "tokens": (lambda t: isinstance(t, str) and len(t) <= MAX_TOKEN_CHARS, f"strings of at most {MAX_TOKEN_CHARS} characters"),
    "token_type": (limits.is_int, "integers"),
    "scores": (limits.is_number, "finite numbers"),
    "merges": (lambda m: isinstance(m, str) and len(m) <= 2 * MAX_TOKEN_CHARS + 1, "strings"),
}


def _check_tokenizer_metadata(meta: dict) -> None:
    """Types and sizes of every tokenizer field, before a vocabulary or a merge table is built."""
    for key in ("model", "pre"):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None and not isinstance(value, str):
            raise ConversionError(f"GGUF tokenizer.ggml.{key} = {_shown(value)} is not a string; the file is damaged")
    for key, (ok, what) in _TOKENIZER_LISTS.items():
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is None:
            continue
        if not isinstance(value, list) or len(value) > limits.MAX_VOCAB or not all(map(ok, value)):
            raise ConversionError(f"GGUF tokenizer.ggml.{key} must be a list of at most {limits.MAX_VOCAB} "
                                  f"{what}; this file's is not: the file is damaged")
    for key in ("add_bos_token", "add_eos_token"):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None and not isinstance(value, (bool, int)):
            raise ConversionError(f"GGUF tokenizer.ggml.{key} = {_shown(value)} is not a boolean; the file is damaged")
    template = meta.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise ConversionError(f"GGUF tokenizer.chat_template is a {type(template).__name__}, not a string; "
                              "the file is damaged (remove the key to convert without a chat template)")


def merges_from_vocab(vocab: dict[str, int], order: dict[str, float]) -> list[tuple[str, str]]:
    """Rebuild BPE merges from a SentencePiece vocabulary that lists none.

    Every split of a token into two vocabulary pieces is a merge; merges are ranked by ``order``
    (higher first: the token's score, or minus its position), then longer left piece first.
    """
    ranked = []
    for token, score in order.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((score, cut, len(right), left, right))
    ranked.sort(key=lambda r: (r[0], r[1], r[2]), reverse=True)  # stable: ties keep insertion order
    return [(r[3], r[4]) for r in ranked]


def _bpe_model(vocab, merges, **kw):
    from tokenizers.models import BPE
    return BPE(vocab=vocab, merges=merges, dropout=None, **kw)


def _byte_level_backend(spec: TokenizerSpec, splits: dict[str, str]):
    """Byte-level BPE (GPT-2 / Llama 3 / Qwen / SmolLM): vocabulary spelled in the byte alphabet."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers

    spelling = byte_to_unicode()
    alphabet = set(spelling.values())
    vocab = {(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(spec.tokens)}
    merges = [tuple(m.split(" ")) for m in (spec.merges or [])]
    tok = Tokenizer(_bpe_model(vocab, merges, continuing_subword_prefix="", end_of_word_suffix="",
                               fuse_unk=False, byte_fallback=False))
    split = splits.get(spec.pre or "")   # an unlisted pre type gets the GPT-2 regex (ByteLevel use_regex)
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    return tok, alphabet


def _replace_spaces_backend(spec: TokenizerSpec, splits: dict[str, str]):
    """SentencePiece BPE whose spaces become "▁" in a normalizer (Gemma's); merges rebuilt from token order."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers

    # Tokens made only of spaces are stored with real spaces; the normalized text has "▁" instead.
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in spec.tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    order = {t: -i for i, t in enumerate(tokens)}  # these scores do not follow merge order; position does
    merges = merges_from_vocab(vocab, order)
    unk = spec.token(spec.unk_id) or "<unk>"
    tok = Tokenizer(_bpe_model(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok, None


def _metaspace_backend(spec: TokenizerSpec, splits: dict[str, str]):
    """Llama-style SentencePiece BPE (Llama 2, TinyLlama, Mistral v1): Metaspace, byte fallback."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers

    vocab = {t: i for i, t in enumerate(spec.tokens)}
    if spec.merges:
        merges = [tuple(m.split(" ")) for m in spec.merges]
    else:
        scores = spec.scores or [0.0] * len(spec.tokens)
        merges = merges_from_vocab(vocab, dict(zip(spec.tokens, scores)))
    tok = Tokenizer(_bpe_model(vocab, merges, fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(content=" ", left=1, right=0)])
    return tok, None


_SENTENCEPIECE_BACKENDS = {"metaspace": _metaspace_backend, "replace_spaces": _replace_spaces_backend}


def _select_backend(spec: TokenizerSpec, arch: GGUFArch):
    if spec.model == "gpt2":
        return _byte_level_backend
    if spec.model == "llama":
        return _SENTENCEPIECE_BACKENDS[arch.sentencepiece]
    raise ConversionError(f"GGUF tokenizer model {spec.model!r} is not supported; "
                          "supported: gpt2 (byte-level BPE), llama (SentencePiece BPE)")


def _add_gguf_tokens(tok, spec: TokenizerSpec, alphabet: set[str] | None) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens (kept whole)."""
    from tokenizers import AddedToken

    types = spec.token_types or []
    control = [AddedToken(t, normalized=False, special=True)
               for t, ty in zip(spec.tokens, types)
               if ty == TOKEN_TYPE_CONTROL and (alphabet is None or set(t) <= alphabet)]
    if control:
        tok.add_special_tokens(control)
    vocab = tok.get_vocab()
    user = [AddedToken(t, normalized=False, special=False)
            for t, ty in zip(spec.tokens, types) if ty == TOKEN_TYPE_USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens(user)
    # bos/eos/unk/pad are special even when the file does not mark them as control
    named = [spec.token(i) for i in (spec.bos_id, spec.eos_id, spec.unk_id, spec.pad_id)]
    extra = [AddedToken(t, normalized=False, special=True) for t in dict.fromkeys(named)
             if t is not None and t in vocab and (alphabet is None or set(t) <= alphabet)]
    if extra:
        tok.add_special_tokens(extra)


def _post_processor(spec: TokenizerSpec):
    """TemplateProcessing that adds BOS / EOS as the GGUF flags say (transformers' layout)."""
    from tokenizers.processors import TemplateProcessing

    bos = spec.token(spec.bos_id) if spec.add_bos else None
    eos = spec.token(spec.eos_id) if spec.add_eos else None
    single = " ".join(x for x in (f"{bos}:0" if bos else "", "$A:0", f"{eos}:0" if eos else "") if x)
    pair = " ".join(x for x in (single, f"{bos}:1" if bos else "", "$B:1", f"{eos}:1" if eos else "") if x)
    special = []
    if bos:
        special.append((bos, spec.bos_id))
    if eos and eos != bos:
        special.append((eos, spec.eos_id))
    return TemplateProcessing(single=single, pair=pair, special_tokens=special)


def build_tokenizer(meta: dict, arch_spec_: GGUFArch | None = None):
    """(tokenizers.Tokenizer, tokenizer_config dict, TokenizerSpec) from the GGUF metadata.
    ``arch_spec_`` defaults to the installed plugins' GGUFArch of the file's architecture."""
    spec = TokenizerSpec.from_metadata(meta)
    arch = meta.get("general.architecture", "")
    backend = _select_backend(spec, arch_spec_ or arch_spec(arch))
    try:
        tok, alphabet = backend(spec, discover().pre_tokenizer_splits())
        _add_gguf_tokens(tok, spec, alphabet)
        tok.post_processor = _post_processor(spec)
    except Exception as exc:   # the tokenizers library rejects the vocabulary or merges
        raise ConversionError(f"cannot build a tokenizer from this GGUF's vocabulary "
                              f"({type(exc).__name__}: {limits.one_line(exc, 120)}); the file is damaged") from None
    tok_config = {
        "add_bos_token": spec.add_bos,
        "add_eos_token": spec.add_eos,
        "bos_token": spec.token(spec.bos_id),
        "eos_token": spec.token(spec.eos_id),
        "unk_token": spec.token(spec.unk_id),
        "pad_token": spec.token(spec.pad_id),
        "clean_up_tokenization_spaces": False,
        "model_max_length": _meta_int(meta, arch, "context_length", 1, limits.MAX_CONTEXT, default=2048),
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if spec.chat_template:
        tok_config["chat_template"] = spec.chat_template
    return tok, tok_config, spec


def generation_config(spec: TokenizerSpec, end_of_turn_tokens: tuple[str, ...] | None = None) -> dict:
    """generation_config.json: bos, pad and every end-of-generation id the chat template uses
    (``end_of_turn_tokens`` defaults to the installed plugins' GGUFArch.end_of_turn_tokens)."""
    if end_of_turn_tokens is None:
        end_of_turn_tokens = discover().end_of_turn_tokens()
    eos = [spec.eos_id] if spec.eos_id is not None else []
    eos += spec.extra_eos_ids
    if spec.chat_template:
        index = {t: i for i, t in enumerate(spec.tokens) if t in end_of_turn_tokens}
        eos += [index[t] for t in end_of_turn_tokens if t in index and t in spec.chat_template]
    eos = list(dict.fromkeys(eos))
    out = {"_from_model_config": True, "bos_token_id": spec.bos_id,
           "eos_token_id": eos[0] if len(eos) == 1 else (eos or None)}
    if spec.pad_id is not None:
        out["pad_token_id"] = spec.pad_id
    return out


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------

def safetensors_header(plan: list[PlannedTensor]) -> bytes:
    """The safetensors header (8-byte little-endian length + JSON padded to 8 bytes) for bf16 tensors."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for p in plan:
        header[p.hf_name] = {"dtype": "BF16", "shape": list(p.shape), "data_offsets": [offset, offset + p.nbytes]}
        offset += p.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors(path: Path, plan: list[PlannedTensor], progress: Progress | None = None) -> None:
    """Stream every planned tensor, dequantized and converted to bf16, into one safetensors file."""
    total = sum(p.nbytes for p in plan) or 1
    done = 0
    with open(path, "wb") as fh:
        fh.write(safetensors_header(plan))
        for p in plan:
            bits = f32_to_bf16_bits(materialize(p))
            fh.write(bits.tobytes())
            done += p.nbytes
            if progress:
                progress("converting tensors", 0.05 + 0.95 * done / total)


def _write_json(path: Path, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=2, ensure_ascii=False)
        fh.write("\n")


def _check_out_dir(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ConversionError(f"{out_dir} exists and is a file; choose another output directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise ConversionError(f"{out_dir} already exists and is not empty; choose another output "
                              "directory or pass overwrite=True (cpullm convert --overwrite)")


def _move_into_place(tmp: Path, out_dir: Path) -> None:
    """Rename the finished temporary directory to out_dir (replacing an empty or overwritten one)."""
    old = None
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(out_dir, old)
    try:
        os.replace(tmp, out_dir)
    except BaseException:
        if old is not None:
            os.replace(old, out_dir)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _convert_into(reader, meta: dict, tmp: Path, progress: Progress | None) -> None:
    """Write every output file of the conversion into the (empty) directory ``tmp``."""
    spec = arch_spec(meta.get("general.architecture"))
    hp = hyperparameters(meta, reader, spec)
    plan, tied = plan_tensors(reader, spec, hp)
    config = build_config(meta, reader, spec, hp, tied)
    try:   # the same checks a load runs: never write a config that cpullm itself would refuse
        check_config(config, "the converted config")
    except ConfigError as exc:
        raise ConversionError(f"{exc} (from the GGUF metadata)") from None
    if progress:
        progress("tokenizer", 0.02)
    tok, tok_config, tspec = build_tokenizer(meta, spec)
    tok.save(str(tmp / "tokenizer.json"))
    _write_json(tmp / "tokenizer_config.json", tok_config)
    _write_json(tmp / "generation_config.json", generation_config(tspec))
    _write_json(tmp / "config.json", config)
    write_safetensors(tmp / "model.safetensors", plan, progress)


_UNTRUSTED_DATA_ERRORS = (ValueError, TypeError, KeyError, IndexError, OverflowError, ZeroDivisionError,
                          RecursionError)


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *,
                 progress: Progress | None = None, overwrite: bool = False) -> Path:
    """Convert a GGUF file into a Hugging Face model directory; returns the directory.

    Writes config.json, model.safetensors (bf16), tokenizer.json, tokenizer_config.json and
    generation_config.json. The work happens in a hidden sibling directory that is renamed into
    place at the end, so a failed or interrupted conversion leaves nothing at ``out_dir``.
    ``progress(message, fraction)`` is called as the conversion advances.
    Raises ConversionError for an unsupported architecture or tensor type, a damaged file, or an
    existing non-empty ``out_dir`` (unless ``overwrite=True``).
    """
    out_dir = Path(os.path.expanduser(str(out_dir))).absolute()
    _check_out_dir(out_dir, overwrite)
    reader = open_gguf(gguf_path)
    if progress:
        progress("reading GGUF", 0.0)
    meta = read_metadata(reader)
    arch_spec(meta.get("general.architecture"))   # refuse an unsupported one before any work
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        try:
            _convert_into(reader, meta, tmp, progress)
        except _UNTRUSTED_DATA_ERRORS as exc:
            # every value is checked above; this keeps a combination no check foresaw from
            # ending in a traceback (the input is an untrusted file)
            raise ConversionError(f"{Path(gguf_path).name} cannot be converted: its metadata or tensors are "
                                  f"inconsistent ({type(exc).__name__}: {limits.one_line(exc, 160)})") from exc
        except MemoryError:
            raise ConversionError(f"not enough memory to convert {Path(gguf_path).name}") from None
        _check_out_dir(out_dir, overwrite)  # it may have appeared meanwhile
        _move_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if progress:
        progress("done", 1.0)
    return out_dir
