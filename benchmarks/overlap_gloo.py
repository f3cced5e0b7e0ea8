"""Exposed against total communication per collective kind: the bundled trainer measured on CPU/gloo
beside what the time model (launcher/plan/costs.py) claims is exposed for the same layout.

What is measured: a few layouts of the tiny-shaped trainer on 2 gloo ranks (FSDP2 ZeRO 3 with prefetch,
the ZeRO 1 distributed optimizer, TP + SP, 1F1B PP), a couple of steps under torch.profiler after a warm-up
step. Each collective is the span from the return of its enqueue call on the rank's main thread (`c10d::*`) to
the end of its `gloo:*` event (gloo runs it on its own worker thread; send/recv are spans that end when the
transfer does); its exposed part is the time in that span in which the main thread runs no compute op (`aten::*`, less the
collectives' own calls and `wait_tensor`). A collective with no compute in its span blocked the thread (a
synchronous one, or one waited for at once): all of it is exposed. One with compute beside it ran
asynchronously: its exposed part is the idle time in its span that no blocking collective accounts for
(gloo runs a group's collectives in order, so a prefetched all-gather queued behind a synchronous
reduce-scatter shares that wait without being the one waited for). The enqueue call itself is host work,
left out (on a GPU it runs ahead of the kernels it queues; on a loaded 2-core host it can take longer than
the transfer), unless the collective ran to its end inside it. The kind comes from where it was issued: the FSDP scope
(forward or backward), the ZeRO reduce (`overlap::grad_reduce`) or gather (`overlap::param_gather`), the
step's scalars (grad norm, loss, step sync), PP's send/recv, the rest of the forward/backward under TP.

What the model says: estimate() for the same plan on the `cpu` preset, with its compute factor and each
group's bandwidth set so that its compute and its communication per kind equal what this run measured
(so the comparison is of the overlap structure, not of a CPU's speed): exposed / total is 1 for TP
(synchronous), for ZeRO 0/1 (after the last backward, grad_sync_overlap 0) and for CP; 1/2 for PP's
transfers (pp_p2p's "half hidden by compute"); for ZeRO 2/3 dp_exposed / dp_comm (prefetch hides all but
one block's collectives per pass behind the compute running then).

What carries from gloo to NCCL and what does not:
- Synchronous collectives (TP/SP, ZeRO 1's reduce-scatter and all-gather) block the issuing thread on gloo
  as they block the compute stream on a GPU: exposed / total ~1 on both. It carries.
- FSDP2's overlap is built on CUDA streams: it issues its all-gathers and reduce-scatters as synchronous
  collectives (async_op False) on side streams, so on a GPU the CPU goes on issuing compute while they run.
  On a CPU the side stream is the issuing thread itself: as the trainer runs it (`fsdp-z3`), every FSDP
  collective blocks the thread on gloo, exposed / total 1, which says nothing about a GPU. FSDP2 has the
  collective-level form of the same schedule, an asynchronous unshard (FSDPModule._set_unshard_async_op,
  whose docstring asks for explicit forward prefetch with it): `fsdp-z3-prefetch` sets both (each block
  prefetches the next; backward prefetch is FSDP2's default), so the all-gathers run on gloo's thread while
  the previous block computes, as they run on the all-gather stream on a GPU. That carries, in direction
  (mostly hidden where a block's compute outlasts its gather), though gloo's thread and the compute share
  the cores (2 ranks on 2 shared cores here) where NCCL's kernels share SMs and HBM. FSDP2's reduce-scatter
  has no asynchronous form: it stays synchronous on gloo (exposed) and is not a check of the model's claim
  that it hides behind the next block's backward.
- Absolute times do not carry at all (loopback TCP and a CPU's matmuls); only ratios are compared.
- PP's 1/2 is the model's rule of thumb: gloo's send returns at once and its time runs behind compute, its
  recv blocks until the peer's activation arrives (the wait is the peer's compute, a bubble, as much as
  transfer), so the measured PP ratio is printed, not asserted.

torch's own estimator (torch/distributed/_tools/runtime_estimator.py) cannot check this: its docstring says
it "only estimate[s] the compute time", communication is not considered, and DTensor is not supported.

    python benchmarks/overlap_gloo.py            # the table
    python benchmarks/overlap_gloo.py --json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

STEP = "overlap::step"
#: A collective whose span holds less compute than this share of it blocked the issuing thread.
SYNC_SLACK = 0.01
OPT = "overlap::optimizer"
GRAD_REDUCE = "overlap::grad_reduce"
PARAM_GATHER = "overlap::param_gather"
#: The shape measured: small enough for a test, with a block's compute well above its all-gather on loopback.
SHAPE = dict(layers=4, hidden=128, heads=4, kv_heads=4, ffn_hidden=352)
#: name -> (what it exercises, make_plan keyword arguments, FSDP2's asynchronous unshard + forward prefetch)
LAYOUTS: dict[str, tuple[str, dict, bool]] = {
    "fsdp-z3-prefetch": ("FSDP2 ZeRO 3, asynchronous unshard + forward prefetch (its streams' overlap)",
                         dict(dp=2, zero=3, micro_batch=4, global_batch=16, seq_len=128), True),
    "fsdp-z3": ("FSDP2 ZeRO 3 as the trainer runs it", dict(dp=2, zero=3, micro_batch=4, global_batch=16,
                                                            seq_len=128), False),
    "zero1": ("ZeRO 1 distributed optimizer", dict(dp=2, zero=1, micro_batch=4, global_batch=16, seq_len=128), False),
    "tp-sp": ("TP 2 + sequence parallel", dict(tp=2, zero=1, micro_batch=4, global_batch=8, seq_len=128), False),
    "pp-1f1b": ("PP 2, 1F1B, 4 micro-batches", dict(pp=2, zero=1, micro_batch=2, global_batch=8, seq_len=128), False),
}
#: Which model term each measured kind belongs to (the model prices terms, not single collectives).
TERM = {"FSDP all-gather (prefetched)": "dp", "FSDP all-gather (on demand)": "dp", "FSDP reduce-scatter": "dp",
        "ZeRO 1 reduce-scatter": "dp", "ZeRO 0 / TP-replicated grad all-reduce": "dp", "ZeRO 1 all-gather": "dp",
        "TP/SP all_gather": "tp", "TP/SP reduce_scatter": "tp", "PP send/recv": "pp"}


# --- the trace: which collective, how long, how much of it exposed -------------------------------------

@dataclass(frozen=True)
class Span:
    name: str
    tid: object
    t0: float    # µs
    t1: float

    @property
    def dur(self) -> float:
        return self.t1 - self.t0


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _minus(base: list[tuple[float, float]], cut: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """base \\ cut, both unions (sorted, disjoint)."""
    out, j = [], 0
    for a, b in base:
        while j < len(cut) and cut[j][1] <= a:
            j += 1
        k, cur = j, a
        while k < len(cut) and cut[k][0] < b:
            if cut[k][0] > cur:
                out.append((cur, cut[k][0]))
            cur = max(cur, cut[k][1])
            k += 1
        if cur < b:
            out.append((cur, b))
    return out


def _covered(union: list[tuple[float, float]], a: float, b: float) -> float:
    """Length of [a, b] inside the union."""
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in union if x < b and y > a)


def _family(name: str) -> str | None:
    n = name.lower()
    for key, fam in (("reduce_scatter", "reduce_scatter"), ("allgather", "all_gather"), ("all_gather", "all_gather"),
                     ("allreduce", "all_reduce"), ("all_reduce", "all_reduce"), ("send", "send"), ("recv", "recv"),
                     ("broadcast", "broadcast"), ("alltoall", "all_to_all"), ("all_to_all", "all_to_all")):
        if key in n:
            return fam
    return None


#: gloo runs a reduce-scatter as an all-reduce (its worker's event says gloo:all_reduce)
_RUNS_AS = {"reduce_scatter": {"reduce_scatter", "all_reduce"}}


def spans_of(trace: dict) -> list[Span]:
    return [Span(e["name"], e["tid"], float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
            for e in trace["traceEvents"] if e.get("ph") == "X"]


def kind_of(family: str, in_step_phase: bool, enclosing: list[str], tp: int) -> str:
    """The collective kind, from the op and the scopes it was issued in."""
    if GRAD_REDUCE in enclosing:
        return "ZeRO 1 reduce-scatter" if family == "reduce_scatter" else "ZeRO 0 / TP-replicated grad all-reduce"
    if PARAM_GATHER in enclosing and family == "all_gather":
        return "ZeRO 1 all-gather"
    if family in ("send", "recv"):
        return "PP send/recv"
    if in_step_phase:
        return "step scalars (norm, loss, sync)"
    if any(n.startswith("FSDP::") for n in enclosing):
        if family == "all_gather":
            prefetched = any("prefetch" in n for n in enclosing if n.startswith("FSDP::"))
            return f"FSDP all-gather ({'prefetched' if prefetched else 'on demand'})"
        return "FSDP reduce-scatter" if family == "reduce_scatter" else f"FSDP {family}"
    if tp > 1:
        return "TP all-reduce (loss, replicated grads)" if family == "all_reduce" else f"TP/SP {family}"
    return f"other {family}"


def analyse(spans: list[Span], tp: int = 1) -> dict:
    """Per kind: count, total and exposed seconds (summed over the profiled steps), the forward/backward
    compute seconds, and how many enqueues found no gloo event (0 unless the trace is not understood)."""
    steps = sorted((s for s in spans if s.name == STEP), key=lambda s: s.t0)
    if not steps:
        raise ValueError(f"no {STEP} span in the trace")
    main = steps[0].tid
    mine = [s for s in spans if s.tid == main]
    comm_ops = _union([(s.t0, s.t1) for s in mine if s.name.startswith(("c10d::", "_c10d_functional::"))])
    compute = _minus(_union([(s.t0, s.t1) for s in mine if s.name.startswith("aten::")]), comm_ops)
    opt_marks = [s.t0 for s in mine if s.name in (OPT, GRAD_REDUCE, PARAM_GATHER) or s.name.startswith("Optimizer.step")]

    def step_of(t: float) -> Span | None:
        return next((st for st in steps if st.t0 <= t <= st.t1), None)

    def opt_start(st: Span) -> float:
        return min((t for t in opt_marks if st.t0 <= t <= st.t1), default=st.t1)

    enqueues = sorted((s for s in mine if s.name.startswith("c10d::") and _family(s.name)), key=lambda s: s.t0)
    runs = sorted((s for s in spans if s.name.startswith("gloo:") and _family(s.name)), key=lambda s: s.t0)
    used = [False] * len(runs)
    scopes = sorted((s for s in mine if not s.name.startswith("aten::")), key=lambda s: s.t0)
    found: list[tuple[str, float, float, float]] = []     # (kind, span start, span end, compute inside)
    unmatched = 0
    for e in enqueues:
        st = step_of(e.t0)
        if st is None:
            continue
        fam = _family(e.name) or ""
        ok = _RUNS_AS.get(fam, {fam})
        j = next((i for i, r in enumerate(runs) if not used[i] and _family(r.name) in ok and r.t0 >= e.t0 - 1.0), None)
        if j is None:
            unmatched += 1
            continue
        used[j] = True
        enclosing = [s.name for s in scopes if s.t0 <= e.t0 and s.t1 >= e.t1 and s is not e]
        k = kind_of(fam, e.t0 >= opt_start(st), enclosing, tp)
        # the issuing call's own time is the host's work (on a GPU it runs ahead of the queued kernels), unless
        # the collective ran to its end inside it: then the call was the wait
        r = runs[j]
        a, b = (max(e.t0, r.t0), r.t1) if r.t1 <= e.t1 else (e.t1, r.t1)
        found.append((k, a, b, _covered(compute, a, b)))
    # A collective with no compute in its span blocked the thread: all of its span is its own exposure. One
    # with compute beside it ran asynchronously: its exposed part is the idle time in its span that no
    # blocking collective accounts for (gloo runs a group's collectives in order, so an all-gather queued
    # behind a synchronous reduce-scatter shares that wait without being waited for).
    blocking = _union([(a, b) for _, a, b, cov in found if cov <= SYNC_SLACK * (b - a)])
    kinds: dict[str, dict] = {}
    for k, a, b, cov in found:
        d = kinds.setdefault(k, {"n": 0, "total_s": 0.0, "exposed_s": 0.0})
        d["n"] += 1
        d["total_s"] += (b - a) * 1e-6
        if cov <= SYNC_SLACK * (b - a):
            d["exposed_s"] += (b - a - cov) * 1e-6
        else:
            idle = _minus(_minus([(a, b)], compute), blocking)
            d["exposed_s"] += sum(y - x for x, y in idle) * 1e-6
    fwd_bwd = sum(_covered(compute, st.t0, opt_start(st)) for st in steps) * 1e-6
    return {"kinds": kinds, "compute_s": fwd_bwd, "steps": len(steps), "unmatched": unmatched}


# --- the trainer under the profiler (a spawned rank; tests/trainer_helpers.spawn runs it too) ------------

@contextlib.contextmanager
def _markers(eng):
    """Scopes around the step's phases, where the Engine calls them (engine module functions, the lean
    optimizer's reduce and step), so each collective is told by where it was issued."""
    import torch

    from launcher.trainer import engine as eng_mod

    def wrap(fn, name):
        def inner(*a, **k):
            with torch.profiler.record_function(name):
                return fn(*a, **k)
        return inner

    saved = {n: getattr(eng_mod, n) for n in ("timed_sync", "clip_grad_norm", "clip_to_global_norm", "sum_tied_grads")}
    for n, fn in saved.items():
        setattr(eng_mod, n, wrap(fn, OPT))
    lean = eng.lean
    if lean is not None:
        lean.reduce_grads = wrap(lean.reduce_grads, GRAD_REDUCE)
        lean.step = wrap(lean.step, PARAM_GATHER)
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(eng_mod, n, fn)
        if lean is not None:
            del lean.reduce_grads, lean.step


