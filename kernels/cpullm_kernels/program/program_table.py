"""The compiled program's instruction table, every column by name: the one contract between the
compiler that writes it (cpullm.compile.compiler) and everything that reads it (the interpreter, the
executor, the batch decoder, the bench's memory-bound count, the head screen).

A program holds one row per instruction in two tables:

    I  int64   (n, NI)   opcode, how it runs, which rows, then per-op integers (offsets, sizes)
    F  float64 (n, NF)   per-op floats (epsilon, scales, ...)

Cells an op does not use hold -1 in ``I`` and 0.0 in ``F``. Offsets are element offsets into a
flat array: ``*_off``/``*_st`` pairs are an arena value's first element and row stride (float32
elements); weight offsets point into ``wq`` (int8; raw ggml blocks: bytes), ``ws`` (uint16 binary16
scales) or ``wf`` (float32); ``ATTENTION_CACHE_OFF``/``GATED_DELTA_STATE_OFF`` into ``state``.

The names are plain module-level ints, so numba compiles ``I[r, LINEAR_KIND]`` exactly like
``I[r, 9]``. Numba's on-disk cache keys a kernel on its own source file only: a changed number here
needs the numba cache cleared, ``KERNELS_VERSION`` bumped (old execution caches hold the old
layout) and ``cache_format.FORMAT_VERSION`` bumped if the stored program's shape changes.

Columns every instruction has:

    col  name          meaning
    0    COL_OP        opcode, OP_* (the values of cpullm.graph.ir.Op; a test checks they agree)
    1    COL_IMPL      IMPL_INTERPRETER: run by interpreter.run; IMPL_EXTERNAL: a plugin kernel
                       replaces it (meta["external"]); IMPL_PLUGIN_OP: a plugin op, run by the
                       executor from meta["plugin_ops"][row]
    2    COL_SECTION   SECTION_BODY: runs on rt[0] rows; SECTION_HEAD: on rt[3] rows

Per op (``I`` columns 3.., ``F`` columns 0..):

    op                    col  name                     meaning
    LINEAR                3-6  LINEAR_X_OFF, _X_ST,     input and output (offset, row stride)
                               _OUT_OFF, _OUT_ST
                          7    LINEAR_K                 input width
                          8    LINEAR_N                 output width (rows of the matrix)
                          9    LINEAR_KIND              WEIGHT_F32 | WEIGHT_Q8 | WEIGHT_BLOCKS
                          10   LINEAR_W_OFF             matrix: wf (f32), wq (q8), wq's bytes (blocks)
                          11   LINEAR_S_OFF             q8: scales in ws; blocks: the ggml type; f32: -1
                          12   LINEAR_KP                weights per stored row: K padded to whole blocks
                          13   LINEAR_BIAS_OFF          bias in wf, -1: none
    EMBED                 3-4  EMBED_OUT_OFF, _OUT_ST   output (offset, row stride)
                          5    EMBED_WIDTH              hidden width H
                          6    EMBED_KIND               as LINEAR_KIND
                          7-9  EMBED_W_OFF, _S_OFF, _KP as LINEAR's columns 10-12
                          F0   F_EMBED_SCALE            multiplies every embedding value
    RMSNORM, LAYERNORM    3-6  NORM_X_OFF, _X_ST,       input and output
                               _OUT_OFF, _OUT_ST
                          7    NORM_WIDTH               width of the value
                          8    NORM_GROUP               normalized group size (== width, or a head)
                          9    NORM_W_OFF               weight in wf
                          10   NORM_BIAS_OFF            LAYERNORM: bias in wf, -1: none
                          F0   F_NORM_EPS               epsilon
    ROPE                  3-6  ROPE_X_OFF, _X_ST,       input and output
                               _OUT_OFF, _OUT_ST
                          7-9  ROPE_N_HEADS, _HEAD_DIM, _ROTARY_DIM
                          10   ROPE_FREQ_OFF            inverse frequencies (rotary_dim / 2) in wf
                          F0   F_ROPE_SCALING           attention scaling of the cos/sin
    ATTENTION             3-10 ATTENTION_Q_OFF, _Q_ST, _K_OFF, _K_ST, _V_OFF, _V_ST, _OUT_OFF,
                               _OUT_ST: q, k, v and output
                          11-13 ATTENTION_N_HEADS, _N_KV_HEADS, _HEAD_DIM
                          14   ATTENTION_CACHE_OFF      KV cache region in state
                          15   ATTENTION_CAP            cache slots (whole key tiles)
                          16   ATTENTION_KV_FORMAT      KV_F32 (0): float32 keys/values; KV_F16 (1):
                                                        float16, the region's floats hold two each
                          F0-2 F_ATTENTION_SCALE, F_ATTENTION_SOFTCAP (0: none),
                               F_ATTENTION_WINDOW (0: full attention; else a sliding window)
    GLU                   3-8  GLU_GATE_OFF, _GATE_ST, _UP_OFF, _UP_ST, _OUT_OFF, _OUT_ST
                          9    GLU_WIDTH
                          10   GLU_ACT                  GLU_ACT_SILU | GLU_ACT_GELU_TANH
    ADD, SIGMOID_MUL      3-8  BINARY_A_OFF, _A_ST, _B_OFF, _B_ST, _OUT_OFF, _OUT_ST
                          9    BINARY_WIDTH
    SOFTCAP, SCALE,       3-6  UNARY_X_OFF, _X_ST,      input and output
    SELECT_ROWS                _OUT_OFF, _OUT_ST
                          7    UNARY_WIDTH
                          F0   F_UNARY_PARAM            SOFTCAP: the cap; SCALE: the factor
    GATED_DELTA           3-12 GATED_DELTA_QKV_OFF, _QKV_ST, _Z_OFF, _Z_ST, _B_OFF, _B_ST,
                               _A_OFF, _A_ST, _OUT_OFF, _OUT_ST: the arena operands
                          13-17 GATED_DELTA_NK, _DK, _NV, _DV, _CONV_K: key/value heads and
                               head dims, convolution kernel length
                          18-21 GATED_DELTA_CONV_W_OFF, _DT_OFF, _ALOG_OFF, _NORM_OFF (in wf)
                          22   GATED_DELTA_STATE_OFF    its region in state
                          F0   F_GATED_DELTA_EPS        the output norm's epsilon
    ACT                   3-7  as SOFTCAP's (UNARY_*)   input, output, width
                          8    ACT_KIND                 kernels.pointwise.ACT_* (gelu, gelu_tanh, relu, silu)
    POS_EMBED             3-7  as SOFTCAP's (UNARY_*)   input, output, width
                          8    POS_TABLE_OFF            the position table (POS_ROWS, width) in wf
                          9    POS_OFFSET               table row of position 0 (OPT: 2)
                          10   POS_ROWS                 rows of the table
    PLUGIN                (none) COL_IMPL is IMPL_PLUGIN_OP; operands in meta["plugin_ops"][row]
    MOE                   3-6  MOE_X_OFF, _X_ST,        input and output (offset, row stride)
                               _OUT_OFF, _OUT_ST
                          7    MOE_WIDTH                hidden width H
                               run by the executor (cpullm_kernels.program.moe.moe); its router, expert
                               table and sizes in meta["moe"][row]

``I`` column 23 and ``F`` column 3 are spare.
"""
from typing import NamedTuple

