"""A small local record of submitted jobs, so `launch status|logs|cancel|diagnose JOB` work later
from another shell. One JSON file under $XDG_STATE_HOME/launch4d (or $LAUNCH4D_STATE)."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.errors import UserError
from launcher.formats.files import MiB, atomic_write, check_writable_target, make_dirs, read_text


@dataclass
class JobRecord:
    id: str
    backend: str
    name: str
    run_dir: str
    log_dir: str
    submitted_at: str
    host: str | None = None
    remote_dir: str | None = None
    namespace: str | None = None
    extra: dict = field(default_factory=dict)


def state_file() -> Path:
    base = os.environ.get("LAUNCH4D_STATE") or os.path.join(
        os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state"), "launch4d")
    return Path(base) / "jobs.json"


STATE_LIMIT = 16 * MiB
_REQUIRED = {f.name for f in dataclasses.fields(JobRecord) if f.default is dataclasses.MISSING
             and f.default_factory is dataclasses.MISSING}
_KNOWN = {f.name for f in dataclasses.fields(JobRecord)}


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
        if not (isinstance(j, dict) and _REQUIRED <= j.keys() and j.keys() <= _KNOWN
                and all(isinstance(j[k], str) for k in _REQUIRED) and isinstance(j.get("extra", {}), dict)):
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
    """Add or replace a job record (locked, written atomically)."""
    path = state_file()
    make_dirs(path.parent, "job state directory")
    try:
        lock = open(path.with_suffix(".lock"), "a")
    except OSError as exc:
        raise UserError(f"{path.with_suffix('.lock')}: cannot lock the job state ({exc.strerror})") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        jobs = [j for j in _read(path) if not (j["id"] == job.id and j["backend"] == job.backend)]
        jobs.append(dataclasses.asdict(job))
        atomic_write(path, json.dumps({"jobs": jobs}, indent=2) + "\n", "job state file")


def record_handle(handle: Any, log_dir: str) -> None:
    """Record a submitted launcher.backends.JobHandle (the inverse of handle_from_record): where it
    runs (host, remote dir, namespace) comes from its extra, its log path rides along there."""
    extra = dict(handle.extra)
    if handle.log_path is not None:
        extra["log_path"] = handle.log_path
    record(JobRecord(id=handle.id, backend=handle.backend, name=handle.name, run_dir=handle.run_dir,
                     log_dir=log_dir, submitted_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                     host=extra.get("host"), remote_dir=extra.get("remote_dir"),
                     namespace=extra.get("namespace"), extra=extra))


def all_jobs() -> list[JobRecord]:
    return [JobRecord(**j) for j in _read(state_file())]


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
