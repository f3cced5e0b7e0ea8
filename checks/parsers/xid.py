"""NVIDIA XID events from the kernel log (`dmesg`, `journalctl -k`).

A kernel log holds much else; only `NVRM: Xid (PCI:<bus>): <code>, ...` lines are events, in any
prefix format (`dmesg`, `dmesg -T`, `--ctime`, `--decode --time-format iso`, syslog, journal
`kernel:`). Such a line whose code is not a number is garbled: ParseError naming it. Which XIDs are
critical follows Azure's health checks (notes/preflight.md §3); the others are reported as warnings.
Two driver messages without an Xid line are kept too: `The NVIDIA GPU <bus> ... has fallen off the
bus` (the message is wrapped over continuation lines that carry no timestamp) and `RmInitAdapter
failed!` (a GPU the driver could not initialise).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from checks.parsers import ParseError, strip_ansi

KIND = "xid"
CRITICAL_XIDS = frozenset({48, 56, 57, 58, 62, 63, 64, 65, 68, 69, 73, 74, 79, 80, 81, 92, 119, 120})
XID_RE = re.compile(r"NVRM: Xid \((?:PCI:)?([0-9A-Fa-f:.]+)\):\s*(.*)$")
CODE_RE = re.compile(r"^(\d+),?\s*(.*)$")
BUS_RE = re.compile(r"NVRM: (?:The NVIDIA )?GPU (?:at PCI:)?([0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.\d)?)\b:?\s*(.*)$")


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
class BusEvent:
    line_no: int
    pci: str
    message: str  # fallen off the bus | RmInitAdapter failed


@dataclass
class XidLog:
    events: list[XidEvent]
    bus_events: list[BusEvent] = field(default_factory=list)

    @property
    def fallen_off_bus(self) -> list[str]:
        """Buses of GPUs the driver lost, with or without an Xid 79 line."""
        out = {e.pci for e in self.events if e.code == 79}
        out |= {b.pci for b in self.bus_events if b.message == "fallen off the bus"}
        return sorted(out)

    @property
    def critical(self) -> list[XidEvent]:
        return [e for e in self.events if e.critical]

    def to_dict(self) -> dict[str, Any]:
        return {"events": [{**vars(e), "critical": e.critical} for e in self.events],
                "codes": sorted({e.code for e in self.events}),
                "critical_codes": sorted({e.code for e in self.critical}),
                "bus_events": [vars(b) for b in self.bus_events], "fallen_off_bus": self.fallen_off_bus}


def _short(pci: str) -> str:
    """`0000:a1:00.0` and `0000:a1:00` name the same GPU: keep the Xid line's form, lower case."""
    return re.sub(r"\.\d$", "", pci).lower()


def parse_xid(text: str) -> XidLog:
    events: list[XidEvent] = []
    bus: list[BusEvent] = []
    lines = strip_ansi(text).splitlines()
    for i, raw in enumerate(lines):
        m = XID_RE.search(raw)
        b = BUS_RE.search(raw) if not m else None
        if b:
            # the "fallen off the bus" notice is wrapped: read it with its next two lines
            tail = " ".join([b.group(2)] + [ln.split("NVRM:", 1)[-1].strip() for ln in lines[i + 1:i + 3]
                                            if ln[:1].isspace() and "NVRM:" in ln])
            what = ("fallen off the bus" if "fallen off the bus" in tail and "Xid" not in b.group(2) else
                    "RmInitAdapter failed" if "RmInitAdapter failed" in b.group(2) else None)
            if what and not any(x.pci == _short(b.group(1)) and x.message == what for x in bus):
                bus.append(BusEvent(line_no=i + 1, pci=_short(b.group(1)), message=what))
        if not m:
            if "NVRM: Xid" in raw:
                raise ParseError(KIND, "an 'NVRM: Xid' line without '(PCI:<bus>): <code>'", i + 1, raw)
            continue
        c = CODE_RE.match(m.group(2))
        if not c:
            raise ParseError(KIND, "XID code is not a number", i + 1, raw)
        events.append(XidEvent(line_no=i + 1, pci=m.group(1).lower(), code=int(c.group(1)), message=c.group(2).strip()))
    return XidLog(events=events, bus_events=bus)
