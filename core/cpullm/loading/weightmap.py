"""Declarative weight maps: checkpoint tensor names -> canonical names, as data.

A family writes its map as a list of rules::

    WeightMap(
        rules=[
            W("embed", "model.embed_tokens.weight", shape=(V, H)),
            W("layers.{i}.attn_norm", "model.layers.{i}.input_layernorm.weight", shape=(H,)),
            W("layers.{i}.mlp_norm", "model.layers.{i}.post_attention_layernorm.weight",
              shape=(H,), transform=ADD_ONE),
            W("lm_head", "lm_head.weight", shape=(V, H), tied_to="embed"),
        ],
        n_layers=L,
        aliases=[("model.language_model.", "model.")],   # other prefixes real checkpoints use
        ignore=[r"^model\\.visual\\.", r"^mtp\\."],         # present on purpose, not needed
    )

``resolve(store)`` checks everything at once: every missing tensor, every unexpected one and
every wrong shape appear in a single WeightMapError. Transforms run once, from the stored tensor
to the canonical one; the canonical tensors are never transformed again.
"""
from __future__ import annotations

import re
from typing import Callable

import attrs
import numpy as np

from ..errors import WeightMapError
from ..limits import one_line


@attrs.define(frozen=True)
class Transform:
    """A named, pure function ``fn(stored, args) -> array``, applied once at load.

    ``stored`` is the checkpoint tensor as float32 (never modify it in place: it may be a view of
    the file), ``args`` the family's Args. The canonical tensor is never transformed again. Two
    rules may read one stored tensor with different transforms: each canonical tensor is then its
    own matrix in the compiled program, while rules with the same source, transform and rows share
    one copy (tied embeddings). The ``name`` enters the execution-cache key, so give each
    transform of a plugin its own name.

    Shape rule: without ``shape`` the result keeps the stored shape (reorder or rescale values).
    A transform that changes it declares ``shape(stored_shape: tuple, args) -> tuple``, the
    canonical shape, which must have as many elements: :data:`TRANSPOSE` turns a Conv1D matrix
    stored (in, out) (GPT-2) into the (out, in) a LINEAR reads. ``W.shape`` stays the *stored*
    shape (what the checkpoint is checked against); ``W.rows`` takes rows of the *canonical*
    (transformed) tensor; the compiler sees only canonical shapes, so the result quantizes like
    any LINEAR weight. A transformed tensor is computed whole once per matrix at build time.
    """

    name: str
    fn: Callable
    shape: Callable | None = None     # (stored shape, args) -> canonical shape; None: unchanged

    def __call__(self, arr, args=None):
        return self.fn(arr, args)

    def out_shape(self, stored_shape: tuple, args=None) -> tuple:
        """The canonical shape of a stored tensor of ``stored_shape``."""
        stored_shape = tuple(int(d) for d in stored_shape)
        if self.shape is None:
            return stored_shape
        out = tuple(int(d) for d in self.shape(stored_shape, args))
        if int(np.prod(out, dtype=np.int64)) != int(np.prod(stored_shape, dtype=np.int64)):
            raise WeightMapError(f"transform {self.name} declares shape {out} for a stored {stored_shape}: "
                                 f"a reshape keeps the number of values")
        return out


ADD_ONE = Transform("add_one", lambda w, args: w + np.float32(1.0))   # zero-centred RMSNorm weight
TRANSPOSE = Transform("transpose", lambda w, args: w.T,                # Conv1D (in, out) -> (out, in)
                      shape=lambda stored, args: tuple(reversed(stored)))


@attrs.define(frozen=True)
class W:
    """One canonical tensor: where it comes from, its stored shape, an optional transform.

    ``{i}`` in both names expands over the layers (or over ``layers`` if given). ``tied_to`` names
    the canonical tensor used when the source is absent (tied embeddings). ``optional`` tensors may
    be absent (biases a config may or may not enable are better made explicit by the family).
    ``rows=(start, stop)`` takes those rows (first axis) of the stored tensor, after the transform:
    fused checkpoint projections (``qkv_proj``, ``gate_up_proj``) become separate canonical
    tensors this way, and the compiler fuses LINEARs that share an input back into one matrix."""

    canonical: str
    source: str | None        # None: never stored (always tied_to another tensor)
    shape: tuple | None = None
    transform: Transform | None = None
    tied_to: str | None = None
    optional: bool = False
    layers: tuple | None = None
    rows: tuple | None = None         # (start, stop) on the stored tensor's first axis


