"""Speculative decoding on a real model: INT8 Qwen2.5-Coder-0.5B-Instruct copying a standard-library
function gives plain decoding's tokens, token for token, with most of them guessed by prompt lookup;
and its sampled output with a seed is the plain sampled output (one draw per emitted token)."""
import inspect

import pytest

import cpullm
from realmodels import real_model_dir

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def qwen():
    return cpullm.load(real_model_dir("qwen2.5-coder-0.5b-instruct"), quant="int8", threads=2, n_ctx=1024)


def _copy_prompt(model):
    import colorsys
    src = inspect.getsource(colorsys.rgb_to_hls) + "\n" + inspect.getsource(colorsys.hls_to_rgb)
    return model.tokenizer.encode(src + "\n# The same two functions again, unchanged:\n\n")


def test_lookup_on_a_copy_is_exact_and_accepts(qwen):
    ids = _copy_prompt(qwen)
    qwen.speculate("off")
    plain = list(qwen.generate_ids(ids, 64))
    qwen.speculate("lookup", draft_max=8)
    stats = cpullm.generate.generate.GenerationStats()
    from cpullm.generate.generate import generate_ids
    from cpullm.generate.sampling import SamplingParams
    spec = list(generate_ids(qwen.forward, qwen.slot, ids, 64, SamplingParams(), qwen.eos_token_ids, stats,
                             speculative=qwen.speculative))
    assert spec == plain
    assert stats.spec_passes > 0 and stats.spec_accepted >= len(plain) // 3
    qwen.speculate("off")
    sampled = list(qwen.generate_ids(ids, 32, temperature=0.8, seed=3))
    qwen.speculate("lookup")
    assert list(qwen.generate_ids(ids, 32, temperature=0.8, seed=3)) == sampled
