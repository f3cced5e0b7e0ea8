"""`launch plan --benchmark K`: the top K plans of a real job run for a few steps through the local
backend (torchrun, gloo on this machine's CPUs), are measured from their metrics.jsonl and re-ranked;
-o writes the measured fastest at the job's full length."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

pytestmark = pytest.mark.e2e

JOB = {
    "name": "bench-tiny", "model": "tiny",
    "train": {"seq_len": 64, "global_batch": 8, "steps": 50, "lr": 3e-3, "precision": "fp32"},
    "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu": "cpu"},
    "parallel": "auto",
    "diagnostics": {"nccl_debug": "off", "init_timeout_s": 120, "collective_timeout_s": 120},
}


def test_benchmark_runs_top_plans_and_picks_by_measurement(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({**JOB, "backend": {"kind": "local", "log_dir": str(tmp_path / "runs")}}))
    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", "plan", str(job), "--benchmark", "2",
                           "--benchmark-steps", "3", "--benchmark-dir", str(tmp_path / "bench"), "-o", str(out),
                           "--json"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    payload = json.loads(proc.stdout)
    runs = payload["benchmark"]
    assert [r["index"] for r in runs] == [0, 1]
    for r in runs:
        assert r["exit_code"] == 0 and r["steps"] == 3 and r["measured_step_s"] > 0 and r["tokens_per_s"] > 0
        metrics = (tmp_path / "bench" / f"{r['index']}-{r['layout']}" / "metrics.jsonl").read_text().splitlines()
        assert len(metrics) == 3                       # the short run, not the job's 50 steps
    fastest = min(runs, key=lambda r: r["measured_step_s"])
    assert payload["chosen_by_measurement"] == fastest["index"]
    written = json.loads(out.read_text())
    plans = [payload["best"]] + payload["alternatives"]
    assert written["layout"] == plans[fastest["index"]]["layout"]
    assert written["train"]["steps"] == 50             # the plan to run keeps the job's length
    assert "measured" in proc.stderr or "benchmark" in proc.stderr
    # the measured pick is the launchable artefact: `launch run plan.json` runs exactly it, not a re-plan
    assert len(written["ranks"]["node"]) == written["world_size"]
    run = subprocess.run([sys.executable, "-m", "launcher.cli", "run", str(out), "--run-dir", str(tmp_path / "rd"),
                          "--dry-run", "--json"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["plan"]["layout"] == written["layout"]


def test_sigterm_during_a_benchmark_leaves_nothing_running(tmp_path):
    """A CI job's timeout SIGTERMs `launch plan --benchmark`: the run it was waiting for is stopped with it
    (torchrun and every trainer carrying the run dir), and launch exits non-zero."""
    import os
    import signal
    import time

    from launcher.backends import procs

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({**JOB, "backend": {"kind": "local", "log_dir": str(tmp_path / "runs")}}))
    bench = tmp_path / "bench"
    proc = subprocess.Popen([sys.executable, "-m", "launcher.cli", "plan", str(job), "--benchmark", "1",
                             "--benchmark-steps", "1000", "--benchmark-dir", str(bench)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not list(bench.glob("*/metrics.jsonl")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)                          # until a trainer has logged a step
    assert proc.poll() is None, proc.stderr.read()[-2000:] if proc.stderr else ""
    run_dir = next(bench.glob("*/metrics.jsonl")).parent
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) != 0
    left = [p for p in procs.marked(("LAUNCH4D_RUN_DIR", str(run_dir))) if p != os.getpid()]
    assert left == [], left
