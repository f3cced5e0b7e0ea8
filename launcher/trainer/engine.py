"""The train loop: build the model for this rank, parallelize it, and step.

Order (torchtitan's), all on the meta device: pipeline split -> TP -> activation
checkpointing -> compiled blocks (plan.layout.compile) -> FSDP; then memory for this rank's shards only, CP, and the seeded init. Each step: this dp rank's rows from the data source, its cp head/tail sequence
chunks, micro-batches through the pipeline schedule (or a plain accumulation loop), gradient
reduction as the ZeRO stage says, mesh-wide clipping, optimizer and LR schedule.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from launcher.errors import UserError
from launcher.plan.capabilities import padded_model
from launcher.trainer import context_parallel as cpar
from launcher.trainer import float8, fsdp, moe
from launcher.trainer.compiled import apply_compile
from launcher.trainer.config import TrainerConfig
from launcher.trainer.dist_optim import MixedPrecisionOptimizer
from launcher.trainer.loss import ChunkedLoss, clip_grad_norm, clip_to_global_norm
from launcher.trainer.mesh import MeshInfo, build_mesh, check_hosts, hostname, log_startup, set_timeouts
from launcher.trainer.model import Transformer
from launcher.trainer.pipeline import (
    build_schedule,
    embedding_group,
    local_stage_ids,
    stage_range,
    sum_tied_grads,
    tied_params,
)
from launcher.trainer.recompute import apply_recompute
from launcher.trainer.tensor_parallel import apply_tp, tag_tp_replicated

log = logging.getLogger("launcher.trainer")

# A sequence-parallel stage returns DTensor.to_local(), a view; FSDP2 warns in case the caller
# modifies it in place. Neither the loss nor the pipeline schedule ever does.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


def default_device() -> torch.device:
    """cuda:LOCAL_RANK when CUDA is available (unless LAUNCH4D_DEVICE=cpu), else CPU."""
    import os

    if torch.cuda.is_available() and os.environ.get("LAUNCH4D_DEVICE", "") != "cpu":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def build_parts(cfg: TrainerConfig, mesh: MeshInfo, bf16: bool) -> tuple[list[Transformer], list[int]]:
    """This rank's model part(s): one per local pipeline stage, initialised and parallelized.

    bf16 under FSDP: fp32 sharded parameters (the masters), bf16 gathered by FSDP's policy. bf16
    without FSDP: the weights themselves in bf16, their fp32 masters in the optimizer (dist_optim)."""
    p = cfg.plan
    n_stages = p.pp * p.virtual_stages
    stage_ids = local_stage_ids(mesh.coords["pp"], p.pp, p.virtual_stages, p.schedule)
    seq_local = cfg.train.seq_len // p.cp
    dp_mode = fsdp.mode(p.zero_stage, mesh.dp_cp_size)
    parts = []
    weights = torch.bfloat16 if bf16 and dp_mode != "fsdp" else torch.float32
    for sid in stage_ids:
        with torch.device("meta"), default_dtype(weights):
            m = Transformer(padded_model(cfg.model, p.tp), seq_len=seq_local)   # vocabulary padded for TP
            if n_stages > 1:
                first, last = stage_range(p.stage_layers, sid)
                m.keep_only(first, last, has_embedding=sid == 0, has_head=sid == n_stages - 1)
        if mesh.ep is not None:
            moe.apply_ep(m, mesh.ep)        # this EP rank's experts only
        # Everything below up to to_empty runs on the meta device: memory is then allocated for
        # this rank's TP and FSDP shards only, and init writes each parameter's shard of its
        # seeded full value (so a model larger than one device can still be initialised).
        apply_tp(m, mesh.tp_mesh)
        if cfg.train.precision == "fp8":
            float8.convert(m, cfg.train.fp8_linears, mesh.device)     # torchao's Float8Linear, or the SP ops' fp8 GEMMs
        apply_recompute(m, p.recompute)
        apply_compile(m, p.layout.compile)     # after TP and recompute, before FSDP (torchtitan's order)
        if dp_mode == "fsdp":
            fsdp.apply_fsdp(m, mesh.fsdp_mesh, p.zero_stage, bf16,
                            expert_mesh=mesh.ep.replica_mesh if mesh.ep is not None else None)
        m.to_empty(device=mesh.device)
        m.rope_dtype = torch.bfloat16 if bf16 else torch.float32
        cpar.apply_cp(m, mesh.group("cp"), mesh.coords["cp"], p.cp, cfg.train.seq_len, p.cp_attention,
                      compiled=p.layout.compile)
        m.init_weights(cfg.train.seed)
        moe.tag_expert_params(m)
        tag_tp_replicated(m, mesh.tp_mesh)
        parts.append(m)
    return parts, stage_ids


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Build modules with parameters in `dtype` (the meta-device model, before any memory exists)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@dataclass
class Engine:
    """Everything one rank needs to run optimizer steps."""

    cfg: TrainerConfig
    mesh: MeshInfo
    bf16: bool | None = None    # None: bf16 when the plan says so and the device is CUDA (launch verify forces it)
    parts: list[Transformer] = field(init=False)
    stage_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        cfg, mesh, p = self.cfg, self.mesh, self.cfg.plan
        cuda = mesh.device.type == "cuda"
        bf16 = self.bf16 if self.bf16 is not None else cfg.train.precision in ("bf16", "fp8") and cuda
        self.dp_mode = fsdp.mode(p.zero_stage, mesh.dp_cp_size)
        self.compute_dtype = torch.bfloat16 if bf16 else torch.float32   # activations, stage boundaries
        self.parts, self.stage_ids = build_parts(cfg, mesh, bf16=bf16)
        self.fp8_linears = sum(float8.converted(m) for m in self.parts)
        if mesh.rank == 0:
            log.info("data parallel over dp·cp = %d ranks: %s", mesh.dp_cp_size,
                     fsdp.describe(p.zero_stage, mesh.dp_cp_size, p.dp_replicas))
            if mesh.ep is not None:
                log.info("expert parallel ep=%d: %d of %d experts per rank (all-to-all dispatch); expert grads "
                         "summed over dp·cp/ep = %d replicas (%s)", p.ep, cfg.model.experts // p.ep,
                         cfg.model.experts, mesh.ep.replica_size,
                         "fully_shard per expert" if self.dp_mode == "fsdp" else "all-reduce")
            log.info("precision: %s", ("bf16 gathered params, fp32 shards/reduce/optimizer" if self.dp_mode == "fsdp"
                                       else f"bf16 weights and activations, {cfg.train.grad_dtype} gradients, fp32 "
                                            "master/optimizer") if bf16 else
                     ("fp32 (CPU runs fp32; plan asked bf16)" if cfg.train.precision == "bf16" else "fp32"))
            if cfg.train.precision == "fp8":
                log.info("fp8: %d linears' GEMMs in e4m3 with rowwise scales (torchao's %s recipe, fp8_linears %s), "
                         "the head, router and routed experts in %s", self.fp8_linears, float8.RECIPE,
                         cfg.train.fp8_linears, "bf16" if bf16 else "fp32")
            log.info("tp=%d (sequence parallel) cp=%d (%s, head/tail chunks) pp=%d schedule=%s "
                     "virtual_stages=%d stage_layers=%s recompute=%s micro_batch=%d grad_accum=%d",
                     p.tp, p.cp, "all-to-all q/k/v/out" if p.cp_attention == "all-to-all" else "all-gather KV",
                     p.pp, p.schedule, p.virtual_stages, list(p.stage_layers), p.recompute, p.micro_batch,
                     p.grad_accum)
        self.params = [q for m in self.parts for q in m.parameters()]
        experts = {id(q) for m in self.parts for q in moe.expert_params(m)}
        self.expert_params = [q for q in self.params if id(q) in experts]    # summed over the EP replicas
        self.dense_params = [q for q in self.params if id(q) not in experts]
        self.lean: MixedPrecisionOptimizer | None = None
        if self.dp_mode == "fsdp":
            self.optimizer = make_optimizer(cfg, self.params)
        else:
            self.lean = lean_optimizer(cfg, mesh, self.parts, experts)
            self.optimizer = self.lean.inner
            if mesh.rank == 0 and p.zero_stage == 1 and mesh.dp_cp_size > 1:
                log.info("ZeRO 1: fp32 master weights and optimizer state of every tensor split evenly over "
                         "%s = %d ranks (%d elements on rank 0)", "dp_shard·cp" if p.dp_replicas > 1 else "dp·cp",
                         mesh.zero_mesh.size(), sum(m.numel() for m in self.lean.masters))
        self.scheduler = make_scheduler(cfg, self.optimizer)
        n_stages = p.pp * p.virtual_stages
        last = next((m for m, s in zip(self.parts, self.stage_ids) if s == n_stages - 1), None)
        self.loss_fn = ChunkedLoss(lambda: last.output_weight(),  # type: ignore[union-attr]  # last stage only
                                   cfg.train.tokens_per_step,
                                   cfg.train.loss_chunk, mesh.group("tp") if p.tp > 1 else None,
                                   vocab=cfg.model.vocab)
        # tied embeddings over pipeline stages: two copies, gradients summed over the embedding group
        self.tied = tied_params(self.parts, self.stage_ids, n_stages) if cfg.model.tied_embeddings else []  # type: ignore[arg-type]
        self.tied_group = embedding_group(p, mesh.rank) if cfg.model.tied_embeddings and p.pp > 1 else None
        self.norm_exclude = {id(m.output.weight) for m in self.parts if m.tied_head_copy}  # type: ignore[union-attr]  # counted once
        self.schedule = None
        if p.pp > 1:
            self.schedule = build_schedule(p, self.parts, self.stage_ids, mesh.device, mesh.group("pp"),  # type: ignore[arg-type]
                                           self.loss_fn, self.lean.take_grads if self.lean is not None else None)
        self.ranks_per_stage = dist.get_world_size() // p.pp
        self.fwd_collective, self.bwd_collective = phase_collectives(p, self.dp_mode)

    @property
    def checkpointable(self):
        """What the checkpointer saves and loads the optimizer through."""
        return self.lean if self.lean is not None else self.optimizer

    wait_s: float = 0.0  # this step's time blocked in timed_sync (what a straggler's peers spend)

    def train_step(self, batch: torch.Tensor, beat) -> tuple[float, float]:
        """One optimizer step on this dp rank's rows [micro_batch·grad_accum, seq_len+1]: (loss, grad norm)."""
        loss, norm = self.step(batch, beat)
        return float(loss) / self.cfg.plan.tp, float(norm)

    def step(self, batch: torch.Tensor, beat) -> tuple[torch.Tensor, torch.Tensor]:
        """train_step without a host sync: the summed loss (× tp) and the grad norm as tensors
        (launch verify runs exactly this under FakeTensorMode)."""
        p, mesh = self.cfg.plan, self.mesh
        inputs = cpar.shard_sequence(batch[:, :-1], mesh.coords["cp"], p.cp).to(mesh.device)
        labels = cpar.shard_sequence(batch[:, 1:], mesh.coords["cp"], p.cp).to(mesh.device)
        local = torch.zeros((), dtype=torch.float32, device=mesh.device)
        if self.schedule is not None:
            beat("forward", self.fwd_collective)     # the schedule interleaves fwd/bwd itself
            losses: list[torch.Tensor] = []
            self.schedule.step(inputs, target=labels, losses=losses, return_outputs=False)
            for x in losses:
                local += x.detach().float()
        else:
            model = self.parts[0]
            for i, (inp, lab) in enumerate(zip(inputs.chunk(p.grad_accum), labels.chunk(p.grad_accum))):
                if self.dp_mode == "fsdp" and p.dp_replicas > 1:
                    # HSDP: reduce-scatter every micro-batch inside the shard group, all-reduce the summed
                    # shards across replicas once, after the last (FSDP2 keeps the partial sums meanwhile)
                    model.set_requires_all_reduce(i == p.grad_accum - 1)  # type: ignore[operator]
                beat("forward", self.fwd_collective)
                loss = self.loss_fn(model(inp), lab)
                beat("backward", self.bwd_collective)
                loss.backward()
                local += loss.detach()
        lean = self.lean
        beat("optimizer", "reduce_scatter(grads, dp·cp)" if lean is not None and p.zero_stage == 1
             else "all_reduce(grads, dp·cp)" if lean is not None else "all_reduce(grad_norm)")
        if lean is not None:
            self.wait_s += timed_sync(mesh.device)   # own compute done; the rest is waiting for peers
            if self.tied_group is not None:
                sum_tied_grads(lean.grads_of(self.tied), self.tied_group)
            lean.reduce_grads()
            norm = clip_to_global_norm(lean.grad_sq(self.ranks_per_stage, self.norm_exclude),
                                       lean.shard_grads(), self.cfg.train.grad_clip)
            beat("optimizer", "all_gather(params, dp·cp)")
            lean.step()
        else:
            if self.tied_group is not None:
                sum_tied_grads([g for _, g in fsdp.local_grads(self.tied)], self.tied_group)
            norm = clip_grad_norm(self.params, self.cfg.train.grad_clip, self.ranks_per_stage,  # type: ignore[arg-type]
                                  exclude=self.norm_exclude)
            self.optimizer.step()
        self.scheduler.step()
        for q in self.params:
            q.grad = None
        dist.all_reduce(local)                      # non-last pp stages add 0; tp ranks hold copies
        return local, norm


