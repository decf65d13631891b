"""Gemma families (gemma, gemma2, gemma3_text, gemma3) against transformers on tiny random
checkpoints, in both checkpoint layouts.

Each tiny config mirrors a real model's structure (MQA in gemma-2b, alternating sliding layers and
soft-caps in gemma-2-2b, 5 local : 1 global with q/k norms in gemma-3-270m, linear-scaled global
RoPE and a vision tower in gemma-3-4b-it) with sliding windows shorter than the 40-token input, so
they matter, and hidden sizes whose sqrt is not a bf16 value. Layouts:

* ``v5``: what transformers 5 saves (rope_parameters, explicit layer_types, dtype,
  ``model.language_model.*`` for the multimodal wrapper);
* ``legacy``: what Hub checkpoints look like (rope_theta / rope_scaling / rope_local_base_freq,
  torch_dtype, implicit layer patterns, F32 norm tensors mixed in, Gemma 1's ``hidden_act "gelu"``,
  the wrapper's ``language_model.model.*`` prefixes and a text_config listing only non-default
  keys).

The transformers reference runs in float32 (eager attention), where the embedding scale
sqrt(hidden_size) is exact; cpullm uses the same value (see cpullm_gemma.common).
"""
import json

import numpy as np
import pytest

pytestmark = pytest.mark.reference   # needs torch and transformers

torch = pytest.importorskip("torch", reason="torch is a test dependency (pip install -e '.[test]')")
transformers = pytest.importorskip("transformers", reason="transformers is a test dependency")

import cpullm  # noqa: E402
from cpullm import testing  # noqa: E402
from cpullm_kernels.attention.attention import padded_cap  # noqa: E402
from cpullm_gemma.tiny_configs import GEMMA2_2B_LIKE, GEMMA3_270M_LIKE  # noqa: E402
from hf_reference import TINY_VOCAB, hf_greedy, hf_logits, hf_model, save_tiny  # noqa: E402

IDS = [256] + [int(x) for x in np.random.default_rng(7).integers(0, 255, 39)]   # 40 tokens
PROMPT = IDS[:8]           # greedy prompt: 8 + 32 generated tokens run well past every window
N_GREEDY = 32
TOKENS = dict(bos_token_id=256, eos_token_id=257, pad_token_id=0, vocab_size=TINY_VOCAB)

# gemma-2b: MQA (8 heads over 1 KV head -> 4 over 1), head_dim 256 -> 32 (heads*head_dim != hidden,
# as in gemma-7b), no sliding window, tied. sqrt(80) = 8.944 (bf16 would round it to 8.9375).
GEMMA_2B_LIKE = dict(
    hidden_size=80, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6, max_position_embeddings=8192,
    hidden_act="gelu_pytorch_tanh", rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    **TOKENS)

# gemma-3-4b-it's text model: heads 8 / kv 4 / query_pre_attn_scalar 256 / eps / thetas are
# Gemma3TextConfig defaults (the legacy file omits them), linear RoPE factor 8 on global layers,
# 6 layers (5 local, then the global layer 5), window 1024 -> 10. Softcaps set but never applied by the wrapper.
GEMMA3_4B_TEXT_LIKE = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=8,
    num_key_value_heads=4, head_dim=16, sliding_window=10, attn_logit_softcapping=5.0,
    final_logit_softcapping=10.0, max_position_embeddings=131072,
    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
    **TOKENS)
TINY_SIGLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                   image_size=28, patch_size=14, vision_use_head=False)

CASES = ("gemma", "gemma2", "gemma3_text", "gemma3")
SLIDING_CASES = ("gemma2", "gemma3_text", "gemma3")
# Hub (transformers 4.5x) names of the multimodal checkpoint's tensors.
LEGACY_PREFIXES = [("model.language_model.", "language_model.model."),
                   ("model.vision_tower.", "vision_tower."),
                   ("model.multi_modal_projector.", "multi_modal_projector."),
                   ("lm_head.", "language_model.lm_head.")]


def _config(name):
    T = transformers
    if name == "gemma":
        return T.GemmaConfig(**GEMMA_2B_LIKE), None
    if name == "gemma2":
        return T.Gemma2Config(**GEMMA2_2B_LIKE), None
    if name == "gemma3_text":
        return T.Gemma3TextConfig(**GEMMA3_270M_LIKE), None
    cfg = T.Gemma3Config(text_config=dict(GEMMA3_4B_TEXT_LIKE), vision_config=dict(TINY_SIGLIP),
                         mm_tokens_per_image=4, **{k: v for k, v in TOKENS.items() if k != "vocab_size"})
    return cfg, T.Gemma3ForConditionalGeneration


