"""The one verdict type of every judge, a Finding, and how findings combine (`worst`, `merge`, `fold`).

A judge looks at what a parser read and returns Findings: one per GPU, link or NIC it looked at
(`component` names it), or one per node and check (component "") where the verdict is already the
node's. `fold` turns the first kind into the second, its worst status naming every component that was
not a pass; assembly (checks/assemble.py) writes each node's verdicts into the BandwidthMap as its
CheckResults (launcher/formats/bwmap.py), the one record preflight hands on.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

STATUS_ORDER = {"pass": 0, "warn": 1, "fail": 2}


@dataclass
class Finding:
    node: str
    component: str  # "GPU 1", "GPU 0000:a1:00", "mlx5_4", "GPU 0 link 3", "node"; "": the node's verdict
    check: str  # gpu_count ... nccl_inter | dcgm:<test> | nvlink | nvbandwidth:<test> | rdma | memory | xid
    status: str  # pass | warn | fail
    figure: Any = None
    threshold: Any = None
    message: str = ""
    remediation: str = ""
    source: str = ""  # where the threshold comes from

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def verdict(node: str, check: str, status: str, figure: Any = None, threshold: Any = None,
            message: str = "") -> Finding:
    """The node's verdict on one check (component ""): what becomes one CheckResult of the map."""
    return Finding(node, "", check, status, figure, threshold, message)


def worst(items: Iterable[str | Finding]) -> str:
    """The worst of these statuses (or these Findings' statuses); "pass" for none."""
    statuses = [i.status if isinstance(i, Finding) else i for i in items]
    return max(statuses, key=lambda s: STATUS_ORDER.get(s, 0)) if statuses else "pass"


def merge(base: Finding, status: str, message: str, threshold: Any = None) -> Finding:
    """`base` made at least as bad as `status`, with `message` appended."""
    if STATUS_ORDER[status] > STATUS_ORDER[base.status]:
        base.status = status
        if threshold is not None and base.threshold is None:
            base.threshold = threshold
    base.message = f"{base.message}; {message}" if base.message else message
    return base


def fold(findings: Sequence[Finding]) -> list[Finding]:
    """One verdict per (node, check), in the order first seen: the worst status with its figure and
    threshold, naming every GPU/link/NIC that was not a pass, and the worst finding's remediation."""
    by: dict[tuple[str, str], list[Finding]] = {}
    for f in findings:
        by.setdefault((f.node, f.check), []).append(f)
    out = []
    for (node, check), fs in by.items():
        top = max(fs, key=lambda f: STATUS_ORDER[f.status])
        bad = [f for f in fs if f.status != "pass"]
        if bad:
            msg = "; ".join(f.message if f.message.startswith(f.component) else f"{f.component}: {f.message}"
                            for f in sorted(bad, key=lambda f: -STATUS_ORDER[f.status]))
            if top.remediation:
                msg += f" -> {top.remediation}"
        else:
            msg = top.message
        out.append(verdict(node, check, top.status, top.figure, top.threshold, msg))
    return out
