"""Context parallelism: exact causal attention with the sequence split over the cp ranks.

Why our own: torch's `context_parallel` has no CPU path for causal SDPA (notes/testbed.md),
and we want one implementation that runs, and is tested, on gloo and NCCL alike.

Load balance: the sequence is cut into 2·cp chunks and cp rank r holds chunks r and
2·cp−1−r (a head and a tail), so every rank has the same share of the causal triangle.
Attention all-gathers keys and values over the cp group (as Llama 3 did) with an autograd
function whose backward sums every rank's gradient back to the owner (reduce-scatter on
NCCL; all-reduce + slice on gloo, which has no reduce-scatter — torch's own
`torch.distributed.nn.functional.all_gather` gave wrong key gradients on gloo here), and
masks by absolute position, so the result is exactly causal attention over the whole
sequence. Queries never move.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from launcher.trainer.model import Transformer


def positions(seq_len: int, cp_rank: int, cp: int) -> torch.Tensor:
    """Absolute positions held by `cp_rank`: its head chunk then its tail chunk."""
    if cp == 1:
        return torch.arange(seq_len)
    c = seq_len // (2 * cp)
    head = torch.arange(cp_rank * c, (cp_rank + 1) * c)
    tail = torch.arange((2 * cp - 1 - cp_rank) * c, (2 * cp - cp_rank) * c)
    return torch.cat([head, tail])


def shard_sequence(x: torch.Tensor, cp_rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This cp rank's head and tail chunks of `x` along `dim` (tokens or labels)."""
    if cp == 1:
        return x
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp - 1 - cp_rank]], dim=dim).contiguous()


class _GatherKV(torch.autograd.Function):
    """All-gather along the sequence dim (2) of [b, heads, s, d]; backward sums grads to the owner."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, g):
        n, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        chunks = [c.contiguous() for c in g.chunk(n, dim=2)]
        if dist.get_backend(ctx.group) == "nccl":
            out = torch.empty_like(chunks[r])
            dist.reduce_scatter(out, chunks, group=ctx.group)
            return out, None
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g.chunk(n, dim=2)[r].contiguous(), None


class CPAttention:
    """Causal attention over the cp group for one rank's [b, heads, s/cp, d] q/k/v."""

    def __init__(self, group, cp_rank: int, cp: int, seq_len: int):
        self.group = group
        self.q_pos = positions(seq_len, cp_rank, cp)
        self.k_pos = torch.cat([positions(seq_len, r, cp) for r in range(cp)])   # gather order
        self._mask: torch.Tensor | None = None

    def mask(self, device: torch.device) -> torch.Tensor:
        if self._mask is None or self._mask.device != device:
            self._mask = (self.q_pos[:, None] >= self.k_pos[None, :]).to(device)
        return self._mask

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ks = _GatherKV.apply(k, self.group)
        vs = _GatherKV.apply(v, self.group)
        return F.scaled_dot_product_attention(q, ks, vs, attn_mask=self.mask(q.device),
                                              enable_gqa=q.shape[1] != ks.shape[1])


def apply_cp(model: Transformer, group, cp_rank: int, cp: int, seq_len: int) -> None:
    """Give every attention layer the cp core and the model this rank's RoPE positions."""
    model.set_positions(positions(seq_len, cp_rank, cp))
    if cp == 1:
        return
    core = CPAttention(group, cp_rank, cp, seq_len)
    for block in model.layers.values():
        block.attention.cp = core  # type: ignore[union-attr]
