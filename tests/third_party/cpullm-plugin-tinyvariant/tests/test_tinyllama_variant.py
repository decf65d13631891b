"""The plugin author's own test suite: cpullm's conformance kit, one call per family config,
against the independent numpy reference in reference.py."""
import json

import pytest
from reference import reference_logits

from cpullm.plugin import testing

BASE = dict(
    model_type="tinyllama_variant", architectures=["TinyLlamaVariantForCausalLM"],
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=272, max_position_embeddings=512,
    tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
CONFIGS = {
    # layer 0 sees the last 8 tokens, layer 1 everything; ids are longer than the window
    "sliding": dict(BASE, layer_types=["sliding_attention", "full_attention"], sliding_window=8),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_conformance(name, tmp_path):
    report = testing.run_family_conformance(CONFIGS[name], tmp_path, reference=reference_logits,
                                            family="tinyvariant")
    assert report["parity_err"] <= testing.F32_TOLERANCE
    assert report["notes"] == []
    print(json.dumps({k: report[k] for k in ("family", "plugin", "parity_err", "cached_decode_err")}))
