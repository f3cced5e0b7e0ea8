"""A small local record of submitted jobs, so `launch status|logs|cancel|diagnose JOB` work later
from another shell. One JSON file under $XDG_STATE_HOME/launch4d (or $LAUNCH4D_STATE)."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from launcher.errors import UserError


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


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    try:
        return json.loads(path.read_text()).get("jobs", [])
    except (json.JSONDecodeError, AttributeError):
        raise UserError(f"{path}: job state file is corrupt; move it aside to start afresh") from None


def record(job: JobRecord) -> None:
    """Add or replace a job record (locked, written atomically)."""
    path = state_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        jobs = [j for j in _read(path) if not (j["id"] == job.id and j["backend"] == job.backend)]
        jobs.append(dataclasses.asdict(job))
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"jobs": jobs}, indent=2) + "\n")
        tmp.replace(path)


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
