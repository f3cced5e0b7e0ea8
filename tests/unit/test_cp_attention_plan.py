"""All-to-all context parallelism (`parallel.cp_attention`) as the job file, the planner, the ledger and the
time model see it: the head rules refused in one line, the planner pricing both kinds and choosing the one
published measurements favour, the all-to-all priced at the measured all-to-all bandwidth, the ledger's
activations for it, and plan.json keeping it (an older plan without the field reads as all-gather).

The evidence the choice tests follow:
- DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv 2309.14509, §3.2 and Fig. 5): per layer 4 all-to-alls of
  N·h/P each per GPU, so its traffic per GPU falls as the CP degree grows, where ring/all-gather CP moves the whole
  sequence's keys and values to every rank; its degree is bounded by the head count.
- USP (Fang & Zhao 2024, arXiv 2405.07719, §4 and its best practices): Ulysses runs best inside a node, where
  all-to-all rides NVLink, ring attention across nodes, where all-to-all is slow; GQA (fewer kv heads) shrinks
  ring's traffic but not Ulysses's q and output, and Ulysses cannot split fewer heads than its degree.
The bundled trainer's all-gather CP stands for ring attention here (the same per-layer key/value volume).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from launcher.errors import SpecError
from launcher.plan.costs import BUNDLED, advertised_bandwidth, estimate
from launcher.plan.ledger import Numerics, trainer_layer_activation_bytes, ulysses_kv_width
from launcher.plan.model import Plan
from launcher.plan.planner import plan_job
from launcher.plan.spec import TrainSpec, resolve_gpu, resolve_model, spec_from_dict
from tests.plan_helpers import chosen
from tests.trainer_helpers import make_plan

pytestmark = pytest.mark.unit


def job(model: str = "tiny", nodes: int = 1, seq: int = 256, gb: int = 8, **parallel) -> dict:
    return {"model": model, "train": {"seq_len": seq, "global_batch": gb},
            "cluster": {"nodes": nodes, "gpus_per_node": 8, "gpu": "h100-sxm"}, "parallel": parallel}


def best(**kw):
    result = plan_job(spec_from_dict(job(**kw)), top=0)
    assert result.best is not None and result.best.fits
    return result


# --- the job file --------------------------------------------------------------------------------

def test_job_file_refuses_the_head_rule_and_unknown_values():
    with pytest.raises(SpecError, match=r"parallel.cp_attention: all-to-all with cp=8: all-to-all needs the 4 query "
                                        r"heads divisible by cp=8; use cp_attention: all-gather"):
        spec_from_dict(job(tp=1, cp=8, cp_attention="all-to-all"))
    with pytest.raises(SpecError, match=r"parallel.cp_attention: 'ring'"):
        spec_from_dict(job(cp_attention="ring"))
    assert spec_from_dict(job(tp=1, cp=4, cp_attention="all-to-all")).parallel.cp_attention == "all-to-all"
    assert spec_from_dict(job()).parallel.cp_attention is None          # searched


# --- the planner's search ------------------------------------------------------------------------------

def test_fixed_all_to_all_searches_only_the_cp_degrees_the_heads_split_over():
    """tiny has 4 heads and 2 kv heads: cp 8 is refused for all-to-all; cp 4 repeats the kv heads."""
    r = best(seq=4096, cp_attention="all-to-all", tp=1, pp=1, zero=1, recompute="none", micro_batch=1)
    assert r.rejected["all-to-all CP: heads or kv heads per TP rank do not split over cp"] >= 1
    cps = {p.layout.cp: p.layout.cp_attention for p in [r.best, *plan_job(spec_from_dict(job(
        seq=4096, cp_attention="all-to-all", tp=1, pp=1, zero=1, recompute="none", micro_batch=1)), top=8).alternatives]}
    assert 8 not in cps and all(a == ("all-to-all" if cp > 1 else "all-gather") for cp, a in cps.items())


def test_plans_without_cp_say_all_gather():
    assert best().best.layout.cp == 1 and best().best.cp_attention == "all-gather"


def _both(**kw) -> dict[str, Any]:
    """The planner's choice with everything but cp_attention fixed, and both kinds' CP seconds."""
    spec = spec_from_dict(job(**kw))
    r = plan_job(spec, top=0)
    lay, bw = chosen(r).layout, r.bandwidth
    cp_s = {a: estimate(spec.model, spec.train, spec.gpu, dataclasses.replace(lay, cp_attention=a), bw, 8).cp_comm_s
            for a in ("all-gather", "all-to-all")}
    # both kinds fit and were priced; the slower was dropped as dominated (their compute is the same)
    assert r.rejected["slower than the same layout with the other cp_attention"] >= 1
    return {"chosen": chosen(r).cp_attention, **cp_s}


FIXED = dict(pp=1, zero=3, recompute="full", micro_batch=1)


def test_ulysses_wins_with_many_heads_a_long_sequence_and_nvlink():
    """Llama 2 7B (32 heads, no GQA) at 128k tokens, cp 8 inside one node: all-to-all moves a quarter of
    all-gather's bytes at half its bus bandwidth (Jacobs et al. §3.2; USP: Ulysses inside the node)."""
    r = _both(model="llama2-7b", seq=131072, tp=1, cp=8, **FIXED)
    assert r["chosen"] == "all-to-all"
    assert r["all-to-all"] == pytest.approx(r["all-gather"] / 2, rel=0.05)


