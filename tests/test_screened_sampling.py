"""Sampled decoding through the lm_head screen: the token drawn from the screen's exact rows and
upper bounds (cpullm_kernels.ops.sample.sample_screened, cpullm.compile.head_screen's
sample_through_screen) is the token the full logits give with the same uniform number, for
top-k, top-p and min-p cuts; when the rows cannot prove it the screen says so (-1) and the full
head is read. Through the model: the same tokens with the same seed whichever head is read."""
from types import SimpleNamespace

import numba
import numpy as np
import pytest

import cpullm
from cpullm.compile.head_screen import sample_through_screen
from cpullm.testing import make_random_checkpoint
from cpullm_kernels.ops.sample import band_rows, sample_logits, sample_screened, screen_can_sample
from cpullm_kernels.panels import head_screen as H
from cpullm_kernels.panels import q8_panels as qp
from cpullm_kernels.rows import q8

CUTS = [(0.7, 0, 0.9, 0.0), (0.7, 40, 1.0, 0.0), (0.7, 40, 0.9, 0.0), (1.0, 0, 0.5, 0.05),
        (0.3, 0, 0.99, 0.0), (1.0, 0, 1.0, 0.1), (0.7, 1, 1.0, 0.0), (1.5, 0, 0.95, 0.0)]
UNIFORMS = np.linspace(0.0005, 0.9995, 101)


def model_like_logits(rng, n, spread):
    """A few likely tokens over a long tail, ties at the top."""
    x = rng.standard_normal(n).astype(np.float32) * spread
    x[rng.integers(0, n, 8)] += 3 * spread
    x[rng.integers(0, n, 3)] = x.max()
    return x


def screened(x, upper, lower, t, top_k, top_p, min_p, u, spans=(2.0, 8.0, 32.0)):
    """sample_screened as the executor drives it: bands of rows below the largest lower bound."""
    rows = np.zeros(x.size, np.int64)
    vals = np.zeros(x.size, np.float32)
    count, hi = 0, np.inf
    for span in spans:
        thr = float(np.float32(lower - span * t))
        start = count
        count = band_rows(upper, thr, hi, rows, start)
        vals[start:count] = x[rows[start:count]]
        tok = sample_screened(rows, vals, count, upper, thr, 1.0 / t, top_k, top_p, min_p, u,
                              np.empty(max(count, 1), np.float32))
        if tok >= 0:
            return tok
        hi = thr
    return -1


@pytest.mark.parametrize("t,top_k,top_p,min_p", CUTS)
@pytest.mark.parametrize("spread,slack", [(3.0, 0.5), (6.0, 2.0), (1.0, 0.2)])
def test_screened_draw_is_the_full_draw(t, top_k, top_p, min_p, spread, slack):
    rng = np.random.default_rng(int(spread * 7 + slack * 3 + top_k))
    x = model_like_logits(rng, 6007, spread)
    # upper bounds at the logit itself for half the rows (the tail as heavy as the bounds allow),
    # above it by up to ``slack`` for the others
    gap = np.where(rng.random(x.size) < 0.5, 0.0, rng.random(x.size) * slack).astype(np.float32)
    upper = x + gap
    lower = float((x - gap).max())
    e = np.empty(x.size, np.float32)
    got = np.array([screened(x, upper, lower, t, top_k, top_p, min_p, float(u)) for u in UNIFORMS])
    want = np.array([sample_logits(x, 1.0 / t, top_k, top_p, min_p, float(u), e) for u in UNIFORMS])
    decided = got >= 0
    assert np.array_equal(got[decided], want[decided])
    if spread >= 3.0:               # peaked logits: the screen proves the draw almost always
        assert decided.mean() > 0.9, decided.mean()


