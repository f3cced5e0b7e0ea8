"""ZeRO 1: optimizer state sharded over the data-parallel group; parameters and gradients whole.

Why this shape (ZeroRedundancyOptimizer's, keyed so torch.distributed.checkpoint can reshard):
gradients are all-reduced as for ZeRO 0 (fsdp.all_reduce_grads), so every rank holds every whole
gradient and the global grad-norm clip is unchanged. The parameters are partitioned among the
group's ranks — whole tensors, largest first onto the least-loaded rank, decided from global
shapes only (the same on every rank, TP ranks included, and nothing data-dependent to trace).
Each rank's optimizer is an ordinary torch optimizer over the parameters it owns, so it holds and
steps their state alone; DCP keys that state by parameter name and each owner writes it once, so a
ZeRO 1 checkpoint loads into any layout and any layout's checkpoint loads into ZeRO 1. After the
step every owner broadcasts its updated parameters (local shards under TP) over the group in flat
buckets.

Expert parallelism: expert weights are replicated only over their dp·cp/ep replica group, so they
are partitioned and broadcast over that group; dense parameters over dp·cp.

Whole tensors mean the split is only as even as the tensors allow: a rank's share is within the
largest tensor's state of total/ranks (a rank may own nothing when ranks outnumber tensors).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
import torch.distributed as dist


def partition(sizes: list[int], n: int) -> list[int]:
    """The owner (0..n-1) of each item: largest first onto the least-loaded rank, ties to the lower
    index (greedy LPT: max load <= sum/n + max item). Pure Python, deterministic."""
    heap = [(0, r) for r in range(n)]         # (load, rank): already a heap
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, r = heapq.heappop(heap)
        owner[i] = r
        heapq.heappush(heap, (load + sizes[i], r))
    return owner


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


@dataclass
class _Split:
    """One group's partition: its parameters (same order on every member), their owners (group ranks)."""

    params: list[torch.nn.Parameter]
    owner: list[int]
    group: object
    size: int
    rank: int


class Zero1:
    """Which parameters this rank's optimizer steps, and the broadcast that follows the step."""

    def __init__(self, splits: list[tuple[list[torch.nn.Parameter], object]], bucket_elems: int = 1 << 25):
        self.bucket_elems = bucket_elems
        self.splits = []
        for params, group in splits:
            if not params:
                continue
            n = dist.get_world_size(group)  # type: ignore[arg-type]
            self.splits.append(_Split(params, partition([p.numel() for p in params], n), group, n,
                                      dist.get_rank(group)))  # type: ignore[arg-type]

    @property
    def owned(self) -> list[torch.nn.Parameter]:
        return [p for s in self.splits for p, o in zip(s.params, s.owner) if o == s.rank]

    @torch.no_grad()
    def broadcast(self) -> None:
        """Every owner's updated parameters to the rest of its group (collective over each group)."""
        for s in self.splits:
            if s.size == 1:
                continue
            for r in range(s.size):
                mine = [_local(p) for p, o in zip(s.params, s.owner) if o == r]
                for bucket in _buckets(mine, self.bucket_elems):
                    self._broadcast_bucket(bucket, r, s)

    @staticmethod
    def _broadcast_bucket(bucket: list[torch.Tensor], src: int, s: _Split) -> None:
        if src == s.rank:
            flat = torch.cat([t.reshape(-1) for t in bucket])
        else:
            flat = torch.empty(sum(t.numel() for t in bucket), dtype=bucket[0].dtype, device=bucket[0].device)
        dist.broadcast(flat, group=s.group, group_src=src)  # type: ignore[arg-type]
        if src == s.rank:
            return
        offset = 0
        for t in bucket:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def _buckets(tensors: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of one dtype, each <= limit elements (a larger tensor goes alone)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        if out and out[-1][0].dtype == t.dtype and size + t.numel() <= limit:
            out[-1].append(t)
            size += t.numel()
        else:
            out.append([t])
            size = t.numel()
    return out


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's optimizer state (local shards of DTensor state, scalars included)."""
    return sum(_local(v).numel() * _local(v).element_size() for st in optimizer.state.values()
               for v in st.values() if torch.is_tensor(v))