NI = 24                 # columns of I
NF = 4                  # columns of F

# ---- opcodes: column COL_OP (== cpullm.graph.ir.Op values) -------------------------------------------
OP_EMBED = 1
OP_RMSNORM = 2
OP_LINEAR = 3
OP_ROPE = 4
OP_ATTENTION = 5
OP_GLU = 6
OP_ADD = 7
OP_SIGMOID_MUL = 8
OP_SOFTCAP = 9
OP_SELECT_ROWS = 11
OP_GATED_DELTA = 12
OP_SCALE = 13
OP_LAYERNORM = 14
OP_ACT = 20            # (16-19 left to other core ops)
OP_POS_EMBED = 21
OP_PLUGIN = 15         # a plugin's op: run by the executor from Python (meta["plugin_ops"]), never here
OP_MOE = 16            # routed experts: run by the executor (kernels.moe, meta["moe"]), never by interpreter.run

# ---- weight kinds: LINEAR_KIND / EMBED_KIND --------------------------------------------------------
WEIGHT_F32 = 0
WEIGHT_Q8 = 1
WEIGHT_BLOCKS = 2      # raw ggml blocks (kernels/cpullm_kernels/rows/gguf_blocks.py) in wq's bytes; s_off holds the ggml type,
#                        plus kquant_panels.PANELED when Q4_K / Q6_K rows are stored in panels of 16

