"""The time model's cross-validation by source (benchmarks/calibrate_costs.py --cv), its overlap terms and
compute by GEMM shape, and the uncertainty `launch plan` reports from the cross-validated error."""

from __future__ import annotations

import json

import pytest

import benchmarks.calibrate_costs as cc
from launcher.plan import costs
from launcher.plan.costs import STACKS, advertised_bandwidth, compute_efficiency, estimate
from launcher.plan.explain import CV_ERROR, uncertainty
from launcher.plan.ledger import Layout
from launcher.plan.spec import TrainSpec, resolve_gpu, resolve_model
from tests.cli_helpers import invoke

pytestmark = pytest.mark.unit


def small_rows() -> list[cc.Case]:
    keep = {"K22", "dgxc llama3.1-8b", "FMS", "TT perf-A100"}
    return [c for c in cc.CASES if c.source in keep]


def test_a_left_out_source_is_not_in_its_fit_and_does_not_move_its_prediction(monkeypatch):
    monkeypatch.setattr(cc, "PASSES", [0.0, 40.0])          # a coarse grid: the machinery, not the figures
    rows = small_rows()
    seen: list[set[str]] = []
    real = cc.fit_family

    def recording(family, train):
        seen.append({c.source for c in train})
        return real(family, train)

    monkeypatch.setattr(cc, "fit_family", recording)
    held = cc.cross_validate(rows)
    sources = {c.source for c in rows}
    assert {h.case.source for h in held} == sources and len(held) == len(rows)
    assert seen and all(len(sources - s) == 1 for s in seen)        # every fit misses exactly one source
    # a source's own figures do not reach its prediction: triple them, its held-out steps stay put
    k22 = [c for c in rows if c.source == "K22"]
    changed = [c if c.source != "K22" else cc.replace(c, published=c.published * 3) for c in rows]
    again = {h.case.label: h.predicted_step for h in cc.cross_validate(changed) if h.case.source == "K22"}
    before = {h.case.label: h.predicted_step for h in held if h.case.source == "K22"}
    assert again == pytest.approx(before) and len(before) == len(k22)
    # ... while the other sources' predictions, fitted on them, do move
    other = {h.case.label: h.predicted_step for h in cc.cross_validate(changed) if h.case.source != "K22"
             and h.case.family == "megatron"}
    assert any(other[k] != pytest.approx(h.predicted_step) for h in held for k in [h.case.label] if k in other)


def test_sweep_scores_spearman_top1_and_regret():
    assert cc.spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert cc.spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    group = [c for c in cc.CASES if c.source == "K22" and c.model_name == "gpt-22b"]
    # predicted steps reversed against the published ones: rank correlation -1, a miss, positive regret
    held = [cc.Held(c, 0.0, cc.published_step(o), False) for c, o in zip(group, reversed(group))]
    (score,) = cc.sweep_scores(held)
    assert score.spearman == pytest.approx(-1.0) and not score.top1 and score.regret > 0.2


def test_every_published_number_has_a_source_and_a_place():
    assert len(cc.CASES) >= 60 and len(cc.sweeps()) >= 25
    for c in cc.CASES:
        assert c.url.startswith("http") and c.where, c.label
        assert c.model_name in cc.MODELS and c.family in cc.FAMILIES


def lay(**kw) -> Layout:
    base = dict(tp=1, cp=1, pp=1, dp=8, ep=1, zero=3, recompute="full", micro_batch=1, grad_accum=4,
                schedule="none", virtual_stages=1)
    return Layout(**{**base, **kw})


def est(layout: Layout, model="llama3-8b", gpu="h100-sxm", seq=4096):
    g = resolve_gpu(gpu)
    train = TrainSpec(seq_len=seq, global_batch=layout.dp * layout.micro_batch * layout.grad_accum)
    return estimate(resolve_model(model), train, g, layout, advertised_bandwidth(g), 8)


def test_fsdp_prefetch_hides_all_but_the_edge_and_zero1_hides_nothing():
    """FSDP2 prefetches the next block's all-gather and reduce-scatters on its own stream: an FSDP-only
    layout's exposed DP time is one block's collectives per pass (and the slowdown of the compute beside the
    rest), far below the total; the lean ZeRO 1's reduce-scatter and all-gather after the last backward have
    nothing beside them."""
    z3 = est(lay(zero=3))
    assert 0 < z3.dp_exposed_s < 0.3 * z3.dp_comm_s
    z1 = est(lay(zero=1))
    assert z1.dp_comm_s > 0 and z1.dp_exposed_s == pytest.approx(z1.dp_comm_s)


