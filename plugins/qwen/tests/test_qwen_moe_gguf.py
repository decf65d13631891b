"""Qwen3-MoE from GGUF files laid out as llama.cpp writes them (architecture ``qwen3moe``: routed
experts stacked in 3-D ``blk.N.ffn_{gate,up,down}_exps.weight`` tensors beside the router
``ffn_gate_inp``): a tiny random transformers checkpoint written in-process by cpullm's GGUF writer
as F32, F16 and Q8_0, loaded, and compared with the same checkpoint from safetensors and with
transformers (F32 / F16: f32 parity and greedy identical; Q8_0 run as it is: close)."""
import numpy as np
import pytest

pytestmark = pytest.mark.reference   # needs torch and transformers

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch", reason="torch is a test dependency (pip install -e '.[test]')")
transformers = pytest.importorskip("transformers", reason="transformers is a test dependency")

import cpullm  # noqa: E402
from cpullm import testing  # noqa: E402
from cpullm.convert.gguf_writer import write_gguf  # noqa: E402
from cpullm.errors import ConversionError, WeightMapError  # noqa: E402
from cpullm.loading.tensors import TensorStore  # noqa: E402
from cpullm_kernels.program import moe as M  # noqa: E402
from cpullm_kernels.program.program_table import WEIGHT_BLOCKS, WEIGHT_Q8  # noqa: E402
from cpullm_qwen.tiny_configs import QWEN3_MOE  # noqa: E402
from hf_reference import hf_greedy, hf_logits, hf_model, save_tiny  # noqa: E402
from test_convert import BPE_MERGES, CHAT_TEMPLATE, byte_level_vocab  # noqa: E402

IDS = [256] + [int(x) for x in np.random.default_rng(5).integers(0, 255, 31)]   # 32 tokens
PROMPT = IDS[:8]
# llama.cpp's qwen3moe has no dense layers: every layer routed
CONFIG = dict(QWEN3_MOE, mlp_only_layers=[])


def _fields(cfg: dict) -> dict:
    tokens, types = byte_level_vocab()
    return {"block_count": cfg["num_hidden_layers"], "context_length": 4096,
            "embedding_length": cfg["hidden_size"], "feed_forward_length": cfg["intermediate_size"],
            "head_count": cfg["num_attention_heads"], "head_count_kv": cfg["num_key_value_heads"],
            "key_length": cfg["head_dim"], "value_length": cfg["head_dim"],
            "layer_norm_rms_eps": cfg["rms_norm_eps"], "rope_freq_base": cfg["rope_parameters"]["rope_theta"],
            "expert_count": cfg["num_experts"], "expert_used_count": cfg["num_experts_per_tok"],
            "expert_feed_forward_length": cfg["moe_intermediate_size"],
            "tokenizer_model": "gpt2", "tokenizer_pre": "qwen2", "token_list": tokens, "token_types": types,
            "token_merges": BPE_MERGES, "bos_token_id": 256, "eos_token_id": 257, "add_bos_token": False,
            "chat_template": CHAT_TEMPLATE}


def _write(d, path, qtype, fields=None, drop=()):
    store = TensorStore(d)
    tensors = {n: store.get(n) for n in store.names() if n not in drop}
    return write_gguf(path, "qwen3moe", fields or _fields(CONFIG), tensors, qtype=qtype)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    d = tmp_path_factory.mktemp("qwen3moe")
    cfg = Qwen3MoeConfig(**{k: v for k, v in CONFIG.items() if k not in ("model_type", "architectures")})
    save_tiny(cfg, d, seed=33, model_class=Qwen3MoeForCausalLM)
    ref = hf_model(d, Qwen3MoeForCausalLM)
    files = {q: _write(d, d.parent / f"qwen3moe-{q}.gguf", q) for q in ("F32", "F16", "Q8_0")}
    return d, files, hf_logits(ref, IDS), hf_greedy(ref, PROMPT, 24)


def _expert_kinds(m) -> set:
    tables = [call.table for call in m.forward.executor.moe.values()]
    assert len(tables) == m.config["num_hidden_layers"]
    return {int(k) for t in tables for k in t[:, [M.TABLE_GATE, M.TABLE_UP, M.TABLE_DOWN]].ravel()}


