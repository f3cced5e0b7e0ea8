"""`nvidia-smi nvlink -s` (`--status`): per GPU, each NVLink's speed or `<inactive>`.

Format (documented by NVIDIA and shown in public runbooks):
    GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-...)
             Link 0: 26.562 GB/s
             Link 1: <inactive>
A GPU without NVLink prints its GPU line and no Link lines. A GPU whose links are all down prints
`NVML: Unable to retrieve NVLink information as all links are inActive` (the driver's spelling)
instead: `all_inactive`. A paste that elides lines with `...` parses as far as it goes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from checks.parsers.base import ParseError, strip_ansi

KIND = "nvlink"
GPU_RE = re.compile(r"^GPU\s+(\d+):\s*(.*?)\s*(?:\(UUID:\s*([^)]*)\))?\s*$")
LINK_RE = re.compile(r"^Link\s+(\d+):\s*(?:(<inactive>)|([-+]?\d+(?:\.\d+)?)\s*([GM]B/s))\s*$")


@dataclass
class NvlinkGpu:
    index: int
    name: str
    uuid: str | None = None
    links: dict[int, float | None] = field(default_factory=dict)  # GB/s, None = inactive
    all_inactive: bool = False  # NVML could not read any link: every NVLink of this GPU is down
    cut: bool = False  # the paste elided the rest of this GPU's links (`...`): its link count is unknown

    @property
    def active(self) -> int:
        return sum(1 for v in self.links.values() if v)

    @property
    def inactive(self) -> list[int]:
        return [k for k, v in self.links.items() if not v]


@dataclass
class NvlinkStatus:
    gpus: list[NvlinkGpu]

    def to_dict(self) -> dict[str, Any]:
        return {"gpus": [{**vars(g), "links": {str(k): v for k, v in g.links.items()},
                          "active": g.active, "inactive": g.inactive} for g in self.gpus]}


def parse_nvlink_status(text: str) -> NvlinkStatus:
    gpus: list[NvlinkGpu] = []
    for i, raw in enumerate(strip_ansi(text).splitlines()):
        s = raw.strip()
        if not s:
            continue
        if s in ("...", "[...]", "…"):
            if gpus:
                gpus[-1].cut = True
            continue
        if gpus and re.search(r"all links are in ?active", s, re.I):
            gpus[-1].all_inactive = True
            continue
        m = GPU_RE.match(s)
        if m:
            gpus.append(NvlinkGpu(index=int(m.group(1)), name=m.group(2), uuid=m.group(3)))
            continue
        m = LINK_RE.match(s)
        if m:
            if not gpus:
                raise ParseError(KIND, "Link line before any GPU line", i + 1, raw)
            if m.group(2):
                speed = None
            else:
                speed = float(m.group(3)) / (1000.0 if m.group(4) == "MB/s" else 1.0)
            gpus[-1].links[int(m.group(1))] = speed
            continue
        raise ParseError(KIND, "expected 'GPU n: ...' or 'Link n: <speed>|<inactive>'", i + 1, raw)
    return NvlinkStatus(gpus=gpus)
