"""How long `launch verify` takes for Llama 3 405B on 16,384 H100s (2,048 nodes × 8), the plan the
planner picks, traced on this CPU: per role, and as a whole process.

Target (issue 9): under a minute on this 2-core machine. Prints wall time and CPU time (user + sys
of the process and its role workers): the machine is shared, so CPU time is the steadier figure.

    PYTHONPATH=. python benchmarks/verify_speed.py [--layout tp,cp,pp,zero,schedule]
"""

from __future__ import annotations

import argparse
import os
import resource
import time

from launcher.plan.planner import plan_job
from launcher.plan.spec import spec_from_dict
from launcher.verify import render, trace_plan


def job(layout: str | None) -> dict:
    d = {"name": "llama3-405b-16k", "model": "llama3-405b", "train": {"seq_len": 8192, "global_batch": 2048},
         "cluster": {"nodes": 2048, "gpus_per_node": 8, "gpu": "h100-sxm"}}
    if layout:
        tp, cp, pp, zero, schedule = layout.split(",")
        d["parallel"] = {"tp": int(tp), "cp": int(cp), "pp": int(pp), "zero": int(zero), "schedule": schedule,
                         "recompute": "selective", "micro_batch": 1}
    return d


def cpu_s() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", help="fix tp,cp,pp,zero,schedule instead of the planner's choice")
    args = ap.parse_args()
    t0, c0 = time.perf_counter(), cpu_s()
    best = plan_job(spec_from_dict(job(args.layout)), None, top=0).best
    t_plan = time.perf_counter() - t0
    rep = trace_plan(best)
    wall, cpu = time.perf_counter() - t0, cpu_s() - c0
    print(render(rep))
    print()
    d = best.degrees
    print(f"llama3-405b on {best.world_size:,} GPUs: tp={d['tp']} cp={d['cp']} pp={d['pp']} dp={d['dp']} "
          f"ZeRO {best.zero_stage} {best.schedule} v={best.virtual_stages} × {best.grad_accum} micro-batches")
    print(f"launch verify: {wall:.1f} s wall ({t_plan:.1f} s planning), {cpu:.1f} s CPU, "
          f"{len(rep.roles)} roles on {os.cpu_count()} CPUs; per role: "
          + ", ".join(f"{r.role.name} {r.seconds:.1f} s" for r in rep.roles))
    print(f"target: under 60 s wall on this 2-core machine -> {'met' if wall < 60 else 'NOT met'}")


if __name__ == "__main__":
    main()
