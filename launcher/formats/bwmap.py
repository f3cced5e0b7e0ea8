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
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BWMAP_VERSION = 2
READABLE_VERSIONS = (1, 2)


class BandwidthMapError(ValueError):
    """A BandwidthMap file that cannot be used; the message names the file and field."""


class _Check:
    """Type and range checks of a BandwidthMap read from JSON, each failure one BandwidthMapError
    naming the file and the field: a bandwidth is a finite number >= 0 (not NaN, not a string), a
    GPU count an integer >= 0, a host list a list (`exclude: "n1"` is not the hosts "n" and "1")."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, path: str, what: str) -> BandwidthMapError:
        return BandwidthMapError(f"{self.where}: {path}: {what}")

    def mapping(self, value: Any, path: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(path, f"{_show(value)} is not a JSON object")
        return value

    def items(self, value: Any, path: str) -> list[Any]:
        if not isinstance(value, list):
            raise self.fail(path, f"{_show(value)} is not a list")
        return value

    def text(self, value: Any, path: str) -> str:
        if not isinstance(value, str):
            raise self.fail(path, f"{_show(value)} is not text")
        return value

    def texts(self, value: Any, path: str) -> list[str]:
        return [self.text(x, f"{path}[{i}]") for i, x in enumerate(self.items(value, path))]

    def bandwidth(self, value: Any, path: str, required: bool = False) -> float | None:
        if value is None and not required:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise self.fail(path, f"{_show(value)} is not a bandwidth (a finite number >= 0, GB/s)")
        return float(value)

    def count(self, value: Any, path: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self.fail(path, f"{_show(value)} is not a count (an integer >= 0)")
        return value

    def status(self, value: Any, path: str) -> None:
        if value not in ("pass", "warn", "fail"):
            raise self.fail(path, f"{_show(value)} is not pass, warn or fail")

    def node(self, n: NodeReport, path: str) -> None:
        self.text(n.host, f"{path}.host")
        self.count(n.gpus, f"{path}.gpus")
        for name in ("gpu_model", "driver"):
            if getattr(n, name) is not None:
                self.text(getattr(n, name), f"{path}.{name}")
        for a, row in self.mapping(n.links, f"{path}.links").items():
            for b, kind in self.mapping(row, f"{path}.links.{a}").items():
                self.text(kind, f"{path}.links.{a}.{b}")
        for i, grp in enumerate(self.items(n.nvlink_groups, f"{path}.nvlink_groups")):
            for j, g in enumerate(self.items(grp, f"{path}.nvlink_groups[{i}]")):
                self.count(g, f"{path}.nvlink_groups[{i}][{j}]")
        for gpu, nic in self.mapping(n.gpu_nic, f"{path}.gpu_nic").items():
            self.text(nic, f"{path}.gpu_nic.{gpu}")
        n.intra_busbw_gbs = self.bandwidth(n.intra_busbw_gbs, f"{path}.intra_busbw_gbs")
        n.alltoall_busbw_gbs = self.bandwidth(n.alltoall_busbw_gbs, f"{path}.alltoall_busbw_gbs")
        for nic, gbps in self.mapping(n.rdma_gbps, f"{path}.rdma_gbps").items():
            n.rdma_gbps[nic] = self.bandwidth(gbps, f"{path}.rdma_gbps.{nic}", required=True)  # type: ignore[assignment]
        self.status(n.status, f"{path}.status")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


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
        v = _Check(where)
        nodes = v.mapping(data.get("nodes", {}), "nodes")
        try:
            out = cls(
                nodes={v.text(h, "nodes"): NodeReport(**v.mapping(n, f"nodes.{h}")) for h, n in nodes.items()},
                pairs=[PairReport(**v.mapping(p, f"pairs[{i}]")) for i, p in enumerate(v.items(data.get("pairs", []),
                                                                                            "pairs"))],
                checks=[CheckResult(**v.mapping(c, f"checks[{i}]")) for i, c in enumerate(v.items(data.get("checks", []),
                                                                                                 "checks"))],
                intra_node_busbw_gbs=v.bandwidth(data.get("intra_node_busbw_gbs"), "intra_node_busbw_gbs"),
                inter_node_busbw_gbs=v.bandwidth(data.get("inter_node_busbw_gbs"), "inter_node_busbw_gbs"),
                all_nodes_busbw_gbs=v.bandwidth(data.get("all_nodes_busbw_gbs"), "all_nodes_busbw_gbs"),
                alltoall_intra_busbw_gbs=v.bandwidth(data.get("alltoall_intra_busbw_gbs"), "alltoall_intra_busbw_gbs"),
                alltoall_inter_busbw_gbs=v.bandwidth(data.get("alltoall_inter_busbw_gbs"), "alltoall_inter_busbw_gbs"),
                level=v.text(data.get("level", "quick"), "level"),
                exclude=v.texts(data.get("exclude", []), "exclude"),
                commands=v.texts(data.get("commands", []), "commands"),
                created=None if data.get("created") is None else v.text(data.get("created"), "created"),
                source=v.text(data.get("source", "preflight"), "source"),
            )
        except TypeError as exc:
            raise BandwidthMapError(f"{where}: malformed ({exc})") from None
        for h, n in out.nodes.items():
            v.node(n, f"nodes.{h}")
        for i, p in enumerate(out.pairs):
            v.text(p.a, f"pairs[{i}].a"), v.text(p.b, f"pairs[{i}].b")
            p.busbw_gbs = v.bandwidth(p.busbw_gbs, f"pairs[{i}].busbw_gbs", required=True)  # type: ignore[assignment]
            v.status(p.status, f"pairs[{i}].status")
        for i, c in enumerate(out.checks):
            v.text(c.node, f"checks[{i}].node"), v.text(c.check, f"checks[{i}].check"), v.text(c.message, f"checks[{i}].message")
            v.status(c.status, f"checks[{i}].status")
        return out

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
