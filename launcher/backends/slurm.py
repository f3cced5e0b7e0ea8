"""Slurm backend: sbatch here or over SSH (slurm_login), state from squeue, sacct or the job log
(slurm_status), logs, scancel.

Submission writes the rendered script and plan.json into the run dir first (over SSH: into a
remote run dir, written through the SSH channel: no SFTP needed), then runs `sbatch --parsable` there. A refusal (bad
partition, missing sbatch, unreachable login node) leaves no run dir behind.
"""

from __future__ import annotations

import contextlib
import re
import shlex
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.backends import (
    RETRY_BUDGET_S,
    Backend,
    BackendOptions,
    JobStatus,
    Request,
    TransientError,
    filter_rank,
    skip_lines,
    with_retries,
)
from launcher.backends.slurm_login import SSHTarget, open_transport, run, sbatch_error, ssh_target_from
from launcher.backends.slurm_status import (
    LAST_WORDS,
    TRANSIENT,
    SlurmJobStatus,
    job_status,
    log_dir,
    squeue_statuses,
)
from launcher.backends.tail import LogTail
from launcher.errors import UserError
from launcher.formats import rundir
from launcher.formats.jobs import JobRecord
from launcher.transport import Transport

if TYPE_CHECKING:
    from launcher.backends import JobArray
    from launcher.formats.requests import BatchScript
    from launcher.plan.model import Plan
    from launcher.plan.spec import JobSpec


# --- the backend ----------------------------------------------------------------------------
@dataclass(frozen=True)
class SlurmOptions(BackendOptions):
    templates: str | None = None                 # a directory whose templates override ours
    measured_env: dict[str, str] | None = None   # NCCL settings a preflight measured
    preflight_plan: float | None = None          # the in-job gate's tolerance (None: no gate)


