"""Live hangs, seen from inside each rank: stack dumps while the job still hangs, and test hooks.

Why here: once a collective times out the process is gone, and with it the one fact that says
where it stood. So every rank:
- registers faulthandler on SIGQUIT (formats.rundir.STACK_SIGNAL; the checkpoint signals are others) at
  start-up, writing every thread's Python stack to <run_dir>/logs/stacks/rank<R>.txt (formats.rundir.STACKS):
  `launch run` (or a person: `kill -QUIT PID`) asks for a dump
  without stopping anything, even while the main thread is blocked inside a C++ collective;
- runs a watchdog thread: when this rank has made no progress (no heartbeat) for `after_s`, it
  dumps its own stacks, the flight recorder (logs/flight/rank_<R>) and, on each host's local rank 0
  with NCCL >= 2.24 and `ncclras` on PATH, the NCCL RAS status (logs/ras/<host>.txt). This works
  the same under Slurm and Kubernetes, where no launcher process is there to ask.
`launch diagnose` reads the dumps (launcher.diagnose.stacks) and names the rank stuck outside any
collective and its frame.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import IO

from launcher.errors import UserError
from launcher.formats import nofollow, rundir

log = logging.getLogger("launcher.trainer")

DUMP_SIGNAL = rundir.STACK_SIGNAL
RAS_MIN = (2, 24, 0)


def stack_file(run_dir: str | Path, rank: int) -> Path:
    return rundir.RunDir(run_dir).stack_file(rank)


class StallWatchdog:
    """Stack dumps on SIGQUIT and after `after_s` seconds without progress (0: never by itself)."""

    def __init__(self, run_dir: str | Path, rank: int, host: str, after_s: float, local_rank: int = 0):
        self.run_dir, self.rank, self.host = Path(run_dir), rank, host
        self.after_s, self.local_rank = float(after_s), local_rank
        self.path = stack_file(run_dir, rank)
        # open for the process's life; never through a link planted in the run dir (formats.nofollow)
        self.file: IO[str] = nofollow.open_append(run_dir, self.path, buffering=1)
        faulthandler.register(DUMP_SIGNAL, file=self.file, all_threads=True, chain=False)
        self.last = time.monotonic()
        self.dumped = False
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        if self.after_s > 0 and self.thread is None:
            self.thread = threading.Thread(target=self._loop, name="launch4d-stall-watchdog", daemon=True)
            self.thread.start()

    def progress(self) -> None:
        """Called on every heartbeat: this rank moved on."""
        self.last = time.monotonic()
        self.dumped = False

    def _loop(self) -> None:
        while not self.stop.wait(min(5.0, max(0.2, self.after_s / 4))):
            quiet = time.monotonic() - self.last
            if quiet >= self.after_s and not self.dumped:
                self.dumped = True  # once per stall; the next heartbeat re-arms it
                try:
                    self.dump(f"no progress for {quiet:.0f} s (watchdog)")
                except Exception as exc:  # noqa: BLE001 - a failed dump must never end the run
                    log.warning("rank %d: stall dump failed: %s", self.rank, exc)

    def dump(self, reason: str) -> None:
        """Every thread's stack, then the flight recorder and the NCCL RAS status, into the run dir."""
        self.file.write(rundir.stack_header(self.rank, self.host, os.getpid(), reason))
        self.file.flush()
        faulthandler.dump_traceback(self.file, all_threads=True)
        self.file.flush()
        log.warning("rank %d: no progress for a while; wrote stacks to %s", self.rank, self.path)
        self._flight()
        if self.local_rank == 0:
            note = ras_status(self.run_dir, self.host)
            self.file.write(f"# nccl ras: {note}\n")
            self.file.flush()

    def _flight(self) -> None:
        """The flight recorder's ring buffer, where TORCH_FR_DUMP_TEMP_FILE would put it on a timeout."""
        if not os.environ.get("TORCH_FR_BUFFER_SIZE"):
            return
        try:
            import torch._C._distributed_c10d as c10d
            import torch.distributed as dist

            nccl = dist.is_initialized() and "nccl" in str(dist.get_backend())
            dump = getattr(c10d, "_dump_nccl_trace" if nccl else "_dump_fr_trace", None)
            if dump is None:
                return
            data = dump()
        except Exception as exc:  # noqa: BLE001 - best effort, beside the stacks
            self.file.write(f"# flight recorder: not dumped ({exc})\n")
            return
        out = self.run_dir / rundir.FLIGHT / f"rank_{self.rank}"
        nofollow.write_atomic(self.run_dir, out, data)
        self.file.write(f"# flight recorder: {out}\n")

    def close(self) -> None:
        self.stop.set()
        try:
            faulthandler.unregister(DUMP_SIGNAL)
        except (ValueError, RuntimeError):
            pass
        self.file.close()


def nccl_version() -> tuple[int, ...] | None:
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        v = torch.cuda.nccl.version()
        return tuple(v) if isinstance(v, tuple) else (v // 10000, v // 100 % 100, v % 100)
    except Exception:  # noqa: BLE001 - no NCCL in this build
        return None


def ras_status(run_dir: Path, host: str, timeout_s: float = 20.0) -> str:
    """`ncclras` (NCCL >= 2.24's RAS client) into logs/ras/<host>.txt; else why it was skipped."""
    version = nccl_version()
    if version is None:
        return "skipped (no NCCL here)"
    if version < RAS_MIN:
        return f"skipped (NCCL {'.'.join(map(str, version))} < 2.24 has no RAS)"
    client = shutil.which("ncclras")
    if client is None:
        return "skipped (ncclras is not on PATH)"
    out = Path(run_dir) / rundir.RAS / f"{host}.txt"
    try:
        r = subprocess.run([client], capture_output=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"failed ({exc})"
    nofollow.write_atomic(run_dir, out, r.stdout[: 4 << 20] + r.stderr[: 1 << 20])
    return str(out)


def parse_rank_seconds(flag: str, value: str | None) -> tuple[int, float] | None:
    """--inject-slow RANK:SECONDS (also from LAUNCH4D_INJECT_SLOW, so a job file's backend.env reaches it)."""
    if value is None:
        return None
    try:
        rank, secs = value.split(":")
        out = int(rank), float(secs)
    except ValueError:
        raise UserError(f"{flag} {value!r}: expected RANK:SECONDS, e.g. 1:0.5") from None
    if not (0 <= out[1] < 3600):
        raise UserError(f"{flag} {value!r}: SECONDS must be between 0 and 3600")
    return out


def stall_after_s(stall_dump_s: float, step_timeout_s: float, override: float | None) -> float:
    """Seconds without progress before the watchdog dumps: --stall-dump-s, else the plan's
    diagnostics.stall_dump_s, else (0 there) half the collective timeout, so the dump comes first."""
    if override is not None:
        return max(0.0, float(override))
    return float(stall_dump_s) if stall_dump_s > 0 else step_timeout_s / 2
