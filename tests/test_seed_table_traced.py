"""The seed's ZeRO table holds for the trainer as `launch verify` traces it: the 6.7B-class SwiGLU shape
(hidden 4096, vocab 32000, ffn 11008) on 8 GPUs, grad_dtype bf16, ZeRO 0-3 — the traced peak's bytes
outside activations within 15 % of the seed's per_gpu_state_gb for the model's own parameter count.

At 4 layers here (tracing costs per op; every share the seed counts is per parameter, so the depth does
not change the ratio): `python benchmarks/seed_table_traced.py` prints the 32-layer table.
"""

from __future__ import annotations

import pytest

from benchmarks.seed_table_traced import row

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_traced_state_is_the_seeds_zero_row(zero):
    pytest.importorskip("torch")
    r = row(zero, layers=4)
    assert "error" not in r, r
    assert r["outside_activations_gb"] == pytest.approx(r["seed_gb"], rel=0.15), r
