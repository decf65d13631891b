"""The plugin author's tests: the conformance kit on tiny GPT-NeoX checkpoints saved by
transformers, against transformers' own logits and greedy tokens."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the reference is transformers (pip install torch transformers)")
transformers = pytest.importorskip("transformers", reason="the reference is transformers")

from cpullm.plugin import testing  # noqa: E402

BASE = dict(vocab_size=272, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=160, max_position_embeddings=512, layer_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            attention_bias=True, tie_word_embeddings=False, bos_token_id=0, eos_token_id=2)
CONFIGS = {"parallel": dict(BASE, use_parallel_residual=True),
           "sequential": dict(BASE, use_parallel_residual=False)}
IDS = [int(x) for x in np.random.default_rng(11).integers(0, 255, 40)]


def _save(config: dict, out_dir) -> None:
    """A random transformers GPT-NeoX in bf16 (weights large enough that logits are far from
    ties, LayerNorm weights and biases spread around 1 and 0) and a byte-level tokenizer."""
    g = torch.Generator().manual_seed(1)
    model = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if (p.dim() == 1 and "layernorm" in name and name.endswith("weight")) else 0.0
            base = 1.0 if name.endswith("final_layer_norm.weight") else base
            p.copy_(base + 0.15 * torch.randn(p.shape, generator=g))
    model.to(torch.bfloat16).save_pretrained(out_dir)
    testing._write_byte_tokenizer(out_dir)


def _reference(model_dir, ids):
    model = transformers.GPTNeoXForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids]), use_cache=False).logits[0].numpy()
        out = model.generate(torch.tensor([ids[:8]]), max_new_tokens=12, min_new_tokens=12,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
    return logits, out[0, 8:].tolist()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_conformance(name, tmp_path):
    _save(CONFIGS[name], tmp_path)
    logits, tokens = _reference(tmp_path, IDS)
    report = testing.run_conformance(tmp_path, IDS, reference_logits=logits, reference_tokens=tokens,
                                     greedy_prompt=IDS[:8], family="gpt_neox")
    assert report["parity_err"] <= testing.F32_TOLERANCE
    assert report["plugin_ops"]["checked"]["neox.gelu_erf"]["max_rel_err"] <= testing.F32_TOLERANCE
    assert report["notes"] == []
