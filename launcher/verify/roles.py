"""The distinct rank roles of a plan, which of them are traced, and with how many micro-batches (torch-free).

Why roles: 16,384 ranks are not 16,384 different memory profiles. What a rank holds depends on
its pipeline rank (which stages, how many layers, embedding and/or output head, and how many
micro-batches the schedule keeps in flight there); TP, CP, DP and EP positions hold shards of
equal size (the trainer requires even splits, and FSDP2 pads every dim-0 shard to the same
size), so one rank per pipeline rank — the one at dp = cp = tp = 0 — stands for all of them.
The last rank of the world is built too (not stepped): the largest coordinates on every axis.

Why not every pipeline rank is traced: the middle stages of a pipeline hold identical shards
(same layers, no embedding, no head) and differ only in how many micro-batches the schedule
keeps in flight there (1F1B: pp - r; GPipe: all). Under GPipe they share one trace; under 1F1B
the two middle ranks with the fewest in flight are traced and the others extended linearly in
their in-flight count (identical micro-batches; shared_traces). Interleaved 1F1B traces each.

Why few micro-batches: identical micro-batches repeat the same memory pattern. With 1F1B (or no
pipeline) a step's peak is reached once the schedule is in its steady state — from the second
backward with f micro-batches in flight, i.e. after f + 2 of them — and from then on each more
micro-batch adds only what lives through the whole step: its receive buffers and token ids,
which the trace measures (memtrace.step_long_bytes) and adds for the micro-batches not traced.
GPipe keeps every micro-batch's activations, so its peak grows linearly: two counts m1 < m2 are
traced and extended linearly to the plan's count; interleaved 1F1B likewise (whole rounds).
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.plan import capabilities, layout
from launcher.plan.model import Plan


@dataclass(frozen=True)
class Role:
    pp_rank: int
    rank: int                   # the representative global rank (dp = cp = tp = 0)
    stages: tuple[int, ...]     # global stage ids held by this pipeline rank
    layers: tuple[int, ...]     # layers per stage
    embedding: bool
    head: bool
    in_flight: int | None = None  # micro-batches whose activations the schedule holds here at most
    dense_layers: int = 0       # of a MoE model's first_dense_layers, how many this rank holds

    @property
    def name(self) -> str:
        if len(self.stages) == 1 and self.embedding and self.head:
            return "every rank"
        parts = [f"pp {self.pp_rank}", "stage" + ("s " if len(self.stages) > 1 else " ")
                 + ",".join(str(s) for s in self.stages)]
        extra = [w for w, on in (("embedding", self.embedding), ("head", self.head)) if on]
        return " ".join(parts) + (f" ({' + '.join(extra)})" if extra else "")

    def to_dict(self) -> dict:
        return {"name": self.name, "pp_rank": self.pp_rank, "rank": self.rank, "stages": list(self.stages),
                "layers": list(self.layers), "embedding": self.embedding, "head": self.head,
                "in_flight": self.in_flight, "dense_layers": self.dense_layers}

    @property
    def shard(self) -> tuple:
        """What this rank holds, whatever its pipeline position: equal for identical shards."""
        return self.layers, self.embedding, self.head, self.dense_layers


def plan_roles(plan: Plan) -> list[Role]:
    """One role per pipeline rank, at its first global rank."""
    pp = plan.degrees["pp"]
    v = max(1, int(plan.virtual_stages or 1))
    n_stages = pp * v
    stride = layout.strides(plan.degrees, plan.mesh_order)["pp"]
    out = []
    first_dense = plan.model.first_dense_layers if plan.model.experts > 1 else 0
    starts = [sum(plan.stage_layers[:s]) for s in range(len(plan.stage_layers))]
    for r in range(pp):
        stages = capabilities.rank_stages(plan.schedule, r, pp, v)
        dense = sum(max(0, min(starts[s] + plan.stage_layers[s], first_dense) - starts[s])
                    for s in stages if s < len(starts))
        out.append(Role(pp_rank=r, rank=r * stride, stages=stages,
                        layers=tuple(int(plan.stage_layers[s]) for s in stages) if plan.stage_layers else (),
                        embedding=0 in stages, head=n_stages - 1 in stages,
                        in_flight=in_flight(plan.schedule, pp, plan.grad_accum, r), dense_layers=dense))
    return out


def in_flight(schedule: str, pp: int, m: int, pp_rank: int) -> int | None:
    """Micro-batches whose activations pipeline rank `pp_rank` holds at once (None: not modelled).
    torch's Schedule1F1B runs min(m, pp - r) forwards before the first backward."""
    if pp == 1:
        return 1
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(m, pp - pp_rank)
    return None


#: micro-batches an interleaved 1F1B role is traced with when its peak is replayed (see replays)
REPLAY_MICRO_BATCHES = 3