def _async_prefetch(eng) -> None:
    """FSDP2's asynchronous unshard with explicit forward prefetch, each block the next: the collective-level
    form of the overlap its streams give on a GPU (see the module docstring)."""
    model = eng.parts[0]
    blocks = list(model.layers.values())
    for a, b in zip(blocks, blocks[1:]):
        a.set_modules_to_forward_prefetch([b])
    model._set_unshard_async_op(True)


def _measure(job: dict, plan) -> dict:
    import torch

    from launcher.trainer.config import config_from_plan
    from launcher.trainer.data import TokenSource
    from launcher.trainer.engine import Engine
    from launcher.trainer.mesh import build_mesh

    cfg = config_from_plan(plan)
    mesh = build_mesh(cfg, torch.device("cpu"))
    eng = Engine(cfg, mesh)
    if job.get("async_prefetch"):
        _async_prefetch(eng)
    data = TokenSource(plan, mesh.coords["dp"], plan.layout.dp)

    def noop(*_a, **_k) -> None:
        return None

    with _markers(eng):
        for _ in range(job.get("warmup", 1)):
            eng.train_step(data.next_batch(), noop)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(job.get("steps", 2)):
                with torch.profiler.record_function(STEP):
                    eng.train_step(data.next_batch(), noop)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.loads(Path(f.name).read_text())
    return analyse(spans_of(trace), plan.layout.tp)


