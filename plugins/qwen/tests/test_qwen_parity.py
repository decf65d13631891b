"""Qwen families (qwen2, qwen3, qwen3_5, qwen3_5_text) against transformers on tiny random
checkpoints, in transformers 5's saved layout and in the Hub's legacy layout.

Every checkpoint goes through the conformance kit: weight map idempotence, f32 parity at every
position of a 48-token input, 32 greedy tokens with the cache equal to transformers' generate,
INT8 fidelity (prefill and decode), and the plugin's fused Gated DeltaNet kernel against the
reference kernel.
"""
import json

import numpy as np
import pytest

pytestmark = pytest.mark.reference   # needs torch and transformers

torch = pytest.importorskip("torch", reason="torch is a test dependency (pip install -e '.[test]')")
transformers = pytest.importorskip("transformers", reason="transformers is a test dependency")

import cpullm  # noqa: E402
from cpullm import testing  # noqa: E402
from cpullm.errors import UnsupportedConfigError, WeightMapError  # noqa: E402
from cpullm_qwen.tiny_configs import QWEN2_SLIDING_UNTIED, QWEN35_TEXT, QWEN35_TEXT_ONLY  # noqa: E402
from hf_reference import TINY_VOCAB, hf_greedy, hf_logits, hf_model, save_tiny  # noqa: E402

# ---- tiny configs mirroring the real checkpoints' structure ----------------------------------

QWEN25_LIKE = dict(  # Qwen2.5-1.5B-Instruct: GQA 12/2 (here 6/2), head_dim from hidden/heads, tied,
    # rope_theta 1e6, sliding_window present but use_sliding_window false (must be ignored)
    hidden_size=96, intermediate_size=192, num_hidden_layers=3, num_attention_heads=6,
    num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=TINY_VOCAB, max_position_embeddings=32768,
    tie_word_embeddings=True, use_sliding_window=False, sliding_window=8, max_window_layers=1,
    bos_token_id=256, eos_token_id=257, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
)

QWEN3_LIKE = dict(  # Qwen3-0.6B: heads x head_dim (4 x 32) != hidden (64), GQA, q/k norm, tied
    hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, vocab_size=TINY_VOCAB,
    max_position_embeddings=40960, tie_word_embeddings=True, attention_bias=False,
    use_sliding_window=False, sliding_window=None, max_window_layers=3,
    bos_token_id=256, eos_token_id=257, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
)

QWEN3_BIAS_UNTIED = dict(  # Qwen3-8B-like untied lm_head, plus attention_bias (q/k/v/o biases)
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=4, head_dim=16, rms_norm_eps=1e-6, vocab_size=TINY_VOCAB,
    max_position_embeddings=4096, tie_word_embeddings=False, attention_bias=True,
    bos_token_id=256, eos_token_id=257, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
)

# The wrapper's text model: an interval-2 pattern (legacy layout: written as full_attention_interval).
QWEN35_WRAPPER_TEXT = dict(QWEN35_TEXT, tie_word_embeddings=True,
                           layer_types=["linear_attention", "full_attention"] * 2)
TINY_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64,
                   num_position_embeddings=16, patch_size=4, temporal_patch_size=2, spatial_merge_size=2)

IDS = [256] + [int(x) for x in np.random.default_rng(11).integers(0, 255, 47)]   # 48 tokens
PROMPT = IDS[:8]
MTP_TENSORS = {"mtp.fc.weight": (64, 128), "mtp.norm.weight": (64,),
               "mtp.layers.0.mlp.up_proj.weight": (128, 64)}


def _build(name):
    """(transformers config, model class or None, family name, legacy F32 tensors)."""
    from transformers import (Qwen2Config, Qwen3Config, Qwen3_5Config, Qwen3_5ForCausalLM,
                              Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig)
    if name == "qwen25":
        return Qwen2Config(**QWEN25_LIKE), None, "qwen2", ("norm",)
    if name == "qwen2_sliding_untied":
        return Qwen2Config(**QWEN2_SLIDING_UNTIED), None, "qwen2", ("norm",)
    if name == "qwen3":
        return Qwen3Config(**QWEN3_LIKE), None, "qwen3", ("norm",)
    if name == "qwen3_bias_untied":
        return Qwen3Config(**QWEN3_BIAS_UNTIED), None, "qwen3", ()
    if name == "qwen3_5":
        cfg = Qwen3_5Config(text_config=dict(QWEN35_WRAPPER_TEXT), vision_config=dict(TINY_VISION),
                            tie_word_embeddings=True)
        return cfg, Qwen3_5ForConditionalGeneration, "qwen3_5", ("A_log", "linear_attn.norm")
    if name == "qwen3_5_text":
        return (Qwen3_5TextConfig(**QWEN35_TEXT_ONLY), Qwen3_5ForCausalLM, "qwen3_5_text",
                ("A_log", "linear_attn.norm"))
    raise KeyError(name)


