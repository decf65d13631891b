"""The plugin author's tests: the conformance kit on tiny GPT-2 checkpoints saved by transformers,
against transformers' own logits and greedy tokens; the Conv1D matrices quantize under INT8."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the reference is transformers (pip install torch transformers)")
transformers = pytest.importorskip("transformers", reason="the reference is transformers")

from cpullm.plugin import testing  # noqa: E402

BASE = dict(vocab_size=272, n_positions=64, n_embd=64, n_layer=2, n_head=4, layer_norm_epsilon=1e-5,
            activation_function="gelu_new", bos_token_id=0, eos_token_id=2, tie_word_embeddings=True)
CONFIGS = {"gpt2": BASE,
           "inner_relu_untied": dict(BASE, n_inner=96, activation_function="relu", tie_word_embeddings=False,
                                     scale_attn_by_inverse_layer_idx=True)}
IDS = [int(x) for x in np.random.default_rng(12).integers(0, 255, 40)]


def _save(config: dict, out_dir) -> None:
    """A random transformers GPT-2 in bf16 (weights large enough that logits are far from ties,
    LayerNorm weights around 1) and a byte-level tokenizer."""
    g = torch.Generator().manual_seed(2)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if (p.dim() == 1 and ".ln_" in name and name.endswith("weight")) else 0.0
            p.copy_(base + 0.15 * torch.randn(p.shape, generator=g))
    model.to(torch.bfloat16).save_pretrained(out_dir)
    testing._write_byte_tokenizer(out_dir)


def _reference(model_dir, ids):
    model = transformers.GPT2LMHeadModel.from_pretrained(str(model_dir), dtype=torch.float32,
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
                                     greedy_prompt=IDS[:8], family="gpt2")
    assert report["parity_err"] <= testing.F32_TOLERANCE
    # every Conv1D matrix is a LINEAR: under INT8 and 4-bit only norms, biases and the position
    # table stay float32 (16 % and 21 % of this tiny model's bytes; over 90 % were the matrices float32)
    assert max(report["float32_share"].values()) < testing.FLOAT32_SHARE_NOTE, report["float32_share"]
    assert report["context_limit"]["limit"] == CONFIGS[name]["n_positions"]
    assert report["notes"] == []
    return report
