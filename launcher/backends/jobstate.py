"""A small local store of submitted jobs' records (launcher.formats.jobs.JobRecord), so `launch
status|logs|cancel|diagnose JOB` work later from another shell. One JSON file under
$XDG_STATE_HOME/launch4d (or $LAUNCH4D_STATE)."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from launcher.errors import UserError
from launcher.formats.files import MiB, atomic_write, check_writable_target, make_dirs, read_text
from launcher.formats.jobs import STATE_KEYS, STATE_REQUIRED, JobRecord


def state_file() -> Path:
    base = os.environ.get("LAUNCH4D_STATE") or os.path.join(
        os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state"), "launch4d")
    return Path(base) / "jobs.json"


STATE_LIMIT = 16 * MiB


def _read(path: Path) -> list[dict]:
    """The records, checked for shape: binary, a directory, or JSON of another shape is one clear
    error naming the file, never a traceback later on."""
    if not os.path.lexists(path):
        return []
    corrupt = f"{path}: job state file is corrupt"
    try:
        data = json.loads(read_text(path, "job state file", STATE_LIMIT))
    except json.JSONDecodeError as exc:
        raise UserError(f"{corrupt} (line {exc.lineno}: {exc.msg}); move it aside to start afresh") from None
    except UserError as exc:
        raise UserError(f"{exc}; move it aside to start afresh") from None
    jobs = data.get("jobs") if isinstance(data, dict) else None
    if not isinstance(jobs, list):
        raise UserError(f"{corrupt} (expected {{\"jobs\": [...]}}); move it aside to start afresh")
    for i, j in enumerate(jobs):
        if not (isinstance(j, dict) and STATE_REQUIRED <= j.keys() and j.keys() <= STATE_KEYS
                and all(isinstance(j[k], str) for k in STATE_REQUIRED) and isinstance(j.get("extra", {}), dict)):
            raise UserError(f"{corrupt} (jobs[{i}] is not a job record); move it aside to start afresh")
    return jobs


def check_state() -> None:
    """Before submitting: the state file reads and its directory can be written, so a job is never
    submitted and then lost from the record."""
    path = state_file()
    _read(path)
    make_dirs(path.parent, "job state directory")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise UserError(f"{path.parent}: job state directory is not writable (set LAUNCH4D_STATE)")
    if os.path.lexists(path):
        check_writable_target(path, "job state file")


def record(job: JobRecord) -> None:
    """Add or replace a job's record (locked, written atomically)."""
    path = state_file()
    make_dirs(path.parent, "job state directory")
    try:
        lock = open(path.with_suffix(".lock"), "a")
    except OSError as exc:
        raise UserError(f"{path.with_suffix('.lock')}: cannot lock the job state ({exc.strerror})") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        jobs = [j for j in _read(path) if not (j["id"] == job.id and j["backend"] == job.backend)]
        jobs.append(job.to_state())
        atomic_write(path, json.dumps({"jobs": jobs}, indent=2) + "\n", "job state file")


def all_jobs() -> list[JobRecord]:
    return [JobRecord.from_state(j) for j in _read(state_file())]


def lookup(job: str) -> JobRecord:
    """Find a job by id (newest first), or by name; a clear error when unknown."""
    jobs = all_jobs()
    for j in reversed(jobs):
        if j.id == job:
            return j
    for j in reversed(jobs):
        if j.name == job:
            return j
    known = ", ".join(j.id for j in jobs[-5:]) or "none recorded"
    raise UserError(f"job {job!r} is not known to launch4d (recent: {known}; state file {state_file()})")
