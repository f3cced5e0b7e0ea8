"""Context parallelism: exact causal attention with the sequence split over the cp ranks.

Why our own: torch's `context_parallel` has no CPU path for causal SDPA (../shared/notes/testbed.md),
and we want one implementation that runs, and is tested, on gloo and NCCL alike.

Load balance: the sequence is cut into 2·cp chunks and cp rank r holds chunks r and
2·cp−1−r (a head and a tail), so every rank has the same share of the causal triangle.
Attention all-gathers keys and values over the cp group (as Llama 3 did) into sequence order,
with an autograd function whose backward sums every rank's gradient back to the owner
(reduce-scatter on NCCL; all-reduce + slice on gloo, which has no reduce-scatter — torch's own
`torch.distributed.nn.functional.all_gather` gave wrong key gradients on gloo here). Queries
never move.

No explicit mask on GPUs: each of the rank's two query chunks sees a prefix of the sequence
(chunk j sees chunks 0..j), causal with the diagonal at the bottom right. One SDPA call per
chunk with torch's `causal_lower_right` bias, which torch runs as flash attention (is_causal,
whose diagonal is bottom-right when queries are fewer than keys) or memory-efficient attention
with a bottom-right causal mask type; the first chunk is square (is_causal=True). A boolean mask
would rule out flash attention and, with fp32 on some GPUs, fall back to the math kernel that
materialises the s² scores. CPU kernels have no bottom-right variant: there the two masks are
built once and shared by every layer.

All-to-all (DeepSpeed-Ulysses, Jacobs et al. 2023, `parallel.cp_attention: all-to-all`): the same head/tail
sequence split (data, positions, RoPE and the loss are unchanged: RoPE is applied before the exchange on the
rank's own positions), but before attention one all-to-all per q, k and v turns [b, heads, s/cp, d] into
[b, heads/cp, s, d] — cp rank r gets head group r of the whole sequence, put in sequence order — then plain
square causal SDPA (no mask, no chunking), and one all-to-all back on the output. GQA key/value heads fewer
than cp are repeated up to cp first (each rank's query group then shares one of them). Each exchange is
its own autograd function whose backward is the opposite exchange.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from launcher.plan.capabilities import CP_ATTENTIONS
from launcher.trainer.model import Transformer

#: (first query position, queries, keys, q[, first head of q among the rank's]) -> ALiBi's additive bias with
#: the causal mask (model.Attention.alibi_bias)
AlibiFn = Callable[..., torch.Tensor]


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
    """All-gather [b, heads, s/cp, d] shards along dim 2 into sequence order (every rank's head
    chunk, then the tails in reverse); backward sums each rank's gradient back to the owner."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        c = x.shape[2] // 2
        return torch.cat([p[:, :, :c] for p in parts] + [p[:, :, c:] for p in reversed(parts)], dim=2)

    @staticmethod
    def backward(ctx, g):
        n, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        chunks = g.chunk(2 * n, dim=2)
        if dist.get_backend(ctx.group) == "nccl":
            per_rank = [torch.cat([chunks[j], chunks[2 * n - 1 - j]], dim=2) for j in range(n)]
            out = torch.empty_like(per_rank[r])
            dist.reduce_scatter(out, per_rank, group=ctx.group)
            return out, None
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        chunks = g.chunk(2 * n, dim=2)
        return torch.cat([chunks[r], chunks[2 * n - 1 - r]], dim=2), None


