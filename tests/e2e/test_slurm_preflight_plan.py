"""The plan preflight on a real Slurm (tests/services/slurm.py: n1 and n2, 2 processes each, gloo on
loopback): `launch preflight --plan --backend slurm` measures the tiny 2-node plan's groups in a batch
job and reports them; `launch submit --preflight-plan` measures them inside the job's allocation before
the trainer, and a slowed group (rank 3's all-gathers delayed in its own process, through a sitecustomize
on the job's PYTHONPATH) leaves its node out, named with the group's ranks, host and link, as the node
check does. The plan's assumed bandwidths are set low (0.5 MB/s): gloo here is far faster, a call
delayed by 0.5 s is not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher.cli import cli
from tests.conftest import REPO
from tests.e2e.test_slurm_e2e import log_text, status, wait_for, write_job
from tests.integration.test_preflight_plan import SLOW_SITE
from tests.services.slurm import slurm_cluster  # noqa: F401  (session fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(autouse=True)
def _state(tmp_path, monkeypatch):
    monkeypatch.setenv("LAUNCH4D_STATE", str(tmp_path / "state"))


def slow_cluster_plan(tmp_path: Path, name: str) -> Path:
    job = write_job(tmp_path, name, steps=2)
    out = tmp_path / f"{name}.plan.json"
    res = CliRunner().invoke(cli, ["plan", str(job), "-o", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    data["bandwidth"].update(intra_gbs=5e-4, net_per_gpu_gbs=5e-4, source="test: a slow cluster")
    out.write_text(json.dumps(data))
    return out


def slow_rank_env(tmp_path: Path, rank: int) -> dict[str, str]:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SLOW_SITE)
    return {"PYTHONPATH": os.pathsep.join([str(site), str(REPO)]), "L4D_SLOW_RANK": str(rank), "L4D_SLOW_S": "0.5"}


def test_preflight_plan_as_a_slurm_job_measures_every_group_on_the_allocated_nodes(slurm_cluster, tmp_path):  # noqa: F811
    plan = slow_cluster_plan(tmp_path, "pp-cmd")
    out_dir = tmp_path / "probe"
    p = subprocess.run([sys.executable, "-c", "from launcher.cli import main; main()", "preflight", "--plan", str(plan),
                        "--backend", "slurm", "--out-dir", str(out_dir), "--iters", "3", "--json"],
                       capture_output=True, text=True, cwd=REPO, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rep = json.loads(p.stdout)
    assert rep["ok"] and rep["backend"] == "gloo"
    hosts = {tuple(g["hosts"]) for g in rep["groups"] if g["kind"] == "tp"}
    assert hosts == {("n1", "n1"), ("n2", "n2")}                      # TP groups inside each node
    assert {g["link"] for g in rep["groups"] if g["kind"] == "dp"} == {"inter-node (2 nodes)"}
    assert json.loads((out_dir / "preflight-plan.json").read_text())["groups"][0]["measured_s"] > 0


def test_the_gate_leaves_a_slow_groups_node_out_as_the_node_check_does(slurm_cluster, tmp_path, monkeypatch):  # noqa: F811
    """Rank 3 (n2) slowed: TP group 1 (ranks 2,3 on n2) fails the gate; n2 is left out with the group named;
    on this 2-node partition the job then fails (too few nodes to requeue on) and the trainer never starts;
    the measurements are in the run dir."""
    plan = slow_cluster_plan(tmp_path, "pp-gate")
    for k, v in slow_rank_env(tmp_path, 3).items():
        monkeypatch.setenv(k, v)                     # sbatch exports the environment to the job
    res = CliRunner().invoke(cli, ["submit", str(plan), "--preflight-plan", "--json"])
    assert res.exit_code == 0, res.output
    sub = json.loads(res.stdout)
    jid, run_dir = sub["id"], sub["run_dir"]
    wait_for(lambda: "not requeueing" in log_text(run_dir, jid), 420, "the plan preflight to leave n2 out",
             run_dir, jid)
    out = log_text(run_dir, jid)
    assert "launch4d: plan preflight: measuring 4 communication group(s) on n1 n2" in out
    line = next(ln for ln in out.splitlines() if "n2 left out:" in ln)
    assert "plan preflight: TP group 1, ranks 2,3 on n2 (intra-node): all_gather" in line
    assert "n1 left out" not in out and "node_rank" not in out           # torchrun never started
    assert "n2 left out: plan preflight" in (Path(run_dir) / "logs" / "nodecheck.log").read_text()
    measured = json.loads((Path(run_dir) / "preflight-plan.json").read_text())
    slow = [g for g in measured["groups"] if g["ratio"] < 0.7]
    assert [(g["kind"], g["ranks"], g["hosts"]) for g in slow] == [("tp", [2, 3], ["n2", "n2"])]
    st = wait_for(lambda: (s := status(jid))["done"] and s, 180, "the job to end", run_dir, jid)
    assert st["state"] == "FAILED", st


def test_the_gate_passes_a_plan_its_nodes_keep_and_the_trainer_runs(slurm_cluster, tmp_path):  # noqa: F811
    plan = slow_cluster_plan(tmp_path, "pp-pass")
    res = CliRunner().invoke(cli, ["submit", str(plan), "--preflight-plan", "--json"])
    assert res.exit_code == 0, res.output
    sub = json.loads(res.stdout)
    jid, run_dir = sub["id"], sub["run_dir"]
    st = wait_for(lambda: (s := status(jid))["done"] and s, 600, "the job to end", run_dir, jid)
    out = log_text(run_dir, jid)
    assert st["state"] == "SUCCEEDED", out[-3000:]
    assert "launch4d: node check passed on n1 n2" in out and "left out" not in out
    measured = json.loads((Path(run_dir) / "preflight-plan.json").read_text())
    assert len(measured["groups"]) == 4 and all(g["ratio"] > 1 for g in measured["groups"])
