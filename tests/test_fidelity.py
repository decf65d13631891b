"""benchmarks/fidelity.py: the KL it reports, and a loose floor on the KL of a GGUF run as it is
against the f32 run on its dequantized weights (a tiny GGUF here; the real SmolLM2 file, marked
slow). The floors sit far above what was measured, so they cannot flake, yet far below what a
wrong block kernel gives (a single mis-scaled sub-block moves the KL by orders of magnitude)."""
from __future__ import annotations


import numpy as np
import pytest

import cpullm

pytest.importorskip("gguf")
from test_gguf_run import write  # noqa: E402,F401  (the tiny-GGUF fixture)
from bench_scripts import load_benchmark  # noqa: E402

fidelity = load_benchmark("fidelity")


def test_kl_per_position_matches_the_definition():
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(3, 7)).astype(np.float32)
    other = ref + rng.normal(scale=0.5, size=ref.shape).astype(np.float32)
    p = np.exp(ref.astype(np.float64))
    p /= p.sum(-1, keepdims=True)
    q = np.exp(other.astype(np.float64))
    q /= q.sum(-1, keepdims=True)
    want = (p * np.log(p / q)).sum(-1)
    np.testing.assert_allclose(fidelity.kl_per_position(ref, other), want, rtol=1e-10)
    assert np.all(want > 0)
    # a constant shift of the logits is the same distribution: KL 0
    np.testing.assert_allclose(fidelity.kl_per_position(ref, ref + 3.0), 0.0, atol=1e-6)
    with pytest.raises(ValueError):
        fidelity.kl_per_position(ref, other[:2])


@pytest.mark.parametrize("fmt", ["Q4_1", "Q4_K", "Q6_K"])
def test_tiny_gguf_as_is_kl_floor(write, fmt):
    """As-is against f32 on a tiny GGUF, teacher-forced over 12 positions: measured 7e-10 (Q4_K) to
    5e-9 (Q6_K) nats; the activations' int16 rounding in prefill is all that differs."""
    from test_gguf_run import IDS

    path = write(fmt)
    ref = cpullm.load(path, quant="f32", use_cache=False)
    got = cpullm.load(path, use_cache=False)
    assert got.quant == "gguf"
    kl = fidelity.mean_kl(fidelity.cpullm_logits(ref, [IDS]), fidelity.cpullm_logits(got, [IDS]))
    assert 0.0 <= kl < 1e-3, kl


@pytest.mark.slow
def test_smollm2_gguf_as_is_kl_floor():
    """The store's SmolLM2 Q4_1 file, one prompt and 8 greedy tokens: as-is KL measured 9e-8 nats,
    llama.cpp on the same file 0.0037 (benchmarks/results/2026-12-04-fidelity.md)."""
    from realmodels import real_gguf_path

    path = real_gguf_path("smollm2-135m-instruct")
    ref = cpullm.load(path, quant="f32")
    seqs = fidelity.greedy_sequences(ref, [fidelity.PROMPTS[0]], 8)
    ref_logits = fidelity.cpullm_logits(ref, seqs)
    del ref
    as_is = fidelity.mean_kl(ref_logits, fidelity.cpullm_logits(cpullm.load(path), seqs))
    assert 0.0 <= as_is < 1e-3, as_is
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return
    llama = fidelity.mean_kl(ref_logits, fidelity.llama_cpp_logits(path, seqs, threads=2))
    assert as_is <= llama + 0.002, (as_is, llama)


@pytest.mark.slow
def test_gemma3_q4_kl_floor():
    """``quant="q4"`` on the store's converted Gemma 3 270M (bf16 of its Q4_K_M file), one prompt
    and 8 greedy tokens, against f32 on the same directory: measured 2.4e-5 nats over 115
    positions, llama.cpp's Q4_K_M of the same weights 0.0048, the q4 mix before its 640-wide
    rows took Q5_0 / Q8_0 0.071 (benchmarks/results/2026-12-04-q4-fidelity.md)."""
    from realmodels import real_model_dir

    d = real_model_dir("gemma-3-270m")
    ref = cpullm.load(d, quant="f32")
    seqs = fidelity.greedy_sequences(ref, [fidelity.PROMPTS[0]], 8)
    ref_logits = fidelity.cpullm_logits(ref, seqs)
    del ref
    q4 = cpullm.load(d, quant="q4")
    assert set(q4.info()["weight_formats"]) >= {"Q5_0", "Q8_0"}
    kl = fidelity.mean_kl(ref_logits, fidelity.cpullm_logits(q4, seqs))
    assert 0.0 <= kl < 0.004, kl
