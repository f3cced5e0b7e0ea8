"""Tensor parallelism with sequence parallelism (Megatron layout, torch.distributed.tensor.parallel).

Why this plan: attention heads and the MLP's inner dimension split column-then-row so each
block needs one all-gather in and one reduce-scatter out per sub-layer; the norms and the
residual stream stay sharded along the sequence (SequenceParallel), so no rank stores the
full s·b·h activations outside attention/MLP. The embedding is vocab-sharded (RowwiseParallel)
and the output projection is vocab-sharded too: the loss (loss.py) is computed vocab-parallel
from those shards, so full logits are never gathered.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from launcher.trainer.model import Transformer


def block_plan(gated: bool, moe: bool = False) -> dict:
    """A dense block: Megatron's column-then-row split of attention and MLP. A mixture-of-experts block:
    attention as a dense one; the router and experts are not split (expert TP 1, Megatron's ETP=1): each
    TP rank routes its own sequence shard's tokens, so the MoE takes and returns the local shard."""
    plan = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                        desired_input_layouts=(Replicate(), None, None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }
    if moe:
        for k in ("feed_forward", "feed_forward.w1", "feed_forward.w2"):
            del plan[k]
        # the norm's sequence shard in, as a plain tensor; the MoE's output is this rank's shard of the
        # residual stream (which the blocks carry as local tensors, as wo's and w2's outputs are)
        plan["feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
                                                  use_local_output=True)
    elif gated:
        plan["feed_forward.w3"] = ColwiseParallel()
    return plan


def apply_tp(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """Shard `model` (a whole model or one pipeline stage) over `tp_mesh` in place."""
    if tp_mesh.size() == 1:
        return
    top: dict = {}
    if model.tok_embeddings is not None:
        # token ids replicated in, sequence-sharded hidden states out (reduce-scatter)
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        top["norm"] = SequenceParallel()
    if top:
        parallelize_module(model, tp_mesh, top)
    if model.output is not None:
        # vocab-sharded [V/tp, h]; used directly by the vocab-parallel loss, never called as a module
        w = model.output.weight
        model.output.weight = nn.Parameter(distribute_tensor(w.detach(), tp_mesh, [Shard(0)], src_data_rank=None),  # type: ignore[operator]
                                           requires_grad=w.requires_grad)  # type: ignore[arg-type]
    gated, moe = model.args.mlp == "swiglu", model.args.experts > 1
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan(gated, moe))


def tag_tp_replicated(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """Mark the MoE weights TP leaves whole (router, experts) with the TP group their gradients are summed
    over: each TP rank's gradient is its own tokens' share (the lean optimizer sums them before its reduce).
    Call on the final Parameter objects (after to_empty)."""
    if tp_mesh.size() == 1 or model.args.experts <= 1:
        return
    group = tp_mesh.get_group()
    for block in model.layers.values():
        ffn = block.feed_forward
        assert isinstance(ffn, nn.Module)
        for p in ffn.parameters():
            p.tp_sum_group = group  # type: ignore[attr-defined]