def timed_sync(device: torch.device) -> float:
    """Seconds this rank waits for the slowest peer: finish its own queued work, then a one-element
    all-reduce. What fast ranks spend here is what a straggler costs them (launcher.diagnose.stragglers)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    flag = torch.zeros(1, device=device)
    t0 = time.perf_counter()
    dist.all_reduce(flag)
    flag.item()
    return time.perf_counter() - t0


def phase_collectives(p, dp_mode: str) -> tuple[str | None, str | None]:
    """The first collective each phase issues (what a heartbeat names when a rank stops there)."""
    a2a = p.cp_attention == "all-to-all"
    fwd = ("all_gather(fsdp, dp·cp)" if dp_mode == "fsdp" else
           "reduce_scatter(tp)" if p.tp > 1 else
           ("all_to_all(q/k/v, cp)" if a2a else "all_gather(kv, cp)") if p.cp > 1 else
           "send/recv(pp)" if p.pp > 1 else None)
    bwd = (("all_to_all(out backward, cp)" if a2a else "all_gather(kv backward, cp)") if p.cp > 1 else
           "all_reduce(loss, tp)" if p.tp > 1 else
           "reduce_scatter(fsdp, dp·cp)" if dp_mode == "fsdp" else None)
    return fwd, bwd


def lean_optimizer(cfg: TrainerConfig, mesh: MeshInfo, parts: list[Transformer],
                   experts: set[int]) -> MixedPrecisionOptimizer:
    """ZeRO 0/1 (and dp·cp = 1): dense weights over dp·cp, EP experts over their dp·cp/ep replicas."""
    from launcher.trainer.checkpoint import merge_parts

    named = list(merge_parts(parts).named_parameters())
    dense = [(n, q) for n, q in named if id(q) not in experts]
    expert = [(n, q) for n, q in named if id(q) in experts]
    several = mesh.dp_cp_size > 1
    shard = mesh.zero_mesh if cfg.plan.zero_stage == 1 else mesh.dp_cp_mesh   # ZeRO 0 shards nothing
    groups: list[tuple] = [(dense, shard.get_group() if several else None, shard if several else None)]
    if several and shard is mesh.shard_mesh and mesh.replica_mesh is not None:
        groups[0] = (*groups[0], mesh.replica_mesh.get_group())      # hybrid: each shard all-reduced over copies
    if expert and mesh.ep is None:
        groups[0] = (named, *groups[0][1:])
    elif expert and mesh.ep is not None:
        rep = mesh.ep.replica_size > 1
        groups.append((expert, mesh.ep.replica_group if rep else None, mesh.ep.replica_mesh if rep else None))
    return MixedPrecisionOptimizer(groups, lambda masters: make_optimizer(cfg, masters),
                                   shard=cfg.plan.zero_stage == 1, grad_dtype=cfg.train.grad_dtype)


def make_optimizer(cfg: TrainerConfig, params: list) -> torch.optim.Optimizer:
    """`params` may be empty (a ZeRO 1 rank that owns no parameter): one empty group, not an error."""
    t = cfg.train
    params = [{"params": list(params)}]
    if t.optimizer == "sgd":
        return torch.optim.SGD(params, lr=t.lr, momentum=0.9, weight_decay=t.weight_decay)
    if t.optimizer == "adam8bit":
        from launcher.trainer.optim8bit import Adam8bit

        return Adam8bit(params, lr=t.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=t.weight_decay)
    # fused: one kernel over all tensors, in place, no temporaries (the foreach default makes sqrt(v) of every
    # tensor at once); torch has it on CUDA and CPU, for DTensor parameters too
    return torch.optim.AdamW(params, lr=t.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=t.weight_decay,
                             fused=True)


def make_scheduler(cfg: TrainerConfig, opt: torch.optim.Optimizer):
    """Linear warmup over train.warmup_steps, then constant."""
    warm = cfg.train.warmup_steps
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) if warm > 0 else 1.0)


def _stall_forever(rank: int, step: int, beat) -> None:
    """A rank that stops answering (fault injection); SIGTERM ends it like a hung process."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    log.warning("rank %d: --inject-stall: sleeping forever before step %d's collectives", rank, step)
    beat("forward", None)
    while True:
        time.sleep(3600)


