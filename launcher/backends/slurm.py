"""Slurm backend: sbatch here or over SSH (paramiko), squeue with sacct fallback, logs, scancel.

Submission writes the rendered script and plan.json into the run dir first (over SSH: into a
remote run dir, written through the SSH channel: no SFTP needed), then runs `sbatch --parsable` there. A refusal (bad
partition, missing sbatch, unreachable login node) leaves no run dir behind. State comes from
`squeue` (always there), then `sacct` (only where accounting answers), then the job's own log
(the batch script prints its step's exit code), so small clusters without slurmdbd still work.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.backends import (
    CANCELLED,
    FAILED,
    PENDING,
    PREEMPTED,
    RUNNING,
    SUCCEEDED,
    TERMINAL,
    UNKNOWN,
    JobHandle,
    JobStatus,
)
from launcher.errors import UserError

if TYPE_CHECKING:
    from launcher.plan import Plan
    from launcher.spec import JobSpec

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
RANK_LINE = re.compile(r"^(?:\d+: )?\[rank(\d+)\]: ?(.*)$")


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


# --- where commands run ---------------------------------------------------------------------
class LocalRunner:
    """Slurm's client commands on this machine."""

    host: str | None = None

    def run(self, argv: list[str], cwd: str | None = None, timeout: float = 60) -> tuple[int, str, str]:
        try:
            p = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout)
        except FileNotFoundError:
            raise UserError(f"{argv[0]} not found on PATH: install Slurm's client commands here, or set "
                            "backend.slurm.login_host to submit over SSH") from None
        except subprocess.TimeoutExpired:
            raise UserError(f"{argv[0]} did not answer within {timeout:.0f}s") from None
        return p.returncode, p.stdout, p.stderr

    def which(self, name: str) -> bool:
        return shutil.which(name) is not None

    def home(self) -> str:
        return str(Path.home())

    def exists(self, path: str) -> bool:
        return Path(path).exists()

    def makedirs(self, path: str) -> None:
        Path(path, "logs").mkdir(parents=True, exist_ok=True)

    def write(self, path: str, data: str, mode: int = 0o644) -> None:
        tmp = Path(path + ".tmp")
        tmp.write_text(data)
        tmp.chmod(mode)
        tmp.replace(path)

    def read_from(self, path: str, offset: int) -> bytes | None:
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                return f.read()
        except FileNotFoundError:
            return None

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        pass


@dataclass
class SSHTarget:
    host: str
    user: str | None = None
    port: int = 22
    identity_file: str | None = None
    known_hosts: str | None = None
    accept_unknown_host: bool = False
    timeout_s: int = 15


