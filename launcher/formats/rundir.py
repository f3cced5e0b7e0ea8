"""The run directory: its layout (one place that spells it) and its exclusive lock.

    <run_dir>/plan.json  job.yaml  metrics.jsonl
              logs/ logs/nccl/ logs/flight/  heartbeat/  checkpoints/  .launch4d.lock

Two `launch run` on one run dir must not both start: the second would clean up the first's
in-progress checkpoint. `lock()` takes an exclusive, non-blocking flock on .launch4d.lock; the fd
can be passed to the job's processes so the lock lives exactly as long as the job.
"""

from __future__ import annotations

import fcntl
import os
import signal
from pathlib import Path

from launcher.errors import UserError

PLAN = "plan.json"
JOB = "job.yaml"
METRICS = "metrics.jsonl"
LOGS = "logs"
NCCL_LOGS = "logs/nccl"
FLIGHT = "logs/flight"
HEARTBEAT = "heartbeat"
CHECKPOINTS = "checkpoints"
LOCK = ".launch4d.lock"
STACKS = "logs/stacks"      # rank<R>.txt: Python stacks dumped while the job hung
RAS = "logs/ras"            # <host>.txt: `ncclras` output taken at the same moment
STACK_HEADER = "# launch4d stack dump"
#: asks a trainer for its stacks (faulthandler; `kill -QUIT PID`, as a JVM takes it). Never a checkpoint
#: signal: those are USR1/USR2/URG/XCPU/HUP (backend.slurm.checkpoint_signal).
STACK_SIGNAL = signal.SIGQUIT
SUBDIRS = (LOGS, NCCL_LOGS, FLIGHT, HEARTBEAT, CHECKPOINTS)


class RunDirLock:
    """An exclusive lock on a run dir, held until release() (or the process and its heirs end)."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise UserError(f"--run-dir: cannot lock {run_dir} ({exc.strerror})") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 64, 0).decode(errors="replace").strip()
            os.close(self.fd)
            raise UserError(f"--run-dir: {run_dir} is in use by another run"
                            f"{f' (pid {holder})' if holder.isdigit() else ''}; wait for it to end "
                            "or give another run directory") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def stack_header(rank: int, host: str, pid: int, reason: str) -> str:
    """The line that opens each stack dump in STACKS/rank<R>.txt (UTC, so it compares with the heartbeat's
    `updated` wherever diagnose runs); launcher.diagnose.stacks reads rank and host from it."""
    import time

    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return f"{STACK_HEADER}: rank {rank} host {host} pid {pid} at {stamp}: {reason}\n"

