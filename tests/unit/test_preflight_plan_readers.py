"""What reads a run's plan preflight (RUN_DIR/preflight-plan.json, written by the job's gate):
`launch diagnose` names the groups it measured slower than the plan assumed, and `launch calibrate`
prices the run's collectives at what its own nodes measured. Measurements are constructed here from
the plan's own groups (the worker that writes them is tested in test_preflight_plan.py)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from launcher.diagnose import diagnose
from launcher.formats import rundir
from launcher.plan.calibrate import base_params, predict, read_run
from launcher.plan.commgroups import probe_spec, with_measured_step
from launcher.plan.model import Plan
from launcher.plan.planner import plan_job
from launcher.plan.spec import spec_from_dict
from tests.plan_helpers import chosen

pytestmark = pytest.mark.unit


def run_dir(tmp: Path, slow_factor: float) -> tuple[Path, Plan]:
    """A 2-node H100 run of llama3-8b (tp8 on each node, DP across them) whose preflight measured every
    group as assumed but DP group 3, `slow_factor` times slower; 5 timed steps."""
    spec = {"name": "rd", "model": "llama3-8b", "train": {"seq_len": 4096, "global_batch": 64},
            "cluster": {"nodes": 2, "gpus_per_node": 8, "gpu": "h100-sxm"},
            "parallel": {"tp": 8, "cp": 1, "pp": 1, "zero": 1, "recompute": "full"}}
    plan = chosen(plan_job(spec_from_dict(spec)))
    d = tmp / "run"
    d.mkdir()
    plan.save(d / rundir.PLAN)
    probe = probe_spec(plan, hosts=["gpu-a", "gpu-b"])
    groups = [replace(g, measured_s=g.assumed_s * (slow_factor if g.kind == "dp" and g.index == 3 else 1.0),
                      hosts=[["gpu-a", "gpu-b"][n] for n in g.nodes]) for g in probe.groups]
    with_measured_step(plan, replace(probe, groups=groups, backend="nccl")).save(d / rundir.PREFLIGHT_PLAN)
    t = plan.estimate["step_time_s"]
    (d / rundir.METRICS).write_text("".join(json.dumps({"step": i + 1, "step_time_s": t}) + "\n" for i in range(5)))
    return d, plan


def test_diagnose_names_the_group_the_preflight_found_slow(tmp_path):
    d, _ = run_dir(tmp_path, slow_factor=4.0)
    rep = diagnose(d)
    found = [f for f in rep.findings if f.kind == "plan_preflight"]
    assert len(found) == 1 and found[0].severity == "warning" and rep.problem
    assert found[0].ranks == [3, 11] and found[0].hosts == ["gpu-a", "gpu-b"]
    assert "DP/ZeRO shard group 3, ranks 3,11 on gpu-a,gpu-b (inter-node (2 nodes))" in found[0].message
    assert "0.25x the bandwidth the plan assumed" in found[0].message
    assert "preflight-plan.json" in rep.files
    # the documented call on logs/ reads the run dir's measurements too
    (d / "logs").mkdir()
    (d / "logs" / "node0.log").write_text("[rank0]: step 1/5 | loss 5.5\n")
    assert any(f.kind == "plan_preflight" for f in diagnose(d / "logs").findings)


def test_diagnose_says_when_every_group_was_as_assumed(tmp_path):
    d, _ = run_dir(tmp_path, slow_factor=1.0)
    rep = diagnose(d)
    found = [f for f in rep.findings if f.kind == "plan_preflight"]
    assert [f.severity for f in found] == ["info"] and "within 30% of what the plan assumed" in found[0].message


def test_calibrate_prices_the_runs_collectives_at_what_its_nodes_measured(tmp_path):
    d, plan = run_dir(tmp_path, slow_factor=4.0)
    run = read_run(d)
    assert run.busbw is not None and set(run.busbw) == {"tp", "dp"}
    base = base_params(plan)
    assert run.busbw["dp"] == pytest.approx(base["net_per_gpu_gbs"] / 4, rel=0.05)
    # the measured DP group is slower than assumed: the run's predicted step grows
    assert predict(plan, base, run.busbw) > predict(plan, base)
    # and the fitted network figure no longer moves a collective the run measured
    assert predict(plan, {**base, "net_per_gpu_gbs": base["net_per_gpu_gbs"] * 10}, run.busbw) == \
        pytest.approx(predict(plan, base, run.busbw))
    (d / rundir.PREFLIGHT_PLAN).write_text("{}")
    with pytest.raises(Exception, match="not a plan preflight file"):
        read_run(d)