def train(cfg: TrainerConfig, run_dir: str | Path, resume: str = "never",
          inject_stall: tuple[int, int] | None = None, device: torch.device | None = None,
          handle_signals: bool = True, inject_slow: tuple[int, float] | None = None,
          watchdog=None) -> list[float]:
    """Run cfg.train.steps optimizer steps on an initialised default process group; the losses.

    `handle_signals` installs the SIGTERM and checkpoint-signal (USR2) preemption handlers (checkpoint, exit 75).
    `inject_slow` (RANK, SECONDS) makes that rank sleep at the start of every step (a straggler);
    `watchdog` (trainer.stalls.StallWatchdog) hears every heartbeat and dumps stacks when they stop.
    """
    from launcher.trainer.checkpoint import PREEMPT_EXIT_CODE, Checkpointer
    from launcher.trainer.data import TokenSource
    from launcher.trainer.metrics import Heartbeat, MetricsLogger

    device = device or default_device()
    rank = dist.get_rank()
    run_dir = Path(run_dir)
    hb = Heartbeat(run_dir, rank, hostname())
    step_now = 0

    def beat(phase: str, collective: str | None) -> None:
        hb.beat(step_now, phase, last_collective=collective)
        if watchdog is not None:
            watchdog.progress()

    beat("init", "init_process_group")
    try:
        mesh = build_mesh(cfg, device)
        set_timeouts(mesh, cfg.init_timeout_s)
        hosts = check_hosts(cfg, mesh)
        log_startup(cfg, mesh, hosts, dist.get_backend())
        eng = Engine(cfg, mesh)
        p = cfg.plan
        data = TokenSource(cfg.plan, mesh.coords["dp"], p.dp)
        ckpt = Checkpointer(run_dir, cfg.train.checkpoint_every)
        if handle_signals:
            ckpt.install_signal_handlers()
        start = 0
        if resume != "never":
            loader = ckpt if resume == "auto" else _loader_for(resume)
            found = loader.load_latest(eng.parts, eng.checkpointable, eng.scheduler)
            if found is not None:
                start, data_state = found
                if data_state is not None:
                    data.load_state_dict(data_state)
                if rank == 0:
                    log.info("resumed from step %d", start)
        metrics = MetricsLogger(run_dir, rank, cfg.plan)
        losses = []
        for step in range(start + 1, cfg.train.steps + 1):
            step_now = step
            if inject_stall is not None and inject_stall == (rank, step):
                _stall_forever(rank, step, beat)
            t0 = time.perf_counter()
            if inject_slow is not None and inject_slow[0] == rank:
                time.sleep(inject_slow[1])
            batch = data.next_batch()
            beat("forward", "all_reduce(step sync)")
            eng.wait_s = timed_sync(mesh.device)   # a rank late with its batch is waited for here
            loss, norm = eng.train_step(batch, beat)
            dt = time.perf_counter() - t0
            if step > start + 1:  # the first step's warm-up (allocation, first collectives) says nothing
                hb.timing(dt, eng.wait_s)
            if step == start + 1:
                set_timeouts(mesh, cfg.step_timeout_s)     # init/first-step slack is over
            metrics.log_step(step, loss, norm, dt, cfg.train.tokens_per_step, lr=eng.scheduler.get_last_lr()[0])
            losses.append(loss)
            if ckpt.stop_requested(device):
                beat("checkpoint", "dcp.save")
                ckpt.maybe_save(step, eng.parts, eng.checkpointable, eng.scheduler, data.state_dict(), force=True)
                beat("done", None)
                raise SystemExit(PREEMPT_EXIT_CODE)
            if ckpt.due(step) or (step == cfg.train.steps and cfg.train.checkpoint_every > 0):
                beat("checkpoint", "dcp.save")
                ckpt.maybe_save(step, eng.parts, eng.checkpointable, eng.scheduler, data.state_dict(), force=True)
        beat("done", None)
        return losses
    except SystemExit:
        raise
    except UserError:
        hb.beat(step_now, "error")
        raise
    except BaseException as exc:
        hb.beat(step_now, "error")
        log.error("rank %d failed at step %d: %s", rank, step_now, str(exc).splitlines()[0] if str(exc) else exc)
        raise


def _loader_for(path: str):
    """A Checkpointer reading from --resume PATH: a run dir, its checkpoints/ dir, or one step-N dir."""
    from launcher.formats.rundir import resume_target
    from launcher.trainer.checkpoint import Checkpointer

    found = resume_target(path)
    if found is not None:
        checkpoints, pinned = found
        loader = Checkpointer(checkpoints.parent, 0)
        if pinned is not None:
            loader.latest_dir = lambda: pinned  # type: ignore[method-assign]
            loader.fallback = False  # the user named this one checkpoint: no other is substituted
        return loader
    raise UserError(f"--resume {path}: not a run directory, a checkpoints/ directory or a complete step-N checkpoint")
