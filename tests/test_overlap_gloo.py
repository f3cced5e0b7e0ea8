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
A unit test checks the trace accounting on hand-made spans.
"""

from __future__ import annotations

import pytest

from benchmarks.overlap_gloo import (
    GRAD_REDUCE,
    OPT,
    STEP,
    Span,
    analyse,
    collect,
    jobs,
    measure_worker,
    model_exposed,
)
from tests.trainer_helpers import free_port, spawn

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


@pytest.mark.integration
def test_synchronous_kinds_are_exposed_as_the_model_charges_them(measured):
    for name, kinds, term in (("tp-sp", ("TP/SP all_gather", "TP/SP reduce_scatter"), "tp"),
                              ("zero1", ("ZeRO 1 reduce-scatter", "ZeRO 1 all-gather"), "dp")):
        job, res = measured[name]
        assert "error" not in res, res.get("trace")
        assert res["unmatched"] == 0
        for k in kinds:
            assert ratio(res, k) >= 0.95, (name, k, res["kinds"][k])
        assert model_exposed(job["plan"], res)[term] == pytest.approx(1.0)


@pytest.mark.integration
def test_fsdp_prefetched_all_gathers_overlap_and_the_model_hides_them(measured):
    job, res = measured["fsdp-z3-prefetch"]
    assert "error" not in res, res.get("trace")
    assert res["unmatched"] == 0
    assert ratio(res, "FSDP all-gather (prefetched)") <= 0.9, res["kinds"]
    assert ratio(res, "FSDP all-gather (on demand)") >= 0.95, res["kinds"]
    fsdp = model_exposed(job["plan"], res)["dp"]
    zero1 = model_exposed(measured["zero1"][0]["plan"], measured["zero1"][1])["dp"]
    assert fsdp <= 0.5 and fsdp < zero1, (fsdp, zero1)


@pytest.mark.unit
def test_trace_accounting_on_hand_made_spans():
    """A blocking collective is exposed whole; one with compute beside it only where the thread idles; an
    asynchronous one queued behind a blocking one does not count that wait again; the enqueue call is left
    out; the step's scalars and the ZeRO reduce are told by their scopes."""
    M, W = "main", "gloo"
    spans = [Span(STEP, M, 0, 1000),
             # forward: an async all-gather [10, 100] beside compute [20, 80]: idle 10-20 and 80-100 -> 30 exposed
             Span("c10d::_allgather_base_", M, 5, 10), Span("gloo:all_gather", W, 12, 100),
             Span("aten::mm", M, 20, 80),
             # a synchronous all-reduce [110, 150] (no compute beside it) -> 40 exposed
             Span("c10d::allreduce_", M, 105, 110), Span("gloo:all_reduce", W, 111, 150),
             # an async all-gather [160, 300] queued behind a blocking all-reduce [170, 250], compute 250-290:
             # its idle time not inside the blocking one: 160-170 and 290-300 -> 20
             Span("c10d::_allgather_base_", M, 155, 160), Span("gloo:all_gather", W, 165, 300),
             Span("c10d::allreduce_", M, 165, 170), Span("gloo:all_reduce", W, 171, 250),
             Span("aten::add", M, 250, 290),
             # the step: a ZeRO reduce-scatter (gloo runs it as an all-reduce), then a scalar all-reduce
             Span(OPT, M, 400, 420), Span("c10d::allreduce_", M, 401, 402), Span("gloo:all_reduce", W, 402, 410),
             Span(GRAD_REDUCE, M, 430, 500), Span("c10d::_reduce_scatter_base_", M, 431, 432),
             Span("gloo:all_reduce", W, 433, 480)]
    got = analyse(spans, tp=2)
    assert got["unmatched"] == 0 and got["steps"] == 1
    k = got["kinds"]
    assert k["TP/SP all_gather"]["n"] == 2
    assert k["TP/SP all_gather"]["total_s"] == pytest.approx((90 + 140) * 1e-6)
    assert k["TP/SP all_gather"]["exposed_s"] == pytest.approx((30 + 20) * 1e-6)
    assert k["TP all-reduce (loss, replicated grads)"]["exposed_s"] == pytest.approx((40 + 80) * 1e-6)
    assert k["step scalars (norm, loss, sync)"]["exposed_s"] == pytest.approx(8e-6)
    assert k["ZeRO 1 reduce-scatter"]["exposed_s"] == pytest.approx(48e-6)
    assert got["compute_s"] == pytest.approx((60 + 40) * 1e-6)
