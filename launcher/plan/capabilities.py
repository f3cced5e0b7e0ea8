"""What the bundled trainer runs, in one torch-free table, and the checks that follow from it.

Why one place: the job-file schema, the spec checker, the planner's search and the trainer's own
start-up check all read this module, so nothing is accepted or planned that the nodes would
refuse after the allocation. Flip an entry only together with the trainer code that runs it
and a test that proves it.

The check functions return None or the reason a value is refused (a phrase that follows the
value); each caller prefixes its own path (`parallel.tp` in a job file, `plan.degrees.tp` in a
plan.json).
"""

from __future__ import annotations

from functools import lru_cache

from launcher.errors import UserError
from launcher.plan.types import (
    CP_ATTENTIONS,
    FP8_LINEARS,
    MLPS,
    MULTI_STAGE,
    OPTIMIZERS,
    POSITIONS,
    PRECISIONS,
    RECOMPUTE,
    SCHEDULES,
    SPLIT_BACKWARD,
    V_SCHEDULES,
    ZERO_STAGES,
    ModelSpec,
)

#: The value sets (ZERO_STAGES, PRECISIONS, SCHEDULES, ...) are launcher.plan.types'; what the trainer refuses
#: of them, and how far it runs each feature, is said here.
ZERO_REFUSED: dict[int, str] = {}
PRECISION_REFUSED = {"fp16": "is not run by the bundled trainer (no loss scaling); choose bf16 or fp32"}
#: Mixture-of-experts models under TP: attention and norms tensor-parallel, the router and experts
#: whole on every TP rank (expert TP 1), each rank routing its own sequence shard (tensor_parallel.py);
#: experts split over dp·cp (ep). Their TP-replicated gradients are summed by the lean optimizer, so
#: MoE with tp > 1 runs under ZeRO 0/1 (MOE_TP_ZERO).
MOE_WITH_TP = True
MOE_TP_ZERO = (0, 1)
CP_ATTENTION = CP_ATTENTIONS[0]            # the default
#: Hybrid sharding (parallel.dp_shard; torchtitan's dp_replicate × dp_shard, FSDP2's HSDP, MiCS): ZeRO 1-3
#: shard over dp_shard·cp and replicate over dp / dp_shard — FSDP2 on a 2-D (replicate, shard) mesh under
#: ZeRO 2/3 (fsdp.py), the lean optimizer's shards all-reduced across the replicas under ZeRO 1
#: (dist_optim.py); the mesh splits dp into (dp_replicate, dp_shard), outer to inner (mesh.py).
HYBRID_SHARDING = True
#: Compiled blocks (train.compile, trainer/compiled.py): every transformer block through torch.compile with
#: fullgraph=True, after TP and recompute and before FSDP (torchtitan's apply_compile). Run on gloo against the
#: single process: tp 2 (DTensor norms, the sequence-parallel ops) and ZeRO 3 with selective recompute in
#: tests/integration/test_trainer_compile.py, ZeRO 1, both CP kinds with and without recompute, PP 1F1B and ALiBi by hand;
#: what torch 2.13 does not trace whole is refused (compile_problem), each refusal the error it raised there.
COMPILE = True


def table() -> dict:
    """The table as data (for `launch schema`, docs and --json)."""
    return {"zero_stages": list(ZERO_STAGES), "precisions": list(PRECISIONS), "optimizers": list(OPTIMIZERS),
            "recompute": list(RECOMPUTE), "schedules": list(SCHEDULES),
            "split_backward_schedules": list(SPLIT_BACKWARD), "v_schedules": list(V_SCHEDULES), "mlp": list(MLPS),
            "positions": list(POSITIONS),
            "moe_with_tp": MOE_WITH_TP, "cp_attention": list(CP_ATTENTIONS), "hybrid_sharding": HYBRID_SHARDING,
            "fp8_linears": list(FP8_LINEARS), "compile": COMPILE}


# --- checks shared by the job file, the planner and the trainer --------------------------------

