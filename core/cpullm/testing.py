"""cpullm.testing: the conformance kit a family plugin runs in its own test suite.

One call per family and checkpoint::

    from cpullm.testing import run_conformance
    report = run_conformance(model_dir, ids, reference_logits=ref, reference_tokens=toks)

or, with no checkpoint at hand, one call per config (a tiny random checkpoint is written first)::

    from cpullm.testing import run_family_conformance
    report = run_family_conformance(TINY_CONFIG, tmp_path, reference=my_reference_forward)

checks, each raising AssertionError with a message that says what failed:

* the family resolves from config.json (to the expected family, if named) and its Args build,
  ignoring config keys they do not know;
* the weight map accounts for every tensor of the checkpoint (missing, unexpected and mis-shaped
  tensors are all reported), and resolving is idempotent: resolving twice, or reading a tensor
  twice, gives identical tensors, and transforms such as ``1 + w`` are applied exactly once;
* the compiled program holds, for every matrix and norm weight, exactly the canonical tensor the
  weight map gives (two canonical tensors read from one stored tensor with different transforms
  or rows must not share one packed copy);
* the graph validates, every weight it reads is resolved, and every resolved tensor is read by
  the graph (a mapped but unused tensor is a silently wrong model);
* an f32 forward pass runs and gives finite logits of shape (T, vocab);
* cached decode (prefill a prefix, then one token at a time) equals the uncached forward, both
  from the first token and from the middle; a prefill split into small chunks equals one chunk;
* f32 logits match the author's reference within ``tol`` x max |reference| at every position
  (:data:`F32_TOLERANCE`, 1e-3, by default);
* greedy tokens with the KV cache equal the reference tokens (up to a near-tie, where f32
  rounding may pick either token);
* INT8 stays close to f32 on both paths (batched prefill, and token-by-token decode, which is
  what generation runs): mean cosine of mean-centred logits >= :data:`INT8_MIN_COSINE`, top-1
  agreement >= :data:`INT8_MIN_TOP1`;
* every fused kernel (:class:`cpullm.loading.family.KernelSpec`) gives the same logits as the reference
  kernel it replaces, one kernel at a time, in prefill and in decode: on this checkpoint when the
  kernel applies to it, else (for the family's own plugin's kernels) on a small sample graph of
  the kernel's op;
* every plugin op (:class:`cpullm.loading.family.OpSpec`) the graph uses: its fast kernels give the same
  logits as its numpy reference, in prefill and in decode;
* batched decode (several sequences at different positions in one step, what the server's
  scheduler runs) gives each sequence the logits it gets decoded alone;
* a declared context limit (``FamilySpec.context_limit``) holds: the default context stays
  within it, one more is refused at load with a ConfigError naming the fix, and the limit itself
  loads and runs its last position.

It also reports the share of the program's weight bytes that stay float32 under INT8 and 4-bit
(:func:`float32_share`), with a note when it is over :data:`FLOAT32_SHARE_NOTE`: a matrix the
compiler cannot quantize (a plugin op's weight not declared in ``OpSpec.matrices``, a stored
layout no rule maps onto a LINEAR) decodes several times slower than it could.

``make_random_checkpoint`` writes a random checkpoint from the family's own weight map, for
authors without a reference checkpoint at hand. Tests never assert a timing.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np

F32_TOLERANCE = 1e-3          # max |delta logit| <= F32_TOLERANCE * max |reference logit|
INT8_MIN_COSINE = 0.98
INT8_MIN_TOP1 = 0.75
GREEDY_TIE = 1e-4             # two logits this close (x max |logit|) may greedy-pick either token
FLOAT32_SHARE_NOTE = 0.25     # float32 share of the weight bytes under INT8 / 4-bit worth a note


class ConformanceWarning(UserWarning):
    """Something the kit could not check with the given inputs (e.g. ids shorter than a window)."""


def fidelity(logits: np.ndarray, ref: np.ndarray) -> dict:
    """Mean cosine of mean-centred logits, top-1 agreement and mean KL(ref || logits), nats.
    Computed a few positions (~1M logits) at a time: each float64 temporary then stays under
    glibc's mmap threshold and reuses the heap, where whole-array temporaries are fresh pages
    every time (60 s instead of 4 s for Gemma 3's 262k vocabulary over 505 positions, here)."""
    logits, ref = np.asarray(logits), np.asarray(ref)
    assert logits.shape == ref.shape, f"shape {logits.shape} != reference {ref.shape}"
    logits, ref = logits.reshape(-1, logits.shape[-1]), ref.reshape(-1, ref.shape[-1])
    rows = max(1, (1 << 20) // logits.shape[-1])
    cos, top1, kl = [], [], []
    for r0 in range(0, logits.shape[0], rows):
        x, y = logits[r0:r0 + rows].astype(np.float64), ref[r0:r0 + rows].astype(np.float64)
        a = x - x.mean(-1, keepdims=True)
        b = y - y.mean(-1, keepdims=True)
        cos.append((a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1) + 1e-30))
        top1.append(x.argmax(-1) == y.argmax(-1))
        lp, lq = _log_softmax(x), _log_softmax(y)
        kl.append((np.exp(lq) * (lq - lp)).sum(-1))
    return {"cosine": float(np.concatenate(cos).mean()), "top1": float(np.concatenate(top1).mean()),
            "kl": float(np.concatenate(kl).mean())}


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _rel_err(got, ref) -> float:
    return float(np.abs(got - ref).max() / max(float(np.abs(ref).max()), 1e-30))


def _load(model_dir, quant="f32", **kw):
    import cpullm
    return cpullm.load(model_dir, quant=quant, use_cache=False, **kw)


# ---------------------------------------------------------------------------------------------
# Resolution, Args, weight map, graph
# ---------------------------------------------------------------------------------------------


def check_resolves(model_dir, family: str | None = None):
    """(FamilySpec, Args) for the checkpoint; ``family``: the family name it must resolve to."""
    from .loading import plugins
    from .loading.family import read_config

    config = read_config(Path(model_dir))
    registry = plugins.discover()
    fam = registry.family_for(config)
    if family is not None:
        conflicts = "; ".join(registry.conflicts) or "none"
        assert fam.name == family, (
            f"model_type {config.get('model_type')!r} resolves to family {fam.name!r} of "
            f"{fam.plugin}, not {family!r} (conflicts: {conflicts})")
    args = fam.args(config)
    try:
        fam.args({**config, "cpullm_conformance_unknown_key": 1})
    except Exception as exc:  # noqa: BLE001 - any failure here is the finding
        raise AssertionError(f"{fam.args_class.__qualname__}.from_config must ignore config keys it "
                             f"does not know: {type(exc).__name__}: {exc}") from exc
    return fam, args


def check_weight_map(model_dir) -> dict:
    """Every tensor accounted for (resolve raises otherwise); transforms applied exactly once;
    resolving twice, and reading one tensor twice, give identical tensors."""
    from .loading.tensors import TensorStore

    family, args = check_resolves(model_dir)
    store = TensorStore(model_dir)
    wmap = family.weight_map(args)
    first = wmap.resolve(store, args)
    second = wmap.resolve(store, args)
    assert sorted(first.names()) == sorted(second.names()), "resolving twice gives other tensors"
    for name in first.names():
        a, b = first.get(name), second.get(name)
        assert np.array_equal(a, b), f"weight map is not idempotent for {name}"
        assert np.array_equal(first.get(name), a), \
            f"{name}: reading the tensor twice gives different values (a transform works in place?)"
    for canonical, (stored, transform) in first.found.items():
        if transform is not None:
            once = transform(store.get(stored), args)
            if canonical in first.rows:
                r0, r1 = first.rows[canonical]
                once = once[r0:r1]
            assert np.array_equal(first.get(canonical), once), \
                f"{canonical}: the {transform.name} transform was not applied exactly once"
    return {"tensors": len(first.names()), "ignored": len(first.ignored)}


def compiled_weight_mismatches(graph, weights, program=None) -> list[str]:
    """The canonical tensors whose copy in ``program`` (an f32 program of ``graph``; compiled here
    if None) differs from ``weights.get(name)`` (``meta["weight_slots"]`` says where each went)."""
    from .compile.compiler import compile_graph

    if program is None:
        program = compile_graph(graph, weights, quant="f32", n_ctx=32, max_chunk=4)
    wf = program.arrays["wf"]
    bad = []
    for name, (kind, off, size, *_) in program.meta["weight_slots"].items():
        want = np.asarray(weights.get(name), np.float32).reshape(-1)
        if kind != "f32" or want.size != size or not np.array_equal(wf[off: off + size], want):
            bad.append(name)
    return sorted(bad)


def check_compiled_weights(model_dir, program=None) -> dict:
    """Every matrix and norm weight of the f32 program (``program``, or one compiled here) equals
    the canonical tensor of the weight map. Two canonical tensors read from one stored tensor with
    different transforms (or rows) are two tensors: a program that packed them as one would
    compute a silently wrong model."""
    from .graph.ir import GraphBuilder
    from .loading.tensors import TensorStore

    family, args = check_resolves(model_dir)
    weights = family.weight_map(args).resolve(TensorStore(model_dir), args)
    graph = family.build_graph(args, GraphBuilder())
    bad = compiled_weight_mismatches(graph, weights, program)
    assert not bad, (f"the compiled program does not hold the weight map's tensors for {', '.join(bad)}: "
                     f"check rules that read one stored tensor with different transforms or rows")
    return {"checked": len(weights.names())}


def check_graph_weights(model_dir) -> dict:
    """The graph validates; it reads only resolved tensors, and reads every resolved tensor."""
    from .graph.ir import GraphBuilder
    from .loading.tensors import TensorStore

    family, args = check_resolves(model_dir)
    weights = family.weight_map(args).resolve(TensorStore(model_dir), args)
    graph = family.build_graph(args, GraphBuilder())
    graph.validate()
    read = {w for n in graph.nodes for _, w in n.weights}
    resolved = set(weights.names())
    missing = sorted(read - resolved)
    assert not missing, (f"the graph reads tensors the weight map does not provide: "
                         f"{', '.join(missing)}; add rules for them (or fix the names)")
    unread = sorted(resolved - read)
    assert not unread, (f"the weight map provides tensors the graph never reads: {', '.join(unread)}; "
                        f"use them in build_graph, or list their checkpoint names in WeightMap.ignore")
    return {"nodes": len(graph.nodes), "weights": len(read)}


# ---------------------------------------------------------------------------------------------
# Forward, cache, parity
# ---------------------------------------------------------------------------------------------


def check_forward(model, ids) -> np.ndarray:
    logits = model.logits(ids)
    assert logits.shape == (len(ids), model.program.meta["vocab"]), f"logits shape {logits.shape}"
    assert np.isfinite(logits).all(), "non-finite logits"
    return logits


def _cached_logits(fwd, ids, split: int) -> np.ndarray:
    """Prefill ids[:split] (all logits), then decode the rest one token at a time (a
    cpullm.run.forward.Forward's steps of one fresh slot)."""
    slot = fwd.new_slot()
    rows = [fwd.prefill(slot, ids[:split], all_logits=True)]
    rows += [np.array(fwd.step([slot], [t])[0][0], np.float32)[None] for t in ids[split:]]
    return np.concatenate(rows)


def check_cached_decode(model, ids, full_logits=None, split: int | None = None, tol: float = F32_TOLERANCE):
    """Prefill ids[:split] then decode the rest one token at a time: equal to the full forward."""
    full = model.logits(ids) if full_logits is None else full_logits
    split = split or max(1, len(ids) // 2)
    got = _cached_logits(model.forward, ids, split)
    err = _rel_err(got, full)
    assert err <= tol, (f"cached decode (prefill {split}, then one token at a time) differs from the "
                        f"uncached forward by {err:.2e} (relative, tolerance {tol:.0e})")
    return err


def check_chunked_prefill(model_dir, ids, full_logits, chunk: int | None = None,
                          tol: float = F32_TOLERANCE) -> float:
    """A prefill split into chunks of ``chunk`` tokens equals the one-chunk forward (f32)."""
    chunk = chunk or max(2, len(ids) // 3 - 1)
    model = _load(model_dir, max_chunk=chunk)
    err = _rel_err(model.logits(ids), full_logits)
    assert err <= tol, (f"prefill in chunks of {chunk} tokens differs from the one-chunk forward by "
                        f"{err:.2e} (relative, tolerance {tol:.0e})")
    return err


def check_parity(logits, reference, tol: float = F32_TOLERANCE) -> float:
    reference = np.asarray(reference, np.float32)
    assert logits.shape == reference.shape, f"shape {logits.shape} != reference {reference.shape}"
    scale = np.abs(reference).max()
    per_pos = np.abs(logits - reference).max(-1) / scale
    worst = int(per_pos.argmax())
    assert per_pos.max() <= tol, (f"f32 logits differ from the reference by {per_pos.max():.2e} x max|ref| "
                                  f"at position {worst} (tolerance {tol:.0e})")
    return float(per_pos.max())


def check_greedy(model, ids, reference_tokens, tie: float = GREEDY_TIE) -> list[int]:
    """Greedy tokens with the KV cache equal the reference's, up to a tie. Where the two sequences
    first part, the step must be a near-tie: our logits of the two tokens, on the shared prefix,
    within ``tie`` x max|logit|; f32 rounding may then pick either, and what follows the tie is
    not compared. Returns our tokens."""
    reference = [int(t) for t in reference_tokens]
    got = [int(t) for t in model.generate_ids(ids, max_new_tokens=len(reference), temperature=0.0,
                                              ignore_eos=True)]
    step = next((i for i, (a, b) in enumerate(zip(got, reference)) if a != b), None)
    if step is None:
        assert len(got) == len(reference), f"{len(got)} greedy tokens, reference has {len(reference)}"
        return got
    logits = model.logits(list(ids) + reference[:step])[-1]                  # (vocab,)
    gap = abs(float(logits[got[step]] - logits[reference[step]])) / float(np.abs(logits).max())
    assert gap <= tie, (f"greedy tokens differ from step {step}: got {got}, reference {reference}; "
                        f"not a tie: their logits differ by {gap:.1e} x max|logit| (tie tolerance {tie:.0e})")
    return got


def check_int8(model_dir, ids, f32_logits, min_cosine=INT8_MIN_COSINE, min_top1=INT8_MIN_TOP1) -> dict:
    """INT8 against f32, on the batched prefill and on token-by-token decode (what generation
    runs). Returns the prefill fidelity, with the decode path's under ``"decode"``."""
    q = _load(model_dir, quant="int8")
    fid = fidelity(q.logits(ids), f32_logits)
    fid["decode"] = fidelity(_cached_logits(q.forward, ids, 1), f32_logits)
    for path, f in (("prefill", fid), ("decode", fid["decode"])):
        assert f["cosine"] >= min_cosine and f["top1"] >= min_top1, (
            f"INT8 fidelity too low on the {path} path: cosine {f['cosine']:.4f}, top1 {f['top1']:.3f} "
            f"(need cosine >= {min_cosine}, top1 >= {min_top1})")
    return fid


# ---------------------------------------------------------------------------------------------
# Plugin kernels
# ---------------------------------------------------------------------------------------------


def _forward(program, kernel_fns: dict, **executor_kw):
    from .run.executor import Executor
    from .run.forward import Forward
    from cpullm_kernels.setup.numba_setup import configured_threads
    return Forward(Executor(program, kernel_fns, **executor_kw), configured_threads())


def _compile(graph, weights, kernels, n_ctx: int):
    from .compile.compiler import compile_graph

    program = compile_graph(graph, weights, quant="f32", n_ctx=n_ctx, kernels=list(kernels))
    return _forward(program, {k.name: k.fn for k in kernels})


def _compare_kernel(spec, graph, weights, ids, tol: float) -> dict | None:
    """One kernel against the reference kernels on ``graph``: None if it applies to no node."""
    n_ctx = max(64, len(ids) + 8)
    fused = _compile(graph, weights, [spec], n_ctx)
    external = fused.program.meta["external"]
    if not external:
        return None
    names = fused.program.meta.get("names") or []
    nodes = sorted(names[int(r)] for r in external if int(r) < len(names))
    ref = _compile(graph, weights, [], n_ctx)
    split = max(1, len(ids) // 2)
    errs = {}
    for path, run in (("prefill", lambda fwd: fwd.logits(ids)),
                      ("decode", lambda fwd: _cached_logits(fwd, ids, split))):
        errs[path] = _rel_err(run(fused), run(ref))
        assert errs[path] <= tol, (
            f"plugin kernel {spec.name!r} ({spec.plugin}) differs from the reference {spec.op.name} "
            f"kernel by {errs[path]:.2e} (relative, tolerance {tol:.0e}) on the {path} path")
    return {"max_rel_err": max(errs.values()), "nodes": nodes}


class _ArrayWeights:
    """In-memory weights with the interface the compiler reads (sample graphs)."""

    def __init__(self, arrays: dict):
        self.arrays = arrays

    def __contains__(self, name):
        return name in self.arrays

    def names(self):
        return list(self.arrays)

    def source_of(self, name):
        return name

    def identity(self, name):
        return name, None, None

    def shape(self, name):
        return self.arrays[name].shape

    def get(self, name, out=None):
        if out is None:
            return self.arrays[name]
        out[...] = self.arrays[name]
        return out


def _sample_weights(graph, vocab: int, seed: int = 0) -> _ArrayWeights:
    """Random weights of the shapes ``graph`` reads (norm weights near 1)."""
    from .graph.ir import Op

    rng = np.random.default_rng(seed)
    width = {n.output: n.width for n in graph.nodes}
    shapes = {}
    for n in graph.nodes:
        w = dict(n.weights)
        if n.op == Op.EMBED:
            shapes[w["table"]] = (vocab, n.width)
        elif n.op == Op.LINEAR:
            shapes[w["weight"]] = (n.width, width[n.inputs[0]])
            if "bias" in w:
                shapes[w["bias"]] = (n.width,)
        elif n.op in (Op.RMSNORM, Op.LAYERNORM):
            shapes[w["weight"]] = (n.attr("group_size"),)
            if "bias" in w:
                shapes[w["bias"]] = (n.attr("group_size"),)
        elif n.op == Op.POS_EMBED:
            shapes[w["table"]] = (n.attr("n_positions"), n.width)
        elif n.op == Op.PLUGIN:
            from .loading import plugins
            spec = plugins.discover().op(n.attr("plugin_op"))
            own = json.loads(json.dumps({k: v for k, v in n.attrs if k not in ("plugin_op", "op_version")},
                                        default=str))                     # what the op's shape rule gets
            roles = spec.weight_roles(tuple(width[i] for i in n.inputs), own)
            shapes.update({w[role]: tuple(shape) for role, shape in roles.items()})
        elif n.op == Op.GATED_DELTA:
            nk, dk, nv, dv, ck = (n.attr(a) for a in ("n_k_heads", "k_head_dim", "n_v_heads",
                                                       "v_head_dim", "conv_kernel"))
            shapes.update({w["conv"]: (2 * nk * dk + nv * dv, ck), w["dt_bias"]: (nv,),
                           w["A_log"]: (nv,), w["norm"]: (dv,)})
        elif w:
            raise AssertionError(f"the conformance kit cannot make sample weights for {n.op.name}")
    arrays = {}
    for name, shape in shapes.items():
        a = (rng.standard_normal(shape) * 0.3).astype(np.float32)
        arrays[name] = (1.0 + a / 3).astype(np.float32) if "norm" in name.rsplit(".", 1)[-1] else a
    return _ArrayWeights(arrays)


def _sample_gated_delta():
    from .graph import blocks
    from .graph.ir import GraphBuilder

    H, V = 64, 96
    g = GraphBuilder()
    h = blocks.embed(g, H)

    def mixer(g, i, x):
        return blocks.gated_delta(g, i, x, hidden=H, n_k_heads=2, k_head_dim=16, n_v_heads=4,
                                  v_head_dim=16, conv_kernel=4, norm_eps=1e-6)

    def mlp(g, i, x):
        return blocks.glu_mlp(g, i, x, H, 96, act="silu")

    for i in range(2):
        h = blocks.decoder_layer(g, i, h, mixer, mlp, 1e-6)
    return g.build(blocks.lm_head(g, h, V, 1e-6)), V


# A small graph exercising each op a plugin kernel may replace (cpullm_kernels.program.interpreter
# EXTERNAL_SIGNATURES); adding a replaceable op means adding its sample here.
SAMPLE_GRAPHS = {"GATED_DELTA": _sample_gated_delta}


def check_kernel_sample(spec, tol: float = F32_TOLERANCE, n_tokens: int = 12) -> dict | None:
    """One KernelSpec against the reference kernel on the kit's sample graph for its op; None if
    ``spec.supports`` accepts none of the sample's nodes."""
    name = getattr(spec.op, "name", str(spec.op))
    assert name in SAMPLE_GRAPHS, (f"the conformance kit has no sample graph for op {name}; "
                                   f"run the kit on a checkpoint that uses kernel {spec.name!r}")
    graph, vocab = SAMPLE_GRAPHS[name]()
    ids = [int(i) for i in np.random.default_rng(1).integers(0, vocab, n_tokens)]
    return _compare_kernel(spec, graph, _sample_weights(graph, vocab), ids, tol)


def check_plugin_kernels(model_dir, ids, tol: float = F32_TOLERANCE) -> dict:
    """Each fused kernel against the core's reference kernel, one kernel at a time, in prefill
    and in decode: every installed kernel that applies to this checkpoint, end to end; the
    family's own plugin's kernels that do not, on the kit's sample graph of their op."""
    from .loading import plugins
    from .graph.ir import GraphBuilder
    from .loading.tensors import TensorStore

    family, args = check_resolves(model_dir)
    ids = [int(i) for i in ids]
    weights = family.weight_map(args).resolve(TensorStore(model_dir), args)
    graph = family.build_graph(args, GraphBuilder())
    report = {"kernels": [], "checked": {}, "not_exercised": [], "max_rel_err": 0.0}
    for spec in plugins.discover().kernels:
        if not any(int(n.op) == int(spec.op) and spec.supports(n) for n in graph.nodes):
            if spec.plugin != family.plugin:
                continue
            result = check_kernel_sample(spec, tol)
            where = "sample"
        else:
            result = _compare_kernel(spec, graph, weights, ids, tol)
            where = "checkpoint"
            report["kernels"].append(spec.name)
        if result is None:
            report["not_exercised"].append(spec.name)
            warnings.warn(f"plugin kernel {spec.name!r} supports none of the nodes of this checkpoint "
                          f"or of the kit's sample graph: run the kit on a checkpoint it supports",
                          ConformanceWarning, stacklevel=2)
            continue
        report["checked"][spec.name] = {"where": where, **result}
        report["max_rel_err"] = max(report["max_rel_err"], result["max_rel_err"])
    return report


def check_plugin_ops(model, ids, tol: float = F32_TOLERANCE) -> dict:
    """The graph's plugin ops (cpullm.loading.family.OpSpec): the program run with their fast kernels
    against the same program run with their numpy references, prefill (every position) and
    cached decode. Ops without fast kernels are listed under ``"reference_only"``."""
    program = model.program
    calls = program.meta.get("plugin_ops") or {}
    used = sorted({c["op"] for c in calls.values()})
    report = {"ops": used, "checked": {}, "reference_only": []}
    if not used:
        return report
    from .loading import plugins
    specs = plugins.discover().ops
    fns = {name: k.fn for name, k in (model.kernels or {}).items()}
    ids = [int(i) for i in ids]
    split = max(1, len(ids) // 2)
    fast = [name for name in used if specs[name].prefill or specs[name].decode]
    report["reference_only"] = [name for name in used if name not in fast]
    if not fast:
        return report
    runs = {impl: _forward(program, fns, op_impl=impl) for impl in ("fast", "reference")}
    errs = {}
    for path, run in (("prefill", lambda fwd: fwd.logits(ids)),
                      ("decode", lambda fwd: _cached_logits(fwd, ids, split))):
        errs[path] = _rel_err(run(runs["fast"]), run(runs["reference"]))
        assert errs[path] <= tol, (
            f"the fast kernels of plugin ops {', '.join(fast)} differ from their numpy references by "
            f"{errs[path]:.2e} (relative, tolerance {tol:.0e}) on the {path} path")
    for name in fast:
        report["checked"][name] = {"plugin": specs[name].plugin, "max_rel_err": max(errs.values())}
    return report


# ---------------------------------------------------------------------------------------------
# Weight bytes, batched decode, context limit
# ---------------------------------------------------------------------------------------------


def float32_share(program, largest: int = 5) -> dict:
    """The program's weight bytes that are float32 (``wf``: norms, biases, position tables, and
    matrices the compiler could not quantize) over all its weight bytes, and the ``largest``
    float32 canonical tensors (``meta["weight_slots"]``) by bytes."""
    a = program.arrays
    f32 = int(a["wf"].size) * 4
    total = f32 + int(a["wq"].size) + int(a["ws"].size) * 2
    slots = [(name, int(size) * 4) for name, (kind, _, size, *_) in program.meta["weight_slots"].items()
             if kind == "f32"]
    slots.sort(key=lambda x: -x[1])
    return {"share": f32 / max(total, 1), "float32_bytes": f32, "weight_bytes": total,
            "largest_float32": slots[:largest]}


def check_float32_share(model_dir, quants=("int8", "q4")) -> dict:
    """:func:`float32_share` of programs compiled in each of ``quants`` (no head screen: the
    model's own weights). Returns {quant: share, "details": {quant: float32_share(...)}}."""
    from .compile.compiler import compile_graph
    from .graph.ir import GraphBuilder
    from .loading.tensors import TensorStore

    family, args = check_resolves(model_dir)
    weights = family.weight_map(args).resolve(TensorStore(model_dir), args)
    graph = family.build_graph(args, GraphBuilder())
    out: dict = {"details": {}}
    for quant in quants:
        detail = float32_share(compile_graph(graph, weights, quant=quant, n_ctx=16, max_chunk=8))
        out[quant] = detail["share"]
        out["details"][quant] = detail
    return out


def check_batched_decode(model, ids, steps: int = 4, tol: float = F32_TOLERANCE) -> float:
    """Three sequences at different positions decoded together, ``steps`` steps, equal to each
    decoded alone (an op reading the step's position or state once for the whole batch, rather
    than per sequence, fails here). Returns the largest relative difference."""
    fwd = model.forward
    ids = [int(i) for i in ids]
    room = len(ids) - steps
    assert room >= 3, f"check_batched_decode needs at least {steps + 3} ids"
    lengths = sorted({max(1, room // 4), max(2, room // 2), room})
    slots = fwd.slots(len(lengths))
    for slot, k in zip(slots, lengths):
        fwd.prefill(slot, ids[:k])
    together = [[] for _ in lengths]
    for j in range(steps):
        rows, _ = fwd.step(slots, [ids[k + j] for k in lengths])
        for b, row in enumerate(rows):
            together[b].append(np.array(row, np.float32))
    worst = 0.0
    for b, k in enumerate(lengths):
        alone = _cached_logits(fwd, ids[:k + steps], k)[-steps:]     # the steps after the prefix
        err = _rel_err(np.stack(together[b]), alone)
        assert err <= tol, (f"batched decode differs from decoding alone by {err:.2e} (relative, tolerance "
                            f"{tol:.0e}) for the sequence at position {k}: an op reads one position or state "
                            f"for the whole batch (cpullm.run.batch.PER_SEQUENCE_OPS)")
        worst = max(worst, err)
    return worst


def check_context_limit(model_dir, run_limit: int = 4096) -> dict:
    """A family's declared hard context limit (FamilySpec.context_limit): the default context is
    within it, n_ctx = limit + 1 is refused at load with a one-line ConfigError naming n_ctx, and
    n_ctx = limit loads and runs its last position (when the limit is at most ``run_limit``)."""
    from .errors import ConfigError

    family, args = check_resolves(model_dir)
    limit = family.context_limit(args) if family.context_limit is not None else None
    if not limit:
        return {"limit": None}
    limit = int(limit)
    default = _load(model_dir).n_ctx
    assert default <= limit, f"the default context {default} is over the family's limit {limit}"
    try:
        _load(model_dir, n_ctx=limit + 1)
    except ConfigError as exc:
        msg = str(exc)
        assert "\n" not in msg and "n_ctx" in msg, f"the refusal of n_ctx {limit + 1} must be one line naming n_ctx: {msg!r}"
    else:
        raise AssertionError(f"n_ctx {limit + 1} loads although the family's context limit is {limit}")
    ran = limit <= run_limit
    if ran:
        model = _load(model_dir, n_ctx=limit)
        vocab = min(model.program.meta["vocab"], 256)
        ids = [int(i) for i in np.random.default_rng(3).integers(0, vocab, limit)]
        assert np.isfinite(model.logits(ids)[-1]).all(), f"non-finite logits at position {limit - 1}"
    return {"limit": limit, "default_n_ctx": int(default), "ran_at_limit": ran}


# ---------------------------------------------------------------------------------------------
# Everything at once
# ---------------------------------------------------------------------------------------------


def run_conformance(model_dir, ids, reference_logits=None, reference_tokens=None,
                    greedy_prompt=None, tol: float = F32_TOLERANCE, int8=True, *,
                    family: str | None = None) -> dict:
    """All checks above on one checkpoint; returns a report dict. ``reference_logits`` are for
    ``ids``; ``reference_tokens`` continue ``greedy_prompt`` (default ``ids``); ``family`` is the
    family name the checkpoint must resolve to. ``report["notes"]`` lists what could not be
    checked (also emitted as :class:`ConformanceWarning`)."""
    from .graph.ir import Op

    ids = [int(i) for i in ids]
    assert len(ids) >= 2, "run_conformance needs at least 2 token ids"
    fam, _ = check_resolves(model_dir, family)
    report = {"family": fam.name, "plugin": fam.plugin, "notes": []}
    report["weight_map"] = check_weight_map(model_dir)
    report["graph"] = check_graph_weights(model_dir)
    model = _load(model_dir)
    report["compiled_weights"] = check_compiled_weights(model_dir, model.program)
    logits = check_forward(model, ids)
    report["cached_decode_err"] = max(check_cached_decode(model, ids, logits, tol=tol),
                                      check_cached_decode(model, ids, logits, split=1, tol=tol))
    report["chunked_prefill_err"] = check_chunked_prefill(model_dir, ids, logits, tol=tol)
    if reference_logits is not None:
        report["parity_err"] = check_parity(logits, reference_logits, tol)
    else:
        report["notes"].append("no reference_logits: f32 parity was not checked")
    if reference_tokens is not None:
        report["greedy"] = check_greedy(model, greedy_prompt or ids, reference_tokens)
    if int8:
        report["int8"] = check_int8(model_dir, ids, logits)
    report["plugin_kernels"] = check_plugin_kernels(model_dir, ids, tol)
    report["plugin_ops"] = check_plugin_ops(model, ids, tol)
    report["batched_decode_err"] = check_batched_decode(model, ids, tol=tol)
    report["context_limit"] = check_context_limit(model_dir)
    shares = check_float32_share(model_dir, ("int8", "q4") if int8 else ())
    report["float32_share"] = {q: v for q, v in shares.items() if q != "details"}
    for quant, detail in shares["details"].items():
        if detail["share"] > FLOAT32_SHARE_NOTE:
            names = ", ".join(f"{n} ({b} bytes)" for n, b in detail["largest_float32"])
            report["notes"].append(
                f"{detail['share']:.0%} of the weight bytes stay float32 under {quant} (largest: {names}): map "
                f"matrices onto LINEARs (Transform(shape=...) for a stored layout) or declare a plugin op's "
                f"matrices in OpSpec.matrices so that they quantize")
    windows = sorted({n.attr("window") for n in model.graph.nodes
                      if n.op == Op.ATTENTION and (n.attr("window") or 0) > 0})
    if windows and len(ids) <= windows[-1]:
        report["notes"].append(f"{len(ids)} ids do not reach past the sliding window "
                               f"{windows[-1]}: the window is not exercised; pass longer ids")
    for note in report["notes"]:
        warnings.warn(note, ConformanceWarning, stacklevel=2)
    return report


def families_without_tiny_config(registry=None) -> list[str]:
    """``plugin:family`` of every installed family that ships no ``FamilySpec.tiny_config``: the
    registry-coverage test runs the kit on each family's tiny config and fails on these."""
    from .loading import plugins

    registry = registry or plugins.discover()
    return [f"{f.plugin}:{f.name}" for f in registry.families if not f.tiny_config]


def sample_ids(config: dict, n: int | None = None, seed: int = 0) -> list[int]:
    """Token ids for a tiny checkpoint: long enough to pass every sliding window, within the
    byte-level tokenizer's range."""
    from .loading.family import text_config

    cfg = text_config(config)
    window = int(cfg.get("sliding_window") or 0)
    n = n or max(48, min(window + 8, 96))
    vocab = int(cfg.get("vocab_size", 256))
    return [int(i) for i in np.random.default_rng(seed).integers(0, min(vocab, 256), n)]


def run_family_conformance(config: dict, out_dir, reference=None, ids=None, seed: int = 0,
                           std: float = 0.15, **kwargs) -> dict:
    """One call per family config: write a tiny random checkpoint for ``config`` into
    ``out_dir`` (:func:`make_random_checkpoint`), then :func:`run_conformance` on it.

    ``reference``: optional ``(model_dir, ids) -> float32 logits (T, vocab)`` from an independent
    implementation (transformers, or the author's own numpy forward); ``ids`` default to
    :func:`sample_ids`. Other keyword arguments go to :func:`run_conformance`."""
    model_dir = make_random_checkpoint(config, out_dir, seed=seed, std=std)
    ids = list(ids) if ids is not None else sample_ids(config)
    ref = reference(model_dir, ids) if reference is not None else None
    return run_conformance(model_dir, ids, reference_logits=ref, **kwargs)


# ---------------------------------------------------------------------------------------------
# Tiny random checkpoints
# ---------------------------------------------------------------------------------------------


def make_random_checkpoint(config: dict, out_dir, seed: int = 0, std: float = 0.15) -> Path:
    """Write config.json and a bf16 model.safetensors with random tensors of exactly the shapes
    the family's weight map asks for (tied tensors omitted), plus a byte-level tokenizer."""
    from .loading import plugins

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    family = plugins.discover().family_for(config)
    args = family.args(config)
    rng = np.random.default_rng(seed)
    tensors = {}
    for rule in family.weight_map(args).expand():
        if rule.source is None or rule.shape is None:
            continue
        if rule.tied_to and config.get("tie_word_embeddings", True):
            continue
        arr = (rng.standard_normal(rule.shape) * std).astype(np.float32)
        if len(rule.shape) == 1 and "norm" in rule.canonical:
            arr = (1.0 if rule.transform is None else 0.0) + arr
        bits = (arr.view(np.uint32) + 0x8000) >> 16          # round to bf16
        tensors[rule.source] = bits.astype(np.uint16)
    _save_bf16(tensors, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _write_byte_tokenizer(out)
    return out


def _save_bf16(tensors: dict, path: Path):
    header, offset, blobs = {}, 0, []
    for name, arr in tensors.items():
        b = arr.tobytes()
        header[name] = {"dtype": "BF16", "shape": list(arr.shape), "data_offsets": [offset, offset + len(b)]}
        offset += len(b)
        blobs.append(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as fh:
        fh.write(len(h).to_bytes(8, "little"))
        fh.write(h)
        for b in blobs:
            fh.write(b)


def _write_byte_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(out / "tokenizer.json"))
