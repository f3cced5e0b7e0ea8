"""What running a command on a host produced, and everything one preflight gathered.

These cross modules (runners produce them, orchestrate collects them, assemble judges them), so
they are plain dataclasses with no behaviour beyond small conveniences.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from launcher.transport import OUTPUT_LIMIT, over_limit  # noqa: F401 - re-exported for the runners


@dataclass
class CommandResult:
    host: str
    command: str
    stdout: str = ""
    stderr: str = ""
    rc: int | None = None
    timed_out: bool = False
    error: str | None = None  # the host could not run it at all (unreachable, auth, host key)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None and not self.timed_out and self.rc == 0

    def reason(self) -> str:
        """One line saying why the command did not succeed."""
        if self.error:
            return self.error
        if self.timed_out:
            return f"timed out after {self.seconds:.0f}s"
        if self.rc != 0:
            tail = (self.stderr.strip() or self.stdout.strip()).splitlines()
            return f"exit status {self.rc}" + (f": {tail[-1][:200]}" if tail else "")
        return "ok"


@dataclass
class NcclRun:
    kind: str  # node | pair | all
    hosts: list[str]
    collective: str
    result: CommandResult


@dataclass
class PreflightResults:
    hosts: list[str]
    unreachable: dict[str, str] = field(default_factory=dict)
    probes: dict[str, dict[str, CommandResult]] = field(default_factory=dict)
    nccl: list[NcclRun] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)
    gpus_per_node: dict[str, int] = field(default_factory=dict)
    level: str = "quick"
    rdma: list = field(default_factory=list)  # checks.levels.RdmaRun, per pair and NIC (level long)
    tool_timeouts: dict[str, float] = field(default_factory=dict)  # the deeper tools' timeouts, seconds