# ---- columns every instruction has ----------------------------------------------------------------
COL_OP = 0
COL_IMPL = 1
COL_SECTION = 2

IMPL_INTERPRETER = 0
IMPL_EXTERNAL = 1
IMPL_PLUGIN_OP = 2

SECTION_BODY = 0
SECTION_HEAD = 1

# ---- LINEAR ------------------------------------------------------------------------------------
LINEAR_X_OFF = 3
LINEAR_X_ST = 4
LINEAR_OUT_OFF = 5
LINEAR_OUT_ST = 6
LINEAR_K = 7
LINEAR_N = 8
LINEAR_KIND = 9
LINEAR_W_OFF = 10
LINEAR_S_OFF = 11
LINEAR_KP = 12
LINEAR_BIAS_OFF = 13

# ---- EMBED -------------------------------------------------------------------------------------
EMBED_OUT_OFF = 3
EMBED_OUT_ST = 4
EMBED_WIDTH = 5
EMBED_KIND = 6
EMBED_W_OFF = 7
EMBED_S_OFF = 8
EMBED_KP = 9
F_EMBED_SCALE = 0

# ---- RMSNORM, LAYERNORM ------------------------------------------------------------------------
NORM_X_OFF = 3
NORM_X_ST = 4
NORM_OUT_OFF = 5
NORM_OUT_ST = 6
NORM_WIDTH = 7
NORM_GROUP = 8
NORM_W_OFF = 9
NORM_BIAS_OFF = 10
F_NORM_EPS = 0

# ---- ROPE --------------------------------------------------------------------------------------
ROPE_X_OFF = 3
ROPE_X_ST = 4
ROPE_OUT_OFF = 5
ROPE_OUT_ST = 6
ROPE_N_HEADS = 7
ROPE_HEAD_DIM = 8
ROPE_ROTARY_DIM = 9
ROPE_FREQ_OFF = 10
F_ROPE_SCALING = 0

# ---- ATTENTION ---------------------------------------------------------------------------------
ATTENTION_Q_OFF = 3
ATTENTION_Q_ST = 4
ATTENTION_K_OFF = 5
ATTENTION_K_ST = 6
ATTENTION_V_OFF = 7
ATTENTION_V_ST = 8
ATTENTION_OUT_OFF = 9
ATTENTION_OUT_ST = 10
ATTENTION_N_HEADS = 11
ATTENTION_N_KV_HEADS = 12
ATTENTION_HEAD_DIM = 13
ATTENTION_CACHE_OFF = 14
ATTENTION_CAP = 15
ATTENTION_KV_FORMAT = 16
F_ATTENTION_SCALE = 0
F_ATTENTION_SOFTCAP = 1
F_ATTENTION_WINDOW = 2

# ---- GLU ---------------------------------------------------------------------------------------
GLU_GATE_OFF = 3
GLU_GATE_ST = 4
GLU_UP_OFF = 5
GLU_UP_ST = 6
GLU_OUT_OFF = 7
GLU_OUT_ST = 8
GLU_WIDTH = 9
GLU_ACT = 10

GLU_ACT_SILU = 0
GLU_ACT_GELU_TANH = 1

# ---- ADD, SIGMOID_MUL --------------------------------------------------------------------------
BINARY_A_OFF = 3
BINARY_A_ST = 4
BINARY_B_OFF = 5
BINARY_B_ST = 6
BINARY_OUT_OFF = 7
BINARY_OUT_ST = 8
BINARY_WIDTH = 9