# Each model type in both layouts. Real Qwen2.5 / Qwen3 checkpoints are legacy-layout, so their
# look-alikes are tested in it; the variants (sliding window on, untied, biases) in transformers 5's.
CASES = [("qwen25", "legacy"), ("qwen2_sliding_untied", "v5"),
         ("qwen3", "legacy"), ("qwen3_bias_untied", "v5"),
         ("qwen3_5", "v5"), ("qwen3_5", "legacy"), ("qwen3_5_text", "v5"), ("qwen3_5_text", "legacy")]


def _add_tensors(model_dir, extra: dict):
    """Add small BF16 tensors (e.g. the MTP head real Qwen3.5 checkpoints carry) to the shard."""
    from safetensors.torch import load_file, save_file
    path = next(model_dir.glob("*.safetensors"))
    tensors = load_file(str(path))
    for name, shape in extra.items():
        tensors[name] = torch.zeros(shape, dtype=torch.bfloat16)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _legacy_interval(model_dir, interval: int):
    """Legacy configs have no layer_types: record the pattern as full_attention_interval."""
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    target = cfg["text_config"] if "text_config" in cfg else cfg
    target["full_attention_interval"] = interval
    path.write_text(json.dumps(cfg, indent=2))


def make_checkpoint(name, layout, out_dir):
    cfg, cls, family, f32_tensors = _build(name)
    legacy = layout == "legacy"
    save_tiny(cfg, out_dir, seed=sum(map(ord, name)) % 1000, legacy=legacy,
              f32_tensors=f32_tensors if legacy else (), model_class=cls)
    if name == "qwen3_5":
        _add_tensors(out_dir, MTP_TENSORS)
        if legacy:
            _legacy_interval(out_dir, 2)
    return cls, family


@pytest.fixture(scope="module", params=CASES, ids=lambda p: f"{p[0]}-{p[1]}")
def checkpoint(request, tmp_path_factory):
    name, layout = request.param
    d = tmp_path_factory.mktemp(f"{name}_{layout}")
    cls, family = make_checkpoint(name, layout, d)
    ref = hf_model(d, cls)
    return d, family, hf_logits(ref, IDS), hf_greedy(ref, PROMPT, 32)


def test_conformance_kit(checkpoint):
    d, family, ref_logits, ref_tokens = checkpoint
    report = testing.run_conformance(d, IDS, reference_logits=ref_logits, reference_tokens=ref_tokens,
                                     greedy_prompt=PROMPT, family=family)
    assert report["family"] == family and report["plugin"] == "cpullm-plugin-qwen"
    assert report["parity_err"] <= 1e-3
    assert report["int8"]["cosine"] >= 0.98 and report["int8"]["top1"] >= 0.75
    assert report["int8"]["decode"]["cosine"] >= 0.98 and report["int8"]["decode"]["top1"] >= 0.75
    if family.startswith("qwen3_5"):
        assert "qwen.gated_delta_fused" in report["plugin_kernels"]["kernels"]


# ---- layouts and prefixes ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def wrapper_v5(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3_5_prefixes")
    make_checkpoint("qwen3_5", "v5", d)
    return d


def _rename(src, dst, rename):
    """Copy a checkpoint with its tensor names rewritten by ``rename(name) -> name | None``."""
    import shutil

    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    path = next(dst.glob("*.safetensors"))
    tensors = load_file(str(path))
    out = {rename(k): v for k, v in tensors.items() if rename(k)}
    path.unlink()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_wrapper_ignores_vision_and_mtp_with_one_notice(wrapper_v5, capsys, monkeypatch):
    monkeypatch.setenv("CPULLM_QUIET", "0")
    model = cpullm.load(wrapper_v5, quant="f32", use_cache=False)
    err = capsys.readouterr().err.strip().splitlines()
    notices = [line for line in err if "ignoring" in line]
    assert len(notices) == 1 and "only the text model runs" in notices[0]
    assert model.family.name == "qwen3_5"


def test_legacy_multimodal_prefix_and_text_only_class_give_same_logits(wrapper_v5, tmp_path):
    base = cpullm.load(wrapper_v5, quant="f32", use_cache=False).logits(IDS[:16])
    # older multimodal exports: language_model.model.* (+ language_model.lm_head.*)
    old = _rename(wrapper_v5, tmp_path / "old_prefix",
                  lambda k: k.replace("model.language_model.", "language_model.model.", 1))
    np.testing.assert_array_equal(cpullm.load(old, quant="f32", use_cache=False).logits(IDS[:16]), base)
    # the wrapper's text model saved as a text-only checkpoint (model.layers.*, no vision / mtp)
    cfg = json.loads((wrapper_v5 / "config.json").read_text())
    text = dict(cfg["text_config"], model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"],
                tie_word_embeddings=True)
    only = _rename(wrapper_v5, tmp_path / "text_only",
                   lambda k: None if k.startswith(("model.visual.", "mtp.")) else
                   k.replace("model.language_model.", "model.", 1))
    (only / "config.json").write_text(json.dumps(text))
    m = cpullm.load(only, quant="f32", use_cache=False)
    assert m.family.name == "qwen3_5_text"
    np.testing.assert_array_equal(m.logits(IDS[:16]), base)