class SSHRunner:
    """The same operations on the login node, over paramiko (host keys checked)."""

    def __init__(self, target: SSHTarget):
        import paramiko

        self.target = target
        self.host = target.host
        client = paramiko.SSHClient()
        client.load_system_host_keys()
        if target.known_hosts:
            kh = os.path.expanduser(target.known_hosts)
            if not os.path.exists(kh):
                raise UserError(f"backend.slurm.known_hosts: {kh} does not exist")
            client.load_host_keys(kh)
        client.set_missing_host_key_policy(paramiko.AutoAddPolicy() if target.accept_unknown_host
                                           else paramiko.RejectPolicy())
        where = f"{target.user + '@' if target.user else ''}{target.host}:{target.port}"
        try:
            client.connect(target.host, port=target.port, username=target.user,
                           key_filename=os.path.expanduser(target.identity_file) if target.identity_file else None,
                           timeout=target.timeout_s, banner_timeout=target.timeout_s,
                           auth_timeout=target.timeout_s, allow_agent=True, look_for_keys=True)
        except paramiko.SSHException as exc:
            if "not found in known_hosts" in str(exc):
                raise UserError(f"login node {where}: host key is not in known_hosts; add it (ssh-keyscan) "
                                "or set backend.slurm.accept_unknown_host: true") from None
            raise UserError(f"login node {where}: SSH failed ({exc})") from None
        except OSError as exc:
            raise UserError(f"cannot reach login node {where}: {exc.strerror or exc}") from None
        self.client = client

    def run(self, argv: list[str], cwd: str | None = None, timeout: float = 60,
            stdin: bytes | None = None) -> tuple[int, str, str]:
        """One command through the login shell (argv quoted); no SFTP needed, which some sites disable."""
        cmd = " ".join(shlex.quote(a) for a in argv)
        if cwd:
            cmd = f"cd {shlex.quote(cwd)} && {cmd}"
        try:
            sin, out, err = self.client.exec_command(cmd, timeout=timeout)
            if stdin is not None:
                sin.write(stdin)
                sin.channel.shutdown_write()
            stdout = out.read().decode(errors="replace")
            stderr = err.read().decode(errors="replace")
            rc = out.channel.recv_exit_status()
        except OSError as exc:  # socket.timeout and paramiko's SSHException are both here
            raise UserError(f"login node {self.host}: {' '.join(argv[:2])} failed ({exc})") from None
        if rc == 127 and "not found" in stderr:
            raise UserError(f"{argv[0]} not found on login node {self.host}")
        return rc, stdout, stderr

    def which(self, name: str) -> bool:
        return self.run(["sh", "-c", 'command -v "$1"', "sh", name])[0] == 0

    def home(self) -> str:
        return self.run(["sh", "-c", 'printf %s "$HOME"'])[1].strip()

    def exists(self, path: str) -> bool:
        return self.run(["test", "-e", path])[0] == 0

    def makedirs(self, path: str) -> None:
        rc, _, err = self.run(["mkdir", "-p", path + "/logs"])
        if rc:
            raise UserError(f"cannot create {path} on {self.host}: {err.strip()}")

    def write(self, path: str, data: str, mode: int = 0o644) -> None:
        rc, _, err = self.run(["sh", "-c", 'cat > "$1.tmp" && chmod "$2" "$1.tmp" && mv "$1.tmp" "$1"',
                               "sh", path, f"{mode:o}"], stdin=data.encode())
        if rc:
            raise UserError(f"cannot write {path} on {self.host}: {err.strip()}")

    def read_from(self, path: str, offset: int) -> bytes | None:
        rc, out, _ = self.run(["sh", "-c", 'test -f "$1" && tail -c +"$2" "$1"', "sh", path, str(offset + 1)])
        return out.encode() if rc == 0 else None

    def remove_tree(self, path: str) -> None:
        self.run(["rm", "-rf", "--", path])

    def close(self) -> None:
        self.client.close()


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
class SlurmBackend:
    name = "slurm"

    def __init__(self, runner_factory: Callable[[SSHTarget | None], Any] | None = None):
        self._factory = runner_factory or (lambda t: SSHRunner(t) if t else LocalRunner())

    def runner(self, target: SSHTarget | None):
        return self._factory(target)

    # submit -----------------------------------------------------------------------------------
    def submit(self, spec: JobSpec, plan: Plan, run_dir: str | Path, dry_run: bool = False,
               templates: str | None = None, exclude: list[str] | None = None,
               measured_env: dict[str, str] | None = None, job_text: str | None = None,
               **options: Any) -> JobHandle:
        """Render into the run dir (here, or a remote one on the login node), then sbatch there.

        Nothing is written for a dry run; on any failure the run dir this call created is removed."""
        from launcher.render import render_slurm

        target = ssh_target_from(spec.backend.slurm)
        runner = self.runner(target) if (target or not dry_run) else None
        created = None
        try:
            rd = self._job_dir(spec, run_dir, target, runner)
            rendered = render_slurm(spec, plan, rd, templates, exclude, measured_env)
            files = dict(rendered.files)
            if job_text is not None:
                files["job.yaml"] = job_text
            command = f"cd {shlex.quote(rd)} && sbatch --parsable train.sbatch"
            extra = {"ssh": asdict(target) if target else None, "remote_dir": rd if target else None,
                     "host": target.host if target else None, "gpus_per_node": plan.gpus_per_node,
                     "nodes": plan.nodes, "requeue": spec.backend.slurm.requeue,
                     "log_path": f"{rd}/logs/slurm-%j.out"}
            request = f"{command}{' (on ' + target.host + ')' if target else ''}\n\n{files['train.sbatch']}"
            if dry_run:
                return JobHandle(self.name, "dry-run", spec.name, rd, dry_run=True, request=request, extra=extra)
            if not runner.which("sbatch"):
                where = f"on login node {target.host}" if target else "on PATH"
                hint = "" if target else " (install Slurm's client commands, or set backend.slurm.login_host)"
                raise UserError(f"sbatch not found {where}{hint}")
            if runner.exists(rd):
                raise UserError(f"run dir {rd} already exists{' on ' + target.host if target else ''}; "
                                "pick another --run-dir")
            runner.makedirs(rd)
            created = rd
            for name, text in sorted(files.items()):
                runner.write(f"{rd}/{name}", text, 0o755 if name.endswith(".sbatch") else 0o644)
            rc, out, err = runner.run(["sbatch", "--parsable", "train.sbatch"], cwd=rd)
            if rc != 0:
                raise UserError("sbatch refused the job: " + sbatch_error(err or out))
            job_id = out.strip().splitlines()[-1].split(";")[0].strip() if out.strip() else ""
            if not job_id.isdigit():
                raise UserError(f"sbatch printed no job id (stdout {out.strip()!r}, stderr {err.strip()!r})")
            created = None  # the job owns it now
            extra["log_path"] = f"{rd}/logs/slurm-{job_id}.out"
            return JobHandle(self.name, job_id, spec.name, rd, log_path=extra["log_path"], request=request,
                             extra=extra)
        finally:
            if runner is not None:
                if created:
                    runner.remove_tree(created)
                runner.close()

    def _job_dir(self, spec: JobSpec, run_dir: str | Path, target: SSHTarget | None, runner) -> str:
        """Here: the run dir itself (absolute). Over SSH: <remote_dir>/<run dir's name> on the login
        node, remote_dir defaulting to ~/launch4d-runs."""
        if target is None:
            return str(Path(run_dir).expanduser().resolve())
        base = spec.backend.slurm.remote_dir or "launch4d-runs"
        if not base.startswith("/"):
            base = f"{runner.home().rstrip('/')}/{base.removeprefix('~/')}"
        return f"{base.rstrip('/')}/{Path(run_dir).name}"

    # status -----------------------------------------------------------------------------------
    def status(self, handle: JobHandle) -> SlurmJobStatus:
        runner = self.runner(ssh_target_from(handle))
        try:
            return self._status(runner, handle)
        finally:
            runner.close()

    def _status(self, runner, handle: JobHandle) -> SlurmJobStatus:
        requeue = bool(handle.extra.get("requeue", True))
        rc, out, err = runner.run(["squeue", "-h", "-t", "all", "-j", handle.id, "-o", "%i|%T|%r|%N|%M"])
        line = next((ln for ln in out.splitlines() if ln.split("|")[0].strip() == handle.id), None)
        if rc == 0 and line:
            _, state, reason, nodes, elapsed = (line.split("|") + [""] * 5)[:5]
            st = normalize_state(state)
            return SlurmJobStatus(state_of(st), None, reason if reason not in ("None", "") else "",
                                  slurm_state=st, source="squeue", nodes=nodes or None, elapsed=elapsed or None,
                                  restarts=self._restarts(runner, handle.id), requeue=requeue)
        rc, out, err = _optional(runner, ["sacct", "-n", "-P", "-X", "-j", handle.id,
                                          "-o", "JobID,State,ExitCode,NodeList,Elapsed,Restarts"])
        rows = [ln.split("|") for ln in out.splitlines() if ln.strip()] if rc == 0 else []
        rows = [r for r in rows if r[0].split(".")[0].split("+")[0] == handle.id]
        if rows:
            r = (rows[-1] + [""] * 6)[:6]
            st = normalize_state(r[1])
            code = r[2].split(":")[0]
            return SlurmJobStatus(state_of(st), int(code) if code.isdigit() else None, "",
                                  slurm_state=st, source="sacct", nodes=r[3] or None, elapsed=r[4] or None,
                                  restarts=int(r[5]) if r[5].isdigit() else None, requeue=requeue)
        return self._status_from_log(runner, handle, (err or "").strip(), requeue)

    def _restarts(self, runner, job_id: str) -> int | None:
        rc, out, _ = _optional(runner, ["scontrol", "show", "job", job_id])
        m = re.search(r"\bRestarts=(\d+)", out) if rc == 0 else None
        return int(m.group(1)) if m else None

    def _status_from_log(self, runner, handle: JobHandle, sacct_err: str, requeue: bool) -> SlurmJobStatus:
        """Neither squeue nor sacct knows the job: read the batch script's own last words."""
        base = f"{handle.run_dir}/logs/slurm-{handle.id}"
        out = (runner.read_from(base + ".out", 0) or b"").decode(errors="replace")
        err = (runner.read_from(base + ".err", 0) or b"").decode(errors="replace")
        note = f"not in squeue; sacct: {sacct_err.splitlines()[0] if sacct_err else 'no record'}"
        done = STEP_DONE.findall(out)
        if done and out.rfind("launch4d: step finished") > out.rfind("launch4d: requeueing"):
            code = int(done[-1])
            st = "COMPLETED" if code == 0 else "FAILED"
            return SlurmJobStatus(state_of(st), code, note, slurm_state=st, source="job log", requeue=requeue)
        if "CANCELLED AT" in out + err:
            return SlurmJobStatus(CANCELLED, None, note, slurm_state="CANCELLED", source="job log",
                                  requeue=requeue)
        return SlurmJobStatus(UNKNOWN, None, note, slurm_state="UNKNOWN", source="none", requeue=requeue)

    # logs -------------------------------------------------------------------------------------
    def logs(self, handle: JobHandle, follow: bool = False, rank: int | None = None, stream: str = "out",
             poll_s: float = 1.0, timeout_s: float | None = None) -> Iterator[str]:
        """Lines of slurm-<id>.out (or .err); with `rank`, only that global rank's trainer lines."""
        runner = self.runner(ssh_target_from(handle))
        path = f"{handle.run_dir}/logs/slurm-{handle.id}.{stream}"
        offset, pending, chunk = 0, b"", None
        deadline = time.monotonic() + timeout_s if timeout_s else None
        try:
            while True:
                chunk = runner.read_from(path, offset)
                if chunk:
                    offset += len(chunk)
                    pending += chunk
                    *lines, pending = pending.split(b"\n")
                    for raw in lines:
                        out = filter_rank(raw.decode(errors="replace"), rank)
                        if out is not None:
                            yield out
                if not follow or (deadline and time.monotonic() > deadline):
                    break
                if not chunk and self._status(runner, handle).done:
                    break
                if not chunk:
                    time.sleep(poll_s)
            if pending:
                out = filter_rank(pending.decode(errors="replace"), rank)
                if out is not None:
                    yield out
            if offset == 0 and not follow:
                raise UserError(f"no log yet at {path}" + (f" on {runner.host}" if runner.host else "")
                                + " (is the job still pending?)")
        finally:
            runner.close()

    # cancel -----------------------------------------------------------------------------------
    def cancel(self, handle: JobHandle) -> None:
        runner = self.runner(ssh_target_from(handle))
        try:
            before = self._status(runner, handle)
            if before.done:
                raise UserError(f"job {handle.id} already ended ({before.slurm_state}); nothing to cancel")
            rc, out, err = runner.run(["scancel", handle.id])
            if rc != 0:
                raise UserError(f"scancel {handle.id} failed: {(err or out).strip()}")
        finally:
            runner.close()


def _optional(runner, argv: list[str]) -> tuple[int, str, str]:
    """A command that may be missing on this cluster (sacct without accounting tools): no answer."""
    try:
        return runner.run(argv)
    except UserError as exc:
        return 127, "", str(exc)


def filter_rank(line: str, rank: int | None) -> str | None:
    """srun --label prefixes each line with its task ("0: "); torchrun with the global rank
    ("[rank3]: ", TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE). With `rank`, keep that rank's text."""
    if rank is None:
        return line
    m = RANK_LINE.match(line)
    return m.group(2) if m and int(m.group(1)) == rank else None


def sbatch_error(text: str) -> str:
    """sbatch's own words, on one line: 'sbatch: error: invalid partition specified: x'."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    errs = [ln.split("error:", 1)[1].strip() for ln in lines if "error:" in ln]
    return "; ".join(errs or lines[-1:]) or "no message"