def replay_micro_batches(plan: Plan) -> int:
    """What replays traces at: REPLAY_MICRO_BATCHES; under the split-backward schedules 4, whose micro-batch 1
    is a kind of its own (replay.action_keys: FSDP's post-backward at the second input-gradient step), and
    DualPipe-V's 2·pp, or 5 at pp 2 (torch's ScheduleDualPipeV runs no fewer than 2·pp; from there every rank's
    order has each kind of action of its micro-batches: the overlapped pairs, the zero-bubble halves, the full
    backwards; tests/unit/test_schedule_orders.py derives it from torch's orders)."""
    if plan.schedule == "dualpipe-v":
        return max(5, 2 * plan.pp)
    return 4 if plan.schedule in capabilities.SPLIT_BACKWARD else REPLAY_MICRO_BATCHES


def replays(plan: Plan) -> bool:
    """Whether interleaved 1F1B roles are traced action by action at REPLAY_MICRO_BATCHES and each pp
    rank's peak replayed through its own action order at the plan's micro-batches (replay.replay_peak).

    Why it holds: what an action (a stage's forward or backward of one micro-batch, a send, a receive,
    FSDP's unshard / wait for it / reshard / gradient reduction) allocates and frees depends on its
    stage, on whether its micro-batch is the first, the last or one in between (identical
    micro-batches), and for a reshard on whether the stage's last backward came before
    (replay.action_keys), not on what else is in flight; the rank's order is torch's own at the
    plan's count. With more than 3 stages per rank torch's runtime evicts and re-gathers stages within
    the step, so any forward or backward may be the one that waits for a gather: the wait is its own
    step, and a probe before the step gathers and reshards each stage once (what an eviction frees).
    3 micro-batches then hold every key of every rank's order at any count (a test derives that from
    torch's schedule code for the 405B pick, pp 32 x v 4 at 128); a key the trace lacks, or one traced
    twice with different effects, stops the trace with an error rather than guess. ZeRO 3 reshards a
    block after each forward unless a backward left it gathered, which depends on the order: those
    plans are traced in full."""
    v = max(1, int(plan.virtual_stages or 1))
    multi = plan.schedule in capabilities.SPLIT_BACKWARD or (plan.schedule == "interleaved-1f1b" and v > 1)
    return multi and plan.pp > 1 and plan.zero_stage <= 2 and plan.grad_accum > replay_micro_batches(plan)


def replay_groups(roles: list[Role]) -> dict[int, tuple[int, ...]]:
    """{pp rank: (the pp rank traced for it,)} under replay: one trace per distinct shard (the first
    pp rank holding it); every other rank's peak is replayed from it through its own order."""
    first: dict[tuple, int] = {}
    return {r.pp_rank: (first.setdefault(r.shard, r.pp_rank),) for r in roles}


def shared_traces(roles: list[Role], schedule: str) -> dict[int, tuple[int, ...]]:
    """{pp rank: the pp ranks whose traces give its figures}: (itself,) when traced. Ranks with
    identical shards share: GPipe one trace (the same in flight everywhere), 1F1B the two with the
    fewest in flight, extended linearly to the others' counts (extend_in_flight)."""
    out: dict[int, tuple[int, ...]] = {r.pp_rank: (r.pp_rank,) for r in roles}
    if schedule not in ("gpipe", "1f1b"):
        return out
    groups: dict[tuple, list[Role]] = {}
    for r in roles:
        groups.setdefault(r.shard, []).append(r)
    for group in groups.values():
        keep = 1 if schedule == "gpipe" else 2
        if len(group) <= keep:
            continue
        traced = tuple(sorted(r.pp_rank for r in sorted(group, key=lambda r: r.in_flight or 0)[:keep]))
        for r in group:
            out[r.pp_rank] = (r.pp_rank,) if r.pp_rank in traced else traced
    return out


def extend_in_flight(points: list[tuple[int, dict[str, float]]], f: int) -> tuple[dict[str, float], bool]:
    """Figures at `f` micro-batches in flight from those of identical shards traced at other counts
    [(f_a, figures_a), (f_b, figures_b)]; (figures, linear) where linear is False when a figure fell
    as more were in flight (the peak moved between phases: then the larger trace is returned)."""
    if len(points) == 1:
        return dict(points[0][1]), True
    (fa, a), (fb, b) = sorted(points, key=lambda p: p[0])
    if any(b[k] < a[k] - 1e-3 * max(1.0, abs(a[k])) for k in b):
        return dict(b), False
    return {k: a[k] + (b[k] - a[k]) * (f - fa) / (fb - fa) for k in b}, True


