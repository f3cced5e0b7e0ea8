"""Where Slurm's client commands run: this machine, or the login node over SSH (launcher.transport),
and how one client command's answer is read (a missing command, a login node that does not answer)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from launcher.backends import TransientError
from launcher.errors import UserError
from launcher.transport import ConnectError, Transport, over_limit
from launcher.transport.local import LocalTransport


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


def run_optional(transport: Transport, argv: list[str]) -> tuple[int, str, str]:
    """A command that may be missing on this cluster (sacct without accounting tools): no answer."""
    try:
        return run(transport, argv)
    except UserError as exc:
        return 127, "", str(exc)


def sbatch_error(text: str) -> str:
    """sbatch's own words, on one line: 'sbatch: error: invalid partition specified: x'."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    errs = [ln.split("error:", 1)[1].strip() if "error:" in ln else ln.removeprefix("sbatch: ")
            for ln in lines if "error:" in ln or "unrecognized option" in ln or "invalid option" in ln]
    return "; ".join(errs or lines[-1:]) or "no message"
