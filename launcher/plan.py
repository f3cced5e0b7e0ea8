"""Plan: the one contract between planner, renderer and trainer, serialized as plan.json.

Everything the trainer needs to build its DeviceMesh and model travels in it (model shape,
training settings, degrees, rank map), together with the memory ledger and time estimate the
layout was chosen on, so a plan can be reviewed long after it was made.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.errors import UserError

PLAN_VERSION = 1


@dataclass
class RankPlacement:
    """Where one global rank runs: node index, local rank on it, physical GPU index, and (when a
    BandwidthMap says) the NIC nearest that GPU."""

    rank: int
    node: int
    local_rank: int
    gpu: int
    coords: dict[str, int] = field(default_factory=dict)
    nic: str | None = None


@dataclass
class Plan:
    name: str
    world_size: int
    nodes: int
    gpus_per_node: int
    degrees: dict[str, int]
    zero_stage: int
    recompute: str
    micro_batch: int
    grad_accum: int
    schedule: str
    virtual_stages: int
    mesh_order: list[str]
    ranks: list[RankPlacement]
    stage_layers: list[int]
    fits: bool
    memory: dict[str, Any]
    estimate: dict[str, Any]
    bandwidth: dict[str, Any]
    warnings: list[str]
    model: dict[str, Any]
    train: dict[str, Any]
    gpu: dict[str, Any]
    diagnostics: dict[str, Any] = field(default_factory=dict)
    hosts: list[str] | None = None
    gpu_order: list[int] | None = None
    tp_node_local: bool = True
    forced: bool = False
    memory_traced: bool = False     # set by `launch verify` once the real trainer was traced
    version: int = PLAN_VERSION

    # --- derived views -------------------------------------------------------------------
    @property
    def tp(self) -> int:
        return self.degrees["tp"]

    @property
    def cp(self) -> int:
        return self.degrees["cp"]

    @property
    def pp(self) -> int:
        return self.degrees["pp"]

    @property
    def dp(self) -> int:
        return self.degrees["dp"]

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Mesh sizes in `mesh_order` (outer→inner), as init_device_mesh wants them."""
        return tuple(self.degrees[d] for d in self.mesh_order)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def save(self, path: str | Path) -> None:
        """Write atomically so a reader never sees half a plan."""
        from launcher.formats.files import atomic_write, make_dirs

        p = Path(path)
        make_dirs(p.parent, "plan directory")
        atomic_write(p, self.to_json() + "\n", "plan")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        if not isinstance(data, dict):
            raise UserError(f"a plan is a JSON object, not {type(data).__name__}")
        if data.get("version") != PLAN_VERSION:
            raise UserError(f"plan version {data.get('version')!r} is not supported (expected {PLAN_VERSION})")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        kwargs["ranks"] = [RankPlacement(**r) for r in data["ranks"]]
        return cls(**kwargs)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        from launcher.formats.files import read_text

        try:
            data = json.loads(read_text(path, "plan"))
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}: not a plan.json (line {exc.lineno}: {exc.msg})") from None
        except RecursionError:
            raise UserError(f"{path}: not a plan.json (nested too deeply)") from None
        try:
            return cls.from_dict(data)
        except UserError as exc:
            raise UserError(f"{path}: {exc}") from None
        except (KeyError, TypeError, AttributeError) as exc:
            raise UserError(f"{path}: malformed plan ({exc})") from None
