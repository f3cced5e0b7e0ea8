"""The ledger against `launch verify`'s trace of the real trainer at full world size (fake process
group, FakeTensorMode, torch's memory tracker), per pipeline rank: totals within 10 % over a small
matrix (ZeRO 0/2/3, full recompute, TP, CP, a 1F1B pipeline) that traces in a few minutes here.
benchmarks/ledger_vs_trace.py prints the whole matrix, large models and categories included.
"""

from __future__ import annotations

import pytest

from benchmarks.ledger_vs_trace import QUICK, compare

pytestmark = pytest.mark.integration

MATRIX = ["tiny dp8 z0 none", "tiny dp8 z2 none", "tiny dp8 z3 full", "tiny tp2 dp4 z3", "tiny cp2 dp4 z1",
          "tiny pp2 1f1b z2"]


@pytest.mark.parametrize("name", MATRIX)
def test_ledger_within_ten_percent_of_the_trace(name):
    pytest.importorskip("torch")
    rows = compare(name, dict(QUICK)[name])
    assert rows
    for row in rows:
        assert "traced_gb" in row, row
        assert row["ledger_gb"] == pytest.approx(row["traced_gb"], rel=0.10), row