def test_all_gather_wins_across_nodes():
    """The same model with tp 8 inside each node and cp 2 across two: per rank all-to-all moves as much as
    the all-gather, through the NIC at the all-to-all's lower bus bandwidth (USP: ring across nodes)."""
    r = _both(model="llama2-7b", nodes=2, seq=131072, gb=8, tp=8, cp=2, **FIXED)
    assert r["chosen"] == "all-gather" and r["all-to-all"] > 1.5 * r["all-gather"]


def test_all_gather_wins_when_kv_heads_are_few():
    """Llama 3 8B (32 heads, 8 kv heads: GQA) on one node, tp 2 × cp 4: the all-gather moves 4 kv heads'
    keys and values per rank, all-to-all 16 query heads as well (USP: GQA favours ring)."""
    r = _both(model="llama3-8b", seq=131072, tp=2, cp=4, **FIXED)
    assert r["chosen"] == "all-gather" and r["all-to-all"] > 2 * r["all-gather"]


# --- the time model: the measured all-to-all bandwidth ---------------------------------------------------

def _cp_seconds(bw, tp: int, cp: int, att: str) -> float:
    """CP seconds per step of Llama 2 7B at 128k, tp × cp ranks, 8 a node (cp crosses nodes when tp·cp > 8)."""
    model, gpu = resolve_model("llama2-7b"), resolve_gpu("h100-sxm")
    lay = make_plan(tp=tp, cp=cp, dp=1, zero=3, recompute="none", cp_attention=att, seq_len=131072).layout
    return estimate(model, TrainSpec(seq_len=131072, global_batch=8), gpu, lay, bw, 8).cp_comm_s


def test_all_to_all_cp_is_priced_at_the_measured_all_to_all_bandwidth():
    """Inside a node the intra figure, across nodes the inter one (preflight's all_to_all_perf, the same fields
    EP's cost reads); without them half the all-reduce figure. The all-gather's price ignores them. The time is
    latency + bytes / bandwidth: each doubling of the bandwidth halves what the one before took off."""
    adv = advertised_bandwidth(resolve_gpu("h100-sxm"))

    def inside(gbs):
        return _cp_seconds(dataclasses.replace(adv, alltoall_intra_gbs=gbs), 1, 8, "all-to-all")

    def across(gbs):                             # cp 2 over two nodes, tp 8 inside each
        return _cp_seconds(dataclasses.replace(adv, alltoall_intra_gbs=1e6, alltoall_inter_gbs=gbs), 8, 2,
                           "all-to-all")

    guess = adv.intra_gbs / 2
    assert inside(guess) == _cp_seconds(adv, 1, 8, "all-to-all")
    assert inside(guess) - inside(2 * guess) == pytest.approx(2 * (inside(2 * guess) - inside(4 * guess)))
    assert inside(guess) > inside(2 * guess)
    assert across(adv.net_per_gpu_gbs / 2) == _cp_seconds(adv, 8, 2, "all-to-all")
    assert across(10) - across(20) == pytest.approx(2 * (across(20) - across(40))) and across(10) > across(20)
    fast = dataclasses.replace(adv, alltoall_intra_gbs=1e6, alltoall_inter_gbs=1e6)
    assert _cp_seconds(fast, 1, 8, "all-gather") == _cp_seconds(adv, 1, 8, "all-gather")


