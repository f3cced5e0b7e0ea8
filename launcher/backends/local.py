"""Local backend: the job on this machine under `torchrun --standalone` (gloo on CPU, NCCL on GPUs).

Why it looks like this:
- The job runs detached in its own session (a small bash wrapper around torchrun), so Ctrl-C in
  the terminal reaches `launch run`, which decides what to do, and so `launch status|logs|cancel`
  work from another shell. The wrapper records torchrun's exit code in logs/exit_code.<token>, one file
  per submission (a run dir reused by a resume keeps each run's own status).
- All output goes to <run_dir>/logs/node0.log, each worker line prefixed `[rank<R>]: ` (torchrun's
  log-line prefix template), which is how rank 0's lines are picked out for the terminal.
- torchrun exits 1 whenever a worker fails, whatever the worker's code; the job's real exit code
  is the one torchrun prints in its root-cause summary (`exitcode  : 75`), so a preempted run
  (checkpointed, exit 75) is told apart from a crash.
- cancel() sends SIGTERM to the trainer processes themselves, not to torchrun: the trainer
  checkpoints and exits 75, and torchrun reports that. (SIGTERM to torchrun would make it kill
  the workers and exit 1 with no exit code of theirs.)
- Every process of the job carries `LAUNCH4D_JOB=<token>` and the wrapper's start time is recorded
  (launcher.backends.procs): cancel signals only processes that still carry the token, so a pid
  reused after the job ended is left alone, and a forced stop also reaches the trainers torchrun put
  in their own sessions. The trainers also die with torchrun (PR_SET_PDEATHSIG, trainer/__main__).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.backends import (
    CANCELLED,
    FAILED,
    PREEMPTED,
    RUNNING,
    UNKNOWN,
    Backend,
    BackendOptions,
    JobStatus,
    Request,
    filter_rank,
    prepare_run_dir,
    procs,
    skip_lines,
    state_for_exit,
    trainer_env,
)
from launcher.errors import UserError
from launcher.formats import nofollow, rundir
from launcher.formats.files import read_text
from launcher.formats.jobs import JobRecord
from launcher.plan.spec_backend import split_env
from launcher.transport.local import LocalTransport

if TYPE_CHECKING:
    from launcher.plan.model import Plan
    from launcher.plan.spec import JobSpec

LOG_PREFIX = "[rank${rank}]: "
ROOT_CAUSE_EXIT = re.compile(r"Root Cause \(first observed failure\):.*?exitcode\s*:\s*(-?\d+)", re.S)
NO_SPACE = "No space left on device"
ROOT_CAUSE_RANK = re.compile(r"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+)", re.S)


def find_py_spy() -> str | None:
    """py-spy on PATH, or installed beside this interpreter (a venv not on PATH)."""
    found = shutil.which("py-spy")
    beside = Path(sys.executable).with_name("py-spy")
    return found or (str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None)


def no_space(run_dir: str | Path) -> str:
    return (f"{NO_SPACE} in {run_dir}: free space, then run again with --resume auto "
            "(the last complete checkpoint is kept)")


def job_exit_code(torchrun_rc: int, log_text: str, run_dir: Path | None = None,
                  started: float | None = None) -> int:
    """The job's exit code from torchrun's and the log's evidence (see the module docstring)."""
    if torchrun_rc == 0:
        return 0
    from launcher.backends import PREEMPT_EXIT_CODE

    m = ROOT_CAUSE_EXIT.findall(log_text)
    if m:
        # Once one trainer exits 75 after its checkpoint, torchrun SIGTERMs the rest, which may die of
        # it while tearing down; any 75 in the failure summary means the job was preempted.
        summary = log_text[log_text.rfind("ChildFailedError"):]
        codes = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", summary)]
        if PREEMPT_EXIT_CODE in codes:
            return PREEMPT_EXIT_CODE
        code = int(m[-1])
        return 128 - code if code < 0 else code
    if "SignalException" in log_text and "got signal" in log_text:
        sig = re.findall(r"got signal: (\d+)", log_text)
        # torchrun itself was signalled; it forwarded the signal, and the trainer checkpoints on it
        if run_dir is not None and started is not None:
            latest = rundir.RunDir(run_dir).checkpoints / rundir.LATEST
            if latest.exists() and latest.stat().st_mtime >= started:
                return PREEMPT_EXIT_CODE
        return 128 + int(sig[-1]) if sig else torchrun_rc
    return torchrun_rc