def _edit_json(path, fn):
    path.write_text(json.dumps(fn(json.loads(path.read_text())), indent=2))


def _legacy_gemma(cfg):
    cfg["hidden_act"] = "gelu"        # the real gemma-2b config; GemmaConfig maps it to tanh-GELU
    return cfg


def _legacy_gemma3_wrapper(cfg):
    """Like the real gemma-3-4b-it config.json: text_config lists only non-default keys."""
    defaults = transformers.Gemma3TextConfig()
    text = cfg["text_config"]
    for k in list(text):
        if k in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers"):
            continue
        if isinstance(getattr(defaults, k, object()), (int, float, str)) and getattr(defaults, k) == text[k]:
            del text[k]
    for k, default in (("rope_theta", 1_000_000.0), ("rope_local_base_freq", 10_000.0), ("rope_scaling", None)):
        if k in text and text[k] == default:
            del text[k]
    return cfg


def _rename_tensors(model_dir, prefixes):
    from safetensors.torch import load_file, save_file

    for f in model_dir.glob("*.safetensors"):
        tensors = load_file(str(f))
        out = {}
        for name, t in tensors.items():
            for old, new in prefixes:
                if name.startswith(old):
                    name = new + name[len(old):]
                    break
            out[name] = t
        save_file(out, str(f), metadata={"format": "pt"})
    index = model_dir / "model.safetensors.index.json"
    assert not index.exists(), "tiny checkpoints are single-file"


def build_checkpoint(name, layout, d):
    cfg, model_class = _config(name)
    legacy = layout == "legacy"
    save_tiny(cfg, d, seed=sum(map(ord, name)) % 1000, legacy=legacy, model_class=model_class,
              f32_tensors=("norm",) if legacy else ())
    if legacy and name == "gemma":
        _edit_json(d / "config.json", _legacy_gemma)
    if legacy and name == "gemma3":
        _edit_json(d / "config.json", _legacy_gemma3_wrapper)
        _rename_tensors(d, LEGACY_PREFIXES)
    return model_class


_BUILT = {}


def _checkpoint(name, layout, tmp_path_factory):
    """(name, dir, transformers' logits for IDS, transformers' greedy tokens after PROMPT),
    built once per module."""
    if (name, layout) not in _BUILT:
        d = tmp_path_factory.mktemp(f"{name}_{layout}")
        model_class = build_checkpoint(name, layout, d)
        ref = hf_model(d, model_class=model_class)
        _BUILT[name, layout] = (name, d, hf_logits(ref, IDS), hf_greedy(ref, PROMPT, N_GREEDY))
    return _BUILT[name, layout]


@pytest.fixture(scope="module", params=CASES)
def checkpoint(request, tmp_path_factory):
    return _checkpoint(request.param, "v5", tmp_path_factory)


@pytest.fixture(scope="module", params=CASES)
def legacy_checkpoint(request, tmp_path_factory):
    return _checkpoint(request.param, "legacy", tmp_path_factory)


@pytest.fixture(scope="module", params=SLIDING_CASES)
def sliding_checkpoint(request, tmp_path_factory):
    # the ring logic does not depend on the checkpoint layout: one layout keeps the suite short
    return _checkpoint(request.param, "v5", tmp_path_factory)


INT8_FIDELITY = {}


def test_conformance_kit(checkpoint):
    """transformers 5 layout, the whole kit: f32 parity at every position (<= 1e-3 x max|ref|),
    32 greedy tokens with the KV cache, cached decode and chunked prefill = one-chunk forward,
    weight map idempotent (1 + w folded once), INT8 fidelity (prefill and decode paths)."""
    name, d, ref_logits, ref_tokens = checkpoint
    report = testing.run_conformance(d, IDS, reference_logits=ref_logits, reference_tokens=ref_tokens,
                                     greedy_prompt=PROMPT, family=name)
    assert report["plugin"] == "cpullm-plugin-gemma"
    assert report["parity_err"] <= testing.F32_TOLERANCE
    assert report["int8"]["cosine"] >= 0.98 and report["int8"]["top1"] >= 0.75
    INT8_FIDELITY[d.name] = report["int8"]
    print(f"\n{d.name}: f32 parity {report['parity_err']:.2e}, int8 {report['int8']}")


