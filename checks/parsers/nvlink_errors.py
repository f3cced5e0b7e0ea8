"""NVLink error counters and link states: `nvidia-smi nvlink -e` and `dcgmi nvlink --link-status`.

`nvidia-smi nvlink -e` prints, per GPU, `GPU n: NAME (UUID: ...)` then `Link k: Replay Errors: 0`,
`Link k: Recovery Errors: 0`, `Link k: CRC Errors: 0` (newer drivers add more counters); a pasted
output may elide links with `[...]`. A GPU whose links are all down prints
`NVML: Unable to retrieve NVLink information as all links are inActive` instead of its links.
`dcgmi nvlink --link-status` prints `gpuId n:` followed by one letter per link (U=Up, D=Down,
X=Disabled, _=Not Supported), then the NvSwitches and a `Key:` legend.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from checks.parsers.base import ParseError, strip_ansi

KIND = "nvlink-errors"
GPU_RE = re.compile(r"^GPU\s+(\d+):\s*(.*?)\s*(?:\(UUID:\s*([^)]*)\))?\s*$")
COUNTER_RE = re.compile(r"^Link\s+(\d+):\s*([A-Za-z][A-Za-z .-]*?)\s*:\s*(\d+|N/A)\s*$")
INACTIVE_RE = re.compile(r"all links are in ?active", re.I)
DCGM_GPU_RE = re.compile(r"^gpuId\s+(\d+):$")
STATES = {"U": "up", "D": "down", "X": "disabled", "_": "unsupported"}


@dataclass
class NvlinkErrGpu:
    index: int
    name: str | None = None
    uuid: str | None = None
    counters: dict[int, dict[str, int]] = field(default_factory=dict)  # link -> {"Replay Errors": n}
    link_states: dict[int, str] = field(default_factory=dict)  # link -> up | down | disabled | unsupported
    all_inactive: bool = False

    @property
    def down(self) -> list[int]:
        return [k for k, v in self.link_states.items() if v == "down"]


@dataclass
class NvlinkErrors:
    source: str  # nvidia-smi | dcgmi
    gpus: list[NvlinkErrGpu]
    elided: bool = False  # the paste left links out (`[...]`)

    def gpu(self, index: int) -> NvlinkErrGpu | None:
        return next((g for g in self.gpus if g.index == index), None)

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "elided": self.elided,
                "gpus": [{"index": g.index, "name": g.name, "uuid": g.uuid, "all_inactive": g.all_inactive,
                          "counters": {str(k): v for k, v in g.counters.items()},
                          "link_states": {str(k): v for k, v in g.link_states.items()},
                          "down": g.down, "errors_total": sum(sum(c.values()) for c in g.counters.values())}
                         for g in self.gpus]}


def parse_nvlink_errors(text: str) -> NvlinkErrors:
    lines = strip_ansi(text).splitlines()
    if any(DCGM_GPU_RE.match(ln.strip()) for ln in lines):
        return _parse_dcgmi(lines)
    out = NvlinkErrors(source="nvidia-smi", gpus=[])
    for i, raw in enumerate(lines):
        s = raw.strip()
        if not s:
            continue
        if s in ("[...]", "...", "…"):
            out.elided = True
            continue
        if (m := GPU_RE.match(s)) is not None:
            out.gpus.append(NvlinkErrGpu(index=int(m.group(1)), name=m.group(2), uuid=m.group(3)))
            continue
        if not out.gpus:
            raise ParseError(KIND, "expected 'GPU n: NAME (UUID: ...)' first", i + 1, raw)
        if INACTIVE_RE.search(s):
            out.gpus[-1].all_inactive = True
            continue
        m = COUNTER_RE.match(s)
        if not m and not s.startswith("Link "):
            continue        # not nvidia-smi's (stderr interleaved into the capture)
        if not m:
            raise ParseError(KIND, "expected 'Link n: <Counter> Errors: <count>'", i + 1, raw)
        if m.group(3) != "N/A":
            out.gpus[-1].counters.setdefault(int(m.group(1)), {})[m.group(2)] = int(m.group(3))
    if not out.gpus:
        raise ParseError(KIND, "no 'GPU n:' line: not nvidia-smi nvlink -e output", 1, lines[0] if lines else "")
    return out


def _parse_dcgmi(lines: list[str]) -> NvlinkErrors:
    out = NvlinkErrors(source="dcgmi", gpus=[])
    section = ""
    for i, raw in enumerate(lines):
        s = raw.strip()
        if s in ("GPUs:", "NvSwitches:"):
            section = s
            continue
        if section != "GPUs:" or not s:
            continue
        if s in ("[...]", "...", "…"):
            out.elided = True
            continue
        if (m := DCGM_GPU_RE.match(s)) is not None:
            out.gpus.append(NvlinkErrGpu(index=int(m.group(1))))
            continue
        letters = s.split()
        if not any(x in STATES for x in letters):
            continue        # no link state at all: not dcgmi's (stderr interleaved into the capture)
        if not out.gpus or not all(x in STATES for x in letters):
            raise ParseError(KIND, "expected a row of link states (U, D, X, _) under 'gpuId n:'", i + 1, raw)
        out.gpus[-1].link_states = {k: STATES[x] for k, x in enumerate(letters)}
    return out