class CPAttention:
    """Causal attention over the cp group for one rank's [b, heads, s/cp, d] q/k/v."""

    def __init__(self, group, cp_rank: int, cp: int, seq_len: int, device: torch.device | None = None):
        self.group = group
        self.cp_rank, self.cp = cp_rank, cp
        self._masks: dict[tuple[int, int, torch.device], torch.Tensor] = {}
        if device is not None:
            # compiled blocks (trainer/compiled.py): built here, once, so the graph only reads them (a cache filled
            # inside a checkpointed region is a side effect torch.compile refuses, and dynamo cannot construct
            # the causal bias, a tensor subclass, inside its graph); eager runs build them at the first forward
            c = seq_len // (2 * cp)
            for j in self.query_chunks():
                if j > 0:
                    self._mask(c, (j + 1) * c, torch.device(device))

    def query_chunks(self) -> tuple[int, int]:
        """Sequence chunk indices (of 2·cp) of this rank's head and tail queries."""
        return self.cp_rank, 2 * self.cp - 1 - self.cp_rank

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alibi: AlibiFn | None = None) -> torch.Tensor:
        return self.local(q, _GatherKV.apply(k, self.group), _GatherKV.apply(v, self.group), alibi)

    def local(self, q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, alibi: AlibiFn | None = None) -> torch.Tensor:
        """This rank's queries against the whole sequence's keys and values (in sequence order). `alibi`
        (model.Attention.alibi_bias): ALiBi's bias for (first query position, queries, keys, q)."""
        c = q.shape[2] // 2
        outs = [self._prefix(q[:, :, i * c:(i + 1) * c], ks[:, :, :(j + 1) * c], vs[:, :, :(j + 1) * c], alibi)
                for i, j in enumerate(self.query_chunks())]
        # joined in the [b, s, heads, d] layout SDPA's outputs have, so wo's reshape is a view
        return torch.cat([o.transpose(1, 2) for o in outs], dim=1).transpose(1, 2)

    def _prefix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alibi: AlibiFn | None = None) -> torch.Tensor:
        """Queries that are the last len(q) positions of keys k (causal, bottom-right diagonal)."""
        gqa = q.shape[1] != k.shape[1]
        L, S = q.shape[2], k.shape[2]
        if alibi is not None:           # the bias holds the causal mask
            return F.scaled_dot_product_attention(q, k, v, attn_mask=alibi(S - L, L, S, q), enable_gqa=gqa)
        if L == S:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self._mask(L, S, q.device), enable_gqa=gqa)

    def _mask(self, L: int, S: int, device: torch.device) -> torch.Tensor:
        """The bottom-right causal mask: torch's causal_lower_right bias (no tensor) on a GPU; on a CPU, whose
        kernels have no such variant, a boolean mask shared by every layer."""
        key = (L, S, device)
        if key not in self._masks:
            self._masks[key] = (causal_lower_right(L, S) if device.type != "cpu" else
                                torch.ones(L, S, dtype=torch.bool, device=device).tril(S - L))
        return self._masks[key]


def _scatter_heads(x: torch.Tensor, group, n: int) -> torch.Tensor:
    """[b, H, s/n, d], this rank's head and tail chunks of every head -> [b, H/n, s, d], head group `rank`
    of the whole sequence in sequence order (chunk j from rank j's head, chunk 2n-1-j from its tail)."""
    b, H, sl, d = x.shape
    hc, c = H // n, sl // 2
    send = x.reshape(b, n, hc, sl, d).transpose(0, 1).contiguous()      # [dest rank, b, H/n, s/n, d]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    del send
    r = recv.view(n, b, hc, 2, c, d)                                    # [source rank, b, H/n, head|tail, c, d]
    out = x.new_empty(b, hc, 2 * n, c, d)
    out[:, :, :n].copy_(r[:, :, :, 0].permute(1, 2, 0, 3, 4))
    for j in range(n):
        out[:, :, 2 * n - 1 - j].copy_(r[j, :, :, 1])
    return out.view(b, hc, 2 * n * c, d)