def test_an_unprovable_top_p_cut_is_refused_not_guessed():
    # two likely tokens and a tail whose weight, known only by its upper bounds, decides
    # whether top_p = 0.5 keeps one of them or both
    x = np.full(1000, -30.0, np.float32)
    x[:2] = (0.0, -0.05)
    upper = x.copy()
    upper[2:] = -2.0                        # the tail may weigh up to ~998 e^-2 ~ 135: anything
    rows = np.arange(2, dtype=np.int64)
    vals = x[:2].copy()
    for u in (0.1, 0.6, 0.9):
        assert sample_screened(rows, vals, 2, upper, -1.0, 1.0, 0, 0.5, 0.0, u, np.empty(2, np.float32)) == -1
    # the same rows with tight bounds on the tail prove it
    upper[2:] = -30.0
    e = np.empty(x.size, np.float32)
    for u in (0.1, 0.6, 0.9):
        got = sample_screened(rows, vals, 2, upper, -1.0, 1.0, 0, 0.5, 0.0, u, np.empty(2, np.float32))
        assert got == sample_logits(x, 1.0, 0, 0.5, 0.0, u, e)


def test_temperature_alone_is_never_screened():
    assert not screen_can_sample(0, 1.0, 0.0, 1000)
    assert not screen_can_sample(1000, 1.0, 0.0, 1000)          # a top_k of the whole vocabulary
    assert screen_can_sample(999, 1.0, 0.0, 1000) and screen_can_sample(0, 0.9, 0.0, 10)
    x = np.zeros(10, np.float32)
    assert sample_screened(np.arange(10, dtype=np.int64), x, 10, x, 0.0, 1.0, 0, 1.0, 0.0, 0.5,
                           np.empty(10, np.float32)) == -1


def test_band_rows_refuses_nan_and_infinite_bounds():
    for bad in (np.nan, np.inf):            # +inf: below no threshold, yet never a candidate either
        up = np.array([0.0, bad, 1.0], np.float32)
        assert band_rows(up, -1.0, np.inf, np.zeros(3, np.int64), 0) == -1
    rows = np.zeros(3, np.int64)
    assert band_rows(np.array([0.0, 2.0, 1.0], np.float32), 0.5, 2.0, rows, 0) == 1 and rows[0] == 2


# ---- the screen's own bounds and exact rows -------------------------------------------------------

