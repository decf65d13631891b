"""GGUF files run as they are (cpullm.load("FILE.gguf"), quant "gguf") and ``quant="q4"``.

Tiny GGUFs are written with gguf.GGUFWriter, every matrix in one ggml block format; the run that
executes the blocks (kernels/cpullm_kernels/rows/kquant.py, kquant_gemm.py) is compared with the f32 run of the same
file (every tensor dequantized, no quantized arithmetic): the only difference is the activations'
rounding to int8 (decode) / int16 (prefill) per block of 32.
"""
from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

import test_convert as tc  # noqa: E402
from test_convert import write_tiny_gguf  # noqa: E402

import cpullm  # noqa: E402
from cpullm.errors import ConfigError  # noqa: E402
from cpullm_kernels.rows import q4  # noqa: E402
from cpullm_kernels.rows.gguf_blocks import FORMATS, random_blocks  # noqa: E402
from steps import Steps  # noqa: E402

# K-quant super-blocks are 256 weights: rows of 256 (hidden) and 512 (ffn) for every format
SHAPES = {"llama": dict(hidden=256, heads=4, kv=2, head_dim=64, ffn=512),
          "gemma3": dict(hidden=256, heads=2, kv=1, head_dim=256, ffn=512),
          "qwen2": dict(hidden=256, heads=4, kv=2, head_dim=64, ffn=512)}
IDS = [1, 5, 9, 17, 33, 65, 100, 7, 200, 3, 12, 40]


def _quantize(arr, qtype):
    """gguf.quants.quantize, plus the K-quants it lacks: Q4_K / Q6_K by cpullm's quantizers, Q5_K
    as random blocks (any valid bytes do: the test compares two runs of the same file)."""
    name = gguf.GGMLQuantizationType(qtype).name
    if name == "Q4_K":
        return q4.quantize_q4(arr)
    if name == "Q6_K":
        return q4.quantize_q6_k(arr)
    if name == "Q5_K":
        return random_blocks("Q5_K", arr.shape[0], arr.shape[1], np.random.default_rng(1), scale=0.004)
    return _ORIGINAL(arr, qtype)


_ORIGINAL = gguf.quants.quantize


@pytest.fixture
def write(monkeypatch, tmp_path):
    def make(fmt: str, arch: str = "llama", tied: bool = True):
        monkeypatch.setitem(tc.TINY_SHAPES, arch, SHAPES[arch])
        monkeypatch.setattr(gguf.quants, "quantize", _quantize)
        path = tmp_path / f"tiny-{arch}-{fmt}.gguf"
        weights = tc.tiny_hf_weights(arch, 2, len(tc.spm_vocab()[0] if arch == "gemma3" else tc.byte_level_vocab()[0]),
                                     0, tied)
        for k, v in weights.items():             # smaller weights: logits of a sane size
            if v.ndim == 2:
                weights[k] = v * np.float32(0.25)
        write_tiny_gguf(path, arch, qtype=fmt, tied=tied, weights=weights)
        return path
    return make


def _close(got, ref, rel: float):
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < rel, f"max |delta logit| {err:.4f} x max |logit| >= {rel}"
    return err


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_gguf_runs_each_block_format_as_it_is(write, fmt):
    path = write(fmt)
    m = cpullm.load(path, use_cache=False)
    assert m.quant == "gguf"
    formats = m.info()["weight_formats"]
    assert formats.get(fmt, 0) > 0 and "int8" not in formats, formats     # no matrix requantized
    ref = cpullm.load(path, quant="f32", use_cache=False).logits(IDS)
    # prefill: kquant_gemm, int16 activations (measured <= 7e-5); Q4_K / Q6_K in panels of 16 rows
    # (kquant_panels) prefill with decode's int8 activations
    paneled = any(s[0].endswith(" panels") for s in m.program.meta["weight_slots"].values())
    assert paneled == (fmt in ("Q4_K", "Q6_K"))
    got = m.logits(IDS)
    _close(got, ref, 0.03 if paneled else 0.002)
    steps = Steps(m)                        # a prompt's last logits (head on one row, two passes
    _close(steps.prefill(IDS)[None], ref[-1:], 0.03 if paneled else 0.002)   # on the int8 rounding)
    steps.reset()
    dec = np.stack([steps.decode(t).copy() for t in IDS])      # decode: kquant.matvec, int8
    _close(dec, ref, 0.03)                                              # activations (measured <= 0.011)


