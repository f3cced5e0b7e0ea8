"""Issue 14 item 6, end to end with real torchrun processes (gloo on CPU): two `launch run` on one
run dir. The second is refused (exit 2, one line naming the holder) even after the first `launch`
process itself was SIGKILLed, because the job's own processes hold the lock; the first job's
checkpoints are untouched and it finishes; once it has, the run dir can be resumed again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import EXAMPLES

pytestmark = pytest.mark.e2e

LAUNCH = str(Path(sys.executable).with_name("launch"))


def _wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def test_second_launch_run_is_refused_while_the_job_lives(tmp_path):
    env = {**os.environ, "LAUNCH4D_STATE": str(tmp_path / "state"), "OMP_NUM_THREADS": "1"}
    rd = tmp_path / "rd"
    first = subprocess.Popen([LAUNCH, "run", str(EXAMPLES / "tiny-cpu.yaml"), "--nproc", "2", "--run-dir", str(rd)],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for(lambda: any((rd / "heartbeat").glob("rank*")), 180, "the first job's heartbeats")
        first.send_signal(signal.SIGKILL)  # launch dies; the detached job goes on, holding the lock
        first.wait()
        second = subprocess.run([LAUNCH, "run", str(EXAMPLES / "tiny-cpu.yaml"), "--nproc", "2", "--run-dir",
                                 str(rd), "--resume", "auto"], env=env, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stderr
        errors = [ln for ln in second.stderr.splitlines() if ln.startswith("error")]
        assert len(errors) == 1 and "in use by another run" in errors[0], second.stderr
        ended = lambda: [p for p in (rd / "logs").glob("exit_code.*") if not p.name.endswith(".tmp")]  # noqa: E731
        _wait_for(ended, 300, "the first job to end")       # its own exit-code file (one per submission)
        assert [p.read_text().strip() for p in ended()] == ["0"]
        steps = [json.loads(ln)["step"] for ln in (rd / "metrics.jsonl").read_text().splitlines()]
        assert steps and max(steps) == 8  # it ran to the end, nobody cleaned up under it
        assert (rd / "checkpoints" / "latest").exists()
    finally:
        if first.poll() is None:
            first.kill()
    # the job is over: its processes released the lock, so the run dir can be continued again
    from launcher.formats.rundir import RunDirLock

    _wait_for(lambda: _lock_free(rd, RunDirLock), 30, "the lock to be released")


def _lock_free(rd: Path, lock_cls) -> bool:
    from launcher.errors import UserError

    try:
        lock_cls(rd).release()
        return True
    except UserError:
        return False
