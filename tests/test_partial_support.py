"""A model a family can only partly handle fails at load, naming the config key or tensor, never
at generation time with wrong output: an unknown rope_type, a layer type the family does not
run, a tensor it does not expect. For the in-tree llama family and the out-of-tree
tinyllama_variant family (tests/third_party, registered in-process here)."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

import cpullm
from cpullm import errors
from cpullm.loading import plugins
from cpullm.cli import main as cli_main
from cpullm.testing import make_random_checkpoint
from tiny_configs import SMOLLM2_LIKE

VARIANT_SRC = Path(__file__).parent / "third_party" / "cpullm-plugin-tinyvariant"

LLAMA = dict(SMOLLM2_LIKE, model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=2)
VARIANT = dict(
    model_type="tinyllama_variant", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256,
    max_position_embeddings=256, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


@pytest.fixture(scope="module")
def variant_plugin():
    """cpullm-plugin-tinyvariant's entry-point module, registered in this process."""
    sys.path.insert(0, str(VARIANT_SRC))
    import cpullm_tinyvariant.plugin as module
    plugins.register_for_tests(module)
    plugins.discover(refresh=True)
    yield module
    plugins.unregister_for_tests(module)
    sys.path.remove(str(VARIANT_SRC))
    plugins.discover(refresh=True)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_random_checkpoint(LLAMA, tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def variant_dir(tmp_path_factory, variant_plugin):
    return make_random_checkpoint(VARIANT, tmp_path_factory.mktemp("variant"))


@pytest.fixture(params=["llama", "variant"])
def family_dir(request):
    return request.param, request.getfixturevalue(f"{request.param}_dir")


def _copy(src: Path, dst: Path, **config_changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in config_changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _load_error(d: Path, cls) -> str:
    with pytest.raises(cls) as exc:
        cpullm.load(d, quant="f32", use_cache=False)
    return str(exc.value)


# ---- rope_type --------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["rope_parameters", "rope_scaling"])
def test_unknown_rope_type_fails_at_load_naming_the_key(family_dir, tmp_path, layout):
    _, src = family_dir
    if layout == "rope_parameters":
        d = _copy(src, tmp_path / "m", rope_parameters={"rope_type": "frobnicated", "rope_theta": 1e4,
                                                        "factor": 4.0})
    else:   # the Hub's legacy layout
        d = _copy(src, tmp_path / "m", rope_parameters=None, rope_theta=1e4,
                  rope_scaling={"type": "frobnicated", "factor": 4.0})
    msg = _load_error(d, errors.UnsupportedConfigError)
    assert "rope_type" in msg and "'frobnicated'" in msg and "llama3" in msg    # names what works


def test_known_but_unimplemented_rope_type_fails_too(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path / "m", rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 2048})
    assert "'yarn'" in _load_error(d, errors.UnsupportedConfigError)


# ---- layer_types ------------------------------------------------------------------------------


def test_llama_refuses_sliding_layers_rather_than_run_full_attention(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path / "m", layer_types=["sliding_attention", "full_attention"],
              sliding_window=16)
    msg = _load_error(d, errors.UnsupportedConfigError)
    assert "'layer_types'" in msg and "sliding_attention" in msg


def test_llama_accepts_all_full_attention_layer_types(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path / "m", layer_types=["full_attention"] * 2)
    ref = cpullm.load(llama_dir, quant="f32", use_cache=False).logits([1, 2, 3])
    got = cpullm.load(d, quant="f32", use_cache=False).logits([1, 2, 3])
    np.testing.assert_array_equal(got, ref)


def test_layer_types_of_the_wrong_length_is_a_config_error(family_dir, tmp_path):
    _, src = family_dir
    d = _copy(src, tmp_path / "m", layer_types=["full_attention"] * 3)
    assert "'layer_types'" in _load_error(d, errors.ConfigError)


def test_variant_refuses_a_layer_type_it_does_not_run(variant_dir, tmp_path):
    d = _copy(variant_dir, tmp_path / "m", layer_types=["linear_attention", "full_attention"])
    msg = _load_error(d, errors.UnsupportedConfigError)
    assert "'layer_types'" in msg and "linear_attention" in msg
    assert "full_attention, sliding_attention" in msg


def test_variant_sliding_layers_need_a_window(variant_dir, tmp_path):
    d = _copy(variant_dir, tmp_path / "m", layer_types=["sliding_attention", "full_attention"])
    assert "'sliding_window'" in _load_error(d, errors.UnsupportedConfigError)


def test_variant_runs_sliding_layers_with_their_window(variant_dir, tmp_path):
    """The variant supports sliding windows generically (blocks.attention(window=)): within the
    window the logits equal full attention's, past it they differ."""
    d = _copy(variant_dir, tmp_path / "m", layer_types=["sliding_attention", "full_attention"],
              sliding_window=4)
    ids = [int(i) for i in np.random.default_rng(0).integers(0, 256, 10)]
    full = cpullm.load(variant_dir, quant="f32", use_cache=False).logits(ids)
    slid = cpullm.load(d, quant="f32", use_cache=False).logits(ids)
    np.testing.assert_allclose(slid[:4], full[:4], rtol=1e-5, atol=1e-5)
    assert np.abs(slid[4:] - full[4:]).max() > 1e-3


# ---- tensors ----------------------------------------------------------------------------------


EXTRA = {"llama": "model.layers.0.self_attn.q_norm.weight",      # a Qwen3-style q/k norm
         "variant": "transformer.h.0.attn.bq.weight"}             # a bias the family never adds


def test_unexpected_tensor_fails_at_load_naming_it(family_dir, tmp_path):
    name, src = family_dir
    d = _copy(src, tmp_path / "m")
    save_file({EXTRA[name]: np.ones(16, np.float32)}, str(d / "extra.safetensors"))
    msg = _load_error(d, errors.WeightMapError)
    assert f"unexpected tensors (1): {EXTRA[name]}" in msg


def test_cli_reports_the_key_in_one_line(llama_dir, tmp_path, capsys):
    d = _copy(llama_dir, tmp_path / "m", layer_types=["sliding_attention", "full_attention"])
    assert cli_main(["run", str(d), "-p", "hi", "-n", "2", "--no-cache"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("cpullm: error: config key 'layer_types'") and "\n" not in err
