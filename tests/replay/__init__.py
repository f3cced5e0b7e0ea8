"""Replay executables for preflight tests, and the per-node settings that drive them.

`install(node_dir, ...)` links nvidia-smi, all_reduce_perf, mpirun, ibstat and dmesg from this
folder into node_dir/bin (a node's PATH, see tests/services/sshd.py) and writes node_dir/replay.env;
dcgmi, nvbandwidth, ib_write_bw and all_to_all_perf (the deeper levels' tools) only when their
setting is given, so a node without it lacks the tool as a real one would.
Values naming real captures are paths relative to the shared fixtures folder, read by the scripts
at run time (REPLAY_FIXTURES); absolute paths name files a test wrote itself (constructed.py).
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

REPLAY_DIR = Path(__file__).resolve().parent
TOOLS = ("nvidia-smi", "all_reduce_perf", "mpirun", "ibstat", "dmesg")
#: Tools a node has only when their setting is given (the deeper levels' tools; a node without
#: the setting lacks the tool, as a node without DCGM lacks dcgmi): tool -> the key that installs it.
OPTIONAL_TOOLS = {"dcgmi": "DCGM", "nvbandwidth": "NVBW", "ib_write_bw": "RDMA", "all_to_all_perf": "A2A_NODE"}
KEYS = ("TOPO", "GPU_QUERY", "NVLINK", "IBSTAT", "DMESG", "NCCL_NODE", "NCCL_PAIR", "NCCL_ALL",
        "NCCL_PAIR_OVERRIDE", "NCCL_ALL_OVERRIDE", "NCCL_HANG", "REPLAY_DELAY", "SMI_DELAY",
        "NVLINK_ERR", "NVLINK_ERR_AFTER", "DCGM", "DCGM_R3", "DCGM_DELAY", "NVBW", "A2A_NODE", "A2A_PAIR",
        "RDMA", "RDMA_SERVER", "RDMA_BAD", "RDMA_BAD_NIC")


def install(node_dir: Path, cluster_dir: Path, fixtures: Path, **settings: str | Path | None) -> None:
    """Put the replay tools on node_dir/bin and write node_dir/replay.env from `settings`."""
    unknown = set(settings) - set(KEYS)
    if unknown:
        raise ValueError(f"unknown replay settings: {sorted(unknown)}")
    bin_dir = node_dir / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for tool in (*TOOLS, *OPTIONAL_TOOLS):
        link = bin_dir / tool
        if link.is_symlink() or link.exists():
            link.unlink()
        if tool in TOOLS or settings.get(OPTIONAL_TOOLS[tool]) is not None:
            os.symlink(REPLAY_DIR / tool, link)
    (node_dir / "nvlink-e.count").unlink(missing_ok=True)
    env = {"REPLAY_FIXTURES": str(fixtures), "REPLAY_CLUSTER": str(cluster_dir)}
    env.update({k: str(v) for k, v in settings.items() if v is not None})
    (node_dir / "replay.env").write_text("".join(f"{k}={shlex.quote(v)}\n" for k, v in env.items()))


def install_dispatch(bin_dir: Path, cluster_dir: Path) -> Path:
    """One PATH for the Slurm test nodes, which share this machine and the submitter's PATH: each tool
    runs the replay of the node the step landed on (cluster_dir/$SLURMD_NODENAME/bin/TOOL, installed
    there by `install`), and is "command not found" (exit 127) where that node lacks it."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for tool in (*TOOLS, *OPTIONAL_TOOLS):
        f = bin_dir / tool
        f.write_text(f'#!/bin/sh\nt={shlex.quote(str(cluster_dir))}/"${{SLURMD_NODENAME:-?}}/bin/${{0##*/}}"\n'
                     '[ -x "$t" ] || { echo "${0##*/}: command not found" >&2; exit 127; }\nexec "$t" "$@"\n')
        f.chmod(0o755)
    return bin_dir
