"""Activation checkpointing as planned: none, selective (op-level) or full (whole block).

selective keeps what is expensive to recompute and recomputes what is cheap, per op (torch's
selective activation checkpointing, as torchtitan's op-level SAC and Megatron's norm/activation
recompute do): the outputs of the matmuls, of SDPA (output and logsumexp) and of TP's reduce-scatters
(sequence shards) are saved, and the sequence-parallel linears' outputs (sequence_parallel.py: the op is
kept whole, so neither its gathered input nor a row-parallel partial sum is held or replayed); the norms,
RoPE, the MLP activation and its gate product, residual adds and casts are recomputed in backward from
them. Keeping an all-gather's output would keep the whole sequence per TP rank (s·b·h, not s·b·h/tp):
Megatron keeps the shard and gathers again in backward, torchtitan's SAC list saves no all-gather either. Recomputing only the attention core (Megatron's original
"selective") saves nothing here: SDPA never materialises the s×s scores.

Why flags on the model rather than checkpoint_wrapper: the module names (and therefore the
checkpoint keys) stay the same in every recompute mode, so a run can be resumed with a
different mode. Applied after TP and before FSDP (torchtitan's order).
"""

from __future__ import annotations

from functools import partial
from typing import Protocol

import torch
from torch import nn
from torch.utils.checkpoint import SAC_IGNORED_OPS as _SAC_IGNORED_OPS
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from launcher.trainer.sequence_parallel import OPS as SP_OPS

MODES = ("none", "selective", "full")

_aten = torch.ops.aten
_c10d = torch.ops._c10d_functional
#: ops whose outputs selective recompute keeps: GEMMs, attention kernels (every backend's), the
#: sequence-parallel linears (their outputs: q/k/v and the MLP's inner rows, and sequence shards; what they
#: gather they gather again in their own backward) and the remaining reduce-scatters and all-reduces
#: (shards or small); other all-gathers are made again in backward
SAVED_OPS = frozenset({*SP_OPS,
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default,
    _aten._scaled_mm.default,               # fp8 linears' GEMMs (torchao's Float8Linear; torchtitan's SAC list too)
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _c10d.reduce_scatter_tensor.default, _c10d.all_reduce.default,
})


# FSDP's hooks on modules inside a checkpointed block (EP experts are FSDP units of their own) mark
# their work with record_function, a dispatched op, a different number of times in forward and in the
# recompute (whether an unshard is due differs): SAC would match ops by count and fail. They compute
# nothing, so selective recompute passes them through, as torch does with detach.
_SAC_IGNORED_OPS.update({torch.ops.profiler._record_function_enter_new.default,
                         torch.ops.profiler._record_function_exit._RecordFunction})


def _policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if func in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


#: checkpoint(context_fn=...) for selective recompute: fresh contexts for every call
selective_contexts = partial(create_selective_checkpoint_contexts, _policy)


class Blocks(Protocol):
    """What apply_recompute reads of a model (model.Transformer): its blocks."""

    layers: nn.ModuleDict


def apply_recompute(model: Blocks, mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"recompute mode {mode!r} is not one of {MODES}")
    for block in model.layers.values():
        block.recompute = mode  # type: ignore[assignment]  # a plain attribute on the block
