"""`launch calibrate`: fit the cluster's efficiency parameters of the time model (costs.estimate) to
measured runs, so later plans predict this cluster's step times.

Each run dir holds the plan it ran (plan.json) and the trainer's metrics.jsonl. A run's measured
step time is the median after WARMUP_STEPS (start-up, allocator warm-up). The fit re-evaluates the
same estimate() the planner uses, for each run's own layout, with candidate parameters, and
minimises the squared log error over the runs (Levenberg-Marquardt on log parameters).

Only what the runs can identify is fitted: at the parameters the runs were planned with, a
parameter's sensitivity is d log(step) / d log(parameter) per run; taken most influential first,
a parameter is fitted when the part of its sensitivity the parameters already chosen cannot mimic
still moves some run's predicted step by IDENTIFY_MIN (5%), and never more parameters than runs.
The rest keep the value the runs were planned with and are not written.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.errors import UserError
from launcher.formats import rundir
from launcher.formats.rundir import RunDir, read_metrics
from launcher.plan.costs import BUNDLED, Bandwidth, estimate
from launcher.plan.model import Plan
from launcher.plan.profile import PARAMS, ClusterProfile

#: Steps left out of each run's median (the first pays start-up and allocator warm-up).
WARMUP_STEPS = 1
#: A parameter is fitted only if it moves some run's predicted step by this much (log) beyond what
#: the parameters already chosen can do.
IDENTIFY_MIN = 0.05


@dataclass
class Run:
    run_dir: str
    plan: Plan
    measured_s: float
    steps: int
    peak_mem_gb: float | None
    #: bus bandwidths by group kind the run's own nodes measured before it (`launch submit --preflight-plan`:
    #: RUN_DIR/preflight-plan.json); its collectives are priced at these, not at the fitted figures
    busbw: dict[str, float] | None = None

    @property
    def layout(self) -> str:
        return layout_name(self.plan)


def layout_name(plan: Plan) -> str:
    """tp2-cp1-pp1-dp2-z3-none-mb2: a layout in one word (benchmark run dirs are named so)."""
    d = plan.degrees
    v = f"v{plan.virtual_stages}" if plan.virtual_stages > 1 else ""
    return (f"tp{d['tp']}-cp{d['cp']}-pp{d['pp']}{v}-dp{d['dp']}" + (f"-ep{d['ep']}" if d.get("ep", 1) > 1 else "")
            + f"-z{plan.zero_stage}-{plan.recompute}-mb{plan.micro_batch}")


def read_run(run_dir: str | Path) -> Run:
    """One measured run, or UserError naming the run dir and what is missing."""
    d = RunDir(run_dir)
    if not d.plan.is_file():
        raise UserError(f"{run_dir}: no {rundir.PLAN} (a run directory from `launch run`, `submit` or `plan --benchmark`)")
    plan = Plan.load(d.plan)
    if not d.metrics.is_file():
        raise UserError(f"{run_dir}: no {rundir.METRICS}: the run logged no steps")
    recs = [r for r in read_metrics(d.root) if _step_time(r) is not None]
    if len(recs) <= WARMUP_STEPS:
        raise UserError(f"{run_dir}: {rundir.METRICS} has {len(recs)} step(s) with a step time; more than the "
                        f"{WARMUP_STEPS} warm-up step(s) are needed (run more train.steps)")
    timed = recs[WARMUP_STEPS:]
    mems = [float(r["peak_mem_gb"]) for r in recs if isinstance(r.get("peak_mem_gb"), (int, float))]
    return Run(str(run_dir), plan, statistics.median(float(r["step_time_s"]) for r in timed), len(recs),
               max(mems) if mems else None, busbw=preflight_busbw(d, plan))


def preflight_busbw(d: RunDir, plan: Plan) -> dict[str, float] | None:
    """What the run's plan preflight measured, per group kind (None without one, or one that did not
    measure); a file that is not one is an error naming it."""
    from launcher.formats.groupprobe import GroupProbe
    from launcher.plan.commgroups import measured_busbw

    if not d.preflight_plan.is_file():
        return None
    probe = GroupProbe.load(d.preflight_plan)
    if probe.error or not probe.measured:
        return None
    return measured_busbw(plan, probe) or None


def _step_time(rec: dict) -> float | None:
    t = rec.get("step_time_s")
    if isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > 0:
        return float(t)
    return None


def cluster_key(plan: Plan) -> dict[str, Any]:
    """What must be equal for runs to come from one cluster and GPU type."""
    bw = plan.bandwidth
    return {"gpu": plan.gpu.name, "peak_tflops": plan.gpu.peak_tflops, "memory_gb": plan.gpu.memory_gb,
            "gpus_per_node": plan.gpus_per_node, "intra_gbs": bw.get("intra_gbs"),
            "net_per_gpu_gbs": bw.get("net_per_gpu_gbs"), "latency_s": bw.get("latency_s")}


def check_same_cluster(runs: list[Run]) -> None:
    first = cluster_key(runs[0].plan)
    for r in runs[1:]:
        key = cluster_key(r.plan)
        diff = next((k for k in first if key[k] != first[k]), None)
        if diff:
            raise UserError(f"{r.run_dir}: {diff} {key[diff]!r} differs from {runs[0].run_dir}'s {first[diff]!r}: "
                            "calibrate runs of one cluster and GPU type together")


def base_params(plan: Plan) -> dict[str, float]:
    """The parameters the run was planned with (the ceiling read back from its estimate)."""
    bw = plan.bandwidth
    # the same estimate at factor 1: compute time is linear in the factor, so the ratio is the factor
    curve = estimate(plan.model, plan.train, plan.gpu, plan.layout, _band(bw, base_latency(bw)), plan.gpus_per_node,
                     tuple(plan.mesh_order), efficiency_max=1.0).efficiency
    return {"compute_efficiency": float(f"{plan.estimate['efficiency'] / curve:.4g}"),   # estimate is rounded
            "latency_s": base_latency(bw),
            "net_per_gpu_gbs": float(bw["net_per_gpu_gbs"]), "intra_gbs": float(bw["intra_gbs"])}


def base_latency(bw: dict) -> float:
    return bw.get("latency_s") or BUNDLED.alpha_s


def _band(bw: dict, latency_s: float, intra: float | None = None, net: float | None = None) -> Bandwidth:
    return Bandwidth(intra_gbs=float(intra or bw["intra_gbs"]), net_per_gpu_gbs=float(net or bw["net_per_gpu_gbs"]),
                     source="calibrate", alltoall_intra_gbs=bw.get("alltoall_intra_gbs"),
                     alltoall_inter_gbs=bw.get("alltoall_inter_gbs"), latency_s=latency_s)


def predict(plan: Plan, p: dict[str, float], busbw: dict[str, float] | None = None) -> float:
    """The time model's step time for the run's own layout with parameters p (and the group kinds its
    plan preflight measured at those figures)."""
    band = _band(plan.bandwidth, p["latency_s"], p["intra_gbs"], p["net_per_gpu_gbs"])
    return estimate(plan.model, plan.train, plan.gpu, plan.layout, band, plan.gpus_per_node,
                    tuple(plan.mesh_order), efficiency_max=p["compute_efficiency"], busbw=busbw).step_time_s


def _residuals(runs: list[Run], base: dict[str, float], names: list[str], x: list[float]) -> list[float]:
    p = {**base, **{n: math.exp(v) for n, v in zip(names, x)}}
    return [math.log(predict(r.plan, p, r.busbw) / r.measured_s) for r in runs]


def _jacobian(runs, base, names, x, h: float = 0.02) -> list[list[float]]:
    r0 = _residuals(runs, base, names, x)
    cols = []
    for j in range(len(x)):
        xs = list(x)
        xs[j] += h
        cols.append([(a - b) / h for a, b in zip(_residuals(runs, base, names, xs), r0)])
    return [[cols[j][i] for j in range(len(x))] for i in range(len(runs))]     # runs × params


def identifiable(runs: list[Run], base: dict[str, float]) -> list[str]:
    """The parameters the runs separate, most influential first (see the module docstring)."""
    names = list(PARAMS)
    jac = _jacobian(runs, base, names, [math.log(base[n]) for n in names])
    cols = {n: [row[j] for row in jac] for j, n in enumerate(names)}
    chosen: list[str] = []
    basis: list[list[float]] = []                              # orthonormal, over the runs
    for n in sorted(names, key=lambda n: -max(abs(v) for v in cols[n])):
        if len(chosen) >= len(runs):
            break
        rest = list(cols[n])
        for q in basis:                                        # what the chosen ones cannot mimic
            dot = sum(a * b for a, b in zip(rest, q))
            rest = [a - dot * b for a, b in zip(rest, q)]
        if max(abs(v) for v in rest) >= IDENTIFY_MIN:
            norm = math.sqrt(sum(v * v for v in rest))
            basis.append([v / norm for v in rest])
            chosen.append(n)
    return chosen


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (a few unknowns)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        piv = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[piv] = m[piv], m[c]
        if abs(m[c][c]) < 1e-300:
            return [0.0] * n
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            m[r] = [x - f * y for x, y in zip(m[r], m[c])]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (m[r][n] - sum(m[r][k] * out[k] for k in range(r + 1, n))) / m[r][r]
    return out


def fit(runs: list[Run], base: dict[str, float], names: list[str], iters: int = 60) -> dict[str, float]:
    """Levenberg-Marquardt on log parameters, each kept within PARAMS' bounds."""
    bounds = [(math.log(PARAMS[n][2]), math.log(PARAMS[n][3])) for n in names]
    x = [min(max(math.log(base[n]), lo), hi) for n, (lo, hi) in zip(names, bounds)]
    cost = sum(v * v for v in _residuals(runs, base, names, x))
    lam = 1e-3
    for _ in range(iters):
        r = _residuals(runs, base, names, x)
        jac = _jacobian(runs, base, names, x)
        jtj = [[sum(row[i] * row[j] for row in jac) for j in range(len(x))] for i in range(len(x))]
        jtr = [sum(row[i] * ri for row, ri in zip(jac, r)) for i in range(len(x))]
        improved = done = False
        while lam < 1e8:
            a = [[jtj[i][j] + (lam * (jtj[i][i] or 1.0) if i == j else 0.0) for j in range(len(x))]
                 for i in range(len(x))]
            step = _solve(a, [-v for v in jtr])
            xn = [min(max(xi + si, lo), hi) for xi, si, (lo, hi) in zip(x, step, bounds)]
            cn = sum(v * v for v in _residuals(runs, base, names, xn))
            if cn < cost:
                improved, done = True, cost - cn < 1e-12        # converged
                x, cost, lam = xn, cn, lam / 3
                break
            lam *= 4
        if not improved or done:
            break
    return {n: math.exp(v) for n, v in zip(names, x)}


