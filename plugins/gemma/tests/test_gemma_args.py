"""Gemma families without torch: config reading (both layouts, defaults, quirks), layer patterns,
RoPE per layer type, weight maps (prefixes, 1 + w folded once), errors, plugin discovery."""
import json

import numpy as np
import pytest

from cpullm.graph import blocks
from cpullm.loading import plugins
from cpullm.errors import ConfigError, UnsupportedConfigError, WeightMapError
from cpullm.loading.weightmap import ADD_ONE

# The real google/gemma-3-4b-it config.json: only non-default text keys.
GEMMA3_4B_IT = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
    "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
    "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16,
                      "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False},
}
GEMMA_2B = {"architectures": ["GemmaForCausalLM"], "model_type": "gemma", "hidden_size": 2048,
            "intermediate_size": 16384, "num_hidden_layers": 18, "num_attention_heads": 8,
            "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 256000, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "rope_scaling": None, "max_position_embeddings": 8192,
            "attention_bias": False, "hidden_act": "gelu", "torch_dtype": "bfloat16"}
GEMMA2_2B = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 2304,
             "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
             "num_key_value_heads": 4, "head_dim": 256, "query_pre_attn_scalar": 256,
             "sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
             "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
             "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "vocab_size": 256000,
             "max_position_embeddings": 8192, "torch_dtype": "float32"}
GEMMA3_1B = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 1152,
             "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
             "num_key_value_heads": 1, "head_dim": 256, "query_pre_attn_scalar": 256,
             "sliding_window": 512, "sliding_window_pattern": 6, "rope_theta": 1_000_000.0,
             "rope_local_base_freq": 10_000.0, "rope_scaling": None, "attn_logit_softcapping": None,
             "final_logit_softcapping": None, "vocab_size": 262144, "max_position_embeddings": 32768}


def family(config):
    return plugins.discover().family_for(config)


def args(config):
    return family(config).args(config)


def full_layers(a):
    return [i for i, s in enumerate(a.layer_specs) if not s.sliding_window]


# ---- discovery ------------------------------------------------------------------------------
def test_four_families_under_the_gemma_plugin():
    reg = plugins.discover()
    info = next(p for p in reg.plugins if p.distribution == "cpullm-plugin-gemma")
    assert info.error is None
    assert sorted(f.name for f in info.families) == ["gemma", "gemma2", "gemma3", "gemma3_text"]
    for config, name in ((GEMMA_2B, "gemma"), (GEMMA2_2B, "gemma2"), (GEMMA3_1B, "gemma3_text"),
                         (GEMMA3_4B_IT, "gemma3")):
        assert family(config).name == name and family(config).plugin == "cpullm-plugin-gemma"


