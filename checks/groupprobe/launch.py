"""How the group probe's worker is started: every rank on this machine (torchrun --standalone), or one
torchrun per node over any runner (SSH) with the static rendezvous the job itself uses (node i of the
plan is node rank i, so rank r runs where the plan put it).

Every start returns the result as a GroupProbe (the worker's error in `error` when it failed) and the
output it printed, so a caller reports either the measurement or why there is none.
"""

from __future__ import annotations

import base64
import json
import os
import shlex
import subprocess
import sys
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from checks.groupprobe.worker import RESULT_MARKER
from checks.runners.base import Runner
from launcher.formats.groupprobe import GroupProbe

#: The spec travels inside the command over SSH (no file copy); beyond this it would not fit one argument.
MAX_INLINE_SPEC = 96 << 10
WORKER = "checks.groupprobe.worker"


def failure(output: str) -> str:
    """The line that says why the worker failed: its own `groupprobe:` line, else the output's last."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    mine = [ln for ln in lines if "groupprobe: " in ln]
    return (mine or lines or ["the probe printed nothing"])[-1][:300]


def run_local(probe: GroupProbe, workdir: Path, timeout_s: float, python: str = sys.executable,
              env: dict[str, str] | None = None) -> tuple[GroupProbe, str]:
    """All of the plan's ranks on this machine, one process each (gloo on CPU, NCCL on GPUs)."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec, out = workdir / "groupprobe-spec.json", workdir / "groupprobe-result.json"
    probe.save(spec)
    out.unlink(missing_ok=True)
    cmd = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={probe.world_size}",
           "--max-restarts=0", "-m", WORKER, str(spec), "-o", str(out), "--timeout", f"{timeout_s:g}"]
    full_env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s + 60, env=full_env,
                           start_new_session=True)
        output = p.stdout + p.stderr
    except subprocess.TimeoutExpired as exc:
        output = f"{_text(exc.stdout)}{_text(exc.stderr)}\ngroupprobe: no result within {timeout_s + 60:g} s"
    return _result(probe, out if out.is_file() else None, output), output


def node_command(probe: GroupProbe, node_rank: int, master: str, port: int, python: str, timeout_s: float,
                 host: str | None) -> str:
    """The shell command that starts node `node_rank`'s torchrun, the spec inlined (zlib + base64). `host`:
    the node's name in the results (None: $LAUNCH4D_NODE_NAME as the node sets it, e.g. a pod's node)."""
    blob = base64.b64encode(zlib.compress(json.dumps(probe.to_dict()).encode(), 9)).decode()
    if len(blob) > MAX_INLINE_SPEC:
        raise ValueError(f"the plan's {len(probe.groups)} groups make a {len(blob) >> 10} KiB spec, more than one "
                         "SSH command carries; run the probe inside the allocation (--backend slurm)")
    q = shlex.quote
    name = "" if host is None else f"LAUNCH4D_NODE_NAME={q(host)} "
    unpack = "import base64,sys,zlib; sys.stdout.write(zlib.decompress(base64.b64decode(sys.argv[1])).decode())"
    return (f"set -o pipefail; d=$(mktemp -d) && {q(python)} -c {q(unpack)} {blob} > \"$d/spec.json\" && "
            f"{name}OMP_NUM_THREADS=${{OMP_NUM_THREADS:-1}} {q(python)} -m torch.distributed.run "
            f"--nnodes={probe.nodes} --nproc-per-node={probe.gpus_per_node} --node-rank={node_rank} "
            f"--rdzv-backend=static --master-addr={q(master)} --master-port={port} --max-restarts=0 "
            f"-m {WORKER} \"$d/spec.json\" -o - --timeout {timeout_s:g}; rc=$?; rm -rf \"$d\"; exit $rc")


def run_nodes(probe: GroupProbe, runner: Runner, hosts: Sequence[str], timeout_s: float, port: int,
              python: str = "python3", master: str | None = None) -> tuple[GroupProbe, str]:
    """One torchrun per host (host i is the plan's node i), all at once through `runner`; rank 0's
    result comes back on its stdout."""
    if len(hosts) != probe.nodes:
        raise ValueError(f"the plan has {probe.nodes} node(s); {len(hosts)} host(s) given")
    master = master or hosts[0]
    cmds = [node_command(probe, i, master, port, python, timeout_s, h) for i, h in enumerate(hosts)]
    with ThreadPoolExecutor(max_workers=len(hosts)) as pool:
        results = list(pool.map(lambda hc: runner.run(hc[0], hc[1], timeout_s + 60), zip(hosts, cmds)))
    output = "\n".join(f"== {r.host}: {r.reason()}\n{r.stdout}{r.stderr}" for r in results)
    doc = next((ln[len(RESULT_MARKER):] for ln in results[0].stdout.splitlines() if ln.startswith(RESULT_MARKER)),
               None)
    if doc is None:
        return replace(probe, error=f"{hosts[0]}: {failure(results[0].stderr or results[0].reason())}"), output
    try:
        got = GroupProbe.from_dict(json.loads(doc), f"{hosts[0]}'s result")
    except (ValueError, Exception) as exc:   # noqa: BLE001 - a garbled line is the host's failure
        return replace(probe, error=f"{hosts[0]}: unreadable result ({exc})"), output
    return got, output


def _text(x: str | bytes | None) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else x or ""


def _result(probe: GroupProbe, path: Path | None, output: str) -> GroupProbe:
    from launcher.errors import UserError

    if path is None:
        return replace(probe, error=failure(output))
    try:
        return GroupProbe.load(path)
    except UserError as exc:
        return replace(probe, error=str(exc))