def test_hidden_collectives_slow_the_compute_beside_them_by_the_bytes_they_move(monkeypatch):
    """A hidden collective costs OVERLAP_SLOWDOWN of its seconds at NVLink's rate (arXiv 2507.03114's average),
    less where the NICs bound it (a per-GPU-NIC stack across nodes moves fewer bytes a second); a collective with
    nothing beside it (ZeRO 1's) adds nothing."""
    g = resolve_gpu("h100-sxm")
    bw = advertised_bandwidth(g)

    def dp_terms(layout: Layout, stack: str = "bundled") -> tuple[float, float]:
        train = TrainSpec(seq_len=4096, global_batch=layout.dp * layout.micro_batch * layout.grad_accum)
        e = estimate(resolve_model("llama3-8b"), train, g, layout, bw, 8, stack=STACKS[stack])
        return e.dp_exposed_s, e.dp_comm_s

    def added(layout: Layout, stack: str = "bundled") -> tuple[float, float]:
        """(what the slowdown adds, the seconds hidden without it)"""
        with_it, _ = dp_terms(layout, stack)
        monkeypatch.setattr(costs, "OVERLAP_SLOWDOWN", 0.0)
        without, comm = dp_terms(layout, stack)
        monkeypatch.undo()
        return with_it - without, comm - without

    extra, hidden = added(lay(zero=3))                                # FSDP inside one node: NVLink's rate
    assert hidden > 0 and extra == pytest.approx(costs.OVERLAP_SLOWDOWN * hidden)
    extra, hidden = added(lay(zero=3, dp=64), "deepspeed")           # one NIC per GPU across 8 nodes
    assert hidden > 0 and extra == pytest.approx(costs.OVERLAP_SLOWDOWN * hidden * bw.net_per_gpu_gbs / bw.intra_gbs)
    assert added(lay(zero=1))[0] == 0.0


def test_compute_efficiency_falls_with_thin_gemms_and_scales_with_the_factor():
    """Per GEMM a fixed time on top of its FLOPs at the GPU's matmul rate: thin TP slices of a small model
    and few tokens a rank reach less of the peak than a large model's GEMMs; the factor scales it linearly
    (what `launch calibrate` fits)."""
    small, big = resolve_model("llama3-1b"), resolve_model("llama3-70b")
    h100 = resolve_gpu("h100-sxm")
    thin = compute_efficiency(small, lay(tp=8, dp=1), 1024, 1.0, STACKS["bundled"], h100)
    wide = compute_efficiency(big, lay(tp=1), 8192, 1.0, STACKS["bundled"], h100)
    assert thin < 0.6 * wide
    assert compute_efficiency(big, lay(), 8192, 0.5, gpu=h100) == pytest.approx(
        0.5 * compute_efficiency(big, lay(), 8192, 1.0, gpu=h100))
    # the same code reaches a smaller share of an H100's peak than of an A100's (memory-bound work)
    a100 = resolve_gpu("a100-80gb")
    assert compute_efficiency(big, lay(), 8192, 1.0, gpu=a100) > compute_efficiency(big, lay(), 8192, 1.0, gpu=h100)


def test_uncertainty_marks_the_plans_within_the_cross_validated_error():
    u = uncertainty(10.0, [10.5, 11.0, 13.0, 10.2], cv_error=0.12)
    assert [a["within_error"] for a in u["alternatives"]] == [True, True, False, True]
    assert u["top_within_error"] == 3 and u["recommend"] == "launch plan --benchmark 3"
    assert uncertainty(10.0, [12.0], cv_error=0.12)["recommend"] is None


def test_launch_plan_prints_and_carries_the_uncertainty():
    job = "examples/llama3-8b-8xh100.yaml"
    out = invoke("plan", job)
    assert out.exit_code == 0, out.output
    assert f"cross-validated error is ±{CV_ERROR:.0%}" in out.output and "uncertainty:" in out.output
    data = json.loads(invoke("plan", job, "--json").output)
    u = data["uncertainty"]
    assert u["cv_error"] == CV_ERROR and len(u["alternatives"]) == len(data["alternatives"])
    best = data["best"]["estimate"]["step_time_s"]
    for a, alt in zip(u["alternatives"], data["alternatives"]):
        assert a["predicted_diff"] == pytest.approx(alt["estimate"]["step_time_s"] / best - 1, abs=1e-3)
    if u["top_within_error"] > 1:
        assert f"--benchmark {u['top_within_error']}" in out.output
