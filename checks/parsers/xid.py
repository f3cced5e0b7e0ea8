"""NVIDIA XID events from the kernel log (`dmesg`, `journalctl -k`).

A kernel log holds much else; only `NVRM: Xid (PCI:<bus>): <code>, ...` lines are events. Such a
line whose code is not a number is garbled: ParseError naming it. Which XIDs are critical follows
Azure's health checks (notes/preflight.md §3); the others are reported as warnings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from checks.parsers import ParseError, strip_ansi

KIND = "xid"
CRITICAL_XIDS = frozenset({48, 56, 57, 58, 62, 63, 64, 65, 68, 69, 73, 74, 79, 80, 81, 92, 119, 120})
XID_RE = re.compile(r"NVRM: Xid \((?:PCI:)?([0-9A-Fa-f:.]+)\):\s*(.*)$")
CODE_RE = re.compile(r"^(\d+),?\s*(.*)$")


@dataclass
class XidEvent:
    line_no: int
    pci: str
    code: int
    message: str

    @property
    def critical(self) -> bool:
        return self.code in CRITICAL_XIDS


@dataclass
class XidLog:
    events: list[XidEvent]

    @property
    def critical(self) -> list[XidEvent]:
        return [e for e in self.events if e.critical]

    def to_dict(self) -> dict[str, Any]:
        return {"events": [{**vars(e), "critical": e.critical} for e in self.events],
                "codes": sorted({e.code for e in self.events}),
                "critical_codes": sorted({e.code for e in self.critical})}


def parse_xid(text: str) -> XidLog:
    events: list[XidEvent] = []
    for i, raw in enumerate(strip_ansi(text).splitlines()):
        m = XID_RE.search(raw)
        if not m:
            if "NVRM: Xid" in raw:
                raise ParseError(KIND, "an 'NVRM: Xid' line without '(PCI:<bus>): <code>'", i + 1, raw)
            continue
        c = CODE_RE.match(m.group(2))
        if not c:
            raise ParseError(KIND, "XID code is not a number", i + 1, raw)
        events.append(XidEvent(line_no=i + 1, pci=m.group(1), code=int(c.group(1)), message=c.group(2).strip()))
    return XidLog(events=events)
