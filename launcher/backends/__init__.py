"""Backends: one small interface per place a job can run (torchx-style), so the CLI never knows
which one it talks to.

    backend = get_backend("local")                         # or "slurm", "k8s"
    handle = backend.submit(spec, plan, run_dir, dry_run)  # dry run: handle.request says what would run
    backend.status(handle) -> JobStatus; backend.logs(handle, follow) -> lines; backend.cancel(handle)

Also here, because every backend needs them: the run directory (COMMON.md layout: plan.json,
job.yaml, logs/, heartbeat/, checkpoints/) and the environment the trainer runs under (NCCL
debug files, flight recorder, timeouts, the user's backend.env).
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from launcher.errors import UserError
from launcher.formats.exitcodes import PREEMPT_EXIT_CODE

if TYPE_CHECKING:
    from launcher.plan.model import Plan
    from launcher.plan.spec import JobSpec

T = TypeVar("T")

# Job states every backend maps its own onto.
PENDING, RUNNING, SUCCEEDED, FAILED, CANCELLED, PREEMPTED, UNKNOWN = (
    "PENDING", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED", "PREEMPTED", "UNKNOWN")
TERMINAL = frozenset({SUCCEEDED, FAILED, CANCELLED, PREEMPTED})


BACKENDS = {
    "local": "launcher.backends.local:LocalBackend",
    "slurm": "launcher.backends.slurm:SlurmBackend",
    "k8s": "launcher.backends.kubernetes:KubernetesBackend",
}


class TransientError(UserError):
    """The scheduler (or the login node) did not answer this time: worth retrying, with backoff,
    within a stated budget (wait() below); a UserError when the budget is spent."""


#: Seconds between polls: 2, 4, 8 ... up to 60.
POLL_START_S, POLL_MAX_S = 2.0, 60.0
#: How long a run of consecutive transient errors is tolerated before a command gives up.
RETRY_BUDGET_S = 120.0


def backoff(start: float = POLL_START_S, cap: float = POLL_MAX_S) -> Iterator[float]:
    """2, 4, 8 ... cap, cap, ..."""
    delay = start
    while True:
        yield delay
        delay = min(delay * 2, cap)


def with_retries(call: Callable[[], T], budget_s: float = RETRY_BUDGET_S,
                 on_retry: Callable[[TransientError, float, int], None] | None = None,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic,
                 start: float = POLL_START_S, cap: float = POLL_MAX_S) -> T:
    """`call()`, retried with backoff while it raises TransientError, for at most `budget_s`."""
    first = clock()
    delays = backoff(start, cap)
    tries = 0
    while True:
        try:
            return call()
        except TransientError as exc:
            tries += 1
            spent = clock() - first
            if spent >= budget_s:
                raise UserError(f"{exc}; still failing after {tries} tries over {spent:.0f} s "
                                f"(retry budget {budget_s:.0f} s)") from None
            delay = min(next(delays), max(budget_s - spent, 0.1))
            if on_retry:
                on_retry(exc, delay, tries)
            sleep(delay)


def wait(backend: Backend, handle: JobHandle, timeout: float | None = None, budget_s: float = RETRY_BUDGET_S,
         on_status: Callable[[JobStatus], None] | None = None,
         on_retry: Callable[[TransientError, float, int], None] | None = None,
         start: float = POLL_START_S, cap: float = POLL_MAX_S,
         sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> JobStatus:
    """Poll until the job is done or `timeout` passes: every 2, 4, 8 ... `cap` s (back to `start`
    when the state changes), tolerating transient scheduler errors for `budget_s` at a time."""
    deadline = clock() + timeout if timeout else None
    last = None
    delays = backoff(start, cap)
    while True:
        st = with_retries(lambda: backend.status(handle), budget_s, on_retry, sleep, clock, start, cap)
        if on_status:
            on_status(st)
        if st.done or (deadline is not None and clock() >= deadline):
            return st
        if st.state != last:
            delays = backoff(start, cap)
            last = st.state
        delay = next(delays)
        if deadline is not None:
            delay = max(min(delay, deadline - clock()), 0.0)
        sleep(delay)


@dataclass
class JobHandle:
    """What submit returns and status/logs/cancel take. `request` is the dry-run object: the exact
    command, script or manifest that was (or would be) sent."""

    backend: str
    id: str
    name: str
    run_dir: str
    log_path: str | None = None
    dry_run: bool = False
    request: str | None = None
    submitted_at: float = field(default_factory=time.time)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class JobStatus:
    state: str
    exit_code: int | None = None
    detail: str = ""

    @property
    def done(self) -> bool:
        return self.state in TERMINAL


@runtime_checkable
class Backend(Protocol):
    name: str

    def submit(self, spec: JobSpec, plan: Plan, run_dir: str | Path, dry_run: bool = False,
               **options: Any) -> JobHandle: ...

    def status(self, handle: JobHandle) -> JobStatus: ...

    def logs(self, handle: JobHandle, follow: bool = False) -> Iterator[str]: ...

    def cancel(self, handle: JobHandle) -> bool | None: ...


def get_backend(kind: str) -> Backend:
    if kind not in BACKENDS:
        raise UserError(f"backend.kind: {kind!r} is not one of {', '.join(BACKENDS)}")
    module, attr = BACKENDS[kind].split(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        raise UserError(f"backend {kind!r} is not available in this installation") from None
    return cls()


# --- run directory ----------------------------------------------------------------------------

def default_run_dir(spec: JobSpec, now: float | None = None) -> Path:
    """<backend.log_dir>/<name>-<YYYYmmdd-HHMMSS>, proven to lie inside backend.log_dir."""
    from launcher.formats.files import child_path

    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return child_path(spec.backend.log_dir, f"{spec.name}-{stamp}", "name")


def check_run_dir(run_dir: str | Path, plan: Plan) -> None:
    """Refuse a run dir that is not a directory or holds another job's plan (before touching it)."""
    from launcher.formats import rundir
    from launcher.plan.model import Plan as PlanCls

    rd = Path(run_dir)
    if rd.exists() and not rd.is_dir():
        raise UserError(f"--run-dir: {rd} exists and is not a directory")
    old = rd / rundir.PLAN
    if old.exists():
        prev = PlanCls.load(old)
        if (prev.name, prev.degrees, prev.model, prev.world_size) != (plan.name, plan.degrees, plan.model,
                                                                        plan.world_size):
            raise UserError(f"--run-dir: {rd} holds a different job ({prev.name}, {prev.degrees}); "
                            "give a new run directory")


