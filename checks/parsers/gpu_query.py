"""`nvidia-smi --query-gpu=FIELDS --format=csv`: one record per GPU, fields named by the header.

The header row (`index, name, memory.total [MiB], ...`) says which fields are present and in
what order, so the parser works with any subset; units in values (`81559 MiB`, `69.31 W`) are
dropped and `[N/A]` / `[Not Supported]` become None. The query the probe runs is QUERY_FIELDS;
drivers before 535 know `clocks_throttle_reasons.active` instead of `clocks_event_reasons.active`.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass, field
from typing import Any

from checks.parsers.base import ParseError, strip_ansi

KIND = "gpu-query"
QUERY_FIELDS = [
    "index", "name", "uuid", "pci.bus_id", "driver_version", "memory.total",
    "ecc.errors.uncorrected.volatile.total", "ecc.errors.corrected.volatile.total",
    "retired_pages.pending", "remapped_rows.pending", "remapped_rows.failure",
    "clocks.sm", "clocks.max.sm", "clocks_event_reasons.active",
    "pcie.link.gen.current", "pcie.link.gen.max", "pcie.link.width.current", "pcie.link.width.max",
    "temperature.gpu", "power.draw", "power.limit",
]
KNOWN = set(QUERY_FIELDS) | {"clocks_throttle_reasons.active", "pcie.link.gen.gpucurrent",
                             "pcie.link.gen.gpumax", "pcie.link.gen.hostmax", "memory.used", "memory.free",
                             "timestamp", "serial", "vbios_version", "pstate", "utilization.gpu",
                             "ecc.mode.current", "clocks.mem", "clocks.max.mem", "compute_cap"}
# per-reason columns (`clocks_event_reasons.sw_power_cap`: Active / Not Active); drivers rename the
# queried `clocks_throttle_reasons.*` to `clocks_event_reasons.*` in the header
REASON_PREFIXES = ("clocks_event_reasons.", "clocks_throttle_reasons.")
NA = {"[N/A]", "N/A", "[Not Supported]", "Not Supported", "[Unknown Error]", "[Insufficient Permissions]", ""}
NUM_RE = re.compile(r"^([-+]?\d+(?:\.\d+)?)(?:\s*[A-Za-z%/]+)?$")


@dataclass
class GpuRecord:
    index: int | None
    name: str | None = None
    uuid: str | None = None
    bus_id: str | None = None
    driver: str | None = None
    memory_total_mib: float | None = None
    ecc_uncorrected: int | None = None
    ecc_corrected: int | None = None
    retired_pending: bool | None = None
    remapped_pending: bool | None = None
    remapped_failure: bool | None = None
    clocks_sm: float | None = None
    clocks_max_sm: float | None = None
    clock_event_reasons: str | None = None
    pcie_gen: int | None = None
    pcie_gen_max: int | None = None
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    temperature_c: float | None = None
    power_draw_w: float | None = None
    power_limit_w: float | None = None
    raw: dict[str, str | None] = field(default_factory=dict)


@dataclass
class GpuQuery:
    gpus: list[GpuRecord]

    @property
    def count(self) -> int:
        return len(self.gpus)

    def to_dict(self) -> dict[str, Any]:
        return {"count": self.count, "gpus": [vars(g) for g in self.gpus]}


def _number(v: str | None, key: str, line_no: int, line: str) -> float | None:
    if v is None:
        return None
    m = NUM_RE.match(v)
    if not m:
        raise ParseError(KIND, f"{key} value {v!r} is not a number", line_no, line)
    return float(m.group(1))


def _int(v: str | None, key: str, line_no: int, line: str) -> int | None:
    x = _number(v, key, line_no, line)
    return None if x is None else int(x)


def _flag(v: str | None, key: str, line_no: int, line: str) -> bool | None:
    if v is None:
        return None
    low = v.lower()
    if low in ("yes", "true", "1", "pending"):
        return True
    if low in ("no", "false", "0", "none"):
        return False
    raise ParseError(KIND, f"{key} value {v!r} is not Yes/No", line_no, line)


def parse_gpu_query(text: str) -> GpuQuery:
    lines = [ln for ln in strip_ansi(text).splitlines()]
    numbered = [(i + 1, ln) for i, ln in enumerate(lines) if ln.strip()]
    if not numbered:
        raise ParseError(KIND, "empty output", 1, "")
    hdr_no, hdr = numbered[0]
    keys = [re.sub(r"\s*\[[^\]]*\]\s*$", "", k.strip()) for k in hdr.split(",")]
    if not keys or not all(k in KNOWN or k.startswith(REASON_PREFIXES) for k in keys) or ("index" not in keys and "name" not in keys):
        raise ParseError(KIND, "expected the CSV header of nvidia-smi --query-gpu (e.g. 'index, name, ...')",
                         hdr_no, hdr)
    gpus: list[GpuRecord] = []
    for line_no, line in numbered[1:]:
        row = next(csv.reader([line], skipinitialspace=True))
        if len(row) != len(keys):
            raise ParseError(KIND, f"{len(row)} values for {len(keys)} header fields (truncated?)", line_no, line)
        vals: dict[str, str | None] = {k: (None if v.strip() in NA else v.strip()) for k, v in zip(keys, row)}
        reasons = vals.get("clocks_event_reasons.active") or vals.get("clocks_throttle_reasons.active")
        if reasons is not None and not re.fullmatch(r"0x[0-9A-Fa-f]+", reasons):
            raise ParseError(KIND, f"clock event reasons {reasons!r} is not a hex mask", line_no, line)
        gen = vals.get("pcie.link.gen.current") or vals.get("pcie.link.gen.gpucurrent")
        gen_max = vals.get("pcie.link.gen.max") or vals.get("pcie.link.gen.gpumax")
        gpus.append(GpuRecord(
            index=_int(vals.get("index"), "index", line_no, line),
            name=vals.get("name"), uuid=vals.get("uuid"), bus_id=vals.get("pci.bus_id"),
            driver=vals.get("driver_version"),
            memory_total_mib=_number(vals.get("memory.total"), "memory.total", line_no, line),
            ecc_uncorrected=_int(vals.get("ecc.errors.uncorrected.volatile.total"), "ecc uncorrected", line_no, line),
            ecc_corrected=_int(vals.get("ecc.errors.corrected.volatile.total"), "ecc corrected", line_no, line),
            retired_pending=_flag(vals.get("retired_pages.pending"), "retired_pages.pending", line_no, line),
            remapped_pending=_flag(vals.get("remapped_rows.pending"), "remapped_rows.pending", line_no, line),
            remapped_failure=_flag(vals.get("remapped_rows.failure"), "remapped_rows.failure", line_no, line),
            clocks_sm=_number(vals.get("clocks.sm"), "clocks.sm", line_no, line),
            clocks_max_sm=_number(vals.get("clocks.max.sm"), "clocks.max.sm", line_no, line),
            clock_event_reasons=reasons,
            pcie_gen=_int(gen, "pcie gen", line_no, line),
            pcie_gen_max=_int(gen_max, "pcie gen max", line_no, line),
            pcie_width=_int(vals.get("pcie.link.width.current"), "pcie width", line_no, line),
            pcie_width_max=_int(vals.get("pcie.link.width.max"), "pcie width max", line_no, line),
            temperature_c=_number(vals.get("temperature.gpu"), "temperature.gpu", line_no, line),
            power_draw_w=_number(vals.get("power.draw"), "power.draw", line_no, line),
            power_limit_w=_number(vals.get("power.limit"), "power.limit", line_no, line),
            raw=vals,
        ))
    return GpuQuery(gpus=gpus)
