"""The local backend's hold on its processes, with real processes: cancel signals only what is still
the job's (a reused pid is left alone, a second cancel is a no-op), and nothing the job started
outlives it: a SIGKILLed torchrun agent takes its trainers along (PR_SET_PDEATHSIG), and a forced
stop reaches trainers torchrun put in their own sessions."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.backends import procs
from launcher.backends.jobstate import record
from launcher.backends.local import LocalBackend
from launcher.formats.jobs import JobRecord
from tests.conftest import REPO
from tests.job_helpers import assert_nothing_left, reaped, recorded_marker, tiny_plan, wait_until

pytestmark = pytest.mark.integration

LAUNCH = str(Path(sys.executable).with_name("launch"))


def handle_for(pid: int, run_dir: Path, marker: str, ticks: int | None) -> JobRecord:
    return JobRecord("local", f"local-{pid}", "t", str(run_dir), str(run_dir / "node0.log"),
                     extra={"pid": pid, "marker": marker, "start_ticks": ticks,
                            "exit_file": str(run_dir / "exit_code"), "log_path": str(run_dir / "node0.log")})


def test_cancel_leaves_a_pid_that_is_no_longer_the_jobs_alone(tmp_path):
    """A record naming a pid that now belongs to another process (no marker, or another start time)."""
    stranger = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        be = LocalBackend()
        for ticks in (None, procs.start_time(stranger.pid)):
            h = handle_for(stranger.pid, tmp_path, "job-token", ticks)
            assert be.status(h).state == "FAILED" and be.status(h).exit_code is None
            assert be.cancel(h) is False and be.cancel(h, force=True) is False
        # the marker matches but the start time does not: a pid reused by a later job of ours
        marked = subprocess.Popen(["sleep", "60"], start_new_session=True,
                                  env={**os.environ, procs.MARKER: "job-token"})
        try:
            started = procs.start_time(marked.pid)
            assert started is not None
            h = handle_for(marked.pid, tmp_path, "job-token", started + 1)
            assert be.status(h).state == "FAILED" and be.status(h).exit_code is None
            assert be.cancel(h) is False
            time.sleep(0.2)
            assert marked.poll() is None
        finally:
            marked.kill()
            marked.wait()
        assert stranger.poll() is None  # never signalled
    finally:
        stranger.kill()
        stranger.wait()


def test_cancel_cli_is_idempotent(tmp_path, monkeypatch):
    """`launch cancel local-<pid>`: the first stops the job's process; the second says it had ended, exit 0."""
    env = {**os.environ, "LAUNCH4D_STATE": str(tmp_path / "state")}
    job = subprocess.Popen(["bash", "-c", "sleep 60 & wait"], start_new_session=True,
                           env={**os.environ, procs.MARKER: "tok"})
    stranger = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        monkeypatch.setenv("LAUNCH4D_STATE", env["LAUNCH4D_STATE"])
        record(JobRecord(id=f"local-{job.pid}", backend="local", name="t", run_dir=str(tmp_path),
                         log_dir=str(tmp_path), submitted_at="now",
                         extra={"pid": job.pid, "marker": "tok", "start_ticks": procs.start_time(job.pid)}))
        # a second record whose pid is someone else's now
        record(JobRecord(id=f"local-{stranger.pid}", backend="local", name="old", run_dir=str(tmp_path / "old"),
                         log_dir=str(tmp_path), submitted_at="then",
                         extra={"pid": stranger.pid, "marker": "gone", "start_ticks": 1}))
        r = subprocess.run([LAUNCH, "cancel", f"local-{job.pid}", "--json"], capture_output=True, text=True,
                           env=env, timeout=60)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["cancelled"] is True
        job.wait(timeout=30)  # no trainer yet: the wrapper's process group got SIGTERM
        assert_nothing_left((procs.MARKER, "tok"), 10)
        for jid in (f"local-{job.pid}", f"local-{stranger.pid}"):
            r = subprocess.run([LAUNCH, "cancel", jid], capture_output=True, text=True, env=env, timeout=60)
            assert r.returncode == 0 and "had already ended; nothing to cancel" in r.stdout, r.stdout + r.stderr
        assert stranger.poll() is None
    finally:
        for p in (job, stranger):
            if p.poll() is None:
                p.kill()
                p.wait()
        procs.kill_marked((procs.MARKER, "tok"))