# ---- SOFTCAP, SCALE, SELECT_ROWS ---------------------------------------------------------------
UNARY_X_OFF = 3
UNARY_X_ST = 4
UNARY_OUT_OFF = 5
UNARY_OUT_ST = 6
UNARY_WIDTH = 7
F_UNARY_PARAM = 0

# ---- ACT, POS_EMBED (their first columns are UNARY_*'s) ------------------------------------------
ACT_KIND = 8
POS_TABLE_OFF = 8
POS_OFFSET = 9
POS_ROWS = 10

# ---- GATED_DELTA -------------------------------------------------------------------------------
GATED_DELTA_QKV_OFF = 3
GATED_DELTA_QKV_ST = 4
GATED_DELTA_Z_OFF = 5
GATED_DELTA_Z_ST = 6
GATED_DELTA_B_OFF = 7
GATED_DELTA_B_ST = 8
GATED_DELTA_A_OFF = 9
GATED_DELTA_A_ST = 10
GATED_DELTA_OUT_OFF = 11
GATED_DELTA_OUT_ST = 12
GATED_DELTA_NK = 13
GATED_DELTA_DK = 14
GATED_DELTA_NV = 15
GATED_DELTA_DV = 16
GATED_DELTA_CONV_K = 17
GATED_DELTA_CONV_W_OFF = 18
GATED_DELTA_DT_OFF = 19
GATED_DELTA_ALOG_OFF = 20
GATED_DELTA_NORM_OFF = 21
GATED_DELTA_STATE_OFF = 22
F_GATED_DELTA_EPS = 0

# ---- MOE ---------------------------------------------------------------------------------------
MOE_X_OFF = 3
MOE_X_ST = 4
MOE_OUT_OFF = 5
MOE_OUT_ST = 6
MOE_WIDTH = 7

# The integer arguments of gated_delta (and of a plugin kernel replacing it, see
# interpreter.EXTERNAL_SIGNATURES), in its argument order: after (arena, state, wf), before (eps, T).
GATED_DELTA_KERNEL_COLUMNS = (
    GATED_DELTA_QKV_OFF, GATED_DELTA_QKV_ST, GATED_DELTA_Z_OFF, GATED_DELTA_Z_ST,
    GATED_DELTA_B_OFF, GATED_DELTA_B_ST, GATED_DELTA_A_OFF, GATED_DELTA_A_ST,
    GATED_DELTA_OUT_OFF, GATED_DELTA_OUT_ST, GATED_DELTA_NK, GATED_DELTA_DK, GATED_DELTA_NV,
    GATED_DELTA_DV, GATED_DELTA_CONV_K, GATED_DELTA_CONV_W_OFF, GATED_DELTA_DT_OFF,
    GATED_DELTA_ALOG_OFF, GATED_DELTA_NORM_OFF, GATED_DELTA_STATE_OFF,
)
# (offset column, row-stride column) of each arena operand: a sequence's rows start further on
GATED_DELTA_ROW_OPERANDS = (
    (GATED_DELTA_QKV_OFF, GATED_DELTA_QKV_ST), (GATED_DELTA_Z_OFF, GATED_DELTA_Z_ST),
    (GATED_DELTA_B_OFF, GATED_DELTA_B_ST), (GATED_DELTA_A_OFF, GATED_DELTA_A_ST),
    (GATED_DELTA_OUT_OFF, GATED_DELTA_OUT_ST),
)


class LinearOperands(NamedTuple):
    """One LINEAR row's integer columns as Python ints (for the Python-side readers)."""

    x_off: int
    x_st: int
    out_off: int
    out_st: int
    k: int
    n: int
    kind: int
    w_off: int
    s_off: int
    kp: int
    bias_off: int


def linear_operands(row) -> LinearOperands:
    """``row``: one instruction of ``I`` (NI,) whose opcode is OP_LINEAR."""
    return LinearOperands(*(int(row[c]) for c in (
        LINEAR_X_OFF, LINEAR_X_ST, LINEAR_OUT_OFF, LINEAR_OUT_ST, LINEAR_K, LINEAR_N, LINEAR_KIND,
        LINEAR_W_OFF, LINEAR_S_OFF, LINEAR_KP, LINEAR_BIAS_OFF)))
