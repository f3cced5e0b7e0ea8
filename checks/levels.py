"""Preflight levels: which deeper tests run beyond the quick probes, on which tool's timeout.

quick     the node probes (nvidia-smi topo/query/nvlink -s, ibstat, Xids) and nccl-tests all_reduce:
          seconds per node.
standard  + `dcgmi diag -r 2` (PCIe, memory), nvbandwidth (host<->device and GPU<->GPU copy bandwidth)
          and `nvidia-smi nvlink -e` read right before and right after the node's NCCL test (error
          counters that rise under load): minutes per node.
long      + `dcgmi diag -r 3` instead of -r 2 (targeted stress and power, memory bandwidth),
          `all_to_all_perf` per node and per node pair (the measured all-to-all the EP cost uses),
          and per-NIC `ib_write_bw --use_cuda` between node pairs in rounds of disjoint pairs.

What they gathered is judged in checks/judges/deep.py and saved in the folder layout by
checks/folder.py; this module only says what runs (the orchestrator and `python -m checks.probe`
read it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from launcher.transport import Completed

LEVELS = ("quick", "standard", "long")
NVB_TESTS = "host_to_device_memcpy_ce device_to_host_memcpy_ce device_to_device_memcpy_read_ce"
A2A_BINARY = "all_to_all_perf"


@dataclass(frozen=True)
class Step:
    """One deeper test on one node: its name (its raw-output file is probe.EXTRA_FILES[name]), command,
    the tool a --tool-timeout names, and that tool's default timeout at this step's level."""

    name: str
    command: str
    tool: str
    timeout: float

    def within(self, timeouts: Mapping[str, float]) -> float:
        return timeouts.get(self.tool, self.timeout)


# Default timeouts, seconds. DCGM's guide gives "a few minutes" for -r 2 and up to 30 minutes for -r 3
# (longer on 8-GPU nodes under power stress); nvbandwidth's copy tests take minutes on 8 GPUs; one
# ib_write_bw run lasts its -D seconds plus connection setup. all_to_all_perf has --nccl-timeout's default.
NVLINK_BEFORE = Step("nvlink-errors", "nvidia-smi nvlink -e", "nvlink", 60)
NVLINK_AFTER = Step("nvlink-errors-after", "nvidia-smi nvlink -e", "nvlink", 60)
DCGM_R2 = Step("dcgm-diag", "dcgmi diag -r 2", "dcgmi", 900)
DCGM_R3 = Step("dcgm-diag", "dcgmi diag -r 3", "dcgmi", 3600)
NVBANDWIDTH = Step("nvbandwidth", f"nvbandwidth -t {NVB_TESTS}", "nvbandwidth", 900)
RDMA_TIMEOUT = 120.0
#: The tools whose timeout `--tool-timeout TOOL=SECONDS` sets.
TOOLS = ("dcgmi", "nvbandwidth", "nvlink", "ib_write_bw", A2A_BINARY)


def parse_tool_timeouts(specs: Sequence[str]) -> dict[str, float]:
    """`TOOL=SECONDS` items -> {tool: seconds}; ValueError naming the bad item and what is valid."""
    out: dict[str, float] = {}
    for spec in specs:
        tool, sep, secs = spec.partition("=")
        tool = tool.strip()
        try:
            value = float(secs) if sep else -1.0
        except ValueError:
            value = -1.0
        if tool not in TOOLS or not value > 0 or value != value or value == float("inf"):
            raise ValueError(f"{spec!r}: expected TOOL=SECONDS with SECONDS > 0 and TOOL one of {', '.join(TOOLS)}")
        out[tool] = value
    return out


def effective_timeouts(level: str, nccl_timeout: float, overrides: Mapping[str, float]) -> dict[str, float]:
    """Every deeper tool's timeout at this level: the defaults, then what the user set."""
    if depth(level) < 1:
        return {}
    out = {s.tool: s.timeout for s in (*node_steps(level), NVLINK_BEFORE)}
    if depth(level) >= 2:
        out |= {"ib_write_bw": RDMA_TIMEOUT, A2A_BINARY: nccl_timeout}
    return out | {k: v for k, v in overrides.items() if k in out}


def depth(level: str) -> int:
    """How deep a level goes: 0 quick, 1 standard, 2 long."""
    return LEVELS.index(level)


def node_steps(level: str) -> list[Step]:
    """The deeper single-node tests run before the node's NCCL test, in order."""
    if depth(level) < 1:
        return []
    return [DCGM_R3 if depth(level) >= 2 else DCGM_R2, NVBANDWIDTH]


def rdma_command(nic: str, gpu: int | None, port: int, server: str | None = None, seconds: int = 5) -> str:
    """perftest's write bandwidth on one NIC, GPU memory when `gpu` is given; the client names `server`."""
    cuda = f" --use_cuda={gpu}" if gpu is not None else ""
    return (f"ib_write_bw -d {nic}{cuda} -F --report_gbits -D {seconds} -p {port}"
            + (f" {server}" if server else ""))


@dataclass
class RdmaRun:
    client: str
    server: str
    nic: str
    gpu: int | None
    link_gbps: float | None
    result: Completed  # the client's output (it prints the figure)
    server_result: Completed | None = None


def tool_of(command: str) -> str:
    """The --tool-timeout name of a command: its program, `nvlink` for `nvidia-smi nvlink -e`."""
    words = command.split()
    tool = words[0].rsplit("/", 1)[-1] if words else "the tool"
    return "nvlink" if tool == "nvidia-smi" and "nvlink" in words else tool
