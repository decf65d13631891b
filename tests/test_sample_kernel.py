"""cpullm_kernels.ops.sample against the sampler's definition in numpy (a full sort of the vocabulary):
the same tokens kept by top-k, top-p and min-p, each drawn for the same share of [0, 1)."""
import numpy as np
import pytest

from cpullm_kernels.ops.sample import LEVELS, sample_logits
from cpullm.generate.sampling import Sampler, SamplingParams


def reference_cdf(x, t, top_k, top_p, min_p):
    """(kept ids ascending, cumulative probability at each) as the numpy sampler defines them."""
    x = np.asarray(x, np.float64) / t
    if top_k and top_k < x.size:
        kth = np.partition(x, -top_k)[-top_k]
        x = np.where(x < kth, -np.inf, x)
    m = x[np.isfinite(x)].max()
    probs = np.exp(x - m)
    probs /= probs.sum()
    if top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cut = np.searchsorted(np.cumsum(probs[order]), top_p) + 1
        keep = np.zeros(x.size, bool)
        keep[order[:cut]] = True
        probs = np.where(keep, probs, 0.0)
    if min_p > 0.0:
        probs = np.where(probs >= min_p * probs.max(), probs, 0.0)
    ids = np.flatnonzero(probs > 0)
    cdf = np.cumsum(probs[ids]) / probs[ids].sum()
    return ids, cdf


def logits_like_a_model(rng, n, spread):
    """A few likely tokens over a long tail, some ties."""
    x = rng.standard_normal(n).astype(np.float32) * spread
    x[rng.integers(0, n, 8)] += 3 * spread
    x[rng.integers(0, n, 4)] = x.max()                  # ties at the top
    return x


CASES = [(0.7, 0, 0.9, 0.0), (1.0, 0, 1.0, 0.0), (0.7, 40, 1.0, 0.0), (0.7, 40, 0.9, 0.0),
         (1.3, 0, 0.5, 0.05), (0.2, 0, 0.99, 0.0), (2.0, 0, 0.999, 0.0), (0.7, 1, 1.0, 0.0),
         (1.0, 0, 1.0, 0.1), (5.0, 0, 0.95, 0.0)]


@pytest.mark.parametrize("t,top_k,top_p,min_p", CASES)
@pytest.mark.parametrize("spread", [0.5, 3.0, 12.0])
def test_every_kept_token_is_drawn_for_its_share(t, top_k, top_p, min_p, spread):
    rng = np.random.default_rng(int(spread * 10) + top_k)
    x = logits_like_a_model(rng, 5003, spread)
    ids, cdf = reference_cdf(x, t, top_k, top_p, min_p)
    e = np.empty(x.size, np.float32)
    lo = np.concatenate([[0.0], cdf[:-1]])
    mids = (lo + cdf) / 2
    tight = (cdf - lo) < 1e-4             # a share too thin for float32 weights to place exactly
    got = np.array([sample_logits(x, 1.0 / t, top_k, top_p, min_p, float(u), e) for u in mids])
    assert np.array_equal(got[~tight], ids[~tight])
    assert set(got.tolist()) <= set(ids.tolist())       # never a token the cuts remove


def test_banned_tokens_are_never_drawn_and_all_banned_is_refused():
    x = np.full(1000, -np.inf)
    x[[3, 500]] = [1.0, 1.0]
    e = np.empty(x.size, np.float32)
    assert {sample_logits(x, 1.0, 0, 1.0, 0.0, u, e) for u in np.linspace(0, 0.999, 50)} == {3, 500}
    assert sample_logits(np.full(10, -np.inf), 1.0, 0, 0.9, 0.0, 0.5, np.empty(10, np.float32)) == -1
    # top-k past the finite logits (a mask left fewer): every allowed token stays
    for top_p in (1.0, 0.999):
        assert {sample_logits(x, 1.0, 40, top_p, 0.0, u, e) for u in np.linspace(0, 0.999, 50)} == {3, 500}


def test_a_flat_tail_past_the_last_level_is_still_cut_exactly():
    # a top token far above a flat tail: top-p 0.6 keeps it alone; 0.99 needs the tail past the
    # last level, whose head is then the whole vocabulary (lower ids first among the tail's ties)
    x = np.zeros(3000, np.float32)
    x[7] = LEVELS[-1] * 1.5
    t = x[7] / np.log(3000.0)            # the top token holds about half of the probability
    e = np.empty(x.size, np.float32)
    for top_p in (0.4, 0.99):
        ids, cdf = reference_cdf(x, t, 0, top_p, 0.0)
        lo = np.concatenate([[0.0], cdf[:-1]])
        got = [sample_logits(x, 1.0 / t, 0, top_p, 0.0, float(u), e) for u in (lo + cdf) / 2]
        assert got == ids.tolist()


def test_the_sampler_is_seeded_and_matches_its_kernel():
    x = logits_like_a_model(np.random.default_rng(5), 2000, 3.0)
    p = SamplingParams(temperature=0.7, top_p=0.9, seed=11)
    a = [Sampler(p).draw(x) for _ in range(3)]
    s1, s2 = Sampler(SamplingParams(temperature=0.7, top_p=0.9, seed=11)), Sampler(SamplingParams(temperature=0.7, top_p=0.9, seed=11))
    assert [s1.draw(x) for _ in range(20)] == [s2.draw(x) for _ in range(20)]
    assert len(set(a)) == 1
