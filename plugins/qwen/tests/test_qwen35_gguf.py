"""Qwen3.5 from GGUF files laid out as llama.cpp's converter writes them (architectures ``qwen35``
and ``qwen35moe``: hybrid Gated DeltaNet / gated-attention layers, the DeltaNet tensors under
llama.cpp's names with its V-head reorder, ``ssm_a = -exp(A_log)``, the squeezed conv kernel and
``1 + w`` norms; cpullm_qwen/gguf_qwen35.py): tiny random transformers checkpoints written
in-process by cpullm's GGUF writer as F32, F16 and Q8_0, loaded, and compared with transformers
(F32 / F16: f32 parity and greedy identical; Q8_0 run as it is stored: close to its own
dequantized run, greedy identical to it, small mean KL to transformers). Damaged files are refused
with a ConversionError naming the tensor."""
import numpy as np
import pytest

pytestmark = pytest.mark.reference   # needs torch and transformers

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch", reason="torch is a test dependency (pip install -e '.[test]')")
transformers = pytest.importorskip("transformers", reason="transformers is a test dependency")

import cpullm  # noqa: E402
from cpullm import testing  # noqa: E402
from cpullm.convert.gguf_writer import write_gguf  # noqa: E402
from cpullm.errors import ConversionError  # noqa: E402
from cpullm.loading.gguf_file import open_gguf  # noqa: E402
from cpullm.loading.tensors import TensorStore  # noqa: E402
from cpullm_qwen.gguf_qwen35 import grouped_from_tiled  # noqa: E402
from cpullm_qwen.tiny_configs import QWEN3_5_MOE_TEXT, QWEN3_5_TEXT  # noqa: E402
from hf_reference import hf_greedy, hf_logits, hf_model  # noqa: E402
from test_convert import BPE_MERGES, CHAT_TEMPLATE, byte_level_vocab  # noqa: E402

IDS = [256] + [int(x) for x in np.random.default_rng(5).integers(0, 255, 31)]   # 32 tokens
PROMPT = IDS[:8]
ARCHS = {"qwen35": QWEN3_5_TEXT, "qwen35moe": QWEN3_5_MOE_TEXT}


def _fields(cfg: dict, n_blocks: int | None = None) -> dict:
    """The header llama.cpp's converter writes for the config (Qwen3NextModel's ssm.* keys)."""
    tokens, types = byte_level_vocab()
    nv, dv = cfg["linear_num_value_heads"], cfg["linear_value_head_dim"]
    out = {"block_count": n_blocks or cfg["num_hidden_layers"], "context_length": 4096,
           "embedding_length": cfg["hidden_size"],
           "head_count": cfg["num_attention_heads"], "head_count_kv": cfg["num_key_value_heads"],
           "key_length": cfg["head_dim"], "value_length": cfg["head_dim"],
           "layer_norm_rms_eps": cfg["rms_norm_eps"], "rope_freq_base": cfg["rope_parameters"]["rope_theta"],
           "rope_dimension_count": int(cfg["head_dim"] * cfg["rope_parameters"]["partial_rotary_factor"]),
           "ssm_conv_kernel": cfg["linear_conv_kernel_dim"], "ssm_state_size": cfg["linear_key_head_dim"],
           "ssm_group_count": cfg["linear_num_key_heads"], "ssm_time_step_rank": nv, "ssm_inner_size": nv * dv,
           "full_attention_interval": 4,
           "tokenizer_model": "gpt2", "tokenizer_pre": "qwen2", "token_list": tokens, "token_types": types,
           "token_merges": BPE_MERGES, "bos_token_id": 256, "eos_token_id": 257, "add_bos_token": False,
           "chat_template": CHAT_TEMPLATE}
    if "num_experts" in cfg:
        out.update(expert_count=cfg["num_experts"], expert_used_count=cfg["num_experts_per_tok"],
                   expert_feed_forward_length=cfg["moe_intermediate_size"],
                   expert_shared_feed_forward_length=cfg["shared_expert_intermediate_size"])
    else:
        out["feed_forward_length"] = cfg["intermediate_size"]
    return out


def _recurrent(arch: str, cfg: dict, extra: int = 0) -> dict:
    return {f"{arch}.attention.recurrent_layers": [t == "linear_attention" for t in cfg["layer_types"]]
            + [False] * extra}


def _tensors(d) -> dict:
    store = TensorStore(d)
    return {n: store.get(n) for n in store.names()}