@pytest.mark.parametrize("arch,fmt", [("gemma3", "Q4_K"), ("qwen2", "Q5_0")])
def test_gguf_as_is_other_architectures(write, arch, fmt):
    path = write(fmt, arch)
    ref = cpullm.load(path, quant="f32", use_cache=False).logits(IDS)
    m = cpullm.load(path, use_cache=False)
    assert m.info()["weight_formats"].get(fmt, 0) > 0
    _close(m.logits(IDS), ref, 0.002)


def test_gguf_untied_and_requantized_on_request(write):
    path = write("Q4_0", tied=False)
    ref = cpullm.load(path, quant="f32", use_cache=False).logits(IDS)
    int8 = cpullm.load(path, quant="int8", use_cache=False)
    assert set(int8.info()["weight_formats"]) == {"int8", "f32"}
    _close(int8.logits(IDS), ref, 0.03)
    q = cpullm.load(path, quant="q4", use_cache=False)
    assert set(q.info()["weight_formats"]) >= {"Q4_K", "Q6_K"}
    _close(q.logits(IDS), ref, 0.25)


def test_gguf_cache_round_trip(write, tmp_path):
    path = write("Q4_K")
    a = cpullm.load(path, cache_dir=tmp_path / "c")
    assert a.cache_status.startswith("MISS")
    b = cpullm.load(path, cache_dir=tmp_path / "c")
    assert b.cache_status == "HIT"
    np.testing.assert_array_equal(a.logits(IDS), b.logits(IDS))
    sa, sb = Steps(a), Steps(b)
    for t in IDS[:4]:
        np.testing.assert_array_equal(sa.decode(t), sb.decode(t))


def test_quant_gguf_needs_a_gguf_file(tmp_path):
    from cpullm.testing import make_random_checkpoint
    d = make_random_checkpoint(dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64,
                                    intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=300, tie_word_embeddings=True,
                                    max_position_embeddings=512), tmp_path / "ckpt")
    with pytest.raises(ConfigError, match="GGUF file"):
        cpullm.load(d, quant="gguf", use_cache=False)


def test_q4_from_safetensors_close_to_f32(tmp_path):
    from cpullm.testing import make_random_checkpoint
    d = make_random_checkpoint(dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=256,
                                    intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=300, tie_word_embeddings=True,
                                    max_position_embeddings=512), tmp_path / "ckpt", std=0.05)
    ref = cpullm.load(d, quant="f32", use_cache=False).logits(IDS)
    m = cpullm.load(d, quant="q4", use_cache=False)
    fm = m.info()["weight_formats"]
    assert fm["Q6_K"] > 0 and fm["Q4_K"] > 0 and "int8" not in fm, fm
    got = m.logits(IDS)
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    int8_rel = np.abs(cpullm.load(d, quant="int8", use_cache=False).logits(IDS) - ref).max() / np.abs(ref).max()
    assert rel < 0.3, (rel, int8_rel)          # measured 0.23 (int8: 0.028) on these random weights
    steps = Steps(m)
    dec = np.stack([steps.decode(t).copy() for t in IDS])
    assert np.abs(dec - got).max() / np.abs(ref).max() < 0.05      # decode and prefill kernels agree


def test_gguf_prompt_cache_and_profile(write, tmp_path):
    path = write("Q4_1")
    m = cpullm.load(path, use_cache=False)
    prompt = [1, 5, 9, 17, 33, 65, 100, 7]
    full = list(m.generate_ids(prompt, max_new_tokens=6))
    m.use_prompt_cache(tmp_path / "p.cache")
    list(m.generate_ids(prompt, max_new_tokens=6))
    m.save_prompt_cache()
    m2 = cpullm.load(path, use_cache=False).use_prompt_cache(tmp_path / "p.cache")
    again = list(m2.generate_ids(prompt, max_new_tokens=6))
    assert m2.prompt_cache_status.startswith("HIT") and again == full
    m2.executor.start_profile()
    steps = Steps(m2)
    steps.prefill(prompt)
    steps.decode(3)
    prof = m2.executor.stop_profile()
    assert prof["mlp_up"] > 0 and prof["lm_head"] > 0


