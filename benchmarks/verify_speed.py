"""How long `launch verify` takes for Llama 3 405B on 16,384 H100s (2,048 nodes × 8), the plan the
planner picks, traced on this CPU: the whole `launch verify JOB` process (Python start, imports,
planning, every role), and per traced role.

Target (issue 9): under a minute on this 2-core machine. Prints wall time and CPU time (user + sys
of the process and its role workers): the machine is shared, so CPU time is the steadier figure.
Measured (2026-12-01, 2 cores): the planner's pick, pp 32 x v 2 (tp 4, cp 8, ZeRO 2, selective,
128 micro-batches): 3 of 32 ranks traced, 17.6 s CPU, 14.8 s wall idle (74 s wall at load 16); `--layout 4,8,32,2,interleaved-1f1b,4` (pp 32 x v 4, the pick before
the ledger's latest correction): 3 of 32 traced, 24.6 s CPU, 82 s wall at load 14 (before more than 3
stages per rank were replayed, every rank was traced in full: hours); `--layout 8,4,16,2,1f1b` 4 of 16
traced, 37.1 s CPU, 64 s wall at load 5-7.

    PYTHONPATH=. python benchmarks/verify_speed.py [--layout tp,cp,pp,zero,schedule[,virtual_stages]]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def job(layout: str | None) -> dict:
    d = {"name": "llama3-405b-16k", "model": "llama3-405b", "train": {"seq_len": 8192, "global_batch": 2048},
         "cluster": {"nodes": 2048, "gpus_per_node": 8, "gpu": "h100-sxm"}}
    if layout:
        tp, cp, pp, zero, schedule, *v = layout.split(",")
        d["parallel"] = {"tp": int(tp), "cp": int(cp), "pp": int(pp), "zero": int(zero), "schedule": schedule,
                         "recompute": "selective", "micro_batch": 1, **({"virtual_stages": int(v[0])} if v else {})}
    return d


def cpu_s() -> float:
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return kids.ru_utime + kids.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", help="fix tp,cp,pp,zero,schedule[,virtual_stages] instead of the planner's choice")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "job.yaml"
        path.write_text(yaml.safe_dump(job(args.layout)))
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        t0, c0 = time.perf_counter(), cpu_s()
        r = subprocess.run([sys.executable, "-m", "launcher.cli", "verify", str(path), "--json"], cwd=REPO,
                           env=env, capture_output=True, text=True)
        wall, cpu = time.perf_counter() - t0, cpu_s() - c0
    if r.returncode not in (0, 1):
        sys.exit(f"launch verify failed (exit {r.returncode}): {r.stderr.strip()[-2000:]}")
    rep = json.loads(r.stdout)
    own = [x for x in rep["roles"] if not x.get("trace_of")]
    shared = [x for x in rep["roles"] if x.get("trace_of")]
    for x in rep["roles"]:
        peak = "      -" if x["peak_gb"] is None else f"{x['peak_gb']:7.2f}"
        print(f"{x['role']['name']:<28} peak {peak} GB  ledger {x['ledger_total_gb'] or 0:7.2f} GB  "
              f"{ {True: 'fits', False: 'DOES NOT FIT', None: x['status'] + ' (not traced)'}[x['fits']]}  "
              + (f"traced in {x['seconds']:.1f} s at {x['micro_batches_traced']} micro-batches"
                 if not x.get("trace_of") else
                 "shares the trace of " + " and ".join(f"pp {q}" for q in x.get("trace_of"))))
    for n in rep["notes"]:
        print(f"note: {n}")
    print()
    print(f"llama3-405b on {rep['world_size']:,} GPUs: {len(rep['roles'])} roles, {len(own)} traced, "
          f"{len(shared)} sharing a trace; verdict: {'fits' if rep['fits'] else 'DOES NOT FIT'}")
    workers = sum(x.get("cpu_seconds", 0.0) for x in rep["roles"] + rep["build_checks"])
    print(f"launch verify, whole process: {wall:.1f} s wall on {os.cpu_count()} CPUs (load average "
          f"{os.getloadavg()[0]:.1f}); CPU {cpu + workers:.1f} s = the process {cpu:.1f} s + its role workers "
          f"{workers:.1f} s (user + sys; a fork server's one import of torch not counted); tracing: {rep['seconds']:.1f} s")
    print(f"target: under 60 s wall on this 2-core machine -> {'met' if wall < 60 else 'NOT met'}")


if __name__ == "__main__":
    main()