def _rel(got, ref):
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def test_experts_are_stacked_3d_tensors_as_llama_cpp_writes_them(checkpoint):
    from cpullm.loading.gguf_file import open_gguf
    _, files, _, _ = checkpoint
    shapes = {t.name: t.shape for t in open_gguf(files["Q8_0"]).tensors}
    E, I, H = CONFIG["num_experts"], CONFIG["moe_intermediate_size"], CONFIG["hidden_size"]
    assert shapes["blk.0.ffn_gate_exps.weight"] == (H, I, E)        # ggml ne, innermost first
    assert shapes["blk.0.ffn_down_exps.weight"] == (I, H, E)
    assert shapes["blk.2.ffn_gate_inp.weight"] == (H, E)
    assert not any(".experts." in n or "ffn_gate.weight" in n for n in shapes)


@pytest.mark.parametrize("qtype", ["F32", "F16"])
def test_float_gguf_matches_safetensors_and_transformers(checkpoint, qtype):
    d, files, ref_logits, ref_tokens = checkpoint
    m = cpullm.load(files[qtype], quant="f32", use_cache=False)
    cfg = m.config
    assert (cfg["model_type"], cfg["num_experts"], cfg["num_experts_per_tok"], cfg["norm_topk_prob"]) == \
        ("qwen3_moe", 8, 2, True)
    got = m.logits(IDS)
    assert _rel(got, ref_logits) <= 1e-3
    if qtype == "F32":          # the bf16 checkpoint's values exactly: the same program's numbers
        ours = cpullm.load(d, quant="f32", use_cache=False).logits(IDS)
        np.testing.assert_allclose(got, ours, rtol=0, atol=1e-5 * np.abs(ours).max())
    testing.check_greedy(m, PROMPT, ref_tokens)


def test_q8_0_experts_run_as_they_are(checkpoint):
    d, files, ref_logits, _ = checkpoint
    m = cpullm.load(files["Q8_0"], use_cache=False)
    assert m.quant == "gguf"
    formats = m.info()["weight_formats"]
    assert formats.get("Q8_0", 0) > 0 and "int8" not in formats, formats
    # Q8_0 blocks run as the q8 panels they are exactly (int8 quants, one scale per 32)
    assert _expert_kinds(m) == {WEIGHT_Q8}
    f32 = cpullm.load(files["Q8_0"], quant="f32", use_cache=False).logits(IDS)   # Q8_0 dequantized
    assert _rel(m.logits(IDS), f32) < 0.03
    f = testing.fidelity(f32, ref_logits)
    assert f["kl"] <= 0.01, f


def test_missing_expert_tensor_is_refused_naming_it(checkpoint, tmp_path):
    d, _, _, _ = checkpoint
    drop = tuple(f"model.layers.1.mlp.experts.{e}.up_proj.weight" for e in range(CONFIG["num_experts"]))
    path = _write(d, tmp_path / "broken.gguf", "F32", drop=drop)
    with pytest.raises(ConversionError, match="blk.1.ffn_up_exps"):
        cpullm.load(path, quant="f32", use_cache=False)


def test_expert_count_that_disagrees_with_the_tensors_is_refused(checkpoint, tmp_path):
    d, _, _, _ = checkpoint
    path = _write(d, tmp_path / "lying.gguf", "F32", fields=dict(_fields(CONFIG), expert_count=16))
    with pytest.raises(WeightMapError, match=r"experts\.8\.gate_proj.*expected \(16, 64\), found \(8, 64\)"):
        cpullm.load(path, quant="f32", use_cache=False)


# K-quant experts need rows of whole 256-weight super-blocks: hidden and expert width 256
KQ_CONFIG = dict(CONFIG, hidden_size=256, moe_intermediate_size=256, intermediate_size=256, num_hidden_layers=2,
                 head_dim=64, num_experts=4)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q5_0"])
