"""When no layout fits: how close the nearest came, and how many GPUs would do.

Only run when a search found nothing, so it may search again: the closest candidate is the least
memory-hungry layout of the same search, priced in full (the search itself stops pricing a layout at
the first rank over the limit, so it does not know by how much it missed); the smallest world size
is found by searching the same job on more nodes of the same size (doubling, then bisecting: the fit
is close to monotone in the node count, not exactly, since the global batch must split over dp and the
layers over pp: below the first fit every node count is tried where that is at most SCAN_NODES of them).
The planner hands in how to search (its Search class), so this module does not import it back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from launcher.plan.spec import JobSpec

if TYPE_CHECKING:
    from launcher.plan.model import Layout

#: A new search of a job on a cluster (planner.Search): `.run()`, then `.candidates` and `.rejected`.
NewSearch = Callable[[JobSpec, Any], Any]

#: The world sizes tried for "fits from N GPUs" stop here.
MAX_WORLD = 1 << 17
MEMORY = "does not fit in GPU memory"


def _frugal(spec: JobSpec) -> JobSpec:
    """The job with every searched memory choice at its most frugal (ZeRO 3, full recompute, one
    sequence a micro-batch) and memory without bound: each layout is priced in full."""
    p = spec.parallel
    parallel = dataclasses.replace(p, zero=p.zero if p.zero is not None else 3, recompute=p.recompute or "full",
                                   micro_batch=p.micro_batch or 1)
    gpu = dataclasses.replace(spec.gpu, memory_gb=1e5)
    return dataclasses.replace(spec, parallel=parallel, gpu=gpu)


def describe_layout(lay: Layout) -> str:
    """A layout in one line: `tp=8 cp=1 pp=4 v=2 dp=16 ZeRO 1 selective`."""
    sched = f" v={lay.virtual_stages}" if lay.virtual_stages > 1 else ""
    att = " (all-to-all)" if lay.cp > 1 and lay.cp_attention == "all-to-all" else ""
    return (f"tp={lay.tp} cp={lay.cp}{att} pp={lay.pp}{sched} dp={lay.dp}" + (f" ep={lay.ep}" if lay.ep > 1 else "")
            + (f" dp_shard={lay.dp_shard_size}" if lay.hybrid else "")
            + f" ZeRO {lay.zero} {lay.recompute}")


def closest(spec: JobSpec, cluster: Any, new_search: NewSearch) -> dict[str, Any] | None:
    """The layout nearest to fitting: its need per GPU against the job's limit."""
    search = new_search(_frugal(spec), cluster)
    search.run()
    if not search.candidates:
        return None
    best = min(search.candidates, key=lambda c: c.ledger.per_gpu_gb)
    limit = spec.gpu.memory_gb * (1 - spec.cluster.memory_headroom)
    led = best.ledger
    return {"layout": describe_layout(best.layout), "per_gpu_gb": round(led.per_gpu_gb, 2), "limit_gb": round(limit, 2),
            "over_by": round(led.per_gpu_gb / limit - 1, 4),
            "categories_gb": {k: round(getattr(led, f"{k}_gb"), 2) for k in
                              ("params", "grads", "optimizer", "activations") if hasattr(led, f"{k}_gb")}}


def _fits_on(spec: JobSpec, cluster: Any, nodes: int, new_search: NewSearch) -> bool:
    par = dataclasses.replace(spec.parallel, dp=None)          # dp follows the world size
    s = dataclasses.replace(spec, parallel=par, cluster=dataclasses.replace(spec.cluster, nodes=nodes))
    search = new_search(s, dataclasses.replace(cluster, nodes=nodes))
    search.run()
    return bool(search.candidates)


#: Up to this many node counts below the first fit found by doubling are each tried (an exact answer);
#: a wider range is bisected (a fitting node count, perhaps not the fewest: fit is not monotone).
SCAN_NODES = 64


def smallest_world(spec: JobSpec, cluster: Any, new_search: NewSearch) -> dict[str, Any] | None:
    """The fewest nodes (of the job's gpus_per_node) on which some layout fits, or None up to MAX_WORLD."""
    g = spec.cluster.gpus_per_node
    lo, hi = spec.cluster.nodes, None           # lo: known not to fit
    n = lo * 2
    while n * g <= MAX_WORLD:
        if _fits_on(spec, cluster, n, new_search):
            hi = n
            break
        lo, n = n, n * 2
    if hi is None:
        return None
    exact = hi - spec.cluster.nodes <= SCAN_NODES
    if exact:                                   # every node count below the first fit: the fewest
        hi = next(k for k in range(spec.cluster.nodes + 1, hi + 1)
                  if k == hi or _fits_on(spec, cluster, k, new_search))
    else:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if _fits_on(spec, cluster, mid, new_search):
                hi = mid
            else:
                lo = mid
    return {"nodes": hi, "gpus_per_node": g, "world_size": hi * g, "fewest": exact}


