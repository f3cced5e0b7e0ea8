"""`launch diagnose` through click's CliRunner and as a real subprocess: exit codes (0 fine, 1 problem,
2 bad input), the --json contract, JOB resolution through the job record, --plan/--bwmap errors."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher.backends import jobstate
from launcher.cli import cli
from tests.cli_helpers import invoke
from tests.conftest import REPO, shared_file
from tests.unit.test_diagnose import F_DESYNC, F_IB, F_IB_PAIR, LOGS, diagnose_plan

pytestmark = pytest.mark.unit


def run(*args: str, env: dict | None = None):
    return CliRunner().invoke(cli, ["diagnose", *args], env=env, catch_exceptions=False)


def test_json_contract_and_exit_1_on_stall():
    log = shared_file(LOGS, F_DESYNC)
    res = run(str(log), "--json")
    assert res.exit_code == 1, res.output
    d = json.loads(res.output)
    assert isinstance(d["verdict"], str) and d["stalled_ranks"] == [1]
    assert all(isinstance(r, int) for r in d["stalled_ranks"])
    for f in d["findings"]:
        assert set(f) >= {"kind", "message", "evidence"}
        assert isinstance(f["kind"], str) and isinstance(f["message"], str)
        assert all(isinstance(e, str) and e.rpartition(":")[2].isdigit() for e in f["evidence"])
    assert d["findings"][0]["kind"] == "stalled_rank"
    assert f"{F_DESYNC}:4" in d["findings"][0]["evidence"]


def test_exit_0_when_nothing_is_wrong_and_human_output():
    log = shared_file(LOGS, F_IB)
    res = run(str(log))
    assert res.exit_code == 0, res.output
    assert res.output.startswith("verdict: no problem found")
    assert "NCCL 2.27.5+cuda12.9" in res.output and "NET/IB/GDRDMA x64" in res.output
    assert f"{F_IB}:" in res.output  # evidence as file:line


def test_human_output_lists_evidence_most_likely_first():
    res = run(str(shared_file(LOGS, F_IB_PAIR)))
    assert res.exit_code == 1
    lines = res.output.splitlines()
    first = next(i for i, ln in enumerate(lines) if " 1. [error]" in ln)
    assert "status=12" in lines[first] and f"{F_IB_PAIR}:6" in lines[first + 1]


def test_bad_inputs_exit_2(tmp_path):
    res = invoke("diagnose", str(tmp_path / "nope" / "x.log"))
    assert res.exit_code == 2 and "no such file" in res.output
    res = CliRunner().invoke(cli, ["diagnose", "no-such-job"], env={"LAUNCH4D_STATE": str(tmp_path / "st")})
    assert res.exit_code == 2 and "not known" in res.output
    bad = tmp_path / "plan.json"
    bad.write_text("{not json")
    res = invoke("diagnose", str(shared_file(LOGS, F_IB)), "--plan", str(bad))
    assert res.exit_code == 2 and "plan.json" in res.output
    bw = tmp_path / "bw.json"
    bw.write_text(json.dumps({"version": 99}))
    res = invoke("diagnose", str(shared_file(LOGS, F_IB)), "--bwmap", str(bw))
    assert res.exit_code == 2 and "version" in res.output


def test_job_id_resolves_to_its_run_dir(tmp_path, monkeypatch):
    run_dir = tmp_path / "runs" / "job-1"
    (run_dir / "logs").mkdir(parents=True)
    shutil.copy(shared_file(LOGS, "pytorch-watchdog-timeout-600000ms-allreduce-full-torchrun-sigabrt.txt"),
                run_dir / "logs" / "node0.log")
    diagnose_plan(dp=2, gpus_per_node=1, hosts=["node-a", "node-b"]).save(run_dir / "plan.json")
    monkeypatch.setenv("LAUNCH4D_STATE", str(tmp_path / "state"))
    jobstate.record(jobstate.JobRecord(id="4242", backend="slurm", name="job-1", run_dir=str(run_dir),
                                       log_dir=str(run_dir / "logs"), submitted_at="2026-11-29T09:00:00"))
    res = run("4242", "--json")
    assert res.exit_code == 1, res.output
    d = json.loads(res.output)
    # the run dir's plan.json gives the world size, so the silent rank is named, with its host
    assert d["stalled_ranks"] == [1] and d["stalled_hosts"] == {"1": "node-b"}
    assert any(e.startswith("logs/node0.log:") for f in d["findings"] for e in f["evidence"])


def test_logs_dir_brings_run_dir_heartbeats_and_plan(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "heartbeat").mkdir()
    diagnose_plan(dp=2, gpus_per_node=1, hosts=["a", "b"]).save(run_dir / "plan.json")
    for r, (coll, phase, t) in enumerate([(9, "error", 100.0), (7, "backward", 60.0)]):
        (run_dir / "heartbeat" / f"rank{r}.json").write_text(json.dumps(
            {"rank": r, "host": f"h{r}", "pid": 10 + r, "step": 4, "phase": phase, "last_collective": "all_reduce",
             "collectives": coll, "updated": t}))
    res = run(str(run_dir / "logs"), "--json")
    d = json.loads(res.output)
    assert res.exit_code == 1 and d["stalled_ranks"] == [1] and d["stalled_hosts"] == {"1": "h1"}
    assert "heartbeat/rank1.json:1" in d["findings"][0]["evidence"]


def test_empty_dir_is_not_a_problem(tmp_path):
    res = run(str(tmp_path), "--json")
    assert res.exit_code == 0 and json.loads(res.output)["verdict"] == "nothing recognisable found"


def test_subprocess_cli():
    log = shared_file(LOGS, F_DESYNC)
    launch = str(REPO / ".venv" / "bin" / "launch")
    if not Path(launch).exists():
        launch = shutil.which("launch") or launch
    p = subprocess.run([launch, "diagnose", str(log), "--json"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr
    assert json.loads(p.stdout)["stalled_ranks"] == [1]
    p = subprocess.run([launch, "diagnose", "/definitely/not/here"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.startswith("error: ") and "Traceback" not in p.stderr


def test_pasted_log_on_stdin():
    text = shared_file(LOGS, F_DESYNC).read_text()
    res = CliRunner().invoke(cli, ["diagnose", "-", "--json"], input=text)
    assert res.exit_code == 1
    d = json.loads(res.output)
    assert d["stalled_ranks"] == [1] and "stdin.log:4" in d["findings"][0]["evidence"]
