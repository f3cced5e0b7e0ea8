"""Data parallelism over the flattened dp×cp mesh, mapped honestly from the plan's ZeRO stage.

- ZeRO 3: `fully_shard` with reshard_after_forward=True (parameters gathered per block, freed
  after forward, gathered again for backward).
- ZeRO 2: `fully_shard` with reshard_after_forward=False (parameters stay gathered from
  forward to backward; gradients and optimizer state sharded).
- ZeRO 0 and 1 (no FSDP): bf16 weights, fp32 masters and optimizer state in the lean optimizer
  (dist_optim.py): gradients all-reduced (ZeRO 0) or reduce-scattered into even shards (ZeRO 1)
  after the last micro-batch, updated weights all-gathered.

Hybrid sharding (plan.layout.dp_shard < dp): ZeRO 2/3 pass fully_shard the 2-D mesh (dp_replicate,
dp_shard·cp), FSDP2's HSDP: parameters sharded inside a shard group and replicated across them, gradients
reduce-scattered inside it and the shards all-reduced across replicas (once per step: the engine turns the
all-reduce off until the last micro-batch, FSDPModule.set_requires_all_reduce); ZeRO 1 shards the lean
optimizer over dp_shard·cp and all-reduces each shard across replicas (dist_optim.py).

`fully_shard` goes on the embedding, each transformer block, the final norm with the output head, then
the root — never on the root alone (seed failure mode 2). The embedding and the head are units of their
own, as torchtitan's: a 128k vocabulary's embedding is as large as a few blocks, and in the root it would
stay gathered, with its unsharded gradient, all step. A tied embedding that is also this stage's head
stays in the root (one parameter cannot be in two units). Gradients are summed, not averaged (divide factor 1), because the loss
is already normalised by the global token count (loss.py).
"""

from __future__ import annotations

import logging

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from launcher.trainer.model import Transformer

log = logging.getLogger("launcher.trainer")


def describe(zero: int, dp_size: int, replicas: int = 1) -> str:
    if dp_size == 1:
        return "no data parallelism (dp·cp = 1): parameters unsharded"
    hybrid = (f"; hybrid: sharded over {dp_size // replicas} ranks, {replicas} replicas, shards all-reduced "
              "across them" if replicas > 1 else "")
    if zero == 3:
        return "ZeRO 3: fully_shard per block, embedding, norm+head and root, reshard_after_forward=True" + hybrid
    if zero == 2:
        return "ZeRO 2: fully_shard per block, embedding, norm+head and root, reshard_after_forward=False" + hybrid
    if zero == 1:
        return ("ZeRO 1: replicated weights; gradients reduce-scattered (sum) into even fp32 shards, "
                "master weights and optimizer state sharded, updated weights all-gathered" + hybrid)
    return "ZeRO 0: replicated weights and optimizer state, gradients all-reduced (sum) after backward"


def mode(zero: int, dp_size: int) -> str:
    if dp_size == 1:
        return "none"
    return "fsdp" if zero >= 2 else "replicate"


def apply_fsdp(model: Transformer, dp_mesh, zero: int, bf16: bool, expert_mesh=None) -> None:
    """`dp_mesh`: 1-D (dp·cp) or 2-D (replicas, shard group: HSDP). `expert_mesh`: with expert parallelism,
    each EP-sharded expert is its own FSDP unit over the dp·cp/ep ranks that hold the same experts (the
    block's unit then skips its parameters)."""
    from launcher.trainer.moe import MoE

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    tied_here = model.tok_embeddings is not None and model.output is None and model.norm is not None
    if model.tok_embeddings is not None and not tied_here:
        fully_shard(model.tok_embeddings, mesh=dp_mesh, reshard_after_forward=zero == 3, mp_policy=mp)
    for block in model.layers.values():
        for moe in (m for m in block.modules() if isinstance(m, MoE) and m.ep.ep > 1):
            for expert in moe.experts.values():
                fully_shard(expert, mesh=expert_mesh, reshard_after_forward=zero == 3, mp_policy=mp)
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=zero == 3, mp_policy=mp)
    if model.norm is not None and model.output is not None:
        # gathered until their backward, which follows the forward at once (the loss is next)
        fully_shard([model.norm, model.output], mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp)
    # the root holds what is left (a tied embedding-and-head), unsharded after forward: backward needs it at once
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            if dp_mesh.device_type == "cpu":
                m.set_force_sum_reduction_for_comms(True)   # gloo has no PREMUL_SUM


def local_grads(params: list[torch.nn.Parameter]) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """Each parameter with its gradient's local tensor, the gradient first redistributed to the
    parameter's own placements (TP can leave a DTensor gradient Partial or differently sharded)."""
    out = []
    for p in params:
        g = p.grad
        if g is None:
            continue
        if hasattr(g, "placements") and tuple(g.placements) != tuple(p.placements):  # type: ignore[attr-defined]
            g = g.redistribute(p.device_mesh, p.placements)  # type: ignore[attr-defined]
            p.grad = g
        out.append((p, g._local_tensor if hasattr(g, "_local_tensor") else g))
    return out
