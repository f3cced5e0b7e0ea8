"""Node-local probes: which commands preflight runs on every node, and where their outputs go.

`python -m checks.probe --out DIR` runs them here and saves the raw outputs under
DIR/<hostname>/ with the fixed names in PROBES (plus probe.json: command, exit status, seconds),
the layout `launch preflight import DIR` reads. The SSH and srun runners run the same commands
remotely, so a node needs only nvidia-smi (and ibstat, nccl-tests), not this package.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checks.parsers.gpu_query import QUERY_FIELDS
from launcher.transport import OUTPUT_LIMIT, Completed, over_limit
from launcher.transport.local import run_process

_NEW = ",".join(QUERY_FIELDS)
_OLD = _NEW.replace("clocks_event_reasons.active", "clocks_throttle_reasons.active")


@dataclass(frozen=True)
class Probe:
    name: str  # the parser KIND
    file: str  # file name under DIR/<host>/
    command: str


PROBES: tuple[Probe, ...] = (
    Probe("topo", "topo.txt", "nvidia-smi topo -m"),
    Probe("gpu-query", "gpu-query.csv",
          f"nvidia-smi --query-gpu={_NEW} --format=csv 2>/dev/null || nvidia-smi --query-gpu={_OLD} --format=csv"),
    Probe("nvlink", "nvlink.txt", "nvidia-smi nvlink -s"),
    Probe("ibstat", "ibstat.txt", "ibstat 2>/dev/null || ibv_devinfo"),
    Probe("xid", "xid.txt",
          "if log=$(dmesg 2>/dev/null) || log=$(journalctl -k --no-pager -q 2>/dev/null); then "
          # Xid lines, and two driver messages that come without one: a GPU that fell off the bus (the
          # notice is wrapped over 3 lines, hence -A2) and a GPU the driver could not initialise
          "printf '%s\\n' \"$log\" | grep -E -A2 'NVRM: (Xid|The NVIDIA GPU|GPU [0-9A-Fa-f:.]+: RmInitAdapter)' "
          "| grep -v '^--$' || true; "
          "else echo 'cannot read the kernel log (dmesg, journalctl -k): no permission?' >&2; exit 3; fi"),
)
PROBE_BY_NAME = {p.name: p for p in PROBES}
NCCL_NODE_FILE = "nccl-node.txt"
#: Single-node nccl-tests runs: kind -> file under DIR/<host>/ (all_to_all_perf at level long)
RUN_FILES = {"nccl-node": NCCL_NODE_FILE, "a2a-node": "alltoall-node.txt"}
#: The deeper levels' outputs (checks/levels.py): kind -> file under DIR/<host>/
EXTRA_FILES = {"nvlink-errors": "nvlink-errors.txt", "nvlink-errors-after": "nvlink-errors-after.txt",
               "dcgm-diag": "dcgm-diag.txt", "nvbandwidth": "nvbandwidth.txt"}
META_FILE = "probe.json"
TIMEOUTS_KEY = "tool_timeouts"  # in probe.json: {tool: seconds} of the deeper levels


def nccl_command(binary: str, gpus: int, sizes: tuple[str, str], extra: str = "") -> str:
    """The single-node nccl-tests command: one process driving all `gpus` GPUs."""
    lo, hi = sizes
    return f"{binary} -b {lo} -e {hi} -f 2 -g {gpus}" + (f" {extra}" if extra else "")


def standalone_env() -> dict[str, str]:
    """This environment without the launcher's (Slurm step, PMI, Open MPI) variables, so an MPI-built
    nccl-tests started by the probe runs as one node alone instead of joining the probe's own step."""
    drop = ("SLURM_", "PMI_", "PMIX_", "OMPI_", "PMI_RANK", "MPI_LOCALRANKID")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


