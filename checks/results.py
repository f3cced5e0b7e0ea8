"""Everything one preflight gathered (each command's result is launcher.transport's Completed).

These cross modules (runners produce them, orchestrate collects them, assemble judges them), so
they are plain dataclasses with no behaviour beyond small conveniences.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from launcher.transport import Completed


@dataclass
class NcclRun:
    kind: str  # node | pair | all
    hosts: list[str]
    collective: str
    result: Completed


@dataclass
class PreflightResults:
    hosts: list[str]
    unreachable: dict[str, str] = field(default_factory=dict)
    probes: dict[str, dict[str, Completed]] = field(default_factory=dict)
    nccl: list[NcclRun] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)
    gpus_per_node: dict[str, int] = field(default_factory=dict)
    level: str = "quick"
    rdma: list = field(default_factory=list)  # checks.levels.RdmaRun, per pair and NIC (level long)
    tool_timeouts: dict[str, float] = field(default_factory=dict)  # the deeper tools' timeouts, seconds
