"""Mixture-of-experts MLP (Mixtral-style top-k routing, DeepSeek-style shared experts) and expert
parallelism over dp·cp.

Why it looks like this: the router is a plain linear layer (hidden → experts); softmax, top-k
with the chosen weights renormalised to sum to 1, and every (token, expert) pair is computed —
no capacity factor, no dropped tokens — so any layout computes exactly the reference's result.
Experts are modules keyed by their global index (`experts.<e>.w1.weight`), so the seeded
per-name init (model.py) and the checkpoint keys do not depend on the layout.

Expert parallelism: an EP group is `ep` ranks that differ only in their dp/cp coordinate; EP
rank i keeps experts [i·E/ep, (i+1)·E/ep). Each MoE layer sends every (token, expert) pair to
the expert's owner with one all_to_all_single (split sizes exchanged first, also by
all-to-all), runs the local experts, and sends the results back with the inverse all-to-all;
`_AllToAll` carries autograd (its backward is the transposed exchange). Expert weights are
replicated over the other dp·cp/ep ranks and their gradients are summed over that replica
group only: an all-reduce for ZeRO 0/1 (engine.py), or, for ZeRO 2/3, each expert is its own
`fully_shard` unit over that replica group (fsdp.py), so expert weights, gradients and optimizer
state are sharded dp·cp/ep ways. No auxiliary load-balancing loss is added.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass
class EPGroups:
    """This rank's expert-parallel groups (built by mesh.build_ep_groups)."""

    ep: int
    ep_rank: int
    ep_group: object | None          # the `ep` ranks that exchange tokens
    replica_group: object | None     # the dp·cp/ep ranks holding the same experts (grad sum)
    replica_size: int
    replica_mesh: object | None = None   # the replica group as a 1-D DeviceMesh (FSDP of experts)


