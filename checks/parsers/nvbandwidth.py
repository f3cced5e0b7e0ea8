"""`nvbandwidth` output: one bandwidth matrix (GB/s) per test case, with the devices it ran on.

Layouts seen (v0.4 to v0.10 and the README's oldest): an optional version / CUDA / driver preamble,
optional `Device N: NAME (bus)` lines (v0.8 prints the hostname before them), `Running TEST.`,
a title line (`memcpy CE GPU(row) -> GPU(column) bandwidth (GB/s)`), a header row of column
indices, then one row per source (`N/A` or, in the oldest format, `0.00` on a device-to-device
diagonal: no measurement), then `SUM TEST total` and (v0.10) `COEFFICIENT_OF_VARIATION TEST x`.
A pasted output whose `Running` line was elided takes its test name from the SUM line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from checks.parsers.base import ParseError, strip_ansi

KIND = "nvbandwidth"
TITLE_RE = re.compile(r"^memcpy .*bandwidth \((GB/s|MB/s)\)\s*$")
DEVICE_RE = re.compile(r"^Device (\d+):\s*(.*?)\s*(?:\(([0-9A-Fa-f:.]+)\))?\s*$")
VALUE_RE = re.compile(r"^(?:N/A|[-+]?\d+(?:\.\d+)?)$")


@dataclass
class NvbTest:
    name: str | None
    title: str
    columns: list[int]
    rows: dict[int, list[float | None]] = field(default_factory=dict)
    total: float | None = None
    cov: float | None = None

    @property
    def host_side(self) -> str | None:
        """Which axis is the CPU (`CPU(row)` / `CPU(column)`), or None for GPU<->GPU and local tests."""
        m = re.search(r"CPU\((row|column)\)", self.title)
        return m.group(1) if m else None

    @property
    def kind(self) -> str:
        """device_to_device | host_device | local, from the title."""
        if self.host_side:
            return "host_device"
        return "device_to_device" if self.title.count("GPU(") >= 2 else "local"

    def values(self) -> list[float]:
        return [v for row in self.rows.values() for v in row if v is not None]

    def per_gpu(self) -> dict[int, float]:
        """The lowest figure each GPU takes part in (as source or destination)."""
        out: dict[int, float] = {}
        for r, row in self.rows.items():
            for c, v in zip(self.columns, row):
                if v is None:
                    continue
                gpus = [c] if self.kind != "device_to_device" else [r, c]
                if self.host_side == "column":
                    gpus = [r]
                for g in gpus:
                    out[g] = min(out.get(g, v), v)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "title": self.title, "kind": self.kind, "columns": self.columns,
                "rows": {str(k): v for k, v in self.rows.items()}, "sum": self.total, "cov": self.cov,
                "min": min(self.values(), default=None), "max": max(self.values(), default=None),
                "per_gpu_min": {str(k): v for k, v in sorted(self.per_gpu().items())}}


@dataclass
class NvBandwidth:
    version: str | None = None
    driver: str | None = None
    hostname: str | None = None
    devices: dict[int, str] = field(default_factory=dict)
    tests: list[NvbTest] = field(default_factory=list)

    @property
    def model(self) -> str | None:
        names = set(self.devices.values())
        return names.pop() if len(names) == 1 else None

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "driver": self.driver, "hostname": self.hostname,
                "devices": {str(k): v for k, v in self.devices.items()}, "model": self.model,
                "tests": [t.to_dict() for t in self.tests]}


def _is_data(line: str) -> bool:
    parts = line.split()
    return bool(parts) and (parts[0].isdigit() or parts[0] in ("SUM", "COEFFICIENT_OF_VARIATION"))


def parse_nvbandwidth(text: str) -> NvBandwidth:
    out = NvBandwidth()
    lines = strip_ansi(text).splitlines()
    if lines and not text.endswith(("\n", "\r")) and _is_data(lines[-1]):
        lines.pop()   # a capture cut mid-line: its last row or SUM may be cut mid-number ("370.9" -> "37")
    running: str | None = None
    test: NvbTest | None = None
    pending_host: str | None = None
    for i, raw in enumerate(lines):
        s = raw.strip()
        if not s:
            test = None if test is not None and test.rows else test
            continue
        if s.startswith("nvbandwidth Version:"):
            out.version = s.split(":", 1)[1].strip()
        elif s.startswith("Driver Version:"):
            out.driver = s.split(":", 1)[1].strip()
        elif s.startswith("Running ") and s.endswith("."):
            running = s[len("Running "):-1].strip()
        elif (m := DEVICE_RE.match(s)) is not None:
            out.devices[int(m.group(1))] = m.group(2)
            if pending_host and out.hostname is None:
                out.hostname = pending_host
        elif TITLE_RE.match(s):
            test = NvbTest(name=running, title=s, columns=[])
            out.tests.append(test)
            running = None
        elif test is not None and not test.columns:
            if not all(x.isdigit() for x in s.split()):
                raise ParseError(KIND, "expected the row of column indices under the title", i + 1, raw)
            test.columns = [int(x) for x in s.split()]
        elif test is not None and s.split()[0].isdigit() and all(VALUE_RE.match(x) for x in s.split()[1:]):
            parts = s.split()
            vals = [None if x == "N/A" else float(x) for x in parts[1:]]
            if len(vals) != len(test.columns):
                raise ParseError(KIND, f"{len(vals)} values for {len(test.columns)} columns (truncated?)", i + 1, raw)
            r = int(parts[0])
            if test.kind == "device_to_device":  # the oldest format prints 0.00 where nothing was measured
                vals = [None if (c == r and v == 0.0) else v for c, v in zip(test.columns, vals)]
            test.rows[r] = vals
        elif s.startswith("SUM ") or s.startswith("COEFFICIENT_OF_VARIATION "):
            parts = s.split()
            if len(parts) != 3:
                raise ParseError(KIND, "expected 'SUM <test> <value>'", i + 1, raw)
            target = next((t for t in reversed(out.tests) if t.name in (None, parts[1])), None)
            if target is None:
                raise ParseError(KIND, f"{parts[0]} for {parts[1]} without its matrix", i + 1, raw)
            target.name = parts[1]
            try:
                value = float(parts[2])
            except ValueError:
                raise ParseError(KIND, f"{parts[0]} value {parts[2]!r} is not a number", i + 1, raw) from None
            if parts[0] == "SUM":
                target.total = value
            else:
                target.cov = value
        elif re.fullmatch(r"[A-Za-z0-9][\w.-]*", s) and not out.devices:
            pending_host = s  # v0.8 prints the hostname alone on a line before the device list
    if not out.tests:
        raise ParseError(KIND, "no bandwidth matrix ('memcpy ... bandwidth (GB/s)'): not nvbandwidth output",
                         1, lines[0] if lines else "")
    for t in out.tests:
        if not t.rows:
            raise ParseError(KIND, f"{t.name or t.title}: matrix has no rows (truncated?)")
    return out
