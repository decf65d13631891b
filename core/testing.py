"""cpullm.testing: the conformance kit a family plugin runs in its own test suite.

One call per family and checkpoint::

    from cpullm.testing import run_conformance
    report = run_conformance(model_dir, ids, reference_logits=ref, reference_tokens=toks)

checks, each raising AssertionError with a message that says what failed:

* the family resolves from config.json and its Args build;
* the weight map accounts for every tensor, and resolving twice gives identical tensors
  (transforms such as ``1 + w`` are applied exactly once);
* an f32 forward pass runs and gives finite logits;
* cached decode (prefill a prefix, then one token at a time) equals the uncached forward;
* f32 logits match the author's reference within ``tol`` x max |reference| at every position;
* greedy tokens with the KV cache equal the reference tokens;
* INT8 stays close to f32 (mean cosine of mean-centred logits, top-1 agreement);
* every fused kernel the plugin registers gives the same logits as the reference kernel.

``make_random_checkpoint`` writes a random checkpoint from the family's own weight map, for
authors without a reference implementation at hand.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

F32_TOLERANCE = 1e-3          # max |delta logit| <= F32_TOLERANCE * max |reference logit|
INT8_MIN_COSINE = 0.98
INT8_MIN_TOP1 = 0.75


def fidelity(logits: np.ndarray, ref: np.ndarray) -> dict:
    """Mean cosine of mean-centred logits, top-1 agreement and mean KL(ref || logits), nats."""
    a = logits - logits.mean(-1, keepdims=True)
    b = ref - ref.mean(-1, keepdims=True)
    cos = (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1) + 1e-30)
    lp, lq = _log_softmax(logits), _log_softmax(ref)
    kl = (np.exp(lq) * (lq - lp)).sum(-1)
    return {"cosine": float(cos.mean()), "top1": float((logits.argmax(-1) == ref.argmax(-1)).mean()),
            "kl": float(kl.mean())}


def _log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _load(model_dir, quant="f32", **kw):
    import cpullm
    return cpullm.load(model_dir, quant=quant, use_cache=False, **kw)


def check_resolves(model_dir):
    from . import plugins
    from .family import read_config

    config = read_config(Path(model_dir))
    family = plugins.discover().family_for(config)
    return family, family.args(config)


def check_weight_map(model_dir) -> dict:
    """Every tensor accounted for (resolve raises otherwise); transforms applied exactly once."""
    from .tensors import TensorStore

    family, args = check_resolves(model_dir)
    store = TensorStore(model_dir)
    wmap = family.weight_map(args)
    first = wmap.resolve(store, args)
    second = wmap.resolve(store, args)
    for name in first.names():
        a, b = first.get(name), second.get(name)
        assert np.array_equal(a, b), f"weight map is not idempotent for {name}"
    for canonical, (stored, transform) in first.found.items():
        if transform is not None:
            once = transform(store.get(stored), args)
            assert np.array_equal(first.get(canonical), once), \
                f"{canonical}: the {transform.name} transform was not applied exactly once"
    return {"tensors": len(first.names()), "ignored": len(first.ignored)}


def check_forward(model, ids) -> np.ndarray:
    logits = model.logits(ids)
    assert logits.shape == (len(ids), model.program.meta["vocab"]), f"logits shape {logits.shape}"
    assert np.isfinite(logits).all(), "non-finite logits"
    return logits


def check_cached_decode(model, ids, full_logits=None, split: int | None = None, tol: float = F32_TOLERANCE):
    """Prefill ids[:split] then decode the rest one token at a time: equal to the full forward."""
    full = model.logits(ids) if full_logits is None else full_logits
    split = split or max(1, len(ids) // 2)
    ex = model.executor
    ex.reset()
    rows = [ex.prefill(ids[:split], all_logits=True)]
    rows += [ex.decode(t).copy()[None] for t in ids[split:]]
    got = np.concatenate(rows)
    err = np.abs(got - full).max() / np.abs(full).max()
    assert err <= tol, f"cached decode differs from the uncached forward by {err:.2e} (relative)"
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


def check_greedy(model, ids, reference_tokens) -> list[int]:
    got = list(model.generate_ids(ids, max_new_tokens=len(reference_tokens), temperature=0.0,
                                  ignore_eos=True))
    assert got == list(reference_tokens), f"greedy tokens differ: got {got}, reference {list(reference_tokens)}"
    return got


def check_int8(model_dir, ids, f32_logits, min_cosine=INT8_MIN_COSINE, min_top1=INT8_MIN_TOP1) -> dict:
    q = _load(model_dir, quant="int8")
    fid = fidelity(q.logits(ids), f32_logits)
    assert fid["cosine"] >= min_cosine and fid["top1"] >= min_top1, \
        f"INT8 fidelity too low: {fid} (need cosine >= {min_cosine}, top1 >= {min_top1})"
    return fid


def check_plugin_kernels(model_dir, ids, tol: float = F32_TOLERANCE) -> dict:
    """Each fused kernel of an installed plugin against the core's reference kernel, end to end."""
    fused = _load(model_dir)
    used = sorted(set(fused.program.meta["external"].values()))
    if not used:
        return {"kernels": []}
    ref = _load(model_dir, plugin_kernels=False)
    a, b = fused.logits(ids), ref.logits(ids)
    err = float(np.abs(a - b).max() / np.abs(b).max())
    assert err <= tol, f"plugin kernels {used} differ from the reference kernels by {err:.2e}"
    return {"kernels": used, "max_rel_err": err}


def run_conformance(model_dir, ids, reference_logits=None, reference_tokens=None,
                    greedy_prompt=None, tol: float = F32_TOLERANCE, int8=True) -> dict:
    """All checks above on one checkpoint; returns a report dict. ``reference_logits`` are for
    ``ids``; ``reference_tokens`` continue ``greedy_prompt`` (default ``ids``)."""
    ids = [int(i) for i in ids]
    report = {"weight_map": check_weight_map(model_dir)}
    family, _ = check_resolves(model_dir)
    report["family"] = family.name
    model = _load(model_dir)
    logits = check_forward(model, ids)
    report["cached_decode_err"] = check_cached_decode(model, ids, logits, tol=tol)
    if reference_logits is not None:
        report["parity_err"] = check_parity(logits, reference_logits, tol)
    if reference_tokens is not None:
        report["greedy"] = check_greedy(model, greedy_prompt or ids, reference_tokens)
    if int8:
        report["int8"] = check_int8(model_dir, ids, logits)
    report["plugin_kernels"] = check_plugin_kernels(model_dir, ids, tol)
    return report


def make_random_checkpoint(config: dict, out_dir, seed: int = 0, std: float = 0.15) -> Path:
    """Write config.json and a bf16 model.safetensors with random tensors of exactly the shapes
    the family's weight map asks for (tied tensors omitted), plus a byte-level tokenizer."""
    from safetensors.numpy import save_file

    from . import plugins

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
