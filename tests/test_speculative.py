"""Exact speculative decoding (cpullm.generate.speculative): the verify pass gives the logits of one-token
steps bit for bit, in f32, int8, q4 and a GGUF run as it is, for every family structure (plain
GQA, sliding-window layers, Qwen3.5's linear attention, Gemma's soft-capping and local/global
layers); a rejection at every position of a draft rolls the state back exactly (KV by position,
the recurrent state from its snapshot); greedy output through the scheduler is the plain output
whatever the guesses; sampled output keeps the target's distribution."""
import numpy as np
import pytest

import cpullm
from cpullm.errors import ConfigError
from cpullm.generate.sampling import SamplingParams
from cpullm.generate.scheduler import Scheduler
from cpullm.generate.sequence import Sequence
from cpullm.generate.speculative import REF_ROW_COST, LookupIndex, Pacer, SeqSpec, resolve
from cpullm.testing import make_random_checkpoint
from cpullm_gemma.tiny_configs import GEMMA2_2B_LIKE, GEMMA3_270M_LIKE
from cpullm_qwen.tiny_configs import QWEN2_SLIDING_UNTIED, QWEN35_TEXT_ONLY
from tiny_configs import SMOLLM2_LIKE

FAMILIES = {
    "llama": dict(SMOLLM2_LIKE, model_type="llama"),
    "qwen2_sliding": dict(QWEN2_SLIDING_UNTIED, model_type="qwen2"),
    "qwen3_5_linear": dict(QWEN35_TEXT_ONLY, model_type="qwen3_5_text"),
    "gemma2": dict(GEMMA2_2B_LIKE, model_type="gemma2"),
    "gemma3": dict(GEMMA3_270M_LIKE, model_type="gemma3_text"),
}
K = 6                       # guesses per verify pass in these tests


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_dir(request, tmp_path_factory):
    return request.param, make_random_checkpoint(FAMILIES[request.param], tmp_path_factory.mktemp(request.param),
                                                 seed=7)