def calibrate(run_dirs: list[str]) -> ClusterProfile:
    """Read the runs, check they share one cluster, fit what they identify; the profile to write."""
    if not run_dirs:
        raise UserError("calibrate: give at least one RUN_DIR")
    runs = [read_run(d) for d in run_dirs]
    check_same_cluster(runs)
    base = base_params(runs[0].plan)
    names = identifiable(runs, base)
    skipped = {n: (f"moves no run's predicted step by {IDENTIFY_MIN:.0%}" + (" beyond the fitted ones" if names else "")
                   if len(names) < len(runs) else f"{len(runs)} run(s) fit at most {len(runs)} parameter(s)")
               for n in PARAMS if n not in names}
    if not names:
        raise UserError(f"calibrate: no parameter moves the predicted step time of these {len(runs)} run(s) by "
                        f"{IDENTIFY_MIN:.0%}; nothing to fit")
    fitted = fit(runs, base, names)
    after = {**base, **fitted}
    rows = []
    for r in runs:
        before_s, after_s = predict(r.plan, base, r.busbw), predict(r.plan, after, r.busbw)
        rows.append({"run_dir": r.run_dir, "layout": r.layout, "world_size": r.plan.world_size,
                     "steps": r.steps, "measured_step_s": round(r.measured_s, 6),
                     "predicted_before_s": round(before_s, 6), "predicted_after_s": round(after_s, 6),
                     "error_before": round(before_s / r.measured_s - 1, 4),
                     "error_after": round(after_s / r.measured_s - 1, 4),
                     "peak_mem_gb": r.peak_mem_gb,
                     **({"measured_busbw_gbs": {k: float(f"{v:.4g}") for k, v in r.busbw.items()}} if r.busbw else {})})
    plan = runs[0].plan
    gpu = {"name": plan.gpu.name, "peak_tflops": plan.gpu.peak_tflops, "memory_gb": plan.gpu.memory_gb}
    return ClusterProfile(gpu=gpu, gpus_per_node=plan.gpus_per_node,
                          params={n: float(f"{fitted[n]:.6g}") for n in names},
                          base={k: float(f"{v:.6g}") for k, v in base.items()}, runs=rows, not_fitted=skipped)
