"""The time model's overlap claims against the bundled trainer measured on CPU/gloo (benchmarks/overlap_gloo.py,
whose docstring says what carries from gloo to NCCL): per collective kind, exposed / total communication.

What is asserted, in the direction that carries:
- TP/SP's all-gathers and reduce-scatters and ZeRO 1's reduce-scatter and all-gather are waited for at once
  (no compute beside them: exposed / total >= 0.95; a collective with compute in its span reads less), and
  the model charges them whole (1.0).
- FSDP2's prefetched all-gathers (asynchronous unshard + forward prefetch, the collective-level form of its
  streams' overlap) have compute beside them: exposed / total <= 0.9, where a gather waited for at once reads
  1.0 (the on-demand first gather of each pass does, as the model's exposed edge says); and the model says
  the FSDP term is mostly hidden (<= 0.5) and below ZeRO 1's.
Tolerance: on this 2-core host the two ranks' compute threads and gloo's own threads share the cores and the
ranks drift apart, so a prefetched gather often outlasts the block it hides behind; its measured exposure
ranged 0.11-0.81 over runs at load averages 5-17. 0.9 separates "compute ran beside it" from "waited for at
once" without claiming a magnitude the host cannot give. 0.95 for the synchronous kinds leaves room for
op-boundary gaps (a collective holding under 1% compute counts as blocking).
tests/unit/test_overlap_accounting.py checks the trace accounting on hand-made spans.
"""

from __future__ import annotations

import pytest

from benchmarks.overlap_gloo import (
    collect,
    jobs,
    measure_worker,
    model_exposed,
)
from tests.trainer_helpers import free_port, spawn

pytestmark = pytest.mark.integration

#: the tiny preset's block, at a sequence long enough that a block's compute outlasts its all-gather
SHAPE = dict(layers=4, hidden=64, heads=4, kv_heads=2, ffn_hidden=176)
LAYOUTS = ["fsdp-z3-prefetch", "zero1", "tp-sp"]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    js = jobs(LAYOUTS, steps=2, shape=SHAPE, seq_len=256)
    d = tmp_path_factory.mktemp("overlap")
    spawn(measure_worker, (2, js, str(d), free_port()), 2)
    res = collect(js, d)
    return {j["name"]: (j, res[j["name"]]) for j in js}


def ratio(res: dict, kind: str) -> float:
    d = res["kinds"][kind]
    assert d["n"] > 0 and d["total_s"] > 0, f"{kind}: nothing measured"
    return d["exposed_s"] / d["total_s"]


def test_synchronous_kinds_are_exposed_as_the_model_charges_them(measured):
    for name, kinds, term in (("tp-sp", ("TP/SP all_gather", "TP/SP reduce_scatter"), "tp"),
                              ("zero1", ("ZeRO 1 reduce-scatter", "ZeRO 1 all-gather"), "dp")):
        job, res = measured[name]
        assert "error" not in res, res.get("trace")
        assert res["unmatched"] == 0
        for k in kinds:
            assert ratio(res, k) >= 0.95, (name, k, res["kinds"][k])
        assert model_exposed(job["plan"], res)[term] == pytest.approx(1.0)


def test_fsdp_prefetched_all_gathers_overlap_and_the_model_hides_them(measured):
    job, res = measured["fsdp-z3-prefetch"]
    assert "error" not in res, res.get("trace")
    assert res["unmatched"] == 0
    assert ratio(res, "FSDP all-gather (prefetched)") <= 0.9, res["kinds"]
    assert ratio(res, "FSDP all-gather (on demand)") >= 0.95, res["kinds"]
    fsdp = model_exposed(job["plan"], res)["dp"]
    zero1 = model_exposed(measured["zero1"][0]["plan"], measured["zero1"][1])["dp"]
    assert fsdp <= 0.5 and fsdp < zero1, (fsdp, zero1)
