"""The table of weight formats (cpullm_kernels.program.formats): every kind the program table names
has a row, and for each format the compiled drivers (matmul_rows: decode, batch, experts; the
embedding row) agree with the row's prefill product and dense values, a batch's rows equal lone
rows bit for bit, and the spans / bytes / slots describe the stored matrix."""
import numpy as np
import pytest

from cpullm_kernels.panels import kquant_panels
from cpullm_kernels.program import formats as FM
from cpullm_kernels.program import program_table as P
from cpullm_kernels.rows import gguf_blocks as gb
from cpullm_kernels.rows.q8 import quantize_weight_q8

N, K = 48, 256          # 48 rows: q8 pads them to 64, Q4_K panels take them as three panels of 16


def _stored(case: str, rng):
    """(kind, s_off, Kp, wq, ws, wf, w_off) of a random (N, K) matrix stored as ``case`` after some
    unrelated leading elements (offsets are not zero)."""
    lead = 32
    arrays = {"wq": np.zeros(0, np.int8), "ws": np.zeros(0, np.uint16), "wf": np.zeros(0, np.float32)}
    if case == "f32":
        kind, s_off, rows = P.WEIGHT_F32, -1, (rng.standard_normal((N, K)).astype(np.float32),)
    elif case == "q8":
        kind, s_off, rows = P.WEIGHT_Q8, lead, quantize_weight_q8(rng.standard_normal((N, K)).astype(np.float32))
    else:
        fmt = gb.block_format(case.split()[0])
        kind, rows = P.WEIGHT_BLOCKS, (gb.random_blocks(fmt, N, K, rng),)
        s_off = fmt.ggml_type + kquant_panels.PANELED * case.endswith("panels")
    packed = FM.weight_format(kind).pack(s_off, *rows)
    if case == "q8":
        assert [v.size for v in packed.values()] == [64 * K, 64 * K // 32]      # 48 rows padded to 64
    for name, values in packed.items():
        arrays[name] = np.concatenate([np.ones(lead, arrays[name].dtype), values.reshape(-1)])
    return kind, s_off, K, arrays["wq"], arrays["ws"], arrays["wf"], lead


CASES = ["f32", "q8", "Q4_1", "Q6_K", "Q4_K panels"]


def test_every_weight_kind_has_one_row():
    kinds = {v for k, v in vars(P).items() if k.startswith("WEIGHT_")}
    assert set(FM.FORMATS) == kinds
    assert all(f.kind == k for k, f in FM.FORMATS.items())
    with pytest.raises(ValueError, match="none of the stored formats"):
        FM.weight_format(max(kinds) + 1)


@pytest.mark.parametrize("case", CASES)
def test_a_format_s_drivers_agree_with_its_prefill_and_dense_values(case):
    rng = np.random.default_rng(7)
    kind, s_off, Kp, wq, ws, wf, w_off = _stored(case, rng)
    fmt = FM.weight_format(kind)
    wb = wq.view(np.uint8)
    T = 5
    x = rng.standard_normal((T, K)).astype(np.float32)
    dense = fmt.dense(wq, ws, wf, w_off, s_off, Kp, N, K)
    assert dense.shape == (N, K) and dense.dtype == np.float32
    want = x.astype(np.float64) @ dense.astype(np.float64).T
    scale = np.abs(want).max()

    pre = np.full((T, N + 3), 7.0, np.float32)                 # rows wider than N: left alone past N
    fmt.prefill(wq, ws, wf, w_off, s_off, Kp, N, x, pre)
    assert np.abs(pre[:, :N] - want).max() / scale < 0.02 and np.all(pre[:, N:] == 7.0)

    xq = np.zeros(T * Kp, np.int16)
    xs = np.zeros(T * Kp // 32 * 3, np.float32)
    for lone in (True, False):
        out = np.zeros((T, N), np.float32)
        FM.matmul_rows(kind, w_off, s_off, Kp, N, wq, ws, wf, wb, wb, x, out, xq, xs, lone, 1)
        assert np.abs(out - want).max() / scale < 0.02
        for t in (0, T - 1):                                     # a row alone: the same numbers
            one = np.zeros((1, N), np.float32)
            FM.matmul_rows(kind, w_off, s_off, Kp, N, wq, ws, wf, wb, wb, x[t: t + 1], one, xq, xs, lone, 1)
            if kind != P.WEIGHT_F32 or lone:
                assert np.array_equal(one[0], out[t]), (case, lone, t)

    row = np.zeros(K, np.float32)
    FM.embed_row_into(kind, w_off, s_off, Kp, wq, ws, wf, wb, 3, np.float32(0.5), row)
    assert np.allclose(row, dense[3] * np.float32(0.5), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("case", CASES)
def test_a_format_s_spans_bytes_and_slots_describe_the_stored_matrix(case):
    kind, s_off, Kp, wq, ws, wf, w_off = _stored(case, np.random.default_rng(1))
    fmt = FM.weight_format(kind)
    arrays = {"wq": wq, "ws": ws, "wf": wf}
    spans = fmt.spans(N, K, Kp, w_off, s_off)
    assert spans and all(off + n == arrays[a].size for a, off, n in spans)     # each ends its array
    assert FM.matrix_bytes(kind, N, K, Kp, w_off, s_off) == sum(n * arrays[a].itemsize for a, _, n in spans)
    assert fmt.spans(N, K + 32, Kp, w_off, s_off) is None                       # rows shorter than K
    first, second = fmt.slot(w_off, s_off, Kp, 0, 16), fmt.slot(w_off, s_off, Kp, 16, 32)
    assert first[3] == second[3] == Kp
    if kind != P.WEIGHT_Q8:                      # rows in order: the second member starts past the first
        item = arrays[spans[0][0]].itemsize
        assert second[1] == first[1] + first[2] and first[2] == 16 * fmt.row_bytes(Kp, s_off) // item
    else:                                        # panels interleave rows: the matrix's offsets, then the first row
        assert first[1:3] == [w_off, 16 * Kp] and second[4:] == [s_off, 16]


def test_the_screen_column_names_the_screen_each_format_gets():
    assert FM.weight_format(P.WEIGHT_Q8).screen(0) == "q8"
    assert FM.weight_format(P.WEIGHT_F32).screen(-1) is None
    blocks = FM.weight_format(P.WEIGHT_BLOCKS)
    assert blocks.screen(gb.Q6_K.ggml_type) == "blocks"
    assert blocks.screen(gb.Q6_K.ggml_type + kquant_panels.PANELED) is None and blocks.screen(gb.Q4_1.ggml_type) is None
