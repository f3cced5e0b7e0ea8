"""`launch verify` on every example job file (examples/*.yaml), through the CLI as a user runs it.

Per example: the plan the planner picks (degrees, ZeRO, schedule), whether it builds and fits
(the exit code: 0 fits, 1 does not fit or does not build, 2 refused), how many rank roles were
traced, each role's traced peak beside the ledger's, and the time (wall, and CPU of the process
and its role workers: the machine is shared, CPU time is the steadier figure). An example that
cannot be verified prints its one-line reason instead.

    PYTHONPATH=. python benchmarks/verify_examples.py [--json] [EXAMPLE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def verify(path: Path) -> dict:
    """Run `launch verify PATH --json`; the report's figures, the exit code and the time."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "launcher.cli", "verify", str(path), "--json"], cwd=REPO, env=env,
                       capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - kids.ru_utime - kids.ru_stime
    out = {"example": path.name, "exit": r.returncode, "wall_s": round(wall, 1)}
    try:
        rep = json.loads(r.stdout)
    except json.JSONDecodeError:
        out["why"] = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return out
    workers = sum(x.get("cpu_seconds", 0.0) for x in rep["roles"] + rep["build_checks"])
    out.update(world=rep["world_size"], builds=rep["builds"], fits=rep["fits"], cpu_s=round(cpu + workers, 1),
               roles=[{"name": x["role"]["name"], "status": x["status"], "shared": bool(x.get("trace_of")),
                       "peak_gb": x["peak_gb"], "ledger_gb": x["ledger_total_gb"], "fits": x["fits"]}
                      for x in rep["roles"]])
    return out


def layout(path: Path) -> str:
    from launcher.commands.verify_cmd import load_plan_or_job

    try:
        p = load_plan_or_job(str(path))
    except Exception as exc:  # noqa: BLE001 - reported in the table
        return f"no plan: {exc}"
    lay = p.layout
    sched = f" {lay.schedule}" + (f" v{lay.virtual_stages}" if lay.virtual_stages > 1 else "") if lay.pp > 1 else ""
    return (f"tp{lay.tp} cp{lay.cp}" + (" a2a" if lay.cp > 1 and lay.cp_attention == "all-to-all" else "")
            + f" pp{lay.pp}{sched} dp{lay.dp}" + (f" shard{lay.dp_shard}" if lay.dp_shard else "")
            + (f" ep{lay.ep}" if lay.ep > 1 else "") + f" z{lay.zero} {lay.recompute} {p.train.precision}"
            + (" compiled" if lay.compile else ""))


def render(rows: list[dict]) -> str:
    out = [f"{'example':32} {'ranks':>6} {'layout':52} {'exit':>4} {'verdict':13} {'roles':>9} "
           f"{'traced/ledger, worst':>22} {'wall s':>7} {'CPU s':>7}"]
    for r in rows:
        if "why" in r:
            out.append(f"{r['example']:32} {'':>6} {r['layout']:52} {r['exit']:>4} cannot verify: {r['why']}")
            continue
        traced = sum(not x["shared"] and x["status"] == "traced" for x in r["roles"])
        verdict = "fits" if r["fits"] else ("DOES NOT BUILD" if not r["builds"] else "DOES NOT FIT")
        diffs = [(x["peak_gb"], x["ledger_gb"]) for x in r["roles"] if x["peak_gb"] and x["ledger_gb"]]
        worst = max(diffs, key=lambda d: abs(d[1] / d[0] - 1), default=None)
        w = f"{worst[0]:.3g}/{worst[1]:.3g} GB {worst[1] / worst[0] - 1:+.0%}" if worst else "-"
        out.append(f"{r['example']:32} {r['world']:>6} {r['layout']:52} {r['exit']:>4} {verdict:13} "
                   f"{traced:>3}/{len(r['roles']):<5} {w:>22} {r['wall_s']:>7.1f} {r['cpu_s']:>7.1f}")
    out.append(f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; roles: traced / all pipeline ranks; "
               f"traced/ledger: the peak of the role whose ledger total is furthest from it, and the ledger's difference)")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("examples", nargs="*", help="example files (default: examples/*.yaml)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    paths = [Path(p) for p in args.examples] or sorted((REPO / "examples").glob("*.yaml"))
    rows = []
    for p in paths:
        row = {**verify(p), "layout": layout(p)}
        rows.append(row)
        if not args.json:
            print(render([row]).splitlines()[1], flush=True)
    print(json.dumps(rows, indent=1) if args.json else "\n" + render(rows))


if __name__ == "__main__":
    main()