def _gather_heads(y: torch.Tensor, group, n: int, seq_major: bool = False) -> torch.Tensor:
    """The inverse of _scatter_heads: [b, H/n, s, d] -> [b, H, s/n, d]; `seq_major`: held as [b, s/n, H, d]
    (what SDPA's outputs are, so the output projection's reshape is a view) and returned transposed."""
    b, hc, S, d = y.shape
    c = S // (2 * n)
    yc = y.reshape(b, hc, 2 * n, c, d)
    send = y.new_empty(n, b, hc, 2, c, d)
    send[:, :, :, 0].copy_(yc[:, :, :n].permute(2, 0, 1, 3, 4))
    for j in range(n):
        send[j, :, :, 1].copy_(yc[:, :, 2 * n - 1 - j])
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    del send
    r = recv.view(n, b, hc, 2 * c, d)                                   # [source rank = head group, b, H/n, s/n, d]
    if seq_major:
        return r.permute(1, 3, 0, 2, 4).reshape(b, 2 * c, n * hc, d).transpose(1, 2)
    return r.permute(1, 0, 2, 3, 4).reshape(b, n * hc, 2 * c, d)


class _ToHeads(torch.autograd.Function):
    """q, k or v to this rank's head group of the whole sequence; backward sends the gradient back."""

    @staticmethod
    def forward(ctx, x, group, n):
        ctx.group, ctx.n = group, n
        return _scatter_heads(x, group, n)

    @staticmethod
    def backward(ctx, g):
        return _gather_heads(g, ctx.group, ctx.n), None, None


class _ToSequence(torch.autograd.Function):
    """Attention's output back to this rank's sequence chunks of every head."""

    @staticmethod
    def forward(ctx, y, group, n):
        ctx.group, ctx.n = group, n
        return _gather_heads(y, group, n, seq_major=True)

    @staticmethod
    def backward(ctx, g):
        return _scatter_heads(g, ctx.group, ctx.n), None, None


def kv_repeats(kv_heads: int, cp: int) -> int:
    """How often all-to-all CP repeats each of a rank's key/value heads: fewer than cp are repeated up to cp
    (capabilities.cp_attention_problem refuses counts that neither divide nor are divisible by cp)."""
    return cp // kv_heads if kv_heads < cp else 1


class UlyssesAttention:
    """Causal attention over the cp group by head exchange (DeepSpeed-Ulysses) for one rank's [b, heads, s/cp, d]
    q/k/v: all-to-all to [b, heads/cp, s, d], causal SDPA over the whole sequence, all-to-all back."""

    def __init__(self, group, cp_rank: int, cp: int):
        self.group = group
        self.cp_rank, self.cp = cp_rank, cp

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alibi: AlibiFn | None = None) -> torch.Tensor:
        n = self.cp
        rep = kv_repeats(k.shape[1], n)
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        qh, kh, vh = (_ToHeads.apply(t, self.group, n) for t in (q, k, v))
        gqa = qh.shape[1] != kh.shape[1]
        S = qh.shape[2]
        if alibi is not None:       # this rank's query heads are head group cp_rank of the rank's heads
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=alibi(0, S, S, qh, self.cp_rank * qh.shape[1]),
                                               enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=gqa)
        return _ToSequence.apply(o, self.group, n)


def apply_cp(model: Transformer, group, cp_rank: int, cp: int, seq_len: int, kind: str = "all-gather",
             compiled: bool = False) -> None:
    """Give every attention layer the cp core (`kind`: plan.layout.cp_attention) and the model this rank's
    RoPE positions. `compiled` (plan.layout.compile): the all-gather core's masks are built now, not at the
    first forward (CPAttention)."""
    model.set_positions(positions(seq_len, cp_rank, cp))
    if cp == 1:
        return
    if kind not in CP_ATTENTIONS:
        raise ValueError(f"cp_attention {kind!r} is not one of {', '.join(CP_ATTENTIONS)}")
    device = model.rope_cos.device if compiled else None
    core: CPAttention | UlyssesAttention = (CPAttention(group, cp_rank, cp, seq_len, device) if kind == "all-gather"
                                            else UlyssesAttention(group, cp_rank, cp))
    for block in model.layers.values():
        block.attention.cp = core  # type: ignore[union-attr]
