"""preflight-plan.json: the plan's own communication groups, what the time model assumed for each,
and (once `launch preflight --plan` or the job's gate ran them) what they measured.

One document travels both ways: the command (which knows the plan and its time model) writes every
group with its collective, message size and assumed time; the probe worker (checks.groupprobe,
which knows only this file) fills in the measured time of each group and the hosts its ranks ran
on; the gate, `launch diagnose` and `launch calibrate` read it back. Torch-free and plan-free, so
checks, the trainer's job and the commands share it.

A group is "slow" when its measured bandwidth is below (1 - tolerance) of what the plan assumed:
ratio = assumed time / measured time < 1 - tolerance.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from launcher.errors import UserError

KIND = "launch4d-plan-preflight"
VERSION = 1
#: Group kinds in the order they are probed and reported (the order a step meets them).
KINDS = ("tp", "cp", "ep", "pp", "dp")
KIND_NAMES = {"tp": "TP", "cp": "CP", "ep": "EP", "pp": "PP neighbours", "dp": "DP/ZeRO shard"}
OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv")
DEFAULT_TOLERANCE = 0.3


def bus_factor(op: str, size: int) -> float:
    """nccl-tests' busbw = algbw × this: what each rank's link carries per byte of the message."""
    if op == "send_recv":
        return 1.0
    if op == "all_reduce":
        return 2 * (size - 1) / size
    return (size - 1) / size


@dataclass
class ProbeGroup:
    """One communication group of the plan and its collective; measured fields None until it ran."""

    kind: str                     # tp, cp, ep, pp, dp (KINDS)
    index: int                    # the group's number within its kind
    ranks: list[int]
    nodes: list[int]              # each rank's node index in the plan
    op: str                       # OPS
    nbytes: int                   # one call's message (nccl-tests' size; per direction for send_recv)
    phase: int                    # groups of one kind and phase run at the same time
    link: str                     # "intra-node" or "inter-node (N nodes)"
    assumed_s: float              # the plan's time model for one call
    assumed_busbw_gbs: float      # the bus bandwidth the model charges this group
    measured_s: float | None = None   # median over iterations of the group's slowest rank
    samples_s: list[float] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)   # where each rank ran (the worker fills it in)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def measured_busbw_gbs(self) -> float | None:
        if not self.measured_s:
            return None
        return self.nbytes / self.measured_s * bus_factor(self.op, self.size) / 1e9

    @property
    def ratio(self) -> float | None:
        """Assumed time / measured time: 1 as the plan assumed, 0.5 half as fast."""
        return self.assumed_s / self.measured_s if self.measured_s else None

    def slow(self, tolerance: float) -> bool:
        r = self.ratio
        return r is not None and r < 1 - tolerance

    def where(self, node_names: list[str] | None = None) -> str:
        """ranks 2,3 on n2 (intra-node): the words a person finds the group by. Hosts are where the
        ranks ran, else the plan's node names (`node_names`), else node indices."""
        names = node_names or []
        hosts = list(dict.fromkeys(self.hosts or [names[n] if n < len(names) else f"node{n}" for n in self.nodes]))
        return f"ranks {','.join(map(str, self.ranks))} on {','.join(hosts)} ({self.link})"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["measured_busbw_gbs"] = _round(self.measured_busbw_gbs)
        d["ratio"] = _round(self.ratio, 4)
        return d


