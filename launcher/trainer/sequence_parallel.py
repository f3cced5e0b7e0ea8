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

Under train.precision fp8 each weight flagged in ``fp8`` runs its three GEMMs by torchao's rowwise recipe
(float8.py: the operands cast to e4m3 along the GEMM's inner dimension); the gathered input is cast once for all
the weights that share it; what is saved and communicated stays in the compute dtype (torchtitan's recipe).

Each op's forward holds one full-sequence buffer while it runs (the gathered input, the partial
sum): :func:`workspace_bytes` declares it, so `launch verify`'s tracer counts it (it sees a
custom op's outputs, not what happens inside).
"""

from __future__ import annotations

import torch
from torch import Tensor

from launcher.trainer import float8

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
def gather_linear(x: Tensor, weights: list[Tensor], group_size: int, group_name: str,
                  fp8: list[bool]) -> list[Tensor]:
    full = _gather_seq(x, group_size, group_name)
    if not any(fp8):
        return [full @ w.t() for w in weights]
    b, n, h = full.shape
    flat = full.reshape(-1, h)
    cast_x = float8.cast(flat, -1)                                    # once for every fp8 weight
    return [float8.linear(flat, w, cast_x).view(b, n, -1) if f else full @ w.t() for w, f in zip(weights, fp8)]


@gather_linear.register_fake
def _(x: Tensor, weights: list[Tensor], group_size: int, group_name: str, fp8: list[bool]) -> list[Tensor]:
    b, s, _h = x.shape
    return [x.new_empty(b, s * group_size, w.shape[0]) for w in weights]


def _gather_linear_setup(ctx, inputs, output) -> None:
    x, weights, group_size, group_name, fp8 = inputs
    ctx.save_for_backward(x, *weights)
    ctx.group, ctx.fp8 = (group_size, group_name), list(fp8)


def _wanted(ctx) -> list[bool]:
    """Which of the op's tensor inputs the running backward differentiates to: every one in a whole backward;
    one side each in a split one (pipelining's input-gradient step, autograd.grad to the stage inputs, then its
    weight step, autograd.grad to the weights: pipelining/_backward.py), where computing both would run each
    linear's backward, and its collectives, twice. A leaf that autograd.grad differentiates to, or a call
    outside a running backward (a trace of the op), makes torch refuse the question: wanted."""
    out = []
    for node, _ in ctx.next_functions:
        try:
            out.append(node is not None and torch._C._will_engine_execute_node(node))
        except RuntimeError:
            out.append(True)
    return out


def _gather_linear_backward(ctx, grads: list[Tensor]):
    x, *weights = ctx.saved_tensors
    want = _wanted(ctx)
    flat = [g.reshape(-1, g.shape[-1]) for g in grads]
    weight_grads: list[Tensor | None] = [None] * len(weights)
    if any(want[1:]):
        full = _gather_seq(x, *ctx.group).reshape(-1, x.shape[-1])    # gathered again (Megatron's backward)
        cast_x = float8.column_major(full) if any(ctx.fp8) else None
        weight_grads = [(float8.weight_grad(g, full, cast_x) if f else g.t() @ full) if w else None
                        for g, f, w in zip(flat, ctx.fp8, want[1:])]
        del full, cast_x                                              # before the input gradient is made
    if not want[0]:
        return None, weight_grads, None, None, None
    grad_full = _input_grad(grads[0], flat[0], weights[0], ctx.fp8[0])
    for g, gf, w, f in zip(grads[1:], flat[1:], weights[1:], ctx.fp8[1:], strict=True):
        grad_full.add_(_input_grad(g, gf, w, f))
    return _scatter_seq(grad_full, *ctx.group), weight_grads, None, None, None


def _input_grad(g: Tensor, flat: Tensor, w: Tensor, fp8: bool) -> Tensor:
    """g @ w ([b, s, n] @ [n, h]), in fp8 by the recipe where the weight is."""
    return float8.input_grad(flat, w).view(*g.shape[:-1], -1) if fp8 else g @ w


gather_linear.register_autograd(_gather_linear_backward, setup_context=_gather_linear_setup)


@torch.library.custom_op("launch4d::linear_scatter", mutates_args=())
def linear_scatter(x: Tensor, w: Tensor, group_size: int, group_name: str, fp8: bool) -> Tensor:
    if fp8:
        b, s, k = x.shape
        return _scatter_seq(float8.linear(x.reshape(-1, k), w).view(b, s, -1), group_size, group_name)
    return _scatter_seq(x @ w.t(), group_size, group_name)


@linear_scatter.register_fake
def _(x: Tensor, w: Tensor, group_size: int, group_name: str, fp8: bool) -> Tensor:
    b, s, _k = x.shape
    return x.new_empty(b, s // group_size, w.shape[0])


def _linear_scatter_setup(ctx, inputs, output) -> None:
    x, w, group_size, group_name, fp8 = inputs
    ctx.save_for_backward(x, w)
    ctx.group, ctx.fp8 = (group_size, group_name), fp8


def _linear_scatter_backward(ctx, grad: Tensor):
    x, w = ctx.saved_tensors
    want_x, want_w = _wanted(ctx)
    g = _gather_seq(grad, *ctx.group)                                  # [b, s, h]
    g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
    if ctx.fp8:
        return (float8.input_grad(g2, w).view(*x.shape) if want_x else None,
                float8.weight_grad(g2, x2) if want_w else None, None, None, None)
    return g @ w if want_x else None, g2.t() @ x2 if want_w else None, None, None, None


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
    linear_scatter (b == 1 makes the transposes views and copies the same bytes once). Under fp8 (the ops' fp8
    flags) also the casts inside (float8.cast: an fp32 copy and its e4m3 result, 5 B an element, the input's kept
    while each weight is cast), at their larger moment."""
    if func is OPS[0]:
        x, ws, n = args[0], args[1], args[2]
        full = x.numel() * n
        if not any(args[4]):
            return full * x.element_size()
        w = max(t.numel() for t, f in zip(ws, args[4]) if f)
        return full * x.element_size() + max(5 * full, full + 5 * w)
    if func is OPS[1]:
        x, w = args[0], args[1]
        partial = x.shape[0] * x.shape[1] * w.shape[0] * x.element_size()
        if not args[4]:
            return partial
        return max(5 * x.numel(), x.numel() + 5 * w.numel(), x.numel() + w.numel() + partial, partial)
    if func is OPS[2]:
        ids, w = args[0], args[1]
        return ids.numel() * w.shape[1] * w.element_size()
    return 0
