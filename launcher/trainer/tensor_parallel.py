"""Tensor parallelism with sequence parallelism (Megatron layout, torch.distributed.tensor.parallel).

Why this plan: attention heads and the MLP's inner dimension split column-then-row so each
block needs one all-gather in and one reduce-scatter out per sub-layer; the norms and the
residual stream stay sharded along the sequence (SequenceParallel), so no rank stores the
full s·b·h activations outside attention/MLP, and the linears (sequence_parallel.py) keep the
shard, not the gathered sequence, for their backward. The embedding is vocab-sharded (sequence_parallel.embedding_scatter)
and the output projection is vocab-sharded too: the loss (loss.py) is computed vocab-parallel
from those shards, so full logits are never gathered.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    PrepareModuleInput,
    SequenceParallel,
    parallelize_module,
)

from launcher.trainer.model import Attention, Transformer


def block_plan(moe: bool = False) -> dict:
    """The modules DTensor handles in a block: the norms, sequence-parallel (their weights replicated,
    their inputs and outputs sequence shards), and the sub-layers' inputs handed over as this rank's
    plain sequence shard. The linears themselves are sequence_parallel.py's ops (shard_block's weights);
    a mixture-of-experts block's router and experts are not split (expert TP 1, Megatron's ETP=1): each
    TP rank routes its own sequence shard's tokens."""
    shard_in = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
                                  use_local_output=True)
    return {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                        desired_input_layouts=(Shard(1), None, None), use_local_output=True),
        "ffn_norm": SequenceParallel(),
        # the MoE's output is this rank's shard of the residual stream, as linear_scatter's is
        "feed_forward": shard_in,
    }


def _shard_weight(linear: nn.Module, tp_mesh: DeviceMesh, dim: int) -> None:
    """Replace a Linear's weight by its TP DTensor: dim 0 (column-parallel) or 1 (row-parallel)."""
    w = linear.weight
    linear.weight = nn.Parameter(distribute_tensor(w.detach(), tp_mesh, [Shard(dim)], src_data_rank=None),  # type: ignore[operator]
                                 requires_grad=w.requires_grad)  # type: ignore[arg-type]


def shard_block(block: nn.Module, tp_mesh: DeviceMesh, moe: bool) -> None:
    """Megatron's column-then-row split of attention (and a dense MLP): heads and the MLP's inner
    dimension over TP, the sequence-parallel ops given the group (model.Attention.sp, FeedForward.sp)."""
    group = (tp_mesh.size(), tp_mesh.get_group().group_name)
    attn = block.get_submodule("attention")
    for name in ("wq", "wk", "wv"):
        _shard_weight(attn.get_submodule(name), tp_mesh, 0)
    _shard_weight(attn.get_submodule("wo"), tp_mesh, 1)
    attn.sp = group  # type: ignore[assignment]
    if moe:
        return
    ffn = block.get_submodule("feed_forward")
    for name in ("w1", "w3"):
        if hasattr(ffn, name):
            _shard_weight(ffn.get_submodule(name), tp_mesh, 0)
    _shard_weight(ffn.get_submodule("w2"), tp_mesh, 1)
    ffn.sp = group  # type: ignore[assignment]


def apply_tp(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """Shard `model` (a whole model or one pipeline stage) over `tp_mesh` in place."""
    if tp_mesh.size() == 1:
        return
    if model.tok_embeddings is not None:
        # token ids replicated in, sequence-sharded hidden states out (sequence_parallel.embedding_scatter)
        _shard_weight(model.tok_embeddings, tp_mesh, 0)
        rows = cast(torch.Tensor, model.tok_embeddings.weight).shape[0] // tp_mesh.size()
        model.tok_embeddings.sp = (tp_mesh.get_local_rank() * rows, tp_mesh.size(), str(tp_mesh.get_group().group_name))
    if model.norm is not None:
        parallelize_module(model, tp_mesh, {"norm": SequenceParallel()})
    if model.output is not None:
        # vocab-sharded [V/tp, h]; used directly by the vocab-parallel loss, never called as a module
        w = model.output.weight
        model.output.weight = nn.Parameter(distribute_tensor(w.detach(), tp_mesh, [Shard(0)], src_data_rank=None),  # type: ignore[operator]
                                           requires_grad=w.requires_grad)  # type: ignore[arg-type]
    per_rank = model.args.heads // tp_mesh.size()
    for block in model.layers.values():
        moe = _is_moe(block)             # a MoE model's first_dense_layers are dense
        parallelize_module(block, tp_mesh, block_plan(moe))
        shard_block(block, tp_mesh, moe)
        attn = block.attention
        assert isinstance(attn, Attention)
        attn.first_head = tp_mesh.get_local_rank() * per_rank   # ALiBi's slopes


def _is_moe(block: nn.Module) -> bool:
    from launcher.trainer.moe import MoE

    return isinstance(getattr(block, "feed_forward", None), MoE)


def tag_tp_replicated(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """Mark the MoE weights TP leaves whole (router, experts, shared experts) with the TP group their gradients are summed
    over: each TP rank's gradient is its own tokens' share (the lean optimizer sums them before its reduce).
    Call on the final Parameter objects (after to_empty)."""
    if tp_mesh.size() == 1 or model.args.experts <= 1:
        return
    group = tp_mesh.get_group()
    for block in model.layers.values():
        if not _is_moe(block):          # a dense layer of a MoE model (first_dense_layers): split as usual
            continue
        ffn = block.feed_forward
        assert isinstance(ffn, nn.Module)
        for p in ffn.parameters():
            p.tp_sum_group = group  # type: ignore[attr-defined]
