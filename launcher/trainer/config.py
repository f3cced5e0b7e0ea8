"""Plan -> typed trainer config, with every check that must hold before a process group exists.

Why a second type: plan.json is the cross-process contract (dicts for model/train); the
trainer wants typed fields and one place that rejects a plan it cannot run, with the field
named, before 8 ranks each print a traceback.
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.errors import UserError
from launcher.plan import Plan
from launcher.trainer.model import ModelArgs

SCHEDULES = ("none", "gpipe", "1f1b", "interleaved-1f1b")
RECOMPUTE = ("none", "selective", "full")
OPTIMIZERS = ("adam", "adamw", "adam8bit", "sgd")


@dataclass(frozen=True)
class ParallelConfig:
    tp: int
    cp: int
    pp: int
    dp: int
    mesh_order: tuple[str, ...]
    zero_stage: int
    recompute: str
    micro_batch: int
    grad_accum: int
    schedule: str
    virtual_stages: int
    stage_layers: tuple[int, ...]
    ep: int = 1     # expert parallelism: splits dp·cp (moe.py); not a mesh dimension of its own

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp


@dataclass(frozen=True)
class TrainConfig:
    seq_len: int
    global_batch: int
    steps: int
    optimizer: str
    precision: str
    lr: float
    warmup_steps: int
    weight_decay: float
    grad_clip: float
    seed: int
    loss_chunk: int
    checkpoint_every: int

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


@dataclass(frozen=True)
class TrainerConfig:
    plan: Plan
    model: ModelArgs
    parallel: ParallelConfig
    train: TrainConfig
    init_timeout_s: float
    step_timeout_s: float


def _req(d: dict, key: str, where: str):
    if key not in d:
        raise UserError(f"plan.{where}.{key} is missing")
    return d[key]


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise UserError(msg)


def model_args(model: dict) -> ModelArgs:
    heads = int(_req(model, "heads", "model"))
    hidden = int(_req(model, "hidden", "model"))
    return ModelArgs(layers=int(_req(model, "layers", "model")), hidden=hidden, heads=heads,
                     kv_heads=int(model.get("kv_heads") or heads),
                     ffn_hidden=int(model.get("ffn_hidden") or 4 * hidden),
                     vocab=int(_req(model, "vocab", "model")), mlp=str(model.get("mlp", "swiglu")),
                     tied_embeddings=bool(model.get("tied_embeddings", False)),
                     experts=int(model.get("experts") or 1),
                     experts_per_token=int(model.get("experts_per_token") or 1))


def config_from_plan(plan: Plan, steps: int | None = None, init_timeout_s: float | None = None,
                     step_timeout_s: float | None = None) -> TrainerConfig:
    """Typed config; UserError naming the plan field when the trainer cannot run the plan."""
    m = model_args(plan.model)
    d = plan.degrees
    t = plan.train
    par = ParallelConfig(tp=int(d.get("tp", 1)), cp=int(d.get("cp", 1)), pp=int(d.get("pp", 1)),
                         dp=int(d.get("dp", 1)), mesh_order=tuple(plan.mesh_order),
                         zero_stage=int(plan.zero_stage), recompute=str(plan.recompute),
                         micro_batch=int(plan.micro_batch), grad_accum=int(plan.grad_accum),
                         schedule=str(plan.schedule or "none"), virtual_stages=int(plan.virtual_stages or 1),
                         stage_layers=tuple(int(x) for x in plan.stage_layers), ep=int(d.get("ep", 1) or 1))
    tr = TrainConfig(seq_len=int(_req(t, "seq_len", "train")), global_batch=int(_req(t, "global_batch", "train")),
                     steps=int(steps if steps is not None else t.get("steps", 1)),
                     optimizer=str(t.get("optimizer", "adam")), precision=str(t.get("precision", "bf16")),
                     lr=float(t.get("lr", 3e-4)), warmup_steps=int(t.get("warmup_steps", 0)),
                     weight_decay=float(t.get("weight_decay", 0.0)), grad_clip=float(t.get("grad_clip", 1.0)),
                     seed=int(t.get("seed", 1234)), loss_chunk=int(t.get("loss_chunk", 1024)),
                     checkpoint_every=int(t.get("checkpoint_every", 0)))
    validate(m, par, tr, plan)
    if steps is not None:       # what the metrics line shows as "step i/N"
        plan.train = {**plan.train, "steps": int(steps)}
    diag = plan.diagnostics or {}
    init_t = float(init_timeout_s if init_timeout_s is not None else diag.get("init_timeout_s", 600))
    step_t = float(step_timeout_s if step_timeout_s is not None else diag.get("collective_timeout_s", 600))
    _check(init_t > 0 and step_t > 0, "timeouts must be positive (--init-timeout-s / --step-timeout-s)")
    return TrainerConfig(plan=plan, model=m, parallel=par, train=tr, init_timeout_s=init_t, step_timeout_s=step_t)


def validate(m: ModelArgs, p: ParallelConfig, t: TrainConfig, plan: Plan) -> None:
    _check(m.hidden % m.heads == 0, f"plan.model.hidden={m.hidden} is not divisible by heads={m.heads}")
    _check(m.heads % m.kv_heads == 0, f"plan.model.kv_heads={m.kv_heads} does not divide heads={m.heads}")
    _check(m.head_dim % 2 == 0, f"plan.model: head_dim {m.head_dim} must be even for RoPE")
    _check(m.mlp in ("swiglu", "gelu"), f"plan.model.mlp={m.mlp!r}: choose 'swiglu' or 'gelu'")
    validate_moe(m, p)
    for name in ("tp", "cp", "pp", "dp"):
        _check(getattr(p, name) >= 1, f"plan.degrees.{name} must be >= 1")
    _check(sorted(p.mesh_order) == sorted(("pp", "dp", "cp", "tp")),
           f"plan.mesh_order={list(p.mesh_order)} must order exactly pp, dp, cp, tp")
    _check(p.world_size == plan.world_size,
           f"plan.degrees multiply to {p.world_size} but plan.world_size is {plan.world_size}")
    _check(m.heads % p.tp == 0 and m.kv_heads % p.tp == 0,
           f"plan.degrees.tp={p.tp} must divide model.heads={m.heads} and kv_heads={m.kv_heads}")
    _check(m.ffn_hidden % p.tp == 0, f"plan.degrees.tp={p.tp} must divide model.ffn_hidden={m.ffn_hidden}")
    _check(m.vocab % p.tp == 0, f"plan.degrees.tp={p.tp} must divide model.vocab={m.vocab} (vocab-parallel loss)")
    split = 2 * p.cp * p.tp if p.cp > 1 else p.tp
    _check(t.seq_len % split == 0,
           f"plan.train.seq_len={t.seq_len} must be divisible by {'2·cp·tp' if p.cp > 1 else 'tp'}={split}")
    _check(p.zero_stage in (0, 1, 2, 3), f"plan.zero_stage={p.zero_stage}: choose 0, 1, 2 or 3")
    _check(p.recompute in RECOMPUTE, f"plan.recompute={p.recompute!r}: choose one of {', '.join(RECOMPUTE)}")
    _check(t.optimizer in OPTIMIZERS,
           f"plan.train.optimizer={t.optimizer!r} is not supported by the bundled trainer (adam, adam8bit, sgd)")
    _check(t.precision in ("bf16", "fp32"),
           f"plan.train.precision={t.precision!r}: the bundled trainer runs bf16 or fp32")
    _check(t.loss_chunk >= 1, "plan.train.loss_chunk must be >= 1")
    _check(p.micro_batch >= 1 and p.grad_accum >= 1,
           f"plan.micro_batch={p.micro_batch} and plan.grad_accum={p.grad_accum} must both be >= 1")
    _check(p.micro_batch * p.grad_accum * p.dp == t.global_batch,
           f"plan: micro_batch {p.micro_batch} × grad_accum {p.grad_accum} × dp {p.dp} = "
           f"{p.micro_batch * p.grad_accum * p.dp}, but train.global_batch is {t.global_batch}")
    # pipeline
    _check(p.schedule in SCHEDULES, f"plan.schedule={p.schedule!r}: choose one of {', '.join(SCHEDULES)}")
    n_stages = p.pp * p.virtual_stages
    _check(len(p.stage_layers) == n_stages,
           f"plan.stage_layers has {len(p.stage_layers)} entries, expected pp·virtual_stages = {n_stages}")
    _check(sum(p.stage_layers) == m.layers,
           f"plan.stage_layers sums to {sum(p.stage_layers)}, but model.layers is {m.layers}")
    _check(all(x >= 0 for x in p.stage_layers), "plan.stage_layers entries must be >= 0")
    if p.pp == 1:
        _check(p.virtual_stages == 1, "plan.virtual_stages > 1 needs pp > 1")
    else:
        _check(p.schedule != "none", f"plan.schedule is 'none' but pp={p.pp}; choose gpipe, 1f1b or interleaved-1f1b")
        if p.virtual_stages > 1:
            _check(p.schedule == "interleaved-1f1b",
                   f"plan.virtual_stages={p.virtual_stages} needs schedule interleaved-1f1b, not {p.schedule}")
        check_microbatches(p.schedule, p.grad_accum, p.pp)


def validate_moe(m: ModelArgs, p: ParallelConfig) -> None:
    """Mixture of experts and expert parallelism: what moe.py runs, and one line for what it does not."""
    _check(m.experts >= 1, f"plan.model.experts={m.experts} must be >= 1")
    _check(p.ep >= 1, f"plan.degrees.ep={p.ep} must be >= 1")
    if m.experts > 1:
        _check(1 <= m.experts_per_token <= m.experts,
               f"plan.model.experts_per_token={m.experts_per_token} must be between 1 and experts={m.experts}")
        _check(p.tp == 1, f"plan.degrees.tp={p.tp} with model.experts={m.experts}: the bundled trainer runs "
                          "mixture-of-experts layers without tensor parallelism; use tp=1 (ep splits dp·cp)")
    if p.ep > 1:
        _check(m.experts > 1, f"plan.degrees.ep={p.ep} needs a mixture-of-experts model (model.experts > 1)")
        _check(m.experts % p.ep == 0, f"plan.degrees.ep={p.ep} must divide model.experts={m.experts}")
        _check((p.dp * p.cp) % p.ep == 0, f"plan.degrees.ep={p.ep} must divide dp·cp={p.dp * p.cp}")


def check_microbatches(schedule: str, n_micro: int, pp: int) -> None:
    """Clear error where the schedule cannot run with this many micro-batches (grad_accum)."""
    if schedule == "1f1b" and n_micro < pp:
        raise UserError(f"plan.grad_accum={n_micro}: schedule 1f1b needs at least pp={pp} micro-batches "
                        f"(gradient-accumulation steps); raise grad_accum to >= {pp} or use gpipe")
    if schedule == "interleaved-1f1b":
        if n_micro < pp:
            raise UserError(f"plan.grad_accum={n_micro}: schedule interleaved-1f1b needs at least pp={pp} "
                            f"micro-batches (gradient-accumulation steps); raise grad_accum to >= {pp}")
        rounds = max(1, n_micro // pp)
        if n_micro % rounds:
            raise UserError(f"plan.grad_accum={n_micro}: interleaved-1f1b needs a multiple of "
                            f"{rounds} micro-batches with pp={pp}; use {rounds * pp} or {(rounds + 1) * pp}")
