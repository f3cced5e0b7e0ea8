"""`launch verify`: trace the bundled trainer at the plan's full world size, one rank per role.

`trace_plan(plan)` builds, for every distinct role (roles.py), the trainer's own Engine — model,
mesh, TP plan, pipeline stages, FSDP wrapping, CP, optimizer — as that rank of the full job
would, under a fake process group and FakeTensorMode, runs one optimizer step through the plan's
schedule and measures the rank's peak memory by category with torch's tracker
(memtrace.py steps it, in fakeworld.py's world, counted by tracker.py; replay.py replays the
schedule's actions for more micro-batches than were traced). Pipeline ranks whose shards are identical share traces
(roles.py says how). It also builds the world's last rank. Nothing here imports
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
    extend_in_flight,
    extend_layers,
    layer_plan,
    layer_variants,
    micro_batch_counts,
    plan_roles,
    replay_groups,
    replay_micro_batches,
    replays,
    shared_traces,
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
               build_last_rank: bool = True, workers: int | None = None, exact: bool = False) -> VerifyReport:
    """Trace every distinct role of `plan`; UserError when the plan is not one the trainer accepts.

    Each traced role runs in its own process (a fresh fake world each; `workers` at once, default
    one per CPU). Every traced role is built at the plan's full size; its step is traced at two
    small layer counts per stage and extended linearly (roles.layer_variants), at few micro-batches
    (roles.micro_batch_counts), and pipeline ranks with identical shards share traces
    (roles.shared_traces) — unless `exact`: every role with all its layers and micro-batches (slow;
    what the tests of those shortcuts compare with)."""
    from launcher.trainer.config import config_from_plan

    t0, c0 = time.perf_counter(), time.process_time()
    config_from_plan(copy.deepcopy(plan))        # the trainer's own checks, before any process starts
    p = plan
    bf16 = plan.train.precision in ("bf16", "fp8")    # fp8: bf16 with the linears' GEMMs in fp8
    cap = float(plan.gpu.memory_gb)
    roles = plan_roles(plan)
    replay = not exact and replays(plan)
    shares = ({r.pp_rank: (r.pp_rank,) for r in roles} if exact else
              replay_groups(roles) if replay else shared_traces(roles, p.schedule))
    traced = [r for r in roles if shares[r.pp_rank] == (r.pp_rank,)]
    last = plan.world_size - 1
    build = [last] if build_last_rank and last not in {r.rank for r in traced} else []
    jobs, why = [], {}
    for role in traced:
        counts, why[role.rank] = micro_batch_counts(p.schedule, p.pp, p.grad_accum, role.pp_rank)
        if exact:
            counts, why[role.rank] = [p.grad_accum], f"all {p.grad_accum} micro-batches traced"
        group = [q for q, of in shares.items() if of == (role.pp_rank,)] if replay else None
        if replay:
            counts = [replay_micro_batches(plan)]
        ks = None if exact else layer_variants(role, p.zero_stage, p.dp * p.cp,
                                               mixed=p.model.experts > 1 and p.model.first_dense_layers > 0)
        jobs.append((role.rank, counts, [(k, layer_plan(plan, k)) for k in ks] if ks else None, group))
    jobs.sort(key=lambda j: -sum(j[1]))              # the longest traces first: two CPUs finish together
    if progress:
        progress(f"verify: {len(traced)} of {len(roles)} role(s) traced, of {plan.world_size} ranks"
                 f"{f', and a build of rank {last}' if build else ''}, on {workers or os.cpu_count()} CPUs")
    outcomes = run_roles(plan, jobs, build, bf16, workers, progress)
    by_pp = {r.pp_rank: _traced_result(plan, r, outcomes[r.rank], next(j for j in jobs if j[0] == r.rank),
                                       why[r.rank], cap) for r in traced}
    if replay:
        rank_of = {r.pp_rank: r for r in traced}
        results = [_replayed_result(plan, r, rank_of[shares[r.pp_rank][0]], outcomes[rank_of[shares[r.pp_rank][0]].rank],
                                    next(j for j in jobs if j[0] == rank_of[shares[r.pp_rank][0]].rank), cap)
                   for r in roles]
    else:
        results = [by_pp[r.pp_rank] if shares[r.pp_rank] == (r.pp_rank,) else
                   _shared_result(plan, r, [by_pp[q] for q in shares[r.pp_rank]], cap) for r in roles]
    checks = [{"rank": r, "ok": "error" not in outcomes[r], "error": outcomes[r].get("error"),
               "cpu_seconds": outcomes[r].get("cpu_seconds", 0.0)} for r in build]
    notes = []
    if bf16:
        notes.append("bf16 traced as on the nodes: FSDP casts parameters to bf16 (fp32 reduce); without FSDP, "
                     "bf16 weights with fp32 masters in the optimizer")
    if plan.train.precision == "fp8":
        notes.append("fp8 traced as on the nodes: the converted linears' e4m3 casts and their backward GEMMs' "
                     "tensorwise kernel with the output rescaled (torchao's rowwise recipe on a GPU)")
    if plan.layout.compile:
        from launcher.verify.fakeworld import TRACE_BACKEND

        notes.append(f"compiled blocks traced through {TRACE_BACKEND}: inductor's decompositions and min-cut partition "
                     "(what a compiled block saves for backward), the graphs run op by op on fake tensors")
    if (plan.model.experts or 1) > 1:
        from launcher.verify.fakeworld import ROUTING_ASSUMPTION

        notes.append(ROUTING_ASSUMPTION)
    if replay:
        notes.append(f"{_shown(p.schedule)}: traced action by action at {replay_micro_batches(plan)} micro-batches on "
                     f"{', '.join(r.name for r in traced)}; every pp rank's peak at {p.grad_accum} micro-batches "
                     f"derived by replaying its own action order (torch's schedule) through the traced actions "
                     f"(identical micro-batches; {_ranges([q for q, of in shares.items() if of != (q,)]) or 'no rank'} "
                     f"from the trace of the rank with the identical shard)")
    shared: dict[tuple, list[int]] = {}
    for r in results if not replay else []:
        if r.trace_of:
            shared.setdefault(tuple(r.trace_of), []).append(r.role.pp_rank)
    if shared:
        notes.append(f"traced: {', '.join(r.role.name for r in results if not r.trace_of)}; "
                     + "; ".join(f"pp {_ranges(ranks)} share{'s' if len(ranks) == 1 else ''} the trace of "
                                 + " and ".join(f"pp {q}" for q in of) for of, ranks in shared.items())
                     + " (identical shards; figures extended linearly to each rank's micro-batches in flight)")
    cpu = time.process_time() - c0 + sum(o.get("cpu_seconds", 0.0) for o in outcomes.values())
    return VerifyReport(plan=plan.name, world_size=plan.world_size, capacity_gb=cap, roles=results,
                        build_checks=checks, seconds=time.perf_counter() - t0, cpu_seconds=cpu, notes=notes)


def _shown(schedule: str) -> str:
    """A schedule as the report names it."""
    return "interleaved 1F1B" if schedule == "interleaved-1f1b" else schedule


def _ranges(xs: list[int]) -> str:
    """[1, 2, 3, 5] -> '1-3, 5'; [] -> ''."""
    if not xs:
        return ""
    out, start = [], xs[0]
    for a, b in zip(xs, [*xs[1:], None]):
        if b != a + 1:
            out.append(f"{start}-{a}" if a > start else f"{a}")
            if b is not None:
                start = b
    return ", ".join(out)


def _result(plan: Plan, role: Role, cap: float, **kw) -> RoleResult:
    led, led_total, allowance, limit = ledger_for(plan, role)
    return RoleResult(role=role, ledger_gb=led, ledger_total_gb=led_total, allowance_gb=allowance,
                      capacity_gb=cap, limit_gb=limit, **kw)


def _traced_result(plan: Plan, role: Role, out: dict, job: tuple, why: str, cap: float) -> RoleResult:
    """A traced role's figures: its traces extended over micro-batches, then over layers."""
    _, counts, variants, _ = job
    m = plan.grad_accum
    res = _result(plan, role, cap, status="traced", seconds=out["seconds"], cpu_seconds=out.get("cpu_seconds", 0.0))
    if "state" in out:
        res.state_gb = {k: v / GB for k, v in out["state"].items()}
    if "traces" in out:
        per_variant = [extend(counts, t["steps"], m, t["per_micro_batch"]) for t in out["traces"]]
        at_m, note = per_variant[0]
        sources = ["traced" if counts == [m] else
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
        res.schedule_note = why if counts == [m] and not variants else f"{note} ({why})"
    elif "state" in out:
        res.status, res.error = "computed", out.get("error")
        res.categories_gb = dict(res.state_gb)
        res.sources = dict.fromkeys(res.state_gb, "computed from local shard shapes")
        res.schedule_note = "step not traced"
    else:
        res.status, res.error = "failed", out["error"]
    return res


def _replayed_result(plan: Plan, role: Role, src: Role, out: dict, job: tuple, cap: float) -> RoleResult:
    """A role's figures under a multi-stage schedule (interleaved 1F1B, the zero-bubble and DualPipe-V
    ones): its own action order at the plan's micro-batches,
    replayed through the actions traced on `src` (itself, or the pp rank with the identical shard)."""
    _, counts, variants, _ = job
    m, n = plan.grad_accum, counts[0]
    own = src.pp_rank == role.pp_rank
    res = _result(plan, role, cap, status="traced", seconds=out["seconds"] if own else 0.0,
                  cpu_seconds=out.get("cpu_seconds", 0.0) if own else 0.0, trace_of=[] if own else [src.pp_rank])
    if "state" in out:
        res.state_gb = {k: v / GB for k, v in out["state"].items()}
    if "traces" not in out:
        res.status, res.error = ("computed", out.get("error")) if "state" in out else ("failed", out["error"])
        if "state" in out:
            res.categories_gb = dict(res.state_gb)
            res.sources = dict.fromkeys(res.state_gb, "computed from local shard shapes")
            res.schedule_note = "step not traced"
        return res
    derived = [t["derived"][role.pp_rank] for t in out["traces"]]
    figs = [d["figures"] for d in derived]
    how = (f"traced per action at {n} micro-batches{'' if own else f' on pp {src.pp_rank} (identical shard)'}, "
           f"peak derived by replaying this rank's {_shown(plan.schedule)} order at {m} micro-batches")
    at_m = figs[0]
    if variants:
        ks = [k for k, _ in variants]
        at_m = extend_layers(ks, figs, role.layers[0])
        how += f"; layers extended from {ks[0]} and {ks[1]} to {role.layers[0]} per stage"
    res.peak_gb = at_m["total"] / GB
    res.categories_gb = {c: at_m[c] / GB for c in CATEGORIES}
    res.sources = dict.fromkeys(CATEGORIES, how)
    res.micro_batches_traced = counts if own else []
    res.schedule_note = (f"{_shown(plan.schedule)}, {m} micro-batches: peak at {derived[-1]['at']}; replayed from "
                         f"{n} traced (the other {m - n} add their step-long receive buffers and token ids)")
    left = max(abs(d["closes"]) for d in derived)
    if left > 1e-3 * at_m["total"]:     # what the replayed step allocates and never frees: a mismatch
        res.schedule_note += f"; WARNING: the replayed step ends {left / GB:.3f} GB off the traced one"
    return res


def _shared_result(plan: Plan, role: Role, traced: list[RoleResult], cap: float) -> RoleResult:
    """A role whose shard equals that of traced role(s): their figures, extended to its in-flight count."""
    names = " and ".join(f"pp {t.role.pp_rank}" for t in traced)
    res = _result(plan, role, cap, status=traced[0].status, state_gb=dict(traced[0].state_gb),
                  trace_of=[t.role.pp_rank for t in traced], error=traced[0].error)
    if any(t.status == "failed" for t in traced):
        res.status, res.error = "failed", next(t.error for t in traced if t.status == "failed")
        return res
    if any(t.peak_gb is None for t in traced):
        res.categories_gb, res.sources = dict(traced[0].categories_gb), dict(traced[0].sources)
        res.schedule_note = f"shares {names}'s computed state (identical shard)"
        return res
    points = [(t.role.in_flight, {**t.categories_gb, "total": t.peak_gb}) for t in traced]
    figs, linear = extend_in_flight(points, role.in_flight)  # type: ignore[arg-type]  # set under gpipe/1f1b; peaks checked above
    res.peak_gb = figs.pop("total")
    res.categories_gb = figs
    f = role.in_flight
    how = (f"shares the trace of {names} (identical shard)" if len(traced) == 1 else
           f"from the traces of {names} (identical shard, {' and '.join(str(p[0]) for p in points)} in flight), "
           + (f"extended linearly to {f} in flight" if linear else
              f"NOT extended to {f} in flight: the peak moved between phases (may be low)"))
    res.sources = {c: f"{how}; {traced[0].sources.get(c, '')}" for c in CATEGORIES}
    res.micro_batches_traced = []
    res.schedule_note = f"{how}; {f} micro-batch{'es' if f != 1 else ''} in flight here"
    return res
