"""Prefix sharing in the scheduler (cpullm.run.prefix_cache): requests that start with the same whole
prefill chunks restore that state instead of prefilling it, and their greedy tokens are the
same as without the cache, in f32 and int8, for full attention (Llama), sliding-window layers
(Qwen2) and linear-attention layers with a recurrent state (Qwen3.5)."""
import numpy as np
import pytest

import cpullm
from cpullm.errors import ConfigError
from cpullm.run.prefix_cache import PrefixCache
from cpullm.generate.sampling import SamplingParams
from cpullm.generate.scheduler import Scheduler
from cpullm.generate.sequence import Sequence
from cpullm.testing import make_random_checkpoint
from test_scheduler import FAMILIES

CHUNK = 16
N_NEW = 10
SHARED = 2 * CHUNK + 5           # two whole chunks can be reused, 5 more shared tokens cannot


@pytest.fixture(scope="module", params=["llama", "qwen2_sliding", "qwen3_5_linear"])
def family_dir(request, tmp_path_factory):
    return make_random_checkpoint(FAMILIES[request.param], tmp_path_factory.mktemp(request.param), seed=7)


def _prompts():
    rng = np.random.default_rng(11)
    system = [int(t) for t in rng.integers(0, 256, SHARED)]
    tails = [rng.integers(0, 256, n) for n in (1, 9, 20, 0)]
    # the last one is the system prompt alone: only one whole chunk is shorter than it and reusable
    return [system + [int(t) for t in tail] for tail in tails] + [system[:CHUNK + 1]]


def _run(model, prompts, slots, budget):
    sch = Scheduler(model.forward, slots=slots, prefill_chunk=CHUNK, prefix_cache_bytes=budget)
    seqs = [sch.add(Sequence(p, N_NEW, SamplingParams())) for p in prompts]
    sch.run_until_idle()
    return sch, [s.generated for s in seqs], [s.reused for s in seqs]


@pytest.mark.parametrize("quant,kv_dtype", [("int8", None), ("f32", None), ("int8", "q8_0")])
def test_prefix_hits_give_the_same_greedy_tokens(family_dir, quant, kv_dtype):
    m = cpullm.load(family_dir, quant=quant, threads=2, n_ctx=128, max_chunk=CHUNK, kv_dtype=kv_dtype)
    prompts = _prompts()
    alone = [_run(m, [p], 1, 0)[1][0] for p in prompts]

    # one slot: each request runs after the previous one recorded the shared chunks
    sch, got, reused = _run(m, prompts, 1, 64 * 2**20)
    assert got == alone
    assert reused == [0, 2 * CHUNK, 2 * CHUNK, 2 * CHUNK, CHUNK]
    assert sch.prefilled_tokens == sum(len(p) for p in prompts) - sum(reused)
    st = sch.prefix_cache.stats()
    assert st["hits"] == 4 and st["misses"] == 1 and st["reused_tokens"] == sum(reused)
    assert st["bytes"] > 0 and st["bytes"] <= st["budget_bytes"]

    # several at once: later ones join while others decode; those admitted together restore what
    # the first recorded before their own first chunk, or between their chunks
    sch, got, reused = _run(m, prompts + prompts[::-1], 4, 64 * 2**20)
    assert got == alone + alone[::-1]
    assert all(r > 0 for r in reused[1:]) and sch.prefix_cache.stats()["misses"] == 1
    assert sch.prefilled_tokens == 2 * sum(len(p) for p in prompts) - sum(reused)


def test_budget_bounds_the_cache_and_evicts_least_recently_used(family_dir):
    m = cpullm.load(family_dir, quant="int8", threads=2, n_ctx=128, max_chunk=CHUNK)
    probe = PrefixCache(m.program.meta["state_regions"], CHUNK, 1)
    one = probe.block_bytes()
    prompts = _prompts()
    alone = [_run(m, [p], 1, 0)[1][0] for p in prompts]
    # room for one block: each block recorded evicts the one before (no prefix is whole)
    sch, got, reused = _run(m, prompts, 1, one)
    assert got == alone
    st = sch.prefix_cache.stats()
    assert st["bytes"] <= one and st["blocks"] == 1 and st["evicted_blocks"] > 0
    # a budget smaller than a block: nothing stored, nothing reused
    sch, got, reused = _run(m, prompts, 1, one - 1)
    assert got == alone and reused == [0] * len(prompts) and sch.prefix_cache.stats()["blocks"] == 0


