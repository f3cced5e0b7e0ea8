"""The plan's communication groups as `launch preflight --plan` probes them (launcher/plan/commgroups.py),
the time model's per-kind collectives they are priced with (costs.collectives), and the
preflight-plan.json format (launcher/formats/groupprobe.py): no processes, no torch."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from launcher.errors import UserError
from launcher.formats.groupprobe import GroupProbe, bus_factor
from launcher.plan import layout
from launcher.plan.commgroups import kind_groups, measured_busbw, plan_collectives, probe_spec, step_time
from launcher.plan.planner import plan_job
from launcher.plan.spec import spec_from_dict

pytestmark = pytest.mark.unit

MOE = dict(layers=4, hidden=128, heads=4, kv_heads=2, ffn_hidden=96, vocab=512, experts=4, experts_per_token=2)


def planned(nodes=2, gpn=8, model="tiny", **par):
    d = {"name": "cg", "model": model, "train": {"seq_len": 64, "global_batch": 16, "precision": "fp32"},
         "cluster": {"nodes": nodes, "gpus_per_node": gpn, "gpu": "cpu"},
         "parallel": {"recompute": "none", "micro_batch": 1, **par}}
    return plan_job(spec_from_dict(d)).best


def test_every_group_of_a_4d_plan_comes_from_its_rank_grid():
    """tp2 cp2 pp2 dp2 on 2 nodes of 8: TP groups are consecutive ranks on one node, CP stride 2, PP
    pairs are the stage neighbours across the nodes, the DP/ZeRO group is dp·cp flattened."""
    plan = planned(tp=2, cp=2, pp=2, zero=1)
    assert (plan.tp, plan.cp, plan.pp, plan.dp) == (2, 2, 2, 2)
    spec = probe_spec(plan)
    by = {k: [g.ranks for g in spec.of(k)] for k in spec.kinds()}
    assert spec.kinds() == ["tp", "cp", "pp", "dp"]
    assert by["tp"][0] == [0, 1] and len(by["tp"]) == 8
    assert by["cp"][0] == [0, 2]
    assert by["pp"][0] == [0, 8] and len(by["pp"]) == 8
    assert by["dp"][0] == [0, 2, 4, 6] and len(by["dp"]) == 4
    # every rank is in exactly one group of each kind and phase: the groups of a phase can run at once
    for kind in spec.kinds():
        for ph in {g.phase for g in spec.of(kind)}:
            ranks = [r for g in spec.of(kind) if g.phase == ph for r in g.ranks]
            assert sorted(ranks) == sorted(set(ranks))
    links = {g.kind: g.link for g in spec.groups}
    assert links["tp"] == "intra-node" and links["pp"] == "inter-node (2 nodes)"
    ops = {g.kind: g.op for g in spec.groups}
    assert ops == {"tp": "all_gather", "cp": "all_gather", "pp": "send_recv", "dp": "reduce_scatter"}


def test_pp_neighbour_pairs_run_in_two_phases_when_stages_share_ranks():
    plan = planned(nodes=1, gpn=4, pp=4, tp=1, zero=0)
    pairs = kind_groups(plan, "pp")
    assert pairs == [([0, 1], 0), ([1, 2], 1), ([2, 3], 0)]


def test_ep_groups_are_the_trainers():
    """The EP groups preflight probes are the ones the trainer builds (launcher/trainer/mesh.ep_layout)."""
    pytest.importorskip("torch")
    from launcher.trainer.mesh import ep_layout

    for deg, order, ep in (({"tp": 2, "cp": 2, "pp": 1, "dp": 4}, ["pp", "dp", "cp", "tp"], 4),
                           ({"tp": 1, "cp": 1, "pp": 2, "dp": 4}, ["pp", "dp", "cp", "tp"], 2),
                           ({"tp": 2, "cp": 2, "pp": 2, "dp": 2}, ["pp", "cp", "dp", "tp"], 2)):
        assert layout.ep_groups(deg, order, ep) == ep_layout(deg, order, ep)[0]


def test_moe_plan_probes_its_ep_all_to_all():
    plan = planned(nodes=1, gpn=8, model=MOE, tp=1, ep=4, zero=1)
    spec = probe_spec(plan)
    ep = spec.of("ep")
    assert ep and all(g.op == "all_to_all" and g.size == 4 for g in ep)


def test_the_probe_prices_each_group_as_the_time_model_does():
    """Each group's assumed time is the model's time for its collective (costs.collectives): the figures
    estimate() charges, so a measured group is compared with what the plan was chosen on."""
    plan = planned(tp=2, cp=2, pp=2, zero=3)
    comm = plan_collectives(plan)
    for g in probe_spec(plan).groups:
        c = comm[g.kind]
        assert g.assumed_busbw_gbs == c.busbw_gbs
        assert g.nbytes >= c.nbytes and g.nbytes % (4 * g.size) == 0
        assert g.assumed_s == pytest.approx(replace(c, nbytes=g.nbytes).seconds())
    # TP and the dp·cp group inside a node at the intra-node figure; PP's pairs across nodes at one NIC's
    assert comm["tp"].busbw_gbs == comm["dp"].busbw_gbs == plan.bandwidth["intra_gbs"]
    assert comm["pp"].busbw_gbs == plan.bandwidth["net_per_gpu_gbs"]


def test_measured_figures_move_the_step_time_and_busbw_for_inverts_seconds():
    plan = planned(tp=2, cp=1, pp=2, zero=1)
    comm = plan_collectives(plan)
    for c in comm.values():
        t = c.seconds()
        assert c.busbw_for(t) == pytest.approx(c.busbw_gbs, rel=1e-9)
    spec = probe_spec(plan)
    assert step_time(plan) == pytest.approx(spec.predicted_step_s)
    # every group measured exactly as assumed: the recomputed step is the plan's
    same = replace(spec, groups=[replace(g, measured_s=g.assumed_s) for g in spec.groups])
    assert step_time(plan, measured_busbw(plan, same)) == pytest.approx(step_time(plan), rel=1e-6)
    # one PP pair ten times slower: the step slows, and by the PP transfer term only
    slow = [replace(g, measured_s=g.assumed_s * (10 if g.kind == "pp" and g.index == 1 else 1)) for g in spec.groups]
    bw = measured_busbw(plan, replace(spec, groups=slow))
    assert bw["pp"] == pytest.approx(comm["pp"].busbw_gbs / 10)
    assert step_time(plan, bw) > step_time(plan)


def test_a_slow_group_is_named_and_its_host_blamed():
    plan = planned(tp=2, cp=1, pp=1, zero=3, dp_shard=8)     # one ZeRO group over both nodes
    assert plan.dp == 8
    spec = probe_spec(plan, hosts=["n1", "n2"])
    groups = [replace(g, measured_s=g.assumed_s * (5 if g.kind == "tp" and g.index == 5 else 0.9))
              for g in spec.groups]
    probe = replace(spec, groups=groups)
    slow = probe.slow_groups()
    assert [(g.kind, g.index) for g in slow] == [("tp", 5)]
    assert slow[0].ratio == pytest.approx(0.2)
    assert slow[0].where(probe.hosts) == "ranks 10,11 on n2 (intra-node)"
    assert list(probe.suspect_hosts()) == ["n2"]
    assert probe.slow_groups(tolerance=0.9) == []
    # a slow group across both nodes blames both: nothing tells them apart
    both = [replace(g, measured_s=g.assumed_s * (5 if g.kind == "dp" and g.index == 0 else 1)) for g in spec.groups]
    assert sorted(replace(spec, groups=both).suspect_hosts()) == ["n1", "n2"]


def test_the_file_round_trips_and_bad_files_are_one_line(tmp_path):
    plan = planned(tp=2, zero=3)
    spec = probe_spec(plan)
    spec = replace(spec, groups=[replace(g, measured_s=2 * g.assumed_s, hosts=["a"] * g.size) for g in spec.groups])
    p = tmp_path / "preflight-plan.json"
    spec.save(p)
    back = GroupProbe.load(p)
    assert back.groups == spec.groups and back.measured
    d = json.loads(p.read_text())
    assert d["groups"][0]["ratio"] == pytest.approx(0.5)
    g0 = spec.groups[0]
    assert g0.measured_s is not None
    assert d["groups"][0]["measured_busbw_gbs"] == pytest.approx(
        g0.nbytes / g0.measured_s * bus_factor(g0.op, g0.size) / 1e9, rel=1e-5)
    for bad, word in (({**d, "kind": "x"}, "not a plan preflight file"), ({**d, "version": 9}, "version 9"),
                      ({**d, "groups": [{**d["groups"][0], "ranks": [0, 99]}]}, r"groups\[0\]\.ranks"),
                      ({**d, "groups": [{**d["groups"][0], "op": "gossip"}]}, r"groups\[0\]\.op")):
        p.write_text(json.dumps(bad))
        with pytest.raises(UserError, match=word):
            GroupProbe.load(p)
