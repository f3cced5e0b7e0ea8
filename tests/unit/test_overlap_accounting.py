"""The accounting behind benchmarks/overlap_gloo.py's exposed-communication figures, on hand-made spans: what
tests/integration/test_overlap_gloo.py measures on the trainer is only as right as this arithmetic."""

from __future__ import annotations

import pytest

from benchmarks.overlap_gloo import GRAD_REDUCE, OPT, STEP, Span, analyse

pytestmark = pytest.mark.unit


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
