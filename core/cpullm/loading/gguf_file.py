"""A GGUF file read as a Hugging Face checkpoint: its header and tensors checked and mapped, the
tensors planned under transformers' names (llama.cpp's Q/K row permutation and ``1 + w`` norms
undone where the architecture has them), and the config.json the metadata describes.

Everything that depends on the GGUF architecture (tensor names, layout changes, config keys)
comes from the installed plugins' :class:`cpullm.loading.family.GGUFArch` (hook
``cpullm_gguf_architectures``). Used by the tensor store that runs a GGUF as it is
(:mod:`cpullm.loading.gguf_model`) and by ``cpullm convert`` (:mod:`cpullm.convert`).
"""
from __future__ import annotations

import math
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import limits
from ..errors import ConversionError
from .family import GGUFArch, GGUFLayout
from .plugins import discover

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


_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.([a-z0-9_]+)(?:\.(weight|bias))?$")
_GLOBAL_TENSOR = re.compile(r"^([a-z0-9_]+)\.(weight|bias)$")


EXPERT_INDEX = "{e}"
"""In a GGUFArch's ``layer_names``, a transformers leaf holding ``{e}``
(``"mlp.experts.{e}.gate_proj"``) names a 3-D tensor that stacks one matrix per expert, as
llama.cpp stores routed experts (``blk.N.ffn_gate_exps.weight``, numpy shape (E, rows, cols)):
each expert's slice is planned as the 2-D tensor of its own transformers name."""


def hf_tensor_name(gguf_name: str, spec: ArchSpec) -> str | None:
    """The transformers name of a GGUF tensor, or None when the table has no entry.

    ``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; a stacked expert
    tensor keeps ``{e}`` in its name (:data:`EXPERT_INDEX`).
    """
    m = _LAYER_TENSOR.match(gguf_name)
    if m:
        layer, leaf, kind = m.groups()
        whole = spec.layer_names.get(leaf if kind is None else f"{leaf}.{kind}")
        if whole is not None:                  # an entry naming the whole tensor ("ssm_a", "ssm_dt.bias")
            return f"model.layers.{layer}.{whole}"
        hf_leaf = spec.layer_names.get(leaf) if kind is not None else None
        return None if hf_leaf is None else f"model.layers.{layer}.{hf_leaf}.{kind}"
    m = _GLOBAL_TENSOR.match(gguf_name)
    if m:
        base = GLOBAL_TENSOR_NAMES.get(m.group(1))
        return None if base is None else f"{base}.{m.group(2)}"
    return None


# ---------------------------------------------------------------------------------------------
# Reading the GGUF file
# ---------------------------------------------------------------------------------------------

def import_gguf():
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
        """The stored bytes shaped like gguf.GGUFReader shapes them (rows, bytes per row): a copy
        read with pread (:meth:`GGUFFile.read_at`), so a file truncated while it loads is a
        ConversionError, never a SIGBUS from a read through the map."""
        gguf = import_gguf()
        raw = self._file.read_at(self.data_offset, self.n_bytes)
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
        fh, self.size = limits.open_regular(path)
        self._fh = fh                      # tensor data is read from it (read_at), not the map
        self.mm = np.memmap(fh, dtype=np.uint8, mode="r") if self.size else np.zeros(0, np.uint8)
        self.buf = memoryview(self.mm) if self.size else memoryview(b"")
        self.pos = 0
        self.metadata: dict[str, Any] = {}
        self.tensors: list[GGUFTensor] = []
        self._parse()

    def read_at(self, offset: int, n: int) -> np.ndarray:
        """``n`` bytes at ``offset`` (uint8, owned), read with pread: the file may have shrunk
        since its header was checked (truncated while loading), which is a ConversionError."""
        out = np.empty(n, np.uint8)
        view, done = memoryview(out), 0
        while done < n:
            got = os.preadv(self._fh.fileno(), [view[done:]], offset + done)
            if got <= 0:
                now = os.fstat(self._fh.fileno()).st_size
                raise ConversionError(f"{self.path} is truncated: it shrank to {now} bytes while being read "
                                      f"(a tensor ends at byte {offset + n}); do not change the file while "
                                      "cpullm loads it, or download it again")
            done += got
        return out

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
        gguf = import_gguf()
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
        self._check_no_overlap()

    def _check_no_overlap(self) -> None:
        """Tensors whose bytes overlap (or whose type makes one read into the next) are refused,
        naming both, as llama.cpp and the safetensors loader refuse them."""
        spans = sorted((t.data_offset, t.data_offset + t.n_bytes, t.name) for t in self.tensors if t.n_bytes)
        for (s0, e0, a), (s1, e1, b) in zip(spans, spans[1:]):
            if s1 < e0:
                raise ConversionError(f"{self.path} is damaged: tensors {limits.shown(a, 80)} (bytes {s0}..{e0}) "
                                      f"and {limits.shown(b, 80)} (bytes {s1}..{e1}) overlap; download it again")


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
    except OSError as exc:
        raise ConversionError(f"cannot read {path}: {exc.strerror}; give a readable .gguf file") from None
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
    layout: GGUFLayout | None = None  # the architecture's reorder / rescale / reshape of this tensor
    stored_shape: tuple[int, ...] | None = None   # row-major as stored, when it is not ``shape``

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * 2  # bf16


