"""Findings and the verdict: what diagnose concluded, ranked so the most likely cause comes first.

Every parser produces Findings; the ranking is one table (KIND_WEIGHT) so the order of the
report is explained in one place: a named stalled rank beats a network error, which beats a
generic timeout, which beats a configuration warning, which beats facts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

ERROR, WARNING, INFO = "error", "warning", "info"

# Higher comes first. A stalled rank named by the job itself (desync report, flight recorder,
# monitoredBarrier) is the answer the seed asks for; the rest explain or corroborate it.
KIND_WEIGHT = {
    "stalled_rank": 100,
    "ib_completion_error": 90,
    "nccl_error": 85,
    "peer_closed": 75,
    "collective_timeout": 70,
    "gloo_timeout": 70,
    "flight_recorder": 68,
    "nccl_init_hang": 80,
    "nccl_warn": 60,
    "straggler": 58,
    "plan_preflight": 57,     # a group measured slower than the plan assumed, before the job started
    "process_exit": 55,
    "tp_across_nodes": 50,
    "unreadable": 48,
    "socket_fallback": 45,
    "nic_not_nearest": 40,
    "socket_transport": 12,
    "nccl_init": 10,
    "heartbeat": 8,
    "stacks": 9,
}
SEVERITY_WEIGHT = {ERROR: 1000, WARNING: 500, INFO: 0}


@dataclass
class Finding:
    kind: str
    severity: str
    message: str
    evidence: list[str] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)
    # for stall findings: how directly the source names the rank (4 its stack, in the frame it is stuck in;
    # 3 explicit, 2 heartbeat, 1 inferred)
    confidence: int = 0

    @property
    def score(self) -> int:
        return SEVERITY_WEIGHT.get(self.severity, 0) + KIND_WEIGHT.get(self.kind, 20) + self.confidence

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["evidence"] = list(dict.fromkeys(self.evidence))
        return d


@dataclass
class Report:
    verdict: str
    stalled_ranks: list[int]
    stalled_hosts: dict[int, str]
    findings: list[Finding]
    nccl: dict[str, Any] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @property
    def problem(self) -> bool:
        return any(f.severity in (ERROR, WARNING) for f in self.findings)

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "stalled_ranks": self.stalled_ranks,
            "stalled_hosts": {str(k): v for k, v in self.stalled_hosts.items()},
            "problem": self.problem,
            "findings": [f.to_dict() for f in self.findings],
            "nccl": self.nccl,
            "files": self.files,
            "skipped": self.skipped,
        }


def rank_findings(findings: list[Finding]) -> list[Finding]:
    """Most likely cause first; stable for equal scores (parse order)."""
    return sorted(findings, key=lambda f: -f.score)


def fmt_ranks(ranks: list[int], hosts: dict[int, str] | None = None) -> str:
    hosts = hosts or {}
    parts = [f"{r} ({hosts[r]})" if r in hosts else str(r) for r in ranks]
    return ", ".join(parts)


def stalled_from(findings: list[Finding]) -> list[int]:
    """Ranks named by the most direct stall evidence available (the highest confidence wins)."""
    stall = [f for f in findings if f.kind == "stalled_rank" and f.ranks]
    if not stall:
        return []
    best = max(f.confidence for f in stall)
    return sorted({r for f in stall if f.confidence == best for r in f.ranks})
