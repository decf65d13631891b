"""The head screen over an lm_head of raw ggml blocks (cpullm_kernels.panels.head_screen_blocks): its
error norms, its bound against kquant.matvec's float32 logits, and above all that the token it
returns is always the argmax of the full raw-block logits (lowest index on ties); then a q4
model's greedy tokens with and without it."""
import numba
import numpy as np
import pytest

import cpullm
from cpullm_kernels.rows import gguf_blocks as gb
from cpullm_kernels.panels import head_screen as H
from cpullm_kernels.panels import head_screen_blocks as HB
from cpullm_kernels.rows import kquant
from cpullm.testing import make_random_checkpoint
from steps import Steps  # noqa: E402

RNG = np.random.default_rng(17)
FORMATS = ["Q6_K", "Q4_K", "Q5_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]


def _q6_k(N, K, rng, outlier_cols=()):
    """A Q6_K matrix of Gaussian weights (cpullm's own quantizer, as --quant q4 stores a head)."""
    from cpullm_kernels.rows import q4
    w = rng.standard_normal((N, K)).astype(np.float32) * 0.05
    for c in outlier_cols:
        w[:, c] *= 8.0
    return q4.quantize_q6_k(w)


class _Screen:
    """A screen over one raw-block matrix, with the executor's scratch buffers."""

    def __init__(self, w, fmt, Kp, importance=None, k_sel=64):
        N = w.shape[0]
        self.w, self.fmt, self.Kp = w, gb.block_format(fmt).ggml_type, Kp
        importance = np.ones(Kp) if importance is None else importance
        self.k_sel = min(k_sel, Kp - 32) // 32 * 32
        self.perm = H.screen_columns(importance, Kp, self.k_sel)
        self.hq, self.hs, self.hb = HB.build_screen_blocks(w, fmt, Kp, self.perm, self.k_sel, rows_per_chunk=37)
        nb = Kp // 32
        self.scratch = (np.zeros(Kp, np.int8), np.zeros(nb, np.float32), np.zeros(Kp // 16, np.float32),
                        np.zeros(Kp, np.int16), np.zeros(H.padded_blocks(Kp), np.float32), np.zeros(Kp, np.float32),
                        np.zeros(N, np.float32), np.zeros(N, np.int64), np.zeros(N, np.float32),
                        np.zeros(8, np.float32), np.zeros(8, np.int64))

    def argmax(self, x, nthreads=None, max_rows=1 << 40):
        nthreads = nthreads or numba.get_num_threads()
        return HB.screen_argmax_blocks(x, self.perm, self.k_sel // 32, self.hq, self.hs, self.hb, self.w,
                                       self.fmt, *self.scratch, nthreads, max_rows)

    def full_logits(self, x):
        """kquant.matvec's logits, x quantized as formats.matmul_rows does (zero past K)."""
        x_q, x_s, x_m = HB._exact_activations_ref(x, self.Kp)
        out = np.zeros(self.w.shape[0], np.float32)
        kquant.matvec(self.fmt, self.w, x_q, x_s, x_m, out)
        return out

    def full_argmax(self, x):
        return int(np.argmax(self.full_logits(x)))


def test_dequantize_parts_add_up_to_the_reference_dequantizer():
    for fmt in FORMATS:
        w = gb.random_blocks(fmt, 7, 512, RNG)
        s, c = gb.dequantize_parts_ref(w, fmt, (7, 512))
        np.testing.assert_allclose(s + c, gb.dequantize_ref(w, fmt, (7, 512)), rtol=1e-6, atol=0)
        name = gb.block_format(fmt).name
        if name == "Q8_0":
            assert np.all(c == 0)
        elif name in ("Q6_K", "Q4_0", "Q5_0"):          # c = -bias * scale, s = scale * q, q unsigned
            bias, top = {"Q6_K": (32, 63), "Q4_0": (8, 15), "Q5_0": (16, 31)}[name]
            nz = c != 0
            q = s[nz] / (-c[nz] / bias)
            assert np.all((q == np.rint(q)) & (q >= 0) & (q <= top))


@pytest.mark.parametrize("fmt", ["Q6_K", "Q4_K", "Q5_0", "Q8_0"])
def test_error_norms_bound_the_real_errors(fmt):
    N, K = 90, 512
    w = gb.random_blocks(fmt, N, K, RNG)
    s = _Screen(w, fmt, K)
    parts = gb.dequantize_parts_ref(w, fmt, (N, K))
    exact = (parts[0] + parts[1])[:, s.perm]
    vals = np.concatenate([s.hq[:, :s.k_sel], H.unpack_nibbles(s.hq[:, s.k_sel:])], axis=1).astype(np.float64)
    from cpullm_kernels.rows.q8 import scale_values
    compact = (vals.reshape(N, -1, 32) * scale_values(s.hs[:, :K // 32])[..., None]).reshape(N, -1)
    err = exact - compact
    rounding = HB.exact_rounding(K) * np.linalg.norm(np.abs(parts[0]) + np.abs(parts[1]), axis=1)
    assert np.all(np.linalg.norm(err[:, :s.k_sel], axis=1) + rounding <= s.hb[:, 0])
    assert np.all(np.linalg.norm(err[:, s.k_sel:], axis=1) + rounding <= s.hb[:, 1])
    assert np.all(np.linalg.norm(exact, axis=1) <= s.hb[:, 2]) and np.all(np.linalg.norm(compact, axis=1) <= s.hb[:, 2])


def test_build_rejects_non_finite_rows_and_wrong_widths():
    w = gb.random_blocks("Q6_K", 4, 256, RNG)
    w[2, 208:210] = np.array([np.inf], np.float16).view(np.uint8)        # row 2's d = inf
    with pytest.raises(ValueError, match="non-finite"):
        HB.build_screen_blocks(w, "Q6_K", 256, np.arange(256), 64)
    with pytest.raises(ValueError, match="not 512"):
        HB.build_screen_blocks(w, "Q6_K", 512, np.arange(512), 64)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("seed", range(3))
def test_bound_holds_for_every_row(fmt, seed):
    rng = np.random.default_rng(seed)
    N, K = 400, 512
    w = gb.random_blocks(fmt, N, K, rng, scale=float(rng.choice([1e-4, 0.01, 3.0])))
    imp = rng.random(K)
    s = _Screen(w, fmt, K, importance=imp)
    x = rng.standard_normal(K).astype(np.float32) * np.float32(rng.uniform(0.01, 100))
    x[np.argsort(-imp)[:4]] *= 40.0                    # large channels where the columns are kept
    approx, bound, _ = HB.screen_bounds_blocks_ref(x, s.perm, s.k_sel, s.hq, s.hs, s.hb)
    exact = s.full_logits(x).astype(np.float64)
    assert np.all(np.abs(exact - approx) <= bound)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("seed", range(6))
def test_screen_argmax_is_the_full_argmax(seed, threads):
    if threads > numba.config.NUMBA_NUM_THREADS:
        pytest.skip("needs 2 numba threads")
    rng = np.random.default_rng(300 + seed)
    N, K = int(rng.integers(50, 2500)), int(rng.choice([256, 512, 768]))
    w = _q6_k(N, K, rng, rng.integers(0, K, 2)) if seed % 2 else gb.random_blocks("Q6_K", N, K, rng)
    s = _Screen(w, "Q6_K", K, importance=rng.random(K))
    for _ in range(6):
        x = rng.standard_normal(K).astype(np.float32) * np.float32(rng.uniform(0.1, 10))
        x[rng.integers(0, K, 4)] *= 40.0
        tok, survivors = s.argmax(x, threads)
        assert tok == s.full_argmax(x) and 1 <= survivors <= N
        ref_tok, ref_survivors = HB.screen_argmax_blocks_ref(x, s.perm, s.k_sel, s.hq, s.hs, s.hb, w, s.fmt)
        assert ref_tok == tok and abs(ref_survivors - survivors) <= max(2, survivors // 100)


def test_survivors_are_recomputed_bit_for_bit_as_the_matvec():
    """The screen's exact values are kquant.matvec's own, bit for bit (its row routine, the same
    activations), not a close recomputation."""
    rng = np.random.default_rng(8)
    N, K = 2000, 512
    s = _Screen(_q6_k(N, K, rng), "Q6_K", K)
    for threads in sorted({1, numba.get_num_threads()}):
        x = rng.standard_normal(K).astype(np.float32)
        tok, survivors = s.argmax(x, threads)
        rows, vals, counts = s.scratch[7], s.scratch[8], s.scratch[10]
        per = (N + threads - 1) // threads
        idx = np.concatenate([np.arange(t * per, t * per + counts[t]) for t in range(threads)])
        assert idx.size == survivors >= 1
        full = s.full_logits(x)
        assert np.array_equal(vals[idx].view(np.uint32), full[rows[idx]].view(np.uint32))
        assert tok == int(np.argmax(full))


def test_rows_past_k_padding_and_aligned_activations():
    """K = 224 real columns of Kp = 256 (q4 pads rows to whole super-blocks); activations along
    one row: few survivors, still the full argmax."""
    rng = np.random.default_rng(5)
    N, K, Kp = 3000, 224, 256
    wf = rng.standard_normal((N, Kp)).astype(np.float32) * 0.05
    wf[:, K:] = 0.0
    from cpullm_kernels.rows import q4
    w = q4.quantize_q6_k(wf)
    s = _Screen(w, "Q6_K", Kp)
    x = (gb.dequantize_ref(w[1234:1235], "Q6_K", (1, Kp))[0, :K] * 50.0).astype(np.float32)
    tok, survivors = s.argmax(x)
    assert tok == s.full_argmax(x) == 1234 and survivors < 40


@pytest.mark.parametrize("random_bytes", [False, True])
def test_near_ties_duplicated_and_nearly_equal_rows(random_bytes):
    """The best row copied elsewhere (equal logits: the lowest index wins), and copies that differ
    from it in one quant (one ql byte's low bit: logits a hair apart): the screen's token is the
    full argmax."""
    rng = np.random.default_rng(11)
    N, K = 600, 512
    base = gb.random_blocks("Q6_K", N, K, rng) if random_bytes else _q6_k(N, K, rng)
    ref = _Screen(base, "Q6_K", K)
    for _ in range(4):
        x = rng.standard_normal(K).astype(np.float32)
        top = ref.full_argmax(x)
        for dups in ((top + 1, N - 1), (0,), (top - 1 if top else N - 2, top + 2 if top + 2 < N else 1)):
            w = base.copy()
            for i, d in enumerate(dups):
                w[d] = base[top]
                if i:                                  # later copies: one quant moved by one
                    w[d, 210 * int(rng.integers(0, K // 256)) + int(rng.integers(0, 128))] ^= 1
            s = _Screen(w, "Q6_K", K)
            logits = s.full_logits(x)
            tok, survivors = s.argmax(x)
            assert tok == int(np.argmax(logits)) and survivors >= 2


def test_other_formats_are_not_screened():
    """The bound holds for every format (above), but only SCREEN_FORMATS' row routines are
    compiled into the screen: another format returns -1 (the full head) and gets no screen."""
    assert HB.SCREEN_FORMATS == (gb.Q6_K.ggml_type,)
    w = gb.random_blocks("Q4_K", 100, 256, RNG)
    s = _Screen(w, "Q4_K", 256)
    assert s.argmax(RNG.standard_normal(256).astype(np.float32)) == (-1, 0)


def test_zero_tiny_and_non_finite_activations_and_max_rows():
    rng = np.random.default_rng(2)
    w = _q6_k(300, 256, rng)
    s = _Screen(w, "Q6_K", 256)
    zero = np.zeros(256, np.float32)
    assert s.argmax(zero) == (0, 300)                  # every logit 0: row 0, all computed
    assert s.argmax(zero, max_rows=299) == (-2, 300)   # too many rows left: the full head
    tiny = (rng.standard_normal(256) * 1e-14).astype(np.float32)   # block scales below 2^-40
    assert s.argmax(tiny) == (-1, 0)
    for bad in (np.nan, np.inf, -np.inf):
        x = rng.standard_normal(256).astype(np.float32)
        x[5] = bad
        assert s.argmax(x) == (-1, 0)                  # the executor then runs the full head
    x = rng.standard_normal(256).astype(np.float32)
    tok, survivors = s.argmax(x, max_rows=0)
    assert tok == -2 and survivors >= 1


# ---- through the model --------------------------------------------------------------------------

TINY = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=256, intermediate_size=512,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=3000,
            rms_norm_eps=1e-5, max_position_embeddings=512, tie_word_embeddings=True, rope_theta=10000.0)


def _load_q4(tmp_path_factory, hidden):
    config = dict(TINY, hidden_size=hidden, intermediate_size=2 * hidden)
    d = make_random_checkpoint(config, tmp_path_factory.mktemp(f"q4screen{hidden}"), seed=3, std=0.05)
    with pytest.MonkeyPatch.context() as mp:           # screens are for large lm_heads: allow this one
        mp.setattr(H, "MIN_LM_HEAD_BYTES", 0)
        return cpullm.load(d, quant="q4", use_cache=False)


@pytest.fixture(scope="module")
def q4_model(tmp_path_factory):
    """hidden 256: a Q6_K lm_head, screened by head_screen_blocks."""
    return _load_q4(tmp_path_factory, 256)


@pytest.fixture(scope="module")
def q4_model_q8_0_head(tmp_path_factory):
    """hidden 128 (not whole super-blocks): a Q8_0 lm_head held as q8, screened by the q8 screen."""
    return _load_q4(tmp_path_factory, 128)


def test_q4_program_gets_a_raw_block_screen(q4_model):
    from cpullm_kernels.program import program_table as P
    sc = q4_model.program.meta["head_screen"]
    lin = P.linear_operands(q4_model.program.I[sc["row"]])
    assert lin.kind == P.WEIGHT_BLOCKS and lin.s_off == gb.Q6_K.ggml_type
    assert q4_model.executor.screen.blocks and sc["columns_from"].startswith("calibration")
    info = q4_model.info()
    screen_bytes = info["memory"]["head_screen_bytes"]
    assert screen_bytes == info["weight_formats"]["head_screen"] > 0
    assert "int8" not in info["weight_formats"]
    N = TINY["vocab_size"]
    assert screen_bytes == N * (sc["q_cols"] + 2 * sc["s_cols"] + 12) < N * gb.Q6_K.row_bytes(256)   # 0.9x at K 256
    from cpullm.bench.memory_bound import decode_weight_bytes
    assert decode_weight_bytes(q4_model.program) < sum(v for k, v in info["weight_formats"].items()
                                                       if k != "head_screen")


@pytest.mark.parametrize("which", ["q4_model", "q4_model_q8_0_head"])
def test_q4_greedy_tokens_with_and_without_the_screen(which, request):
    model = request.getfixturevalue(which)
    from cpullm_kernels.program import program_table as P
    head = P.linear_operands(model.program.I[model.executor.screen.row])
    assert head.kind == (P.WEIGHT_BLOCKS if which == "q4_model" else P.WEIGHT_Q8)
    ex = Steps(model)
    for ids in ([5, 17, 99, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]):
        ex.reset()
        tok = int(np.argmax(ex.prefill(ids)))
        want = []
        for _ in range(20):
            tok = int(np.argmax(ex.decode(tok)))       # the full raw-block head's logits
            want.append(tok)
        for plain_faster in (None, True, False):       # whichever head the timing picks
            ex.reset()
            ex.screen.t_screen.clear()
            ex.screen.t_plain.clear()
            if plain_faster is not None:
                slow, fast = [1.0] * 8, [0.0] * 8
                ex.screen.t_screen.extend(slow if plain_faster else fast)
                ex.screen.t_plain.extend(fast if plain_faster else slow)
            tok = int(np.argmax(ex.prefill(ids)))
            got = []
            for _ in range(20):
                tok = ex.decode_argmax(tok)
                got.append(tok)
            assert got == want
        assert 1 <= ex.screen_survivors <= TINY["vocab_size"]