@dataclass(frozen=True)
class LocalOptions(BackendOptions):
    resume: str | None = None              # the trainer's --resume: auto | never | a checkpoint
    keep_fds: tuple[int, ...] = ()         # descriptors the job's processes inherit (the run dir's lock)


class LocalBackend(Backend):
    """The job on this machine. Of the job's data it uses the text (job.yaml); one node has nothing
    to leave out or order, so `exclude` and `node_order` do not apply."""

    name = "local"
    Options = LocalOptions
    poll_start_s, poll_max_s = 0.2, 2.0  # a job on this machine is cheap to look at

    def __init__(self) -> None:
        self._procs: dict[str, subprocess.Popen] = {}
        self.here = LocalTransport()  # files and commands on this machine

    # --- submit ----------------------------------------------------------------------------------
    def command(self, plan: Plan, run_dir: Path, resume: str | None = None) -> list[str]:
        logs = rundir.RunDir(run_dir).logs
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={plan.world_size}", "--max-restarts=0",
               "--tee=3", f"--log-dir={logs / 'torchrun'}"]
        if plan.train.entrypoint is not None:  # own code: its own arguments; the resume mode is in its env
            return cmd + plan.train.entrypoint.argv
        cmd += ["-m", "launcher.trainer", "--plan", str(rundir.RunDir(run_dir).plan), "--run-dir", str(run_dir)]
        if resume:
            cmd += ["--resume", resume]
        return cmd

    def env(self, spec: JobSpec, plan: Plan, run_dir: Path, resume: str | None = None) -> dict[str, str]:
        from launcher.render.env import plan_env

        env = trainer_env(spec, run_dir)
        env.update(plan_env(plan, str(rundir.RunDir(run_dir).plan), str(run_dir), resume or "never"))
        env.update(split_env(spec.backend.env)[0])  # the user has the last word
        env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = LOG_PREFIX
        env.setdefault("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
        if plan.gpu.name == "cpu":
            # A CPU job stays on CPU (gloo) even on a machine with GPUs.
            env["LAUNCH4D_DEVICE"] = "cpu"
            env["CUDA_VISIBLE_DEVICES"] = ""
        elif "CUDA_VISIBLE_DEVICES" not in os.environ:
            # Local rank i drives the GPU the plan placed it on (NVLink-aware gpu_order): the trainer
            # uses cuda:LOCAL_RANK, so list the plan's GPUs in local-rank order.
            order = [r.gpu for r in sorted(plan.ranks, key=lambda r: r.local_rank) if r.node == 0]
            if order != list(range(len(order))):
                env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, order))
        return env

    def dryrun(self, job: JobSpec, plan: Plan, run_dir: str | Path | None = None, *, job_text: str | None = None,
               exclude: list[str] | None = None, node_order: list[str] | None = None, **options: Any) -> Request:
        """torchrun's command and environment, plan.json and job.yaml: nothing written or started."""
        from launcher.backends import default_run_dir

        opts = self.options(options)
        resume, keep_fds = opts.resume, opts.keep_fds
        if plan.nodes != 1:
            raise UserError(f"cluster.nodes: the local backend runs on this machine only, but the plan has "
                            f"{plan.nodes} nodes; use backend.kind slurm or k8s, or set cluster.nodes: 1")
        rd = Path(run_dir or default_run_dir(job)).resolve()
        cmd = self.command(plan, rd, resume)
        env = self.env(job, plan, rd, resume)
        files = {rundir.PLAN: plan.to_json() + "\n"}
        if job_text is not None:
            files[rundir.JOB] = job_text
        # backend.env's LD_LIBRARY_PATH / PATH / PYTHONPATH: torchrun's only, never the wrapper shell's
        trainer_only = split_env(job.backend.env)[1]
        command = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted({**env, **trainer_only}.items())) \
            + " " + shlex.join(cmd)
        return Request(self.name, job.name, str(rd), command, files, env=env,
                       extra={"argv": cmd, "world": plan.world_size, "keep_fds": tuple(keep_fds),
                              "trainer_env": trainer_only})

    @staticmethod
    def wrapper(cmd: list[str], exit_file: Path, trainer_env: dict[str, str]) -> str:
        """The bash script around torchrun: it outlives Ctrl-C and records torchrun's exit code. The
        exit code goes to a new file (noclobber: O_EXCL, so never through a link) renamed into place;
        backend.env's LD_LIBRARY_PATH / PATH / PYTHONPATH are torchrun's alone, not this shell's."""
        prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in sorted(trainer_env.items()))
        tmp, final = shlex.quote(f"{exit_file}.tmp"), shlex.quote(str(exit_file))
        logs = shlex.quote(str(exit_file.parent))  # logs/ itself replaced by a link: write nothing there
        return (f"trap ':' TERM INT USR1 USR2\n{prefix}{shlex.join(cmd)}\nrc=$?\n"
                f"[ ! -L {logs} ] && rm -f -- {tmp} && (set -C; echo $rc > {tmp}) && mv -fT -- {tmp} {final}\n"
                "exit $rc\n")

    def submit(self, request: Request) -> JobRecord:
        """Write the run dir (refusing one that holds another job), then start the command detached."""
        from launcher.formats.files import atomic_write
        from launcher.plan.model import Plan as PlanCls

        rd = Path(request.run_dir)
        plan = PlanCls.from_dict(json.loads(request.files[rundir.PLAN]))
        prepare_run_dir(rd, plan, None)
        for name, text in request.files.items():
            if name != rundir.PLAN:
                atomic_write(rd / name, text, name)
        log = rundir.RunDir(rd).node_log()
        cmd = list(request.extra["argv"])
        env = dict(request.env)
        token = uuid.uuid4().hex
        env[procs.MARKER] = token
        exit_file = rundir.RunDir(rd).exit_code_of(token)    # this submission's own: a resume writes another
        wrapper = self.wrapper(cmd, exit_file, request.extra.get("trainer_env") or {})
        started = time.time()
        try:  # never through a link planted since the run dir was checked (logs/ or the log itself)
            log_fd = nofollow.open_fd(rd, log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        except nofollow.PlantedLinkError as exc:
            raise UserError(str(exc)) from None
        except OSError as exc:
            raise UserError(f"{log}: cannot write the job's log ({exc.strerror})") from None
        try:
            os.write(log_fd, f"{rundir.LOCAL_RUN_HEADER}{time.strftime('%Y-%m-%dT%H:%M:%S')}: "
                             f"{shlex.join(cmd)}\n".encode())
            offset = os.lseek(log_fd, 0, os.SEEK_END)  # this submission's output starts here (appended to)
            proc = self.here.spawn(["bash", "-c", wrapper], output_fd=log_fd, env=env,
                                   pass_fds=tuple(request.extra.get("keep_fds", ())))  # the run dir's lock
        finally:
            os.close(log_fd)
        # Popen returns once the exec has begun, before the kernel has laid out the new environment:
        # until the marker shows in /proc/PID/environ the wrapper would not be known as the job's.
        until = time.monotonic() + 10
        while procs.environ(proc.pid).get(procs.MARKER) != token and proc.poll() is None \
                and time.monotonic() < until:
            time.sleep(0.005)
        handle = JobRecord(backend=self.name, id=f"local-{proc.pid}", name=request.name, run_dir=str(rd),
                           log_path=str(log), request=request.text(), log_dir=str(rundir.RunDir(rd).logs),
                           extra={"pid": proc.pid, "exit_file": str(exit_file), "log_path": str(log),
                                  "started": started, "log_offset": offset,
                                  "world": request.extra.get("world"), "marker": token,
                                  "start_ticks": procs.start_time(proc.pid)})
        self._procs[handle.id] = proc
        return handle

    # --- follow ------------------------------------------------------------------------------------
    def describe(self, handle: JobRecord) -> JobStatus | None:
        """From the wrapper's exit-code file, else whether the wrapper still lives; None for a job
        this machine has no trace of (no such pid of ours, no exit code, no run dir)."""
        proc = self._procs.get(handle.id)
        if proc is not None:
            proc.poll()
        exit_file = Path(handle.extra.get("exit_file", rundir.RunDir(handle.run_dir).exit_code))
        for _ in range(2):  # the exit code, else a live wrapper; again: it may have ended in between
            if self.here.exists(str(exit_file)):
                return self._ended(handle, exit_file)
            if self._wrapper_alive(handle):
                return JobStatus(RUNNING)
        if not handle.extra.get("pid") or not Path(handle.run_dir).is_dir():
            return None
        return JobStatus(FAILED, None, self._why_gone(handle))

    def _ended(self, handle: JobRecord, exit_file: Path) -> JobStatus:
        try:
            rc = int((self.here.get(str(exit_file)) or b"").decode(errors="replace").strip())
        except ValueError:
            rc = 1
        text = self._log_text(handle)
        code = job_exit_code(rc, text, Path(handle.run_dir), handle.extra.get("started"))
        state = state_for_exit(code)
        detail = {PREEMPTED: "checkpointed and stopped; run again with --resume auto to continue",
                  CANCELLED: "stopped by a signal"}.get(state, "")
        if state == FAILED and NO_SPACE in text:
            detail = no_space(handle.run_dir)
        return JobStatus(state, code, detail)

    def _why_gone(self, handle: JobRecord) -> str:
        """The job's wrapper is gone and left no exit code: say why where the run dir shows it."""
        rd = Path(handle.run_dir)
        try:
            fs = os.statvfs(rd)
            full = fs.f_bavail == 0 or (fs.f_favail == 0 and fs.f_files > 0)
        except OSError:
            full = False
        if full or NO_SPACE in self._log_tail(handle):
            return no_space(rd)
        return "the job's process is gone without an exit code (killed with SIGKILL, or the machine restarted?)"

    def _log_tail(self, handle: JobRecord, size: int = 1 << 16) -> str:
        from launcher.backends.tail import read_tail

        tail = read_tail(self.here, handle.log_path or "", size, int(handle.extra.get("log_offset", 0))) or b""
        return tail[-size:].decode(errors="replace")

    # --- which processes are the job's --------------------------------------------------------------
    @staticmethod
    def marker(handle: JobRecord) -> tuple[str, str]:
        """The environment marker every process of the job carries (jobs recorded before the marker
        existed are known by their run dir, which the wrapper's environment names too)."""
        token = handle.extra.get("marker")
        return (procs.MARKER, str(token)) if token else ("LAUNCH4D_RUN_DIR", str(handle.run_dir))

    def _wrapper_alive(self, handle: JobRecord) -> bool:
        pid = handle.extra.get("pid")
        if not pid:
            return False
        ticks = handle.extra.get("start_ticks")
        return procs.is_ours(int(pid), self.marker(handle), int(ticks) if ticks is not None else None)

    def _log_text(self, handle: JobRecord) -> str:
        """This submission's part of node0.log: from its offset to the next submission's header (a run dir
        reused by a resume appends another run after it)."""
        from launcher.backends.tail import read_from

        text = (read_from(self.here, handle.log_path or "", int(handle.extra.get("log_offset") or 0))
                or b"").decode(errors="replace")
        nxt = text.find("\n" + rundir.LOCAL_RUN_HEADER)
        return text if nxt < 0 else text[:nxt + 1]

    def log_iter(self, handle: JobRecord, rank: int | None = None, follow: bool = False, since: int | None = None,
                 stream: str = "out") -> Iterator[str]:
        """Lines of node0.log (this submission's part; stdout and stderr together); with follow,
        until the job ends."""
        lines = (t for t in (filter_rank(ln, rank) for ln in self._lines(handle, follow)) if t is not None)
        return skip_lines(lines, since)

    def _lines(self, handle: JobRecord, follow: bool, poll_s: float = 0.2) -> Iterator[str]:
        """The log through launcher.backends.tail's one loop; a job here is cheap to look at, so
        whether it has ended is asked at every idle poll."""
        from launcher.backends.tail import LogTail

        path = Path(handle.log_path or rundir.RunDir(handle.run_dir).node_log())

        def ended() -> bool:
            st = self.status(handle)
            return st.done or st.state == UNKNOWN

        tail = LogTail(self.here, str(path), int(handle.extra.get("log_offset", 0)), ended=ended, poll_s=poll_s,
                       check_start=0.0, check_cap=0.0)
        return tail.lines(follow)

    # --- cancel -----------------------------------------------------------------------------------
    def workers(self, handle: JobRecord) -> list[int]:
        """The trainer processes: the job's marked processes other than the wrapper and torchrun (its
        child). Found by marker, so trainers in their own sessions or orphaned by torchrun count too."""
        mine = procs.marked(self.marker(handle))
        wrapper = int(handle.extra["pid"])
        agents = set(procs.children([wrapper])) if wrapper in mine else set()
        return [p for p in mine if p != wrapper and p not in agents]

    def cancel(self, handle: JobRecord, force: bool = False) -> bool:
        """SIGTERM the trainers (they checkpoint and exit 75); force: SIGKILL every process of the job.
        Only processes that still carry the job's marker are signalled; False when none is left (the
        job had already ended, its exit code written: cancel is idempotent)."""
        if not handle.extra.get("pid"):
            return False
        st = self.describe(handle)
        if not force and (st is None or st.done):  # its wrapper may still be exiting: nothing to stop
            return False
        wrapper = int(handle.extra["pid"])
        ours = self._wrapper_alive(handle)
        if force:
            if ours:
                try:
                    os.killpg(wrapper, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return bool(procs.kill_marked(self.marker(handle))) or ours
        targets = self.workers(handle)
        if targets:
            return bool(procs.signal_all(targets, signal.SIGTERM))
        if ours:  # not started yet: stop torchrun itself
            try:
                os.killpg(wrapper, signal.SIGTERM)
            except ProcessLookupError:
                return False
            return True
        return False

    def dump_stacks(self, handle: JobRecord, reason: str, py_spy: str | None = None) -> list[int]:
        """Ask every trainer of the job for its Python stacks, into <run_dir>/logs/stacks/rank<R>.txt:
        `py-spy dump` where installed (native frames too), else SIGQUIT, on which the trainer's
        faulthandler writes them. Only pids that carry the job's marker and handle SIGQUIT are signalled
        (its default action would kill). `py_spy`: its path ("" never; default: on PATH or
        beside this Python). The ranks asked."""
        rd = rundir.RunDir(handle.run_dir)
        spy = find_py_spy() if py_spy is None else (py_spy or None)
        asked = []
        for beat in rd.heartbeat_files():
            try:
                rec = json.loads(read_text(beat, "heartbeat", 64 << 10))
                rank, pid, host = int(rec["rank"]), int(rec["pid"]), str(rec.get("host") or "?")
            except (UserError, ValueError, KeyError, TypeError):
                continue
            if not procs.is_ours(pid, self.marker(handle)):
                continue
            head = rundir.stack_header(rank, host, pid, reason)
            try:  # never through a link planted in the run dir (the trainer, writing the same file, stops at it)
                if spy is not None:
                    r = self.here.run([spy, "dump", "--pid", str(pid)], timeout=30, limit=1 << 20)
                    if r.rc == 0 and r.stdout:
                        with nofollow.open_append(rd.root, rd.stack_file(rank)) as f:
                            f.write(head + r.stdout + "\n")
                        asked.append(rank)
                        continue
                if procs.catches(pid, rundir.STACK_SIGNAL):
                    with nofollow.open_append(rd.root, rd.stack_file(rank)) as f:
                        f.write(head)
                    os.kill(pid, rundir.STACK_SIGNAL)
                    asked.append(rank)
            except nofollow.PlantedLinkError:
                continue
        return asked

    def sweep(self, handle: JobRecord) -> list[int]:
        """After the job's end: SIGKILL any of its processes still running (trainers that outlived a
        killed torchrun); the pids that were."""
        return procs.kill_marked(self.marker(handle))