def test_legacy_layout(legacy_checkpoint, tmp_path_factory):
    """Hub layout: transformers' reading of the legacy config and names (run on the legacy files)
    matches cpullm's at every position and over 32 greedy tokens, and cpullm builds exactly the
    model of the transformers 5 layout (same graph, same canonical tensors), so everything else
    the kit checks on that layout holds for this one."""
    from cpullm.loading import plugins
    from cpullm.loading.family import read_config
    from cpullm.graph.ir import GraphBuilder
    from cpullm.loading.tensors import TensorStore

    name, d, ref_logits, ref_tokens = legacy_checkpoint
    testing.check_weight_map(d)
    model = cpullm.load(d, quant="f32", use_cache=False)
    assert model.family.name == name
    testing.check_parity(model.logits(IDS), ref_logits)
    testing.check_greedy(model, PROMPT, ref_tokens)

    _, v5_dir, _, _ = _checkpoint(name, "v5", tmp_path_factory)
    models = []
    for path in (d, v5_dir):
        config = read_config(path)
        fam = plugins.discover().family_for(config)
        args = fam.args(config)
        graph = fam.build_graph(args, GraphBuilder())
        models.append((graph.dump(), fam.weight_map(args).resolve(TensorStore(path), args)))
    (legacy_graph, legacy_w), (v5_graph, v5_w) = models
    assert legacy_graph == v5_graph
    assert sorted(legacy_w.names()) == sorted(v5_w.names())
    for canonical in v5_w.names():
        np.testing.assert_array_equal(legacy_w.get(canonical), v5_w.get(canonical), err_msg=canonical)
    if name == "gemma3":
        assert any(src.startswith("language_model.model.") for src, _ in legacy_w.found.values())


@pytest.mark.parametrize("max_chunk", [5])
def test_sliding_ring_wraps_and_matches(sliding_checkpoint, max_chunk):
    """With a small prefill chunk the sliding layers' ring (window + max_chunk slots, rounded up to
    whole key tiles of 16) wraps many
    times over the 40-token input and the 8 + 32 token generation; logits and greedy tokens still
    match transformers."""
    name, d, ref_logits, ref_tokens = sliding_checkpoint
    model = cpullm.load(d, quant="f32", use_cache=False, max_chunk=max_chunk)
    rings = [r for r in model.program.meta["state_regions"] if r["kind"] == "kv" and r["window"]]
    assert rings and all(r["cap"] == padded_cap(r["window"] + max_chunk) for r in rings)
    assert all(r["cap"] < len(PROMPT) + N_GREEDY for r in rings), "the ring must wrap in this test"
    testing.check_parity(model.logits(IDS), ref_logits)
    testing.check_greedy(model, PROMPT, ref_tokens)


def test_sliding_cache_does_not_grow_with_context(sliding_checkpoint):
    """The sliding layers' KV cache size is independent of n_ctx; full layers' grows with it."""
    name, d, _, _ = sliding_checkpoint
    sizes = {}
    for n_ctx in (256, 2048):
        model = cpullm.load(d, quant="f32", use_cache=False, n_ctx=n_ctx, max_chunk=16)
        sizes[n_ctx] = {r["layer"]: (r["window"], r["cap"], r["floats"])
                        for r in model.program.meta["state_regions"] if r["kind"] == "kv"}
    small, large = sizes[256], sizes[2048]
    assert small.keys() == large.keys()
    sliding = [layer for layer, (window, _, _) in small.items() if window]
    full = [layer for layer, (window, _, _) in small.items() if not window]
    assert sliding and full
    for layer in sliding:
        window = small[layer][0]
        assert small[layer] == large[layer] and small[layer][1] == padded_cap(window + 16)
    for layer in full:
        assert (small[layer][1], large[layer][1]) == (256, 2048)
        assert large[layer][2] == 8 * small[layer][2]


@pytest.mark.parametrize("layout", ["v5", "legacy"])
def test_multimodal_vision_weights_ignored_with_one_notice(layout, tmp_path_factory, monkeypatch, capfd):
    """The gemma3 wrapper's vision tower and projector (either prefix) are matched by the weight
    map's ignore list: loading prints exactly one notice line, and every text tensor is used."""
    _, d, _, _ = _checkpoint("gemma3", layout, tmp_path_factory)
    monkeypatch.setenv("CPULLM_QUIET", "0")
    model = cpullm.load(d, quant="f32", use_cache=False)
    notices = [line for line in capfd.readouterr().err.splitlines() if "ignoring" in line]
    assert len(notices) == 1, notices
    assert "vision_tower" in notices[0] or "multi_modal_projector" in notices[0]
    assert model.family.name == "gemma3"
