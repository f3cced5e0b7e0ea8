"""Pipeline parallelism with torch.distributed.pipelining: stages from plan.stage_layers.

Why: layers are cut where the plan says (uneven splits allowed, e.g. fewer layers on the
stages that also hold the embedding or the output); a pp rank with virtual stages holds
stages r, r+pp, r+2·pp, ... (the layout Interleaved1F1B and InterleavedZeroBubble expect), or under
the V schedules (ZBVZeroBubble, DualPipeV) stages r and 2·pp-1-r (capabilities.rank_stages).
Micro-batches are the gradient-accumulation steps; the loss is already normalised by the global
token count, so the schedule must sum micro-batch gradients (scale_grads=False).

The zero-bubble and DualPipe-V schedules split a stage's backward in two (pipelining/_backward.py):
the input gradient (autograd.grad to the stage inputs, graph retained) and, later, the weight gradient
(autograd.grad from the saved intermediates to the weights, written into .grad by hand). That second
half runs no AccumulateGrad, so no post-accumulate-grad hook fires: `after_weight` lets the lean
optimizer take the weight gradients in then (its fp32 main_grad buffers, grad_dtype fp32).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from launcher.plan import layout
from launcher.plan.capabilities import check_microbatches, rank_stages, virtual_stages_problem
from launcher.plan.model import Plan

#: the plan's schedules by torch's classes: one stage per rank, several (interleaved or in a V)
SINGLE = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
MULTI = {"interleaved-1f1b": ScheduleInterleaved1F1B, "interleaved-zero-bubble": ScheduleInterleavedZeroBubble,
         "zero-bubble-v": ScheduleZBVZeroBubble, "dualpipe-v": ScheduleDualPipeV}


def local_stage_ids(pp_rank: int, pp: int, virtual_stages: int, schedule: str = "1f1b") -> list[int]:
    return list(rank_stages(schedule, pp_rank, pp, virtual_stages))


def stage_range(stage_layers: Sequence[int], stage_id: int) -> tuple[int, int]:
    """[first, last) global layer indices of one stage."""
    first = sum(stage_layers[:stage_id])
    return first, first + stage_layers[stage_id]


class Stage(PipelineStage):
    """torch's PipelineStage, calling `after_weight(module)` after each split backward's weight step."""

    def __init__(self, *args, after_weight: Callable[[torch.nn.Module], None] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.after_weight = after_weight

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward=False):
        super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
        if self.after_weight is not None:
            self.after_weight(self.submod)


def build_schedule(p: Plan, modules: list[torch.nn.Module], stage_ids: list[int],
                   device: torch.device, group, loss_fn,
                   after_weight: Callable[[torch.nn.Module], None] | None = None):
    """PipelineStages for this rank's modules and the planned schedule over them."""
    n_stages = p.pp * p.virtual_stages
    n_micro = p.grad_accum
    check_microbatches(p.schedule, n_micro, p.pp)
    why = virtual_stages_problem(p.schedule, p.pp, len(modules))
    if why:
        raise ValueError(f"schedule {p.schedule}: virtual_stages {why}")
    stages = [Stage(m, sid, n_stages, device, group=group, after_weight=after_weight)
              for m, sid in zip(modules, stage_ids)]
    if p.schedule in MULTI:
        return MULTI[p.schedule](stages, n_microbatches=n_micro, loss_fn=loss_fn, scale_grads=False)  # type: ignore[arg-type]
    cls = SINGLE.get(p.schedule)
    if cls is None:
        raise ValueError(f"pipeline schedule {p.schedule!r} needs pp > 1 and one of {', '.join([*SINGLE, *MULTI])}")
    return cls(stages[0], n_microbatches=n_micro, loss_fn=loss_fn, scale_grads=False)


def embedding_group(p: Plan, rank: int):
    """Tied embeddings with pp > 1: the group {first-stage rank, last-stage rank} with this rank's
    dp/cp/tp coordinates (Megatron's embedding group), or None when this rank is in none.

    Collective: every rank creates every group (dist.new_group's contract), in the same order.
    """
    degrees = {"tp": p.tp, "cp": p.cp, "pp": p.pp, "dp": p.dp}
    mine = None
    for grp in layout.groups(degrees, p.mesh_order, "pp"):
        pair = [grp[0], grp[-1]]
        g = dist.new_group(pair)
        if rank in pair:
            mine = g
    return mine


def tied_params(parts: list[torch.nn.Module], stage_ids: list[int], n_stages: int) -> list[torch.nn.Parameter]:
    """This rank's copy of a tied embedding split over pipeline stages: the embedding of stage 0
    and/or the output-head copy of the last stage (none on the stages in between)."""
    out = []
    for m, sid in zip(parts, stage_ids):
        if sid == 0 and m.tok_embeddings is not None:
            out.append(m.tok_embeddings.weight)  # type: ignore[union-attr]
        if sid == n_stages - 1 and m.tied_head_copy:
            out.append(m.output.weight)  # type: ignore[union-attr]
    return out  # type: ignore[return-value]


def sum_tied_grads(grads: list[torch.Tensor], group) -> None:
    """Sum the two copies' gradients over the embedding group (before clipping): both copies then take
    the same optimizer step from the same values and stay equal. Both copies have the same TP/FSDP
    placements, so their local shards line up element for element. `grads`: the local gradient
    tensors (fsdp.local_grads, or the lean optimizer's fp32 buffers)."""
    for g in grads:
        buf = g if g.is_contiguous() else g.contiguous()
        dist.all_reduce(buf, group=group)
        if buf is not g:
            g.copy_(buf)
