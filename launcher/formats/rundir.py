"""The run directory: its layout (the one place that spells it), its readers and its exclusive lock.

    <run_dir>/plan.json  job.yaml  metrics.jsonl
              logs/ logs/nccl/ logs/flight/ logs/stacks/ logs/ras/  heartbeat/  checkpoints/  .launch4d.lock

The trainer writes these files, the backends create the layout, `launch run`, `launch diagnose` and
the benchmarks read them: every one of them names a path through `RunDir` (or the constants below
for templates and remote paths), so the layout can change here alone. docs/formats.md describes it.

Two `launch run` on one run dir must not both start: the second would clean up the first's
in-progress checkpoint. `lock()` takes an exclusive, non-blocking flock on .launch4d.lock; the fd
can be passed to the job's processes so the lock lives exactly as long as the job.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sys
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
NODECHECK_LOG = "logs/nodecheck.log"  # the sbatch script's node health check, one line per bad node
PREFLIGHT_PLAN = "preflight-plan.json"            # the plan's groups as measured before the trainer (gate)
PREFLIGHT_PLAN_SPEC = "preflight-plan.spec.json"  # the groups to measure, as submitted (formats/groupprobe.py)
PREFLIGHT_PLAN_LOG = "logs/preflight-plan.log"    # the probe's own output
EXIT_CODE = "logs/exit_code"  # the local backend's wrapper writes torchrun's exit status here
#: The line the local backend writes into node0.log before each submission's output (a run dir reused
#: by a resume holds several): "# launch4d local 2026-05-01T12:00:01: <command>", local time.
LOCAL_RUN_HEADER = "# launch4d local "
LATEST = "latest"            # checkpoints/latest holds the name of the newest complete step-N dir
CHECKPOINT_EXTRA = "extra.pt"  # rank 0's step/scheduler/data state; with DCP's .metadata marks a complete checkpoint


class RunDir:
    """Paths inside one run directory (nothing is touched until a path is used)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"RunDir({str(self.root)!r})"

    plan = property(lambda self: self.root / PLAN)
    job = property(lambda self: self.root / JOB)
    metrics = property(lambda self: self.root / METRICS)
    logs = property(lambda self: self.root / LOGS)
    nccl_logs = property(lambda self: self.root / NCCL_LOGS)
    flight = property(lambda self: self.root / FLIGHT)
    stacks = property(lambda self: self.root / STACKS)
    ras = property(lambda self: self.root / RAS)
    heartbeat = property(lambda self: self.root / HEARTBEAT)
    checkpoints = property(lambda self: self.root / CHECKPOINTS)
    exit_code = property(lambda self: self.root / EXIT_CODE)
    lock = property(lambda self: self.root / LOCK)
    preflight_plan = property(lambda self: self.root / PREFLIGHT_PLAN)

    def exit_code_of(self, token: str) -> Path:
        """One submission's exit-code file (the local backend's wrapper writes it): each run in a reused
        run dir keeps its own status."""
        return self.logs / f"exit_code.{token}"

    def node_log(self, node: int = 0) -> Path:
        """One node's combined output (the local backend's torchrun, every rank line prefixed)."""
        return self.logs / f"node{node}.log"

    def heartbeat_file(self, rank: int) -> Path:
        return self.heartbeat / f"rank{rank}.json"

    def heartbeat_files(self) -> list[Path]:
        return sorted(self.heartbeat.glob("rank*.json"))

    def stack_file(self, rank: int) -> Path:
        return self.stacks / f"rank{rank}.txt"

    def stack_files(self) -> list[Path]:
        return sorted(self.stacks.glob("rank*.txt"))

    def flight_prefix(self) -> str:
        """The flight recorder's dump prefix (torch appends the rank)."""
        return f"{self.flight}/rank_"

    def nccl_debug_file(self) -> str:
        """NCCL_DEBUG_FILE: one file per host and process (NCCL expands %h and %p)."""
        return f"{self.nccl_logs}/%h.%p.log"


