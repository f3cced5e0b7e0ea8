"""A Slurm job's state, from three sources in turn: `squeue` (always there), then `sacct` (only where
accounting answers), then the job's own log (the batch script prints its step's exit code), so small
clusters without slurmdbd still work; and why a job ended or waits (the node check's words)."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from launcher.backends import (
    CANCELLED,
    FAILED,
    PENDING,
    PREEMPTED,
    RUNNING,
    SUCCEEDED,
    TERMINAL,
    UNKNOWN,
    JobStatus,
    TransientError,
)
from launcher.backends.slurm_login import run, run_optional, sbatch_error
from launcher.backends.tail import read_tail
from launcher.formats import rundir
from launcher.formats.jobs import JobRecord
from launcher.transport import Transport

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


def sacct_fields(transport: Transport) -> tuple[frozenset[str] | None, str]:
    """The fields this sacct knows (`sacct --helpformat`, asked once per login host), or None and
    why where there is no accounting (no slurmdbd: sacct refuses every query) or no sacct."""
    key = transport.host
    if key not in _SACCT_FIELDS:
        rc, out, err = run_optional(transport, ["sacct", "--helpformat"])
        if rc == 0 and out.split():
            _SACCT_FIELDS[key] = (frozenset(out.split()), "")
        elif TRANSIENT.search(err or out) and not NO_ACCOUNTING.search(err or out):
            raise TransientError(f"sacct not answering ({sbatch_error(err or out)})")
        else:
            _SACCT_FIELDS[key] = (None, sbatch_error(err or out))
    return _SACCT_FIELDS[key]


def squeue_statuses(transport: Transport, group: list[JobRecord]) -> dict[str, JobStatus]:
    """Many jobs on one login host: one squeue for all of them; sacct or the job log only for those
    squeue has forgotten. Raises TransientError when the controller does not answer."""
    out: dict[str, JobStatus] = {}
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
                                       elapsed=row[4] or None, requeue=bool(h.extra.get("requeue", True)))
        else:
            out[h.id] = job_status(transport, h)
    return out


def job_status(transport: Transport, handle: JobRecord) -> SlurmJobStatus:
    requeue = bool(handle.extra.get("requeue", True))
    rc, out, err = run(transport, ["squeue", "-h", "-r", "-t", "all", "-j", handle.id, "-o", SQUEUE_FORMAT])
    if rc != 0 and TRANSIENT.search(err or out):
        raise TransientError(f"Slurm controller not answering ({sbatch_error(err or out)})")
    line = next((ln for ln in out.splitlines() if ln.split("|")[0].strip() == handle.id), None)
    if rc == 0 and line:
        _, state, reason, nodes, elapsed = (line.split("|") + [""] * 5)[:5]
        st = normalize_state(state)
        job = scontrol_job(transport, handle.id)
        detail = reason if reason not in ("None", "") else ""
        excluded = left_out(transport, handle, job.get("ExcNodeList")) if st == "PENDING" else ""
        if excluded:
            detail = f"{detail}; {excluded}" if detail else excluded
        restarts = job.get("Restarts")
        return SlurmJobStatus(state_of(st), None, detail, slurm_state=st, source="squeue", nodes=nodes or None,
                              elapsed=elapsed or None, restarts=int(restarts) if restarts and restarts.isdigit()
                              else None, requeue=requeue)
    fields, why = sacct_fields(transport)
    if fields is None:
        return status_from_log(transport, handle, f"no Slurm accounting here ({why}): squeue/scontrol "
                                     "and the job log only", requeue)
    cols = [f for f in SACCT_WANTED if f in fields]
    rc, out, err = run_optional(transport, ["sacct", "-n", "-P", "-X", "-j", handle.id, "-o", ",".join(cols)])
    if rc != 0 and TRANSIENT.search(err or out):
        raise TransientError(f"sacct not answering ({sbatch_error(err or out)})")
    rows = [dict(zip(cols, ln.split("|"))) for ln in out.splitlines() if ln.strip()] if rc == 0 else []
    rows = [r for r in rows if r.get("JobID", "").split(".")[0].split("+")[0] == handle.id]
    if rows:
        r = rows[-1]
        st = normalize_state(r.get("State", ""))
        code = r.get("ExitCode", "").split(":")[0]
        restarts = r.get("Restarts", "")
        detail = check_failure(transport, handle) if st == "FAILED" and code == "3" else ""
        return SlurmJobStatus(state_of(st), int(code) if code.isdigit() else None, detail,
                              slurm_state=st, source="sacct", nodes=r.get("NodeList") or None,
                              elapsed=r.get("Elapsed") or None,
                              restarts=int(restarts) if restarts.isdigit() else None, requeue=requeue)
    note = f"sacct: {sbatch_error(err)}" if rc != 0 else "sacct: no record"
    return status_from_log(transport, handle, note, requeue)


def scontrol_job(transport: Transport, job_id: str) -> dict[str, str]:
    """`scontrol show job` as key=value pairs (Restarts, ExcNodeList, ...); {} when it cannot say."""
    rc, out, _ = run_optional(transport, ["scontrol", "show", "job", job_id])
    if rc != 0:
        return {}
    return {m[1]: m[2] for m in re.finditer(r"(?:^|\s)([A-Za-z][A-Za-z:/]*)=(\S*)", out)}


def left_out(transport: Transport, handle: JobRecord, exc: str | None) -> str:
    """For a pending job: the nodes the node check left out, and why (from logs/nodecheck.log)."""
    if not exc or exc == "(null)":
        return ""
    text = (transport.get(rundir.remote(handle.run_dir, rundir.NODECHECK_LOG), 0) or b"").decode(errors="replace")
    why: dict[str, str] = {}
    for m in re.finditer(r": (\S+) left out: (.*)$", text, re.M):
        why[m.group(1)] = m.group(2)
    nodes = [n for n in exc.split(",") if n in why]
    return "; ".join(f"left out {n} (node check: {why[n]})" for n in nodes)


def check_failure(transport: Transport, handle: JobRecord) -> str:
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


def status_from_log(transport: Transport, handle: JobRecord, sacct_note: str, requeue: bool) -> SlurmJobStatus:
    """Neither squeue nor sacct knows the job: read the batch script's own last words."""
    base = f"{log_dir(handle)}/slurm-{handle.id}"
    out = (read_tail(transport, base + ".out") or b"").decode(errors="replace")
    err = (read_tail(transport, base + ".err") or b"").decode(errors="replace")
    note = f"not in squeue; {sacct_note}"
    done = STEP_DONE.findall(out)
    if done and out.rfind("launch4d: step finished") > out.rfind("launch4d: requeueing"):
        code = int(done[-1])
        st = "COMPLETED" if code == 0 else "FAILED"
        check = check_failure(transport, handle) if code == 3 else ""
        return SlurmJobStatus(state_of(st), code, f"{check}; {note}" if check else note, slurm_state=st,
                              source="job log", requeue=requeue)
    if "CANCELLED AT" in out + err:
        return SlurmJobStatus(CANCELLED, None, note, slurm_state="CANCELLED", source="job log",
                              requeue=requeue)
    return SlurmJobStatus(UNKNOWN, None, note, slurm_state="UNKNOWN", source="none", requeue=requeue)

# logs -------------------------------------------------------------------------------------


def log_dir(handle: JobRecord) -> str:
    """Where Slurm writes the job's output: <run dir>/logs, or an array's <base>/logs."""
    return handle.extra.get("log_dir") or rundir.remote(handle.run_dir, rundir.LOGS)