@attrs.define
class WeightMap:
    rules: list
    n_layers: int = 0
    aliases: list = attrs.field(factory=list)   # (prefix found in checkpoints, prefix used in rules)
    ignore: list = attrs.field(factory=list)    # regexes of tensors deliberately unused

    def expand(self) -> list[W]:
        out = []
        for r in self.rules:
            if "{i}" in r.canonical:
                for i in (r.layers if r.layers is not None else range(self.n_layers)):
                    out.append(attrs.evolve(
                        r, canonical=r.canonical.format(i=i),
                        source=r.source.format(i=i) if r.source else None,
                        tied_to=r.tied_to.format(i=i) if r.tied_to else None, layers=None))
            else:
                out.append(r)
        return out

    def _normalise(self, name: str) -> str:
        for found, used in self.aliases:
            if name.startswith(found):
                return used + name[len(found):]
        return name

    def resolve(self, store, args=None) -> "ResolvedWeights":
        """Match rules to the store's tensors; raise one WeightMapError listing every problem."""
        by_norm: dict[str, str] = {}
        for name in store.names():
            by_norm.setdefault(self._normalise(name), name)
        ignore = [re.compile(p) for p in self.ignore]
        rules = self.expand()
        missing, bad_shape, used = [], [], set()
        found: dict[str, tuple] = {}
        row_ranges: dict[str, tuple] = {}
        for r in rules:
            stored = by_norm.get(r.source) if r.source else None
            if stored is None:
                if r.tied_to or r.optional:
                    continue
                missing.append(r.source)
                continue
            used.add(stored)
            if r.shape is not None and tuple(store.shape(stored)) != tuple(r.shape):
                bad_shape.append(f"{stored}: expected {tuple(r.shape)}, found {tuple(store.shape(stored))}")
                continue
            if r.rows is not None:
                r0, r1 = (int(v) for v in r.rows)
                n_rows = _canonical_shape(r.transform, store.shape(stored), args)[0]
                if not 0 <= r0 < r1 <= n_rows:
                    bad_shape.append(f"{stored}: rows {tuple(r.rows)} for {r.canonical} are outside its "
                                     f"{n_rows} rows")
                    continue
                row_ranges[r.canonical] = (r0, r1)
            found[r.canonical] = (stored, r.transform)
        ties = {}
        for r in rules:
            if r.canonical not in found and r.tied_to:
                if r.tied_to not in found:
                    missing.append(r.source or r.canonical)
                else:
                    ties[r.canonical] = r.tied_to
        ignored = [n for n in store.names() if n not in used and any(p.search(n) for p in ignore)]
        unused = [n for n in store.names() if n not in used and n not in ignored]
        problems = []
        if missing:
            problems.append(f"missing tensors ({len(missing)}): " + _first(missing, ", "))
        if bad_shape:
            problems.append(f"wrong shapes ({len(bad_shape)}): " + _first(bad_shape, "; "))
        if unused:
            problems.append(f"unexpected tensors ({len(unused)}): " + _first(sorted(unused), ", "))
        if problems:
            raise WeightMapError(
                "the checkpoint does not match the family's weight map: " + " | ".join(problems)
                + ". Check that config.json belongs to these weights (layer count, head counts, "
                "sizes) and that the right family plugin is installed")
        return ResolvedWeights(store=store, found=found, ties=ties, ignored=ignored, args=args,
                               rows=row_ranges)


def _canonical_shape(transform, stored_shape, args) -> tuple:
    """The shape a stored tensor has once ``transform`` (or none) ran on it."""
    return tuple(stored_shape) if transform is None else transform.out_shape(stored_shape, args)


_LISTED = 40   # names shown per kind of problem: all of a real mismatch, not 20k of a hostile one


def _first(items: list, sep: str) -> str:
    """The first ``_LISTED`` items joined by ``sep``, with how many more there are."""
    shown = sep.join(one_line(x, 200) for x in items[:_LISTED])
    return shown + (f"{sep}... (+{len(items) - _LISTED} more)" if len(items) > _LISTED else "")


