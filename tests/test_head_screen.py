"""The lm_head screen of greedy decoding (cpullm_kernels.panels.head_screen): its packing, its bound, its
kernels against their numpy references, and, above all, that the token it returns is always the
argmax of the full q8 logits (lowest index on ties)."""
import numba
import numpy as np
import pytest

import cpullm
from cpullm_kernels.panels import head_screen as H
from cpullm_kernels.rows import q8
from cpullm_kernels.panels import q8_panels as qp
from cpullm.testing import make_random_checkpoint
from steps import Steps  # noqa: E402

RNG = np.random.default_rng(7)


def _matrix(N, K, outlier_cols=()):
    w = RNG.standard_normal((N, K)).astype(np.float32) * 0.05
    for c in outlier_cols:
        w[:, c] *= 8.0
    return q8.quantize_weight_q8(w)


def _activations(K, outliers=(), scale=1.0):
    x = RNG.standard_normal(K).astype(np.float32) * scale
    for c in outliers:
        x[c] *= 40.0
    return x


class _Screen:
    """A screen over one q8 matrix, with the executor's scratch buffers."""

    def __init__(self, w_q, w_s, importance=None, k_sel=64):
        N, Kp = w_q.shape
        self.w_q, self.w_s = w_q, w_s
        importance = np.ones(Kp) if importance is None else importance
        self.perm = H.screen_columns(importance, Kp, k_sel)
        self.k_sel = min(k_sel, Kp - 32) // 32 * 32
        self.hq, self.hs, self.hb = H.build_screen(w_q, w_s, self.perm, self.k_sel)
        self.wp, self.sp = qp.pack_panels(w_q, w_s)           # the lm_head as the program stores it
        nb = Kp // 32
        self.scratch = (np.zeros(Kp, np.int16), np.zeros(nb, np.float32), np.zeros(Kp, np.int16),
                        np.zeros(H.padded_blocks(Kp), np.float32), np.zeros(Kp, np.float32),
                        np.zeros(Kp, np.float32), np.zeros(N, np.float32), np.zeros(N, np.int64),
                        np.zeros(N, np.float32), np.zeros(8, np.float32), np.zeros(8, np.int64))

    def argmax(self, x, nthreads=None, max_rows=1 << 40):
        nthreads = nthreads or numba.get_num_threads()
        return H.screen_argmax(x, self.perm, self.k_sel // 32, self.hq, self.hs, self.hb, self.wp,
                               self.sp, *self.scratch, nthreads, max_rows)

    def full_argmax(self, x):
        Kp = self.w_q.shape[1]
        x_q, x_s = np.zeros(Kp, np.int16), np.zeros(Kp // 32, np.float32)
        q8.quantize_act_q16(x, x_q, x_s)                   # as the executor's LINEAR does
        return int(np.argmax(out := _logits(self.wp, self.sp, self.w_q.shape[0], x_q, x_s))), out


def _logits(wp, sp, N, x_q, x_s):
    """The lm_head kernel's float32 logits (q8 panels) for one row of int16 activations."""
    out = np.zeros((1, N), np.float32)
    qp.panels_matmul(wp, sp, N, x_q[None], x_s[None], out, numba.get_num_threads())
    return out[0]


def test_rest_activations_are_packed_in_pair_order_with_their_offset_corrections():
    k_sel, Kp = 64, 64 + 32 * 5                   # five 4-bit blocks: two pairs and a lone block
    p_q = np.zeros(Kp, np.int16)
    p_q[k_sel:] = RNG.integers(-127, 128, Kp - k_sel)
    npair = H.rest_pairs(Kp, k_sel)
    assert npair == 3
    x8, corr = np.full(64 * npair, 99, np.int8), np.zeros(8 * npair, np.int32)
    H._pack_rest(p_q, k_sel, x8, corr)
    rest = np.concatenate([p_q[k_sel:], np.zeros(32, np.int16)]).reshape(-1, 32)   # + a zero block
    for q in range(npair):
        for h in range(2):
            blk = rest[2 * q + h]
            assert np.array_equal(x8[64 * q + 16 * h: 64 * q + 16 * h + 16], blk[:16])
            assert np.array_equal(x8[64 * q + 32 + 16 * h: 64 * q + 32 + 16 * h + 16], blk[16:])
            lanes = blk[:16].reshape(4, 4).sum(1) + blk[16:].reshape(4, 4).sum(1)
            assert np.array_equal(corr[8 * q + 4 * h: 8 * q + 4 * h + 4], -8 * lanes)


def test_nibble_packing_round_trips():
    q = RNG.integers(-8, 8, (5, 96))
    assert np.array_equal(H.unpack_nibbles(H._pack_nibbles(q)), q)


def test_screen_columns_puts_the_largest_first_then_the_rest_in_order():
    w = np.array([0.1, -5.0, 0.2, 3.0, 0.0] + [0.01] * 59)
    perm = H.screen_columns(w, 96, 32)
    assert sorted(perm) == list(range(96))
    assert set(perm[:32]) >= {1, 3} and list(perm[:32]) == sorted(perm[:32])
    assert list(perm[32:]) == sorted(perm[32:])


def test_build_screen_error_norms_bound_the_real_errors():
    w_q, w_s = _matrix(200, 160, outlier_cols=(3, 77))
    s = _Screen(w_q, w_s, k_sel=64)
    exact = q8.dequantize_weight_q8_ref(w_q, w_s).astype(np.float64)[:, s.perm]
    vals = np.concatenate([s.hq[:, :64], H.unpack_nibbles(s.hq[:, 64:])], axis=1).astype(np.float64)
    compact = (vals.reshape(200, -1, 32) * q8.scale_values(s.hs[:, :5])[..., None]).reshape(200, -1)
    assert np.all(np.abs(vals[:, 64:]) <= 8)
    err = exact - compact
    assert np.all(np.linalg.norm(err[:, :64], axis=1) <= s.hb[:, 0])
    assert np.all(np.linalg.norm(err[:, 64:], axis=1) <= s.hb[:, 1])
    assert np.all(np.linalg.norm(exact, axis=1) <= s.hb[:, 2])
    assert np.all(s.hs[:, 5:] == 0)                       # scale rows padded to 8 with zeros


@pytest.mark.parametrize("N,K,k_sel", [(100, 96, 32), (333, 160, 64), (64, 250, 64), (40, 64, 64)])
def test_screen_dots_match_reference(N, K, k_sel):
    w_q, w_s = _matrix(N, K)
    s = _Screen(w_q, w_s, k_sel=k_sel)
    x = np.zeros(w_q.shape[1], np.float32)
    x[:K] = _activations(K, outliers=(1, K - 2))
    p_q, p_s = H.screen_activations_ref(x, s.k_sel)
    assert np.abs(p_q[:s.k_sel]).max() > 127 >= np.abs(p_q[s.k_sel:]).max()
    p_s_pad = np.zeros(H.padded_blocks(w_q.shape[1]), np.float32)
    p_s_pad[:p_s.size] = p_s
    out = np.zeros(N, np.float32)
    H.screen_dots(s.hq, s.hs, p_q, p_s_pad, s.k_sel // 32, out)
    ref = H.screen_dots_ref(s.hq, s.hs, p_q, p_s, s.k_sel)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("seed", range(6))
def test_bound_holds_for_every_row(seed):
    rng = np.random.default_rng(seed)
    N, K = 500, 224
    w_q, w_s = _matrix(N, K, outlier_cols=rng.integers(0, K, 3))
    imp = np.ones(K)
    big = rng.choice(K, 5, replace=False)
    imp[big] = 10.0
    s = _Screen(w_q, w_s, importance=imp, k_sel=64)
    x = _activations(K, outliers=big, scale=float(rng.uniform(0.01, 100)))
    approx, bound, (x_q, x_s) = H.screen_bounds_ref(x, s.perm, s.k_sel, s.hq, s.hs, s.hb)
    exact = _logits(s.wp, s.sp, N, x_q, x_s)                  # the kernel's float32 logits
    assert np.all(np.abs(exact.astype(np.float64) - approx) <= bound)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("seed", range(12))
def test_screen_argmax_is_the_full_argmax(seed, threads):
    if threads > numba.config.NUMBA_NUM_THREADS:
        pytest.skip("needs 2 numba threads")
    rng = np.random.default_rng(100 + seed)
    N, K = int(rng.integers(50, 3000)), int(rng.choice([64, 96, 200, 576]))
    w_q, w_s = _matrix(N, K, outlier_cols=rng.integers(0, K, 2))
    s = _Screen(w_q, w_s, importance=rng.random(K), k_sel=64)
    for _ in range(5):
        x = _activations(K, outliers=rng.integers(0, K, 4), scale=float(rng.uniform(0.1, 10)))
        tok, survivors = s.argmax(x, threads)
        full, _ = s.full_argmax(x)
        assert tok == full and 1 <= survivors <= N
        ref_tok, ref_survivors = H.screen_argmax_ref(x, s.perm, s.k_sel, s.hq, s.hs, s.hb, w_q, w_s)
        assert ref_tok == tok and abs(ref_survivors - survivors) <= max(2, survivors // 100)


def test_screen_argmax_keeps_the_lowest_index_of_tied_rows():
    w_q, w_s = _matrix(400, 128)
    x = _activations(128)
    _, logits = _Screen(w_q, w_s).full_argmax(x)
    top = int(np.argmax(logits))
    for dup in (top + 1, 399, 0):                              # copies of the best row elsewhere
        wq2, ws2 = w_q.copy(), w_s.copy()
        wq2[dup], ws2[dup] = w_q[top], w_s[top]
        s = _Screen(wq2, ws2)
        tok, survivors = s.argmax(x)
        assert tok == s.full_argmax(x)[0] == min(dup, top) and survivors >= 2


def test_screen_argmax_zero_and_non_finite_activations():
    w_q, w_s = _matrix(300, 96)
    s = _Screen(w_q, w_s)
    tok, survivors = s.argmax(np.zeros(96, np.float32))        # every logit 0: row 0, all computed
    assert tok == 0 and survivors == 300
    assert s.argmax(np.zeros(96, np.float32), max_rows=299) == (-2, 300)   # too many: the full head
    for bad in (np.nan, np.inf):
        x = _activations(96)
        x[5] = bad
        # the token the full head would pick from the same quantized activations, or -1 (the
        # executor then runs the full head)
        assert s.argmax(x)[0] in (-1, s.full_argmax(x)[0])


def test_screen_reads_fewer_rows_when_the_answer_is_clear():
    w_q, w_s = _matrix(4000, 256)
    x = q8.dequantize_weight_q8_ref(w_q[1234:1235], w_s[1234:1235])[0] * 50.0   # aligned with row 1234
    s = _Screen(w_q, w_s)
    tok, survivors = s.argmax(x.astype(np.float32))
    assert tok == 1234 and survivors < 40


# ---- through the model --------------------------------------------------------------------------

TINY = dict(model_type="llama", hidden_size=128, intermediate_size=160, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=2000, rms_norm_eps=1e-5,
            max_position_embeddings=512, tie_word_embeddings=True, rope_theta=10000.0)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_random_checkpoint(TINY, tmp_path_factory.mktemp("screen"), seed=11)


@pytest.fixture(scope="module")
def tiny_model(tiny_dir):
    with pytest.MonkeyPatch.context() as mp:         # screens are for large lm_heads: allow this one
        mp.setattr(H, "MIN_LM_HEAD_BYTES", 0)
        return cpullm.load(tiny_dir, use_cache=False)


def test_small_lm_heads_get_no_screen(tiny_dir):
    m = cpullm.load(tiny_dir, use_cache=False)
    assert "head_screen" not in m.program.meta and m.executor.screen is None
    ids = [5, 17]
    ex = Steps(m)
    tok = int(np.argmax(ex.prefill(ids)))
    assert ex.decode_argmax(tok) == int(np.argmax(cpullm.load(tiny_dir, use_cache=False).logits(ids + [tok])[-1]))


def test_program_has_a_screen_only_in_int8(tiny_model, tmp_path_factory):
    sc = tiny_model.program.meta["head_screen"]
    assert sc["row"] == len(tiny_model.program.I) - 1 and sc["k_sel"] == H.sel_columns(128) == 32
    assert sc["columns_from"].startswith("calibration")
    assert tiny_model.info()["memory"]["head_screen_bytes"] > 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(H, "MIN_LM_HEAD_BYTES", 0)
        f32 = cpullm.load(tiny_model.model_dir, quant="f32", use_cache=False)
    assert "head_screen" not in f32.program.meta
    assert f32.executor.screen is None


def test_decode_argmax_follows_the_full_logits(tiny_model):
    ex = Steps(tiny_model)
    screen = tiny_model.executor.screen
    ids = [5, 17, 99, 3]
    ex.reset()
    tok = int(np.argmax(ex.prefill(ids)))
    want = []
    for _ in range(24):
        tok = int(np.argmax(ex.decode(tok)))
        want.append(tok)
    ex.reset()
    tok = int(np.argmax(ex.prefill(ids)))
    got = []
    for _ in range(24):
        tok = ex.decode_argmax(tok)
        got.append(tok)
        assert 1 <= tiny_model.executor.screen_survivors <= TINY["vocab_size"]
    assert got == want
    # whichever head the timing picks, the same tokens: force each choice in turn
    for plain_faster in (True, False):
        ex.reset()
        slow, fast = [1.0] * 8, [0.0] * 8
        screen.t_screen.extend(slow if plain_faster else fast)
        screen.t_plain.extend(fast if plain_faster else slow)
        tok = int(np.argmax(ex.prefill(ids)))
        got = []
        for _ in range(24):
            tok = ex.decode_argmax(tok)
            got.append(tok)
        assert got == want


def test_the_head_choice_follows_the_timings(tiny_model):
    sc = tiny_model.executor.screen
    sc.t_screen.clear()
    sc.t_plain.clear()
    sc.steps = 0
    first = []
    for t_screen, t_plain in ((2.0, 1.0), (2.0, 1.0)):          # a first look at both heads
        first.append(sc.choose())
        sc.record(True, t_screen)
        first.append(sc.choose())
        sc.record(False, t_plain)
    assert first == [True, False, True, False]
    picks = [sc.choose() for _ in range(2 * sc.EXPLORE)]
    assert picks.count(True) == 2                  # the plain head, but the screen now and then
    for _ in range(sc.WINDOW):
        sc.record(True, 0.5)                       # the screen got faster: it takes over
    sc.record(True, 9.0)                           # one stall does not flip the choice back
    picks = [sc.choose() for _ in range(2 * sc.EXPLORE)]
    assert picks.count(False) == 2


def test_the_rows_choice_carries_a_loss_to_more_rows():
    """RowsScreen keeps times per row count; where the screen was slower at fewer rows, a larger
    count takes the full head without timing the screen first (every EXPLORE-th pass still tries
    it), and a count below the loss still explores both heads."""
    from cpullm.compile.head_screen import RowsScreen
    rs = object.__new__(RowsScreen)                # the choice only: no model needed
    rs.times, rs.passes = {}, {}
    for _ in range(2):
        assert rs.choose(3) is True
        rs.record(3, True, 2.0)
        assert rs.choose(3) is False
        rs.record(3, False, 1.0)
    picks = [rs.choose(5) for _ in range(rs.EXPLORE)]
    assert picks.count(True) == 1 and picks[-1] is True
    assert rs.choose(2) is True                    # fewer rows than the loss: explored as before
    for _ in range(2):
        rs.record(7, True, 0.5)
        rs.record(7, False, 1.0)
    assert rs.choose(7) is True                    # its own times decide once it has them


def test_greedy_generation_uses_the_screen_and_sampling_does_not(tiny_model, monkeypatch):
    ex = tiny_model.executor
    calls = {"argmax": 0, "decode": 0}
    real_argmax, real_decode = ex.decode_argmax, ex.decode

    def count(name, fn):
        def wrapped(*args):
            calls[name] += 1
            return fn(*args)
        return wrapped
    monkeypatch.setattr(ex, "decode_argmax", count("argmax", real_argmax))
    monkeypatch.setattr(ex, "decode", count("decode", real_decode))
    greedy = list(tiny_model.generate_ids([5, 17], max_new_tokens=8, temperature=0.0))
    assert calls == {"argmax": len(greedy) - 1, "decode": 0}
    list(tiny_model.generate_ids([5, 17], max_new_tokens=8, temperature=0.8, seed=1))
    list(tiny_model.generate_ids([5, 17], max_new_tokens=8, temperature=0.0, repetition_penalty=1.3))
    assert calls["argmax"] == len(greedy) - 1 and calls["decode"] > 0


@pytest.mark.parametrize("regex,mask", [(r"(ab|ba){1,3}-[0-9]{2}", "refuses"), (r"[\s\S]{1,12}", "allows")])
def test_constrained_greedy_reads_the_screen_and_keeps_the_unscreened_tokens(tiny_model, monkeypatch, regex, mask):
    pytest.importorskip("llguidance", reason="llguidance (cpullm[structured]) is not installed")
    from cpullm.generate.sampling import SamplingParams
    from cpullm.generate.scheduler import Scheduler
    from cpullm.generate.sequence import Sequence
    m = tiny_model
    ex = m.executor
    prompts = [[5, 17], [3, 99, 40, 7], [11]]

    def decode(screened: bool, slots: int):
        # unscreened: an identity logits processor makes every step read the full logits and
        # take the masked argmax of them, the reference a constrained greedy row must match
        procs = () if screened else (lambda ids, x: x,)
        sch = Scheduler(m.forward, slots)
        seqs = [sch.add(Sequence(p, 16, SamplingParams(), stop_ids=m.eos_token_ids,
                                 constraint=m.constraint({"regex": regex}), logits_processors=procs))
                for p in prompts]
        sch.run_until_idle()
        return [s.generated for s in seqs]

    calls = {"argmax": 0, "full": 0}
    real_argmax, real_full = ex.decode_argmax, ex.last_step_logits

    def count(name, fn):
        def wrapped(*args):
            calls[name] += 1
            return fn(*args)
        return wrapped
    monkeypatch.setattr(ex, "decode_argmax", count("argmax", real_argmax))
    monkeypatch.setattr(ex, "last_step_logits", count("full", real_full))
    want = decode(False, 1)
    assert calls == {"argmax": 0, "full": 0}
    for plain_faster in (False, True):              # the screen answering, then the plain head
        slow, fast = [1.0] * 8, [0.0] * 8
        ex.screen.t_screen.extend(slow if plain_faster else fast)
        ex.screen.t_plain.extend(fast if plain_faster else slow)
        assert decode(True, 1) == want
    # steps whose argmax the mask forbids read the full logits too, the others only the argmax
    if mask == "refuses":
        assert calls["argmax"] >= calls["full"] > 0
    else:
        assert calls["full"] < calls["argmax"]      # some steps' argmax was allowed: no full logits
    assert decode(True, 3) == want                  # batched rows: the same tokens


def test_profile_times_greedy_steps_through_the_screen(tiny_model):
    from cpullm.bench import format_profile, profile_pass
    ex = tiny_model.executor
    calls = {"argmax": 0}
    real = ex.decode_argmax

    def counted(*args):
        calls["argmax"] += 1
        return real(*args)
    ex.decode_argmax = counted
    try:
        p = profile_pass(tiny_model, [5, 17, 99], 6)
    finally:
        del ex.decode_argmax
    assert calls["argmax"] == 6 and p["decode_head"] == "screen"
    groups = p["decode"]["groups"]
    assert groups["lm_head"]["seconds"] > 0 and "sampling" not in groups     # the argmax is the head's
    assert abs(sum(g["share"] for g in groups.values()) - 1.0) < 1e-9
    assert "through the head screen" in format_profile(p)


@pytest.mark.skipif(not q8.HAVE_AVX2, reason="x86 AVX2 host only")
def test_screen_row_codegen_is_vectorized():
    import re

    from test_kernels_q8 import _fresh_asm
    w_q, w_s = _matrix(64, 256)
    s = _Screen(w_q, w_s)
    p_q = np.zeros(256, np.int16)
    p_s = np.zeros(H.padded_blocks(256), np.float32)
    npair = H.rest_pairs(256, s.k_sel)
    asm = _fresh_asm(H.bounds_pass, s.hq, s.hs, s.hb, p_q, np.zeros(64 * npair, np.int8),
                     np.zeros(8 * npair, np.int32), p_s, 2, np.float32(1), np.float32(1),
                     np.float32(1), np.zeros(64, np.float32), np.zeros(2, np.float32), 1)
    # int8 blocks: vpmaddwd; 4-bit blocks: unsigned nibbles times int8, two blocks per ymm
    assert "vpmaddwd" in asm and "prefetcht0" in asm
    if H.SCREEN_ISA == "vnni":
        assert re.search(r"vpdpbusd\s+[^\n]*%ymm", asm)
    else:
        assert re.search(r"vpmaddubsw\s+[^\n]*%ymm", asm)
    # block factors converted 8 at a time at the row start and read by the FMA as a broadcast
    assert re.search(r"vcvtph2psx?\s+[^\n]*%ymm", asm) and re.search(r"vfmadd\w+ps\s+[^\n]*\{1to8\}|vbroadcastss", asm)


def test_memory_bound_counts_the_head_each_step_read(tiny_model, monkeypatch):
    """bench's read-rate share reads, after each decode step, the bytes that step read: the
    screen's compact copy, or the plain lm_head where the executor chose it (random weights'
    flat logits make it the faster one), or both where a screened step fell back."""
    from cpullm.bench import format_memory_bound
    from cpullm.bench.memory_bound import decode_weight_bytes, decode_weight_spans, memory_bound
    from cpullm_kernels.program import program_table as P
    prog, sc = tiny_model.program, tiny_model.executor.screen
    size = {k: sum(v.nbytes for v in decode_weight_spans(prog, k)) for k in ("screen", "plain", "both")}
    lin = P.linear_operands(prog.I[prog.meta["head_screen"]["row"]])
    head = qp.padded_rows(lin.n) * (lin.kp + lin.kp // 16)     # panels: rows padded to 64, all read
    assert size["plain"] - size["screen"] == head - tiny_model.info()["memory"]["head_screen_bytes"]
    assert size["both"] == size["screen"] + head
    assert decode_weight_bytes(prog) == size["screen"]
    with pytest.raises(ValueError):
        decode_weight_spans(prog, "lm_head")
    answers = {"screen": (3, 1), "both": (-2, 10 ** 6)}     # the screen's token, or too many rows left
    for kind in ("screen", "plain", "both"):
        monkeypatch.setattr(sc, "choose", lambda k=kind: k != "plain")
        monkeypatch.setattr(sc, "argmax", lambda nthreads, k=kind: answers[k])
        r = memory_bound(tiny_model, steps=4, token=5)
        assert r["memory_bound_head"] == kind and r["memory_bound_head_steps"][kind] == 4
        assert r["decode_weight_bytes"] == size[kind]
    assert "lm_head read the screen, then the plain lm_head on 4 of 4 steps" in format_memory_bound(r)