def _write(arch, tensors, path, qtype="F32", **kw):
    cfg = ARCHS[arch]
    fields = kw.pop("fields", None) or _fields(cfg)
    metadata = kw.pop("metadata", None) or _recurrent(arch, cfg)
    return write_gguf(path, arch, fields, tensors, qtype=qtype, metadata=metadata, **kw)


@pytest.fixture(scope="module", params=list(ARCHS))
def checkpoint(request, tmp_path_factory):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
    arch = request.param
    model_class = Qwen3_5ForCausalLM if arch == "qwen35" else Qwen3_5MoeForCausalLM
    d = tmp_path_factory.mktemp(arch)
    # the checkpoints of benchmarks/results/2026-12-06-qwen35-gguf.md (converted there by llama.cpp)
    testing.make_random_checkpoint(ARCHS[arch], d, seed=1 if arch == "qwen35" else 2)
    ref = hf_model(d, model_class)
    tensors = _tensors(d)
    files = {q: _write(arch, tensors, d.parent / f"{arch}-{q}.gguf", q) for q in ("F32", "F16", "Q8_0")}
    return arch, tensors, files, hf_logits(ref, IDS), hf_greedy(ref, PROMPT, 24)


def _rel(got, ref):
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def test_file_is_laid_out_as_llama_cpp_writes_it(checkpoint):
    """Names, shapes (ggml ne) and the transforms of llama.cpp's converter, checked on the F32 file."""
    arch, tensors, files, _, _ = checkpoint
    c = ARCHS[arch]
    H, nk, dk, nv, dv, K = (c["hidden_size"], c["linear_num_key_heads"], c["linear_key_head_dim"],
                            c["linear_num_value_heads"], c["linear_value_head_dim"], c["linear_conv_kernel_dim"])
    conv_dim = 2 * nk * dk + nv * dv
    stored = {t.name: t for t in open_gguf(files["F32"]).tensors}
    shapes = {n: t.shape for n, t in stored.items()}
    assert shapes["blk.0.attn_qkv.weight"] == (H, conv_dim)
    assert shapes["blk.0.ssm_conv1d.weight"] == (K, conv_dim)          # (C, 1, K) squeezed
    assert shapes["blk.0.ssm_a"] == (nv,) and shapes["blk.0.ssm_dt.bias"] == (nv,)
    assert shapes["blk.0.ssm_out.weight"] == (nv * dv, H)
    assert "blk.3.attn_q.weight" in shapes and "blk.3.ssm_a" not in shapes and "blk.0.attn_q.weight" not in shapes
    assert "blk.0.post_attention_norm.weight" in shapes
    L = "model.layers.0."
    heads = grouped_from_tiled(nk, nv, 1)                      # transformers head h is stored at heads[h]
    a = stored["blk.0.ssm_a"].data
    np.testing.assert_allclose(a[heads], -np.exp(tensors[L + "linear_attn.A_log"]), rtol=1e-6)
    z = stored["blk.0.attn_gate.weight"].data
    np.testing.assert_array_equal(z[grouped_from_tiled(nk, nv, dv)], tensors[L + "linear_attn.in_proj_z.weight"])
    np.testing.assert_array_equal(stored["blk.0.attn_norm.weight"].data,
                                  tensors[L + "input_layernorm.weight"] + np.float32(1))
    np.testing.assert_array_equal(stored["blk.0.ssm_norm.weight"].data, tensors[L + "linear_attn.norm.weight"])


@pytest.mark.parametrize("qtype", ["F32", "F16"])
def test_float_gguf_matches_transformers(checkpoint, qtype):
    arch, _, files, ref_logits, ref_tokens = checkpoint
    m = cpullm.load(files[qtype], quant="f32", use_cache=False)
    assert m.config["model_type"] == ARCHS[arch]["model_type"]
    assert m.config["layer_types"] == ARCHS[arch]["layer_types"]
    assert _rel(m.logits(IDS), ref_logits) <= 1e-3
    testing.check_greedy(m, PROMPT, ref_tokens)


