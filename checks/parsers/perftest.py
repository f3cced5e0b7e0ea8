"""perftest bandwidth tests (`ib_write_bw`, `ib_read_bw`, `ib_send_bw`), client or server side.

The banner (`RDMA_Write BW Test`) and the settings block (`Device : mlx5_4`, `Number of qps`,
`Link type`, `Mtu`, two settings per line split by tabs) come first; with `--use_cuda` perftest
prints its CUDA set-up before it (`[pid = 18, dev = 0] device name = [Tesla T4]`). The result
table is `#bytes #iterations BW peak[Gb/sec] BW average[Gb/sec] MsgRate[Mpps]` (MB/sec without
`--report_gbits`), one row per size (`-a` sweeps sizes); warnings such as `Conflicting CPU frequency`
may land between the header and the rows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from checks.parsers.base import ParseError, strip_ansi

KIND = "perftest"
BANNER_RE = re.compile(r"^(RDMA_Write|RDMA_Read|Send|Atomic)\s+BW Test$")
SETTING_RE = re.compile(r"([A-Za-z][A-Za-z0-9 .*_-]*?)\s*:\s*([^\t]*?)\s*(?=\t|$)")
HEADER_RE = re.compile(r"^#bytes\s+#iterations\s+BW peak\[(Gb/sec|MB/sec)\]\s+BW average\[(?:Gb/sec|MB/sec)\]")
ROW_RE = re.compile(r"^(\d+)\s+(\d+)\s+(\d+(?:\.\d+)?)\s+(\d+(?:\.\d+)?)\s+(\d+(?:\.\d+)?)$")
GPU_RE = re.compile(r"device name = \[(.+)\]")


@dataclass
class PerftestRow:
    size: int
    iterations: int
    peak_gbps: float
    avg_gbps: float
    msg_rate_mpps: float


@dataclass
class Perftest:
    test: str | None = None  # RDMA_Write | RDMA_Read | Send
    device: str | None = None
    link_type: str | None = None  # IB | Ethernet
    qps: int | None = None
    mtu: str | None = None
    gpu: str | None = None  # set when the buffer was GPU memory (--use_cuda)
    server: bool = False
    settings: dict[str, str] = field(default_factory=dict)
    rows: list[PerftestRow] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def use_cuda(self) -> bool:
        return self.gpu is not None

    @property
    def bw_avg_gbps(self) -> float | None:
        """The figure to judge: the best average over the sizes run (the plateau of an `-a` sweep)."""
        return max((r.avg_gbps for r in self.rows), default=None)

    def to_dict(self) -> dict[str, Any]:
        return {"test": self.test, "device": self.device, "link_type": self.link_type, "qps": self.qps,
                "mtu": self.mtu, "gpu": self.gpu, "use_cuda": self.use_cuda, "server": self.server,
                "bw_avg_gbps": self.bw_avg_gbps, "rows": [vars(r) for r in self.rows],
                "warnings": self.warnings, "settings": self.settings}


def parse_perftest(text: str) -> Perftest:
    out = Perftest()
    lines = strip_ansi(text).splitlines()
    unit: str | None = None
    for i, raw in enumerate(lines):
        s = raw.strip()
        if not s or set(s) <= {"-"}:
            continue
        if (m := BANNER_RE.match(s)) is not None:
            out.test = m.group(1)
            continue
        if (m := GPU_RE.search(s)) is not None:
            out.gpu = m.group(1)
            continue
        if "Waiting for client" in s:
            out.server = True
            continue
        if s.startswith("WARNING") or s.startswith("Conflicting CPU frequency") or s.startswith("Requested mtu"):
            out.warnings.append(s)
            continue
        if (m := HEADER_RE.match(s)) is not None:
            unit = m.group(1)
            continue
        if unit is not None:
            m = ROW_RE.match(s)
            if m:
                scale = 1.0 if unit == "Gb/sec" else 8 / 1000  # MB/sec (10^6 bytes) to Gb/s
                out.rows.append(PerftestRow(int(m.group(1)), int(m.group(2)), float(m.group(3)) * scale,
                                            float(m.group(4)) * scale, float(m.group(5))))
                continue
            if s[0].isdigit():
                raise ParseError(KIND, "a result row without its five numbers (truncated?)", i + 1, raw)
            continue
        if out.test is not None and ":" in s and not s.startswith(("local address", "remote address", "GID")):
            for k, v in SETTING_RE.findall(raw):
                out.settings[k.strip()] = v.strip()
    st = out.settings
    out.device = st.get("Device")
    out.link_type = st.get("Link type")
    out.mtu = st.get("Mtu")
    if st.get("Number of qps", "").isdigit():
        out.qps = int(st["Number of qps"])
    if out.test is None:
        raise ParseError(KIND, "no '... BW Test' banner: not perftest bandwidth output", 1, lines[0] if lines else "")
    if not out.rows:
        raise ParseError(KIND, "no result rows under '#bytes #iterations BW peak ...' (the run failed or was cut)")
    return out
