"""`launch verify`: trace the bundled trainer at the plan's full world size, one rank per role.

`trace_plan(plan)` builds, for every distinct role (roles.py), the trainer's own Engine — model,
mesh, TP plan, pipeline stages, FSDP wrapping, CP, optimizer — as that rank of the full job
would, under a fake process group and FakeTensorMode, runs one optimizer step through the plan's
schedule and measures the rank's peak memory by category with torch's tracker
(launcher/trainer/memtrace.py). It also builds the world's last rank. Nothing here imports
torch at module level: the trainer side is imported inside trace_plan.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable

from launcher.plan.model import Plan
from launcher.verify.report import CATEGORIES, GB, RoleResult, VerifyReport, render
from launcher.verify.roles import (
    Role,
    extend,
    extend_layers,
    layer_plan,
    layer_variants,
    micro_batch_counts,
    plan_roles,
)
from launcher.verify.worker import run_roles

__all__ = ["RoleResult", "VerifyReport", "render", "trace_plan", "plan_roles"]


def ledger_for(plan: Plan, role: Role) -> tuple[dict[str, float] | None, float | None, float, float]:
    """(per-category GB, total GB without the runtime allowance, allowance GB, limit GB) of the
    ledger for this role: launcher.plan.ledger.rank_memory prices each pipeline rank. The limit is what a
    plan may use: the GPU's memory less the plan's headroom."""
    from launcher.plan import ledger

    mem = plan.memory or {}
    cap = float(plan.gpu.memory_gb)
    allowance = float(mem.get("runtime_gb", ledger.BUFFER_FIXED_GB))
    limit = float(mem.get("limit_gb", cap * (1 - float(mem.get("headroom", ledger.DEFAULT_HEADROOM)))))
    m = ledger.rank_memory(plan.model, plan.train, plan.gpu, plan.layout, role.pp_rank)
    cats = {c: getattr(m, c) / GB for c in CATEGORIES}
    return cats, m.total / GB, allowance, limit


def trace_plan(plan: Plan, progress: Callable[[str], None] | None = None,
               build_last_rank: bool = True, workers: int | None = None, full_layers: bool = False) -> VerifyReport:
    """Trace every role of `plan`; UserError when the plan is not one the trainer accepts.

    Each role runs in its own process (a fresh fake world each; `workers` at once, default one
    per CPU). Every role is built at the plan's full size; its step is traced at two small layer
    counts per stage and extended linearly (roles.layer_variants) unless `full_layers`."""
    from launcher.trainer.config import config_from_plan

    t0 = time.perf_counter()
    config_from_plan(copy.deepcopy(plan))        # the trainer's own checks, before any process starts
    p = plan
    bf16 = plan.train.precision == "bf16"
    cap = float(plan.gpu.memory_gb)
    roles = plan_roles(plan)
    last = plan.world_size - 1
    build = [last] if build_last_rank and last not in {r.rank for r in roles} else []
    jobs, why = [], {}
    for role in roles:
        counts, why[role.rank] = micro_batch_counts(p.schedule, p.pp, p.grad_accum, role.pp_rank)
        ks = None if full_layers else layer_variants(role, p.zero_stage, p.dp * p.cp)
        jobs.append((role.rank, counts, [(k, layer_plan(plan, k)) for k in ks] if ks else None))
    if progress:
        progress(f"verify: {len(roles)} role(s) of {plan.world_size} ranks"
                 f"{f', and a build of rank {last}' if build else ''}, on {workers or os.cpu_count()} CPUs")
    outcomes = run_roles(plan, jobs, build, bf16, workers, progress)
    results = []
    for role, (_, counts, variants) in zip(roles, jobs):
        out = outcomes[role.rank]
        led, led_total, allowance, limit = ledger_for(plan, role)
        res = RoleResult(role=role, status="traced", ledger_gb=led, ledger_total_gb=led_total,
                         allowance_gb=allowance, capacity_gb=cap, limit_gb=limit, seconds=out["seconds"])
        if "state" in out:
            res.state_gb = {k: v / GB for k, v in out["state"].items()}
        if "traces" in out:
            per_variant = [extend(counts, t["steps"], p.grad_accum) for t in out["traces"]]
            at_m, note = per_variant[0]
            sources = ["traced" if len(counts) == 1 else
                       f"traced at {counts[1]} micro-batches, NOT extended (may be low)" if "NOT extended" in note
                       else "traced, extended to the plan's micro-batches"]
            if variants:
                ks = [k for k, _ in variants]
                at_m = extend_layers(ks, [f for f, _ in per_variant], role.layers[0])
                sources.append(f"layers extended from {ks[0]} and {ks[1]} to {role.layers[0]} per stage")
                note = f"{note}; traced with {ks[0]} and {ks[1]} layers per stage, extended linearly to " \
                       f"{role.layers[0]} (identical layers; built at full size)"
            res.peak_gb = at_m["total"] / GB
            res.categories_gb = {c: at_m[c] / GB for c in CATEGORIES}
            res.sources = dict.fromkeys(CATEGORIES, "; ".join(sources))
            res.micro_batches_traced = counts
            res.schedule_note = why[role.rank] if len(counts) == 1 and not variants else f"{note} ({why[role.rank]})"
        elif "state" in out:
            res.status, res.error = "computed", out.get("error")
            res.categories_gb = dict(res.state_gb)
            res.sources = dict.fromkeys(res.state_gb, "computed from local shard shapes")
            res.schedule_note = "step not traced"
        else:
            res.status, res.error = "failed", out["error"]
        results.append(res)
    checks = [{"rank": r, "ok": "error" not in outcomes[r], "error": outcomes[r].get("error")} for r in build]
    notes = []
    if bf16:
        notes.append("bf16 traced as on the nodes: FSDP casts parameters to bf16 (fp32 reduce); without FSDP, "
                     "autocast with CPU autocast's op list")
    return VerifyReport(plan=plan.name, world_size=plan.world_size, capacity_gb=cap, roles=results,
                        build_checks=checks, seconds=time.perf_counter() - t0, notes=notes)