def _dequantize(t) -> np.ndarray:
    """A GGUF tensor as float32 in HF (row-major) shape."""
    gguf = import_gguf()
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
    return to_hf(p, _dequantize(p.source))


def to_hf(p: PlannedTensor, w: np.ndarray) -> np.ndarray:
    """The stored values ``w`` (float32) of a planned tensor in transformers' shape and convention."""
    stored = p.stored_shape or p.shape
    if tuple(w.shape) != stored:
        try:
            w = w.reshape(stored)
        except ValueError as exc:
            raise ConversionError(f"tensor {p.source.name}: dequantized to shape {w.shape}, expected "
                                  f"{stored}; the file is damaged") from exc
    if p.permute_heads:
        w = unpermute_qk(w, p.permute_heads)
    layout = p.layout
    if layout is not None:
        if layout.rows is not None:
            w = w[layout.rows]
        if layout.columns is not None:
            w = w[..., layout.columns]
        if layout.to_hf is not None:
            w = np.asarray(layout.to_hf(w), dtype=np.float32)
    if p.subtract_one or (layout is not None and layout.add_one):
        w = w - np.float32(1.0)
    return w.reshape(p.shape)


def reorder_blocks(p: PlannedTensor, data: np.ndarray, fmt) -> np.ndarray | None:
    """The stored blocks (uint8 (rows, row bytes), ``fmt`` a cpullm_kernels BlockFormat) of a
    planned matrix in transformers' order, or None when its layout cannot be run on blocks (values
    change, or columns move within a block)."""
    layout = p.layout
    if layout is None:
        return data
    if layout.moves_values or len(p.shape) != 2:
        return None
    if layout.rows is not None:
        data = data[layout.rows]
    if layout.columns is not None:
        if len(layout.columns) % fmt.block_weights:
            return None
        cols = np.asarray(layout.columns).reshape(-1, fmt.block_weights)   # one row per block
        starts = cols[:, 0]
        if np.any(starts % fmt.block_weights) or np.any(cols - starts[:, None] != np.arange(fmt.block_weights)):
            return None
        order = starts // fmt.block_weights
        data = data.reshape(data.shape[0], -1, fmt.block_bytes)[:, order].reshape(data.shape[0], -1)
    return np.ascontiguousarray(data)


# ---------------------------------------------------------------------------------------------
# Planning: names, shapes, tied embeddings
# ---------------------------------------------------------------------------------------------

def _hf_shape(t) -> tuple[int, ...]:
    """GGUF stores ggml's ne (innermost first); HF/numpy shape is the reverse."""
    return tuple(int(d) for d in reversed(t.shape))


