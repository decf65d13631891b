"""Every user-caused failure: a specific cpullm.errors exception, and one CLI line with exit 2."""
import json
import struct

import numpy as np
import pytest

import cpullm
from cpullm import errors
from cpullm.cli import main
from cpullm.testing import make_random_checkpoint

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=300, rms_norm_eps=1e-5,
            max_position_embeddings=64, tie_word_embeddings=True, rope_theta=10000.0)


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    return make_random_checkpoint(TINY, tmp_path_factory.mktemp("good"))


def _copy(src, dst):
    import shutil
    shutil.copytree(src, dst)
    return dst


def _cli_error(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("cpullm: error:"), err
    return err[0]


def test_missing_directory(tmp_path, capsys):
    with pytest.raises(errors.ModelNotFoundError, match="does not exist"):
        cpullm.load(tmp_path / "nope" / "model")
    _cli_error(capsys, ["run", str(tmp_path / "nope" / "model"), "-p", "hi", "--no-cache"])


def test_missing_config(tmp_path, good_dir, capsys):
    d = _copy(good_dir, tmp_path / "m")
    (d / "config.json").unlink()
    with pytest.raises(errors.ConfigError, match="config.json is missing"):
        cpullm.load(d)
    assert "config.json" in _cli_error(capsys, ["run", str(d), "-p", "hi"])


def test_invalid_config(tmp_path, good_dir):
    d = _copy(good_dir, tmp_path / "m")
    (d / "config.json").write_text("{not json")
    with pytest.raises(errors.ConfigError, match="not valid JSON"):
        cpullm.load(d)


def test_unknown_model_type_lists_families_and_names_plugin(tmp_path, good_dir, capsys):
    d = _copy(good_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "frobnicator"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(errors.UnknownModelTypeError, match=r"installed: .*llama"):
        cpullm.load(d)
    cfg["model_type"] = "qwen3_5"
    (d / "config.json").write_text(json.dumps(cfg))
    from cpullm.loading import plugins
    if not any("qwen3_5" in f.model_types for f in plugins.discover().families):
        line = _cli_error(capsys, ["run", str(d), "-p", "hi"])
        assert "cpullm-plugin-qwen" in line


def _rewrite_header(path, mutate):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    mutate(header)
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + raw[8 + n:])


def test_truncated_safetensors(tmp_path, good_dir, capsys):
    d = _copy(good_dir, tmp_path / "m")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(errors.CheckpointError, match="truncated"):
        cpullm.load(d)
    assert "truncated" in _cli_error(capsys, ["run", str(d), "-p", "hi", "--no-cache"])


def test_header_offsets_past_end(tmp_path, good_dir):
    d = _copy(good_dir, tmp_path / "m")

    def push(h):
        name = next(k for k in h if k != "__metadata__")
        b, e = h[name]["data_offsets"]
        h[name]["data_offsets"] = [b + 10**9, e + 10**9]
    _rewrite_header(d / "model.safetensors", push)
    with pytest.raises(errors.CheckpointError, match="truncated|past"):
        cpullm.load(d)


def test_header_length_past_end(tmp_path, good_dir):
    d = _copy(good_dir, tmp_path / "m")
    f = d / "model.safetensors"
    raw = f.read_bytes()
    f.write_bytes(struct.pack("<Q", len(raw) * 2) + raw[8:])
    with pytest.raises(errors.CheckpointError, match="header length"):
        cpullm.load(d)


def test_unknown_dtype(tmp_path, good_dir):
    d = _copy(good_dir, tmp_path / "m")

    def bad(h):
        name = next(k for k in h if k != "__metadata__")
        h[name]["dtype"] = "F8_E9M9"
    _rewrite_header(d / "model.safetensors", bad)
    with pytest.raises(errors.CheckpointError, match="unknown dtype 'F8_E9M9'"):
        cpullm.load(d)


def _load_bf16(f):
    from cpullm.loading.tensors import TensorStore
    st = TensorStore(f.parent)
    return {n: np.array(st.raw(n)) for n in st.names()}


def _save(t, f):
    from cpullm.testing import _save_bf16
    _save_bf16(t, f)


def test_missing_and_unexpected_tensors_reported_together(tmp_path, good_dir):
    d = _copy(good_dir, tmp_path / "m")
    f = d / "model.safetensors"
    t = _load_bf16(f)
    t.pop("model.layers.1.mlp.down_proj.weight")
    t.pop("model.norm.weight")
    t["model.layers.0.extra.weight"] = np.zeros(3, np.uint16)
    _save(t, f)
    with pytest.raises(errors.WeightMapError) as ei:
        cpullm.load(d)
    msg = str(ei.value)
    assert "model.layers.1.mlp.down_proj.weight" in msg and "model.norm.weight" in msg
    assert "model.layers.0.extra.weight" in msg


def test_wrong_tensor_shape(tmp_path, good_dir):
    d = _copy(good_dir, tmp_path / "m")
    f = d / "model.safetensors"
    t = _load_bf16(f)
    t["model.layers.0.self_attn.q_proj.weight"] = np.zeros((64, 32), np.uint16)
    _save(t, f)
    with pytest.raises(errors.WeightMapError, match=r"q_proj.weight: expected \(64, 64\), found \(64, 32\)"):
        cpullm.load(d)


def test_empty_prompt_and_bad_n(good_dir, capsys):
    model = cpullm.load(good_dir, use_cache=False)
    with pytest.raises(errors.PromptError, match="empty"):
        list(model.generate("", max_new_tokens=4))
    with pytest.raises(errors.PromptError, match="max_new_tokens"):
        list(model.generate("hi", max_new_tokens=0))
    with pytest.raises(errors.PromptError):
        model.logits([])
    _cli_error(capsys, ["run", str(good_dir), "-p", "", "--no-cache"])
    _cli_error(capsys, ["run", str(good_dir), "-p", "hi", "-n", "0", "--no-cache"])
    _cli_error(capsys, ["run", str(good_dir), "-p", "hi", "-n", "-3", "--no-cache"])


def test_prompt_longer_than_context(good_dir, capsys):
    model = cpullm.load(good_dir, use_cache=False)        # max_position_embeddings 64
    with pytest.raises(errors.ContextOverflowError, match="context"):
        list(model.generate("x" * 200, max_new_tokens=2))
    with pytest.raises(errors.ContextOverflowError):
        model.logits(list(range(65)))
    assert "context" in _cli_error(capsys, ["run", str(good_dir), "-p", "y" * 100, "--no-cache"])


def test_bad_sampling_parameters(good_dir):
    model = cpullm.load(good_dir, use_cache=False)
    for kw in (dict(temperature=-1), dict(top_p=0.0), dict(top_k=-2), dict(min_p=1.5),
               dict(repetition_penalty=0)):
        with pytest.raises(errors.SamplingError):
            list(model.generate("hi", max_new_tokens=2, **kw))


def test_bad_quant(good_dir):
    with pytest.raises(errors.ConfigError, match="quant"):
        cpullm.load(good_dir, quant="int3")


def test_debug_shows_traceback(tmp_path):
    with pytest.raises(errors.ModelNotFoundError):
        main(["run", str(tmp_path / "missing"), "-p", "hi", "--debug"])