def prepare_run_dir(run_dir: str | Path, plan: Plan, job_text: str | None) -> Path:
    """Create the layout and write plan.json and job.yaml. Refuses a dir holding another job's plan."""
    from launcher.formats import rundir
    from launcher.formats.files import atomic_write, make_dirs

    rd = Path(run_dir).resolve()
    check_run_dir(rd, plan)
    for sub in rundir.SUBDIRS:
        make_dirs(rd / sub, "run directory")
    plan.save(rd / rundir.PLAN)
    if job_text is not None:
        atomic_write(rd / rundir.JOB, job_text, "job file copy")
    return rd


def trainer_env(spec: JobSpec, run_dir: str | Path) -> dict[str, str]:
    """Environment for every trainer process of a local run: the diagnostics every backend sets
    (launcher.render.env: NCCL debug, flight recorder, timeouts) pointed into the run dir, then the
    job's backend.env (the user has the last word)."""
    from launcher.render.env import diagnostics_env

    env = {"PYTHONUNBUFFERED": "1", "LAUNCH4D_RUN_DIR": str(Path(run_dir))}
    env.update(diagnostics_env(spec, str(Path(run_dir))))
    env.update({str(k): str(v) for k, v in spec.backend.env.items()})
    return env


def state_for_exit(code: int | None) -> str:
    if code is None:
        return RUNNING
    if code == 0:
        return SUCCEEDED
    if code == PREEMPT_EXIT_CODE:
        return PREEMPTED
    if code in (130, 143, -2, -15):
        return CANCELLED
    return FAILED


def handle_from_record(rec: Any) -> JobHandle:
    """A JobHandle again from a launcher.backends.jobstate.JobRecord (status/logs/cancel from another shell)."""
    extra = dict(rec.extra or {})
    return JobHandle(backend=rec.backend, id=rec.id, name=rec.name, run_dir=rec.run_dir,
                     log_path=extra.get("log_path"), extra=extra)
