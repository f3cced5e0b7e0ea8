"""The plan's communication groups as `launch preflight --plan` probes them, and the step time
recomputed with what they measured.

Every group comes from the plan's rank map (launcher.plan.layout, the grid the trainer's DeviceMesh
is built on): each TP and CP group, each pair of neighbouring pipeline stages, each DP/ZeRO shard
group (dp·cp flattened: the trainer's FSDP and gradient reduction run over it) and each EP group.
Each group's collective, message size and bandwidth are the time model's (costs.collectives, the
figures estimate() charges), so a measured group is compared with exactly what the plan was chosen
on. PP pairs share ranks (stage 1 talks to 0 and 2): the even pairs run first, then the odd ones.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import replace
from datetime import datetime, timezone

from launcher.formats.groupprobe import DEFAULT_TOLERANCE, KINDS, GroupProbe, ProbeGroup
from launcher.plan import layout
from launcher.plan.costs import BUNDLED, Bandwidth, Collective, collectives, estimate
from launcher.plan.model import Plan

#: Timed calls per group (their median is the group's figure), after WARMUP untimed ones.
ITERS = 5
WARMUP = 2


def plan_bandwidth(plan: Plan) -> Bandwidth:
    """The Bandwidth the plan was priced with, from plan.json's `bandwidth` section."""
    names = {f.name for f in dataclasses.fields(Bandwidth)}
    return Bandwidth(**{k: v for k, v in plan.bandwidth.items() if k in names})


def plan_collectives(plan: Plan) -> dict[str, Collective]:
    return collectives(plan.model, plan.train, plan.layout, plan_bandwidth(plan), plan.gpus_per_node,
                       tuple(plan.mesh_order))


def kind_groups(plan: Plan, kind: str) -> list[tuple[list[int], int]]:
    """(ranks, phase) of every group of `kind`, from the plan's rank grid."""
    deg, order = plan.degrees, plan.mesh_order
    if kind in ("tp", "cp"):
        return [(g, 0) for g in layout.groups(deg, order, kind)]
    if kind == "dp":
        # the ZeRO shard groups: dp·cp, or under hybrid sharding each replica's dp_shard·cp (mesh.py splits dp
        # into replicate-outer, shard-inner coordinates)
        shard = plan.layout.dp_shard_size
        out = []
        for g in layout.groups_over(deg, order, ("dp", "cp")):
            by_replica: dict[int, list[int]] = {}
            for r in g:
                by_replica.setdefault(plan.ranks[r].coords["dp"] // shard, []).append(r)
            out += [(ranks, 0) for _, ranks in sorted(by_replica.items())]
        return out
    if kind == "ep":
        return [(g, 0) for g in layout.ep_groups(deg, order, plan.ep)]
    if kind == "pp":
        return [([chain[i], chain[i + 1]], i % 2) for chain in layout.groups(deg, order, "pp")
                for i in range(len(chain) - 1)]
    raise ValueError(kind)


def _link(plan: Plan, ranks: list[int]) -> str:
    nodes = sorted({plan.ranks[r].node for r in ranks})
    nics = sorted({n for r in ranks if (n := plan.ranks[r].nic)})
    words = "intra-node" if len(nodes) == 1 else f"inter-node ({len(nodes)} nodes)"
    return words + (f" via {','.join(nics)}" if nics and len(nodes) > 1 else "")


def probe_spec(plan: Plan, tolerance: float = DEFAULT_TOLERANCE, iters: int = ITERS, warmup: int = WARMUP,
               hosts: list[str] | None = None) -> GroupProbe:
    """Every communication group of the plan with its collective and what the time model assumed."""
    comm = plan_collectives(plan)
    groups: list[ProbeGroup] = []
    for kind in KINDS:
        c = comm.get(kind)
        if c is None:
            continue
        for i, (ranks, phase) in enumerate(kind_groups(plan, kind)):
            g = len(ranks)
            unit = 4 * g                                 # fp32 elements, divisible over the group
            nbytes = max(unit, int(math.ceil(c.nbytes / unit)) * unit)
            call = replace(c, nbytes=nbytes, size=g)
            groups.append(ProbeGroup(kind=kind, index=i, ranks=ranks, nodes=[plan.ranks[r].node for r in ranks],
                                     op=c.op, nbytes=nbytes, phase=phase, link=_link(plan, ranks),
                                     assumed_s=call.seconds(), assumed_busbw_gbs=c.busbw_gbs))
    return GroupProbe(plan=plan.name, world_size=plan.world_size, nodes=plan.nodes,
                      gpus_per_node=plan.gpus_per_node, hosts=list(hosts or plan.hosts or []), tolerance=tolerance,
                      iters=iters, warmup=warmup, groups=groups, predicted_step_s=step_time(plan),
                      planned_step_s=plan.estimate.get("step_time_s"),
                      created=datetime.now(timezone.utc).isoformat(timespec="seconds"))


def measured_busbw(plan: Plan, probe: GroupProbe) -> dict[str, float]:
    """Per group kind, the bus bandwidth at which the time model gives the slowest group's measured
    time (a step runs at the pace of its slowest group of each kind)."""
    comm = plan_collectives(plan)
    out: dict[str, float] = {}
    for kind in probe.kinds():
        timed = [g for g in probe.of(kind) if g.measured_s]
        if kind not in comm or not timed:
            continue
        worst = min(timed, key=lambda g: g.assumed_s / g.measured_s)     # type: ignore[operator]
        call = replace(comm[kind], nbytes=worst.nbytes, size=worst.size)
        out[kind] = call.busbw_for(worst.measured_s)                      # type: ignore[arg-type]
    return out


def step_time(plan: Plan, busbw: dict[str, float] | None = None) -> float:
    """The time model's step for the plan's layout at its assumed bandwidths (and its job file's
    cluster.compute_efficiency, where set), with `busbw` (GB/s by group kind) in their place where given."""
    eff = plan.cluster.compute_efficiency if plan.cluster is not None else None
    return estimate(plan.model, plan.train, plan.gpu, plan.layout, plan_bandwidth(plan), plan.gpus_per_node,
                    tuple(plan.mesh_order), efficiency_max=eff, stack=BUNDLED, busbw=busbw).step_time_s


def with_measured_step(plan: Plan, probe: GroupProbe) -> GroupProbe:
    """The probe with measured_step_s filled in: the plan's step recomputed at the measured bandwidths."""
    if not any(g.measured_s for g in probe.groups):
        return probe
    return replace(probe, measured_step_s=step_time(plan, measured_busbw(plan, probe)))
