"""Decode matvec over raw GGUF blocks (cpullm_kernels.rows.kquant) vs its numpy reference, on every
format, every ISA variant this CPU runs (generic always; AVX2 and AVX-512 VNNI where present),
awkward shapes, extreme values, and a codegen guard."""
import re

import numba
import numpy as np
import pytest
from numba import njit

from cpullm_kernels.rows import gguf_blocks as gb
from cpullm_kernels.rows import kquant as kq

RNG = np.random.default_rng(20261204)
FORMATS = ["Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q5_K", "Q4_1", "Q5_0", "Q5_1"]
ISAS = [pytest.param(i, id=kq.ISA_NAMES[i]) for i in kq.ISAS]


def _shapes(name):
    W = gb.FORMATS[name].block_weights
    # N = 1, odd N, K one block, an odd and an even number of blocks, and a long row; for the
    # 32-weight formats also groups of 8 blocks with an odd (19 = 2 * 8 + 3) and an even tail
    # (30 = 3 * 8 + 6) after them
    extra = [(6, 19 * W), (4, 30 * W)] if W == 32 else []
    return [(1, W), (7, W), (33, 2 * W), (5, 3 * W), (64, 5 * W), (3, 8192 if W == 256 else 4864)] + extra


def _act(K, scale=1.0):
    x = (RNG.standard_normal(K) * scale).astype(np.float32)
    if K > 40:
        x[3] = 40.0 * scale                       # an outlier inside one block
        x[32:64] = 0.0                            # an all-zero block (scale 0)
    x_q = np.full(K, 99, np.int8)                 # garbage: every value must be overwritten
    x_s = np.full(K // 32, np.nan, np.float32)
    x_m = np.full(K // 16, np.nan, np.float32)
    kq.quantize_act_q8(x, x_q, x_s, x_m)
    return x, x_q, x_s, x_m


def _check_close(out, w, name, N, K, x_q, x_s):
    ref = kq.matvec_ref(w, name, (N, K), x_q, x_s)
    deq = np.abs(gb.dequantize_ref(w, name, (N, K)).astype(np.float64))
    terms = deq @ np.abs(x_q * np.repeat(x_s, 32).astype(np.float64))
    assert np.isfinite(out).all()
    # float32 sums across blocks: error relative to the sum of absolute terms
    assert (np.abs(out.astype(np.float64) - ref) <= 2e-6 * terms + 1e-30).all()


@pytest.mark.parametrize("K", [32, 64, 96, 256, 4864, 8192])
def test_quantize_act_q8_matches_reference(K):
    x, x_q, x_s, x_m = _act(K, 3.0)
    r_q, r_s, r_m = kq.quantize_act_q8_ref(x)
    np.testing.assert_array_equal(x_q, r_q)
    np.testing.assert_array_equal(x_s, r_s)
    np.testing.assert_array_equal(x_m, r_m)
    assert np.abs(x_q.astype(np.int32)).max() == 127
    step = np.repeat(x_s, 32).astype(np.float64)
    assert (np.abs(x_q * step - x) <= 0.501 * step + 1e-30).all()


def test_quantize_act_q8_rejects_bad_shapes():
    with pytest.raises(ValueError):
        kq.quantize_act_q8(np.zeros(40, np.float32), np.zeros(40, np.int8), np.zeros(1, np.float32),
                           np.zeros(2, np.float32))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", FORMATS)
def test_matvec_matches_reference(name, isa):
    fmt = gb.FORMATS[name]
    for N, K in _shapes(name):
        w = gb.random_blocks(name, N, K, RNG)
        _, x_q, x_s, x_m = _act(K)
        out = np.full(N, np.nan, np.float32)
        kq.MATVECS[isa](fmt.ggml_type, w, x_q, x_s, x_m, out)
        _check_close(out, w, name, N, K, x_q, x_s)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", FORMATS)
def test_matvec_extreme_quants_do_not_overflow(name, isa):
    # every quant at its largest (all bits set) or smallest (all clear) against x_q = +-127 of
    # one sign per block: the int16 pairs of vpmaddubsw and the int32 sums at their limits
    fmt = gb.FORMATS[name]
    N, K = 4, 2 * fmt.block_weights
    w = gb.random_blocks(name, N, K, RNG, scale=1.0)
    b = w.reshape(-1, fmt.block_bytes)
    quant_bytes = {"Q8_0": [(2, 34)], "Q4_0": [(2, 18)], "Q4_1": [(4, 20)], "Q5_0": [(2, 22)], "Q5_1": [(4, 24)],
                   "Q4_K": [(16, 144)], "Q5_K": [(16, 176)], "Q6_K": [(0, 192)]}[name]
    for lo, hi in quant_bytes:
        b[0::2, lo:hi] = 0xFF
        b[1::2, lo:hi] = 0x00 if name != "Q8_0" else 0x80          # Q8_0: -128
    x = np.where(np.arange(K) // 32 % 2 == 0, 1.0, -1.0).astype(np.float32)
    _, x_q, x_s, x_m = _act(K)
    kq.quantize_act_q8(x, x_q, x_s, x_m)
    assert np.abs(x_q.astype(np.int32)).min() == 127
    out = np.full(N, np.nan, np.float32)
    kq.MATVECS[isa](fmt.ggml_type, w, x_q, x_s, x_m, out)
    _check_close(out, w, name, N, K, x_q, x_s)


@pytest.mark.parametrize("isa", ISAS)
def test_matvec_reads_strided_row_views(isa):
    # a tensor inside a larger mapped buffer: rows contiguous, row stride larger than a row
    name = "Q4_K"
    N, K = 9, 512
    fmt = gb.FORMATS[name]
    w = gb.random_blocks(name, N, K, RNG)
    big = np.zeros((N, w.shape[1] + 40), np.uint8)
    big[:, :w.shape[1]] = w
    _, x_q, x_s, x_m = _act(K)
    out = np.full(N, np.nan, np.float32)
    kq.MATVECS[isa](fmt.ggml_type, big[:, :w.shape[1]], x_q, x_s, x_m, out)
    _check_close(out, w, name, N, K, x_q, x_s)


def test_matvec_is_the_best_variant():
    # compiled code's matvec_at calls each format's kernel of the best ISA, compiled on first use
    for fmt in kq.MATVEC_FORMATS:
        assert kq.MATVEC[fmt].dispatcher is kq.matvec_kernel(fmt, kq.BEST_ISA)
    assert kq.matvec_kernel(kq.Q4_1, kq.ISA_GENERIC).py_func.__qualname__ == "matvec_q4_1_generic"
    if kq.HAVE_VNNI512:
        assert kq.BEST_ISA == kq.ISA_VNNI512


def test_matvec_rejects_bad_input():
    w = gb.random_blocks("Q4_K", 4, 256, RNG)
    _, x_q, x_s, x_m = _act(256)
    with pytest.raises(ValueError):
        kq.matvec(kq.Q4_K, w, x_q, x_s, x_m, np.zeros(3, np.float32))
    with pytest.raises(ValueError):
        kq.matvec(kq.Q6_K, w, x_q, x_s, x_m, np.zeros(4, np.float32))     # 144-byte rows are not Q6_K
    with pytest.raises(ValueError):
        kq.matvec(9, w, x_q, x_s, x_m, np.zeros(4, np.float32))           # Q8_1: not a weight format
    with pytest.raises(ValueError):                                        # ... nor from compiled code
        from numba.typed import List
        _serial_caller(np.array([9]), List([w]), np.zeros(256, np.float32), x_q, x_s, x_m,
                       List([np.zeros(4, np.float32)]))


@njit(cache=False)
def _serial_caller(fmts, ws, x, x_q, x_s, x_m, outs):
    # the interpreter pattern: a non-parallel njit function running the (parallel) kernel of each
    # format through its address (a run-time format)
    kq.quantize_act_q8(x, x_q, x_s, x_m)
    for i in range(fmts.size):
        kq.matvec_at(fmts[i], ws[i], x_q, x_s, x_m, outs[i])


def test_matvec_from_a_serial_njit_caller():
    from numba.typed import List
    N, K = 13, 512
    names = ["Q4_K", "Q6_K", "Q8_0"]
    ws = List()
    outs = List()
    fmts = np.array([gb.FORMATS[n].ggml_type for n in names], np.int64)
    raw = [gb.random_blocks(n, N, K, RNG) for n in names]
    for r in raw:
        ws.append(r)
        outs.append(np.zeros(N, np.float32))
    x = RNG.standard_normal(K).astype(np.float32)
    x_q, x_s, x_m = np.empty(K, np.int8), np.empty(K // 32, np.float32), np.empty(K // 16, np.float32)
    _serial_caller(fmts, ws, x, x_q, x_s, x_m, outs)
    for name, r, out in zip(names, raw, outs):
        _check_close(out, r, name, N, K, x_q, x_s)


# ---- codegen guard -----------------------------------------------------------------------------

def _fresh_asm(dispatcher, *args):
    """Assembly of a dispatcher's function, compiled afresh (numba cannot inspect cached code)."""
    fresh = numba.njit(**{k: v for k, v in dispatcher.targetoptions.items() if k != "nopython"})(dispatcher.py_func)
    fresh(*args)
    return fresh.inspect_asm(fresh.signatures[0])


def _formats_asm(isa, names=("Q4_K", "Q8_0")) -> str:
    """Assembly of the matvecs of ``names`` on ``isa``: a K-quant and Q8_0 (the 32-weight blocks'
    path, with vpsignb)."""
    asm = []
    for name in names:
        w = gb.random_blocks(name, 8, 512, RNG)
        _, x_q, x_s, x_m = _act(512)
        asm.append(_fresh_asm(kq.matvec_kernel(gb.FORMATS[name].ggml_type, isa), w, x_q, x_s, x_m,
                              np.zeros(8, np.float32)))
    return "\n".join(asm)


@pytest.mark.skipif(not kq.HAVE_AVX2, reason="x86 AVX2 host only")
def test_avx2_codegen_uses_byte_multiply_adds():
    asm = _formats_asm(kq.ISA_AVX2)
    for insn in ("vpmaddubsw", "vpmaddwd", "vphaddw", "vcvtdq2ps", "vfmadd", "prefetcht0", "vpsignb"):
        assert insn in asm, f"{insn} missing: the AVX2 k-quant matvec lost its vector code"


@pytest.mark.skipif(not kq.HAVE_AVXVNNI, reason="x86 AVX-VNNI host only")
def test_avxvnni_codegen_uses_vpdpbusd_on_ymm():
    asm = _formats_asm(kq.ISA_AVXVNNI)
    assert re.search(r"vpdpbusd\s+[^\n]*%ymm", asm), "the AVX-VNNI k-quant matvec lost its ymm vpdpbusd"
    if not kq.HAVE_VNNI512:      # compiled for a target without AVX-512 (numba_setup.restricted_target_env)
        assert "zmm" not in asm and "{evex}" not in asm, "the AVX-VNNI variant must not need AVX-512"


@pytest.mark.skipif(not kq.HAVE_VNNI512, reason="AVX-512 VNNI host only")
def test_vnni_codegen_uses_vpdpbusd_on_zmm():
    asm = _formats_asm(kq.ISA_VNNI512)
    assert re.search(r"vpdpbusd\s+[^\n]*%zmm", asm), "the K-quants lost their zmm vpdpbusd"
    assert re.search(r"vpdpbusd\s+[^\n]*%ymm", asm), "the 32-weight formats lost their ymm vpdpbusd"
