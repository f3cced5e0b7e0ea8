"""NVIDIA XID events from the kernel log (`dmesg`, `journalctl -k`).

A kernel log holds much else; only `NVRM: Xid (PCI:<bus>): <code>, ...` lines are events, in any
prefix format (`dmesg`, `dmesg -T`, `--ctime`, `--decode --time-format iso`, syslog, journal
`kernel:`). Such a line whose code is not a number is garbled: ParseError naming it. Which XIDs are
critical (the node leaves service) and which are the application's follows NVIDIA's whole Xid catalog
with each code's resolution buckets (checks.parsers.xid_catalog, which cites it) and Azure's health
checks (../shared/notes/preflight.md §3); a code the catalog lacks is reported as unknown.
Two driver messages without an Xid line are kept too: `The NVIDIA GPU <bus> ... has fallen off the
bus` (the message is wrapped over continuation lines that carry no timestamp) and `RmInitAdapter
failed!` (a GPU the driver could not initialise).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from checks.parsers.base import ParseError, strip_ansi
from checks.parsers.xid_catalog import CATALOG, SOURCE, verdict

KIND = "xid"
XID_SOURCE = SOURCE
# code -> (meaning, fails the node?, remediation), from NVIDIA's whole catalog (checks.parsers.xid_catalog)
XID_CATALOG: dict[int, tuple[str, bool, str]] = {
    code: ((v := verdict(code)).meaning, v.status == "fail", v.action) for code in CATALOG}
CRITICAL_XIDS = frozenset(code for code, (_, hardware, _) in XID_CATALOG.items() if hardware)
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
        """The node fails preflight on it (the catalog's action takes the GPU out of service)."""
        return verdict(self.code, self.message).status == "fail"

    @property
    def known(self) -> bool:
        return self.code in CATALOG


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
        return {"events": [{**vars(e), "critical": e.critical, "known": e.known} for e in self.events],
                "codes": sorted({e.code for e in self.events}),
                "critical_codes": sorted({e.code for e in self.critical}),
                "unknown_codes": sorted({e.code for e in self.events if not e.known}),
                "bus_events": [vars(b) for b in self.bus_events], "fallen_off_bus": self.fallen_off_bus}


def _short(pci: str) -> str:
    """`0000:a1:00.0` and `0000:a1:00` name the same GPU: keep the Xid line's form, lower case."""
    return re.sub(r"\.\d$", "", pci).lower()


def _continuation(lines: list[str], start: int, want: int = 2) -> list[str]:
    """The wrapped notice's next lines (indented, `NVRM:`, no timestamp), stepping over lines of other
    writers that landed between them (a kernel log interleaves), until another record starts."""
    out: list[str] = []
    for ln in lines[start:start + want + 3]:
        if "NVRM:" not in ln:
            continue                      # another writer's line between the notice's lines
        if not ln[:1].isspace():
            break                         # a new timestamped NVRM record: the notice has ended
        out.append(ln.split("NVRM:", 1)[-1].strip())
        if len(out) == want:
            break
    return out


def parse_xid(text: str) -> XidLog:
    events: list[XidEvent] = []
    bus: list[BusEvent] = []
    lines = strip_ansi(text).splitlines()
    for i, raw in enumerate(lines):
        m = XID_RE.search(raw)
        b = BUS_RE.search(raw) if not m else None
        if b:
            # the "fallen off the bus" notice is wrapped: read it with its next two lines
            tail = " ".join([b.group(2)] + _continuation(lines, i + 1))
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
