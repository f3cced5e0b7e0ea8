"""One way to reach a machine: this one (`local`) or another over SSH (`ssh`), for preflight's
fan-out and for Slurm submission alike.

A Transport runs a command with a timeout and a bound on the output it keeps, streams a command's
output as lines, puts and gets files, and says whether a path exists. Command failures come back as
a `Completed` (rc, timed out, flooded); only failing to reach the machine at all raises
`ConnectError`, whose message is one line and whose `kind` says whether trying again may help.
Torch-free and light: paramiko is imported only when an SSH connection is made, so checks and
launcher may both import this package (it imports nothing of launch4d but formats and errors).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from launcher.errors import UserError

#: The most of one command's stdout (and of its stderr) a transport keeps. Every probe and
#: nccl-tests output is far smaller; a command flooding its output is stopped there and reported,
#: instead of filling this machine's memory.
OUTPUT_LIMIT = 32 << 20
#: The most one `get` returns; a longer file is read in several calls (from an offset).
CHUNK_LIMIT = 8 << 20


def over_limit(limit: int = OUTPUT_LIMIT) -> str:
    return f"output larger than {limit >> 20} MiB; stopped reading it (a command flooding its output?)"


class TransportError(UserError):
    """The machine could not be asked, or refused a file operation (not: a command failed there).
    One line, for people: the CLI prints it as it prints any UserError."""


class ConnectError(TransportError, ConnectionError):
    """Could not reach or log in to a host. `kind`: unknown-host-key, changed-host-key, auth,
    unreachable, timeout, jump, ssh. Only unreachable and timeout are worth retrying."""

    TRANSIENT = frozenset({"unreachable", "timeout"})

    def __init__(self, message: str, kind: str = "ssh"):
        super().__init__(message)
        self.kind = kind

    @property
    def transient(self) -> bool:
        return self.kind in self.TRANSIENT


@dataclass
class Completed:
    """What one command did: the one result type of every way launch4d runs a command (a
    transport's run, and a preflight Runner's fan-out over transports, which also says on which
    `host` and which `command`). rc is None when it was stopped (timed out, flooded its output) or
    never ran; `error` says why a host could not run it at all (unreachable, auth, host key)."""

    rc: int | None = None
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    flooded: bool = False
    seconds: float = 0.0
    host: str = ""
    command: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.rc == 0 and not self.timed_out and not self.flooded

    def reason(self) -> str:
        """One line saying why the command did not succeed."""
        if self.error:
            return self.error
        if self.timed_out:
            return f"timed out after {self.seconds:.0f}s"
        if self.flooded:
            return over_limit()
        if self.rc != 0:
            tail = (self.stderr.strip() or self.stdout.strip()).splitlines()
            return f"exit status {self.rc}" + (f": {tail[-1][:200]}" if tail else "")
        return "ok"


Command = str | Sequence[str]  # a shell command line (bash -c), or an argv (quoted for the shell)


class Transport(ABC):
    """Commands and files on one machine. `host` is None for this machine."""

    host: str | None = None

    @abstractmethod
    def run(self, command: Command, *, timeout: float = 60, cwd: str | None = None,
            stdin: bytes | None = None, limit: int = OUTPUT_LIMIT) -> Completed:
        """Run `command` (a bash command line, or an argv) and wait at most `timeout` seconds; keep
        at most `limit` bytes of stdout and of stderr each. A missing program is rc 127."""

    @abstractmethod
    def stream(self, command: Command, *, timeout: float | None = None, cwd: str | None = None) -> Iterator[str]:
        """The command's stdout, line by line as it comes (stderr is dropped); closing the iterator
        (or `timeout`) ends the command."""

    @abstractmethod
    def put(self, path: str, data: str | bytes, mode: int = 0o644) -> None:
        """Write a whole file atomically (temp file, then rename); raises TransportError."""

    @abstractmethod
    def get(self, path: str, offset: int = 0, limit: int = CHUNK_LIMIT) -> bytes | None:
        """Up to `limit` bytes of a file from `offset`; None when it is not a file there."""

    @abstractmethod
    def exists(self, path: str) -> bool: ...

    @abstractmethod
    def makedirs(self, path: str) -> None:
        """mkdir -p; raises TransportError."""

    @abstractmethod
    def remove_tree(self, path: str) -> None:
        """rm -rf, quietly."""

    @abstractmethod
    def home(self) -> str: ...

    @abstractmethod
    def which(self, name: str) -> bool: ...

    def close(self) -> None:  # noqa: B027 - optional: transports holding connections override it
        """Release the connection (SSH); nothing for this machine."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

