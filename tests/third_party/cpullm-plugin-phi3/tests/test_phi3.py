"""The plugin author's tests: the conformance kit on tiny Phi-3 checkpoints saved by transformers,
against transformers' own logits (f32) and greedy tokens; longrope on both sides of the original
context."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the reference is transformers (pip install torch transformers)")
transformers = pytest.importorskip("transformers", reason="the reference is transformers")

import cpullm  # noqa: E402
from cpullm.plugin import testing  # noqa: E402

HEAD_DIM, ORIGINAL = 16, 32
BASE = dict(vocab_size=272, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=512,
            tie_word_embeddings=False, bos_token_id=0, eos_token_id=2, pad_token_id=0)


def _longrope(partial: float) -> dict:
    half = int(HEAD_DIM * partial) // 2
    rng = np.random.default_rng(4)
    return dict(BASE, max_position_embeddings=4 * ORIGINAL, original_max_position_embeddings=ORIGINAL,
                rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": partial,
                                 "original_max_position_embeddings": ORIGINAL,
                                 "short_factor": [float(x) for x in 1 + rng.random(half)],
                                 "long_factor": [float(x) for x in 2 + 6 * rng.random(half)]})


CONFIGS = {
    "longrope": _longrope(1.0),                                            # Phi-3-mini-128k
    "longrope_partial": _longrope(0.75),                                   # Phi-4-mini
    "window": dict(BASE, sliding_window=8,                                 # Phi-3-mini-4k
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}
IDS = [int(x) for x in np.random.default_rng(12).integers(0, 255, 48)]     # longer than ORIGINAL


def _save(config: dict, out_dir) -> None:
    """A random transformers Phi-3 in bf16 (RMSNorm weights around 1) and a byte-level tokenizer."""
    g = torch.Generator().manual_seed(2)
    model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.15 * torch.randn(p.shape, generator=g))
    model.to(torch.bfloat16).save_pretrained(out_dir)
    testing._write_byte_tokenizer(out_dir)


def _hf(model_dir):
    return transformers.Phi3ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                        attn_implementation="eager").eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0].numpy()


def _greedy(model, ids, n: int) -> list[int]:
    """Greedy tokens from full forwards of the growing sequence. (transformers' generate() picks
    longrope's factors per call from the positions in hand, and its first step already disagrees
    with its own full forward on the same 40 tokens; the full forward is the reference.)"""
    ids = list(ids)
    for _ in range(n):
        ids.append(int(_logits(model, ids)[-1].argmax()))
    return ids[-n:]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_conformance(name, tmp_path):
    """Programs for the default context (128 > 32 positions: longrope's long factors) against
    transformers on 48 tokens (> 32: transformers' long factors too); greedy from 40 tokens."""
    _save(CONFIGS[name], tmp_path)
    hf = _hf(tmp_path)
    report = testing.run_conformance(tmp_path, IDS, reference_logits=_logits(hf, IDS),
                                     reference_tokens=_greedy(hf, IDS[:40], 8), greedy_prompt=IDS[:40],
                                     family="phi3")
    assert report["parity_err"] <= testing.F32_TOLERANCE
    assert report["notes"] == []


@pytest.mark.parametrize("name", ["longrope", "longrope_partial"])
def test_longrope_within_the_original_context_uses_the_short_factors(name, tmp_path):
    """A program for the original context (32) against transformers on 24 tokens (short factors);
    the same tokens through a program for 128 positions (long factors) differ."""
    _save(CONFIGS[name], tmp_path)
    ref = _logits(_hf(tmp_path), IDS[:24])
    short = cpullm.load(tmp_path, quant="f32", use_cache=False, n_ctx=ORIGINAL).logits(IDS[:24])
    testing.check_parity(short, ref)
    long = cpullm.load(tmp_path, quant="f32", use_cache=False, n_ctx=4 * ORIGINAL).logits(IDS[:24])
    assert np.abs(long - ref).max() > 100 * testing.F32_TOLERANCE * np.abs(ref).max()