@dataclass
class GroupProbe:
    """Every group of one plan (the spec), and once measured, the results."""

    plan: str                     # the plan's name
    world_size: int
    nodes: int
    gpus_per_node: int
    hosts: list[str]              # node names in the plan's node order (empty when the plan has none)
    tolerance: float
    iters: int
    warmup: int
    groups: list[ProbeGroup]
    predicted_step_s: float       # the time model's step for the plan at its assumed bandwidths
    backend: str | None = None    # gloo / nccl, once run
    created: str | None = None
    measured_step_s: float | None = None   # the same step recomputed with the measured bandwidths
    planned_step_s: float | None = None    # the step time plan.json was chosen on (its estimate, as saved)
    error: str | None = None      # why the probe did not measure (the worker's one line)

    def kinds(self) -> list[str]:
        present = {g.kind for g in self.groups}
        return [k for k in KINDS if k in present]

    def of(self, kind: str) -> list[ProbeGroup]:
        return [g for g in self.groups if g.kind == kind]

    @property
    def measured(self) -> bool:
        return bool(self.groups) and all(g.measured_s for g in self.groups)

    def slow_groups(self, tolerance: float | None = None) -> list[ProbeGroup]:
        tol = self.tolerance if tolerance is None else tolerance
        return [g for g in self.groups if g.slow(tol)]

    def suspect_hosts(self, tolerance: float | None = None) -> dict[str, list[ProbeGroup]]:
        """The hosts to blame for the slow groups: those in the most slow groups (one host shared by
        every slow group; all of a group's hosts when nothing tells them apart), each with its groups."""
        slow = self.slow_groups(tolerance)
        count: Counter[str] = Counter()
        for g in slow:
            count.update(set(_hosts(self, g)))
        if not count:
            return {}
        top = max(count.values())
        return {h: [g for g in slow if h in _hosts(self, g)] for h in sorted(count) if count[h] == top}

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "groups"}
        return {"kind": KIND, "version": VERSION, **d, "groups": [g.to_dict() for g in self.groups]}

    def save(self, path: str | Path) -> None:
        from launcher.formats.files import atomic_write

        atomic_write(path, json.dumps(self.to_dict(), indent=1) + "\n", "plan preflight")

    @classmethod
    def from_dict(cls, data: Any, where: str = "plan preflight") -> GroupProbe:
        if not isinstance(data, dict) or data.get("kind") != KIND:
            raise UserError(f"{where}: not a plan preflight file (kind {KIND!r}; `launch preflight --plan` writes one)")
        if data.get("version") != VERSION:
            raise UserError(f"{where}: version {data.get('version')!r} is not supported (expected {VERSION})")
        try:
            groups = [_group(g) for g in data.get("groups") or []]
            top: dict[str, Any] = {f.name: data.get(f.name) for f in fields(cls) if f.name != "groups"}
            probe = cls(**{**top, "groups": groups})
            _check(probe)
        except (TypeError, ValueError, KeyError) as exc:
            raise UserError(f"{where}: {exc}") from None
        return probe

    @classmethod
    def load(cls, path: str | Path) -> GroupProbe:
        from launcher.formats.files import read_text

        try:
            data = json.loads(read_text(path, "plan preflight"))
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}: not JSON (line {exc.lineno}: {exc.msg})") from None
        return cls.from_dict(data, str(path))


def _hosts(probe: GroupProbe, g: ProbeGroup) -> list[str]:
    if g.hosts:
        return g.hosts
    return [probe.hosts[n] if n < len(probe.hosts) else f"node{n}" for n in g.nodes]


def _group(d: Any) -> ProbeGroup:
    if not isinstance(d, dict):
        raise ValueError(f"groups: entries are mappings, not {type(d).__name__}")
    names = {f.name for f in fields(ProbeGroup)}
    return ProbeGroup(**{k: v for k, v in d.items() if k in names})


def _check(p: GroupProbe) -> None:
    """What the worker relies on: integer ranks inside the world, known kinds and ops, positive sizes."""
    if not isinstance(p.world_size, int) or p.world_size < 1:
        raise ValueError(f"world_size: {p.world_size!r} is not a positive integer")
    if not isinstance(p.tolerance, (int, float)) or not 0 <= p.tolerance < 1:
        raise ValueError(f"tolerance: {p.tolerance!r} is not in [0, 1)")
    if not isinstance(p.iters, int) or not isinstance(p.warmup, int) or p.iters < 1 or p.warmup < 0:
        raise ValueError("iters (>= 1) and warmup (>= 0) are integers")
    for i, g in enumerate(p.groups):
        at = f"groups[{i}]"
        if g.kind not in KINDS:
            raise ValueError(f"{at}.kind: {g.kind!r} is not one of {', '.join(KINDS)}")
        if g.op not in OPS:
            raise ValueError(f"{at}.op: {g.op!r} is not one of {', '.join(OPS)}")
        if not g.ranks or any(not isinstance(r, int) or not 0 <= r < p.world_size for r in g.ranks) \
                or len(set(g.ranks)) != len(g.ranks):
            raise ValueError(f"{at}.ranks: {g.ranks!r} must be distinct ranks of 0..{p.world_size - 1}")
        if not isinstance(g.nbytes, int) or g.nbytes < 1:
            raise ValueError(f"{at}.nbytes: {g.nbytes!r} is not a positive integer")
        if not isinstance(g.assumed_s, (int, float)) or not math.isfinite(g.assumed_s) or g.assumed_s <= 0:
            raise ValueError(f"{at}.assumed_s: {g.assumed_s!r} is not a positive number")


def _round(x: float | None, digits: int = 6) -> float | None:
    return None if x is None else float(f"{x:.{digits}g}")
