"""The instruction table's contract (cpullm_kernels.program.program_table): each op's column names take
distinct columns inside the tables, and no other source indexes the tables by bare number."""
from __future__ import annotations

import re
from pathlib import Path

from cpullm_kernels.program import program_table as P

REPO = Path(__file__).resolve().parent.parent
LAYOUTS = ("LINEAR", "EMBED", "NORM", "ROPE", "ATTENTION", "GLU", "BINARY", "UNARY", "GATED_DELTA")
# I[r, 9], F[r, 0], I[:, 6], Ir[3:14], I[3:23]: a table indexed by a number literal
BARE_COLUMN = re.compile(r"\b(I|F|Ir|Fr)\[[^][]*\b\d+(:\d*)?\]")


def test_each_op_layout_names_distinct_columns_inside_the_tables():
    ints = {k: v for k, v in vars(P).items() if k.isupper() and type(v) is int}
    assert (P.COL_OP, P.COL_IMPL, P.COL_SECTION) == (0, 1, 2)
    for op in LAYOUTS:
        cols = {k: v for k, v in ints.items() if k.startswith(op + "_") and not k.startswith("GLU_ACT_")}
        assert len(cols) >= 5 and len(set(cols.values())) == len(cols), (op, cols)
        assert all(3 <= c < P.NI for c in cols.values()), (op, cols)
        fcols = {k: v for k, v in ints.items() if k.startswith("F_" + op + "_")}
        assert len(set(fcols.values())) == len(fcols), (op, fcols)
        assert all(0 <= c < P.NF for c in fcols.values()), (op, fcols)


def test_gated_delta_kernel_columns_cover_its_operands_once():
    cols = P.GATED_DELTA_KERNEL_COLUMNS
    assert len(cols) == len(set(cols)) == 20          # the 20 integers of EXTERNAL_SIGNATURES
    assert {c for pair in P.GATED_DELTA_ROW_OPERANDS for c in pair} <= set(cols)


def test_no_source_indexes_the_tables_by_number():
    hits = []
    for folder in ("core", "kernels", "plugins", "benchmarks", "scripts", "tests"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path.name in ("program_table.py", Path(__file__).name) or ".venv" in path.parts:
                continue
            for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if BARE_COLUMN.search(line):
                    hits.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
    assert hits == [], "index I/F by the names in cpullm_kernels.program.program_table:\n" + "\n".join(hits)