def _tensors_identical(a, b) -> bool:
    if a.tensor_type != b.tensor_type or a.shape != b.shape:
        return False
    return np.array_equal(a._file.read_at(a.data_offset, a.n_bytes), b._file.read_at(b.data_offset, b.n_bytes))


def plan_tensors(reader, spec: ArchSpec, hp: dict) -> tuple[list[PlannedTensor], bool]:
    """Map every GGUF tensor to its HF name and transform; returns (plan, tie_word_embeddings).

    All unknown names and all missing required tensors are reported in one ConversionError.
    """
    by_name = {t.name: t for t in reader.tensors}
    unknown, plan, bad_types, misshapen = [], [], [], []
    layouts = spec.tensor_layouts(reader.metadata)
    n_layers, nextn = hp["num_hidden_layers"], hp.get("nextn_predict_layers", 0)
    stacked: list[tuple[str, list]] = []      # (name, slices) of each 3-D expert tensor
    tied = "output.weight" not in by_name
    if not tied and "token_embd.weight" in by_name:
        tied = _tensors_identical(by_name["output.weight"], by_name["token_embd.weight"])
    for t in reader.tensors:
        if DROPPED_TENSORS.match(t.name) or (tied and t.name == "output.weight") or \
                _prediction_block(t.name, n_layers, nextn):
            continue
        hf = hf_tensor_name(t.name, spec)
        if hf is None:
            unknown.append(t.name)
            continue
        if t.tensor_type.name not in SUPPORTED_TENSOR_TYPES:
            bad_types.append(f"{t.name} ({t.tensor_type.name})")
        if EXPERT_INDEX in hf:
            experts = _expert_slices(t, hf, len(plan))
            if stacked and len(experts) != len(stacked[0][1]):
                raise ConversionError(f"tensor {limits.shown(t.name, 80)} stacks {len(experts)} experts but "
                                      f"{limits.shown(stacked[0][0], 80)} stacks {len(stacked[0][1])}; "
                                      "every expert tensor holds all the experts: the file is damaged")
            stacked.append((t.name, experts))
            plan += experts
            continue
        p = PlannedTensor(hf, t, _hf_shape(t))
        layout = layouts.get(re.sub(r"^blk\.\d+\.", "", t.name))
        if layout is not None:
            wrong = _layout_mismatch(layout, p.shape)
            if wrong:
                misshapen.append(f"{t.name} {wrong}")
                continue
            p.layout = layout
            if layout.hf_shape is not None and tuple(layout.hf_shape) != p.shape:
                p.stored_shape, p.shape = p.shape, tuple(int(d) for d in layout.hf_shape)
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
    if misshapen:
        raise ConversionError(f"cannot convert this GGUF: tensors whose shape disagrees with its metadata: "
                              f"{'; '.join(misshapen[:6])}. The file is damaged or not a {hp['arch']} model; "
                              "download it again")
    missing = _missing_tensors(by_name, spec, n_layers, reader.metadata)
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


def _expert_slices(t: "GGUFTensor", hf_pattern: str, planned: int) -> list[PlannedTensor]:
    """The E matrices of a stacked expert tensor (ggml ne (cols, rows, E)), each planned as the
    2-D tensor ``hf_pattern`` names with its index: a view of the expert's own bytes, so a matrix
    stored in a block format runs as it is and only the chosen experts' bytes are read."""
    if len(t.shape) != 3 or not all(t.shape):
        raise ConversionError(f"tensor {limits.shown(t.name, 80)} has shape {list(t.shape)}; routed experts are "
                              "stored as a 3-D tensor (columns, rows, experts); the file is damaged")
    n_experts = int(t.shape[2])
    if planned + n_experts > limits.MAX_TENSORS:
        raise ConversionError(f"tensor {limits.shown(t.name, 80)} stacks {n_experts} experts: more than the "
                              f"{limits.MAX_TENSORS} matrices cpullm reads from one file; the file is damaged")
    step = t.n_bytes // n_experts          # ne[0] is whole blocks, so every expert is whole rows of blocks
    return [PlannedTensor(hf_pattern.replace(EXPERT_INDEX, str(e)),
                          GGUFTensor(f"{t.name}[{e}]", t.tensor_type, t.shape[:2], step, t.data_offset + e * step,
                                     t._file),
                          (int(t.shape[1]), int(t.shape[0])))
            for e in range(n_experts)]


