"""Rank layout: which global rank sits on which node and GPU, and which ranks form each group.

The rank grid is one row-major array over `mesh_order` (outer→inner, default pp, dp, cp, tp),
as picotron's `arange(world).view(...)`: consecutive ranks form a TP group, and with
gpus_per_node divisible by tp every TP group lands on one node. Inside a node, GPUs are taken
in `gpu_order`, which puts NVLink-connected GPUs next to each other when the BandwidthMap says
the node is not fully connected.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from launcher.plan.schema import bounded

DEFAULT_ORDER = ("pp", "dp", "cp", "tp")


@dataclass
class RankPlacement:
    """Where one global rank runs: node index, local rank on it, physical GPU index, and (when a
    BandwidthMap says) the NIC nearest that GPU."""

    rank: int = bounded(lo=0)
    node: int = bounded(lo=0)
    local_rank: int = bounded(lo=0)
    gpu: int = bounded(lo=0)
    coords: dict[str, int] = field(default_factory=dict)
    nic: str | None = None


def stage_layers(layers: int, stages: int) -> list[int]:
    """Split layers over pipeline stages (pp·virtual_stages of them); when the split is uneven the
    first and last stages (embedding, output head and loss) get the smaller share, as Llama 3 did
    (126 layers on pp 16: 8 per stage, 7 on the ends)."""
    base, extra = divmod(layers, stages)
    out = [base] * stages
    order = list(range(1, stages - 1)) + [stages - 1, 0] if stages > 2 else list(range(stages))[::-1]
    for i in order[:extra]:
        out[i] += 1
    return out


def strides(degrees: dict[str, int], mesh_order: Sequence[str]) -> dict[str, int]:
    out, acc = {}, 1
    for dim in reversed(mesh_order):
        out[dim] = acc
        acc *= degrees[dim]
    return out


def coords_of(rank: int, degrees: dict[str, int], mesh_order: Sequence[str]) -> dict[str, int]:
    st = strides(degrees, mesh_order)
    return {dim: (rank // st[dim]) % degrees[dim] for dim in mesh_order}


def groups(degrees: dict[str, int], mesh_order: Sequence[str], dim: str) -> list[list[int]]:
    """Every group of ranks that differ only in coordinate `dim` (e.g. all TP groups)."""
    st = strides(degrees, mesh_order)
    others = [d for d in mesh_order if d != dim]
    out = []
    for combo in itertools.product(*(range(degrees[d]) for d in others)):
        base = sum(c * st[d] for c, d in zip(combo, others))
        out.append([base + i * st[dim] for i in range(degrees[dim])])
    return out


def placements(degrees: dict[str, int], mesh_order: Sequence[str], gpus_per_node: int,
               gpu_order: Sequence[int] | None = None) -> list[RankPlacement]:
    st = strides(degrees, mesh_order)
    world = 1
    for dim in mesh_order:
        world *= degrees[dim]
    order = list(gpu_order) if gpu_order else list(range(gpus_per_node))
    dims = [(dim, st[dim], degrees[dim]) for dim in mesh_order]
    return [RankPlacement(rank=r, node=r // gpus_per_node, local_rank=r % gpus_per_node,
                          gpu=order[r % gpus_per_node], coords={d: (r // k) % n for d, k, n in dims})
            for r in range(world)]


def groups_node_local(group_list: list[list[int]], gpus_per_node: int) -> bool:
    return all(len({r // gpus_per_node for r in g}) == 1 for g in group_list)


def nodes_spanned(group: Sequence[int], gpus_per_node: int) -> int:
    return len({r // gpus_per_node for r in group})


def gpu_order_from_nvlink_groups(nvlink_groups: Sequence[Sequence[int]], gpus_per_node: int) -> list[int]:
    """GPU indices ordered so NVLink-connected GPUs are adjacent (islands first, largest first).

    On a fully connected NVSwitch node this is the identity. On a PCIe box with bridged pairs
    ([[0, 2], [1, 3]]) it gives [0, 2, 1, 3], so TP=2 groups land on bridged pairs.
    """
    seen: list[int] = []
    for grp in sorted((sorted(g) for g in nvlink_groups), key=lambda g: (-len(g), g)):
        seen.extend(i for i in grp if i not in seen and i < gpus_per_node)
    seen.extend(i for i in range(gpus_per_node) if i not in seen)
    return seen


def tp_blocks_on_nvlink(gpu_order: Sequence[int], nvlink_groups: Sequence[Sequence[int]], tp: int) -> bool:
    """True when every block of `tp` consecutive local ranks lies inside one NVLink island."""
    if tp == 1:
        return True
    island = {g: i for i, grp in enumerate(nvlink_groups) for g in grp}
    for start in range(0, len(gpu_order), tp):
        block = gpu_order[start:start + tp]
        if len({island.get(g, ("alone", g)) for g in block}) != 1:
            return False
    return True


def rank_map_table(ranks: Sequence[RankPlacement], mesh_order: Sequence[str], gpus_per_node: int,
                   max_nodes: int = 8) -> str:
    """A compact nodes × GPUs grid, each cell the rank's coordinates (e.g. p0d1c0t3)."""
    letters = {"pp": "p", "dp": "d", "cp": "c", "tp": "t"}
    by_node: dict[int, list[RankPlacement]] = {}
    for r in ranks:
        by_node.setdefault(r.node, []).append(r)
    node_ids = sorted(by_node)
    cells = {r.rank: "".join(f"{letters[d]}{r.coords[d]}" for d in mesh_order) for r in ranks}
    width = max(len(c) for c in cells.values())
    lines = ["node  " + " ".join(f"gpu{g}".ljust(width) for g in range(gpus_per_node))]
    shown = node_ids if len(node_ids) <= max_nodes else node_ids[: max_nodes // 2] + node_ids[-max_nodes // 2:]
    for i, n in enumerate(shown):
        if len(node_ids) > max_nodes and i == max_nodes // 2:
            lines.append(f"...   ({len(node_ids) - max_nodes} more nodes)")
        row = sorted(by_node[n], key=lambda r: r.gpu)
        lines.append(f"{n:<5} " + " ".join(cells[r.rank].ljust(width) for r in row))
    return "\n".join(lines)


def groups_over(degrees: dict[str, int], mesh_order: Sequence[str], dims: Sequence[str]) -> list[list[int]]:
    """Every group of ranks that differ only in the coordinates `dims`, flattened in mesh order (the
    dp·cp group FSDP and the gradient reduction use: dims ("dp", "cp"))."""
    st = strides(degrees, mesh_order)
    inner = [d for d in mesh_order if d in dims]
    others = [d for d in mesh_order if d not in dims]
    out = []
    for combo in itertools.product(*(range(degrees[d]) for d in others)):
        base = sum(c * st[d] for c, d in zip(combo, others))
        out.append(sorted(base + sum(c * st[d] for c, d in zip(inner_combo, inner))
                          for inner_combo in itertools.product(*(range(degrees[d]) for d in inner))))
    return out


def ep_groups(degrees: dict[str, int], mesh_order: Sequence[str], ep: int) -> list[list[int]]:
    """The expert-parallel groups: within one (pp, tp) slice, dp·cp index f (dp and cp flattened in mesh
    order) has EP rank f % ep, and a group is ep consecutive f (the trainer's mesh.ep_layout)."""
    dims = [d for d in mesh_order if d in ("dp", "cp")]
    world = 1
    for d in mesh_order:
        world *= degrees[d]
    out: dict[tuple[int, int, int], list[int]] = {}
    for r in range(world):
        c = coords_of(r, degrees, mesh_order)
        f = c[dims[0]] * degrees[dims[1]] + c[dims[1]]
        out.setdefault((c["pp"], c["tp"], f // ep), []).append(r)
    return [out[k] for k in sorted(out)]