def measure_worker(rank: int, nprocs: int, jobs: list[dict], workdir: str, port: int) -> None:
    """Spawn target: each job {name, plan, async_prefetch?, warmup?, steps?} on ranks < its world size;
    every rank writes <workdir>/<name>.<rank>.json (its analyse() result, or {"error": ...})."""
    from tests.trainer_helpers import clear_dtensor_caches, job_groups

    for job, plan in job_groups(rank, nprocs, jobs, port):
        try:
            out = _measure(job, plan)
        except Exception as exc:  # noqa: BLE001 - reported through the file
            out = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        clear_dtensor_caches()
        (Path(workdir) / f"{job['name']}.{rank}.json").write_text(json.dumps(out))


def jobs(names: list[str] | None = None, steps: int = 2, shape: dict | None = None, **over) -> list[dict]:
    """The spawn jobs for these layouts (`over`: make_plan keywords replacing the layouts' own)."""
    from tests.trainer_helpers import make_plan

    out = []
    for name in names or list(LAYOUTS):
        _, kw, prefetch = LAYOUTS[name]
        kw = {"loss_chunk": 1024, **kw, **over}                  # the spec's default loss chunk
        plan = make_plan(model_over=dict(shape or SHAPE), **kw)
        out.append({"name": name, "plan": plan.to_dict(), "async_prefetch": prefetch, "steps": steps})
    return out


