"""Level long inside the preflight batch job: the node-pair tests, as srun steps.

`python -m checks.slurm_pairs OUT` runs after every node wrote its outputs under OUT
(`python -m checks.probe --level long`): all_to_all_perf on neighbouring node pairs and per-NIC
GPUDirect `ib_write_bw` in rounds of disjoint pairs (a pair that is slow is re-paired in round 2),
the same `long_pairs` the SSH and srun backends run, with the NICs read from each node's saved
ibstat and topology. The runs land in OUT in the layout `preflight import` reads.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from checks import levels
from checks.folder import load_dir
from checks.level_runs import save_runs
from checks.orchestrate import PreflightOptions, gpu_count, long_pairs
from checks.pairing import NcclOptions
from checks.parsed import parse_nccl_run
from checks.runners.srun import SrunRunner

LAUNCHER = "srun --mpi={mpi} --export=ALL,NCCL_DEBUG=INFO -N {{nnodes}} -w {{hostlist}} --ntasks-per-node={{gpus}} {{cmd}}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m checks.slurm_pairs", description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the job's output folder (OUT/<host>/ from checks.probe)")
    ap.add_argument("--mpi", default="pmix", help="srun --mpi plugin for the multi-node runs")
    ap.add_argument("--gpus", type=int, default=None, help="tasks per node of a pair run (default: counted)")
    ap.add_argument("--sizes", default="512M,8G", help="nccl-tests -b,-e")
    ap.add_argument("--nccl-timeout", type=float, default=900.0)
    ap.add_argument("--tool-timeout", action="append", default=[], metavar="TOOL=SECONDS")
    args = ap.parse_args(argv)
    try:
        overrides = levels.parse_tool_timeouts(args.tool_timeout)
    except ValueError as exc:
        ap.error(f"--tool-timeout {exc}")
    lo, hi = args.sizes.split(",")
    opts = PreflightOptions(nccl_timeout=args.nccl_timeout, level="long", tool_timeouts=overrides,
                            nccl=NcclOptions(sizes=(lo, hi), launcher=LAUNCHER.format(mpi=args.mpi)))
    res = load_dir(args.out)
    res.tool_timeouts = levels.effective_timeouts("long", args.nccl_timeout, overrides)
    ok = set()
    for run in res.nccl:
        if run.kind == "node":
            t, _ = parse_nccl_run(run.result, run.collective)
            if t is not None and not t.failed:
                ok.add(run.hosts[0])
    hosts = [h for h in res.hosts if h in ok]  # pairs only among nodes whose own run worked
    res.gpus_per_node = {h: args.gpus or gpu_count(res.probes.get(h, {})) or 1 for h in hosts}
    res.nccl, res.rdma = [], []  # only the new runs are saved below

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if len(hosts) < 2:
        say(f"[rdma] skipped: {len(hosts)} node(s) passed their own NCCL test")
        return 0
    long_pairs(SrunRunner(), res, hosts, opts, say)
    save_runs(res, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
