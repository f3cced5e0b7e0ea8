"""DeviceMesh from the plan, and the start-up check that reality matches the plan.

Why: the plan's rank grid (mesh_order outer→inner) is only worth something if the launcher
really put consecutive ranks on one node. Every rank reports its host; a TP group that spans
hosts is an error (or a warning when the plan was forced that way), caught before the first
slow step rather than guessed from throughput.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from launcher.errors import UserError
from launcher.formats.secrets import looks_secret
from launcher.plan import layout
from launcher.trainer.config import TrainerConfig
from launcher.trainer.moe import EPGroups

log = logging.getLogger("launcher.trainer")

ENV_PREFIXES = ("MASTER_", "RANK", "WORLD_SIZE", "LOCAL_", "GROUP_", "ROLE_", "NODE_RANK", "TORCHELASTIC_",
                "NCCL_", "TORCH_NCCL_", "TORCH_DIST", "GLOO_", "CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID",
                "SLURM_NODEID", "SLURM_PROCID", "LAUNCH4D_")


@dataclass
class MeshInfo:
    """The world mesh and the groups the trainer uses, with this rank's coordinates."""

    world: DeviceMesh
    rank: int
    coords: dict[str, int]
    device: torch.device
    tp_mesh: DeviceMesh
    dp_cp_mesh: DeviceMesh      # all data-parallel ranks of a stage: dp and cp flattened
    sizes: dict[str, int]
    ep: EPGroups | None = None  # expert-parallel groups when plan.degrees.ep > 1 (moe.py)
    # hybrid sharding (plan.layout.dp_shard < dp): ZeRO shards over dp_shard·cp, replicas over dp_replicate
    shard_mesh: DeviceMesh | None = None      # dp_shard and cp flattened (None: dp_cp_mesh)
    replica_mesh: DeviceMesh | None = None    # dp_replicate: the same shard on each
    _fsdp_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)

    def group(self, dim: str):
        return self.world.get_group(dim)

    @property
    def dp_cp_size(self) -> int:
        return self.sizes["dp"] * self.sizes["cp"]

    @property
    def zero_mesh(self) -> DeviceMesh:
        """The 1-D group ZeRO shards over: dp·cp, or dp_shard·cp under hybrid sharding."""
        return self.shard_mesh if self.shard_mesh is not None else self.dp_cp_mesh

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """fully_shard's mesh: 1-D dp·cp, or 2-D (dp_replicate, dp_shard·cp), FSDP2's HSDP (torchtitan's
        (dp_replicate, dp_shard_cp))."""
        if self.shard_mesh is None or self.replica_mesh is None:
            return self.dp_cp_mesh
        if self._fsdp_mesh is None:
            self._fsdp_mesh = DeviceMesh._concatenate([self.replica_mesh, self.shard_mesh])
        return self._fsdp_mesh


def hostname() -> str:
    """This rank's host; LAUNCH4D_FAKE_HOSTS="a,a,b,b" (one per global rank) overrides it for tests."""
    fake = os.environ.get("LAUNCH4D_FAKE_HOSTS")
    if fake:
        names = [h.strip() for h in fake.split(",")]
        rank = int(os.environ.get("RANK", "0"))
        if rank < len(names):
            return names[rank]
    return socket.gethostname()


def mesh_dims(p) -> tuple[list[str], dict[str, int]]:
    """The world mesh's dimensions outer→inner and their sizes: plan.mesh_order, with dp split in place
    into (dp_replicate, dp_shard) under hybrid sharding (torchtitan's order: the shard group is dp-consecutive
    ranks, inside a node first). The rank grid is the plan's either way."""
    sizes = {"tp": p.tp, "cp": p.cp, "pp": p.pp, "dp": p.dp}
    order = list(p.mesh_order)
    if p.dp_replicas == 1:
        return order, sizes
    names = [x for d in order for x in (("dp_replicate", "dp_shard") if d == "dp" else (d,))]
    return names, {**sizes, "dp_replicate": p.dp_replicas, "dp_shard": p.dp_shard}


def build_mesh(cfg: TrainerConfig, device: torch.device) -> MeshInfo:
    p = cfg.plan
    names, sizes = mesh_dims(p)
    order = list(p.mesh_order)
    world = init_device_mesh(device.type, tuple(sizes[d] for d in names), mesh_dim_names=tuple(names))
    dp_cp = world[tuple(d for d in names if d in ("dp", "dp_replicate", "dp_shard", "cp"))]._flatten("dp_cp")
    shard = replica = None
    if p.dp_replicas > 1:
        shard = world[tuple(d for d in names if d in ("dp_shard", "cp"))]._flatten("dp_shard_cp")
        replica = world["dp_replicate"]
    rank = dist.get_rank()
    coords = layout.coords_of(rank, sizes, order)
    for d in names:
        got = world.get_local_rank(d)
        want = coords[d] if d in coords else (coords["dp"] // p.dp_shard if d == "dp_replicate"
                                              else coords["dp"] % p.dp_shard)
        assert got == want, "DeviceMesh layout differs from launcher.plan.layout"
    return MeshInfo(world=world, rank=rank, coords=coords, device=device, tp_mesh=world["tp"],
                    dp_cp_mesh=dp_cp, sizes={d: sizes[d] for d in order},
                    ep=build_ep_groups(sizes, order, p.ep, rank, device.type), shard_mesh=shard, replica_mesh=replica)