def padded_vocab(m: ModelSpec, tp: int) -> int:
    """Rows of the embedding and the output head as the trainer builds them: model.vocab rounded up to a
    multiple of model.vocab_multiple × tp (Megatron's padding), so every TP rank holds an equal vocab shard
    whatever the vocabulary (GPT-2's 50257); the padding's logits are masked out of the loss (loss.py)."""
    step = m.vocab_multiple * tp
    return -(-m.vocab // step) * step


@lru_cache(maxsize=1024)   # the ledger prices thousands of layouts of one model
def padded_model(m: ModelSpec, tp: int) -> ModelSpec:
    """The model with its vocabulary padded for `tp` (what the trainer allocates)."""
    import dataclasses

    v = padded_vocab(m, tp)
    return m if v == m.vocab else dataclasses.replace(m, vocab=v)


def model_problem(m: ModelSpec) -> tuple[str, str] | None:
    """(field, reason) where the model shape cannot be built."""
    if m.hidden % m.heads and m.head_dim == m.hidden // m.heads:
        return "hidden", f"{m.hidden} is not divisible by heads={m.heads} (or set model.head_dim)"
    if m.heads % (m.kv_heads or m.heads):
        return "kv_heads", f"{m.kv_heads} does not divide heads={m.heads}"
    if m.position == "rope" and (m.head_dim or 0) % 2:
        return "head_dim", (f"{m.head_dim} (hidden/heads or as given) is odd; rotary embeddings need an even "
                            "head_dim (position: alibi takes any)")
    if m.experts_per_token > m.experts:
        return "experts_per_token", f"{m.experts_per_token} exceeds experts={m.experts}"
    if not m.is_moe:
        for name in ("moe_ffn_hidden", "shared_experts", "first_dense_layers"):
            if getattr(m, name):
                return name, f"{getattr(m, name)} needs a mixture-of-experts model (model.experts > 1)"
    elif m.first_dense_layers >= m.layers:
        return "first_dense_layers", (f"{m.first_dense_layers} leaves no mixture-of-experts layer of "
                                      f"layers={m.layers}; use experts: 1 for a dense model")
    return None


def tp_problem(m: ModelSpec, tp: int) -> str | None:
    """Why the trainer cannot shard this model over `tp` ranks (Megatron-style TP, vocab-parallel loss;
    a MoE's experts stay whole, so only dense layers' ffn_hidden is split)."""
    if m.experts > 1 and tp > 1 and not MOE_WITH_TP:  # pragma: no cover - kept for a trainer without it
        return ("with a mixture-of-experts model: the bundled trainer runs experts without tensor "
                "parallelism; use tp 1 with ep (expert parallelism) instead")
    names = ("heads", "kv_heads") + (("ffn_hidden",) if m.layers > m.moe_layers else ())
    for name in names:                                      # the vocabulary is padded (padded_vocab)
        if getattr(m, name) % tp:
            return f"does not divide model.{name}={getattr(m, name)}"
    return None


def moe_tp_zero_problem(m: ModelSpec, tp: int, zero: int, dp_cp: int) -> str | None:
    """MoE under TP keeps its router and experts whole on every TP rank; their gradients are summed over
    TP by the lean optimizer (ZeRO 0/1), not by FSDP."""
    if m.experts > 1 and tp > 1 and dp_cp > 1 and zero not in MOE_TP_ZERO:
        return (f"with a mixture-of-experts model under tp {tp}: the experts' TP-replicated gradients are summed "
                f"by ZeRO {' or '.join(map(str, MOE_TP_ZERO))}'s optimizer; choose zero 0 or 1")
    return None


def cp_problem(seq_len: int, cp: int, tp: int) -> str | None:
    """CP cuts the sequence into 2·cp chunks (head + tail per rank), and sequence-parallel TP splits
    each again by tp."""
    split = 2 * cp * tp if cp > 1 else tp
    if seq_len % split:
        return f"needs train.seq_len={seq_len} divisible by {'2·cp·tp' if cp > 1 else 'tp'}={split}"
    return None


def ep_problem(m: ModelSpec, ep: int, dp: int, cp: int) -> str | None:
    if ep == 1:
        return None
    if m.experts <= 1:
        return "needs a mixture-of-experts model (model.experts > 1)"
    if m.experts % ep:
        return f"does not divide model.experts={m.experts}"
    if (dp * cp) % ep:
        return f"does not divide dp·cp={dp * cp}"
    return None


def dp_shard_problem(dp_shard: int, dp: int, cp: int, zero: int, ep: int) -> str | None:
    """Why ZeRO cannot shard over `dp_shard` of the dp ranks (with cp) and replicate over the rest."""
    if dp % dp_shard:
        return f"does not divide dp={dp}"
    if dp_shard == dp:
        return None
    if zero == 0:
        return "needs zero 1, 2 or 3: ZeRO 0 shards nothing (its gradients are all-reduced over all of dp·cp)"
    if dp_shard * cp == 1:
        return "with cp 1 shards over one rank, which is ZeRO 0's replication; use zero 0 or dp_shard > 1"
    if ep > 1:
        return ("with ep > 1 is not run by the bundled trainer (experts shard over their own dp·cp/ep replicas); "
                "use dp_shard = dp")
    return None


def cp_attention_problem(m: ModelSpec, cp: int, tp: int, kind: str) -> str | None:
    """All-to-all CP hands each cp rank heads/cp of its TP rank's query heads over the whole sequence, so they
    must divide by cp; key/value heads too, or (GQA with fewer than cp) divide cp: each is then repeated up to
    cp, every rank's query group sharing one (context_parallel.kv_repeats). After TP: tp_problem comes first."""
    if kind != "all-to-all" or cp == 1:
        return None
    kv_heads = m.kv_heads or m.heads
    q, kv = m.heads // tp, kv_heads // tp
    where = f" per TP rank (of {{}}, tp={tp})" if tp > 1 else ""
    if q % cp:
        return (f"all-to-all needs the {q} query heads{where.format(m.heads)} divisible by cp={cp}; "
                "use cp_attention: all-gather")
    if kv >= cp and kv % cp:
        return (f"all-to-all needs the {kv} key/value heads{where.format(kv_heads)} divisible by cp={cp}; "
                "use cp_attention: all-gather")
    if kv < cp and cp % kv:
        return (f"all-to-all repeats the {kv} key/value heads{where.format(kv_heads)} up to cp={cp}, which they "
                "must divide; use cp_attention: all-gather")
    return None


def fp8_converts(out_features: int, in_features: int, rule: str) -> bool:
    """Whether the trainer runs a linear with weight [out_features, in_features] (the whole model's shape: torchtitan
    converts before it parallelizes) in fp8. Both dims divisible by 16 (the fp8 tensor cores' alignment, torchtitan's
    module_filter_fn); under `auto` also large enough (torchao's _auto_filter_for_rowwise: N <= 2048, K <= 1024, or
    N <= 4096 with K <= 2048 stay bf16)."""
    n, k = out_features, in_features
    if n % 16 or k % 16:
        return False
    return rule == "all" or not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))


