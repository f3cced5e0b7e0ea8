"""BandwidthMap: what preflight measured, as versioned JSON; the planner's input.

Bandwidths are nccl-tests bus bandwidths in GB/s (busbw, which is comparable across
collective sizes and ranks): `intra_node_busbw_gbs` from all_reduce_perf over all GPUs of one
node, `inter_node_busbw_gbs` from all_reduce_perf over all GPUs of a node pair. The planner
derives the per-GPU network bandwidth as inter / gpus_per_node. Version 2 (`--level long`) adds the
measured all-to-all busbw (`alltoall_intra_busbw_gbs`, `alltoall_inter_busbw_gbs`, per node
`alltoall_busbw_gbs`) and per-NIC GPUDirect RDMA bandwidth in Gb/s (`NodeReport.rdma_gbps`, NIC ->
figure); version 1 files still load (those fields empty).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BWMAP_VERSION = 2
READABLE_VERSIONS = (1, 2)


class BandwidthMapError(ValueError):
    """A BandwidthMap file that cannot be used; the message names the file and field."""


@dataclass
class NodeReport:
    host: str
    gpus: int = 0
    gpu_model: str | None = None
    driver: str | None = None
    links: dict[str, dict[str, str]] = field(default_factory=dict)
    nvlink_groups: list[list[int]] = field(default_factory=list)
    gpu_nic: dict[str, str] = field(default_factory=dict)  # "GPU0" -> nearest NIC device ("mlx5_0")
    intra_busbw_gbs: float | None = None
    alltoall_busbw_gbs: float | None = None
    rdma_gbps: dict[str, float] = field(default_factory=dict)  # NIC -> ib_write_bw --use_cuda, Gb/s
    status: str = "pass"


@dataclass
class PairReport:
    a: str
    b: str
    busbw_gbs: float
    status: str = "pass"


@dataclass
class CheckResult:
    node: str
    check: str
    status: str  # pass | warn | fail
    value: Any = None
    threshold: Any = None
    message: str = ""


@dataclass
class BandwidthMap:
    nodes: dict[str, NodeReport] = field(default_factory=dict)
    pairs: list[PairReport] = field(default_factory=list)
    checks: list[CheckResult] = field(default_factory=list)
    intra_node_busbw_gbs: float | None = None
    inter_node_busbw_gbs: float | None = None
    all_nodes_busbw_gbs: float | None = None  # all_reduce over every healthy node at once (informational)
    alltoall_intra_busbw_gbs: float | None = None  # all_to_all_perf over one node's GPUs (median)
    alltoall_inter_busbw_gbs: float | None = None  # all_to_all_perf over a node pair (median)
    level: str = "quick"
    exclude: list[str] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)
    created: str | None = None
    source: str = "preflight"
    version: int = BWMAP_VERSION

    @property
    def ratio(self) -> float | None:
        if self.intra_node_busbw_gbs and self.inter_node_busbw_gbs:
            return self.intra_node_busbw_gbs / self.inter_node_busbw_gbs
        return None

    @property
    def healthy_hosts(self) -> list[str]:
        return [h for h in self.nodes if h not in self.exclude]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["ratio"] = self.ratio
        return d

    def save(self, path: str | Path) -> None:
        """Temp file then rename, never through or over a symlink or device (launcher.formats)."""
        from launcher.formats.files import atomic_write

        atomic_write(path, json.dumps(self.to_dict(), indent=2) + "\n", "bandwidth map")

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "bandwidth map") -> BandwidthMap:
        if not isinstance(data, dict):
            raise BandwidthMapError(f"{where}: expected a JSON object")
        if data.get("version") not in READABLE_VERSIONS:
            raise BandwidthMapError(f"{where}: version {data.get('version')!r} is not supported "
                                    f"(expected one of {', '.join(map(str, READABLE_VERSIONS))})")
        try:
            return cls(
                nodes={h: NodeReport(**n) for h, n in data.get("nodes", {}).items()},
                pairs=[PairReport(**p) for p in data.get("pairs", [])],
                checks=[CheckResult(**c) for c in data.get("checks", [])],
                intra_node_busbw_gbs=data.get("intra_node_busbw_gbs"),
                inter_node_busbw_gbs=data.get("inter_node_busbw_gbs"),
                all_nodes_busbw_gbs=data.get("all_nodes_busbw_gbs"),
                alltoall_intra_busbw_gbs=data.get("alltoall_intra_busbw_gbs"),
                alltoall_inter_busbw_gbs=data.get("alltoall_inter_busbw_gbs"),
                level=data.get("level", "quick"),
                exclude=list(data.get("exclude", [])),
                commands=list(data.get("commands", [])),
                created=data.get("created"),
                source=data.get("source", "preflight"),
            )
        except (TypeError, AttributeError) as exc:
            raise BandwidthMapError(f"{where}: malformed ({exc})") from None

    @classmethod
    def load(cls, path: str | Path) -> BandwidthMap:
        from launcher.errors import UserError
        from launcher.formats.files import read_text

        try:
            data = json.loads(read_text(path, "bandwidth map"))
        except UserError as exc:
            raise BandwidthMapError(str(exc)) from None
        except json.JSONDecodeError as exc:
            raise BandwidthMapError(f"{path}: not JSON (line {exc.lineno}: {exc.msg})") from None
        except RecursionError:
            raise BandwidthMapError(f"{path}: JSON nested too deeply") from None
        return cls.from_dict(data, where=str(path))
