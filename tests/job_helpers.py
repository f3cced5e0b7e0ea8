"""Helpers for tests that start real local jobs (torchrun + the trainer): polling, a free port, a tiny plan,
and the one check that no process of a job is left behind, with the clean-up that must follow every such test.

A local job's processes carry the job's marker in their environment (launcher.backends.procs), so
"nothing left" means: no process on this machine carries it any more.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from launcher.backends import procs


def wait_until(pred: Callable[[], object], limit_s: float = 60.0, poll_s: float = 0.1) -> bool:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        if pred():
            return True
        time.sleep(poll_s)
    return bool(pred())


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (a job's master port, a private sshd's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_plan(run_dir: Path, name: str = "orphans", steps: int = 50, timeout_s: int = 120) -> Path:
    """plan.json of a 2-process (dp 2) tiny CPU job, written into run_dir."""
    from launcher.plan.planner import plan_job
    from launcher.plan.spec import spec_from_dict

    spec = spec_from_dict({
        "name": name, "model": "tiny",
        "train": {"seq_len": 32, "global_batch": 4, "steps": steps, "lr": 3.0e-3, "warmup_steps": 1,
                  "precision": "fp32", "seed": 1, "data": "synthetic", "checkpoint_every": 0},
        "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu": "cpu"},
        "parallel": {"tp": 1, "cp": 1, "pp": 1, "zero": 1, "recompute": "none", "micro_batch": 2},
        "diagnostics": {"init_timeout_s": timeout_s, "collective_timeout_s": timeout_s}})
    plan = plan_job(spec, top=0).best
    assert plan is not None and plan.world_size == 2 and plan.degrees["dp"] == 2
    run_dir.mkdir(parents=True, exist_ok=True)
    plan.save(run_dir / "plan.json")
    return run_dir / "plan.json"


def recorded_marker(state_dir: Path) -> tuple[str, str]:
    """The marker of the job `launch run` recorded last in LAUNCH4D_STATE=state_dir."""
    rec = json.loads((state_dir / "jobs.json").read_text())["jobs"][-1]
    return procs.MARKER, rec["extra"]["marker"]


def assert_nothing_left(marker: tuple[str, str], limit_s: float = 20.0) -> None:
    """No process carrying the job's marker survives (given `limit_s` to exit)."""
    assert wait_until(lambda: not procs.marked(marker), limit_s), f"still running: {procs.marked(marker)}"


@contextmanager
def reaped(proc: subprocess.Popen | None = None) -> Iterator[list[tuple[str, str]]]:
    """Whatever the test asserts: on the way out `proc` is killed if it still runs, and every process
    of the markers the test appends to the yielded list (a failed test leaves no job behind)."""
    markers: list[tuple[str, str]] = []
    try:
        yield markers
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.communicate()
        for m in markers:
            procs.kill_marked(m)