@attrs.define
class ResolvedWeights:
    """Canonical name -> tensor, loaded lazily (one tensor at a time, float32)."""

    store: object
    found: dict
    ties: dict
    ignored: list
    args: object = None
    rows: dict = attrs.field(factory=dict)     # canonical -> (start, stop) rows of its source
    _whole: tuple = attrs.field(default=(None,), init=False, repr=False, eq=False)  # get_rows' transformed tensor

    def names(self) -> list[str]:
        return list(self.found) + list(self.ties)

    def __contains__(self, canonical: str) -> bool:
        return canonical in self.found or canonical in self.ties

    def is_tied(self, canonical: str) -> bool:
        return canonical in self.ties

    def source_of(self, canonical: str) -> str:
        canonical = self.ties.get(canonical, canonical)
        return self.found[canonical][0]

    def identity(self, canonical: str) -> tuple:
        """(source, transform, rows): equal for two canonical names exactly when they are the same
        tensor (a tie, or two rules reading one stored tensor alike); the compiler packs one copy
        per identity, never per source alone."""
        canonical = self.ties.get(canonical, canonical)
        stored, transform = self.found[canonical]
        return stored, transform, self.rows.get(canonical)

    def shape(self, canonical: str) -> tuple:
        """The canonical tensor's shape: the stored one, or its transform's (``Transform.shape``),
        or its rows of that."""
        stored, transform, rows = self.identity(canonical)
        shape = _canonical_shape(transform, self.store.shape(stored), self.args)
        return shape if rows is None else (rows[1] - rows[0], *shape[1:])

    def get(self, canonical: str, out: np.ndarray | None = None) -> np.ndarray:
        """The canonical tensor as float32; written into ``out`` (float32, its shape) if given."""
        stored, transform, rows = self.identity(canonical)
        if transform is None and rows is None:
            return self.store.get(stored) if out is None else self.store.get(stored, out=out)
        arr = self.store.get(stored)
        if transform is not None:
            arr = np.ascontiguousarray(transform(arr, self.args), dtype=np.float32)
            want = transform.out_shape(self.store.shape(stored), self.args)
            if arr.shape != want:
                raise WeightMapError(f"transform {transform.name} turned {stored} {self.store.shape(stored)} "
                                     f"into {arr.shape}, not the {want} it declares; a transform keeps the "
                                     f"stored shape unless it declares another (Transform(shape=...))")
        if rows is not None:
            arr = np.ascontiguousarray(arr[rows[0]: rows[1]])
        if out is not None:
            out[...] = arr
            return out
        return arr

    def get_rows(self, canonical: str, r0: int, r1: int, out: np.ndarray) -> np.ndarray:
        """Rows ``r0:r1`` of the canonical tensor as float32, written into ``out`` (float32,
        (r1 - r0, ...)): read from the stored rows alone when no transform applies; a transformed
        tensor is computed whole once and kept until :meth:`release` (transforms may mix rows)."""
        stored, transform, rows = self.identity(canonical)
        if transform is None:
            base = rows[0] if rows is not None else 0
            return self.store.get_rows(stored, base + r0, base + r1, out=out)
        key = (stored, transform, rows)
        if self._whole[0] != key:
            self._whole = (None,)
            self._whole = (key, self.get(canonical))
        out[...] = self._whole[1][r0:r1]
        return out

    def release(self, canonical: str) -> None:
        """Drop what reading ``canonical`` left resident: the mapped source pages of its stored
        tensor and a transformed copy kept by :meth:`get_rows`."""
        stored, _, _ = self.identity(canonical)
        self._whole = (None,)
        if hasattr(self.store, "release"):
            self.store.release(stored)

    def blocks(self, canonical: str):
        """(ggml format name, uint8 (rows, row bytes)) when the canonical tensor is stored as raw
        ggml blocks the runtime executes as they are (a GGUF store's quantized tensor, read with
        no transform; its rows taken for ``rows``), else None."""
        stored, transform, rows = self.identity(canonical)
        get = getattr(self.store, "blocks", None)
        if get is None or transform is not None:
            return None
        found = get(stored)
        if found is None:
            return None
        fmt, data = found
        return fmt, (data if rows is None else data[rows[0]: rows[1]])

    def fingerprint(self) -> list:
        """What the mapping did, for cache keys: (canonical, source, transform name[, rows])."""
        out = [[c, s, t.name if t else None] + ([list(self.rows[c])] if c in self.rows else [])
               for c, (s, t) in sorted(self.found.items())]
        out += [[c, "tied:" + t, None] for c, t in sorted(self.ties.items())]
        return out