def micro_batch_counts(schedule: str, pp: int, m: int, pp_rank: int = 0) -> tuple[list[int], str]:
    """The micro-batch counts to trace for pipeline rank `pp_rank` of a plan with `m` per step, and why.
    One count where the peak is reached in a steady state (no pipeline, 1F1B), two where it grows with
    the count (GPipe; interleaved 1F1B: whole rounds of pp, the same residue as m)."""
    if pp == 1 or schedule == "1f1b":
        f = 1 if pp == 1 else min(m, pp - pp_rank)
        n = min(m, f + 2)
        why = ("no pipeline: one micro-batch in flight" if pp == 1 else
               f"1F1B: pp - {pp_rank} = {f} micro-batch{'es' if f > 1 else ''} in flight here")
        if n == m:
            return [m], f"{why}; all {m} micro-batches traced"
        return [n], f"{why}; from the 2nd backward on every micro-batch repeats the same steady state"
    if schedule == "gpipe":
        base, step, why = 3, 2, "GPipe keeps every micro-batch's activations until its backward"
    else:
        base, step, why = 2 * pp, pp, "interleaved 1F1B: in flight bounded by the rounds of pp"
    first = base + (m - base) % step
    if m <= 2 * first + step:          # tracing two counts would cost more than tracing m
        return [m], f"all {m} micro-batches traced"
    return [first, first + step], why


def layer_variants(role: Role, zero: int, dp_cp: int, mixed: bool = False) -> list[int] | None:
    """Layers per stage to trace instead of the role's own, when that is cheaper: two small counts
    whose peaks extend linearly to the real one (identical layers), or None (trace as planned).
    Only under FSDP (ZeRO 2/3 over dp·cp > 1), where every block is its own unit: ZeRO 0/1 peak in
    the optimizer step, whose buckets and per-owner partitions do not grow linearly with layers.
    ZeRO 3 prefetches the next block's parameters and reduce-scatters the block above's gradients
    beside the block in backward, so its smallest linear case is 3 layers (with full recompute, the
    backward's re-gather of a block beside the prefetched next one first peaks at 3 layers: traced at
    2 and 3, Llama 3 70B's 80 layers read 137 GB of buffers instead of 5; without, a Mixtral-shaped
    block's 2-layer peak falls in another phase, and 2 and 3 extended to negative gradients). ZeRO 2 too:
    at 1 layer its peak falls in another phase than at 2, and 1 and 2 extended one block's fp32
    reduce-scatter input to every block (a 6.7B model's 32 layers read 25.1 GB of communication buffers;
    traced whole, and from 3 and 4: 0.8). `mixed`: the model's layers are not identical (a MoE model's
    first_dense_layers): traced as planned."""
    if mixed or zero < 2 or dp_cp == 1 or not role.layers or len(set(role.layers)) != 1:
        return None                      # uneven stages on one rank: trace them as they are
    k1 = 3
    return [k1, k1 + 1] if role.layers[0] > k1 + 2 else None


def layer_plan(plan: Plan, k: int) -> Plan:
    """`plan` with every pipeline stage k layers deep (the model shortened to match)."""
    import dataclasses

    n = len(plan.stage_layers)
    return dataclasses.replace(plan, model=dataclasses.replace(plan.model, layers=k * n), stage_layers=[k] * n)


def extend_layers(ks: list[int], figures: list[dict[str, float]], layers: int) -> dict[str, float]:
    """Figures at `layers` per stage from those traced at ks = [k1, k2] (linear: identical layers)."""
    (k1, k2), (a, b) = ks, figures
    return {c: a[c] + (b[c] - a[c]) * (layers - k1) / (k2 - k1) for c in b}


def extend(counts: list[int], peaks: list[dict[str, float]], m: int,
           per_micro_batch: dict[str, float] | None = None) -> tuple[dict[str, float], str]:
    """The figures at `m` micro-batches from those traced at `counts` (see module docstring). One count
    below m: the steady-state peak plus what each further micro-batch keeps for the whole step."""
    if len(counts) == 1:
        (n,), (a,) = counts, peaks
        if n == m or not per_micro_batch:
            return dict(a), f"all {n} micro-batches traced" if n == m else f"traced at {n} micro-batches"
        extra = {k: v * (m - n) for k, v in per_micro_batch.items()}
        out = {k: a[k] + extra.get(k, 0.0) for k in a}
        out["total"] = a["total"] + sum(extra.values())
        return out, (f"traced at {n} micro-batches, the other {m - n} added as their step-long buffers "
                     f"(receive buffers, token ids)")
    (m1, m2), (a, b) = counts, peaks
    if all(abs(b[k] - a[k]) <= 1e-3 * max(1.0, abs(b[k])) for k in b):
        return dict(b), f"traced at {m1} and {m2} micro-batches: same peak (steady state), so also at {m}"
    if any(b[k] < a[k] - 1e-3 * max(1.0, abs(a[k])) for k in b):
        # the peak fell in a different phase at the two counts: a line through them means nothing
        return dict(b), (f"traced at {m1} and {m2} micro-batches; the peak moved between phases, so the "
                         f"figures are those at {m2}, NOT extended to {m} (may be low)")
    out = {k: a[k] + (b[k] - a[k]) * (m - m1) / (m2 - m1) for k in b}
    return out, f"traced at {m1} and {m2} micro-batches, extended linearly to {m} (identical micro-batches)"
