"""Full `nvidia-smi -q` (or `-q -d ECC,PAGE_RETIREMENT,ROW_REMAPPER`): per GPU, the memory-health sections.

The output is an indented tree: `GPU 00000000:19:00.0` opens a GPU, `    ECC Errors` opens a
section, `        Volatile` a subsection, `            DRAM Uncorrectable : 0` a value. Kept per GPU:
the product name, ECC counters (Hopper splits `SRAM Uncorrectable` into `Parity` and `SEC-DED`:
summed), `SRAM Threshold Exceeded`, Retired Pages (numbers before Ampere, `N/A` after), Remapped
Rows (Ampere and later) and its bank histogram. A fragment holding only an `ECC Errors` block
parses as one GPU with no bus id. `Unable to determine the device handle for GPU<bus>: <error>`
(a GPU the driver lost, e.g. after Xid 79) is recorded as an inaccessible GPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from checks.parsers.base import ParseError, strip_ansi

KIND = "gpu-q"
GPU_RE = re.compile(r"^GPU ([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f])\s*$")
KV_RE = re.compile(r"^(\s*)([^:]+?)\s*:\s*(.*)$")
LOST_RE = re.compile(r"Unable to determine the device handle for GPU\s*([0-9A-Fa-f:.]+):\s*(.*)$")
SECTIONS = ("ECC Errors/", "Retired Pages/", "Remapped Rows/", "Product Name")
NA = {"N/A", "[N/A]", "Not Supported", "[Not Supported]", ""}


@dataclass
class GpuHealth:
    bus_id: str | None
    name: str | None = None
    values: dict[str, str] = field(default_factory=dict)  # "ECC Errors/Volatile/DRAM Uncorrectable" -> "0"

    def _int(self, *paths: str) -> int | None:
        found = [self.values[p] for p in paths if p in self.values and self.values[p] not in NA]
        nums = [int(m.group(0)) for v in found if (m := re.match(r"\d+", v))]
        return sum(nums) if nums else None

    def _flag(self, path: str) -> bool | None:
        v = self.values.get(path)
        return None if v is None or v in NA else v.strip().lower() in ("yes", "true")

    def sram_uncorrectable(self, scope: str) -> int | None:
        base = f"ECC Errors/{scope}/SRAM Uncorrectable"
        return self._int(base, base + " Parity", base + " SEC-DED")

    def dram_uncorrectable(self, scope: str) -> int | None:
        return self._int(f"ECC Errors/{scope}/DRAM Uncorrectable")

    def summary(self) -> dict[str, Any]:
        hist = {k.rsplit("/", 1)[1]: self._int(k) for k in self.values
                if k.startswith("Remapped Rows/Bank Remap Availability Histogram/")}
        return {
            "bus_id": self.bus_id, "name": self.name,
            "sram_uncorrectable_volatile": self.sram_uncorrectable("Volatile"),
            "sram_uncorrectable_aggregate": self.sram_uncorrectable("Aggregate"),
            "sram_threshold_exceeded": self._flag("ECC Errors/Aggregate/SRAM Threshold Exceeded"),
            "dram_uncorrectable_volatile": self.dram_uncorrectable("Volatile"),
            "dram_uncorrectable_aggregate": self.dram_uncorrectable("Aggregate"),
            "dram_correctable_volatile": self._int("ECC Errors/Volatile/DRAM Correctable"),
            "retired_single_bit": self._int("Retired Pages/Single Bit ECC"),
            "retired_double_bit": self._int("Retired Pages/Double Bit ECC"),
            "retired_pending": self._flag("Retired Pages/Pending Page Blacklist"),
            "remapped_correctable": self._int("Remapped Rows/Correctable Error"),
            "remapped_uncorrectable": self._int("Remapped Rows/Uncorrectable Error"),
            "remapped_pending": self._flag("Remapped Rows/Pending"),
            "remapping_failure": self._flag("Remapped Rows/Remapping Failure Occurred"),
            "bank_histogram": hist,
        }


@dataclass
class GpuQ:
    driver: str | None = None
    gpus: list[GpuHealth] = field(default_factory=list)
    inaccessible: dict[str, str] = field(default_factory=dict)  # bus id -> the error nvidia-smi printed

    def to_dict(self) -> dict[str, Any]:
        return {"driver": self.driver, "count": len(self.gpus), "gpus": [g.summary() for g in self.gpus],
                "inaccessible": self.inaccessible}


def parse_gpu_q(text: str) -> GpuQ:
    out = GpuQ()
    gpu: GpuHealth | None = None
    stack: list[tuple[int, str]] = []  # (indent, section name)
    lines = strip_ansi(text).splitlines()
    for raw in lines:
        if not raw.strip() or raw.strip().startswith("="):
            continue
        if (m := LOST_RE.search(raw)) is not None:
            out.inaccessible[m.group(1)] = m.group(2).strip()
            continue
        raw = raw.expandtabs(4).rstrip("\r")   # nvidia-smi indents by 4 spaces; a capture may hold tabs
        if (m := GPU_RE.match(raw.strip())) is not None and not raw.startswith(" "):
            gpu, stack = GpuHealth(bus_id=m.group(1)), []
            out.gpus.append(gpu)
            continue
        indent = len(raw) - len(raw.lstrip())
        kv = KV_RE.match(raw)
        key = (kv.group(2) if kv else raw).strip()
        if indent == 0:
            # Top-level lines are the header's ("Driver Version : ...") or not nvidia-smi's at all
            # (stderr interleaved into the capture): neither opens nor closes a GPU's sections, so a
            # stray line inside "Remapped Rows" cannot hide the rows that follow it.
            if kv is not None and key == "Driver Version":
                out.driver = kv.group(3).strip()
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if kv is None:
            stack.append((indent, key))
            continue
        if gpu is None:  # a fragment without its GPU line
            gpu = GpuHealth(bus_id=None)
            out.gpus.append(gpu)
        path = "/".join([s for _, s in stack] + [key])
        gpu.values[path] = kv.group(3).strip()
        if path == "Product Name":
            gpu.name = kv.group(3).strip()
    # a fragment without its GPU line counts only when it holds a section nvidia-smi -q prints
    out.gpus = [g for g in out.gpus if g.bus_id or any(k.startswith(SECTIONS) for k in g.values)]
    if not out.gpus and not out.inaccessible:
        raise ParseError(KIND, "no 'GPU <bus id>' block: not nvidia-smi -q output", 1, lines[0] if lines else "")
    return out
