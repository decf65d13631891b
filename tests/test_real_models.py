"""The three real models (slow): SmolLM2-135M-Instruct (llama), Gemma 3 270M (gemma3_text) and
Qwen2.5-Coder-0.5B-Instruct (qwen2), converted from their PyPI GGUFs by the model store.

For three prompts each (plain text, code, a story opening):
* f32 mode generates the same 32 greedy tokens as transformers. The reference is transformers
  loading the converted directory in float32; tests/test_convert.py proves that directory holds
  exactly transformers' own dequantization of the GGUF (rounded to bf16, as checkpoints are).
* INT8 mode's top-1 agreement with f32 is >= 97 % and its mean KL divergence <= 0.01 nats over
  ~500 positions, through both paths: the batched prefill (INT8 weights x int16 activation
  blocks on AVX2 / AVX-512 VNNI CPUs, x f32 activations elsewhere) and the one-token decode path
  teacher-forced through the same tokens (INT8 weights x int16 activation blocks). Measured
  (top-1 / KL, equal on both paths to 3 digits, AMD Zen 5 with VNNI): SmolLM2-135M
  98.0 % / 0.0013, Gemma 3 270M 98.8 % / 0.0006, Qwen2.5-Coder-0.5B 99.2 % / 0.0002.
  (The int8-activation decode path it replaced, llama.cpp's Q8_0 x Q8_0 numerics, measured
  93.8-95.2 % on SmolLM2 over ~290 of these positions.)
"""
import numpy as np
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.reference]

torch = pytest.importorskip("torch", reason="torch is a test dependency (pip install -e '.[test]')")
transformers = pytest.importorskip("transformers", reason="transformers is a test dependency")

import cpullm  # noqa: E402
from cpullm import testing  # noqa: E402
from hf_reference import hf_greedy, hf_model  # noqa: E402
from realmodels import real_model_dir  # noqa: E402
from steps import Steps  # noqa: E402

MODELS = ["smollm2-135m-instruct", "gemma-3-270m", "qwen2.5-coder-0.5b-instruct"]
PROMPTS = {
    "text": "The history of the printing press begins in the fifteenth century, when",
    "code": "def quicksort(items):\n    \"\"\"Sort a list of numbers.\"\"\"\n    if len(items) <= 1:\n",
    "story": "Once upon a time, in a village at the edge of a great forest, there lived a",
}
# INT8 fidelity is measured over the three prompts plus this passage (~500 positions): top-1
# agreement over only the ~60 prompt positions moves by 1.6 points per near-tie flip, over ~290
# by 0.35 (every flip measured on SmolLM2 is a near tie: f32 top-2 gap <= 0.08 nats, median 1.0).
PASSAGE = (
    'The river town woke slowly that spring. Fishermen pulled their boats onto the gravel bank, the baker opened her shutters before dawn, and children ran along the levee shouting at the herons. Nobody expected the letter that arrived on the noon ferry, addressed in careful blue ink to the mayor, who had not received a letter from outside the valley in eleven years.'
    "\n"
    'In computing, a cache is a small, fast store that keeps copies of data so that future requests can be served quickly. When the requested data is found in the cache, it is called a hit; otherwise it is a miss, and the data must be fetched from a slower layer such as main memory or disk. Good caching depends on locality: programs tend to reuse recent data and nearby addresses.'
    "\n"
    'To make bread, mix flour, water, salt and yeast into a shaggy dough, let it rest for twenty minutes, then knead until it is smooth and elastic. Leave it covered in a warm place until it has doubled in size, shape it gently, and bake it in a hot oven until the crust is deep brown and the loaf sounds hollow when tapped underneath.'
    "\n"
    'The committee met on a grey Tuesday morning to discuss the budget for the coming year. Most members agreed that the library needed a new roof, but few could agree on how to pay for it, and the debate ran well past lunch before a compromise was reached.'
    "\n"
    'Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to produce glucose and oxygen. It takes place mainly in the leaves, inside small structures called chloroplasts, which contain the pigment chlorophyll that gives plants their colour.'
    "\n"
    'def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\nprint([fibonacci(i) for i in range(10)])'
    "\n"
    'The train left the station exactly on time, which surprised everyone on the platform. As it gathered speed, the city gave way to fields, then to low hills covered in pine, and the passengers settled into the quiet rhythm of a long journey north.'
    "\n"
)
MIN_TOP1, MAX_KL = 0.97, 0.01


