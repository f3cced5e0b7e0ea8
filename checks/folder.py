"""The folder layout of gathered preflight outputs, written and read back (`launch preflight import`,
`--save-raw`, and the Slurm preflight job, which writes it on the cluster):

    DIR/<host>/topo.txt gpu-query.csv ... nccl-node.txt probe-meta.json   one folder per node (checks/probe.py)
    DIR/pairs/<a>+<b>.txt          nccl-tests over a node pair (<a>+<b>~<i>.txt: the same pair again)
    DIR/all/all.txt                nccl-tests over every node
    DIR/unreachable.json           hosts that could not be reached, and why
    plus the deeper levels' outputs (checks/level_runs.py: load_runs / save_runs)
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from checks.level_runs import load_runs, save_runs
from checks.parsed import hosts_in
from checks.probe import EXTRA_FILES, META_FILE, NCCL_NODE_FILE, PROBES, Probe
from checks.results import NcclRun, PreflightResults
from launcher.transport import Completed

UNREACHABLE_FILE = "unreachable.json"
BWMAP_FILE = "bwmap.json"  # where the Slurm preflight job leaves its BandwidthMap


def load_dir(path: str | Path) -> PreflightResults:
    """Read DIR/<host>/{topo.txt,gpu-query.csv,...,nccl-node.txt} and DIR/pairs/*.txt, DIR/all/*.txt.

    A pair file named `<a>+<b>.txt` after two host folders is that pair; otherwise the hosts are
    read from the nccl-tests `# Rank ... on <host>` lines.
    """
    from launcher.formats.files import read_text  # bounded: a probe file may be anything

    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: not a folder")
    res = PreflightResults(hosts=[])
    files = {p.file: p for p in PROBES} | {f: Probe(k, f, "") for k, f in EXTRA_FILES.items()}
    for d in sorted(root.iterdir()):
        if not d.is_dir() or d.name in ("pairs", "all"):
            continue
        present = [f for f in files if (d / f).exists()] + ([NCCL_NODE_FILE] if (d / NCCL_NODE_FILE).exists() else [])
        if not present:
            continue
        host = d.name
        res.hosts.append(host)
        meta = _probe_meta(d / META_FILE) if (d / META_FILE).exists() else {}
        probes: dict[str, Completed] = {}
        for fname, probe in files.items():
            if (d / fname).exists():
                m = meta.get(probe.name, {})
                out = read_text(d / fname, "probe output", errors="replace")
                probes[probe.name] = Completed(m.get("rc", 0), out, m.get("stderr", ""), bool(m.get("timed_out")), host=host,
                                               command=m.get("command", probe.command), error=m.get("error"))
        res.probes[host] = probes
        if (d / NCCL_NODE_FILE).exists():
            m = meta.get("nccl-node", {})
            r = Completed(m.get("rc", 0), read_text(d / NCCL_NODE_FILE, "nccl-tests output", errors="replace"), "",
                          bool(m.get("timed_out")), host=host, command=m.get("command", f"(from {d / NCCL_NODE_FILE})"))
            res.nccl.append(NcclRun("node", [host], "all_reduce", r))
            res.commands.append(f"[{host}] {r.command}")
    if (root / UNREACHABLE_FILE).exists():
        try:
            gone = json.loads(read_text(root / UNREACHABLE_FILE, "unreachable-hosts file"))
        except json.JSONDecodeError:
            gone = {}
        for host, why in gone.items() if isinstance(gone, dict) else []:
            if host not in res.hosts:
                res.hosts.append(host)
                res.unreachable[host] = str(why)
    for kind in ("pairs", "all"):
        for f in sorted((root / kind).glob("*.txt")) if (root / kind).is_dir() else []:
            text = read_text(f, "nccl-tests output", errors="replace")
            named = [h for h in re.split(r"[+]", f.stem.split("~")[0]) if h]
            hosts = named if named and all(h in res.hosts for h in named) else (hosts_in(text) or named)
            if kind == "pairs" and len(hosts) != 2:
                continue
            r = Completed(0, text, host=hosts[0], command=f"(from {f})")
            res.nccl.append(NcclRun("pair" if kind == "pairs" else "all", hosts, "all_reduce", r))
    load_runs(root, res)
    return res


#: probe-meta.json: per probe, what ran and how it ended (checks/probe.py `save` writes it)
#: (rc null: the tool timed out or never ran)
META_TYPES: dict[str, tuple[type, ...]] = {"command": (str,), "stderr": (str,), "rc": (int, type(None)),
                                           "timed_out": (bool,), "error": (str, type(None))}


def _probe_meta(path: Path) -> dict[str, dict[str, Any]]:
    """probe-meta.json, each value of the shape `save` writes, or one UserError naming the file and field
    (a hand-made or damaged file was a traceback)."""
    from launcher.errors import UserError
    from launcher.formats.files import read_text

    try:
        meta = json.loads(read_text(path, "probe metadata"))
    except (json.JSONDecodeError, RecursionError):
        raise UserError(f"{path}: not JSON (probe metadata)") from None
    if not isinstance(meta, dict):
        raise UserError(f"{path}: expected a JSON object of probe name -> metadata, not {type(meta).__name__}")
    for probe, m in meta.items():
        if not isinstance(m, dict):
            raise UserError(f"{path}: {probe}: expected a JSON object, not {type(m).__name__}")
        for key, value in m.items():
            want = META_TYPES.get(key)
            if want is not None and (not isinstance(value, want) or (int in want and isinstance(value, bool))):
                raise UserError(f"{path}: {probe}.{key}: {value!r:.60} is not "
                                f"{' or '.join('null' if t is type(None) else t.__name__ for t in want)}")
    return meta


def save_dir(results: PreflightResults, path: str | Path) -> Path:
    """Write what a preflight gathered in the layout `load_dir` reads, to judge it again later."""
    from checks.probe import save
    from launcher.formats.files import atomic_write, make_dirs

    root = Path(path)
    make_dirs(root, "preflight output directory")
    node_runs = {r.hosts[0]: r.result for r in results.nccl if r.kind == "node"}
    for host, probes in results.probes.items():
        outs = dict(probes)
        if host in node_runs:
            outs["nccl-node"] = node_runs[host]
        save(root, host, outs)
    if results.unreachable:
        atomic_write(root / UNREACHABLE_FILE, json.dumps(results.unreachable, indent=2) + "\n", "preflight output", durable=False)
    for kind, sub in (("pair", "pairs"), ("all", "all")):
        runs = [r for r in results.nccl if r.kind == kind]
        if runs:
            make_dirs(root / sub, "preflight output directory")
        for i, r in enumerate(runs):
            name = "+".join(r.hosts) if kind == "pair" else "all"
            f = root / sub / f"{name}.txt"
            if f.exists():
                f = root / sub / f"{name}~{i}.txt"  # the same pair again (a retry in round 2)
            atomic_write(f, r.result.stdout + (f"\n{r.result.stderr}" if r.result.stderr else ""), "preflight output", durable=False)
    save_runs(results, root)
    return root
