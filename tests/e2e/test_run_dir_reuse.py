"""A run dir reused by a second run (a resume after a cancel) keeps each run's own status and diagnosis.

Real torchrun runs of a small user script (train.entrypoint): the first ends as a preempted run does
(rank 1 exits 75 after "checkpointing"), the second, in the same run dir, succeeds. `launch jobs` must
still show the first as PREEMPTED (its exit code is its own file, not the latest run's), and `launch
diagnose` of the run dir explains the last run (exit 0), not the earlier run's exit 75.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.cli_helpers import launch, state_env

pytestmark = pytest.mark.e2e

SCRIPT = "import os, sys\nprint('rank', os.environ['RANK'], flush=True)\n" \
         "sys.exit(int(sys.argv[1]) if os.environ['RANK'] == '1' else 0)\n"


def job(tmp_path: Path, code: int) -> Path:
    path = tmp_path / f"job{code}.yaml"
    path.write_text(yaml.safe_dump({
        "name": "reused", "model": "tiny", "train": {"seq_len": 32, "global_batch": 2, "steps": 1,
                                                      "entrypoint": {"script": "exit.py", "args": [str(code)]}},
        "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu": "cpu"},
        "parallel": {"tp": 1, "cp": 1, "pp": 1, "zero": 1, "recompute": "none", "micro_batch": 1}}))
    return path


def test_each_run_keeps_its_own_status_and_diagnosis(tmp_path):
    (tmp_path / "exit.py").write_text(SCRIPT)
    rd, env = tmp_path / "rd", state_env(tmp_path)
    first = launch("run", job(tmp_path, 75), "--run-dir", rd, env=env, cwd=tmp_path)
    assert first.returncode == 75, first.stderr
    second = launch("run", job(tmp_path, 0), "--run-dir", rd, env=env, cwd=tmp_path)
    assert second.returncode == 0, second.stderr

    r = launch("jobs", "--json", env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    states = [(j["state"], j["exit_code"]) for j in json.loads(r.stdout)["jobs"]]
    assert states == [("PREEMPTED", 75), ("SUCCEEDED", 0)]

    r = launch("diagnose", rd, "--json", env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert not [f for f in report["findings"] if "75" in f["message"] and f["kind"] == "process_exit"], report
    assert any("earlier run" in s for s in report["skipped"])
    # the earlier run alone (its log part) is still what it was: diagnose of that log file names its exit
    job_id = json.loads(launch("jobs", "--json", env=env, cwd=tmp_path).stdout)["jobs"][0]["id"]
    r = launch("logs", job_id, env=env, cwd=tmp_path)
    assert r.returncode == 0 and "rank 1" in r.stdout
