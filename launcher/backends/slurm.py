"""Slurm backend: sbatch here or over SSH (launcher.transport), squeue with sacct fallback, logs, scancel.

Submission writes the rendered script and plan.json into the run dir first (over SSH: into a
remote run dir, written through the SSH channel: no SFTP needed), then runs `sbatch --parsable` there. A refusal (bad
partition, missing sbatch, unreachable login node) leaves no run dir behind. State comes from
`squeue` (always there), then `sacct` (only where accounting answers), then the job's own log
(the batch script prints its step's exit code), so small clusters without slurmdbd still work.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.backends import (
    CANCELLED,
    FAILED,
    PENDING,
    PREEMPTED,
    RETRY_BUDGET_S,
    RUNNING,
    SUCCEEDED,
    TERMINAL,
    UNKNOWN,
    Backend,
    BackendOptions,
    JobStatus,
    Request,
    TransientError,
    filter_rank,
    skip_lines,
    with_retries,
)
from launcher.backends.tail import LogTail, read_tail
from launcher.errors import UserError
from launcher.formats import rundir
from launcher.formats.jobs import JobRecord
from launcher.transport import ConnectError, Transport, over_limit
from launcher.transport.local import LocalTransport

if TYPE_CHECKING:
    from launcher.backends import JobArray
    from launcher.formats.requests import BatchScript
    from launcher.plan.model import Plan
    from launcher.plan.spec import JobSpec

# Every Slurm job state (squeue long names; sacct may append "+" or " by <uid>") -> shared state.
SLURM_STATES: dict[str, str] = {
    "PENDING": PENDING, "CONFIGURING": PENDING, "REQUEUED": PENDING, "REQUEUE_FED": PENDING,
    "REQUEUE_HOLD": PENDING, "RESV_DEL_HOLD": PENDING, "SPECIAL_EXIT": PENDING,
    "RUNNING": RUNNING, "COMPLETING": RUNNING, "RESIZING": RUNNING, "SIGNALING": RUNNING,
    "STAGE_OUT": RUNNING, "SUSPENDED": RUNNING, "STOPPED": RUNNING,
    "PREEMPTED": PREEMPTED,
    "COMPLETED": SUCCEEDED,
    "FAILED": FAILED, "BOOT_FAIL": FAILED, "NODE_FAIL": FAILED, "OUT_OF_MEMORY": FAILED,
    "TIMEOUT": FAILED, "DEADLINE": FAILED, "REVOKED": FAILED,
    "CANCELLED": CANCELLED,
}
SHORT_STATES = {"PD": "PENDING", "CF": "CONFIGURING", "RQ": "REQUEUED", "RF": "REQUEUE_FED",
                "RH": "REQUEUE_HOLD", "RD": "RESV_DEL_HOLD", "SE": "SPECIAL_EXIT", "R": "RUNNING",
                "CG": "COMPLETING", "RS": "RESIZING", "SI": "SIGNALING", "SO": "STAGE_OUT",
                "S": "SUSPENDED", "ST": "STOPPED", "PR": "PREEMPTED", "CD": "COMPLETED", "F": "FAILED",
                "BF": "BOOT_FAIL", "NF": "NODE_FAIL", "OOM": "OUT_OF_MEMORY", "TO": "TIMEOUT",
                "DL": "DEADLINE", "RV": "REVOKED", "CA": "CANCELLED"}
STEP_DONE = re.compile(r"launch4d: step finished with exit code (\d+)")


def LAST_WORDS(chunk: bytes) -> bool:  # noqa: N802 - a constant predicate
    """The batch script's words at a step's end, a requeue or a node left out: ask squeue at once."""
    return b"launch4d: step finished" in chunk or b"launch4d: requeueing" in chunk or b"left out:" in chunk
# What Slurm's client commands print when the controller (or the network to it) is away for a moment.
TRANSIENT = re.compile(r"Unable to contact slurm controller|Socket timed out|Connection refused|"
                       r"Connection timed out|Zero Bytes were transmitted|Communication connection failure|"
                       r"Resource temporarily unavailable|Transport endpoint is not connected", re.I)
NO_ACCOUNTING = re.compile(r"accounting storage is disabled|Problem talking to the database|"
                           r"slurmdbd.*(not|n't) (running|responding)", re.I)
#: What status asks sacct for, when this sacct knows the field (Restarts is missing on 22.05).
SACCT_WANTED = ("JobID", "State", "ExitCode", "NodeList", "Elapsed", "Restarts")
#: squeue's fields (one-letter -o codes exist on every Slurm release we meet).
SQUEUE_FORMAT = "%i|%T|%r|%N|%M"
# Per login host: the fields this sacct has (None: no accounting) and why not (probed once).
_SACCT_FIELDS: dict[str | None, tuple[frozenset[str] | None, str]] = {}


def normalize_state(raw: str) -> str:
    """'CANCELLED by 0', 'CANCELLED+', 'CD' -> the long state name ('UNKNOWN' if unrecognised)."""
    s = raw.strip().split()[0].rstrip("+") if raw.strip() else ""
    s = SHORT_STATES.get(s, s)
    return s if s in SLURM_STATES else "UNKNOWN"


def state_of(slurm_state: str) -> str:
    """A Slurm state as one of the shared states (launcher.backends)."""
    return SLURM_STATES.get(slurm_state, UNKNOWN)


@dataclass
class SlurmJobStatus(JobStatus):
    """The shared JobStatus plus what Slurm said, and where the answer came from."""

    slurm_state: str = "UNKNOWN"
    source: str = "squeue"
    nodes: str | None = None
    elapsed: str | None = None
    restarts: int | None = None
    requeue: bool = True

    @property
    def done(self) -> bool:
        # A preempted job with --requeue comes back (submitit#1770: not a failure).
        if self.state == PREEMPTED and self.requeue:
            return False
        return self.state in TERMINAL

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "done": self.done}


# --- where commands run: launcher.transport (this machine, or the login node over SSH) -----------
@dataclass
class SSHTarget:
    """The login node, as the job file names it (kept in the job record for later commands)."""

    host: str
    user: str | None = None
    port: int = 22
    identity_file: str | None = None
    known_hosts: str | None = None
    accept_unknown_host: bool = False
    timeout_s: int = 15

    @property
    def where(self) -> str:
        return f"{self.user + '@' if self.user else ''}{self.host}:{self.port}"


def open_transport(target: SSHTarget | None) -> Transport:
    """This machine, or a connection to the login node (host keys checked: an unknown one is
    refused unless backend.slurm.accept_unknown_host, which records it in known_hosts)."""
    if target is None:
        return LocalTransport()
    from launcher.transport.ssh import SSHOptions, connect

    if target.known_hosts and not os.path.exists(os.path.expanduser(target.known_hosts)):
        raise UserError(f"backend.slurm.known_hosts: {os.path.expanduser(target.known_hosts)} does not exist")
    opts = SSHOptions(user=target.user, port=target.port, identity_file=target.identity_file,
                      known_hosts=target.known_hosts, accept_new_hosts=target.accept_unknown_host,
                      connect_timeout=target.timeout_s)
    try:
        return connect(target.host, opts)
    except ConnectError as exc:
        if exc.kind == "unknown-host-key":
            raise UserError(f"login node {target.where}: host key is not in known_hosts; add it (ssh-keyscan) "
                            "or set backend.slurm.accept_unknown_host: true") from None
        if exc.transient:
            raise TransientError(f"cannot reach login node {target.where} ({exc})") from None
        raise UserError(f"login node {target.where}: {exc}") from None


def run(t: Transport, argv: list[str], cwd: str | None = None, timeout: float = 60) -> tuple[int, str, str]:
    """One Slurm client command: (rc, stdout, stderr). Raises TransientError when it (or the login
    node) does not answer, UserError when the command is not there."""
    try:
        c = t.run(argv, cwd=cwd, timeout=timeout)
    except ConnectError as exc:
        if exc.transient:
            raise TransientError(f"login node {t.host}: {' '.join(argv[:2])} failed ({exc})") from None
        raise
    if c.timed_out:
        raise TransientError(f"{argv[0]} did not answer within {timeout:.0f}s"
                             + (f" on login node {t.host}" if t.host else "")) from None
    if c.flooded or c.rc is None:
        raise UserError(f"{' '.join(argv[:2])}: {over_limit()}")
    if c.rc == 127 and "not found" in c.stderr:
        if t.host:
            raise UserError(f"{argv[0]} not found on login node {t.host}")
        raise UserError(f"{argv[0]} not found on PATH: install Slurm's client commands here, or set "
                        "backend.slurm.login_host to submit over SSH")
    return c.rc, c.stdout, c.stderr


def ssh_target_from(record_or_spec: Any) -> SSHTarget | None:
    """From a SlurmSpec (submit) or a JobRecord's extra (later commands)."""
    if hasattr(record_or_spec, "login_host"):
        s = record_or_spec
        if not s.login_host:
            return None
        return SSHTarget(s.login_host, s.login_user, s.login_port, s.identity_file, s.known_hosts,
                         s.accept_unknown_host, s.ssh_timeout_s)
    ssh = (record_or_spec.extra or {}).get("ssh")
    return SSHTarget(**ssh) if ssh else None


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
            return self._status(transport, handle)
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
            st = self._status(held[key], handle)
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
                ids = ",".join(h.id for h in group)
                rc, text, err = run(transport, ["squeue", "-h", "-r", "-t", "all", "-j", ids, "-o", SQUEUE_FORMAT])
                if rc != 0 and TRANSIENT.search(err or text):
                    raise TransientError(f"Slurm controller not answering ({sbatch_error(err or text)})")
                rows = {ln.split("|")[0].strip(): ln.split("|") for ln in text.splitlines() if "|" in ln}
                for h in group:
                    row = rows.get(h.id)
                    if row and len(row) >= 5:
                        st = normalize_state(row[1])
                        out[h.id] = SlurmJobStatus(state_of(st), None, row[2] if row[2] not in ("None", "") else "",
                                                   slurm_state=st, source="squeue", nodes=row[3] or None,
                                                   elapsed=row[4] or None,
                                                   requeue=bool(h.extra.get("requeue", True)))
                    else:
                        out[h.id] = self._status(transport, h)
            finally:
                transport.close()
        return out

    def _status(self, transport, handle: JobRecord) -> SlurmJobStatus:
        requeue = bool(handle.extra.get("requeue", True))
        rc, out, err = run(transport, ["squeue", "-h", "-r", "-t", "all", "-j", handle.id, "-o", SQUEUE_FORMAT])
        if rc != 0 and TRANSIENT.search(err or out):
            raise TransientError(f"Slurm controller not answering ({sbatch_error(err or out)})")
        line = next((ln for ln in out.splitlines() if ln.split("|")[0].strip() == handle.id), None)
        if rc == 0 and line:
            _, state, reason, nodes, elapsed = (line.split("|") + [""] * 5)[:5]
            st = normalize_state(state)
            job = self._scontrol_job(transport, handle.id)
            detail = reason if reason not in ("None", "") else ""
            left_out = self._left_out(transport, handle, job.get("ExcNodeList")) if st == "PENDING" else ""
            if left_out:
                detail = f"{detail}; {left_out}" if detail else left_out
            restarts = job.get("Restarts")
            return SlurmJobStatus(state_of(st), None, detail, slurm_state=st, source="squeue", nodes=nodes or None,
                                  elapsed=elapsed or None, restarts=int(restarts) if restarts and restarts.isdigit()
                                  else None, requeue=requeue)
        fields, why = sacct_fields(transport)
        if fields is None:
            return self._status_from_log(transport, handle, f"no Slurm accounting here ({why}): squeue/scontrol "
                                         "and the job log only", requeue)
        cols = [f for f in SACCT_WANTED if f in fields]
        rc, out, err = _optional(transport, ["sacct", "-n", "-P", "-X", "-j", handle.id, "-o", ",".join(cols)])
        if rc != 0 and TRANSIENT.search(err or out):
            raise TransientError(f"sacct not answering ({sbatch_error(err or out)})")
        rows = [dict(zip(cols, ln.split("|"))) for ln in out.splitlines() if ln.strip()] if rc == 0 else []
        rows = [r for r in rows if r.get("JobID", "").split(".")[0].split("+")[0] == handle.id]
        if rows:
            r = rows[-1]
            st = normalize_state(r.get("State", ""))
            code = r.get("ExitCode", "").split(":")[0]
            restarts = r.get("Restarts", "")
            detail = self._check_failure(transport, handle) if st == "FAILED" and code == "3" else ""
            return SlurmJobStatus(state_of(st), int(code) if code.isdigit() else None, detail,
                                  slurm_state=st, source="sacct", nodes=r.get("NodeList") or None,
                                  elapsed=r.get("Elapsed") or None,
                                  restarts=int(restarts) if restarts.isdigit() else None, requeue=requeue)
        note = f"sacct: {sbatch_error(err)}" if rc != 0 else "sacct: no record"
        return self._status_from_log(transport, handle, note, requeue)

    def _scontrol_job(self, transport, job_id: str) -> dict[str, str]:
        """`scontrol show job` as key=value pairs (Restarts, ExcNodeList, ...); {} when it cannot say."""
        rc, out, _ = _optional(transport, ["scontrol", "show", "job", job_id])
        if rc != 0:
            return {}
        return {m[1]: m[2] for m in re.finditer(r"(?:^|\s)([A-Za-z][A-Za-z:/]*)=(\S*)", out)}

    def _left_out(self, transport, handle: JobRecord, exc: str | None) -> str:
        """For a pending job: the nodes the node check left out, and why (from logs/nodecheck.log)."""
        if not exc or exc == "(null)":
            return ""
        text = (transport.get(rundir.remote(handle.run_dir, rundir.NODECHECK_LOG), 0) or b"").decode(errors="replace")
        why: dict[str, str] = {}
        for m in re.finditer(r": (\S+) left out: (.*)$", text, re.M):
            why[m.group(1)] = m.group(2)
        nodes = [n for n in exc.split(",") if n in why]
        return "; ".join(f"left out {n} (node check: {why[n]})" for n in nodes)

    def _check_failure(self, transport, handle: JobRecord) -> str:
        """For a job that ended with exit 3: what the node check said (which check failed on which node,
        a tool missing everywhere, too few nodes left), or the link planted in its run dir that stopped it,
        from the job's own output."""
        base = f"{log_dir(handle)}/slurm-{handle.id}"
        out = (read_tail(transport, base + ".out") or b"").decode(errors="replace")
        said = [ln[len("launch4d: "):] for ln in out.splitlines() if ln.startswith("launch4d: node check")]
        if not said:
            err = (read_tail(transport, base + ".err") or b"").decode(errors="replace")
            said = [ln[len("launch4d: "):] for ln in err.splitlines()
                    if ln.startswith("launch4d: ") and "symbolic link" in ln]
        return "; ".join(said[-4:]) + (f" (+{len(said) - 4} more)" if len(said) > 4 else "")

    def _status_from_log(self, transport, handle: JobRecord, sacct_note: str, requeue: bool) -> SlurmJobStatus:
        """Neither squeue nor sacct knows the job: read the batch script's own last words."""
        base = f"{log_dir(handle)}/slurm-{handle.id}"
        out = (read_tail(transport, base + ".out") or b"").decode(errors="replace")
        err = (read_tail(transport, base + ".err") or b"").decode(errors="replace")
        note = f"not in squeue; {sacct_note}"
        done = STEP_DONE.findall(out)
        if done and out.rfind("launch4d: step finished") > out.rfind("launch4d: requeueing"):
            code = int(done[-1])
            st = "COMPLETED" if code == 0 else "FAILED"
            check = self._check_failure(transport, handle) if code == 3 else ""
            return SlurmJobStatus(state_of(st), code, f"{check}; {note}" if check else note, slurm_state=st,
                                  source="job log", requeue=requeue)
        if "CANCELLED AT" in out + err:
            return SlurmJobStatus(CANCELLED, None, note, slurm_state="CANCELLED", source="job log",
                                  requeue=requeue)
        return SlurmJobStatus(UNKNOWN, None, note, slurm_state="UNKNOWN", source="none", requeue=requeue)

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
        tail = LogTail(transport, path, ended=lambda: self._status(transport, handle).done, last_words=LAST_WORDS,
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
            before = with_retries(lambda: self._status(transport, handle))
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


def sacct_fields(transport) -> tuple[frozenset[str] | None, str]:
    """The fields this sacct knows (`sacct --helpformat`, asked once per login host), or None and
    why where there is no accounting (no slurmdbd: sacct refuses every query) or no sacct."""
    key = transport.host
    if key not in _SACCT_FIELDS:
        rc, out, err = _optional(transport, ["sacct", "--helpformat"])
        if rc == 0 and out.split():
            _SACCT_FIELDS[key] = (frozenset(out.split()), "")
        elif TRANSIENT.search(err or out) and not NO_ACCOUNTING.search(err or out):
            raise TransientError(f"sacct not answering ({sbatch_error(err or out)})")
        else:
            _SACCT_FIELDS[key] = (None, sbatch_error(err or out))
    return _SACCT_FIELDS[key]


def log_dir(handle: JobRecord) -> str:
    """Where Slurm writes the job's output: <run dir>/logs, or an array's <base>/logs."""
    return handle.extra.get("log_dir") or rundir.remote(handle.run_dir, rundir.LOGS)


def _optional(transport: Transport, argv: list[str]) -> tuple[int, str, str]:
    """A command that may be missing on this cluster (sacct without accounting tools): no answer."""
    try:
        return run(transport, argv)
    except UserError as exc:
        return 127, "", str(exc)


def ranked(lines: Iterable[str], rank: int | None) -> Iterator[str]:
    """The lines (all, or with `rank` that rank's text only: filter_rank)."""
    for line in lines:
        text = filter_rank(line, rank)
        if text is not None:
            yield text


def sbatch_error(text: str) -> str:
    """sbatch's own words, on one line: 'sbatch: error: invalid partition specified: x'."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    errs = [ln.split("error:", 1)[1].strip() if "error:" in ln else ln.removeprefix("sbatch: ")
            for ln in lines if "error:" in ln or "unrecognized option" in ln or "invalid option" in ln]
    return "; ".join(errs or lines[-1:]) or "no message"


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