def nothing_fits(spec: JobSpec, cluster: Any, search: Any, new_search: NewSearch) -> dict[str, Any]:
    """What PlanResult.nothing_fits holds: the reasons every layout was rejected, and where memory was
    the reason, the closest candidate and the smallest world size that fits (searched with
    `new_search`, the planner's Search)."""
    rejected = sorted(search.rejected.items(), key=lambda kv: -kv[1])
    out: dict[str, Any] = {"rejected": [{"reason": r, "layouts": n} for r, n in rejected[:3]]}
    if search.rejected.get(MEMORY):
        near = closest(spec, cluster, new_search)
        if near is not None:
            out["closest"] = near
        out["smallest_world"] = smallest_world(spec, cluster, new_search)
        out["max_world_tried"] = MAX_WORLD
    return out


def nothing_fits_text(spec: JobSpec, result: Any) -> str:
    """The explanation as one line (no trailing full stop)."""
    nf = result.nothing_fits or {}
    parts = []
    near = nf.get("closest")
    if near:
        parts.append(f"the closest, {near['layout']}, needs {near['per_gpu_gb']:.1f} GB per GPU against a limit of "
                     f"{near['limit_gb']:.1f} GB ({spec.gpu.memory_gb:g} GB less "
                     f"{spec.cluster.memory_headroom:.0%} headroom), {near['over_by']:.0%} over")
    if "smallest_world" in nf:
        w = nf["smallest_world"]
        if w:
            parts.append(f"it fits {'from' if w.get('fewest') else 'on'} {w['world_size']} GPUs ({w['nodes']} nodes × "
                         f"{w['gpus_per_node']}; set cluster.nodes: {w['nodes']})")
        else:
            parts.append(f"it fits on no world size up to {nf.get('max_world_tried', MAX_WORLD)} GPUs")
    if not parts or not near:
        reasons = "; ".join(f"{r['reason']} ({r['layouts']})" for r in nf.get("rejected", []))
        parts.insert(0, f"every layout was rejected: {reasons or 'none matches the fixed parallel section'}")
    return "; ".join(parts)


# --- how far the time model can tell plans apart ----------------------------------------------------

#: The time model's step-time error for the bundled trainer's stack family, cross-validated by source:
#: the median |error| when each publication's rows are predicted by a fit on all the others
#: (`benchmarks/calibrate_costs.py --cv`, 156 rows of torchtitan, FMS and llm-foundry runs: 6.7%; worst
#: 34.1%). Two plans whose predicted steps differ by less cannot be told apart.
CV_ERROR = 0.067
CV_SOURCE = "leave-one-source-out median |step-time error| of the eager-FSDP family (benchmarks/calibrate_costs.py --cv)"


def uncertainty(best_step_s: float, alternative_steps_s: list[float], cv_error: float = CV_ERROR) -> dict[str, Any]:
    """Each alternative's predicted difference from the best plan beside the cross-validated error, and
    how many of the top plans lie within it (the best counted): if more than one, the model's order among
    them is a coin toss and `launch plan --benchmark K` measures them instead."""
    alts = []
    for i, step in enumerate(alternative_steps_s, 1):
        diff = step / best_step_s - 1
        alts.append({"rank": i + 1, "predicted_diff": round(diff, 4), "within_error": diff <= cv_error})
    within = 1
    for a in alts:                      # the leading run of plans the model cannot separate from the best
        if not a["within_error"]:
            break
        within += 1
    out: dict[str, Any] = {"cv_error": cv_error, "source": CV_SOURCE, "alternatives": alts,
                           "top_within_error": within, "recommend": None}
    if within > 1:
        out["recommend"] = f"launch plan --benchmark {within}"
    return out


def uncertainty_text(u: dict[str, Any]) -> str:
    """One line for `launch plan`'s human output."""
    n = u["top_within_error"]
    if n > 1:
        return (f"uncertainty: the top {n} plans lie within the time model's cross-validated error "
                f"(±{u['cv_error']:.0%}): its order among them is a coin toss; `{u['recommend']}` measures them")
    return f"uncertainty: the next plan is predicted more than the time model's ±{u['cv_error']:.0%} slower"