def owned_experts(experts: int, ep: int, ep_rank: int) -> list[int]:
    per = experts // ep
    return list(range(ep_rank * per, (ep_rank + 1) * per))


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with variable splits; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        gx = g.new_empty((sum(in_splits),) + tuple(g.shape[1:]))
        dist.all_to_all_single(gx, g.contiguous(), in_splits, out_splits, group=ctx.group)
        return gx, None, None, None


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in fp32, top-k, weights renormalised: ([T, k] weights, [T, k] expert ids)."""
    probs = F.softmax(logits.float(), dim=-1)
    w, idx = probs.topk(top_k, dim=-1)
    w = w / w.sum(dim=-1, keepdim=True)
    return w, idx


def balanced_counts(pairs: int, experts: int) -> list[int]:
    """`pairs` (token, expert) pairs spread evenly over `experts` (the first get one more)."""
    return [pairs // experts + (e < pairs % experts) for e in range(experts)]


class MoE(nn.Module):
    """Drop-in replacement for FeedForward: x [b, s, h] -> [b, s, h]. Each expert (and the shared
    experts' MLP) is `mlp(a, width)`: model.FeedForward, handed in by the block that builds this (so
    moe.py does not import model.py back)."""

    #: None in a real run. `launch verify` (FakeTensorMode: shapes, no values) sets a function
    #: (pairs, experts) -> rows per expert, the routing assumed from shapes (e.g. balanced_counts);
    #: every source rank of an EP group is then assumed to route the same way.
    assumed_counts: Callable[[int, int], list[int]] | None = None

    def __init__(self, a, mlp: Callable[..., nn.Module]):
        super().__init__()
        self.num_experts = a.experts
        self.top_k = a.experts_per_token
        self.router = nn.Linear(a.hidden, a.experts, bias=False)
        self.experts = nn.ModuleDict({str(e): mlp(a, a.expert_ffn) for e in range(a.experts)})
        # DeepSeek's shared experts: one MLP shared_experts × moe_ffn_hidden wide that every token passes
        # through, replicated like the router (not expert-parallel), its output added to the routed ones'
        self.shared = mlp(a, a.shared_ffn) if a.shared_experts else None
        self.ep = EPGroups(ep=1, ep_rank=0, ep_group=None, replica_group=None, replica_size=1)

    def keep_experts(self, ep: EPGroups) -> None:
        """Expert parallelism: keep only this EP rank's experts (call on the meta model)."""
        self.ep = ep
        keep = {str(e) for e in owned_experts(self.num_experts, ep.ep, ep.ep_rank)}
        for name in list(self.experts.keys()):
            if name not in keep:
                del self.experts[name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, idx = route(self.router(x), self.top_k)
        flat = idx.reshape(-1)                                     # [T·k] expert of each pair
        order = torch.argsort(flat, stable=True)                   # pairs grouped by expert
        token = order // self.top_k
        per_expert = (torch.bincount(flat, minlength=self.num_experts) if MoE.assumed_counts is None
                      else MoE.assumed_counts(flat.numel(), self.num_experts))
        xs = x.index_select(0, token)
        ys = self._experts(xs, per_expert)
        ys = ys * weights.reshape(-1)[order, None].to(ys.dtype)
        # the experts' dtype, like a dense MLP's output
        out = ys.new_zeros(x.shape).index_add(0, token, ys)
        if self.shared is not None:
            out = out + self.shared(x)
        return out.reshape(shape)

    def _experts(self, xs: torch.Tensor, per_expert: torch.Tensor | list[int]) -> torch.Tensor:
        """Rows of xs grouped by expert (counts per_expert [E]) through their experts, same order."""
        ep = self.ep
        if ep.ep == 1:
            counts = per_expert if isinstance(per_expert, list) else per_expert.tolist()
            return self._run_local(xs, counts, list(range(self.num_experts)))
        per_rank = self.num_experts // ep.ep
        if isinstance(per_expert, list):       # assumed from shapes: every source routes like this rank
            mine = per_expert[ep.ep_rank * per_rank:(ep.ep_rank + 1) * per_rank]
            recv = [mine] * ep.ep
            in_splits = [sum(per_expert[j * per_rank:(j + 1) * per_rank]) for j in range(ep.ep)]
        else:
            # counts[j] = how many rows this rank sends to each of EP rank j's experts
            recv_counts = torch.empty_like(per_expert)
            dist.all_to_all_single(recv_counts, per_expert, group=ep.ep_group)
            recv = recv_counts.view(ep.ep, per_rank).tolist()             # [source][local expert]
            in_splits = per_expert.view(ep.ep, per_rank).sum(1).tolist()
        out_splits = [sum(r) for r in recv]
        got = _AllToAll.apply(xs, out_splits, in_splits, ep.ep_group)
        # `got` is ordered by source rank, then expert: regroup by expert, compute, restore order
        local_ids = torch.arange(per_rank, device=xs.device).repeat(ep.ep)
        row_expert = torch.repeat_interleave(local_ids, torch.tensor([c for r in recv for c in r], device=xs.device),
                                             output_size=sum(out_splits))
        by_expert = torch.argsort(row_expert, stable=True)
        ys = self._run_local(got.index_select(0, by_expert), [sum(c) for c in zip(*recv)],
                             owned_experts(self.num_experts, ep.ep, ep.ep_rank))
        ys = torch.empty_like(ys).index_copy(0, by_expert, ys) if ys.shape[0] else ys
        return _AllToAll.apply(ys, in_splits, out_splits, ep.ep_group)

    def _run_local(self, xs: torch.Tensor, counts: list[int], expert_ids: list[int]) -> torch.Tensor:
        outs = []
        for e, part in zip(expert_ids, xs.split(counts)):
            # an expert with no rows still runs (on zero rows) so its parameters get a zero
            # gradient on every rank: the replica all-reduce then sees the same tensors everywhere
            outs.append(self.experts[str(e)](part))
        return torch.cat(outs) if outs else xs[:0]


def expert_params(model: nn.Module) -> list[nn.Parameter]:
    """Parameters of EP-sharded experts (routers and everything else are dense)."""
    out: list[nn.Parameter] = []
    for m in model.modules():
        if isinstance(m, MoE) and m.ep.ep > 1:
            out.extend(m.experts.parameters())
    return out


def dense_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The definition, for tests: every expert on every token, weighted by the renormalised top-k."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    weights, idx = route(moe.router(x), moe.top_k)
    out = torch.zeros_like(x)
    for e in range(moe.num_experts):
        gate = (weights * (idx == e)).sum(-1, keepdim=True).to(x.dtype)
        out = out + gate * moe.experts[str(e)](x)
    if moe.shared is not None:
        out = out + moe.shared(x)
    return out.reshape(shape)


def apply_ep(model: nn.Module, ep: EPGroups) -> None:
    """Expert parallelism on a (meta) model or pipeline stage: each MoE layer keeps its EP rank's experts."""
    for m in model.modules():
        if isinstance(m, MoE):
            m.keep_experts(ep)


def tag_expert_params(model: nn.Module) -> None:
    """Mark EP-sharded expert weights (after to_empty made the final Parameter objects) so the
    global grad norm counts each expert once: they are replicated on world/pp/ep ranks, not world/pp."""
    for p in expert_params(model):
        p.ep_degree = next(m.ep.ep for m in model.modules() if isinstance(m, MoE))  # type: ignore[attr-defined]
