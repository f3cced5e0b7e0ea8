"""The distinct rank roles of a plan, and which micro-batch counts to trace for each (torch-free).

Why roles: 16,384 ranks are not 16,384 different memory profiles. What a rank holds depends on
its pipeline rank (which stages, how many layers, embedding and/or output head, and how many
micro-batches the schedule keeps in flight there); TP, CP, DP and EP positions hold shards of
equal size (the trainer requires even splits, and FSDP2 pads every dim-0 shard to the same
size), so one rank per pipeline rank — the one at dp = cp = tp = 0 — stands for all of them.
The last rank of the world is built too (not stepped): the largest coordinates on every axis.

Why only some micro-batch counts: identical micro-batches repeat the same memory pattern, so a
step's peak is either reached after a bounded number of them (no pipeline: the second one, when
gradients already exist; 1F1B: p in flight; interleaved 1F1B: one round of p) or grows linearly
with their count (GPipe keeps every micro-batch's activations). verify traces two counts m1 < m2:
equal peaks mean the steady state (the plan's peak is the same); different peaks are extended
linearly to the plan's count. A plan with few micro-batches is traced with exactly its count.
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.plan import layout
from launcher.plan.model import Plan


@dataclass(frozen=True)
class Role:
    pp_rank: int
    rank: int                   # the representative global rank (dp = cp = tp = 0)
    stages: tuple[int, ...]     # global stage ids held by this pipeline rank
    layers: tuple[int, ...]     # layers per stage
    embedding: bool
    head: bool

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
                "layers": list(self.layers), "embedding": self.embedding, "head": self.head}


def plan_roles(plan: Plan) -> list[Role]:
    """One role per pipeline rank, at its first global rank."""
    pp = plan.degrees["pp"]
    v = max(1, int(plan.virtual_stages or 1))
    n_stages = pp * v
    stride = layout.strides(plan.degrees, plan.mesh_order)["pp"]
    out = []
    for r in range(pp):
        stages = tuple(r + k * pp for k in range(v))
        out.append(Role(pp_rank=r, rank=r * stride, stages=stages,
                        layers=tuple(int(plan.stage_layers[s]) for s in stages) if plan.stage_layers else (),
                        embedding=0 in stages, head=n_stages - 1 in stages))
    return out


def micro_batch_counts(schedule: str, pp: int, m: int, pp_rank: int = 0) -> tuple[list[int], str]:
    """The micro-batch counts to trace for pipeline rank `pp_rank` of a plan with `m` per step, and
    why those. Two counts of the same residue as `m` (mod the schedule's period: 1F1B alternates
    which operation peaks with the parity of the count), past the rank's warm-up."""
    if pp == 1:
        base, step, why = 2, 1, "no pipeline: micro-batches run one after another"
    elif schedule == "gpipe":
        base, step, why = 3, 2, "GPipe keeps every micro-batch's activations until its backward"
    elif schedule == "interleaved-1f1b":
        base, step, why = 2 * pp, pp, "interleaved 1F1B: in flight bounded by the rounds of pp"
    else:
        base, step, why = max(pp, pp - pp_rank + 2), 2, f"1F1B: pp - {pp_rank} = {pp - pp_rank} micro-batches in flight here"
    first = base + (m - base) % step
    if m <= 2 * first + step:          # tracing two counts would cost more than tracing m
        return [m], f"all {m} micro-batches traced"
    return [first, first + step], why


def layer_variants(role: Role, zero: int, dp_cp: int) -> list[int] | None:
    """Layers per stage to trace instead of the role's own, when that is cheaper: two small counts
    whose peaks extend linearly to the real one (identical layers), or None (trace as planned).
    Only under FSDP (ZeRO 2/3 over dp·cp > 1), where every block is its own unit: ZeRO 0/1 peak in
    the optimizer step, whose buckets and per-owner partitions do not grow linearly with layers.
    ZeRO 3 prefetches the next block's parameters, so its smallest linear case is 2 layers."""
    if zero < 2 or dp_cp == 1 or not role.layers or len(set(role.layers)) != 1:
        return None                      # uneven stages on one rank: trace them as they are
    k1 = 2 if zero >= 3 else 1
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


def extend(counts: list[int], peaks: list[dict[str, float]], m: int) -> tuple[dict[str, float], str]:
    """The figures at `m` micro-batches from those traced at `counts` (see module docstring)."""
    if len(counts) == 1:
        return dict(peaks[0]), f"all {counts[0]} micro-batches traced"
    (m1, m2), (a, b) = counts, peaks
    if all(abs(b[k] - a[k]) <= 1e-3 * max(1.0, abs(b[k])) for k in b):
        return dict(b), f"traced at {m1} and {m2} micro-batches: same peak (steady state), so also at {m}"
    if any(b[k] < a[k] - 1e-3 * max(1.0, abs(a[k])) for k in b):
        # the peak fell in a different phase at the two counts: a line through them means nothing
        return dict(b), (f"traced at {m1} and {m2} micro-batches; the peak moved between phases, so the "
                         f"figures are those at {m2}, NOT extended to {m} (may be low)")
    out = {k: a[k] + (b[k] - a[k]) * (m - m1) / (m2 - m1) for k in b}
    return out, f"traced at {m1} and {m2} micro-batches, extended linearly to {m} (identical micro-batches)"
