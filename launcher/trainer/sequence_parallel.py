"""Megatron's sequence-parallel linears, as two torch custom ops: a rank keeps only its sequence shard.

Why not DTensor's ColwiseParallel behind a Shard(1)->Replicate redistribute: the matmuls then save
the all-gathered input for their weight gradients, s·b·h per sub-layer on every TP rank, where
Megatron (Korthikanti et al. 2022, §4.2.2; ColumnParallelLinear with sequence_parallel) saves the
shard and gathers it again in backward. And under selective recompute the row-parallel matmul's
full-sequence partial sum (before its reduce-scatter) is a kept matmul output. As one custom op
each, autograd saves exactly what the backward below needs, and selective recompute
(recompute.SAVED_OPS) keeps the op's outputs and never replays what is inside it.

- ``gather_linear(x, [w...])``: all-gather ``x`` [b, s/tp, h] along the sequence, one matmul per
  weight (q, k, v share one gather, as Megatron's fused QKV); saves ``x`` (the shard). Backward:
  the same all-gather again, the weight gradients from it, the input gradient reduce-scattered.
- ``embedding_scatter(ids, w)``: the vocabulary-parallel embedding (this rank's rows looked up, the
  partial sums reduce-scattered along the sequence); its backward makes only this rank's rows'
  gradient, where DTensor's RowwiseParallel embedding makes the whole [vocab, h] one and slices it.
- ``linear_scatter(x, w)``: the row-parallel matmul and the reduce-scatter of its partial sums
  along the sequence; saves ``x`` (which its producer keeps anyway). Backward: the output gradient
  all-gathered, both gradients from it.

Each op's forward holds one full-sequence buffer while it runs (the gathered input, the partial
sum): :func:`workspace_bytes` declares it, so `launch verify`'s tracer counts it (it sees a
custom op's outputs, not what happens inside).
"""

from __future__ import annotations

import torch
from torch import Tensor

_c10d = torch.ops._c10d_functional


def _gather_seq(x: Tensor, group_size: int, group_name: str) -> Tensor:
    """[b, s, h] shards -> [b, s·n, h] in sequence order (rank-major along dim 1)."""
    b, s, h = x.shape
    g = _c10d.wait_tensor(_c10d.all_gather_into_tensor(x.transpose(0, 1).contiguous(), group_size, group_name))
    return g.view(group_size * s, b, h).transpose(0, 1)   # b == 1: a view; else the caller's matmul copies


