"""Backends: one interface per place a job can run (torchx's Scheduler), so the CLI never knows
which one it talks to.

    be = get_backend("local")                    # or "slurm", "k8s"
    req = be.dryrun(spec, plan, run_dir)         # Request: the files and the command; nothing sent
    print(req.text())                            # what every --dry-run prints
    h = be.submit(req)                           # JobRecord (launcher.formats.jobs), as jobstate keeps it
    be.describe(h) -> JobStatus | None           # None: the backend does not know this job
    be.log_iter(h, rank=None, follow=False, since=None)   # lines; since N: skip the first N
    be.cancel(h) -> bool                         # False: it had already ended (idempotent)
    be.wait(h, timeout)                          # written once here: backoff 2..60 s, retry budget
    be.request(BatchScript | Manifests | JobArray) -> Request   # other kinds: preflight's, arrays
    be.tasks(h), be.dump_stacks(h, why), be.sweep(h)            # an array's tasks; stacks; leftovers

Options: the job's own data (job_text, exclude, node_order) every backend takes; its own are typed
(Backend.Options, a BackendOptions dataclass) and one it does not take is refused (UserError).

Also here, because every backend needs them: the run directory (plan.json, job.yaml, logs/,
heartbeat/, checkpoints/) and the environment the trainer runs under (NCCL debug files, flight
recorder, timeouts, the user's backend.env).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import re
import time
import types
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from launcher.errors import UserError
from launcher.formats.exitcodes import PREEMPT_EXIT_CODE
from launcher.formats.jobs import JobRecord

if TYPE_CHECKING:
    from launcher.plan.model import Plan
    from launcher.plan.spec import JobSpec

T = TypeVar("T")

# Job states every backend maps its own onto.
PENDING, RUNNING, SUCCEEDED, FAILED, CANCELLED, PREEMPTED, UNKNOWN = (
    "PENDING", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED", "PREEMPTED", "UNKNOWN")
TERMINAL = frozenset({SUCCEEDED, FAILED, CANCELLED, PREEMPTED})
#: A trainer's line in a log: "[rank3]: text", after srun --label's "0: " where there is one.
RANK_LINE = re.compile(r"^(?:\d+: )?\[rank(\d+)\]: ?(.*)$")


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


def wait(backend: Backend, handle: JobRecord, timeout: float | None = None, budget_s: float = RETRY_BUDGET_S,
         on_status: Callable[[JobStatus], None] | None = None,
         on_retry: Callable[[TransientError, float, int], None] | None = None,
         start: float = POLL_START_S, cap: float = POLL_MAX_S,
         sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> JobStatus:
    """Poll until the job is done or `timeout` passes (None: no limit; 0: one look): every 2, 4, 8 ... `cap` s (back to `start`
    when the state changes), tolerating transient scheduler errors for `budget_s` at a time. A job
    the backend does not know (describe: None) ends the wait at once, as UNKNOWN. Every look goes
    through one backend.watching(): over SSH, one connection for the whole wait."""
    deadline = clock() + timeout if timeout is not None else None   # 0: one look, no wait
    last = None
    delays = backoff(start, cap)
    with backend.watching() as describe:
        while True:
            found = with_retries(lambda: describe(handle), budget_s, on_retry, sleep, clock, start, cap)
            st = found if found is not None else unknown(handle)
            if on_status:
                on_status(st)
            if st.done or found is None or (deadline is not None and clock() >= deadline):
                return st
            if st.state != last:
                delays = backoff(start, cap)
                last = st.state
            delay = next(delays)
            if deadline is not None:
                delay = max(min(delay, deadline - clock()), 0.0)
            sleep(delay)


@dataclass
class JobStatus:
    state: str
    exit_code: int | None = None
    detail: str = ""

    @property
    def done(self) -> bool:
        return self.state in TERMINAL


def unknown(handle: JobRecord) -> JobStatus:
    return JobStatus(UNKNOWN, None, f"{handle.backend} has no job {handle.id} (never submitted, or forgotten)")



@dataclass
class JobArray:
    """Several plans of one job as one submission (`launch plan --benchmark` on Slurm): plan i runs in
    <base>/<names[i]>; Backend.tasks(handle) gives one handle per plan."""

    spec: JobSpec
    plans: list[Plan]
    base: str | Path
    names: list[str]
    templates: str | None = None
    exclude: list[str] | None = None
    node_order: list[str] | None = None
    job_text: str | None = None


@dataclass
class Request:
    """What submit() sends, made by dryrun() with nothing sent or written: the files that go into the
    run dir (script or manifest, plan.json, job.yaml) and the command that starts the job. Printing
    it is every --dry-run; a test may change it before submitting it (torchx's AppDryRunInfo)."""

    backend: str
    name: str
    run_dir: str
    command: str
    files: dict[str, str] = field(default_factory=dict)
    main: str | None = None                 # the file a person reads first (train.sbatch, manifest.yaml)
    host: str | None = None                 # where the command runs, when not here (login node)
    env: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # what the backend keeps for submit and the handle

    def text(self) -> str:
        """The command (and where it runs), then the main file."""
        head = self.command + (f"  (on {self.host})" if self.host else "")
        return head + (f"\n\n{self.files[self.main].rstrip()}" if self.main in self.files else "")

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "name": self.name, "run_dir": self.run_dir, "command": self.command,
                "host": self.host, "main": self.main, "env": self.env, "files": self.files,
                "warnings": self.warnings}


