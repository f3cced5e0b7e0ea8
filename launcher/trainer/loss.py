"""Chunked, vocab-parallel cross-entropy normalised by the global token count; mesh-wide clipping.

Why chunked: the s·b·V fp32 logits are the one tensor recomputation does not shrink (seed
failure mode 3). The output projection happens here, `loss_chunk` tokens at a time, each
chunk under activation checkpointing, so at most one chunk of logits exists, in forward and
in backward.

Why the global token count: every rank returns sum(CE over its tokens) / (global_batch ·
seq_len) and gradients are SUMMED over dp·cp (FSDP divide factor 1, or an all-reduce sum)
and over micro-batches (pipelining scale_grads=False), so any dp × grad-accum × pp × cp
split yields exactly the gradient of one process on the whole batch (seed failure mode 5).
"""

from __future__ import annotations

from collections.abc import Set

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from launcher.trainer.fsdp import local_grads


class _SumForward(torch.autograd.Function):
    """All-reduce(sum) whose result feeds a computation replicated on every rank: identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherSeq(torch.autograd.Function):
    """All-gather sequence shards (dim 1) of the TP group; backward sums the partial grads
    (every rank's vocab shard contributes) and keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        n = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        n = dist.get_world_size(ctx.group)
        return g.chunk(n, dim=1)[dist.get_rank(ctx.group)].contiguous(), None


def _chunk_ce(h: torch.Tensor, w: torch.Tensor, target: torch.Tensor, vocab_start: int, group,
              vocab: int) -> torch.Tensor:
    """Sum of CE over one chunk; h [n, H], w this rank's [V/tp, H] vocab shard (of the padded vocabulary:
    columns from `vocab` on are padding, masked to -inf so they take no probability and no gradient)."""
    logits = (h @ w.t()).float()
    keep = vocab - vocab_start
    if keep < w.shape[0]:
        logits[:, max(0, keep):] = float("-inf")
    if group is None:
        return F.cross_entropy(logits, target, reduction="sum")
    m = logits.detach().amax(dim=-1)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    z = logits - m[:, None]
    sumexp = _SumForward.apply(z.exp().sum(dim=-1), group)
    local = target - vocab_start
    inside = (local >= 0) & (local < w.shape[0])
    picked = z.gather(1, local.clamp(0, w.shape[0] - 1)[:, None]).squeeze(1) * inside
    picked = _SumForward.apply(picked, group)
    return (sumexp.log() - picked).sum()


class ChunkedLoss:
    """loss_fn(hidden, labels) for one model (or the last pipeline stage).

    `weight_fn` returns the output projection at call time (FSDP swaps the parameter object
    between sharded and unsharded), `tp_group` is None without tensor parallelism.
    """

    def __init__(self, weight_fn, global_tokens: int, chunk: int, tp_group=None, vocab: int | None = None):
        self.weight_fn = weight_fn
        self.vocab = vocab              # the real vocabulary; the weight's rows beyond it are padding
        self.global_tokens = global_tokens
        self.chunk = chunk
        self.tp_group = tp_group

    def __call__(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        w = self.weight_fn()
        group = self.tp_group
        vocab_start = 0
        if hasattr(w, "to_local"):
            w = w.to_local()
        if group is not None:
            h = _GatherSeq.apply(h, group)             # [b, s_cp, H] on every TP rank
            vocab_start = dist.get_rank(group) * w.shape[0]
        h = h.reshape(-1, h.shape[-1])
        labels = labels.reshape(-1)
        total = h.new_zeros((), dtype=torch.float32)
        n = h.shape[0]
        vocab = self.vocab if self.vocab is not None else w.shape[0] * (dist.get_world_size(group) if group else 1)
        for i in range(0, n, self.chunk):
            j = min(n, i + self.chunk)
            total = total + checkpoint(_chunk_ce, h[i:j], w, labels[i:j], vocab_start, group, vocab,
                                       use_reentrant=False)
        return total / self.global_tokens


def _replication(p: torch.Tensor, ranks_per_stage: int) -> int:
    """How many ranks of one pipeline stage hold an identical copy of this rank's shard of `p`."""
    if not hasattr(p, "device_mesh"):
        return ranks_per_stage // getattr(p, "ep_degree", 1)     # EP experts: ep distinct sets
    mesh = p.device_mesh
    rep = ranks_per_stage // mesh.size()       # copies outside the parameter's own mesh
    for i, pl in enumerate(p.placements):  # type: ignore[attr-defined]
        if pl.is_replicate():
            rep *= mesh.size(i)
    return rep // getattr(p, "ep_degree", 1)    # FSDP-sharded EP experts: over dp·cp/ep ranks


def grad_norm_and_clip(params: list[torch.Tensor], max_norm: float, ranks_per_stage: int,
                       exclude: Set[int] = frozenset()) -> float:
    """clip_grad_norm as a Python float (one host sync)."""
    return float(clip_grad_norm(params, max_norm, ranks_per_stage, exclude))


def clip_grad_norm(params: list[torch.Tensor], max_norm: float, ranks_per_stage: int,
                   exclude: Set[int] = frozenset()) -> torch.Tensor:
    """Global L2 norm of all gradients over the whole mesh (each element counted once), then clip.

    `ranks_per_stage` = world / pp: the number of ranks that share one pipeline stage's
    parameters (as shards or copies). `exclude`: ids of parameters clipped but left out of the
    norm (the last stage's copy of a tied embedding, whose gradient equals the embedding's).
    Same formula as torch.nn.utils.clip_grad_norm_, and like it no host sync: the norm stays a
    tensor and the clip factor is clamped to 1 on the device (so `launch verify` can trace it).
    """
    device = None
    sq = torch.zeros((), dtype=torch.float64)
    grads = []
    for p, local in local_grads(params):  # type: ignore[arg-type]
        device = local.device
        sq = sq.to(device)
        if id(p) not in exclude:
            sq += _norm_sq(local) / _replication(p, ranks_per_stage)
        grads.append(local)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
            else torch.device("cpu")
        sq = sq.to(device)
    return clip_to_global_norm(sq, grads, max_norm)


def _norm_sq(t: torch.Tensor) -> torch.Tensor:
    """A tensor's squared L2 norm as a float64 scalar: reduced in fp32 (no full-size copy of the tensor, as
    torch's clip_grad_norm_), squared in float64 so the sum over tensors and ranks keeps its digits."""
    return torch.linalg.vector_norm(t.detach(), dtype=torch.float32).double().square()


def clip_to_global_norm(sq: torch.Tensor, grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """This rank's share of the squared norm summed over the whole mesh; every gradient tensor scaled
    by min(1, max_norm / norm) on the device. The norm, as a tensor."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sq)
    total = sq.sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)
    return total