def collect(jobs_: list[dict], workdir: str | Path) -> dict[str, dict]:
    """Every rank's result summed per job: {name: {kinds, compute_s (mean over ranks), ranks, unmatched}}."""
    from launcher.plan.model import Plan

    out: dict[str, dict] = {}
    for j in jobs_:
        world = Plan.from_dict(j["plan"]).world_size
        per_rank: list[dict] = []
        for r in range(world):
            f = Path(workdir) / f"{j['name']}.{r}.json"
            per_rank.append(json.loads(f.read_text()) if f.exists() else {"error": "no result written"})
        errors = [x["error"] for x in per_rank if "error" in x]
        if errors:
            out[j["name"]] = {"error": errors[0], "trace": next(x.get("trace", "") for x in per_rank if "error" in x)}
            continue
        kinds: dict[str, dict] = {}
        for x in per_rank:
            for k, d in x["kinds"].items():
                acc = kinds.setdefault(k, {"n": 0, "total_s": 0.0, "exposed_s": 0.0})
                for f_ in acc:
                    acc[f_] += d[f_]
        out[j["name"]] = {"kinds": kinds, "compute_s": sum(x["compute_s"] for x in per_rank) / world,
                          "ranks": world, "steps": per_rank[0]["steps"],
                          "unmatched": sum(x["unmatched"] for x in per_rank)}
    return out