@dataclass(frozen=True)
class BackendOptions:
    """A backend's own dryrun options, one typed field each (torchx's runopts). parse() refuses an
    option the backend does not take, or a value of the wrong type, in one line (exit 2); an option
    given as None is one not given."""

    @classmethod
    def parse(cls: type[OptionsT], backend: str, given: dict[str, Any]) -> OptionsT:
        hints = typing.get_type_hints(cls)
        known = [f.name for f in dataclasses.fields(cls)]
        for name, value in given.items():
            if value is None:
                continue
            if name not in hints:
                takes = ", ".join(known) or "none"
                raise UserError(f"{name}: not an option of the {backend} backend (its options: {takes})")
            if not _is_a(value, hints[name]):
                raise UserError(f"{name}: the {backend} backend takes {_type_name(hints[name])}, "
                                f"not {type(value).__name__} ({value!r})")
        return cls(**{k: v for k, v in given.items() if v is not None})


def _is_a(value: Any, hint: Any) -> bool:
    """isinstance against a type hint: unions and parameterised collections by their outer type."""
    if hint is Any:
        return True
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return any(_is_a(value, h) for h in typing.get_args(hint))
    origin = typing.get_origin(hint) or hint
    if origin is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, origin)


def _type_name(hint: Any) -> str:
    return " or ".join(getattr(h, "__name__", str(h)) for h in
                       (typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)) if h is not type(None))


OptionsT = TypeVar("OptionsT", bound="BackendOptions")


class Backend(ABC):
    """One place jobs run. Subclasses say how to build, send, read and stop a job; waiting (with
    backoff and a retry budget for a scheduler that is away) is the same everywhere, so it is here."""

    name = "base"
    #: Seconds between polls in wait(): start, doubling up to cap (local jobs are polled faster).
    poll_start_s, poll_max_s = POLL_START_S, POLL_MAX_S
    retry_budget_s = RETRY_BUDGET_S
    #: Told of each retry while the scheduler does not answer (the CLI prints a warning).
    on_retry: Callable[[TransientError, float, int], None] | None = None

    #: The options this backend's dryrun takes beyond the job's own data (torchx's runopts).
    Options: type[BackendOptions]

    @abstractmethod
    def dryrun(self, job: JobSpec, plan: Plan, run_dir: str | Path | None = None, *, job_text: str | None = None,
               exclude: list[str] | None = None, node_order: list[str] | None = None, **options: Any) -> Request:
        """The request, built without side effects: nothing written, started or sent. The job's own
        data (its text, the nodes a preflight left out, the measured node order) every backend takes,
        using what applies to it; `options` are the backend's own (self.Options) and one it does not
        know is refused (UserError naming it)."""

    def request(self, what: Any) -> Request:
        """A request of another kind than a planned job (launcher.formats.requests: a BatchScript, a
        Manifests; here a JobArray), built without side effects like dryrun's; submit() sends it."""
        raise UserError(f"the {self.name} backend cannot run a {type(what).__name__}")

    def tasks(self, handle: JobRecord) -> list[JobRecord]:
        """The jobs one submission made: an array's tasks, each followed on its own; else the job itself."""
        return [handle]

    def sweep(self, handle: JobRecord) -> list[int]:
        """After the job's end: stop any of its processes still running here; the pids that were (a
        scheduler cleans up its own jobs: none)."""
        return []

    def dump_stacks(self, handle: JobRecord, reason: str) -> list[int]:
        """Ask the job's trainers for their Python stacks (into the run dir's logs/stacks/); the ranks
        asked. A backend that cannot reach the job's processes from here asks none."""
        return []

    def check_access(self) -> None:  # noqa: B027 - optional hook: most backends find out at first use
        """Fail now, in one line (UserError), when the scheduler cannot be reached with what this
        backend was given (no Kubernetes credentials): before a command says or makes anything.
        A backend that finds out at its first command checks nothing here."""

    def options(self, given: dict[str, Any]) -> Any:
        """`given` as this backend's typed options (self.Options.parse)."""
        return self.Options.parse(self.name, given)

    @abstractmethod
    def submit(self, request: Request) -> JobRecord:
        """Send the request; nothing is left behind when it is refused."""

    @abstractmethod
    def describe(self, handle: JobRecord) -> JobStatus | None:
        """The job's state now, or None when the backend does not know the job."""

    @abstractmethod
    def log_iter(self, handle: JobRecord, rank: int | None = None, follow: bool = False, since: int | None = None,
                 stream: str = "out") -> Iterator[str]:
        """The job's log lines (only global rank `rank`'s trainer lines, without their prefix); `since`
        N skips the first N of them (a follower resuming); `follow` goes on until the job ends.
        `stream` "err": Slurm's separate stderr file; elsewhere the one combined log."""

    @abstractmethod
    def cancel(self, handle: JobRecord, force: bool = False) -> bool:
        """Stop the job. Idempotent: a job that has already ended (or is gone) is no error: False.
        `force`: stop every process of it now, without letting the trainers checkpoint (where the
        scheduler's own stop, scancel or a deletion, does not do that already)."""

    @contextlib.contextmanager
    def watching(self) -> Iterator[Callable[[JobRecord], JobStatus | None]]:
        """describe(), for many looks in a row (a wait, a follow): a backend that reaches its scheduler
        through a connection (Slurm over SSH) keeps one open for all of them and closes it after."""
        yield self.describe

    def status(self, handle: JobRecord) -> JobStatus:
        """describe(), with an unknown job as an UNKNOWN status."""
        found = self.describe(handle)
        return found if found is not None else unknown(handle)

    def statuses(self, handles: list[JobRecord]) -> dict[str, JobStatus]:
        """Many jobs' states (Slurm asks once per login host)."""
        return {h.id: self.status(h) for h in handles}

    def wait(self, handle: JobRecord, timeout: float | None = None,
             on_status: Callable[[JobStatus], None] | None = None, **options: Any) -> JobStatus:
        """Until the job has ended, is unknown, or `timeout` passes (module wait(): backoff, retries)."""
        options.setdefault("start", self.poll_start_s)
        options.setdefault("cap", self.poll_max_s)
        options.setdefault("budget_s", self.retry_budget_s)
        options.setdefault("on_retry", self.on_retry)
        return wait(self, handle, timeout, on_status=on_status, **options)