@pytest.fixture(scope="module", params=MODELS)
def real(request):
    d = real_model_dir(request.param)
    f32 = cpullm.load(d, quant="f32", use_cache=False)
    int8 = cpullm.load(d, quant="int8", use_cache=False)
    ref = hf_model(d)
    yield request.param, f32, int8, ref
    del ref


def _decode_path_logits(model, ids):
    """Logits of every position through the one-token decode path (teacher forcing)."""
    ex = Steps(model)
    ex.reset()
    return np.stack([ex.decode(t).copy() for t in ids])


@pytest.mark.parametrize("kind", list(PROMPTS))
def test_f32_greedy_32_tokens_equal_transformers(real, kind):
    name, f32, _, ref = real
    ids = f32.tokenizer.encode(PROMPTS[kind])
    expected = hf_greedy(ref, ids, 32)
    testing.check_greedy(f32, ids, expected)


def test_int8_fidelity_over_prompt_positions(real):
    name, f32, int8, _ = real
    ids = [t for kind in PROMPTS for t in int8.tokenizer.encode(PROMPTS[kind])]
    ids += int8.tokenizer.encode(PASSAGE)
    ref = f32.logits(ids)
    prefill = testing.fidelity(int8.logits(ids), ref)
    decode = testing.fidelity(_decode_path_logits(int8, ids), ref)
    print(f"\n{name} INT8 vs f32 over {len(ids)} positions: prefill {prefill}, decode {decode}")
    for path, fid in (("prefill", prefill), ("decode", decode)):
        assert fid["top1"] >= MIN_TOP1, f"{name} {path}: top-1 {fid['top1']:.3f} < {MIN_TOP1}"
        assert fid["kl"] <= MAX_KL, f"{name} {path}: KL {fid['kl']:.4f} > {MAX_KL}"


def test_int8_greedy_through_the_head_screen_equals_the_full_logits(real):
    """Greedy INT8 decode through the lm_head screen picks, at every step of every prompt, the
    argmax of the full q8 logits, while teacher-forced through the same tokens."""
    name, _, int8, _ = real
    if int8.executor.screen is None:                 # SmolLM2's lm_head is below the size for one
        from cpullm_kernels.panels import head_screen
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(head_screen, "MIN_LM_HEAD_BYTES", 0)
            int8 = cpullm.load(int8.model_dir, quant="int8", use_cache=False)
    ex = Steps(int8)
    assert ex.screen is not None, name
    ex.screen.t_screen.clear()
    ex.screen.t_plain.extend([1e9] * ex.screen.WINDOW)     # the screen on (nearly) every step
    for kind in PROMPTS:
        ids = int8.tokenizer.encode(PROMPTS[kind])
        ex.reset()
        tok = int(np.argmax(ex.prefill(ids)))
        screened, survivors = [], []
        for _ in range(48):
            tok = ex.decode_argmax(tok)
            screened.append(tok)
            survivors.append(ex.screen_survivors)
        ex.reset()
        tok = int(np.argmax(ex.prefill(ids)))
        full = []
        for _ in range(48):
            tok = int(np.argmax(ex.decode(tok)))
            full.append(tok)
        print(f"\n{name} {kind}: rows computed exactly per step median {np.median(survivors):.0f} "
              f"of {int8.program.meta['vocab']}")
        assert screened == full, (name, kind)


def test_chat_answers_sensibly():
    """The embedded default answers a simple question through its chat template."""
    model = cpullm.load(real_model_dir("smollm2-135m-instruct"), use_cache=False)
    text = "".join(model.generate("What is the capital of France?", chat=True, max_new_tokens=24))
    assert "Paris" in text, text
