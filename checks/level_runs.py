"""The deeper levels' raw outputs in the folder layout checks/folder.py reads and writes (--save-raw,
`launch preflight import`, the Slurm preflight job): DIR/<host>/alltoall-node.txt,
DIR/alltoall-pairs/<a>+<b>.txt, DIR/rdma/<client>+<server>+<nic>~<i>.txt with DIR/rdma/runs.json, and
each tool's timeout in DIR/<host>/probe.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from checks.levels import TOOLS, RdmaRun
from checks.probe import META_FILE, RUN_FILES, TIMEOUTS_KEY
from checks.results import NcclRun, PreflightResults
from launcher.transport import Completed

A2A_NODE_FILE = RUN_FILES["a2a-node"]
A2A_PAIRS_DIR = "alltoall-pairs"
RDMA_DIR = "rdma"
RDMA_INDEX = "runs.json"


def save_runs(results: PreflightResults, root: Path) -> None:
    """The long level's runs in the layout `load_runs` reads: DIR/<host>/alltoall-node.txt,
    DIR/alltoall-pairs/<a>+<b>.txt, DIR/rdma/<client>+<server>+<nic>.txt with DIR/rdma/runs.json."""
    from launcher.formats.files import atomic_write, make_dirs

    for run in results.nccl:
        if run.kind == "a2a-node":
            make_dirs(root / run.hosts[0], "preflight output directory")
            atomic_write(root / run.hosts[0] / A2A_NODE_FILE, run.result.stdout, "preflight output", durable=False)
        elif run.kind == "a2a-pair":
            make_dirs(root / A2A_PAIRS_DIR, "preflight output directory")
            atomic_write(root / A2A_PAIRS_DIR / f"{'+'.join(run.hosts)}.txt", run.result.stdout, "preflight output",
                         durable=False)
    if results.tool_timeouts:
        for host in results.probes:
            meta = _meta(root / host)
            if meta:
                meta[TIMEOUTS_KEY] = results.tool_timeouts
                atomic_write(root / host / META_FILE, json.dumps(meta, indent=2) + "\n", "probe metadata",
                             durable=False)
    if not results.rdma:
        return
    make_dirs(root / RDMA_DIR, "preflight output directory")
    index = []
    for i, r in enumerate(results.rdma):
        name = f"{r.client}+{r.server}+{r.nic}~{i}.txt"
        atomic_write(root / RDMA_DIR / name, r.result.stdout, "preflight output", durable=False)
        index.append({"file": name, "client": r.client, "server": r.server, "nic": r.nic, "gpu": r.gpu,
                      "link_gbps": r.link_gbps, "command": r.result.command, "rc": r.result.rc})
    atomic_write(root / RDMA_DIR / RDMA_INDEX, json.dumps(index, indent=2) + "\n", "preflight output", durable=False)


def _meta(host_dir: Path) -> dict[str, Any]:
    from launcher.formats.files import read_text

    try:
        meta = json.loads(read_text(host_dir / META_FILE, "probe metadata")) if (host_dir / META_FILE).is_file() else {}
    except json.JSONDecodeError:
        return {}
    return meta if isinstance(meta, dict) else {}


def load_runs(root: Path, res: PreflightResults) -> None:
    """Read back what `save_runs` wrote, and set the level the outputs show."""
    from launcher.formats.files import read_text

    for host in res.hosts:
        limits = _meta(root / host).get(TIMEOUTS_KEY)
        if isinstance(limits, dict):
            res.tool_timeouts |= {k: v for k, v in limits.items() if k in TOOLS and isinstance(v, (int, float))}
        f = root / host / A2A_NODE_FILE
        if f.is_file():
            m = _meta(root / host).get("a2a-node")  # written by `python -m checks.probe --level long`
            m = m if isinstance(m, dict) else {}
            res.nccl.append(NcclRun("a2a-node", [host], "alltoall", Completed(
                m.get("rc", 0), read_text(f, "all_to_all_perf output", errors="replace"), m.get("stderr", ""),
                bool(m.get("timed_out")), host=host, command=m.get("command", f"(from {f})"), error=m.get("error"))))
    for f in sorted((root / A2A_PAIRS_DIR).glob("*.txt")) if (root / A2A_PAIRS_DIR).is_dir() else []:
        hosts = f.stem.split("+")
        if len(hosts) == 2:
            res.nccl.append(NcclRun("a2a-pair", hosts, "alltoall",
                                    Completed(0, read_text(f, "all_to_all_perf output", errors="replace"),
                                              host=hosts[0], command=f"(from {f})")))
    idx = root / RDMA_DIR / RDMA_INDEX
    if idx.is_file():
        try:
            entries = json.loads(read_text(idx, "RDMA run index"))
        except json.JSONDecodeError:
            entries = []
        for e in entries if isinstance(entries, list) else []:
            try:
                f = root / RDMA_DIR / Path(str(e["file"])).name
                out = read_text(f, "ib_write_bw output", errors="replace")
                res.rdma.append(RdmaRun(str(e["client"]), str(e["server"]), str(e["nic"]), e.get("gpu"),
                                        e.get("link_gbps"), Completed(e.get("rc", 0), out, host=str(e["client"]),
                                                                      command=str(e.get("command", "")))))
            except (KeyError, TypeError, OSError):
                continue
    if res.rdma or any(r.kind.startswith("a2a") for r in res.nccl):
        res.level = "long"
    elif any("dcgm-diag" in p or "nvbandwidth" in p or "nvlink-errors-after" in p for p in res.probes.values()):
        res.level = "standard"