def test_gguf_f16_matrices_go_the_int8_way(write):
    path = write("F16")
    m = cpullm.load(path, use_cache=False)
    assert m.quant == "gguf" and set(m.info()["weight_formats"]) == {"int8", "f32"}
    assert m.info()["gguf_formats"].get("F16", 0) > 0
    ref = cpullm.load(path, quant="f32", use_cache=False).logits(IDS)
    _close(m.logits(IDS), ref, 0.03)


def test_cli_runs_a_gguf_file(write, tmp_path):
    import json
    import os
    import subprocess
    import sys
    path = write("Q8_0")
    env = dict(os.environ, CPULLM_CACHE_DIR=str(tmp_path / "c"))
    r = subprocess.run([sys.executable, "-m", "cpullm.cli", "run", str(path), "-p", "the", "-n", "3",
                        "--threads", "1", "--json"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["quant"] == "gguf" and out["model"] == str(path)


def test_q4_rows_that_are_not_whole_super_blocks_take_q5_0_and_q8_0(tmp_path):
    """hidden 96 (intermediate 160), like the small models' 576 / 640 / 896: the 4-bit matrices
    are Q5_0 and the 6-bit ones (the tied lm_head, its embedding rows gathered from the same
    blocks) Q8_0, llama.cpp's fallbacks, instead of Q4_K / Q6_K padded to 256."""
    from cpullm.testing import make_random_checkpoint
    d = make_random_checkpoint(dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=96,
                                    intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=300, tie_word_embeddings=True,
                                    max_position_embeddings=512), tmp_path / "ckpt", std=0.05)
    ref = cpullm.load(d, quant="f32", use_cache=False).logits(IDS)
    m = cpullm.load(d, quant="q4", use_cache=False)
    fm = m.info()["weight_formats"]
    assert fm["Q5_0"] > 0 and fm["Q8_0"] > 0 and not {"Q4_K", "Q6_K", "int8"} & set(fm), fm
    got = m.logits(IDS)
    int8 = cpullm.load(d, quant="int8", use_cache=False).logits(IDS)
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    assert rel < 0.15, (rel, np.abs(int8 - ref).max() / np.abs(ref).max())     # measured 0.098 (int8 0.016)
    steps = Steps(m)
    dec = np.stack([steps.decode(t).copy() for t in IDS])
    assert np.abs(dec - got).max() / np.abs(ref).max() < 0.05


@pytest.mark.parametrize("fmt", ["Q4_K", "Q4_1", "Q8_0"])
def test_gguf_batched_decode_equals_each_request_alone(write, fmt):
    """The scheduler runs raw-block LINEARs row by row through the lone decode's matvec: a
    request's greedy tokens are the same alone and among others of other lengths."""
    m = cpullm.load(write(fmt), use_cache=False)
    prompts = [IDS[:5], IDS, IDS[:1], IDS[3:9]]
    alone = [list(m.generate_ids(p, max_new_tokens=6, temperature=0.0, ignore_eos=True)) for p in prompts]
    mixed = m.generate_batch(prompts, max_new_tokens=6, parallel=3, ignore_eos=True)
    assert mixed == alone


def test_a_block_format_gguf_calls_each_kernel_with_the_warmed_signature_only(write, tmp_path):
    """Like the default model (a Q4_1 GGUF): in a fresh process the block kernels run with the
    signatures the warm-up compiled, and the q8 prefill GEMM (its row quantizer and the q8 panel
    kernel of several rows), which no body LINEAR needs, is never compiled; the one-row q8 panel
    kernel, which the decode calls by address for the Q8_0 head, only with its one declared
    signature."""
    from test_coldstart import used_kernel_signatures
    used = used_kernel_signatures(write("Q4_1"), tmp_path / "cache")
    assert used["cpullm_kernels.program.interpreter.linear_rows"] != []
    assert used["cpullm_kernels.panels.q8_panels.quantize_rows_par"] == []
    assert len(used["cpullm_kernels.panels.q8_panels.panels_matvec"]) == 1
    assert used["cpullm_kernels.panels.q8_panels.panels_matmul"] == []


def test_gguf_as_is_gets_no_head_screen_but_q4_does(write, monkeypatch):
    """A GGUF run as it is keeps its resident weights at the file's tensor bytes: no lm_head screen,
    even where a q4 program of the same file gets one (kernels/cpullm_kernels/panels/head_screen_blocks.py)."""
    from cpullm_kernels.panels import head_screen
    monkeypatch.setattr(head_screen, "MIN_LM_HEAD_BYTES", 0)
    path = write("Q6_K")
    m = cpullm.load(path, use_cache=False)
    assert m.quant == "gguf" and "head_screen" not in m.program.meta and m.executor.screen is None
    assert "head_screen" not in m.info()["weight_formats"]
    q = cpullm.load(path, quant="q4", use_cache=False)
    assert q.executor.screen is not None and q.executor.screen.blocks


@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K", "Q5_0"])
def test_panel_rows_do_not_depend_on_the_batch(write, fmt, monkeypatch):
    """Q4_K / Q6_K matrices in panels of 16 rows (kernels/cpullm_kernels/panels/kquant_panels.py) serve the scheduler's
    batched decode steps and a lone decode with one kernel (the 265-row head here stays row by
    row, through the decode's row routine on both paths): a request's logits are the same bit for
    bit alone, among others, and from the executor's one-token decode (which is why a lone
    request may take that path: Forward.lone_path_identical)."""
    from cpullm.run.batch import BatchDecoder
    from cpullm.generate.sampling import SamplingParams
    from cpullm.generate.scheduler import Scheduler
    from cpullm.generate.sequence import Sequence

    m = cpullm.load(write(fmt), use_cache=False, threads=2, n_ctx=128, max_chunk=16)
    paneled = any(s[0] == f"{fmt} panels" for s in m.program.meta["weight_slots"].values())
    assert paneled == (fmt != "Q5_0")          # Q5_0: every matrix row by row (kquant.matvec)
    assert m.forward.lone_path_identical
    # every step through the batched decoder here, a batch of one included
    monkeypatch.setattr(m.forward, "lone_path_identical", False)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(1, 250, n)] for n in (5, 33, 1, 20)]

    def run(ps, slots):                     # each request's decode-step logits, in its order
        sch = Scheduler(m.forward, slots=slots, prefill_chunk=16)
        seqs = [sch.add(Sequence(p, 8, SamplingParams())) for p in ps]
        rows = {id(s): [] for s in seqs}
        decoder = m.forward.decoder
        decode = decoder.decode

        def spy(states, slot_ids, positions, tokens):
            out = decode(states, slot_ids, positions, tokens)
            for i, slot in enumerate(slot_ids):
                rows[id(next(s for s in seqs if s.slot is not None and s.slot.index == slot and not s.done))].append(
                    out[i].copy())
            return out
        decoder.decode = spy
        try:
            sch.run_until_idle()
        finally:
            del decoder.decode
        return [(s.generated, np.stack(rows[id(s)])) for s in seqs]

    alone = [run([p], 1)[0] for p in prompts]
    mixed = run(prompts, 3)                 # 4 requests over 3 slots: batches of 1 to 3 rows
    for (tok_a, log_a), (tok_m, log_m) in zip(alone, mixed):
        assert tok_a == tok_m and np.array_equal(log_a, log_m)
    fwd = m.forward
    for p, (toks, logits) in zip(prompts, alone):
        slot = fwd.new_slot()
        fwd.prefill(slot, p)
        lone = []
        for t in toks[:-1]:               # the executor's one-token decode
            lone.append(fwd.executor.decode(slot.state, slot.position, t).copy())
            slot.position += 1
        assert np.array_equal(np.stack(lone), logits)