def test_block_experts_run_as_they_are(qtype, tmp_path, monkeypatch):
    """Each expert's slice of a 3-D block tensor runs in its format (Q4_K / Q6_K repacked into
    panels, others row by row), against the f32 run of the same file (every tensor dequantized)."""
    from test_gguf_run import _quantize
    monkeypatch.setattr(gguf.quants, "quantize", _quantize)      # the K-quants gguf lacks
    rng = np.random.default_rng(7)
    c = KQ_CONFIG
    H, I, E, hd = c["hidden_size"], c["moe_intermediate_size"], c["num_experts"], c["head_dim"]
    nq, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    r = lambda *s: (rng.standard_normal(s) * 0.05).astype(np.float32)          # noqa: E731
    w = {"model.embed_tokens.weight": r(384, H) * 20, "model.norm.weight": 1 + r(H), "lm_head.weight": r(384, H)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": 1 + r(H), p + "post_attention_layernorm.weight": 1 + r(H),
                  p + "self_attn.q_proj.weight": r(nq * hd, H), p + "self_attn.k_proj.weight": r(nkv * hd, H),
                  p + "self_attn.v_proj.weight": r(nkv * hd, H), p + "self_attn.o_proj.weight": r(H, nq * hd),
                  p + "self_attn.q_norm.weight": 1 + r(hd), p + "self_attn.k_norm.weight": 1 + r(hd),
                  p + "mlp.gate.weight": r(E, H) * 20})
        for e in range(E):
            w.update({p + f"mlp.experts.{e}.gate_proj.weight": r(I, H), p + f"mlp.experts.{e}.up_proj.weight": r(I, H),
                      p + f"mlp.experts.{e}.down_proj.weight": r(H, I)})
    path = write_gguf(tmp_path / f"kq-{qtype}.gguf", "qwen3moe", _fields(c), w, qtype=qtype)
    m = cpullm.load(path, use_cache=False)
    assert m.info()["weight_formats"].get(qtype, 0) > 0
    assert _expert_kinds(m) == {WEIGHT_BLOCKS}
    ref = cpullm.load(path, quant="f32", use_cache=False).logits(IDS)
    assert _rel(m.logits(IDS), ref) < 0.03
    s = cpullm.load(path, use_cache=False)
    dec = np.stack([s.forward.step([slot], [t])[0][0].copy() for slot in [s.forward.new_slot()] for t in IDS])
    assert _rel(dec, ref) < 0.03


def _tensors(d) -> dict:
    """Every tensor of the checkpoint directory d, by its transformers name."""
    store = TensorStore(d)
    return {n: store.get(n) for n in store.names()}


def test_expert_tensor_that_is_not_3d_is_refused(checkpoint, tmp_path):
    d, _, _, _ = checkpoint
    tensors = _tensors(d)
    flat = np.zeros((CONFIG["moe_intermediate_size"] * CONFIG["num_experts"], CONFIG["hidden_size"]), np.float32)
    path = write_gguf(tmp_path / "flat.gguf", "qwen3moe", _fields(CONFIG), tensors, skip=("blk.0.ffn_gate_exps.weight",),
                      extra_tensors={"blk.0.ffn_gate_exps.weight": flat})
    with pytest.raises(ConversionError, match=r"blk\.0\.ffn_gate_exps\.weight.*3-D"):
        cpullm.load(path, quant="f32", use_cache=False)


def test_expert_tensors_stacking_different_counts_are_refused(checkpoint, tmp_path):
    d, _, _, _ = checkpoint
    tensors = _tensors(d)
    fewer = np.zeros((CONFIG["num_experts"] - 1, CONFIG["moe_intermediate_size"], CONFIG["hidden_size"]), np.float32)
    path = write_gguf(tmp_path / "fewer.gguf", "qwen3moe", _fields(CONFIG), tensors, skip=("blk.0.ffn_gate_exps.weight",),
                      extra_tensors={"blk.0.ffn_gate_exps.weight": fewer})
    with pytest.raises(ConversionError, match=rf"ffn_gate_exps\.weight'? stacks {CONFIG['num_experts'] - 1} experts but"):
        cpullm.load(path, quant="f32", use_cache=False)


def test_experts_of_different_shapes_are_refused_and_nothing_is_written(checkpoint, tmp_path):
    d, _, _, _ = checkpoint
    tensors = _tensors(d)
    name = "model.layers.0.mlp.experts.1.up_proj.weight"
    tensors[name] = tensors[name][:-1]
    with pytest.raises(ConversionError, match=r"experts of blk\.0\.ffn_up_exps\.weight differ in shape"):
        write_gguf(tmp_path / "ragged.gguf", "qwen3moe", _fields(CONFIG), tensors)
    assert list(tmp_path.iterdir()) == []