def _missing_tensors(by_name: dict, spec: ArchSpec, n_layers: int, meta: dict) -> list[str]:
    need = ["token_embd.weight", "output_norm.weight"]
    if spec.layer_tensors is not None:
        need += [f"blk.{i}.{name}" for i in range(n_layers) for name in spec.layer_tensors(meta, i)]
    else:
        need += [f"blk.{i}.{leaf}.weight" for i in range(n_layers) for leaf in spec.required_layer_leaves]
    return [n for n in need if n not in by_name]


def _prediction_block(name: str, n_layers: int, nextn: int) -> bool:
    """A tensor of one of the ``nextn`` multi-token-prediction blocks llama.cpp appends after the
    decoder's ``n_layers``: not run by cpullm, so not read."""
    m = re.match(r"^blk\.(\d+)\.", name)
    return m is not None and n_layers <= int(m.group(1)) < n_layers + nextn


def _layout_mismatch(layout: GGUFLayout, shape: tuple) -> str:
    """Why a stored tensor of ``shape`` (row-major) does not fit its layout, or ""."""
    if layout.gguf_shape is not None and tuple(layout.gguf_shape) != shape:
        return f"has shape {list(shape)}, expected {list(layout.gguf_shape)}"
    count = int(np.prod(shape, dtype=np.int64))
    if layout.hf_shape is not None and int(np.prod(layout.hf_shape, dtype=np.int64)) != count:
        return f"has {count} values, expected {int(np.prod(layout.hf_shape, dtype=np.int64))}"
    if layout.rows is not None and len(layout.rows) != shape[0]:
        return f"has {shape[0]} rows, expected {len(layout.rows)}"
    if layout.columns is not None and len(layout.columns) != shape[-1]:
        return f"has {shape[-1]} columns, expected {len(layout.columns)}"
    return ""


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
        # absent (an all-experts MLP): None, which build_config accepts only if the arch says so
        "intermediate_size": _meta_int(meta, arch, "feed_forward_length", 1, limits.MAX_INTERMEDIATE,
                                       per_layer=True) if f"{arch}.feed_forward_length" in meta else None,
        **_decoder_layers(meta, arch),
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
    tokens = meta.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and len(tokens) > vocab:
        raise ConversionError(f"this GGUF's vocabulary (tokenizer.ggml.tokens) has {len(tokens)} tokens but "
                              f"its embedding only {vocab} rows: text could tokenize to ids the model has no "
                              "row for; the file is damaged")
    hp["vocab_size"] = vocab
    return hp


def _decoder_layers(meta: dict, arch: str) -> dict:
    """``num_hidden_layers``: ``block_count`` less llama.cpp's trailing multi-token-prediction
    blocks (``nextn_predict_layers``, also returned): cpullm runs the decoder, not the draft head."""
    blocks = _meta_int(meta, arch, "block_count", 1, limits.MAX_LAYERS)
    nextn = _meta_int(meta, arch, "nextn_predict_layers", 0, blocks - 1, default=0)
    return {"num_hidden_layers": blocks - nextn, "nextn_predict_layers": nextn}


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


def token_id(meta: dict, key: str) -> int | None:
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
        "bos_token_id": token_id(meta, "bos_token_id"),
        "eos_token_id": token_id(meta, "eos_token_id"),
        "pad_token_id": token_id(meta, "padding_token_id"),
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "bfloat16",
    }
    extras = spec.config_extras(meta, hp, tuple(t.name for t in reader.tensors))
    cfg.update(extras)
    if cfg["intermediate_size"] is None:
        if "intermediate_size" in extras:     # the architecture has no dense MLP width (all experts)
            del cfg["intermediate_size"]
            return cfg
        raise ConversionError(f"the GGUF metadata lacks {arch}.feed_forward_length; the file is incomplete "
                              "or damaged")
    return cfg
