"""The scheduler: batch invariance (a request's greedy tokens are the same alone and among
others of different lengths, in f32 and int8, and in int8 the tokens ``generate`` gives alone),
for a tiny random model of every family structure: plain GQA (Llama), biases and sliding-window
layers (Qwen2), linear-attention layers with per-sequence recurrent state (Qwen3.5), alternating
local/global layers with soft-capping (Gemma 2, Gemma 3). Also cancellation, slot reuse and
chunked prefill interleaved with decode."""
import threading

import numpy as np
import pytest

import cpullm
from cpullm.errors import ConfigError, ContextOverflowError
from cpullm.generate.sampling import SamplingParams
from cpullm.generate.scheduler import Scheduler
from cpullm.generate.sequence import Sequence
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
# prompt lengths: shorter and longer than the sliding windows (8-12) and than a prefill chunk (16)
LENGTHS = (5, 41, 1, 23, 12)
N_NEW = 14


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_dir(request, tmp_path_factory):
    return request.param, make_random_checkpoint(FAMILIES[request.param], tmp_path_factory.mktemp(request.param),
                                                 seed=3)


def _prompts(seed=0):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, 256, n)] for n in LENGTHS]


def _run(model, prompts, slots=4, n_new=N_NEW, params=None):
    sch = Scheduler(model.forward, slots=slots, prefill_chunk=16)
    seqs = [sch.add(Sequence(p, n_new, params or SamplingParams())) for p in prompts]
    sch.run_until_idle()
    assert sch.idle and sorted(sch.free) == list(range(slots))      # every slot given back
    return [s.generated for s in seqs]


@pytest.mark.parametrize("quant,kv_dtype", [("int8", None), ("int8", "f32"), ("int8", "q8_0"),
                                            ("f32", None)])   # None: f16 / f32
def test_greedy_tokens_do_not_depend_on_the_batch(family_dir, quant, kv_dtype):
    name, d = family_dir
    m = cpullm.load(d, quant=quant, threads=2, n_ctx=128, max_chunk=16, kv_dtype=kv_dtype)
    assert m.kv_dtype == (kv_dtype or ("f16" if quant == "int8" else "f32"))
    prompts = _prompts()
    alone = [_run(m, [p])[0] for p in prompts]
    assert all(len(t) == N_NEW for t in alone)
    mixed = _run(m, prompts)                          # 5 requests over 4 slots: one waits, joins later
    assert mixed == alone
    assert _run(m, prompts[::-1], slots=5)[::-1] == alone
    if quant == "int8":         # the one-token decode's numerics row by row: generate()'s tokens
        assert alone == [list(m.generate_ids(p, N_NEW, ignore_eos=True)) for p in prompts]


def test_sampled_requests_keep_their_own_seeded_draws(family_dir):
    _, d = family_dir
    m = cpullm.load(d, quant="int8", threads=2, n_ctx=128, max_chunk=16)
    prompts = _prompts(1)
    params = [SamplingParams(temperature=0.9, top_k=40, seed=i) for i in range(len(prompts))]

    def run(idx):
        sch = Scheduler(m.forward, slots=4, prefill_chunk=16)
        seqs = [sch.add(Sequence(prompts[i], 10, params[i])) for i in idx]
        sch.run_until_idle()
        return {i: s.generated for i, s in zip(idx, seqs)}
    alone = {}
    for i in range(len(prompts)):
        alone.update(run([i]))
    assert run(list(range(len(prompts)))) == alone


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = make_random_checkpoint(FAMILIES["llama"], tmp_path_factory.mktemp("llama_s"), seed=4)
    return cpullm.load(d, quant="int8", threads=2, n_ctx=96, max_chunk=16)


def test_cancel_frees_the_slot_at_once_and_others_are_unaffected(llama):
    prompts = _prompts(2)
    alone = [_run(llama, [p])[0] for p in prompts]
    sch = Scheduler(llama.forward, slots=2, prefill_chunk=16)
    seqs = [sch.add(Sequence(p, N_NEW, SamplingParams())) for p in prompts]
    ended = []
    while not sch.idle:
        for seq, tok in sch.step():
            if tok is None:
                ended.append(seq)
            elif seq is seqs[0] and len(seq.generated) == 3:
                seq.cancel()
    assert seqs[0].stats.stop_reason == "cancelled" and seqs[0].generated == alone[0][:3]
    assert [s.generated for s in seqs[1:]] == alone[1:]
    assert set(ended) == set(seqs)


