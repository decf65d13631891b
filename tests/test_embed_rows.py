"""A program's ``embed_rows`` is the embedding's row count in every weight format: the prompt-id
check (and the execution cache's bounds check) read it. A tied Q6_K table in panels of 16 rows
once reported its byte count there, so ids past the vocabulary reached past the table, and the
cache refused its own entries."""
import pytest

import cpullm
from cpullm.errors import PromptError
from cpullm.testing import make_random_checkpoint

QWEN3_TIED = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=256, intermediate_size=512,
                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=4096,
                  max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True)


@pytest.mark.parametrize("quant", ["q4", "int8"])
def test_embed_rows_is_the_vocabulary_and_the_entry_loads_back(tmp_path, quant):
    d = make_random_checkpoint(QWEN3_TIED, tmp_path / "m", seed=1)
    first = cpullm.load(d, quant=quant, cache_dir=tmp_path / "c", n_ctx=64)
    assert first.program.meta["embed_rows"] == 4096
    again = cpullm.load(d, quant=quant, cache_dir=tmp_path / "c", n_ctx=64)
    assert again.cache_status == "HIT"
    with pytest.raises(PromptError):
        list(again.generate_ids([1, 4096], 2))