class SlurmBackend(Backend):
    name = "slurm"
    Options = SlurmOptions

    def __init__(self, transport_factory: Callable[[SSHTarget | None], Transport] | None = None):
        self._factory = transport_factory or open_transport

    def transport(self, target: SSHTarget | None) -> Transport:
        """Where the Slurm commands run: this machine, or the login node over SSH (the caller closes it)."""
        return self._factory(target)

    # submit -----------------------------------------------------------------------------------
    def dryrun(self, job: JobSpec, plan: Plan, run_dir: str | Path | None = None, *, job_text: str | None = None,
               exclude: list[str] | None = None, node_order: list[str] | None = None, **options: Any) -> Request:
        """The sbatch script (and plan.json, job.yaml) for the run dir and the sbatch command, nothing
        written. Over SSH the run dir is on the login node (<remote_dir>/<run dir's name>); a relative
        remote_dir asks the login node for $HOME, read only."""
        from launcher.formats.files import child_path
        from launcher.render.sbatch import render_slurm, site_options

        opts = self.options(options)
        target = ssh_target_from(job.backend.slurm)
        if run_dir is None:
            run_dir = child_path(Path(job.backend.log_dir).expanduser().resolve(), job.name, "name")
        rd = self._job_dir(job, run_dir, target)
        rendered = render_slurm(job, plan, rd, opts.templates, exclude, opts.measured_env, node_order,
                                preflight_plan=opts.preflight_plan)
        files = dict(rendered.files)
        if job_text is not None:
            files[rundir.JOB] = job_text
        extra: dict[str, Any] = {
            "ssh": asdict(target) if target else None, "remote_dir": rd if target else None,
            "host": target.host if target else None, "gpus_per_node": plan.gpus_per_node, "nodes": plan.nodes,
            "requeue": job.backend.slurm.requeue, "site_flags": {f: path for f, _, path in site_options(job)}}
        return Request(self.name, job.name, rd, f"cd {shlex.quote(rd)} && sbatch --parsable train.sbatch", files,
                       main="train.sbatch", host=target.host if target else None, warnings=rendered.warnings,
                       extra=extra)

    def submit(self, request: Request) -> JobRecord:
        """Write the request's files into a new run dir (here, or on the login node), then sbatch there;
        on any failure the run dir this call created is removed."""
        extra = {k: v for k, v in request.extra.items() if k not in ("site_flags", "dirs")}
        target = SSHTarget(**extra["ssh"]) if extra.get("ssh") else None
        transport = self.transport(target)
        dirs = request.extra.get("dirs") or [rundir.remote(request.run_dir, rundir.LOGS)]
        try:
            job_id = self._sbatch(request.extra.get("site_flags") or {}, transport, target, request.run_dir,
                                  request.files, request.main or "train.sbatch", dirs)
        finally:
            transport.close()
        extra["log_path"] = (f"{extra['log_dir']}/slurm-{job_id}.out" if extra.get("log_dir")
                             else rundir.slurm_log(request.run_dir, job_id))
        logs = extra.get("log_dir") or rundir.remote(request.run_dir, rundir.LOGS)
        return JobRecord(self.name, job_id, request.name, request.run_dir, log_path=extra["log_path"],
                         request=request.text(), log_dir=logs, extra=extra)

    def request(self, what: Any) -> Request:
        """A preflight's batch script (BatchScript) or several plans as one job array (JobArray)."""
        from launcher.backends import JobArray
        from launcher.formats.requests import BatchScript

        if isinstance(what, BatchScript):
            return self._script_request(what)
        if isinstance(what, JobArray):
            return self._array_request(what)
        return super().request(what)

    def _script_request(self, s: BatchScript) -> Request:
        rd = str(Path(s.run_dir).expanduser().resolve())
        return Request(self.name, s.name, rd, f"cd {shlex.quote(rd)} && sbatch --parsable {shlex.quote(s.script_name)}",
                       {s.script_name: s.script, **s.files}, main=s.script_name,
                       extra={"ssh": None, "remote_dir": None, "host": None, "nodes": s.nodes, "requeue": False,
                              "log_dir": rd, "dirs": [rd]})

    def _array_request(self, a: JobArray) -> Request:
        """Task i runs plan i in its own run dir <base>/<names[i]>; its logs are
        <base>/logs/slurm-<job>_<i>.out. Over SSH the base is on the login node (its $HOME asked)."""
        from launcher.render.sbatch import render_slurm_array, site_options

        target = ssh_target_from(a.spec.backend.slurm)
        rd = self._job_dir(a.spec, a.base, target)
        dirs = [f"{rd}/{n}" for n in a.names]
        script, tasks = render_slurm_array(a.spec, a.plans, rd, dirs, a.templates, a.exclude, a.node_order)
        files = {"array.sbatch": script}
        for name, task in zip(a.names, tasks):
            files.update({f"{name}/{f}": text for f, text in task.files.items()})
            if a.job_text is not None:
                files[f"{name}/{rundir.JOB}"] = a.job_text
        logs = rundir.remote(rd, rundir.LOGS)
        extra: dict[str, Any] = {
            "ssh": asdict(target) if target else None, "remote_dir": rd if target else None,
            "host": target.host if target else None, "requeue": a.spec.backend.slurm.requeue, "log_dir": logs,
            "site_flags": {f: path for f, _, path in site_options(a.spec)},
            "dirs": [rundir.remote(d, rundir.LOGS) for d in (rd, *dirs)],
            "array_tasks": [{"name": f"{a.spec.name}[{i}]", "run_dir": d, "gpus_per_node": p.gpus_per_node,
                             "nodes": p.nodes} for i, (p, d) in enumerate(zip(a.plans, dirs))]}
        return Request(self.name, a.spec.name, rd, f"cd {shlex.quote(rd)} && sbatch --parsable array.sbatch", files,
                       main="array.sbatch", host=target.host if target else None, extra=extra)

    def tasks(self, handle: JobRecord) -> list[JobRecord]:
        """A job array's tasks, id "<job>_<i>", which squeue, scancel, status and logs take as they are."""
        tasks = handle.extra.get("array_tasks")
        if not tasks:
            return [handle]
        base = {k: v for k, v in handle.extra.items() if k not in ("array_tasks", "log_path", "remote_dir")}
        out = []
        for i, t in enumerate(tasks):
            extra = {**base, "remote_dir": t["run_dir"] if base.get("ssh") else None,
                     "gpus_per_node": t["gpus_per_node"], "nodes": t["nodes"], "array_job": handle.id,
                     "array_task": i, "log_path": rundir.slurm_log(handle.run_dir, handle.id, i)}
            out.append(JobRecord(self.name, f"{handle.id}_{i}", t["name"], t["run_dir"], log_path=extra["log_path"],
                                 request=handle.request, log_dir=handle.log_dir, extra=extra))
        return out

    def _sbatch(self, site_flags: dict[str, str], transport, target: SSHTarget | None, rd: str,
                files: dict[str, str], script: str, dirs: list[str]) -> str:
        """Write `files` under the new run dir `rd` (creating `dirs` first: the logs/ folders), run sbatch
        on `script` there, and return the job id; on any failure nothing of it is left behind."""
        if not transport.which("sbatch"):
            where = f"on login node {target.host}" if target else "on PATH"
            hint = "" if target else " (install Slurm's client commands, or set backend.slurm.login_host)"
            raise UserError(f"sbatch not found {where}{hint}")
        if transport.exists(rd):
            raise UserError(f"run dir {rd} already exists{' on ' + target.host if target else ''}; "
                            "pick another directory")
        try:
            for d in dirs:
                transport.makedirs(d)
            for name, text in sorted(files.items()):
                transport.put(f"{rd}/{name}", text, 0o755 if name.endswith(".sbatch") else 0o644)
            rc, out, err = run(transport, ["sbatch", "--parsable", script], cwd=rd)
            if rc != 0:
                raise UserError(refusal(site_flags, err or out))
            job_id = out.strip().splitlines()[-1].split(";")[0].strip() if out.strip() else ""
            if not job_id.isdigit():
                raise UserError(f"sbatch printed no job id (stdout {out.strip()!r}, stderr {err.strip()!r})")
        except BaseException:
            transport.remove_tree(rd)
            raise
        return job_id

    def _job_dir(self, spec: JobSpec, run_dir: str | Path, target: SSHTarget | None, transport=None) -> str:
        """Here: the run dir itself (absolute). Over SSH: <remote_dir>/<run dir's name> on the login
        node, remote_dir defaulting to ~/launch4d-runs (its $HOME asked for when relative)."""
        if target is None:
            return str(Path(run_dir).expanduser().resolve())
        base = spec.backend.slurm.remote_dir or "launch4d-runs"
        if not base.startswith("/"):
            own = transport is None
            transport = transport or self.transport(target)
            try:
                home = transport.home()
            finally:
                if own:
                    transport.close()
            base = f"{home.rstrip('/')}/{base.removeprefix('~/')}"
        return f"{base.rstrip('/')}/{Path(run_dir).name}"

    # status -----------------------------------------------------------------------------------
    def status(self, handle: JobRecord) -> SlurmJobStatus:
        """The job's state now. Raises TransientError when the controller does not answer."""
        transport = self.transport(ssh_target_from(handle))
        try:
            return job_status(transport, handle)
        finally:
            transport.close()

    def describe(self, handle: JobRecord) -> SlurmJobStatus | None:
        """status(), or None when neither squeue, sacct nor a job log knows the job."""
        st = self.status(handle)
        return None if st.source == "none" else st

    @contextlib.contextmanager
    def watching(self) -> Iterator[Callable[[JobRecord], SlurmJobStatus | None]]:
        """describe() over one transport per login host, opened at the first look (so a login node
        that cannot be reached yet is retried like any look) and closed at the end: `status --wait`
        over SSH does not log in again at every poll. A connection that breaks meanwhile is made again
        by the transport itself (launcher.transport.ssh forgets a broken client)."""
        held: dict[str | None, Transport] = {}

        def describe(handle: JobRecord) -> SlurmJobStatus | None:
            target = ssh_target_from(handle)
            key = target.where if target else None
            if key not in held:
                held[key] = self.transport(target)
            st = job_status(held[key], handle)
            return None if st.source == "none" else st

        try:
            yield describe
        finally:
            for t in held.values():
                t.close()

    def statuses(self, handles: list[JobRecord]) -> dict[str, JobStatus]:
        """Many jobs at once: one squeue per login host for all of them; sacct or the job log only
        for those squeue has forgotten. Raises TransientError when a controller does not answer."""
        out: dict[str, JobStatus] = {}
        by_host: dict[str | None, list[JobRecord]] = {}
        for h in handles:
            by_host.setdefault((h.extra.get("ssh") or {}).get("host"), []).append(h)
        for group in by_host.values():
            transport = self.transport(ssh_target_from(group[0]))
            try:
                out.update(squeue_statuses(transport, group))
            finally:
                transport.close()
        return out

    # logs -------------------------------------------------------------------------------------
    def log_iter(self, handle: JobRecord, rank: int | None = None, follow: bool = False, since: int | None = None,
                 stream: str = "out") -> Iterator[str]:
        return skip_lines(self.logs(handle, follow, rank, stream, on_retry=self.on_retry), since)

    def logs(self, handle: JobRecord, follow: bool = False, rank: int | None = None, stream: str = "out",
             poll_s: float = 1.0, timeout_s: float | None = None, budget_s: float = RETRY_BUDGET_S,
             on_retry: Callable[[TransientError, float, int], None] | None = None) -> Iterator[str]:
        """Lines of slurm-<id>.out (or .err); with `rank`, only that global rank's trainer lines.

        Following reads the file every `poll_s` but asks the scheduler whether the job has ended
        only when the log is idle, every 2, 4, 8 ... 60 s (at once when the script writes its last
        words), tolerating a controller that is away for up to `budget_s`."""
        transport = self.transport(ssh_target_from(handle))
        path = f"{log_dir(handle)}/slurm-{handle.id}.{stream}"
        tail = LogTail(transport, path, ended=lambda: job_status(transport, handle).done, last_words=LAST_WORDS,
                       poll_s=poll_s, budget_s=budget_s, on_retry=on_retry)
        try:
            yield from ranked(tail.lines(follow, timeout_s), rank)
            if tail.offset == 0 and not follow:
                raise UserError(f"no log yet at {path}" + (f" on {transport.host}" if transport.host else "")
                                + " (is the job still pending?)")
        finally:
            transport.close()

    # cancel -----------------------------------------------------------------------------------
    def cancel(self, handle: JobRecord, force: bool = False) -> bool:
        """scancel the job (it ends every step's processes: `force` changes nothing). Idempotent: a job
        that has already ended is left alone (False)."""
        transport = self.transport(ssh_target_from(handle))
        try:
            before = with_retries(lambda: job_status(transport, handle))
            if before.done:
                return False
            rc, out, err = run(transport, ["scancel", handle.id])
            if rc != 0:
                text = (err or out).strip()
                if re.search(r"already completing or completed|Invalid job id specified", text):
                    return False
                if TRANSIENT.search(text):
                    raise TransientError(f"scancel {handle.id}: Slurm controller not answering ({text})")
                raise UserError(f"scancel {handle.id} failed: {text}")
            return True
        finally:
            transport.close()


def ranked(lines: Iterable[str], rank: int | None) -> Iterator[str]:
    """The lines (all, or with `rank` that rank's text only: filter_rank)."""
    for line in lines:
        text = filter_rank(line, rank)
        if text is not None:
            yield text


UNKNOWN_OPTION = re.compile(r"unrecognized option '(--[^=' ]+)")


def refusal(site_flags: dict[str, str], text: str) -> str:
    """sbatch's refusal as one line; an option the installed sbatch does not know is named with
    the job-file field it came from (`site_flags`: flag -> field; the installed sbatch is the judge
    of what it accepts)."""
    m = UNKNOWN_OPTION.search(text)
    if m:
        flag = m.group(1)
        path = site_flags.get(flag)
        if path:
            hint = "; --segment comes with the topology/block plugin of newer Slurm" if flag == "--segment" else ""
            return f"{path}: the installed sbatch does not accept {flag} (see `sbatch --help`{hint})"
    return "sbatch refused the job: " + sbatch_error(text)
