"""Trace one rank of a full-size job on this CPU: the real Engine, a fake world, no real memory.

Why: the ledger is a formula; what a rank really holds is whatever the trainer's own code
allocates (FSDP2 buffers, TP/SP shards, the pipeline schedule's in-flight micro-batches, SDPA's
kernels, the chunked loss). This module builds the trainer's Engine for one global rank of the
plan's full world under torch's fake process group (`FakeStore`, backend "fake": collectives
return at once) and FakeTensorMode (tensors have shapes, dtypes and storages of known size but
no data), runs one optimizer step through Engine.step, and measures that rank's peak with
torch's FSDP-aware MemTracker, by category.

What it takes to run the trainer unchanged in that world (../shared/notes/testbed.md lists what failed):
- DeviceMesh objects are metadata: they are built from real tensors even inside FakeTensorMode
  (FSDP2 concatenates the dp and tp meshes inside fully_shard, which under fake mode hit
  `aten.nonzero`).
- The pipeline's start-up vote and metadata exchange need peers; under the fake group each
  stage is given its input/output metadata up front (static mode), computed from the plan.
- The optimizer state is created before the traced step, as it exists from step 2 on.
- What the plan's GPU runs differently from this CPU is run its way: the optimizer's foreach step
  (step_as_on_the_nodes) and CP's prefix attention without a mask tensor (attention_as_on_the_nodes).
- The tracker is entered inside the fake mode (it only counts ops run under the mode it was
  entered in), counts every part of a rank (virtual pipeline stages), counts parameters and
  gradients that FSDP does not manage (ZeRO 0/1, dp·cp = 1), and accepts one forward per
  micro-batch.
- Categories follow what a tensor is, not when it was made (as the ledger files them): the lean
  optimizer's fp32 masters (ZeRO 0/1) are optimizer state and its fp32 gradient shards gradients,
  its packed reduce buffers and gathered weights communication buffers, and the
  fp32 gradients FSDP accumulates unsharded while pipelining disables gradient sync are gradients
  (torch's files them as backward temporaries), and the grad-norm clip's float64 copies, made
  between the backward and the optimizer, and what optimizer.step makes beside the state it updates
  are temporaries (torch's files them as activations and optimizer state).
  What recompute remakes in backward (a checkpointed block's body run again) is an activation, as
  Korthikanti's and Megatron's counts have it (torch's files it as a backward temporary, except what an
  FSDP unit inside the block, an EP expert, recomputes), and FSDP's
  reduce-scatter input is a communication buffer from its allocation on (torch's re-files it so
  only when the collective runs).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from unittest import mock

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed.fsdp import FSDPModule

from launcher.plan.capabilities import SPLIT_BACKWARD
from launcher.trainer import engine as engine_mod
from launcher.trainer import float8
from launcher.trainer import pipeline as pipeline_mod
from launcher.trainer.config import TrainerConfig
from launcher.trainer.engine import Engine
from launcher.verify.fakeworld import (
    MetaBuiltTransformer,
    assumed_routing,
    attention_as_on_the_nodes,
    compiled_as_traced,
    mesh_for,
    untracked_sharding_propagation,
)
from launcher.verify.replay import ActionLog, replay_peak, schedule_orders
from launcher.verify.tracker import CATEGORIES, RankMemTracker, weak_module_grad_hooks


@dataclass
class StepTrace:
    """The peak of one traced optimizer step with `micro_batches` micro-batches (bytes)."""

    micro_batches: int
    peak: int
    categories: dict[str, int]
    detail: dict[str, int]          # the tracker's own categories at the peak
    per_micro_batch: dict[str, int] = field(default_factory=dict)   # see step_long_bytes
    segments: list[dict] = field(default_factory=list)              # see ActionLog (per_action traces)


@dataclass
class RoleTrace:
    """What one rank holds: the traced step(s) and the state computed from local shard shapes."""

    rank: int
    stage_ids: list[int]
    state: dict[str, int]           # params / grads / optimizer from local shard shapes (exact)
    steps: list[StepTrace] = field(default_factory=list)
    dp_mode: str = ""
    seconds: float = 0.0


def run_fewer_micro_batches(eng: Engine, m: int) -> None:
    """Let a 1F1B schedule built for pp micro-batches run `m` < pp of them. The torch schedule refuses
    fewer than pp at construction because the other stages would starve; this rank's own order of
    operations (min(m, pp - stage) forwards in flight, then one backward / one forward) does not
    depend on them, and under the fake group nobody waits."""
    from torch.distributed.pipelining import Schedule1F1B

    if not isinstance(eng.schedule, Schedule1F1B):
        raise RuntimeError(f"only a 1F1B schedule runs fewer micro-batches than pp, not {type(eng.schedule)}")
    eng.schedule._n_microbatches = m

def with_micro_batches(cfg: TrainerConfig, m: int) -> TrainerConfig:
    """The same plan with `m` micro-batches per step (global batch follows)."""
    plan = cfg.plan
    if m == plan.grad_accum:
        return cfg
    lay = dataclasses.replace(plan.layout, grad_accum=m)
    train = dataclasses.replace(plan.train, global_batch=plan.micro_batch * m * plan.dp)
    return dataclasses.replace(cfg, plan=dataclasses.replace(plan, layout=lay, train=train))


def hidden_dtype(eng: Engine) -> torch.dtype:
    """What one pipeline stage sends the next: the compute dtype (bf16 weights or FSDP's bf16 gathers)."""
    return eng.compute_dtype


def make_pipeline_static(eng: Engine, cfg: TrainerConfig) -> None:
    """Give each of this rank's PipelineStages its input/output metadata (what the start-up vote
    and metadata exchange with the neighbouring ranks would have found) and skip that exchange."""
    from torch.distributed.pipelining._utils import InferenceMode, _StageMeta, extract_tensor_metas

    sched = eng.schedule
    p = cfg.plan
    seq = cfg.train.seq_len // p.cp
    hidden = torch.empty(p.micro_batch, seq // p.tp, cfg.model.hidden, dtype=hidden_dtype(eng),
                         device=eng.mesh.device)
    stages = list(getattr(sched, "_stages", None) or [sched._stage])  # type: ignore[union-attr]
    for st in stages:
        # a received activation requires grad, as the previous stage's output does: the stage's backward makes
        # its input gradient (what it sends back), and a split backward differentiates to it first
        x = torch.zeros(p.micro_batch, seq, dtype=torch.long, device=eng.mesh.device) if st.is_first else \
            hidden.detach().requires_grad_(True)
        y = hidden.detach().requires_grad_(True)
        st._user_meta = _StageMeta(inputs=extract_tensor_metas((x,)), outputs=extract_tensor_metas((y,)))

    def all_static(stages, has_backward, p2p_done) -> None:
        for s in stages:
            s._inference_mode = InferenceMode.STATIC

    sched._warmup_p2p = all_static  # type: ignore[union-attr]


def check_stage_output(eng: Engine, cfg: TrainerConfig) -> None:
    """The first stage's real output must be what the next stage was told to expect."""
    if eng.schedule is None or 0 not in eng.stage_ids:
        return
    p = cfg.plan
    part = eng.parts[eng.stage_ids.index(0)]
    x = torch.zeros(p.micro_batch, cfg.train.seq_len // p.cp, dtype=torch.long, device=eng.mesh.device)
    with torch.no_grad():
        y = part(x)
    for m in part.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    want = (p.micro_batch, cfg.train.seq_len // p.cp // p.tp, cfg.model.hidden)
    if tuple(y.shape) != want or y.dtype != hidden_dtype(eng):
        raise RuntimeError(f"pipeline stage 0 outputs {tuple(y.shape)} {y.dtype}, but the next stage "
                           f"expects {want} {hidden_dtype(eng)}")


def step_as_on_the_nodes(eng: Engine, cfg: TrainerConfig) -> None:
    """Run the optimizer's step as torch runs it on the plan's device: on a GPU, AdamW and SGD default to
    their foreach implementations (one kernel over every local tensor: AdamW makes sqrt(v) for all of
    them at once), on a CPU to one parameter at a time; the traced tensors live on this CPU."""
    on_gpu = cfg.plan.gpu.name != "cpu"
    for group in eng.optimizer.param_groups:
        if "foreach" in group and group["foreach"] is None:
            group["foreach"] = on_gpu


def init_optimizer_state(eng: Engine) -> None:
    """Create the optimizer state as it exists from step 2 on (zero gradients, one step)."""
    if eng.lean is not None:
        eng.lean.init_state()
        return
    for q in eng.params:
        if q.requires_grad:
            q.grad = torch.zeros_like(q)
    eng.optimizer.step()
    eng.optimizer.zero_grad(set_to_none=True)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (DTensors: their local shards)."""
    seen, total = set(), 0
    for t in tensors:
        for st in get_untyped_storages(t):
            if id(st) not in seen:
                seen.add(id(st))
                total += st.nbytes()
    return total


def computed_state(eng: Engine) -> dict[str, int]:
    """Parameters, gradients and optimizer state from the local shard shapes (exact, not traced).
    Gradients: one per trainable parameter, local shard in the parameter's dtype."""
    params = [q for m in eng.parts for q in m.parameters()]
    buffers = [b for m in eng.parts for b in m.buffers()]
    width = params[0].dtype.itemsize if params else 4
    if eng.lean is not None and eng.cfg.train.grad_dtype == "fp32":
        width = 4                               # the fp32 accumulation buffers (dist_optim: main_grad)
    grads = sum(q.to_local().numel() if hasattr(q, "to_local") else q.numel() for q in params
                if q.requires_grad) * width
    opt = [v for s in eng.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    if eng.lean is not None:
        opt += eng.lean.masters                 # the fp32 masters are optimizer state (the seed's 4 of 12 B)
    return {"params": storage_bytes(params) + storage_bytes(buffers), "grads": grads, "optimizer": storage_bytes(opt)}


def trace_step(cfg: TrainerConfig, bf16: bool, micro_batches: int,
               replay: tuple[int, list[int]] | None = None) -> tuple[StepTrace, RoleTrace]:
    """Build the rank's Engine and trace one optimizer step with `micro_batches` micro-batches
    (under 1F1B possibly fewer than pp: run_fewer_micro_batches); also the rank's state from its
    local shard shapes. Call inside fake_world() and real_device_meshes().

    `replay` = (m, pp ranks), multi-stage schedules only: `micro_batches` may be fewer than pp (the
    trainer's own check is skipped: torch's schedule is built for them); every action of the step
    is recorded (ActionLog) and StepTrace.segments holds, per pp rank, the figures at the peak of
    that rank's own action order at m micro-batches, replayed from the recorded actions (replay)."""
    pp = cfg.plan.pp
    fewer = pp > 1 and micro_batches < pp and cfg.plan.schedule == "1f1b"
    cfg_m = with_micro_batches(cfg, pp if fewer else micro_batches)
    mesh = mesh_for(cfg_m)
    allow_few = mock.patch.object(pipeline_mod, "check_microbatches", lambda *a: None) if replay else \
        contextlib.nullcontext()
    # engine.timed_sync times the wait for peers with a host sync on a one-element tensor: no peers,
    # no data and no memory here
    with FakeTensorMode(allow_non_fake_inputs=True), mock.patch.object(engine_mod, "timed_sync", lambda device: 0.0), \
            mock.patch.object(engine_mod, "Transformer", MetaBuiltTransformer), assumed_routing(), \
            untracked_sharding_propagation(), attention_as_on_the_nodes(cfg), compiled_as_traced(), \
            weak_module_grad_hooks(cfg.plan.schedule), \
            mock.patch.object(float8, "BACKWARD_FAST_ACCUM", False):     # fp8's backward GEMMs as a GPU runs them
        with allow_few:
            eng = Engine(cfg_m, mesh, bf16=bf16)
        if eng.schedule is not None:
            make_pipeline_static(eng, cfg_m)
            check_stage_output(eng, cfg_m)
            if fewer:
                run_fewer_micro_batches(eng, micro_batches)
        step_as_on_the_nodes(eng, cfg)
        init_optimizer_state(eng)
        p = cfg_m.plan
        batch = torch.randint(0, cfg.model.vocab, (p.micro_batch * micro_batches, cfg.train.seq_len + 1))
        tracker = RankMemTracker(eng.parts, eng.optimizer, eng.lean)  # type: ignore[arg-type]
        tracker.track_inputs((batch,))
        log = None
        if replay:
            sched = eng.schedule
            log = ActionLog(sched.pipeline_order_with_comms[sched.rank], tracker, sched)  # type: ignore[union-attr]
            sched.pipeline_order_with_comms[sched.rank] = log  # type: ignore[union-attr]
        with tracker, mock.patch.object(engine_mod, "clip_grad_norm", tracker.clipping(engine_mod.clip_grad_norm)):
            if log is not None:
                log.begin()
            eng.step(batch, lambda *a, **k: None)
            if log is not None:
                log.end()
        total, cats, detail = tracker.peak()
        per_mb = step_long_bytes(tracker, eng, batch, micro_batches)
        derived: list[dict] = []
        if log is not None and replay is not None:
            m, ranks = replay
            ran = list(list.__iter__(log))
            sched_name = cfg.plan.schedule
            if ran != schedule_orders(sched_name, pp, len(eng.stage_ids), micro_batches)[eng.schedule.rank]:  # type: ignore[union-attr]
                raise RuntimeError("replay: torch's schedule built without stages orders this rank's actions "
                                   "otherwise than the one that ran")
            orders = schedule_orders(sched_name, pp, len(eng.stage_ids), m)
            second = sched_name in SPLIT_BACKWARD
            carried = input_grad_bytes(eng) / micro_batches
            derived = [{"pp_rank": r, **replay_peak(log, orders[r], m, micro_batches, per_mb, pp, second, carried)}
                       for r in ranks]
        role = RoleTrace(rank=dist.get_rank(), stage_ids=list(eng.stage_ids), state=computed_state(eng),
                         dp_mode=eng.dp_mode)
    return StepTrace(micro_batches=micro_batches, peak=total, categories=cats, detail=detail,
                     per_micro_batch=per_mb, segments=derived), role


def step_long_bytes(tracker: RankMemTracker, eng: Engine, batch: torch.Tensor, m: int) -> dict[str, int]:
    """Bytes per micro-batch, by category, that live through the whole step: the token ids, and
    under a pipeline the receive buffers every stage allocates up front for each micro-batch
    (activations from the previous stage, gradients from the next). A step with more micro-batches
    holds exactly this much more at its peak, whatever the schedule keeps in flight."""
    out: dict[str, int] = {}

    def add(t: torch.Tensor | None, share: float = 1.0) -> None:
        if t is None:
            return
        for st in get_untyped_storages(t):
            winfo = tracker._WINFO.get(st, (None, None))[0]
            cat = next((c for c, keys in CATEGORIES.items() if winfo is not None and winfo.reftype in keys), None)
            if cat is not None:          # one the tracker did not see is not in the traced peak either
                out[cat] = out.get(cat, 0) + int(st.nbytes() * share)

    add(batch, 1 / m)
    stages = list(getattr(eng.schedule, "_stages", None) or [getattr(eng.schedule, "_stage", None)])
    for st in stages:
        if st is None:
            continue
        for info in (*st.args_recv_info.get(0, ()), *st.grad_recv_info.get(0, ())):
            add(info.buffer)
    return out


def input_grad_bytes(eng: Engine) -> int:
    """What the step's input-gradient steps left in the stages' receive buffers (.grad, until the next step)."""
    total = 0
    for st in getattr(eng.schedule, "_stages", None) or []:
        for infos in st.args_recv_info.values():
            for info in infos:
                g = getattr(info.buffer, "grad", None) if getattr(info, "buffer", None) is not None else None
                if g is not None:
                    total += storage_bytes([g])
    return total


def build_state(cfg: TrainerConfig, bf16: bool) -> dict[str, int]:
    """Build this (fake) rank's Engine (mesh, TP plan, stage split, FSDP wrapping, CP, optimizer)
    without stepping; its state from local shard shapes. Call inside fake_world() and
    real_device_meshes()."""
    mesh = mesh_for(cfg)
    with FakeTensorMode(allow_non_fake_inputs=True), mock.patch.object(engine_mod, "Transformer",
                                                                       MetaBuiltTransformer), assumed_routing():
        eng = Engine(cfg, mesh, bf16=bf16)
        if eng.schedule is not None:
            make_pipeline_static(eng, cfg)
        init_optimizer_state(eng)
        return computed_state(eng)
