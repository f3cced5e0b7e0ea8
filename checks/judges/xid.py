"""Xids judged per GPU against NVIDIA's catalog: an action that takes the GPU out of service fails, others warn."""

from __future__ import annotations

from checks.judges.finding import Finding
from checks.parsers.xid import XID_CATALOG, XID_SOURCE, XidLog
from checks.parsers.xid_catalog import verdict as xid_verdict


def classify_xid(code: int, message: str = "") -> tuple[str, str, str]:
    """(meaning, status, remediation) for one Xid, from NVIDIA's catalog: an action that takes the GPU out
    of service -> fail (drain); the application's, or nothing to do -> warn; a code not in it -> warn, unknown."""
    v = xid_verdict(code, message)
    return v.meaning, v.status, v.action


def judge_xid(log: XidLog, node: str = "") -> list[Finding]:
    out: list[Finding] = []
    groups: dict[tuple[str, int, str], int] = {}
    first: dict[tuple[str, int, str], str] = {}
    for e in log.events:
        meaning = classify_xid(e.code, e.message)[0]
        key = (e.pci, e.code, meaning)
        groups[key] = groups.get(key, 0) + 1
        first.setdefault(key, e.message)
    for (pci, code, meaning), count in groups.items():
        _, status, fix = classify_xid(code, first[(pci, code, meaning)])
        out.append(Finding(node, f"GPU {pci}", "xid", status, code, "NVIDIA's action takes the GPU out of service: fail; "
                           "the application's, or none: warn; not in the catalog: warn",
                           f"Xid {code} x{count}: {meaning}", fix, XID_SOURCE))
    xid79 = {e.pci for e in log.events if e.code == 79}
    for b in log.bus_events:
        if b.message == "fallen off the bus" and b.pci not in xid79:
            out.append(Finding(node, f"GPU {b.pci}", "xid", "fail", "fallen off the bus", "no bus loss",
                               "the driver lost the GPU (fallen off the bus) without an Xid line",
                               XID_CATALOG[79][2], XID_SOURCE))
        elif b.message == "RmInitAdapter failed":
            out.append(Finding(node, f"GPU {b.pci}", "xid", "fail", "RmInitAdapter failed", "initialised",
                               "the driver could not initialise the GPU", XID_CATALOG[143][2], "NVIDIA driver log"))
    return out or [Finding(node, "node", "xid", "pass", 0, 0, "no Xid events", "", XID_SOURCE)]