# ---- config handling ---------------------------------------------------------------------------


def _args(config):
    from cpullm.loading import plugins
    return plugins.discover().family_for(config).args(config)


def test_layer_types_derived_from_full_attention_interval():
    a = _args(dict(QWEN35_TEXT, model_type="qwen3_5_text", num_hidden_layers=8))
    assert a.full_layers == (3, 7) and a.linear_layers == (0, 1, 2, 4, 5, 6)
    a = _args({"model_type": "qwen3_5", "text_config": dict(QWEN35_TEXT, num_hidden_layers=6,
                                                           full_attention_interval=3)})
    assert a.full_layers == (2, 5)


def test_qwen3_5_rope_partial_and_legacy_keys():
    a = _args(dict(QWEN35_TEXT, model_type="qwen3_5_text"))
    assert a.rope_spec.rotary_dim == 8 and a.rope_spec.theta == 1e7
    legacy = {k: v for k, v in QWEN35_TEXT.items() if k != "rope_parameters"}
    a = _args(dict(legacy, model_type="qwen3_5_text", rope_theta=1e7))   # factor defaults to 0.25
    assert a.rope_spec.rotary_dim == 8 and a.rope_spec.theta == 1e7
    a = _args(dict(legacy, model_type="qwen3_5_text", rope_theta=1e6, partial_rotary_factor=0.5))
    assert a.rope_spec.rotary_dim == 16


def test_wrapper_tie_follows_wrapper_key():
    a = _args({"model_type": "qwen3_5", "tie_word_embeddings": True,
               "text_config": dict(QWEN35_TEXT, tie_word_embeddings=False)})
    assert a.tie_word_embeddings is True


def test_qwen2_sliding_window_ignored_unless_enabled():
    base = dict(QWEN25_LIKE, model_type="qwen2", num_hidden_layers=4, max_window_layers=2)
    assert _args(base).layer_windows == (0, 0, 0, 0)
    assert _args(dict(base, use_sliding_window=True)).layer_windows == (0, 0, 8, 8)
    assert _args(dict(base, use_sliding_window=True,
                      layer_types=["sliding_attention", "full_attention"] * 2)).layer_windows == (8, 0, 8, 0)


def test_head_dims():
    assert _args(dict(QWEN25_LIKE, model_type="qwen2")).head_dim == 16
    assert _args(dict(QWEN3_LIKE, model_type="qwen3")).head_dim == 32
    no_hd = {k: v for k, v in QWEN3_LIKE.items() if k != "head_dim"}
    assert _args(dict(no_hd, model_type="qwen3")).head_dim == 128   # transformers' default


@pytest.mark.parametrize("config,key", [
    (dict(QWEN35_TEXT, model_type="qwen3_5_text",
          layer_types=["linear_attention", "sliding_attention", "full_attention", "full_attention"]),
     "layer_types"),
    (dict(QWEN35_TEXT, model_type="qwen3_5_text", layer_types=["full_attention"] * 3), "layer_types"),
    (dict(QWEN35_TEXT, model_type="qwen3_5_text", linear_num_value_heads=3), "linear_num_value_heads"),
    (dict(QWEN3_LIKE, model_type="qwen3", hidden_act="gelu"), "hidden_act"),
    (dict(QWEN25_LIKE, model_type="qwen2", layer_types=["chunked_attention"] * 3), "layer_types"),
    (dict(QWEN25_LIKE, model_type="qwen2", rope_parameters={"rope_type": "yarn", "rope_theta": 1e6,
                                                          "factor": 4.0}), "rope"),
])
def test_unsupported_config_names_the_key(config, key):
    with pytest.raises(UnsupportedConfigError, match=key):
        _args(config)


def test_missing_and_unexpected_tensors_reported_at_once(wrapper_v5, tmp_path):
    broken = _rename(wrapper_v5, tmp_path / "broken",
                     lambda k: None if k.endswith(("layers.0.linear_attn.A_log", "layers.1.self_attn.q_norm.weight"))
                     else k.replace("layers.2.linear_attn.dt_bias", "layers.2.linear_attn.dt_bias_x"))
    with pytest.raises(WeightMapError) as exc:
        cpullm.load(broken, quant="f32", use_cache=False)
    msg = str(exc.value)
    assert "layers.0.linear_attn.A_log" in msg and "layers.1.self_attn.q_norm.weight" in msg
    assert "dt_bias_x" in msg and "layers.2.linear_attn.dt_bias" in msg