def test_other_prefixes_do_not_hit(family_dir):
    m = cpullm.load(family_dir, quant="int8", threads=2, n_ctx=128, max_chunk=CHUNK)
    a = list(range(40))
    b = list(range(40))
    b[CHUNK - 1] += 1                          # differs inside the first chunk
    c = list(range(40))
    c[CHUNK] += 1                              # shares the first chunk only
    sch, got, reused = _run(m, [a, b, c], 1, 2**20 * 64)
    assert reused == [0, 0, CHUNK]
    assert got == [_run(m, [p], 1, 0)[1][0] for p in (a, b, c)]


def test_engine_shares_prefixes_by_default_and_reports_them(tmp_path):
    d = make_random_checkpoint(FAMILIES["llama"], tmp_path / "m", seed=8)
    m = cpullm.load(d, quant="int8", threads=2, n_ctx=128, max_chunk=CHUNK)
    prompts = _prompts()
    alone = [_run(m, [p], 1, 0)[1][0] for p in prompts]
    with m.engine(parallel=2) as eng:
        assert eng.prefix_stats()["budget_bytes"] > 0
        first = eng.submit(prompts[0], N_NEW, stop_ids=()).result()
        rest = [eng.submit(p, N_NEW, stop_ids=()) for p in prompts[1:]]
        got = [first] + [r.result() for r in rest]
        st = eng.prefix_stats()
    assert got == alone
    assert st["hits"] == len(prompts) - 1 and st["reused_tokens"] == 3 * 2 * CHUNK + CHUNK
    assert st["prefilled_tokens"] == sum(len(p) for p in prompts) - st["reused_tokens"]
    with m.engine(parallel=2, prefix_cache_bytes=0) as eng:
        assert [eng.submit(p, N_NEW, stop_ids=()).result() for p in prompts] == alone
        assert eng.prefix_stats()["hits"] == 0 and eng.prefix_stats()["bytes"] == 0
    assert m.generate_batch(prompts, N_NEW, parallel=2, ignore_eos=True) == alone


@pytest.mark.parametrize("quant", ["int8", "f32"])
def test_blocks_smaller_than_the_chunk(family_dir, quant):
    """Blocks of 4 tokens in chunks of 16: a model with full-attention and sliding-window layers
    reuses any whole block of the shared prompt (rings of 8-12 positions wrap several times in
    it); one with recurrent state only those ending where a chunk ended."""
    m = cpullm.load(family_dir, quant=quant, threads=2, n_ctx=128, max_chunk=CHUNK)
    prompts = _prompts()
    alone = [_run(m, [p], 1, 0)[1][0] for p in prompts]
    sch = Scheduler(m.forward, slots=1, prefill_chunk=CHUNK, prefix_cache_bytes=64 * 2**20, prefix_block=4)
    seqs = [sch.add(Sequence(p, N_NEW, SamplingParams())) for p in prompts]
    sch.run_until_idle()
    assert [s.generated for s in seqs] == alone
    only_full = all(r["kind"] == "kv" for r in m.program.meta["state_regions"])
    # SHARED = 37: 9 whole blocks of 4; prompts[4] is the first 17 tokens of it
    want = [0, 36, 36, 36, 16] if only_full else [0, 32, 32, 32, 16]
    assert [s.reused for s in seqs] == want
    assert sch.prefilled_tokens == sum(len(p) for p in prompts) - sum(want)
    with pytest.raises(ConfigError, match="divide the prefill chunk"):
        Scheduler(m.forward, slots=1, prefill_chunk=CHUNK, prefix_cache_bytes=1, prefix_block=5)