def ep_layout(sizes: dict[str, int], order: list[str], ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """(EP groups, expert replica groups) over all ranks. Within one (pp, tp) slice, dp·cp index f
    (dp and cp flattened in mesh order, as for FSDP) has EP rank f % ep; an EP group is ep
    consecutive f, a replica group the dp·cp/ep ranks with the same EP rank."""
    world = sizes["tp"] * sizes["cp"] * sizes["pp"] * sizes["dp"]
    dims = [d for d in order if d in ("dp", "cp")]
    ep_groups: dict[tuple, list[int]] = {}
    replicas: dict[tuple, list[int]] = {}
    for r in range(world):
        c = layout.coords_of(r, sizes, order)
        f = c[dims[0]] * sizes[dims[1]] + c[dims[1]]
        ep_groups.setdefault((c["pp"], c["tp"], f // ep), []).append(r)
        replicas.setdefault((c["pp"], c["tp"], f % ep), []).append(r)
    return [ep_groups[k] for k in sorted(ep_groups)], [replicas[k] for k in sorted(replicas)]


def build_ep_groups(sizes: dict[str, int], order: list[str], ep: int, rank: int,
                    device_type: str = "cpu") -> EPGroups | None:
    """This rank's EP and expert-replica process groups (every rank creates every group, same order)."""
    if ep == 1:
        return None
    ep_list, rep_list = ep_layout(sizes, order, ep)
    mine_ep = None
    for ranks in ep_list:
        g = dist.new_group(ranks)
        if rank in ranks:
            mine_ep, ep_rank = g, ranks.index(rank)
    # the replica groups as one DeviceMesh [sets, replicas]: FSDP of experts needs a mesh
    rep_mesh = DeviceMesh(device_type, torch.tensor(rep_list), mesh_dim_names=("ep_replica_set", "ep_replica"))
    rep = rep_mesh["ep_replica"]
    return EPGroups(ep=ep, ep_rank=ep_rank, ep_group=mine_ep, replica_group=rep.get_group(),
                    replica_size=rep.size(), replica_mesh=rep)


def all_groups(mesh: MeshInfo) -> list:
    groups = [dist.group.WORLD]
    for d in mesh.world.mesh_dim_names or ():
        groups.append(mesh.world.get_group(d))
    groups.append(mesh.dp_cp_mesh.get_group())
    if mesh.shard_mesh is not None and mesh.replica_mesh is not None:
        groups += [mesh.shard_mesh.get_group(), mesh.replica_mesh.get_group()]
    if mesh.ep is not None:
        groups += [mesh.ep.ep_group, mesh.ep.replica_group]  # type: ignore[list-item]
    return groups


def set_timeouts(mesh: MeshInfo, seconds: float) -> None:
    """Apply one collective timeout to every group (subgroups otherwise keep the 30-min default)."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    for g in all_groups(mesh):
        _set_pg_timeout(timedelta(seconds=seconds), g)


def tp_host_problems(cfg: TrainerConfig, hosts: list[str]) -> list[str]:
    """One line per TP group whose ranks are not all on one host."""
    p = cfg.plan
    degrees = {"tp": p.tp, "cp": p.cp, "pp": p.pp, "dp": p.dp}
    out = []
    for grp in layout.groups(degrees, p.mesh_order, "tp"):
        names = sorted({hosts[r] for r in grp})
        if len(names) > 1:
            out.append(f"TP group ranks {grp} spans hosts {', '.join(names)}")
    return out


def check_hosts(cfg: TrainerConfig, mesh: MeshInfo) -> list[str]:
    """All-gather hostnames; raise UserError when a TP group spans hosts (warning if plan.forced)."""
    hosts: list = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, hostname())
    problems = tp_host_problems(cfg, hosts)
    if problems:
        msg = (f"{problems[0]}{f' (and {len(problems) - 1} more)' if len(problems) > 1 else ''}: "
               "tensor parallelism must stay inside one node; the launcher's rank order does not match "
               "the plan (plan.mesh_order / rank map)")
        if not cfg.plan.forced:
            raise UserError(msg)
        if mesh.rank == 0:
            log.warning("%s; continuing because the plan was forced", msg)
    # Under Slurm the batch script orders the nodes it was given (LAUNCH4D_HOSTS); else the plan's.
    plan_hosts = os.environ.get("LAUNCH4D_HOSTS", "").split() or cfg.plan.hosts
    if plan_hosts and mesh.rank == 0:
        for r in cfg.plan.ranks:
            want = plan_hosts[r.node] if r.node < len(plan_hosts) else None
            if want and hosts[r.rank].split(".")[0] != want.split(".")[0]:
                log.warning("rank %d runs on %s but the plan placed it on %s", r.rank, hosts[r.rank], want)
                break
    return hosts


def log_startup(cfg: TrainerConfig, mesh: MeshInfo, hosts: list[str], backend: str) -> None:
    if mesh.rank != 0:
        return
    p = cfg.plan
    nccl = "n/a"
    if torch.cuda.is_available():
        try:
            nccl = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception:   # noqa: BLE001 - a build without NCCL
            nccl = "unavailable"
    log.info("torch %s, backend %s, NCCL %s, world %d", torch.__version__, backend, nccl, dist.get_world_size())
    log.info("mesh %s = %s", "×".join(p.mesh_order), "×".join(str(mesh.sizes[d]) for d in p.mesh_order))
    table = layout.rank_map_table(cfg.plan.ranks, p.mesh_order, max(1, cfg.plan.gpus_per_node)) \
        if cfg.plan.ranks else "(plan has no rank map)"
    log.info("rank map (plan):\n%s", table)
    log.info("hosts by rank: %s", ", ".join(f"{r}:{h}" for r, h in enumerate(hosts)))
    env = {k: v for k, v in sorted(os.environ.items())
           if k.startswith(ENV_PREFIXES) and not looks_secret(k)}
    log.info("distributed env: %s", " ".join(f"{k}={v}" for k, v in env.items()))