# --- the model's claim for the same run ---------------------------------------------------------------

def model_exposed(plan_dict: dict, measured: dict) -> dict[str, float]:
    """The time model's exposed / total per term (tp, pp, dp) for this plan, at this run's magnitudes: the
    compute factor and each term's bandwidth solved so that the model's compute and communication equal the
    measured (mean per rank and step; the model's latency set to ~0, so its time is volume / bandwidth)."""
    from dataclasses import replace

    from launcher.plan.costs import BUNDLED, Bandwidth, estimate
    from launcher.plan.ledger import Layout
    from launcher.plan.model import Plan

    plan = Plan.from_dict(plan_dict)
    lay = Layout(**{f: getattr(plan.layout, f) for f in Layout.__dataclass_fields__})
    ranks, steps = measured["ranks"], measured["steps"]
    per = {t: 0.0 for t in ("tp", "pp", "dp")}
    for k, d in measured["kinds"].items():
        if k in TERM:
            per[TERM[k]] += d["total_s"] / ranks / steps
    bw = Bandwidth(intra_gbs=1.0, net_per_gpu_gbs=1.0, source="gloo loopback", latency_s=1e-12)
    stack = replace(BUNDLED, alpha_s=1e-12)

    def run(factor: float, busbw: dict[str, float]):
        return estimate(plan.model, plan.train, plan.gpu, lay, bw, plan.gpus_per_node, tuple(plan.mesh_order),
                        efficiency_max=factor, stack=stack, busbw=busbw)

    ones = {t: 1.0 for t in per}
    first = run(1.0, ones)
    raw = {"tp": first.tp_comm_s, "pp": 2 * first.pp_p2p_s, "dp": first.dp_comm_s}
    factor = first.compute_s / (measured["compute_s"] / steps) if measured["compute_s"] else 1.0
    busbw = {t: (raw[t] / per[t] if per[t] and raw[t] else 1.0) for t in per}
    est = run(factor, busbw)
    out = {}
    if est.tp_comm_s:
        out["tp"] = 1.0                                   # charged whole: TP is synchronous
    if est.pp_p2p_s:
        out["pp"] = 0.5                                   # pp_p2p: half hidden by compute
    if est.dp_comm_s:
        out["dp"] = est.dp_exposed_s / est.dp_comm_s
    return out


def table(results: dict[str, dict], jobs_: list[dict]) -> list[dict]:
    """Rows: layout, kind, count, measured exposed / total, the model's exposed / total for the kind's term."""
    rows = []
    plans = {j["name"]: j["plan"] for j in jobs_}
    for name, res in results.items():
        if "error" in res:
            rows.append({"layout": name, "kind": "error", "error": res["error"]})
            continue
        model = model_exposed(plans[name], res)
        for k, d in sorted(res["kinds"].items()):
            term = TERM.get(k)
            rows.append({"layout": name, "kind": k, "term": term, "n": d["n"], "total_s": d["total_s"],
                         "measured": d["exposed_s"] / d["total_s"] if d["total_s"] else 0.0,
                         "model": model.get(term) if term else None})
        for term, frac in model.items():
            sel = [d for k, d in res["kinds"].items() if TERM.get(k) == term]
            tot = sum(d["total_s"] for d in sel)
            rows.append({"layout": name, "kind": f"all {term} (the model's term)", "term": term,
                         "n": sum(d["n"] for d in sel), "total_s": tot,
                         "measured": sum(d["exposed_s"] for d in sel) / tot if tot else 0.0, "model": frac})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", nargs="*", choices=list(LAYOUTS), help="default: all")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps per layout (after one warm-up)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.multiprocessing as mp

    from tests.trainer_helpers import free_port

    js = jobs(a.layouts, a.steps)
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(measure_worker, (2, js, d, free_port()), nprocs=2)
        results = collect(js, d)
    rows = table(results, js)
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"2 gloo ranks, shape {SHAPE}, {a.steps} profiled steps per layout; exposed / total per kind")
    print(f"{'layout':18} {'kind':40} {'n':>5} {'total s':>8} {'measured':>9} {'model':>6}")
    for r in rows:
        if r["kind"] == "error":
            print(f"{r['layout']:18} error: {r['error']}")
            continue
        model = f"{r['model']:.2f}" if r["model"] is not None else "-"
        print(f"{r['layout']:18} {r['kind']:40} {r['n']:>5} {r['total_s']:>8.3f} {r['measured']:>9.2f} {model:>6}")


if __name__ == "__main__":
    main()