def _prompt(n=21, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


def _steps(fwd, prompt, tokens):
    """Logits after each of ``tokens`` decoded one token a step (the plain path) after ``prompt``."""
    slot = fwd.new_slot()
    fwd.prefill(slot, prompt)
    return np.stack([fwd.step([slot], [t])[0][0] for t in tokens])


def check_verify_is_exact(model, prompt, tokens):
    """verify() == one-token steps; and a rejection after every row rolls back exactly."""
    fwd = model.forward
    plain = _steps(fwd, prompt, tokens)
    slot = fwd.new_slot()
    fwd.prefill(slot, prompt)
    rows, snaps = fwd.verify([slot], [tokens])
    assert rows[0].shape == plain.shape and np.array_equal(rows[0], plain)
    assert slot.position == len(prompt) + len(tokens)
    other = (tokens[0] + 17) % 256
    for keep in range(1, len(tokens) + 1):            # a rejection after every row of the draft
        slot = fwd.new_slot()
        fwd.prefill(slot, prompt)
        _, snaps = fwd.verify([slot], [tokens])
        fwd.rewind([slot], snaps, [tokens[:keep]])
        assert slot.position == len(prompt) + keep
        after = fwd.step([slot], [other])[0][0]
        want = _steps(fwd, prompt, tokens[:keep] + [other])[-1]
        assert np.array_equal(after, want), f"state wrong after keeping {keep} of {len(tokens)} rows"


@pytest.mark.parametrize("quant", ["int8", "f32"])
def test_verify_rows_are_one_token_steps_for_every_family(family_dir, quant):
    name, d = family_dir
    m = cpullm.load(d, quant=quant, threads=2, n_ctx=96, max_chunk=16)
    check_verify_is_exact(m, _prompt(), _prompt(K + 1, seed=1))
    assert m.forward.guess_row_cost == 0.0         # q8 panels and f32: one read for all of a pass's rows


@pytest.mark.parametrize("name", ["llama", "qwen3_5_linear"])     # 4-bit on two structures: attention, linear attention
def test_verify_rows_are_one_token_steps_in_4_bit(name, tmp_path):
    d = make_random_checkpoint(FAMILIES[name], tmp_path / name, seed=0)
    m = cpullm.load(d, quant="q4", threads=2, n_ctx=96, max_chunk=16)
    check_verify_is_exact(m, _prompt(), _prompt(K + 1, seed=1))
    # rows of 144 weights: Q5_0 blocks (multiplied a row at a time in a verify pass) beside Q8_0
    # ones (q8 panels, read once)
    assert 0.0 < m.forward.guess_row_cost < 1.0


def test_verify_of_a_gguf_run_as_it_is(tmp_path):
    pytest.importorskip("gguf")
    from test_convert import write_tiny_gguf
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama", qtype="Q8_0")
    m = cpullm.load(path, threads=2, n_ctx=96, max_chunk=16)
    assert m.quant == "gguf"
    check_verify_is_exact(m, _prompt(), _prompt(K + 1, seed=2))
    assert m.forward.guess_row_cost == 0.0         # Q8_0 runs as q8 panels: read once for all rows


def test_sliding_window_survives_a_rejection_past_the_window(tmp_path):
    """A prompt longer than the window (8-12 positions): the ring holds window + max_chunk
    positions, so the rejected rows never overwrote a position the next token reads."""
    d = make_random_checkpoint(FAMILIES["qwen2_sliding"], tmp_path / "q", seed=2)
    m = cpullm.load(d, quant="int8", threads=2, n_ctx=96, max_chunk=16)
    check_verify_is_exact(m, _prompt(40, seed=3), _prompt(15, seed=4))      # 15 rows: max_chunk - 1


# ---- through the scheduler ----------------------------------------------------------------------

class Oracle:
    """A drafter that knows the plain output and guesses it with a wrong token at ``wrong``
    positions of each draft (a rejection there), the rest right."""

    def __init__(self, prompt, plain, wrong):
        self.prompt, self.plain, self.wrong = prompt, plain, wrong

    def __call__(self, spec, history, k):
        done = len(history) - len(self.prompt)
        want = self.plain[done: done + k]
        return [(t + 1) % 256 if i == self.wrong(done) else t for i, t in enumerate(want)]


def _spec_run(m, prompts, drafter=None, params=None, n_new=24, slots=4, draft_max=K, monkeypatch=None):
    cfg = resolve("lookup", draft_max)
    if drafter is not None:
        monkeypatch.setattr(SeqSpec, "lookup", lambda spec, history, k: drafter(spec, history, k))
    sch = Scheduler(m.forward, slots=slots, prefill_chunk=16, speculative=cfg)
    seqs = [sch.add(Sequence(p, n_new, params or SamplingParams())) for p in prompts]
    sch.run_until_idle()
    return [s.generated for s in seqs], sch


@pytest.mark.parametrize("quant", ["int8", "f32"])
def test_greedy_output_is_the_plain_output_whatever_the_guesses(family_dir, quant, monkeypatch):
    _, d = family_dir
    m = cpullm.load(d, quant=quant, threads=2, n_ctx=96, max_chunk=16)
    prompt = _prompt(13, seed=5)
    plain = list(m.generate_ids(prompt, 24, ignore_eos=True))
    for wrong_at in range(K + 1):                      # every position of a draft rejected in turn
        out, sch = _spec_run(m, [prompt], Oracle(prompt, plain, lambda done: wrong_at), monkeypatch=monkeypatch)
        assert out == [plain], f"rejection at {wrong_at}"
        assert sch.spec_stats.verify_passes > 0
        if wrong_at == K:
            assert sch.spec_stats.accepted == sch.spec_stats.drafted
    # speculative and plain sequences share one pass: another prompt without guesses beside it
    other = _prompt(30, seed=6)
    want_other = list(m.generate_ids(other, 24, ignore_eos=True))
    oracle = Oracle(prompt, plain, lambda done: 3)
    out, _ = _spec_run(m, [prompt, other],
                       lambda spec, h, k: oracle(spec, h, k) if h[:len(prompt)] == prompt else [],
                       monkeypatch=monkeypatch)
    assert out == [plain, want_other]


def test_screened_verify_gives_the_tokens_of_plain_decoding(tmp_path, monkeypatch):
    """With a q8 head screen, a greedy verify pass may read the lm_head through the multi-row
    screen (BatchDecoder.decode_argmax): each row's token is the argmax of verify()'s logits,
    whichever head the timings choose, and greedy lookup decoding through it is plain decoding."""
    from cpullm_kernels.panels import head_screen as H
    monkeypatch.setattr(H, "MIN_LM_HEAD_BYTES", 0)          # screens are for large lm_heads: allow this one
    d = make_random_checkpoint(FAMILIES["llama"], tmp_path / "l", seed=8)
    m = cpullm.load(d, quant="int8", threads=2, n_ctx=128, max_chunk=16, use_cache=False)
    fwd = m.forward
    rs = fwd.decoder.rows_screen
    assert m.executor.screen is not None and rs is not None
    monkeypatch.setattr(rs, "MAX_ROWS_FRACTION", 1.0)       # a tiny random head leaves many rows to compute
    prompts, tokens = [_prompt(), _prompt(9, seed=3)], [_prompt(K + 1, seed=1), _prompt(3, seed=2)]

    def run(method):
        slots = fwd.slots(2)
        for s, p in zip(slots, prompts):
            fwd.prefill(s, p)
        return method(slots, tokens)[0]
    want = [r.argmax(1) for r in run(fwd.verify)]
    for screened in (True, False):
        monkeypatch.setattr(rs, "choose", lambda n, screened=screened: screened)
        rs.survivors = 0
        got = run(fwd.verify_argmax)
        assert [list(g) for g in got] == [list(w) for w in want]
        assert (rs.survivors > 0) == screened
    monkeypatch.setattr(rs, "choose", lambda n: True)
    prompt = _prompt(13, seed=5)
    plain = list(m.generate_ids(prompt, 24, ignore_eos=True))
    for wrong_at in (0, 2, K):
        out, sch = _spec_run(m, [prompt], Oracle(prompt, plain, lambda done: wrong_at), monkeypatch=monkeypatch)
        assert out == [plain] and sch.spec_stats.verify_passes > 0 and rs.survivors > 0


def test_prompt_lookup_copies_and_is_exact(monkeypatch):
    d = make_random_checkpoint(FAMILIES["llama"], __import__("pathlib").Path(
        __import__("tempfile").mkdtemp()) / "l", seed=8)
    m = cpullm.load(d, quant="int8", threads=2, n_ctx=128, max_chunk=16)
    base = _prompt(20, seed=9)
    prompt = base + base[:6]                         # the model tends to copy; lookup finds base again
    plain = list(m.generate_ids(prompt, 40, ignore_eos=True))
    cfg = resolve("lookup", K)
    sch = Scheduler(m.forward, slots=1, prefill_chunk=16, speculative=cfg)
    seq = sch.add(Sequence(prompt, 40, SamplingParams()))
    sch.run_until_idle()
    assert seq.generated == plain
    assert seq.spec.index.tokens == seq.history[:len(seq.spec.index.tokens)] and len(seq.spec.index.tokens) > len(prompt)


def test_sampling_keeps_the_target_distribution(monkeypatch, tmp_path):
    """With sampling (temperature 1), a guess of the second token is accepted when the drawn
    token equals it (probability p(guess)), otherwise the drawn token is the residual's: the
    second token must follow the model's distribution P(x2) = sum over x1 of p(x1) p(x2 | x1),
    checked by a chi-square test over 1024 draws."""
    d = make_random_checkpoint(FAMILIES["llama"], tmp_path / "s", seed=10, std=0.6)
    m = cpullm.load(d, quant="f32", threads=2, n_ctx=64, max_chunk=16)
    fwd = m.forward
    prompt = _prompt(5, seed=11)
    p1 = _softmax(fwd.prefill(fwd.new_slot(), prompt))
    marginal = np.zeros(p1.size)
    for x1 in np.flatnonzero(p1 > 1e-7):
        slot = fwd.new_slot()
        fwd.prefill(slot, prompt)
        marginal += p1[x1] * _softmax(fwd.step([slot], [int(x1)])[0][0])
    guess = int(np.argmax(marginal))
    monkeypatch.setattr(SeqSpec, "lookup",
                        lambda spec, history, k: [guess] if len(history) == len(prompt) + 1 else [])
    n, width = 1024, 16
    counts = np.zeros(p1.size)
    cfg = resolve("lookup", 2)
    passes = 0
    for start in range(0, n, width):
        sch = Scheduler(fwd, slots=width, prefill_chunk=16, speculative=cfg)
        seqs = [sch.add(Sequence(prompt, 3, SamplingParams(temperature=1.0, seed=start + i))) for i in range(width)]
        sch.run_until_idle()
        passes += sch.spec_stats.verify_passes
        for s in seqs:
            counts[s.generated[1]] += 1
    assert passes == n                               # every second token came through a verify pass
    expected = marginal * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    chi2 = float(((obs - exp) ** 2 / np.maximum(exp, 1e-9)).sum())
    pval = _chi2_sf(chi2, len(obs) - 1)
    assert pval > 1e-3, f"chi-square p = {pval:.2e}: the output is not the model's distribution"


def _chi2_sf(x: float, df: int) -> float:
    """P(chi-square with ``df`` degrees of freedom > x), by the Wilson-Hilferty normal
    approximation (good to a few percent of p at these sizes)."""
    import math
    z = ((x / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def _softmax(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


# ---- units ----------------------------------------------------------------------------------------

def test_lookup_proposes_what_followed_the_last_occurrence():
    ix = LookupIndex()
    ix.extend([1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 1, 2, 3])
    assert ix.propose(3) == [4, 5, 9]               # the longest tail match first: "1 2 3" (not "2 3")
    ix.extend([4])
    assert ix.propose(2) == [5, 9]                  # "1 2 3 4" continued with 5
    ix.extend([6, 2, 3])
    assert ix.propose(2) == [4, 6]                  # no earlier "4 6 2 3" or "6 2 3"; "2 3" last went on 4 6
    assert LookupIndex().propose(4) == []


def _waits_after_failures(p: Pacer, n: int = 7) -> list[int]:
    """The steps ``p`` waits after each of ``n`` passes whose guesses all fail."""
    waits = []
    for _ in range(n):
        p.record(p.k, 0)
        w = 0
        while p.budget() == 0:
            w += 1
        waits.append(w)
    return waits


def test_pacer_backs_off_when_guesses_fail_and_grows_when_they_hold():
    p = Pacer(8)
    assert p.budget() == 4
    p.record(4, 4)
    assert p.budget() == 8
    assert _waits_after_failures(p) == [1, 2, 4, 8, 16, 32, 32]
    assert p.k == 1
    p.record(1, 1)                                  # one guess, kept: the draft grows, the backoff stands
    assert p.k == 2 and p.cooldown == 32
    p.record(2, 2)
    assert p.k == 4 and p.cooldown == 1
    # failures between passes that keep one guess still back off; two kept end the backoff
    p.record(p.k, 0)
    for want in (2, 4):
        p.record(4, 1)
        assert p.cooldown == want
        p.record(p.k, 0)
    p.record(4, 2)
    assert p.cooldown == 1 and p.k == 3
    # where a guessed row costs more than an INT8 program's (REF_ROW_COST), the waits grow with it
    assert Pacer(8, REF_ROW_COST / 2).wait_scale == 1.0
    assert _waits_after_failures(Pacer(8, row_cost=5 * REF_ROW_COST)) == [5, 10, 20, 40, 80, 160, 160]


@pytest.mark.parametrize("bad", [0, 33, -1, 2.5, True])
def test_draft_max_out_of_range_names_the_fix(bad):
    with pytest.raises(ConfigError, match="--draft-max must be an integer in 1..32"):
        resolve("lookup", bad)


def test_bad_mode_and_draft_without_model():
    with pytest.raises(ConfigError, match="--speculative must be one of off, lookup, draft, auto"):
        resolve("ngram")
    with pytest.raises(ConfigError, match="--draft-model"):
        resolve("draft")


# ---- a draft model ----------------------------------------------------------------------------------

def test_draft_model_guesses_and_the_output_stays_exact(tmp_path):
    target = cpullm.load(make_random_checkpoint(FAMILIES["llama"], tmp_path / "t", seed=12), quant="int8",
                         threads=2, n_ctx=96, max_chunk=16)
    small = dict(FAMILIES["llama"], num_hidden_layers=1)
    draft = cpullm.load(make_random_checkpoint(small, tmp_path / "d", seed=12), quant="int8", threads=2,
                        n_ctx=96, max_chunk=16)
    prompts = [_prompt(9, seed=13), _prompt(17, seed=14)]
    plain = [list(target.generate_ids(p, 20, ignore_eos=True)) for p in prompts]
    target.speculate("draft", draft, 4)
    assert [list(target.generate_ids(p, 20, ignore_eos=True)) for p in prompts] == plain
    sch = Scheduler(target.forward, slots=2, prefill_chunk=16, speculative=target.speculative)
    seqs = [sch.add(Sequence(p, 20, SamplingParams())) for p in prompts]
    sch.run_until_idle()
    assert [s.generated for s in seqs] == plain
    assert sch.spec_stats.verify_passes > 0 and target.speculative.draft.steps > 0
    # refused pairs: the draft larger than the target, another vocabulary, a recurrent state
    with pytest.raises(ConfigError, match="smaller --draft-model"):
        draft.speculate("draft", target)
    other = cpullm.load(make_random_checkpoint(dict(small, vocab_size=small["vocab_size"] + 2048), tmp_path / "v"),
                        quant="int8", threads=2, n_ctx=96, max_chunk=16)
    with pytest.raises(ConfigError, match="does not share the target's tokenizer"):
        target.speculate("draft", other)


def test_auto_uses_a_draft_only_when_its_measured_costs_pay():
    import types
    from cpullm.generate.speculative import (DraftModel, PROBE_EVERY, RECENT_ROUNDS, draft_pays,
                                             expected_tokens)
    assert expected_tokens(0.0, 4) == 1.0 and abs(expected_tokens(0.5, 2) - 1.75) < 1e-12
    # a draft step 0.4 of a plain step, a verify pass 1.3: 3.36 tokens at acceptance 0.8 (pays), 2.31 at 0.6
    assert draft_pays(1.0, 0.4, 1.3, 4, 0.8) and not draft_pays(1.0, 0.4, 1.3, 4, 0.6)
    dm = DraftModel(types.SimpleNamespace(forward=None))
    assert not dm.pays(None, None, 4)                 # no plain pass measured yet: plain decode first
    assert dm.pays(1.0, None, 4)                      # the draft not measured yet: tried
    dm.step_s, dm.steps = 4.0, 10
    assert dm.pays(1.0, 1.3, 4)                       # at the prior acceptance (0.8)
    for _ in range(10):
        dm.scored(10, 6)
    assert not dm.pays(1.0, 1.3, 4)                   # at the measured one
    dm.step_s = 1.0                                   # a cheap draft pays at 0.6
    assert dm.pays(1.0, 1.3, 4)
    dm.step_s = 4.0
    # a draft that stopped paying is tried again now and then, and its recent rounds decide
    picks = [dm.pays(1.0, 1.3, 4) for _ in range(2 * PROBE_EVERY)]
    assert picks.count(True) == 2 and picks[PROBE_EVERY - 1]
    for _ in range(RECENT_ROUNDS):
        dm.scored(10, 10)                             # the text turned to one it guesses
    assert dm.acceptance == 1.0 and dm.pays(1.0, 1.3, 4)


def test_the_constraint_mask_applies_to_guessed_tokens(tmp_path, monkeypatch):
    """Guesses that break a regex are rejected by the mask (each row's token is the masked
    choice), guesses that follow it are kept: the output is the plain constrained output."""
    pytest.importorskip("llguidance", reason="llguidance (cpullm[structured]) is not installed")
    import re
    m = cpullm.load(make_random_checkpoint(FAMILIES["llama"], tmp_path / "c", seed=3), quant="int8", threads=2,
                    n_ctx=128, max_chunk=16)
    m.speculate("off")
    regex = r"(ab|ba){1,3}-[0-9]{2}"
    prompt = [5, 9, 33, 17]
    plain = list(m.generate_ids(prompt, 24, regex=regex))
    assert re.fullmatch(regex, m.tokenizer.decode(plain))
    for wrong_at in (0, 1, 3):
        oracle = Oracle(prompt, plain, lambda done: wrong_at)
        monkeypatch.setattr(SeqSpec, "lookup", lambda spec, history, k: oracle(spec, history, k))
        sch = Scheduler(m.forward, slots=2, prefill_chunk=16, speculative=resolve("lookup", K))
        seq = sch.add(Sequence(prompt, 24, SamplingParams(), stop_ids=m.eos_token_ids,
                               constraint=m.constraint({"regex": regex})))
        sch.run_until_idle()
        assert seq.generated == plain and seq.stats.stop_reason == "stop"
        assert sch.spec_stats.verify_passes > 0


def test_cli_flags_are_checked_before_the_model_loads():
    import argparse

    from cpullm.cli.commands.common import add_speculative_options, load_model
    p = argparse.ArgumentParser()
    add_speculative_options(p)
    args = p.parse_args(["--speculative", "lookup", "--draft-max", "0"])
    args.model = "no-such-model-anywhere"
    with pytest.raises(ConfigError, match="--draft-max must be an integer in 1..32"):
        load_model(args)
    args = p.parse_args(["--speculative", "draft"])
    args.model = "no-such-model-anywhere"
    with pytest.raises(ConfigError, match="give --draft-model MODEL"):
        load_model(args)


def test_a_lone_stream_decodes_plainly_until_the_batched_step_is_compiled(tmp_path, monkeypatch):
    """SpecConfig.compile_first (the CLI's run and chat): while the batched step is not compiled,
    a lone sequence makes no verify pass and a child compiles the step (asked once a step);
    then it speculates. The tokens are plain decoding's throughout."""
    import attrs
    d = make_random_checkpoint(FAMILIES["llama"], tmp_path / "l", seed=8)
    m = cpullm.load(d, quant="int8", threads=2, n_ctx=128, max_chunk=16)
    prompt = _prompt(13, seed=5)
    plain = list(m.generate_ids(prompt, 24, ignore_eos=True))
    oracle = Oracle(prompt, plain, lambda done: K)                   # every guess right
    monkeypatch.setattr(SeqSpec, "lookup", lambda spec, history, k: oracle(spec, history, k))
    dec = m.forward.decoder
    ready, started = [False], []
    monkeypatch.setattr(dec, "compiled", lambda states: ready[0])
    monkeypatch.setattr(dec, "compile_in_background", lambda states: started.append(states))
    cfg = attrs.evolve(resolve("lookup", K), compile_first=True)
    for is_ready in (False, True):
        ready[0], started[:] = is_ready, []
        sch = Scheduler(m.forward, slots=1, prefill_chunk=16, speculative=cfg)
        seq = sch.add(Sequence(prompt, 24, SamplingParams()))
        sch.run_until_idle()
        assert seq.generated == plain
        if is_ready:
            assert sch.spec_stats.verify_passes > 0 and not started
        else:
            assert sch.spec_stats.verify_passes == 0 and len(started) > 0


def test_the_batched_steps_signature_is_the_one_it_compiles(tmp_path):
    """BatchDecoder.fused_signature names the types a verify pass calls the step with: after one
    pass the step counts as compiled, so a background compile of that signature is the one used."""
    d = make_random_checkpoint(FAMILIES["llama"], tmp_path / "l", seed=8)
    m = cpullm.load(d, quant="int8", threads=2, n_ctx=128, max_chunk=16)
    fwd = m.forward
    slot = fwd.new_slot()
    fwd.prefill(slot, _prompt(9, seed=3))
    fwd.verify_argmax([slot], [_prompt(3, seed=4)])
    from cpullm.run.batch import _fused
    assert fwd.decoder.fused_signature(slot.table) in _fused.overloads
    assert fwd.decoder.compiled(slot.table)


@pytest.mark.cold
def test_the_background_compile_fills_the_cache(tmp_path):
    """BatchDecoder.compile_in_background's child compiles the batched step into numba's cache
    in the state a fresh machine is in after its first token: every kernel the step calls is
    cached, the step itself is not (the child must start numba's threading layer for the parallel
    kernels it loads)."""
    from pathlib import Path
    from cpullm.run.batch import _fused
    d = make_random_checkpoint(FAMILIES["llama"], tmp_path / "l", seed=8)
    m = cpullm.load(d, quant="int8", threads=2, n_ctx=128, max_chunk=16)
    fwd = m.forward
    slot = fwd.new_slot()
    fwd.prefill(slot, _prompt(9, seed=3))
    fwd.verify_argmax([slot], [_prompt(3, seed=4)])          # the step and its kernels, cached
    index = Path(_fused._cache._cache_file._index_path)
    for f in index.parent.glob(index.name[:-len(".nbi")] + ".*"):
        f.unlink()                                             # the step's own entries only
    dec = fwd.decoder
    dec.compile_in_background(slot.table)
    assert dec._compiler.wait(timeout=900) == 0
    key = _fused._cache._index_key(dec.fused_signature(slot.table), _fused.targetctx.codegen())
    assert key in _fused._cache._cache_file._load_index()