def run_local(command: str, timeout: float, host: str = "localhost",
              env: dict[str, str] | None = None, limit: int = OUTPUT_LIMIT) -> Completed:
    """`bash -c command` here (launcher.transport's one local runner: own session, bounded output)."""
    c = run_process(command, timeout, env=env, limit=limit)
    c.host, c.command = host, command
    if c.flooded:
        c.error = over_limit(limit)
    return c


def save(out_dir: Path, host: str, results: dict[str, Completed], timeouts: dict[str, float] | None = None) -> Path:
    """Write outputs as DIR/<host>/<file> and their metadata as probe.json (with the deeper tools'
    timeouts, so a tool that timed out is reported with its limit when the folder is judged)."""
    d = out_dir / host
    d.mkdir(parents=True, exist_ok=True)
    meta: dict[str, Any] = {}
    for name, r in results.items():
        fname = PROBE_BY_NAME[name].file if name in PROBE_BY_NAME else (EXTRA_FILES | RUN_FILES)[name]
        (d / fname).write_text(r.stdout)
        meta[name] = {"file": fname, "command": r.command, "rc": r.rc, "timed_out": r.timed_out,
                      "error": r.error, "seconds": round(r.seconds, 3), "stderr": r.stderr[-2000:]}
    if timeouts:
        meta[TIMEOUTS_KEY] = timeouts
    (d / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return d


def main(argv: list[str] | None = None) -> int:
    from checks import levels

    ap = argparse.ArgumentParser(prog="python -m checks.probe", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder; outputs go to OUT/<hostname>/")
    ap.add_argument("--host", default=None, help="name to file under (default: this host's name)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per probe")
    ap.add_argument("--nccl", action="store_true", help="also run the single-node nccl-tests all_reduce")
    ap.add_argument("--nccl-timeout", type=float, default=900.0, help="seconds for the nccl-tests run")
    ap.add_argument("--nccl-binary", default="all_reduce_perf")
    ap.add_argument("--sizes", default="512M,8G", help="nccl-tests -b,-e")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs for nccl-tests -g (default: counted)")
    ap.add_argument("--level", choices=levels.LEVELS, default="quick",
                    help="standard/long: also the level's single-node tools (checks/levels.py)")
    ap.add_argument("--tool-timeout", action="append", default=[], metavar="TOOL=SECONDS",
                    help=f"a deeper tool's timeout: {', '.join(levels.TOOLS)}")
    args = ap.parse_args(argv)
    try:
        timeouts = levels.effective_timeouts(args.level, args.nccl_timeout, levels.parse_tool_timeouts(args.tool_timeout))
    except ValueError as exc:
        ap.error(f"--tool-timeout {exc}")
    host = args.host or os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    results = {p.name: run_local(p.command, args.timeout, host) for p in PROBES}
    gpus = args.gpus
    if gpus is None:
        from checks.parsers.base import ParseError
        from checks.parsers.gpu_query import parse_gpu_query
        try:
            gpus = parse_gpu_query(results["gpu-query"].stdout).count
        except ParseError:
            gpus = 0
    deep = levels.depth(args.level)

    def step(s: levels.Step) -> None:
        results[s.name] = run_local(s.command, s.within(timeouts), host)

    if deep and gpus:  # the same order as the interactive backends (checks/orchestrate.py)
        for s in levels.node_steps(args.level):
            step(s)
    lo, hi = args.sizes.split(",")
    if args.nccl and gpus:
        if deep:
            step(levels.NVLINK_BEFORE)
        cmd = nccl_command(args.nccl_binary, gpus, (lo, hi))
        results["nccl-node"] = run_local(cmd, args.nccl_timeout, host, env=standalone_env())
        if deep:
            step(levels.NVLINK_AFTER)
        if deep >= 2:
            results["a2a-node"] = run_local(nccl_command(levels.A2A_BINARY, gpus, (lo, hi)),
                                            timeouts[levels.A2A_BINARY], host, env=standalone_env())
    d = save(Path(args.out), host, results, timeouts)
    print(f"probe: {host}: {len(results)} outputs in {d}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