def get_backend(kind: str, **how: Any) -> Backend:
    """The backend for a kind; `how` is how it reaches its scheduler (k8s: kubeconfig, context)."""
    if kind not in BACKENDS:
        raise UserError(f"backend.kind: {kind!r} is not one of {', '.join(BACKENDS)}")
    module, attr = BACKENDS[kind].split(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        raise UserError(f"backend {kind!r} is not available in this installation") from None
    return cls(**how)


# --- run directory ----------------------------------------------------------------------------

def default_run_dir(spec: JobSpec, now: float | None = None) -> Path:
    """<backend.log_dir>/<name>-<YYYYmmdd-HHMMSS>, proven to lie inside backend.log_dir."""
    from launcher.formats.files import child_path

    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return child_path(spec.backend.log_dir, f"{spec.name}-{stamp}", "name")


def check_run_dir(run_dir: str | Path, plan: Plan) -> None:
    """Refuse a run dir that is not a directory, holds a symbolic link anywhere inside, or holds another
    job's plan (before touching it)."""
    from launcher.formats import rundir
    from launcher.plan.model import Plan as PlanCls

    rd = Path(run_dir)
    if rd.exists() and not rd.is_dir():
        raise UserError(f"--run-dir: {rd} exists and is not a directory")
    link = rundir.planted_link(rd) if rd.is_dir() else None
    if link:
        raise UserError(f"--run-dir: {rd} holds a symbolic link ({link}); launch4d never writes through one: "
                        "remove it, or give a new run directory")
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
    job's backend.env (the user has the last word). LD_LIBRARY_PATH, PATH and PYTHONPATH from
    backend.env are not here: the backend gives them to the trainer's command only
    (launcher.plan.spec_backend.split_env)."""
    from launcher.plan.spec_backend import split_env
    from launcher.render.env import diagnostics_env

    env = {"PYTHONUNBUFFERED": "1", "LAUNCH4D_RUN_DIR": str(Path(run_dir))}
    env.update(diagnostics_env(spec, str(Path(run_dir))))
    env.update(split_env(spec.backend.env)[0])
    return env


def rank_of(line: str) -> tuple[int | None, str]:
    """(rank, text) of a job's log line: srun --label prefixes each line with its task ("0: "), torchrun with
    the global rank ("[rank3]: ", TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE); rank None for torchrun's own lines."""
    m = RANK_LINE.match(line)
    return (int(m.group(1)), m.group(2)) if m else (None, line)


def filter_rank(line: str, rank: int | None) -> str | None:
    """The line (rank None), or with `rank` that rank's text only (None for another rank's line)."""
    if rank is None:
        return line
    got, text = rank_of(line)
    return text if got == rank else None


def skip_lines(lines: Iterator[str], since: int | None) -> Iterator[str]:
    """All but the first `since` lines."""
    for n, line in enumerate(lines):
        if since is None or n >= since:
            yield line


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