def fp8_problem(gpu) -> str | None:
    """Why train.precision fp8 cannot run on `gpu` (a GpuSpec): it needs FP8 tensor cores, which a preset states as
    fp8_tflops (Hopper, Ada, Blackwell, MI300-class; the CPU's torch._scaled_mm runs too)."""
    if getattr(gpu, "fp8_tflops", None):
        return None
    name = getattr(gpu, "name", "custom")
    if name == "custom":
        return "needs the GPU's dense FP8 peak: set cluster.gpu.fp8_tflops (a GPU with FP8 tensor cores), or use bf16"
    return (f"needs FP8 tensor cores, which GPU {name} lacks (fp8 runs on Hopper, Ada, Blackwell and MI300-class "
            "GPUs); use bf16")


def interleave_problem(layers: int, pp: int, v: int) -> str | None:
    """Layers split over pp·v model chunks evenly, or with the first and last chunk (which also hold the
    embedding and the head) one layer short, down to none (Llama 3's 126 layers on pp 16 × v 8:
    launcher.plan.layout.stage_layers; the trainer runs such chunks, tests/integration/test_trainer_uneven.py)."""
    if v > 1 and -layers % (pp * v) > 2:
        return (f"layers={layers} do not split over pp·virtual_stages={pp * v} chunks evenly or with only the "
                "first and last chunk one layer short")
    return None