def test_cli_families_lists_them(capsys):
    from cpullm.cli import main

    assert main(["families", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["plugins"]
    row = next(r for r in rows if r["plugin"] == "cpullm-plugin-gemma")
    assert {f["name"]: f["model_types"] for f in row["families"]} == {
        "gemma": ["gemma"], "gemma2": ["gemma2"], "gemma3": ["gemma3"], "gemma3_text": ["gemma3_text"]}


# ---- Gemma 1 ------------------------------------------------------------------------------------
def test_gemma_2b_gelu_means_tanh_and_mqa():
    a = args(GEMMA_2B)
    assert a.glu_act == "gelu_tanh"                                    # "gelu" means tanh-GELU
    assert (a.num_attention_heads, a.num_key_value_heads, a.head_dim) == (8, 1, 256)
    assert a.attn_scale == 256 ** -0.5 and a.tie_word_embeddings
    assert np.float32(a.embed_scale) == np.float32(np.sqrt(np.float32(2048)))
    assert all(s.sliding_window == 0 and s.attn_softcap == 0 and not s.qk_norm for s in a.layer_specs)
    assert a.layer_specs[0].rope.inv_freq == blocks.make_rope({"rope_theta": 1e4}, 256).inv_freq


def test_gemma2_bad_values_name_the_key():
    with pytest.raises(ConfigError, match="attn_logit_softcapping"):
        args({**GEMMA2_2B, "attn_logit_softcapping": -1})
    with pytest.raises(ConfigError, match="rope_theta"):
        args({**GEMMA2_2B, "rope_theta": None})


def test_gemma_exact_gelu_is_refused_with_the_key_named():
    with pytest.raises(UnsupportedConfigError, match="hidden_activation"):
        args({**GEMMA2_2B, "hidden_activation": "gelu"})     # exact (erf) GELU in Gemma 2
    with pytest.raises(UnsupportedConfigError, match="hidden_act"):
        args({**GEMMA_2B, "hidden_act": "relu"})


# ---- Gemma 2 ------------------------------------------------------------------------------------
def test_gemma2_implicit_alternating_layers_and_softcaps():
    a = args(GEMMA2_2B)
    assert full_layers(a) == list(range(1, 26, 2))               # even layers slide
    assert {s.sliding_window for s in a.layer_specs} == {0, 4096}
    assert all(s.attn_softcap == 50.0 for s in a.layer_specs) and a.final_softcap == 30.0
    assert a.attn_scale == 256 ** -0.5 and np.float32(a.embed_scale) == np.float32(48.0)


def test_gemma2_defaults_and_explicit_layer_types():
    cfg = {k: v for k, v in GEMMA2_2B.items() if k not in ("attn_logit_softcapping", "final_logit_softcapping")}
    a = args({**cfg, "num_hidden_layers": 4, "layer_types": ["full_attention"] * 3 + ["sliding_attention"]})
    assert full_layers(a) == [0, 1, 2]
    assert a.layer_specs[0].attn_softcap == 50.0 and a.final_softcap == 30.0    # Gemma2Config defaults
    assert args({**GEMMA2_2B, "final_logit_softcapping": None}).final_softcap == 0.0


# ---- Gemma 3 ------------------------------------------------------------------------------------
def test_gemma3_4b_it_text_defaults_patterns_and_ropes():
    a = args(GEMMA3_4B_IT)
    assert type(a).__name__ == "Gemma3Args"
    assert (a.hidden_size, a.num_hidden_layers, a.intermediate_size) == (2560, 34, 10240)
    # Gemma3TextConfig defaults for the keys the real file leaves out
    assert (a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.vocab_size) == (8, 4, 256, 262208)
    assert a.attn_scale == 256 ** -0.5 and a.rms_norm_eps == 1e-6 and a.glu_act == "gelu_tanh"
    assert full_layers(a) == [5, 11, 17, 23, 29]
    assert {a.layer_specs[i].sliding_window for i in range(34) if i not in full_layers(a)} == {1024}
    glob, loc = a.layer_specs[5].rope, a.layer_specs[0].rope
    np.testing.assert_array_equal(np.float32(glob.inv_freq),
                                  blocks.default_inv_freq(1e6, 256) / np.float32(8.0))
    np.testing.assert_array_equal(np.float32(loc.inv_freq), blocks.default_inv_freq(1e4, 256))
    assert all(s.qk_norm and s.attn_softcap == 0 for s in a.layer_specs)
    assert a.final_softcap == 0.0


def test_gemma3_wrapper_ignores_softcaps_text_model_applies_final():
    text = {**GEMMA3_4B_IT["text_config"], "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0}
    a = args({**GEMMA3_4B_IT, "text_config": text})
    assert a.final_softcap == 0.0 and all(s.attn_softcap == 0 for s in a.layer_specs)   # caps never applied
    b = args({**GEMMA3_1B, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0})
    assert b.final_softcap == 30.0 and all(s.attn_softcap == 0 for s in b.layer_specs)


def test_gemma3_legacy_and_v5_rope_layouts_agree():
    legacy = args(GEMMA3_1B)
    v5 = {k: v for k, v in GEMMA3_1B.items() if k not in ("rope_theta", "rope_local_base_freq",
                                                            "rope_scaling", "sliding_window_pattern")}
    v5["rope_parameters"] = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    v5["layer_types"] = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)]
    assert args(v5).layer_specs == legacy.layer_specs
    assert full_layers(legacy) == [5, 11, 17, 23]
    # rope defaults (1e6 global, 1e4 local) when nothing is given
    bare = {k: v for k, v in GEMMA3_1B.items() if k not in ("rope_theta", "rope_local_base_freq")}
    assert args(bare).layer_specs == legacy.layer_specs
    # a layer pattern other than 6, implicit
    assert full_layers(args({**GEMMA3_1B, "sliding_window_pattern": 2}))[:3] == [1, 3, 5]


def test_gemma3_v5_linear_scaling_matches_legacy_rope_scaling():
    wrapper_v5 = json.loads(json.dumps(GEMMA3_4B_IT))
    text = wrapper_v5["text_config"]
    del text["rope_scaling"]
    text["rope_parameters"] = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    assert args(wrapper_v5).layer_specs == args(GEMMA3_4B_IT).layer_specs


@pytest.mark.parametrize("patch,error,key", [
    ({"layer_types": ["sliding_attention"] * 3}, ConfigError, "layer_types"),
    ({"layer_types": ["chunked_attention"] * 26}, UnsupportedConfigError, "layer_types"),
    ({"sliding_window": None}, ConfigError, "sliding_window"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, UnsupportedConfigError, "rope"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, UnsupportedConfigError, "rope_parameters"),
    ({"use_bidirectional_attention": True}, UnsupportedConfigError, "use_bidirectional_attention"),
    ({"num_key_value_heads": 3}, UnsupportedConfigError, "num_key_value_heads"),
    ({"head_dim": None}, ConfigError, "head_dim"),
    ({"rope_scaling": {"rope_type": "linear"}}, ConfigError, "factor"),
    ({"rope_theta": "big"}, ConfigError, "rope_theta"),
    ({"query_pre_attn_scalar": None}, ConfigError, "query_pre_attn_scalar"),
    ({"final_logit_softcapping": "x"}, ConfigError, "final_logit_softcapping"),
    ({"sliding_window_pattern": 0}, ConfigError, "sliding_window_pattern"),
    ({"hidden_size": "wide"}, ConfigError, "hidden_size"),
])
def test_bad_gemma3_configs_name_the_key(patch, error, key):
    with pytest.raises(error, match=key):
        args({**GEMMA3_1B, **patch})


# ---- weight maps ----------------------------------------------------------------------------------
class FakeStore:
    """The TensorStore interface the weight map uses, over in-memory arrays."""

    def __init__(self, tensors):
        self.tensors = tensors

    def names(self):
        return list(self.tensors)

    def shape(self, name):
        return self.tensors[name].shape

    def get(self, name):
        return self.tensors[name].astype(np.float32)


TINY3 = {"model_type": "gemma3", "text_config": {
    "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 4, "vocab_size": 10, "sliding_window": 4}}


def tiny3_tensors(prefix, rng):
    a = args(TINY3)
    wmap = family(TINY3).weight_map(a)
    out = {}
    for r in wmap.expand():
        if r.source and r.source.startswith("model."):     # tied: no lm_head.weight stored
            out[prefix + r.source[len("model."):]] = rng.standard_normal(r.shape).astype(np.float32)
    return out


@pytest.mark.parametrize("prefix", ["language_model.model.", "model.language_model."])
def test_gemma3_wrapper_prefixes_norms_folded_once_vision_ignored(prefix):
    rng = np.random.default_rng(0)
    tensors = tiny3_tensors(prefix, rng)
    vision = ("vision_tower.vision_model.embeddings.patch_embedding.weight"
              if prefix.startswith("language_model") else "model.vision_tower.vision_model.post_layernorm.weight")
    tensors[vision] = np.zeros((3,), np.float32)
    proj = ("" if prefix.startswith("language_model") else "model.") + "multi_modal_projector.mm_soft_emb_norm.weight"
    tensors[proj] = np.zeros((3,), np.float32)
    a = args(TINY3)
    wmap = family(TINY3).weight_map(a)
    store = FakeStore(tensors)
    first, second = wmap.resolve(store, a), wmap.resolve(store, a)
    assert sorted(first.ignored) == sorted([vision, proj])
    assert first.is_tied("lm_head")
    for canonical in ("final_norm", "layers.1.attn_norm", "layers.1.post_attn_norm", "layers.0.mlp_norm",
                      "layers.0.post_mlp_norm", "layers.1.attn.q_norm", "layers.0.attn.k_norm"):
        stored = tensors[first.source_of(canonical)]
        np.testing.assert_array_equal(first.get(canonical), stored + np.float32(1.0))   # once
        np.testing.assert_array_equal(second.get(canonical), first.get(canonical))
        assert first.found[canonical][1] is ADD_ONE
    np.testing.assert_array_equal(first.get("layers.0.attn.q_proj"),
                                  tensors[prefix + "layers.0.self_attn.q_proj.weight"])


def test_gemma3_missing_and_unexpected_tensors_reported_together():
    rng = np.random.default_rng(0)
    tensors = tiny3_tensors("model.language_model.", rng)
    del tensors["model.language_model.layers.1.self_attn.k_norm.weight"]
    tensors["model.audio_tower.x"] = np.zeros(2, np.float32)
    a = args(TINY3)
    with pytest.raises(WeightMapError) as e:
        family(TINY3).weight_map(a).resolve(FakeStore(tensors), a)
    assert "layers.1.self_attn.k_norm.weight" in str(e.value) and "model.audio_tower.x" in str(e.value)


def test_untied_lm_head_under_either_prefix():
    cfg = json.loads(json.dumps(TINY3))
    cfg["text_config"]["tie_word_embeddings"] = False
    a = args(cfg)
    for prefix, head in (("language_model.model.", "language_model.lm_head.weight"),
                         ("model.language_model.", "lm_head.weight")):
        tensors = tiny3_tensors(prefix, np.random.default_rng(1))
        tensors[head] = np.ones((10, 8), np.float32)
        w = family(cfg).weight_map(a).resolve(FakeStore(tensors), a)
        assert not w.is_tied("lm_head") and w.source_of("lm_head") == head