def _screen(N, K, rng):
    w = rng.standard_normal((N, K)).astype(np.float32) * 0.05
    w_q, w_s = q8.quantize_weight_q8(w)
    Kp = w_q.shape[1]
    perm = H.screen_columns(np.ones(Kp), Kp, 64)
    hq, hs, hb = H.build_screen(w_q, w_s, perm, 64)
    wp, sp = qp.pack_panels(w_q, w_s)
    x = np.zeros(K, np.float32)
    args = (x, perm, 2, hq, hs, hb, wp, sp, np.zeros(Kp, np.int16), np.zeros(Kp // 32, np.float32),
            np.zeros(Kp, np.int16), np.zeros(H.padded_blocks(Kp), np.float32), np.zeros(Kp, np.float32),
            np.zeros(Kp, np.float32), np.zeros(N, np.float32), np.zeros(N, np.int64), np.zeros(N, np.float32))
    sc = SimpleNamespace(blocks=False, args=args, lower_max=np.zeros(8, np.float32), rows=N,
                         MAX_ROWS_FRACTION=1 / 4)
    return sc, w_q, w_s, wp, sp


def _full_logits(wp, sp, N, x, Kp):
    x_q, x_s = np.zeros(Kp, np.int16), np.zeros(Kp // 32, np.float32)
    q8.quantize_act_q16(x, x_q, x_s)                   # as the lm_head's LINEAR does
    out = np.zeros((1, N), np.float32)
    qp.panels_matmul(wp, sp, N, x_q[None], x_s[None], out, numba.get_num_threads())
    return out[0]


@pytest.mark.parametrize("seed", range(4))
def test_sample_through_screen_is_the_full_draw(seed):
    rng = np.random.default_rng(seed)
    N, K = 3000, 192
    sc, w_q, w_s, wp, sp = _screen(N, K, rng)
    # activations near a few rows of the head: a few likely tokens over a tail, as a model's
    hot = rng.integers(0, N, 3)
    x = (q8.dequantize_weight_q8_ref(w_q[hot], w_s[hot])[:, :K] * np.array([[40.0], [36.0], [30.0]])).sum(0)
    x = (x + rng.standard_normal(K) * 0.5).astype(np.float32)
    sc.args[0][:] = x
    full = _full_logits(wp, sp, N, x, w_q.shape[1])
    e = np.empty(N, np.float32)
    decided = 0
    for t, top_k, top_p, min_p in CUTS:
        for u in UNIFORMS[::10]:
            tok, rows = sample_through_screen(sc, numba.get_num_threads(), 1.0 / t, top_k, top_p, min_p, float(u))
            want = sample_logits(full, 1.0 / t, top_k, top_p, min_p, float(u), e)
            assert tok in (-1, want)
            if tok >= 0:
                decided += 1
                # exact rows are the lm_head's numbers, bit for bit
                r, v = sc.args[15][:rows], sc.args[16][:rows]
                assert np.array_equal(v, full[r])
    assert decided > 0


# ---- through the model --------------------------------------------------------------------------

TINY = dict(model_type="llama", hidden_size=128, intermediate_size=160, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=2000, rms_norm_eps=1e-5,
            max_position_embeddings=512, tie_word_embeddings=True, rope_theta=10000.0)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    d = make_random_checkpoint(TINY, tmp_path_factory.mktemp("screened"), seed=11)
    with pytest.MonkeyPatch.context() as mp:         # screens are for large lm_heads: allow this one
        mp.setattr(H, "MIN_LM_HEAD_BYTES", 0)
        return cpullm.load(d, use_cache=False)


@pytest.mark.parametrize("cuts", [dict(top_k=3), dict(top_p=0.5), dict(top_k=20, top_p=0.8), dict(min_p=0.3)])
def test_sampled_generation_is_the_same_through_either_head(tiny_model, monkeypatch, cuts):
    ex = tiny_model.executor
    assert ex.screen is not None
    heads = []
    real = ex.decode_sample

    def spy(*args):
        tok = real(*args)
        heads.append(ex.head_read)
        return tok
    monkeypatch.setattr(ex, "decode_sample", spy)
    # a random model's logits are flat: let the screen compute as many rows as it needs
    monkeypatch.setattr(type(ex.screen), "MAX_ROWS_FRACTION", 1.0)

    def run(screen_faster: bool):
        from cpullm.compile.head_screen import HeadTimes
        ex.sample_times = HeadTimes(explore=10 ** 9)           # never the other head
        slow, fast = [1.0] * 8, [0.0] * 8
        ex.sample_times.t_screen.extend(fast if screen_faster else slow)
        ex.sample_times.t_plain.extend(slow if screen_faster else fast)
        heads.clear()
        out = list(tiny_model.generate_ids([5, 17, 99], max_new_tokens=24, temperature=0.5, seed=3,
                                           ignore_eos=True, **cuts))
        return out, list(heads)
    plain, plain_heads = run(False)
    screened_toks, screened_heads = run(True)
    assert screened_toks == plain
    assert plain_heads and all(h == (False, True) for h in plain_heads)
    assert any(h == (True, False) for h in screened_heads)     # the screen proved some draws
    ex.sample_times = None


def test_a_sampler_without_a_cut_or_with_penalties_reads_the_full_logits(tiny_model, monkeypatch):
    ex = tiny_model.executor
    calls = []
    monkeypatch.setattr(ex, "decode_sample", lambda *a: calls.append(a) or 0)
    list(tiny_model.generate_ids([5, 17], max_new_tokens=6, temperature=0.8, seed=1))
    list(tiny_model.generate_ids([5, 17], max_new_tokens=6, temperature=0.8, top_p=0.9, seed=1,
                                 presence_penalty=0.5))
    list(tiny_model.generate_ids([5, 17], max_new_tokens=6, temperature=0.8, top_p=0.9, seed=1, logprobs=2))
    assert calls == []


def test_a_lone_draw_that_refuses_its_logits_fails_its_sequence_alone(tiny_model, monkeypatch):
    from cpullm.errors import SamplingError
    ex = tiny_model.executor
    nan = np.full(ex.vocab, np.nan, np.float32)
    monkeypatch.setattr(ex, "decode_sample", lambda state, pos, token, cuts, draw: draw(nan))
    with pytest.raises(SamplingError, match="non-finite logits"):
        list(tiny_model.generate_ids([5, 17], max_new_tokens=4, temperature=0.8, top_p=0.9, seed=1))
    monkeypatch.undo()
    assert len(list(tiny_model.generate_ids([5, 17], max_new_tokens=4, temperature=0.8, top_p=0.9, seed=1,
                                            ignore_eos=True))) == 4