def test_long_prompt_is_prefilled_in_chunks_between_decode_steps(llama):
    sch = Scheduler(llama.forward, slots=2, prefill_chunk=16)
    short = sch.add(Sequence([1, 2, 3], 40, SamplingParams()))
    sch.step()                                              # short: prefilled, first token
    long = sch.add(Sequence(list(range(60)), 2, SamplingParams()))
    grew = []
    while long.position < 60:
        n = len(short.generated)
        sch.step()
        grew.append(len(short.generated) - n)
    assert len(grew) == 4 and all(g == 1 for g in grew)     # 60 tokens = 4 chunks, a token of short each


def test_prompt_longer_than_the_context_is_refused(llama):
    sch = Scheduler(llama.forward, slots=2)
    with pytest.raises(ContextOverflowError, match="--ctx"):
        sch.add(Sequence(list(range(97)), 4, SamplingParams()))
    with pytest.raises(ConfigError, match="--parallel"):
        Scheduler(llama.forward, slots=17)
    assert sch.kv_bytes == 2 * llama.forward.state_floats * 4


def test_generation_stops_at_the_end_of_the_context(llama):
    out = _run(llama, [list(range(90))], n_new=20)[0]
    assert len(out) == 96 - 90 + 1          # the token after the last position is still emitted
    assert out == list(llama.generate_ids(list(range(90)), 20, ignore_eos=True))


def test_core_gated_delta_runs_per_sequence(tmp_path):
    """Qwen3.5's linear-attention layers through the core kernel (the plugin's fused kernel off):
    each sequence's recurrent state is its own."""
    d = make_random_checkpoint(FAMILIES["qwen3_5_linear"], tmp_path / "q", seed=5)
    m = cpullm.load(d, quant="int8", threads=2, n_ctx=128, max_chunk=16, plugin_kernels=False)
    assert not m.executor.external and m.executor.has_linear_state
    prompts = _prompts(3)
    alone = [_run(m, [p])[0] for p in prompts]
    assert _run(m, prompts) == alone
    assert alone == [list(m.generate_ids(p, N_NEW, ignore_eos=True)) for p in prompts]


# ---- the Python API: model.generate_batch and the threaded engine ------------------------------------

def test_generate_batch_equals_generate_per_prompt(llama):
    prompts = _prompts(4)
    texts = ["hello there", "a longer prompt about a quiet village by the sea"]
    out = llama.generate_batch(prompts + texts, max_new_tokens=8, ignore_eos=True, parallel=3)
    assert out[:len(prompts)] == [list(llama.generate_ids(p, 8, ignore_eos=True)) for p in prompts]
    assert out[len(prompts):] == [llama.tokenizer.decode(list(llama.generate_ids(t, 8, ignore_eos=True)))
                                  for t in texts]
    sampled = llama.generate_batch(prompts[:2], max_new_tokens=6,
                                   sampling=[{"temperature": 0.8, "seed": 1}, {"temperature": 0.0}])
    assert sampled[0] == list(llama.generate_ids(prompts[0], 6, temperature=0.8, seed=1))
    assert sampled[1] == list(llama.generate_ids(prompts[1], 6))


def test_engine_serves_threads_with_cancel(llama):
    prompts = _prompts(5)
    alone = [list(llama.generate_ids(p, N_NEW, ignore_eos=True)) for p in prompts]
    with llama.engine(parallel=3) as eng:
        reqs = [eng.submit(p, N_NEW, stop_ids=()) for p in prompts]
        victim = eng.submit(list(range(30)), 200, stop_ids=())
        got = {}

        def consume(i, r):
            got[i] = list(r)
        threads = [threading.Thread(target=consume, args=(i, r)) for i, r in enumerate(reqs)]
        for t in threads:
            t.start()
        for n, _ in enumerate(victim):
            if n == 2:
                victim.cancel()
        for t in threads:
            t.join(60)
        assert [got[i] for i in range(len(prompts))] == alone
        # a cancel takes effect within a few passes; a pass may keep up to DEFAULT_DRAFT_MAX
        # guessed tokens plus its own (speculation is on by default)
        from cpullm.generate.speculative import DEFAULT_DRAFT_MAX
        assert victim.stats.stop_reason == "cancelled"
        assert len(victim.seq.generated) < 2 + 3 * (DEFAULT_DRAFT_MAX + 1) < 200
        assert eng.counts()["running"] == 0 and eng.counts()["free_slots"] == 3