def _scatter_seq(y: Tensor, group_size: int, group_name: str) -> Tensor:
    """Sum [b, s, h] partial results over the group, each rank keeping its [b, s/n, h] sequence shard."""
    b, s, h = y.shape
    rows = y.transpose(0, 1).contiguous()                   # [s, b, h]: the shards are contiguous blocks
    out = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(rows, "sum", group_size, group_name))
    return out.view(s // group_size, b, h).transpose(0, 1).contiguous()


@torch.library.custom_op("launch4d::gather_linear", mutates_args=())
def gather_linear(x: Tensor, weights: list[Tensor], group_size: int, group_name: str) -> list[Tensor]:
    full = _gather_seq(x, group_size, group_name)
    return [full @ w.t() for w in weights]


@gather_linear.register_fake
def _(x: Tensor, weights: list[Tensor], group_size: int, group_name: str) -> list[Tensor]:
    b, s, _h = x.shape
    return [x.new_empty(b, s * group_size, w.shape[0]) for w in weights]


def _gather_linear_setup(ctx, inputs, output) -> None:
    x, weights, group_size, group_name = inputs
    ctx.save_for_backward(x, *weights)
    ctx.group = (group_size, group_name)


def _gather_linear_backward(ctx, grads: list[Tensor]):
    x, *weights = ctx.saved_tensors
    full = _gather_seq(x, *ctx.group).reshape(-1, x.shape[-1])        # gathered again (Megatron's backward)
    weight_grads = [g.reshape(-1, g.shape[-1]).t() @ full for g in grads]
    del full                                                          # before the input gradient is made
    grad_full = grads[0] @ weights[0]
    for g, w in zip(grads[1:], weights[1:], strict=True):
        grad_full.add_(g @ w)
    return _scatter_seq(grad_full, *ctx.group), weight_grads, None, None


gather_linear.register_autograd(_gather_linear_backward, setup_context=_gather_linear_setup)


@torch.library.custom_op("launch4d::linear_scatter", mutates_args=())
def linear_scatter(x: Tensor, w: Tensor, group_size: int, group_name: str) -> Tensor:
    return _scatter_seq(x @ w.t(), group_size, group_name)


@linear_scatter.register_fake
def _(x: Tensor, w: Tensor, group_size: int, group_name: str) -> Tensor:
    b, s, _k = x.shape
    return x.new_empty(b, s // group_size, w.shape[0])


def _linear_scatter_setup(ctx, inputs, output) -> None:
    x, w, group_size, group_name = inputs
    ctx.save_for_backward(x, w)
    ctx.group = (group_size, group_name)


def _linear_scatter_backward(ctx, grad: Tensor):
    x, w = ctx.saved_tensors
    g = _gather_seq(grad, *ctx.group)                                  # [b, s, h]
    grad_w = g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
    return g @ w, grad_w, None, None


linear_scatter.register_autograd(_linear_scatter_backward, setup_context=_linear_scatter_setup)



@torch.library.custom_op("launch4d::embedding_scatter", mutates_args=())
def embedding_scatter(ids: Tensor, w: Tensor, vocab_start: int, group_size: int, group_name: str) -> Tensor:
    """Megatron's VocabParallelEmbedding with sequence parallelism: each rank looks up the tokens of its
    vocabulary rows (zeros for the others), and the partial sums are reduce-scattered along the sequence."""
    local, outside = _local_ids(ids, vocab_start, w.shape[0])
    rows = torch.nn.functional.embedding(local, w).masked_fill_(outside.unsqueeze(-1), 0)
    return _scatter_seq(rows, group_size, group_name)


@embedding_scatter.register_fake
def _(ids: Tensor, w: Tensor, vocab_start: int, group_size: int, group_name: str) -> Tensor:
    b, s = ids.shape
    return w.new_empty(b, s // group_size, w.shape[1])


def _local_ids(ids: Tensor, vocab_start: int, rows: int) -> tuple[Tensor, Tensor]:
    local = ids - vocab_start
    outside = (local < 0) | (local >= rows)
    return local.masked_fill(outside, 0), outside


def _embedding_setup(ctx, inputs, output) -> None:
    ids, w, vocab_start, group_size, group_name = inputs
    ctx.save_for_backward(ids)
    ctx.rows, ctx.dtype = w.shape[0], w.dtype
    ctx.vocab_start, ctx.group = vocab_start, (group_size, group_name)


def _embedding_backward(ctx, grad: Tensor):
    (ids,) = ctx.saved_tensors
    g = _gather_seq(grad, *ctx.group)                                 # [b, s, h]
    local, outside = _local_ids(ids, ctx.vocab_start, ctx.rows)
    g = g.masked_fill(outside.unsqueeze(-1), 0)
    # only this rank's vocabulary rows: DTensor's embedding backward makes the whole [vocab, h] gradient
    grad_w = g.new_zeros(ctx.rows, g.shape[-1]).index_add_(0, local.reshape(-1), g.reshape(-1, g.shape[-1]))
    return None, grad_w, None, None, None


embedding_scatter.register_autograd(_embedding_backward, setup_context=_embedding_setup)


#: the ops' overloads, for selective recompute's kept list and the tracer
OPS = (torch.ops.launch4d.gather_linear.default, torch.ops.launch4d.linear_scatter.default,
       torch.ops.launch4d.embedding_scatter.default)


def workspace_bytes(func, args) -> int:
    """The full-sequence buffer one of these ops holds while its forward runs (0 for any other op): the
    gathered input and its [s, b, h] transpose for gather_linear, the partial sum and its transpose for
    linear_scatter (b == 1 makes the transposes views and copies the same bytes once)."""
    if func is OPS[0]:
        x, _w, n = args[0], args[1], args[2]
        return x.numel() * n * x.element_size()
    if func is OPS[1]:
        x, w = args[0], args[1]
        return x.shape[0] * x.shape[1] * w.shape[0] * x.element_size()
    if func is OPS[2]:
        ids, w = args[0], args[1]
        return ids.numel() * w.shape[1] * w.element_size()
    return 0
