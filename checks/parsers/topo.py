"""`nvidia-smi topo -m` (and `-mp`): the GPU/NIC link matrix, affinities and what follows from it.

Handles tab- or space-aligned output, ANSI underline escapes around the header, NIC columns named
`NICn` (with a "NIC Legend") or by device (`mlx5_0`, older drivers), NIC rows with or without
trailing empty cells, the optional `GPU NUMA ID` column, and the older legend wording. Derived
here because the planner needs them: NVLink groups, NVLinks per GPU pair and each GPU's nearest NIC.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from checks.parsers.base import ParseError, strip_ansi

KIND = "topo"
AFFINITY_COLUMNS = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")
NV_RE = re.compile(r"^NV(\d+)$")
GLUED_RE = re.compile(r"(GPU\d+|NIC\d+)")
# PCIe distance, nearest first ("SOC" is the pre-NODE/SYS name for crossing the CPU socket link).
PCIE_RANK = {"PIX": 0, "PXB": 1, "PHB": 2, "NODE": 3, "SYS": 4, "SOC": 4}


def valid_code(code: str) -> bool:
    return code == "X" or code in PCIE_RANK or bool(NV_RE.match(code))


@dataclass
class TopoGpu:
    index: int
    name: str
    cpu_affinity: str | None = None
    numa_affinity: str | None = None
    gpu_numa_id: str | None = None


@dataclass
class TopoNic:
    name: str  # the column name as printed: NIC0 or mlx5_0
    device: str  # the device from the NIC Legend (mlx5_0), else the column name


@dataclass
class Topology:
    gpus: list[TopoGpu]
    nics: list[TopoNic]
    links: dict[str, dict[str, str]]
    nvlink_groups: list[list[int]] = field(default_factory=list)
    nvlinks: dict[str, dict[str, int]] = field(default_factory=dict)
    nearest_nic: dict[str, str] = field(default_factory=dict)

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)

    def signature(self) -> str:
        """A compact description of the GPU-GPU matrix, for comparing nodes."""
        names = [g.name for g in self.gpus]
        return ";".join(",".join(self.links[a][b] for b in names) for a in names)

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpus": [vars(g) for g in self.gpus],
            "nics": [vars(n) for n in self.nics],
            "links": self.links,
            "nvlink_groups": self.nvlink_groups,
            "nvlinks": self.nvlinks,
            "nearest_nic": self.nearest_nic,
        }


def _header_columns(line: str) -> tuple[list[str], list[str]]:
    """Device column names and affinity column names, in order."""
    first = len(line)
    affinity: list[tuple[int, str]] = []
    for col in AFFINITY_COLUMNS:
        at = line.find(col)
        if at >= 0:
            affinity.append((at, col))
            first = min(first, at)
    devices: list[str] = []
    for tok in line[:first].split():
        glued = GLUED_RE.findall(tok)
        if len(glued) > 1 and "".join(glued) == tok:
            devices.extend(glued)  # "NIC8NIC9" as pasted by some users
        else:
            devices.append(tok)
    return devices, [c for _, c in sorted(affinity)]


def parse_topo(text: str) -> Topology:
    lines = strip_ansi(text).splitlines()
    header_at = next((i for i, ln in enumerate(lines) if ln.strip()), None)
    if header_at is None:
        raise ParseError(KIND, "empty output", 1, "")
    header = lines[header_at]
    devices, affinity_cols = _header_columns(header)
    if not devices or devices[0] != "GPU0" or len(set(devices)) != len(devices):
        raise ParseError(KIND, "expected a header row of device columns starting with GPU0",
                         header_at + 1, header)
    for d in devices:
        if not re.fullmatch(r"[A-Za-z][\w.-]*", d):
            raise ParseError(KIND, f"bad column name {d!r}", header_at + 1, header)
    gpu_names = [d for d in devices if re.fullmatch(r"GPU\d+", d)]
    n = len(devices)

    links: dict[str, dict[str, str]] = {}
    extras: dict[str, list[str]] = {}
    last_line = header_at + 1
    i = header_at + 1
    while i < len(lines):
        raw = lines[i]
        toks = raw.split()
        if not toks:
            if links:
                break
            i += 1
            continue
        label = toks[0]
        if label not in devices:
            if links and label.startswith("Legend"):
                break
            raise ParseError(KIND, f"row label {label!r} is not one of the header's columns", i + 1, raw)
        if label in links:
            raise ParseError(KIND, f"row {label} appears twice", i + 1, raw)
        cells = toks[1:1 + n]
        if len(cells) < n:
            raise ParseError(KIND, f"row {label} has {len(cells)} link cells, expected {n} (truncated?)",
                             i + 1, raw)
        for col, code in zip(devices, cells):
            if not valid_code(code):
                raise ParseError(KIND, f"unknown link code {code!r} in column {col}", i + 1, raw)
            if (col == label) != (code == "X"):
                raise ParseError(KIND, f"'X' must mark exactly the diagonal ({label}/{col})", i + 1, raw)
        links[label] = dict(zip(devices, cells))
        extras[label] = toks[1 + n:]
        last_line = i + 1
        i += 1
    missing = [d for d in devices if d not in links]
    if missing:
        raise ParseError(KIND, f"rows missing for {', '.join(missing)} (truncated output?)",
                         last_line, lines[last_line - 1] if last_line - 1 < len(lines) else "")

    legend: dict[str, str] = {}
    for j in range(i, len(lines)):
        m = re.match(r"^\s*(NIC\d+)\s*:\s*(\S+)\s*$", lines[j])
        if m:
            legend[m.group(1)] = m.group(2)

    gpus: list[TopoGpu] = []
    for name in gpu_names:
        vals = extras[name]
        info = dict(zip(affinity_cols, vals))
        gpus.append(TopoGpu(index=int(name[3:]), name=name, cpu_affinity=info.get("CPU Affinity"),
                            numa_affinity=info.get("NUMA Affinity"), gpu_numa_id=info.get("GPU NUMA ID")))
    nics = [TopoNic(name=d, device=legend.get(d, d)) for d in devices if d not in gpu_names]
    topo = Topology(gpus=gpus, nics=nics, links=links)
    _derive(topo)
    return topo


def _derive(topo: Topology) -> None:
    names = [g.name for g in topo.gpus]
    adj: dict[str, set[str]] = {a: set() for a in names}
    for a in names:
        for b in names:
            m = NV_RE.match(topo.links[a][b])
            if m:
                topo.nvlinks.setdefault(a, {})[b] = int(m.group(1))
                adj[a].add(b)
                adj[b].add(a)
    seen: set[str] = set()
    for a in names:
        if a in seen or not adj[a]:
            continue
        comp, stack = set(), [a]
        while stack:
            x = stack.pop()
            if x in comp:
                continue
            comp.add(x)
            stack.extend(adj[x] - comp)
        seen |= comp
        topo.nvlink_groups.append(sorted(int(x[3:]) for x in comp))
    for g in names:
        best: tuple[int, int] | None = None
        for k, nic in enumerate(topo.nics):
            rank = PCIE_RANK.get(topo.links[g][nic.name])
            if rank is not None and (best is None or (rank, k) < best):
                best = (rank, k)
        if best is not None:
            topo.nearest_nic[g] = topo.nics[best[1]].device
