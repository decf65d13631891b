"""A checkpoint whose config ties the embeddings but which also stores an ``lm_head.weight`` that
differs: transformers 5 does not tie the two (``PreTrainedModel.tie_weights``: both present and
unequal -> keep both) and its logits come from the stored head; so do cpullm's, through the one
rule every family uses (``cpullm.graph.decoder.lm_head_rule``)."""
import numpy as np
import pytest

pytestmark = pytest.mark.reference   # needs torch and transformers

torch = pytest.importorskip("torch", reason="torch is a test dependency (pip install -e '.[test]')")
transformers = pytest.importorskip("transformers", reason="transformers is a test dependency")

import cpullm  # noqa: E402
from cpullm import testing  # noqa: E402
from cpullm_gemma.tiny_configs import GEMMA3_TEXT  # noqa: E402
from cpullm_llama.tiny_configs import LLAMA  # noqa: E402
from hf_reference import hf_logits, hf_model, save_tiny  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

IDS = [256] + [int(x) for x in np.random.default_rng(3).integers(0, 255, 23)]


def _store_own_head(d):
    """Add a random lm_head.weight (V, H) beside the tied embedding, in the embedding's dtype."""
    path = d / "model.safetensors"
    tensors = load_file(path)
    embed = tensors["model.embed_tokens.weight"]
    gen = torch.Generator().manual_seed(11)
    tensors["lm_head.weight"] = (torch.randn(embed.shape, generator=gen) * 0.05).to(embed.dtype)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize("config", [LLAMA, GEMMA3_TEXT], ids=["llama", "gemma3_text"])
def test_tied_config_with_a_stored_differing_head_uses_the_stored_head(config, tmp_path):
    from transformers import AutoConfig

    assert config.get("tie_word_embeddings", True)      # tied (the transformers default when unset)
    cfg = AutoConfig.for_model(**config)
    save_tiny(cfg, tmp_path, seed=5)
    tied = hf_logits(hf_model(tmp_path), IDS)
    _store_own_head(tmp_path)
    ref = hf_logits(hf_model(tmp_path), IDS)
    assert np.abs(ref - tied).max() > 0.1 * np.abs(tied).max()     # the stored head is what counts
    model = cpullm.load(tmp_path, quant="f32", use_cache=False)
    testing.check_parity(model.logits(IDS), ref)


def test_tied_config_without_a_stored_head_uses_the_embedding(tmp_path):
    from transformers import AutoConfig

    save_tiny(AutoConfig.for_model(**LLAMA), tmp_path, seed=5)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    model = cpullm.load(tmp_path, quant="f32", use_cache=False)
    testing.check_parity(model.logits(IDS), hf_logits(hf_model(tmp_path), IDS))