def test_q8_0_runs_as_stored(checkpoint):
    arch, _, files, ref_logits, _ = checkpoint
    m = cpullm.load(files["Q8_0"], use_cache=False)
    assert m.quant == "gguf"
    formats = m.info()["weight_formats"]
    assert formats.get("Q8_0", 0) > 0, formats
    dequantized = cpullm.load(files["Q8_0"], quant="f32", use_cache=False)
    f32 = dequantized.logits(IDS)
    got = m.logits(IDS)
    # The as-stored run also rounds activations to 8 bits (the q8 GEMM); on these tiny random
    # models that moves near-tied routing choices (top 4 of 8), so the bounds are on the mean.
    assert testing.fidelity(got, f32)["kl"] <= 0.01
    # greedy equal to the file's own values run in f32
    testing.check_greedy(m, PROMPT, dequantized.generate_ids(PROMPT, max_new_tokens=24, temperature=0.0,
                                                              ignore_eos=True))
    f = testing.fidelity(f32, ref_logits)
    assert f["kl"] <= 0.03, f


def test_reordered_q8_0_blocks_hold_the_dequantized_matrix(checkpoint):
    """Rows (and whole-block columns) llama.cpp reordered are moved as stored blocks: each matrix
    the runtime runs as Q8_0 dequantizes to exactly the transformers-order tensor the f32 path
    reads; a reorder inside blocks (ssm_out's 16-wide heads here) falls back to the float path."""
    from cpullm.loading.gguf_model import GGUFStore
    from cpullm_kernels.rows.gguf_blocks import FORMATS
    from cpullm_kernels.tiles.kquant_gemm import dequantize
    arch, _, files, _, _ = checkpoint
    store = GGUFStore(files["Q8_0"])
    L = "model.layers.0.linear_attn."
    for name in (L + "in_proj_qkv.weight", L + "in_proj_z.weight", L + "in_proj_a.weight",
                 "model.layers.3.self_attn.q_proj.weight"):
        fmt, data = store.blocks(name)
        K = store.shape(name)[1]
        np.testing.assert_array_equal(dequantize(FORMATS[fmt], data, K), store.get(name))
    assert store.blocks(L + "out_proj.weight") is None


def test_missing_linear_attention_tensor_is_refused_naming_it(checkpoint, tmp_path):
    arch, tensors, _, _, _ = checkpoint
    path = _write(arch, tensors, tmp_path / "missing.gguf", skip=("blk.1.ssm_a",))
    with pytest.raises(ConversionError, match=r"missing tensors: blk\.1\.ssm_a"):
        cpullm.load(path, quant="f32", use_cache=False)


def test_misshapen_tensor_is_refused_naming_it(checkpoint, tmp_path):
    arch, tensors, _, _, _ = checkpoint
    c = ARCHS[arch]
    short = np.zeros((2 * c["linear_num_key_heads"] * c["linear_key_head_dim"], c["hidden_size"]), np.float32)
    path = _write(arch, tensors, tmp_path / "short.gguf", skip=("blk.0.attn_qkv.weight",),
                  extra_tensors={"blk.0.attn_qkv.weight": short})
    with pytest.raises(ConversionError, match=r"blk\.0\.attn_qkv\.weight has shape \[64, 64\], expected \[128, 64\]"):
        cpullm.load(path, quant="f32", use_cache=False)


def test_positive_ssm_a_is_refused(checkpoint, tmp_path):
    arch, tensors, _, _, _ = checkpoint
    nv = ARCHS[arch]["linear_num_value_heads"]
    path = _write(arch, tensors, tmp_path / "ssm_a.gguf", skip=("blk.0.ssm_a",),
                  extra_tensors={"blk.0.ssm_a": np.ones(nv, np.float32)})
    with pytest.raises(ConversionError, match="ssm_a"):
        cpullm.load(path, quant="f32", use_cache=False).logits(IDS[:2])


def test_multi_token_prediction_block_is_left_out(checkpoint, tmp_path):
    """The converter's default appends the MTP block (nextn_predict_layers): not run, not refused."""
    arch, tensors, files, _, _ = checkpoint
    c = ARCHS[arch]
    n, H = c["num_hidden_layers"], c["hidden_size"]
    fields = dict(_fields(c, n_blocks=n + 1), nextn_predict_layers=1)
    extra = {f"blk.{n}.nextn.eh_proj.weight": np.zeros((H, 2 * H), np.float32),
             f"blk.{n}.attn_norm.weight": np.ones(H, np.float32)}
    path = _write(arch, tensors, tmp_path / "mtp.gguf", fields=fields, metadata=_recurrent(arch, c, extra=1),
                  extra_tensors=extra)
    m = cpullm.load(path, quant="f32", use_cache=False)
    assert m.config["num_hidden_layers"] == n
    ref = cpullm.load(files["F32"], quant="f32", use_cache=False)
    np.testing.assert_array_equal(m.logits(IDS[:8]), ref.logits(IDS[:8]))