def schedule_problem(schedule: str, n_micro: int, pp: int) -> str | None:
    """Where the pipeline schedule cannot run with this many micro-batches (grad_accum)."""
    if pp == 1:
        return None
    if schedule == "none":
        return f"is 'none' but pp={pp}; choose one of {', '.join(SCHEDULES)}"
    if schedule in ("1f1b", "interleaved-1f1b") and n_micro < pp:
        return (f"{schedule} needs at least pp={pp} micro-batches (gradient-accumulation steps), "
                f"got {n_micro}; raise grad_accum to >= {pp}" + (" or use gpipe" if schedule == "1f1b" else ""))
    if schedule in ("interleaved-1f1b", "interleaved-zero-bubble"):
        # torch's rounds: max(1, m // pp) of m // rounds micro-batches each (ScheduleInterleaved1F1B and
        # ScheduleInterleavedZeroBubble, whose ZB1P order also runs fewer micro-batches than pp)
        rounds = max(1, n_micro // pp)
        if n_micro % rounds:
            return (f"{schedule} needs a multiple of {rounds} micro-batches with pp={pp}, got {n_micro}; "
                    f"use {rounds * pp} or {(rounds + 1) * pp}")
    if schedule == "dualpipe-v" and n_micro < 2 * pp:
        # ScheduleDualPipeV: at least as many micro-batches as stages (2·pp)
        return (f"dualpipe-v needs at least 2·pp={2 * pp} micro-batches (its stages), got {n_micro}; raise "
                f"grad_accum to >= {2 * pp} or use zero-bubble-v")
    return None


def rank_stages(schedule: str, pp_rank: int, pp: int, v: int) -> tuple[int, ...]:
    """The global stage ids pipeline rank `pp_rank` holds, in local order: r, r + pp, r + 2·pp, ... (the loop
    layout of torch's Interleaved1F1B / InterleavedZeroBubble), or under the V schedules r and 2·pp-1-r."""
    if schedule in V_SCHEDULES:
        return (pp_rank, 2 * pp - 1 - pp_rank)
    return tuple(pp_rank + k * pp for k in range(v))


def virtual_stages_problem(schedule: str, pp: int, v: int) -> str | None:
    """Why `schedule` cannot run `v` stages per rank."""
    if pp == 1:
        return "> 1 needs pp > 1" if v > 1 else None
    if schedule in V_SCHEDULES and v != 2:
        return f"must be 2 with schedule {schedule} (a V: rank r holds stages r and 2·pp-1-r), not {v}"
    if v > 1 and schedule not in MULTI_STAGE:
        return f"needs a schedule that runs several stages per rank ({', '.join(MULTI_STAGE)}), not {schedule}"
    return None


def compile_schedule_problem(schedule: str, compiled: bool) -> str | None:
    """Compiled stages (train.compile) under a split-backward schedule: torch's zero-bubble and DualPipe-V
    schedules refuse stage modules that went through torch.compile (schedules.py:
    _check_torch_compile_compatibility: the input/weight backward split does not run on compiled graphs).
    For the train.compile field's checks (job file, planner, trainer) to call."""
    if compiled and schedule in SPLIT_BACKWARD:
        return (f"compiled blocks (train.compile) cannot run under schedule {schedule}: torch splits its backward "
                "into input and weight gradients, which compiled stages do not support; use 1f1b or "
                "interleaved-1f1b, or train.compile: false")
    return None


def compile_problem(m: ModelSpec, schedule: str | None = None, tp: int | None = None,
                    recompute: str | None = None) -> str | None:
    """Why the trainer cannot compile its blocks (train.compile) for this model and, where given, schedule, tp and
    recompute (None: not yet chosen, not checked). Each is what torch 2.13 raised when the block was compiled with
    fullgraph=True on gloo; nothing here is refused on suspicion."""
    why = compile_schedule_problem(schedule, True) if schedule is not None else None
    if why:
        return why
    if m.experts > 1:
        return ("compiled blocks (train.compile) cannot trace a mixture-of-experts layer: its dispatch reads the "
                "per-expert token counts back (moe.py), a data-dependent shape torch.compile does not trace in one "
                "graph; use train.compile: false")
    if tp is not None and tp > 1 and recompute == "full":
        return (f"compiled blocks (train.compile) with full recompute under tp {tp}: torch's compiled checkpoint "
                "saves the sequence-parallel norms' DeviceMesh for backward and fails; use selective recompute, or "
                "train.compile: false")
    if m.position == "alibi" and recompute not in (None, "none"):
        return (f"compiled blocks (train.compile) with ALiBi and {recompute} recompute: the shared bias is built on "
                "first use inside the checkpointed block (model.AlibiBias), a side effect torch.compile refuses "
                "there; use recompute none, or train.compile: false")
    return None


def split_backward_problem(schedule: str, zero: int, recompute: str, dp_cp: int) -> tuple[str, str] | None:
    """(field, reason) where the trainer cannot run a split-backward schedule (tests/integration/test_trainer_schedules.py
    runs the rest against the single process): torch finds a stage's weights through module.parameters() when
    its input-gradient step starts (pipelining/_backward.py stage_backward_input), and FSDP's ZeRO 3 has
    resharded every block after its forward, so those blocks' weight gradients would never be computed. Recompute
    replays a checkpointed region in each backward pass through it: torch's selective checkpointing allows one
    (utils/checkpoint.py), and the weight step runs one autograd.grad per weight (stage_backward_weight), so full
    recompute replays each block once per weight and keeps every replay until the step ends (traced: a 2-layer
    stage's weight step held 13 blocks' activations, and ran 13 forwards)."""
    if schedule not in SPLIT_BACKWARD:
        return None
    if zero == 3 and dp_cp > 1:
        return "zero", (f"3 cannot run under schedule {schedule}: FSDP reshards each block after its forward, and "
                        "torch's split backward takes the weights it differentiates from the stage's parameters "
                        "at the input-gradient step (sharded ones: their gradients are lost); use zero 2 (FSDP, "
                        "blocks kept gathered, torchtitan's choice under PP) or 0/1")
    if recompute != "none":
        return "recompute", (f"{recompute} cannot run under schedule {schedule}: its split backward replays a "
                             "recomputed block once per weight (torch's weight step differentiates each weight "
                             "apart; selective checkpointing allows one replay at all); use recompute none, or "
                             "1f1b / interleaved-1f1b with recompute")
    return None


def v_tied_problem(schedule: str, tied: bool) -> str | None:
    """Tied embeddings under a V: stage 0's embedding and stage 2·pp-1's head copy both land on pp rank 0,
    and the trainer's checkpoints hold a tied pair as one key that the two ends' ranks each read
    (checkpoint._tied_aliases), not two copies on one rank."""
    if tied and schedule in V_SCHEDULES:
        return (f"cannot be tied under schedule {schedule}: its V puts the embedding and the tied head copy on the "
                "same pipeline rank, which the trainer's checkpoints do not hold; set model.tied_embeddings: false "
                "or use interleaved-zero-bubble")
    return None


def check_microbatches(schedule: str, n_micro: int, pp: int) -> None:
    """The trainer's last word before it builds a pipeline schedule."""
    why = schedule_problem(schedule, n_micro, pp)
    if why:
        raise UserError(f"plan.layout.grad_accum={n_micro}: schedule {why}")
