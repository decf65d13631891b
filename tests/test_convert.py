"""cpullm.convert: GGUF -> Hugging Face model directory.

Fast tests build tiny GGUF files with gguf.GGUFWriter (no network). The real-model tests
(``-m slow``) convert the three known models and compare them with transformers' own GGUF loader.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from cpullm import convert as cv  # noqa: E402
from cpullm.convert import directory as cv_directory  # noqa: E402
from cpullm.loading import gguf_file as gf  # noqa: E402
from cpullm.loading import gguf_vocab as gv  # noqa: E402
from cpullm.errors import ConversionError  # noqa: E402

# ---------------------------------------------------------------------------------------------
# Tiny GGUF builder (shared with test_store.py)
# ---------------------------------------------------------------------------------------------

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BPE_MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "Ġ Ġ"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

SPM_SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
SPM_USER = ["<start_of_turn>", "<end_of_turn>", "\n", "\n\n"]
SPM_PIECES = ["\u2581", "t", "h", "e", "a", "n", "i", "\u2581t", "he", "\u2581the", "in", "\u2581a", "  ", "   "]

# Per-architecture shapes. Qwen3 and Gemma 3 use head_dim 128 / 256 because transformers' GGUF
# loader takes those defaults from the config class instead of the file.
TINY_SHAPES = {
    "llama": dict(hidden=64, heads=4, kv=2, head_dim=16, ffn=96),
    "qwen2": dict(hidden=64, heads=4, kv=2, head_dim=16, ffn=96),
    "qwen3": dict(hidden=64, heads=2, kv=1, head_dim=128, ffn=96),
    "gemma3": dict(hidden=64, heads=2, kv=1, head_dim=256, ffn=96),
}


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf ``LlamaModel.permute`` (HF rotate-half rows -> interleaved pairs)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def byte_level_vocab() -> tuple[list[str], list[int]]:
    table = gv.byte_to_unicode()
    tokens = SPECIAL + [table[b] for b in range(256)] + ["Ġt", "he", "Ġthe", "in", "Ġa", "ĠĠ"]
    types = [3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL))
    return tokens, types


def spm_vocab() -> tuple[list[str], list[int], list[float]]:
    tokens = SPM_SPECIAL + SPM_USER + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES
    types = ([3] * len(SPM_SPECIAL) + [4] * len(SPM_USER) + [6] * 256 + [1] * len(SPM_PIECES))
    scores = [-float(i) for i in range(len(tokens))]
    return tokens, types, scores


def tiny_hf_weights(arch: str, layers: int = 2, vocab: int = 265, seed: int = 0,
                    tied: bool = True) -> dict[str, np.ndarray]:
    """Random transformers-convention weights (float32) of a tiny model of ``arch``."""
    s = TINY_SHAPES[arch]
    rng = np.random.default_rng(seed)
    h, q, kvd, f = s["hidden"], s["heads"] * s["head_dim"], s["kv"] * s["head_dim"], s["ffn"]

    def r(*shape, scale=0.2):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    zero_centred = arch == "gemma3"  # Gemma norms are stored as w (HF) and 1 + w (llama.cpp)

    def norm(n):
        return r(n, scale=0.1) + (0.0 if zero_centred else 1.0)

    w = {"model.embed_tokens.weight": r(vocab, h, scale=1.0), "model.norm.weight": norm(h)}
    if not tied:
        w["lm_head.weight"] = r(vocab, h)
    for i in range(layers):
        p = f"model.layers.{i}."
        w.update({
            p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h),
            p + "self_attn.q_proj.weight": r(q, h), p + "self_attn.k_proj.weight": r(kvd, h),
            p + "self_attn.v_proj.weight": r(kvd, h), p + "self_attn.o_proj.weight": r(h, q),
            p + "mlp.gate_proj.weight": r(f, h), p + "mlp.up_proj.weight": r(f, h),
            p + "mlp.down_proj.weight": r(h, f),
        })
        if arch == "qwen2":
            w.update({p + "self_attn.q_proj.bias": r(q), p + "self_attn.k_proj.bias": r(kvd),
                      p + "self_attn.v_proj.bias": r(kvd)})
        if arch in ("qwen3", "gemma3"):
            w.update({p + "self_attn.q_norm.weight": norm(s["head_dim"]),
                      p + "self_attn.k_norm.weight": norm(s["head_dim"])})
        if arch == "gemma3":
            w.update({p + "pre_feedforward_layernorm.weight": norm(h),
                      p + "post_feedforward_layernorm.weight": norm(h)})
    return w


def _layout(arch: str):
    """The GGUFArch naming the tensors of a tiny ``arch`` file: the installed one, or llama's
    table without its q/k permutation for an architecture no plugin declares."""
    import attrs

    specs = gf.gguf_architectures()
    return specs.get(arch) or attrs.evolve(specs["llama"], name=arch, permute_qk=False)


def write_tiny_gguf(path: Path, arch: str = "llama", *, qtype: str = "F32", tied: bool = True,
                    layers: int = 2, seed: int = 0, weights: dict | None = None,
                    identical_output: bool = False, extra_tensors: dict | None = None,
                    drop_tensors: tuple[str, ...] = (), meta: dict | None = None) -> dict[str, np.ndarray]:
    """Write a tiny GGUF of ``arch`` as llama.cpp would; returns the HF weights it encodes."""
    from cpullm.convert.gguf_writer import write_gguf

    s = TINY_SHAPES.get(arch, TINY_SHAPES["llama"])
    spm = arch == "gemma3"
    if spm:
        tokens, types, scores = spm_vocab()
    else:
        (tokens, types), scores = byte_level_vocab(), None
    hf = weights or tiny_hf_weights(arch if arch in TINY_SHAPES else "llama", layers, len(tokens), seed, tied)
    fields = {"block_count": layers, "context_length": 512, "embedding_length": s["hidden"],
              "feed_forward_length": s["ffn"], "head_count": s["heads"], "head_count_kv": s["kv"],
              "layer_norm_rms_eps": 1e-6, "rope_freq_base": 10000.0}
    if arch != "llama":
        fields.update(key_length=s["head_dim"], value_length=s["head_dim"])
    else:
        fields["rope_dimension_count"] = s["head_dim"]
    if arch == "gemma3":
        fields["sliding_window"] = 128
    fields.update(tokenizer_model="llama" if spm else "gpt2", tokenizer_pre="default" if spm else "qwen2",
                  token_list=tokens, token_types=types)
    if spm:
        fields.update(token_scores=scores, bos_token_id=2, eos_token_id=1, unk_token_id=3, pad_token_id=0,
                      add_bos_token=True)
    else:
        fields.update(token_merges=BPE_MERGES, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      add_bos_token=False, chat_template=CHAT_TEMPLATE)
    tensors = dict(hf)
    if identical_output:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    write_gguf(path, arch, fields, tensors, layout=_layout(arch), qtype=qtype, metadata=meta,
               extra_tensors=extra_tensors, skip=drop_tensors)
    return hf


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """bf16 safetensors -> float32 arrays, parsed by hand (numpy has no bfloat16)."""
    raw = Path(path).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name, info in header.items():
        assert info["dtype"] == "BF16", name
        start, end = info["data_offsets"]
        bits = np.frombuffer(raw[8 + n + start:8 + n + end], dtype="<u2").reshape(info["shape"])
        out[name] = gf.bf16_bits_to_f32(bits)
    return out


def test_safetensors_file_reads_with_the_official_library(tiny_llama, tmp_path):
    from safetensors import safe_open

    path, hf = tiny_llama
    out = cv.convert_gguf(path, tmp_path / "out")
    with safe_open(str(out / "model.safetensors"), framework="numpy") as f:
        assert f.metadata() == {"format": "pt"}
        assert set(f.keys()) == set(hf)
        sl = f.get_slice("model.layers.1.mlp.up_proj.weight")
        assert sl.get_dtype() == "BF16" and sl.get_shape() == list(hf["model.layers.1.mlp.up_proj.weight"].shape)


def bf16(x: np.ndarray) -> np.ndarray:
    return gf.bf16_bits_to_f32(gf.f32_to_bf16_bits(x))


@pytest.fixture
def tiny_llama(tmp_path):
    path = tmp_path / "tiny-llama.gguf"
    hf = write_tiny_gguf(path, "llama")
    return path, hf


# ---------------------------------------------------------------------------------------------
# Fast tests
# ---------------------------------------------------------------------------------------------

def test_convert_llama_writes_hf_directory(tiny_llama, tmp_path):
    path, hf = tiny_llama
    out = cv.convert_gguf(path, tmp_path / "out")
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (64, 4, 2, 16)
    assert cfg["num_hidden_layers"] == 2 and cfg["intermediate_size"] == 96 and cfg["vocab_size"] == 265
    assert cfg["rms_norm_eps"] == 1e-6 and cfg["rope_theta"] == 10000.0 and cfg["rope_scaling"] is None
    assert cfg["torch_dtype"] == "bfloat16" and cfg["tie_word_embeddings"] is True
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 2, 0)
    got = read_safetensors(out / "model.safetensors")
    assert set(got) == set(hf)  # every tensor renamed, no lm_head (tied)
    for name, ref in hf.items():
        np.testing.assert_array_equal(got[name], bf16(ref), err_msg=name)


def test_llama_qk_unpermute_restores_hf_rows(tiny_llama, tmp_path):
    path, hf = tiny_llama
    got = read_safetensors(cv.convert_gguf(path, tmp_path / "out") / "model.safetensors")
    q = hf["model.layers.0.self_attn.q_proj.weight"]
    k = hf["model.layers.1.self_attn.k_proj.weight"]
    np.testing.assert_array_equal(got["model.layers.0.self_attn.q_proj.weight"], bf16(q))
    np.testing.assert_array_equal(got["model.layers.1.self_attn.k_proj.weight"], bf16(k))
    # and the stored GGUF rows really were permuted (the test would be vacuous otherwise)
    assert not np.array_equal(llamacpp_permute(q, 4), q)


def test_unpermute_inverts_llamacpp_permute():
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    for heads in (1, 2, 8):
        np.testing.assert_array_equal(gf.unpermute_qk(llamacpp_permute(w, heads), heads), w)
        np.testing.assert_array_equal(gf.permute_qk(w, heads), llamacpp_permute(w, heads))
    bias = np.arange(32, dtype=np.float32)
    np.testing.assert_array_equal(gf.unpermute_qk(llamacpp_permute(bias, 4), 4), bias)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma3"])
def test_unpermuted_architectures_keep_rows_and_fix_norms(arch, tmp_path):
    hf = write_tiny_gguf(tmp_path / "m.gguf", arch)
    out = cv.convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    got = read_safetensors(out / "model.safetensors")
    assert set(got) == set(hf)
    for name, ref in hf.items():
        if arch == "gemma3" and name.endswith("norm.weight"):
            ref = (ref + np.float32(1)) - np.float32(1)  # stored as 1 + w; converted back in f32
        np.testing.assert_array_equal(got[name], bf16(ref), err_msg=name)


def test_gemma3_config(tmp_path):
    write_tiny_gguf(tmp_path / "g.gguf", "gemma3", layers=7)
    cfg = json.loads((cv.convert_gguf(tmp_path / "g.gguf", tmp_path / "out") / "config.json").read_text())
    assert cfg["model_type"] == "gemma3_text" and cfg["architectures"] == ["Gemma3ForCausalLM"]
    assert cfg["head_dim"] == 256 and cfg["query_pre_attn_scalar"] == 256
    assert cfg["sliding_window"] == 128 and cfg["sliding_window_pattern"] == 6
    assert cfg["layer_types"] == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    assert cfg["rope_local_base_freq"] == 10000.0 and cfg["rope_theta"] == 10000.0
    assert cfg["final_logit_softcapping"] is None and cfg["attn_logit_softcapping"] is None
    assert cfg["hidden_activation"] == "gelu_pytorch_tanh"
    tok_cfg = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert tok_cfg["add_bos_token"] is True and tok_cfg["bos_token"] == "<bos>" and "chat_template" not in tok_cfg


def test_qwen2_config_and_biases(tmp_path):
    write_tiny_gguf(tmp_path / "q.gguf", "qwen2")
    out = cv.convert_gguf(tmp_path / "q.gguf", tmp_path / "out")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["use_sliding_window"] is False
    assert "model.layers.1.self_attn.k_proj.bias" in read_safetensors(out / "model.safetensors")


def test_untied_output_writes_lm_head(tmp_path):
    hf = write_tiny_gguf(tmp_path / "m.gguf", "llama", tied=False)
    out = cv.convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    got = read_safetensors(out / "model.safetensors")
    np.testing.assert_array_equal(got["lm_head.weight"], bf16(hf["lm_head.weight"]))


def test_output_identical_to_embedding_is_tied(tmp_path):
    write_tiny_gguf(tmp_path / "m.gguf", "llama", identical_output=True)
    out = cv.convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    assert "lm_head.weight" not in read_safetensors(out / "model.safetensors")


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0"])
def test_quantized_tensors_are_dequantized(qtype, tmp_path):
    hf = write_tiny_gguf(tmp_path / "m.gguf", "qwen2", qtype=qtype)
    got = read_safetensors(cv.convert_gguf(tmp_path / "m.gguf", tmp_path / "out") / "model.safetensors")
    t = gguf.GGMLQuantizationType[qtype]
    name = "model.layers.0.mlp.down_proj.weight"
    expect = gguf.quants.dequantize(gguf.quants.quantize(hf[name], t), t)
    np.testing.assert_array_equal(got[name], bf16(np.asarray(expect, np.float32)))


def test_unsupported_tensor_type_fails_before_writing(tmp_path, monkeypatch):
    write_tiny_gguf(tmp_path / "m.gguf", "llama", qtype="Q8_0")
    monkeypatch.setattr(gf, "SUPPORTED_TENSOR_TYPES", ("F32",))
    with pytest.raises(ConversionError, match=r"ggml types: .*\(Q8_0\).*supported: F32"):
        cv.convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path, "out") == []


@pytest.mark.reference
def test_bf16_rounding_matches_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(10000).astype(np.float32) * 10.0 ** rng.integers(-8, 8, 10000),
                        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3.3895314e38, 1e-45, -1e-40], np.float32)])
    ours = gf.f32_to_bf16_bits(x)
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(ours, theirs)


def test_unsupported_architecture(tmp_path):
    write_tiny_gguf(tmp_path / "m.gguf", "gpt2")
    with pytest.raises(ConversionError, match=r"'gpt2' is not supported") as err:
        cv.convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    assert all(arch in str(err.value) for arch in ("llama", "qwen2", "qwen3", "gemma3"))
    assert not (tmp_path / "out").exists()


def test_unexpected_and_missing_tensors_reported_together(tmp_path):
    write_tiny_gguf(tmp_path / "m.gguf", "llama", drop_tensors=("blk.1.ffn_up.weight",),
                    extra_tensors={"blk.0.ffn_gate_exps.weight": np.zeros((2, 4, 8), np.float32)})
    with pytest.raises(ConversionError) as err:
        cv.convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    assert "blk.0.ffn_gate_exps.weight" in str(err.value) and "blk.1.ffn_up.weight" in str(err.value)


def test_rope_freqs_become_llama3_rope_scaling(tmp_path):
    dim, theta, factor, orig = 16, 10000.0, 8.0, 64
    inv = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
    factors = []
    for f in inv:  # llama.cpp's Llama 3 rule (convert_hf_to_gguf), with low=1, high=4
        wl = 2 * np.pi / f
        if wl < orig / 4:
            factors.append(1.0)
        elif wl > orig:
            factors.append(factor)
        else:
            sm = (orig / wl - 1) / 3
            factors.append(1 / ((1 - sm) / factor + sm))
    write_tiny_gguf(tmp_path / "m.gguf", "llama", extra_tensors={"rope_freqs.weight": np.array(factors, np.float32)},
                    meta={"llama.rope.scaling.original_context_length": orig})
    out = cv.convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": orig}
    assert "rope_freqs.weight" not in read_safetensors(out / "model.safetensors")


def test_linear_rope_scaling_from_metadata(tmp_path):
    write_tiny_gguf(tmp_path / "m.gguf", "gemma3", meta={"gemma3.rope.scaling.type": "linear",
                                                         "gemma3.rope.scaling.factor": 8.0})
    cfg = json.loads((cv.convert_gguf(tmp_path / "m.gguf", tmp_path / "out") / "config.json").read_text())
    assert cfg["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}


@pytest.mark.parametrize("content", [b"", b"not a gguf at all" * 10, b"GGUF\x03\x00\x00\x00" + b"\xff" * 40])
def test_damaged_or_foreign_file(content, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    with pytest.raises(ConversionError, match="GGUF|gguf"):
        cv.convert_gguf(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_truncated_file(tiny_llama, tmp_path):
    path, _ = tiny_llama
    data = path.read_bytes()
    for cut in (len(data) - 100, len(data) // 2, 64):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ConversionError, match="truncated|damaged"):
            cv.convert_gguf(bad, tmp_path / "out")
    with pytest.raises(ConversionError, match="does not exist"):
        cv.convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")


def _leftovers(parent: Path, name: str) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.")]


@pytest.mark.parametrize("exc", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_interrupted_conversion_leaves_nothing(tiny_llama, tmp_path, monkeypatch, exc):
    path, _ = tiny_llama
    real = cv_directory.write_safetensors

    def failing(target, plan, progress=None):
        real(target, plan[:3], progress)  # part of the file is written, then it dies
        raise exc

    monkeypatch.setattr(cv_directory, "write_safetensors", failing)
    with pytest.raises(type(exc)):
        cv.convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert _leftovers(tmp_path, "out") == []


def test_refuses_to_overwrite(tiny_llama, tmp_path):
    path, _ = tiny_llama
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConversionError, match="not empty.*overwrite"):
        cv.convert_gguf(path, out)
    assert (out / "notes.txt").read_text() == "mine"
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConversionError, match="is a file"):
        cv.convert_gguf(path, tmp_path / "afile")
    result = cv.convert_gguf(path, out, overwrite=True)
    assert (result / "config.json").is_file() and not (result / "notes.txt").exists()
    assert _leftovers(tmp_path, "out") == []


def test_empty_existing_dir_is_used(tiny_llama, tmp_path):
    path, _ = tiny_llama
    (tmp_path / "out").mkdir()
    seen = []
    out = cv.convert_gguf(path, tmp_path / "out", progress=lambda m, f: seen.append(f))
    assert (out / "model.safetensors").is_file()
    assert seen[-1] == 1.0 and seen == sorted(seen)


def test_byte_level_tokenizer(tiny_llama, tmp_path):
    from tokenizers import Tokenizer

    path, _ = tiny_llama
    out = cv.convert_gguf(path, tmp_path / "out")
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    text = "<|im_start|>user\n the  thing 中文 😀<|im_end|>"
    enc = tok.encode(text)
    assert enc.ids[0] == 1 and enc.ids[-1] == 2  # special tokens kept whole
    assert tok.token_to_id("Ġthe") in enc.ids
    assert tok.decode(enc.ids, skip_special_tokens=False) == text
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == CHAT_TEMPLATE and cfg["add_bos_token"] is False
    assert (cfg["bos_token"], cfg["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["bos_token_id"] == 1 and gen["eos_token_id"] == 2


def test_sentencepiece_tokenizer_adds_bos_and_byte_fallback(tmp_path):
    from tokenizers import Tokenizer

    write_tiny_gguf(tmp_path / "g.gguf", "gemma3")
    out = cv.convert_gguf(tmp_path / "g.gguf", tmp_path / "out")
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    enc = tok.encode("the the  x\n\n<start_of_turn>")
    assert enc.ids[0] == 2  # <bos>
    pieces = enc.tokens
    assert "he" in pieces and "\u2581the" in pieces and "\u2581\u2581" in pieces  # respelled space token
    assert "<0x78>" in pieces  # 'x' is not in the vocabulary: byte fallback
    assert pieces[-2:] == ["\n\n", "<start_of_turn>"]
    assert tok.decode(enc.ids, skip_special_tokens=True) == "the the  x\n\n<start_of_turn>"


def test_merges_from_vocab_orders_by_score_then_left_length():
    vocab = {"a": 0, "b": 1, "c": 2, "ab": 3, "bc": 4, "abc": 5}
    merges = gv.merges_from_vocab(vocab, {t: -i for t, i in vocab.items()})
    assert merges == [("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc")]


# ---------------------------------------------------------------------------------------------
# transformers parity on tiny files (fast: tiny models; skipped without transformers/accelerate)
# ---------------------------------------------------------------------------------------------

TOKEN_TEXTS = [
    "the thing in a theatre",
    "  leading and  double spaces\n\n\ttabs\r\n",
    "中文 العربية Русский 😀👍🏽",
    "<|im_start|>user\nhi<|im_end|> <bos><start_of_turn>x<end_of_turn>",
    "",
]


@pytest.mark.reference
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_tiny_matches_transformers_gguf_loader(arch, tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    write_tiny_gguf(tmp_path / "m.gguf", arch, qtype="Q8_0")
    out = cv.convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", dtype=torch.float32).eval()
    ours = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.tensor([[2, 5, 40, 100, 7, 260, 3]])
    with torch.no_grad():
        for p in ref.parameters():  # the converted checkpoint is bf16: round the reference the same way
            p.data = p.data.bfloat16().float()
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)
    ref_tok = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    our_tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in TOKEN_TEXTS:
        for special in (True, False):
            assert our_tok.encode(text, add_special_tokens=special).ids == \
                ref_tok(text, add_special_tokens=special).input_ids, (text, special)


# ---------------------------------------------------------------------------------------------
# Real models (slow: they download wheels unless $CPULLM_WHEELHOUSE has them)
# ---------------------------------------------------------------------------------------------

VARIED_TEXT = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n-1) + fib(n-2)\n\nprint(fib(10))  # 55\n",
    "for (int i = 0; i < 10; ++i) {\n\tprintf(\"%d\\n\", i);\n}",
    "中文测试：你好，世界！今天天气很好。",
    "العربية: مرحبا بالعالم",
    "Русский текст: Привет, мир! Ёжик.",
    "Emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 ❤️ 🇫🇷",
    "   leading spaces, double  spaces,   triple   spaces\n\n\n\nnewlines\t\ttabs \t mixed \r\n crlf   ",
    "Numbers 1234567890 3.14159 -42 1e-10 0x1F 12,345.67",
    "Café naïve résumé Ångström ß ﬁ ligature, zero\u200bwidth, nbsp\u00a0here",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<bos><start_of_turn>user\nhi<end_of_turn>",
    "I'm you're we'll they'd IT'S DON'T",
    "", " ", "\n",
]
REAL_MODELS = ["smollm2-135m-instruct", "gemma-3-270m", "qwen2.5-coder-0.5b-instruct"]


@pytest.mark.slow
@pytest.mark.parametrize("name", REAL_MODELS)
def test_real_model_matches_transformers(name):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF: pip install accelerate")
    import torch
    from transformers import AutoModelForCausalLM
    from realmodels import real_gguf_path, real_model_dir

    model_dir, gguf_path = real_model_dir(name), real_gguf_path(name)
    ours = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                               dtype=torch.float32).eval()
    ids = torch.tensor([[2, 651, 6037, 576, 9625, 603, 100, 200, 300, 42, 7, 1000]])
    with torch.no_grad():
        ref_f32 = ref(ids).logits
        ours_sd, ref_sd = ours.state_dict(), ref.state_dict()
        assert set(ours_sd) == set(ref_sd)
        for p in ref.parameters():  # the checkpoint is bf16: round the reference weights the same way
            p.data = p.data.bfloat16().float()
        for k in ours_sd:  # renaming, q/k un-permutation and norm offsets are all exact
            assert torch.equal(ours_sd[k], ref.state_dict()[k]), k
        ref_bf16 = ref(ids).logits
        got = ours(ids).logits
    scale = ref_bf16.abs().max()
    assert ((got - ref_bf16).abs().max() / scale).item() < 1e-5
    # against the un-rounded f32 GGUF model only bf16 weight rounding separates them
    assert ((got - ref_f32).abs().max() / ref_f32.abs().max()).item() < 3e-2
    assert (got.argmax(-1) == ref_f32.argmax(-1)).float().mean().item() >= 0.9


@pytest.mark.slow
@pytest.mark.parametrize("name", REAL_MODELS)
def test_real_tokenizer_matches_transformers(name):
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer
    from realmodels import real_gguf_path, real_model_dir

    model_dir, gguf_path = real_model_dir(name), real_gguf_path(name)
    ref = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    ours = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    hf_ours = AutoTokenizer.from_pretrained(str(model_dir))  # our tokenizer_config loads in transformers
    for text in VARIED_TEXT + ["\n".join(VARIED_TEXT)]:
        for special in (True, False):
            want = ref(text, add_special_tokens=special).input_ids
            assert ours.encode(text, add_special_tokens=special).ids == want, (text, special)
            assert hf_ours(text, add_special_tokens=special).input_ids == want, (text, special)
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids)
    if ref.chat_template:
        msgs = [{"role": "user", "content": "Write a haiku about CPUs."}]
        assert hf_ours.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == \
            ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)


# ---------------------------------------------------------------------------------------------
# GGUF architectures come from the plugins (hook cpullm_gguf_architectures)
# ---------------------------------------------------------------------------------------------

class _TinyArchPlugin:
    """An out-of-tree plugin making the GGUF architecture "tinyarch" (llama's layout without the
    q/k permutation) convertible, into a checkpoint of the installed llama family."""

    @staticmethod
    @__import__("cpullm.hookspecs", fromlist=["hookimpl"]).hookimpl
    def cpullm_gguf_architectures():
        from cpullm.loading.family import GGUFArch

        return [GGUFArch(
            name="tinyarch", model_type="llama", architectures=("LlamaForCausalLM",),
            layer_names=gf.DENSE_LAYER_NAMES, required_layer_leaves=tuple(gf.DENSE_LAYER_NAMES),
            head_dim_keys=("attention.key_length",),
            config_extras=lambda meta, hp, names: {"hidden_act": "silu", "tinyarch_layers": hp["num_hidden_layers"]},
            pre_tokenizer_splits={"tinyarch-pre": r"\s+|\S+"}, end_of_turn_tokens=("<|im_end|>",))]


@pytest.fixture
def tiny_arch_plugin():
    from cpullm.loading import plugins

    plugins.register_for_tests(_TinyArchPlugin)
    plugins.discover(refresh=True)
    yield _TinyArchPlugin
    plugins.unregister_for_tests(_TinyArchPlugin)
    plugins.discover(refresh=True)


def test_a_plugins_hook_is_what_makes_an_architecture_convertible(tmp_path, request):
    hf = write_tiny_gguf(tmp_path / "m.gguf", "tinyarch")
    assert "tinyarch" not in gf.supported_architectures()
    with pytest.raises(ConversionError, match=r"'tinyarch' is not supported.*install the cpullm plugin"):
        cv.convert_gguf(tmp_path / "m.gguf", tmp_path / "out")

    request.getfixturevalue("tiny_arch_plugin")
    assert gf.arch_spec("tinyarch").plugin == "_TinyArchPlugin"
    out = cv.convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["tinyarch_layers"] == 2   # the plugin's config_extras
    got = read_safetensors(out / "model.safetensors")
    for name, ref in hf.items():   # no q/k un-permutation: this plugin's layout says so
        np.testing.assert_array_equal(got[name], bf16(ref), err_msg=name)
    assert "tinyarch-pre" in gf.PRE_TOKENIZER_SPLITS


def test_a_plugin_redefining_an_architecture_is_reported_not_used(tiny_arch_plugin):
    import attrs

    from cpullm.loading import plugins
    from cpullm.hookspecs import hookimpl

    taken = attrs.evolve(gf.arch_spec("tinyarch"), plugin=None)

    class Clash:
        @staticmethod
        @hookimpl
        def cpullm_gguf_architectures():
            return [taken]

    plugins.register_for_tests(Clash)
    try:
        reg = plugins.discover(refresh=True)
        info = next(p for p in reg.plugins if p.name == "Clash")
        assert "GGUF architecture name 'tinyarch' is already registered" in info.error
        assert reg.gguf_architectures["tinyarch"].plugin == "_TinyArchPlugin"
    finally:
        plugins.unregister_for_tests(Clash)


def test_a_failed_gguf_write_leaves_the_file_there_as_it_was(tmp_path):
    """write_gguf writes a temporary file and replaces the target only when it is whole."""
    from cpullm.convert.gguf_writer import write_gguf
    path = tmp_path / "model.gguf"
    write_tiny_gguf(path)
    before = path.read_bytes()
    with pytest.raises(ConversionError, match="no GGUF name for 1 tensors"):
        write_gguf(path, "llama", {"head_count": 4}, {"model.no_such.weight": np.zeros((4, 4), np.float32)},
                   layout=_layout("llama"))
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]
