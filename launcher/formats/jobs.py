"""The one record of a submitted job: what Backend.submit returns, what the job state file keeps
(launcher.backends.jobstate) and what status/logs/cancel/diagnose take again from another shell.

What a job asks for before it is sent is the backend's Request (the dry run); everything after the
submission is this record. `extra` is the backend's own (Slurm: the login node and array tasks;
Kubernetes: namespace, kubeconfig, pods; local: pid, marker, exit file). The state file's entry is
`to_state()`: the record less the submitted request's text, the log path inside `extra`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

#: The state file entry's keys: those every entry has (strings), and all it may have.
STATE_REQUIRED = frozenset({"id", "backend", "name", "run_dir", "log_dir", "submitted_at"})
STATE_KEYS = STATE_REQUIRED | {"host", "remote_dir", "namespace", "extra"}


def now() -> str:
    """A submission time as the state file keeps it: local time with its UTC offset."""
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


@dataclass
class JobRecord:
    """One submitted job. `request` is the submitted Request's text (the exact command and script or
    manifest), known to the shell that submitted it only; `log_dir` is where the job's logs are."""

    backend: str
    id: str
    name: str
    run_dir: str
    log_path: str | None = None
    request: str | None = None
    log_dir: str = ""
    submitted_at: str = field(default_factory=now)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def host(self) -> str | None:
        """The login node the job was submitted on (Slurm over SSH), else None: this machine."""
        return self.extra.get("host")

    @property
    def remote_dir(self) -> str | None:
        return self.extra.get("remote_dir")

    @property
    def namespace(self) -> str | None:
        return self.extra.get("namespace")

    def to_state(self) -> dict[str, Any]:
        """The state file's entry."""
        extra = dict(self.extra)
        if self.log_path is not None:
            extra["log_path"] = self.log_path
        return {"id": self.id, "backend": self.backend, "name": self.name, "run_dir": self.run_dir,
                "log_dir": self.log_dir, "submitted_at": self.submitted_at, "host": self.host,
                "remote_dir": self.remote_dir, "namespace": self.namespace, "extra": extra}

    @classmethod
    def from_state(cls, entry: dict[str, Any]) -> JobRecord:
        """A record again from a state file entry (checked for shape by the reader)."""
        extra = dict(entry.get("extra") or {})
        for key in ("host", "remote_dir", "namespace"):
            if entry.get(key) is not None:
                extra.setdefault(key, entry[key])
        return cls(backend=entry["backend"], id=entry["id"], name=entry["name"], run_dir=entry["run_dir"],
                   log_path=extra.get("log_path"), log_dir=entry["log_dir"], submitted_at=entry["submitted_at"],
                   extra=extra)
