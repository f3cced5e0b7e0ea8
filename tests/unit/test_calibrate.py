"""`launch calibrate`: the fit recovers the efficiency parameters that generated a set of runs' step
times, fits only those the runs identify, writes a cluster profile the planner then predicts with,
and refuses bad input (one line, exit 2, nothing written). The runs' plan.json come from the real
planner; their metrics.jsonl carry step times made from known parameters (the ground truth the fit
must find), with a slow first step the warm-up must leave out. The real measured path (Slurm job
array -> calibrate -> plan) is tests/e2e/test_slurm_e2e.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from launcher.plan.calibrate import base_params, predict
from launcher.plan.planner import plan_job
from launcher.plan.spec import spec_from_dict
from tests.cli_helpers import invoke
from tests.plan_helpers import chosen

pytestmark = pytest.mark.unit


def job(nodes: int, gpu: str = "h100-sxm", **par) -> dict:
    return {"name": "cal", "model": "llama3-8b", "train": {"seq_len": 4096, "global_batch": 64},
            "cluster": {"nodes": nodes, "gpus_per_node": 8, "gpu": gpu},
            "parallel": {"cp": 1, "pp": 1, "recompute": "full", **par}}


def run_dir(tmp: Path, name: str, spec: dict, truth: dict[str, float] | None, steps: int = 5) -> Path:
    """A run dir: the real plan, and steps timed as the model predicts with `truth` (±1%)."""
    plan = chosen(plan_job(spec_from_dict(spec)))
    d = tmp / name
    d.mkdir()
    plan.save(d / "plan.json")
    if truth is not None:
        t = predict(plan, {**base_params(plan), **truth})
        times = [5 * t] + [t * (1 + 0.01 * ((-1) ** i)) for i in range(steps - 1)]   # step 1: warm-up
        (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "step_time_s": s, "peak_mem_gb": 40.0})
                                                 + "\n" for i, s in enumerate(times)))
    return d


def test_compute_bound_runs_fit_the_efficiency_ceiling_only_and_plans_use_it(tmp_path):
    truth = {"compute_efficiency": 0.3}
    dirs = [run_dir(tmp_path, f"r{i}", job(1, tp=tp, zero=z, micro_batch=1), truth)
            for i, (tp, z) in enumerate([(1, 3), (1, 2), (1, 1)])]
    out = tmp_path / "profile.json"
    res = invoke("calibrate", *dirs, "-o", out, "--json")
    assert res.exit_code == 0, res.output
    prof = json.loads(res.output)
    assert list(prof["params"]) == ["compute_efficiency"]
    assert prof["params"]["compute_efficiency"] == pytest.approx(0.3, rel=0.02)
    assert set(prof["not_fitted"]) == {"latency_s", "net_per_gpu_gbs", "intra_gbs"}
    for r in prof["runs"]:
        assert abs(r["error_after"]) < 0.02 < abs(r["error_before"]) and r["steps"] == 5
    assert json.loads(out.read_text())["params"] == prof["params"]

    # a later plan of the first run's layout, with the profile, predicts its measured step
    spec = job(1, tp=1, zero=3, micro_batch=1)
    spec["cluster"]["profile"] = str(out)
    jf = tmp_path / "job.yaml"
    jf.write_text(yaml.safe_dump(spec))
    human = invoke("plan", jf)
    assert human.exit_code == 0 and f"calibrated cluster profile {out}" in human.output, human.output
    planned = json.loads(invoke("plan", jf, "--json").output)
    assert planned["calibration"]["params"] == prof["params"]
    assert planned["best"]["estimate"]["step_time_s"] == pytest.approx(prof["runs"][0]["measured_step_s"], rel=0.02)


def test_runs_that_stress_the_network_identify_its_bandwidth(tmp_path):
    truth = {"compute_efficiency": 0.35, "net_per_gpu_gbs": 20.0}
    # A100 nodes (8 NICs of 25 GB/s carry less than NVLink) and ZeRO 1, whose reduce and gather after the
    # last backward nothing hides: the network bounds DP across nodes
    dirs = [run_dir(tmp_path, "one-node", job(1, "a100-80gb", tp=1, zero=3, micro_batch=1), truth),
            run_dir(tmp_path, "eight-nodes", job(8, "a100-80gb", tp=1, zero=1, micro_batch=1), truth)]
    res = invoke("calibrate", *dirs, "-o", tmp_path / "p.json", "--json")
    assert res.exit_code == 0, res.output
    params = json.loads(res.output)["params"]
    assert set(params) == {"compute_efficiency", "net_per_gpu_gbs"}
    assert params["compute_efficiency"] == pytest.approx(0.35, rel=0.05)
    assert params["net_per_gpu_gbs"] == pytest.approx(20.0, rel=0.05)


def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path):
    good = run_dir(tmp_path, "good", job(1, tp=1, zero=3, micro_batch=1), {"compute_efficiency": 0.3})
    no_metrics = run_dir(tmp_path, "no-metrics", job(1, tp=2, zero=1, micro_batch=1), None)
    short = run_dir(tmp_path, "short", job(1, tp=2, zero=1, micro_batch=1), {"compute_efficiency": 0.3}, steps=1)
    a100 = run_dir(tmp_path, "a100", job(1, gpu="a100-80gb", tp=2, zero=1, micro_batch=1), {"compute_efficiency": 0.3})
    out = tmp_path / "profile.json"
    for args, why in [((no_metrics,), "no metrics.jsonl"), ((short,), "more than the 1 warm-up"),
                      ((good, a100), "calibrate runs of one cluster and GPU type together"),
                      ((tmp_path / "absent",), "no plan.json")]:
        res = invoke("calibrate", *args, "-o", out)
        assert res.exit_code == 2 and why in res.output, res.output
        assert len(res.output.strip().splitlines()) == 1
        assert not out.exists()

    # a profile from one GPU type is refused for another
    assert invoke("calibrate", good, "-o", out).exit_code == 0
    spec = job(1, gpu="a100-80gb", tp=1, zero=3, micro_batch=1)
    spec["cluster"]["profile"] = str(out)
    jf = tmp_path / "job.yaml"
    jf.write_text(yaml.safe_dump(spec))
    res = invoke("plan", jf)
    assert res.exit_code == 2 and "was fitted on GPU 'h100-sxm'" in res.output, res.output


def test_docs_describe_every_profile_field():
    import dataclasses

    from launcher.plan.profile import PARAMS, ClusterProfile
    from tests.conftest import REPO

    text = (REPO / "docs" / "formats.md").read_text()
    names = [f.name for f in dataclasses.fields(ClusterProfile) if f.name != "path"] + list(PARAMS)
    assert [n for n in names if f"`{n}`" not in text] == []


def test_benchmark_table_names_the_calibrate_command_for_its_measured_runs():
    from launcher.commands.bench import Measured, render

    text = render([Measured(0, "tp1", "/r/0-tp1", 0.4, 0.1, 100.0, 0.3, 0, 4),
                   Measured(1, "tp2", "/r/1-tp2", 0.5, None, None, None, 1, 0)])
    assert text.splitlines()[-1] == "fit this cluster's efficiency to these runs: launch calibrate /r/0-tp1"