@pytest.mark.slow
def test_killed_torchrun_agent_takes_its_trainers_along(tmp_path):
    """torchrun + the bundled trainer (gloo); rank 1 stalls so both ranks sit in step 2; SIGKILL the
    agent: the trainers, each in its own session, die with it instead of training on as orphans."""
    rd = tmp_path / "run"
    plan = tiny_plan(rd)
    token = "agent-test"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0",
           "-m", "launcher.trainer", "--plan", str(plan), "--run-dir", str(rd), "--inject-stall", "1:2"]
    agent = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env={**os.environ, "OMP_NUM_THREADS": "1", procs.MARKER: token})
    marker = (procs.MARKER, token)
    with reaped(agent) as markers:
        markers.append(marker)

        def both_in_step_2() -> bool:
            beats = [rd / "heartbeat" / f"rank{r}.json" for r in (0, 1)]
            return all(b.exists() and json.loads(b.read_text())["step"] == 2 for b in beats)

        assert wait_until(both_in_step_2, 180), "the trainers never reached step 2"
        trainers = [p for p in procs.marked(marker) if p != agent.pid]
        assert len(trainers) >= 2
        assert all(os.getsid(p) != os.getsid(agent.pid) for p in trainers)  # out of a group kill's reach
        agent.kill()
        agent.wait()
        assert_nothing_left(marker)


@pytest.mark.slow
def test_ctrl_c_twice_leaves_nothing_running(tmp_path):
    """`launch run`, two SIGINTs before the first step: the job is killed and no process of it is left."""
    env = {**os.environ, "LAUNCH4D_STATE": str(tmp_path / "state"), "OMP_NUM_THREADS": "1"}
    job = tmp_path / "job.yaml"
    job.write_text((REPO / "examples" / "tiny-cpu.yaml").read_text().replace("steps: 8", "steps: 400"))
    rd = tmp_path / "rd"
    run = subprocess.Popen([LAUNCH, "run", str(job), "--nproc", "2", "--run-dir", str(rd)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    with reaped(run) as markers:
        state = tmp_path / "state" / "jobs.json"
        assert wait_until(lambda: state.exists() and (rd / "heartbeat" / "rank1.json").exists(), 180)
        markers.append(marker := recorded_marker(tmp_path / "state"))
        assert len(procs.marked(marker)) >= 4  # wrapper, torchrun, two trainers
        run.send_signal(signal.SIGINT)
        time.sleep(0.3)
        run.send_signal(signal.SIGINT)
        out, err = run.communicate(timeout=120)
        assert "killing the job" in err, err
        assert run.returncode != 0
        assert_nothing_left(marker)


def test_status_wait_timeout_exits_124_while_the_job_runs(tmp_path, monkeypatch):
    env = {**os.environ, "LAUNCH4D_STATE": str(tmp_path / "state")}
    job = subprocess.Popen(["sleep", "60"], start_new_session=True, env={**os.environ, procs.MARKER: "w"})
    try:
        monkeypatch.setenv("LAUNCH4D_STATE", env["LAUNCH4D_STATE"])
        record(JobRecord(id=f"local-{job.pid}", backend="local", name="w", run_dir=str(tmp_path),
                         log_dir=str(tmp_path), submitted_at="now",
                         extra={"pid": job.pid, "marker": "w", "start_ticks": procs.start_time(job.pid),
                                "exit_file": str(tmp_path / "exit_code")}))
        jid = f"local-{job.pid}"
        r = subprocess.run([LAUNCH, "status", jid, "--wait", "--timeout", "0.5", "--interval", "0.1", "--json"],
                           capture_output=True, text=True, env=env, timeout=60)
        assert r.returncode == 124, r.stderr
        out = json.loads(r.stdout)
        assert out["state"] == "RUNNING" and out["timed_out"] is True
        # --timeout 0: one look, then 124 (issue 23: 0 was read as "no timeout" and never returned)
        r = subprocess.run([LAUNCH, "status", jid, "--wait", "--timeout", "0", "--json"], capture_output=True,
                           text=True, env=env, timeout=60)
        assert r.returncode == 124 and json.loads(r.stdout)["timed_out"] is True, r.stderr
        for flag, value in (("--interval", "-1"), ("--interval", "nan"), ("--interval", "0"), ("--timeout", "inf"),
                            ("--timeout", "-3")):
            r = subprocess.run([LAUNCH, "status", jid, "--wait", flag, value], capture_output=True, text=True,
                               env=env, timeout=60)
            assert r.returncode == 2 and r.stderr.startswith(f"error: {flag}:") and len(r.stderr.splitlines()) == 1
        (tmp_path / "exit_code").write_text("0\n")  # the job ends: --wait returns its state
        r = subprocess.run([LAUNCH, "status", jid, "--wait", "--timeout", "5"], capture_output=True, text=True,
                           env=env, timeout=60)
        assert r.returncode == 0 and "SUCCEEDED" in r.stdout
    finally:
        job.kill()
        job.wait()