def test_a_request_submitted_mid_stream_joins_the_running_decode(llama):
    """Continuous batching, counted in tokens rather than time: a 3-token request submitted
    when a 60-token stream has emitted 3 tokens ends a few scheduler steps later (one to
    prefill, then one token a step beside the long stream), long before that stream ends; both
    equal what they give alone."""
    long_prompt, short_prompt = [5, 6, 7], [9, 8]
    want_long = list(llama.generate_ids(long_prompt, 60, ignore_eos=True))
    want_short = list(llama.generate_ids(short_prompt, 3, ignore_eos=True))
    order, short = [], []
    with llama.engine(parallel=2) as eng:
        def on_long(tok):                      # runs on the engine's thread, between steps
            order.append(("long", tok))
            if tok is not None and sum(1 for k, t in order if k == "long") == 3:
                short.append(eng.submit(short_prompt, 3, stop_ids=(),
                                        on_token=lambda t: order.append(("short", t))))
        long = eng.submit(long_prompt, 60, stop_ids=(), on_token=on_long)
        assert long.finished.wait(120) and short and short[0].finished.wait(120)
    long_before_short_ended = sum(1 for k, t in order[:order.index(("short", None))] if k == "long")
    assert long_before_short_ended <= 3 + 4           # prefill step + 3 decode steps, with slack of 1
    assert [t for k, t in order if k == "long"] == want_long + [None]
    assert [t for k, t in order if k == "short"] == want_short + [None]


def test_parallel_is_planned_against_available_memory(llama, monkeypatch):
    from cpullm.generate import engine
    slot = llama.forward.state_floats * 4
    monkeypatch.setattr(engine, "available_memory_bytes", lambda: 10 * slot)
    assert engine.default_parallel(llama) == min(engine.MAX_DEFAULT_PARALLEL, 4 * llama.threads, 5)
    with pytest.raises(ConfigError, match="lower --parallel or --ctx"):
        engine.Engine(llama, parallel=11)


def test_long_positions_split_keys_the_same_way_batched(llama):
    """At positions past 2 x 32 keys the 3-KV-head model's decode splits each head's keys over the
    2 threads: the batched rows still equal generate()'s."""
    prompts = [list(range(3, 73)), list(range(5, 85)), [9, 8, 7]]
    want = [list(llama.generate_ids(p, 10, ignore_eos=True)) for p in prompts]
    assert _run(llama, prompts, n_new=10) == want


def test_mixed_load_through_the_engine(llama):
    """40 requests from 8 threads on 4 slots: different lengths, greedy and seeded sampling, a
    quarter cancelled after a few tokens. Every request that completes equals the same request
    run alone (generate), and every slot comes back."""
    rng = np.random.default_rng(7)
    reqs = []
    for i in range(40):
        prompt = [int(t) for t in rng.integers(0, 256, int(rng.integers(1, 50)))]
        sampling = {} if i % 3 else {"temperature": 0.8, "top_p": 0.9, "seed": i}
        reqs.append((prompt, int(rng.integers(1, 20)), sampling, i % 4 == 1))
    results = {}
    with llama.engine(parallel=4) as eng:
        def client(k):
            for i in range(k, len(reqs), 8):
                prompt, n, sampling, cancel = reqs[i]
                r = eng.submit(prompt, n, stop_ids=(), **sampling)
                got = []
                for tok in r:
                    got.append(tok)
                    if cancel and len(got) == 2:
                        r.cancel()
                results[i] = (got, r.stats.stop_reason)
        threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert eng.counts() == {"parallel": 4, "waiting": 0, "running": 0, "free_slots": 4}
    assert len(results) == len(reqs)
    for i, (prompt, n, sampling, cancel) in enumerate(reqs):
        got, reason = results[i]
        want = list(llama.generate_ids(prompt, n, ignore_eos=True, **sampling))
        if reason == "cancelled":
            assert cancel and got == want[:len(got)]
        else:
            assert got == want and reason == "length"