def test_all_to_all_counts_four_exchanges_per_layer_and_pass():
    """Per layer q, k, v and the output, forward and backward; again in full recompute's forward."""
    adv = advertised_bandwidth(resolve_gpu("h100-sxm"))
    model, gpu, t = resolve_model("llama2-7b"), resolve_gpu("h100-sxm"), TrainSpec(seq_len=131072, global_batch=8)
    lays = {rc: make_plan(cp=8, zero=3, recompute=rc, cp_attention="all-to-all", seq_len=131072).layout
            for rc in ("none", "full")}
    none, full = (estimate(model, t, gpu, lays[rc], adv, 8) for rc in ("none", "full"))
    assert full.cp_comm_s == pytest.approx(none.cp_comm_s * 3 / 2)
    # one call: this rank's [s/cp, heads, d] of bf16, 7/8 of it sent, at half the all-reduce figure, one latency
    one = 131072 / 8 * model.q_width * 2 * 7 / 8 / (adv.intra_gbs / 2 * 1e9) + BUNDLED.alpha_s
    per_layer = none.cp_comm_s / lays["none"].grad_accum / model.layers
    assert per_layer == pytest.approx(8 * one)                                    # MHA: k, v as wide as q


# --- the ledger -------------------------------------------------------------------------------------------

def test_all_to_all_keeps_no_gathered_keys_and_values():
    """Without recompute, all-gather CP keeps the whole sequence's keys and values per layer; all-to-all keeps
    its exchanged k and v, [kv heads/cp, s] (as many bytes as the rank's own), repeated up to cp where fewer."""
    m, num, s, b = resolve_model("llama3-8b"), Numerics("bf16"), 8192, 1
    assert m.head_dim is not None
    for tp, cp in ((1, 2), (2, 4), (8, 2)):       # 8, 4 and 1 kv heads per TP rank
        ag = trainer_layer_activation_bytes(m, s, b, "none", num, tp=tp, cp=cp)
        a2a = trainer_layer_activation_bytes(m, s, b, "none", num, tp=tp, cp=cp, cp_attention="all-to-all")
        kv_tp = m.kv_width / tp
        tokens = s / cp * b
        assert ag - a2a == pytest.approx(2 * kv_tp * 2 * s * b - 2 * (ulysses_kv_width(m, tp, cp) - kv_tp) * 2 * tokens)
    assert ulysses_kv_width(m, 8, 2) == 2 * m.head_dim        # one kv head per TP rank, repeated to cp 2


# --- plan.json ----------------------------------------------------------------------------------------

def test_plan_json_keeps_the_choice_and_older_plans_read_as_all_gather():
    plan = make_plan(cp=2, dp=2, cp_attention="all-to-all")
    back = Plan.from_dict(plan.to_dict())
    assert back.cp_attention == "all-to-all"
    old = plan.to_dict()
    del old["layout"]["cp_attention"]
    assert Plan.from_dict(old).cp_attention == "all-gather"
    bad = plan.to_dict()
    bad["layout"]["cp_attention"] = "ring"
    with pytest.raises(SpecError, match=r"plan.layout.cp_attention"):
        Plan.from_dict(bad)


def test_the_plan_preflight_measures_the_cp_groups_all_to_all():
    """`launch preflight --plan` probes each group with the time model's collective: for all-to-all CP an
    all_to_all of one q over each cp group, and what it measures replaces the CP bandwidth in the step time."""
    from launcher.plan.commgroups import plan_bandwidth, plan_collectives

    plan = chosen(plan_job(spec_from_dict(job(model="llama2-7b", nodes=2, seq=131072, gb=16,
                                              cp_attention="all-to-all")), top=0))
    assert plan.cp == 8 and plan.cp_attention == "all-to-all"
    cp = plan_collectives(plan)["cp"]
    assert (cp.op, cp.size) == ("all_to_all", 8)
    assert cp.nbytes == 131072 / 8 * plan.model.q_width * 2
    bw = plan_bandwidth(plan)
    t = [estimate(plan.model, plan.train, plan.gpu, plan.layout, bw, 8, busbw={"cp": x}).cp_comm_s
         for x in (cp.busbw_gbs, cp.busbw_gbs / 2)]
    assert t[0] == pytest.approx(plan.estimate["cp_comm_s"], rel=1e-4) and t[1] > 1.9 * t[0]
