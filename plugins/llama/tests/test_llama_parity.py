"""Llama family against transformers on tiny random checkpoints (both checkpoint layouts)."""
import zlib

import numpy as np
import pytest

pytestmark = pytest.mark.reference   # needs torch and transformers

torch = pytest.importorskip("torch", reason="torch is a test dependency (pip install -e '.[test]')")
transformers = pytest.importorskip("transformers", reason="transformers is a test dependency")

import cpullm  # noqa: E402
from cpullm import testing  # noqa: E402
from hf_reference import hf_greedy, hf_logits, hf_model, save_tiny  # noqa: E402
from cpullm_llama.tiny_configs import LLAMA  # noqa: E402
from tiny_configs import LLAMA_UNTIED_BIAS, SMOLLM2_LIKE  # noqa: E402

CASES = {
    "llama32": {k: v for k, v in LLAMA.items() if k != "model_type"},   # Llama 3.2-like
    "smollm2": SMOLLM2_LIKE,
    "untied_bias": LLAMA_UNTIED_BIAS,
}
IDS = [256] + [int(x) for x in np.random.default_rng(7).integers(0, 255, 47)]   # 48 tokens


@pytest.fixture(scope="module", params=[(n, layout) for n in CASES for layout in ("v5", "legacy")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def checkpoint(request, tmp_path_factory):
    from transformers import LlamaConfig

    name, layout = request.param
    cfg = LlamaConfig(**CASES[name])
    d = tmp_path_factory.mktemp(f"{name}_{layout}")
    save_tiny(cfg, d, seed=zlib.crc32(name.encode()) % 1000, legacy=layout == "legacy",
              f32_tensors=("norm",) if layout == "legacy" else ())
    ref = hf_model(d)
    return d, hf_logits(ref, IDS), hf_greedy(ref, IDS[:8], 32)


def test_f32_parity_every_position(checkpoint):
    d, ref_logits, _ = checkpoint
    model = cpullm.load(d, quant="f32", use_cache=False)
    testing.check_parity(model.logits(IDS), ref_logits)


def test_f32_greedy_32_tokens_with_cache(checkpoint):
    d, _, ref_tokens = checkpoint
    model = cpullm.load(d, quant="f32", use_cache=False)
    testing.check_greedy(model, IDS[:8], ref_tokens)


def test_conformance_kit(checkpoint):
    d, ref_logits, ref_tokens = checkpoint
    report = testing.run_conformance(d, IDS, reference_logits=ref_logits,
                                     reference_tokens=ref_tokens, greedy_prompt=IDS[:8])
    assert report["family"] == "llama"
    assert report["int8"]["cosine"] >= 0.98 and report["int8"]["top1"] >= 0.75