def planted_link(root: str | Path) -> str | None:
    """The first symbolic link anywhere inside the run dir `root` ("path -> target"), or None. A run dir
    holds none of its own making, and every writer in it (the trainer's checkpoints and their .tmp dirs,
    logs/, logs/exit_code.<token>.tmp, the node scripts) would write through one to its target: a job refuses
    to start, or resume, in a run dir that holds one."""
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            if os.path.islink(p):
                try:
                    target = os.readlink(p)
                except OSError:
                    target = "?"
                return f"{p} -> {target}"
    return None


def slurm_log(run_dir: str, job_id: str = "%j", task: int | None = None) -> str:
    """Where sbatch writes a job's output (`%j` in the script; the job id, or id_task of an array, after).
    A string: the run dir may be on a login node reached over SSH."""
    return f"{run_dir}/{LOGS}/slurm-{job_id}{'' if task is None else f'_{task}'}.out"


def remote(run_dir: str, name: str) -> str:
    """`name` (one of the constants above) inside a run dir given as a string, e.g. on a remote host."""
    return f"{run_dir}/{name}"


def read_metrics(run_dir: str | Path) -> list[dict]:
    """metrics.jsonl as a list, one record per step (the last written wins: a resumed run redoes
    steps), torn or unreadable lines skipped; [] when there is none yet."""
    try:
        lines = RunDir(run_dir).metrics.read_text(errors="replace").splitlines()
    except OSError:
        return []
    by_step: dict[int, dict] = {}
    for line in lines:
        try:
            rec = json.loads(line)
            by_step[int(rec["step"])] = rec
        except (ValueError, KeyError, TypeError):
            continue
    return [by_step[s] for s in sorted(by_step)]


def read_heartbeats(run_dir: str | Path) -> list[dict]:
    """Every rank's last heartbeat record, by rank; unreadable files skipped."""
    out = []
    for p in RunDir(run_dir).heartbeat_files():
        try:
            rec = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return sorted(out, key=lambda r: r.get("rank", 0) if isinstance(r.get("rank"), int) else 0)


# --- checkpoints: checkpoints/step-<N>/ (complete), step-<N>.tmp/ (being written), latest ----------

def checkpoint_step(path: Path) -> int:
    """N of a step-N checkpoint dir; -1 for any other name."""
    try:
        return int(path.name.split("-", 1)[1])
    except (IndexError, ValueError):
        return -1


def is_complete_checkpoint(path: Path) -> bool:
    """A finished checkpoint dir: its final name, DCP's .metadata and rank 0's extras present."""
    return (path.is_dir() and not path.name.endswith(".tmp") and (path / ".metadata").is_file()
            and (path / CHECKPOINT_EXTRA).is_file())


def complete_checkpoints(checkpoints: Path) -> list[Path]:
    """The complete step-N dirs under a checkpoints/ dir, oldest first."""
    return sorted((p for p in checkpoints.glob("step-*") if is_complete_checkpoint(p)), key=checkpoint_step)


def latest_checkpoint(checkpoints: Path, warn: bool = True) -> Path | None:
    """The checkpoint `latest` names if complete; else the newest complete one (with a warning on
    stderr when `latest` named something else); None when there is none."""
    named = None
    try:
        named = (checkpoints / LATEST).read_text().strip()
    except (OSError, UnicodeDecodeError):
        pass
    if named and "/" not in named and is_complete_checkpoint(checkpoints / named):
        return checkpoints / named
    done = complete_checkpoints(checkpoints)
    if done and named and warn:
        print(f"warning: {checkpoints / LATEST} names {named!r}, which is not a complete checkpoint; "
              f"using {done[-1].name}", file=sys.stderr, flush=True)
    return done[-1] if done else None


def resume_target(path: str | Path) -> tuple[Path, Path | None] | None:
    """What `--resume PATH` names: a run dir, its checkpoints/ dir, or one complete step-N dir.
    (the checkpoints/ dir, the one checkpoint it pins or None for "the latest"); None if none of these."""
    p = Path(path)
    if (p / CHECKPOINTS).is_dir():
        return p / CHECKPOINTS, None
    if p.name == CHECKPOINTS and p.is_dir():
        return p, None
    if is_complete_checkpoint(p):
        return p.parent, p
    return None


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

