"""Preflight levels: which deeper tests run beyond the quick probes, and how their outputs are judged.

quick     the node probes (nvidia-smi topo/query/nvlink -s, ibstat, Xids) and nccl-tests all_reduce:
          seconds per node.
standard  + `dcgmi diag -r 2` (PCIe, memory), nvbandwidth (host<->device and GPU<->GPU copy bandwidth)
          and `nvidia-smi nvlink -e` read right before and right after the node's NCCL test (error
          counters that rise under load): minutes per node.
long      + `dcgmi diag -r 3` instead of -r 2 (targeted stress and power, memory bandwidth),
          `all_to_all_perf` per node and per node pair (the measured all-to-all the EP cost uses),
          and per-NIC `ib_write_bw --use_cuda` between node pairs in rounds of disjoint pairs.

A tool a node lacks (the shell's exit status 127: command not found) is "not measured", a warning,
never a failure: a site without DCGM can still run `--level standard`. An output the parser cannot
read is a warning too: a node is drained on a judge's verdict, not on a format surprise. The judges
are checks/health_judges.py; each (node, check) becomes one CheckResult naming the GPU, link or NIC.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from checks.health_judges import (
    Finding,
    judge_dcgm_diag,
    judge_nvbandwidth,
    judge_nvlink_errors,
    judge_perftest,
)
from checks.judges import STATUS_ORDER
from checks.parsers import ParseError
from checks.parsers.dcgm_diag import parse_dcgm_diag
from checks.parsers.nvbandwidth import parse_nvbandwidth
from checks.parsers.nvlink_errors import parse_nvlink_errors
from checks.parsers.perftest import parse_perftest
from checks.probe import META_FILE, RUN_FILES, TIMEOUTS_KEY
from checks.results import CommandResult, NcclRun, PreflightResults
from launcher.formats.bwmap import BandwidthMap, CheckResult

LEVELS = ("quick", "standard", "long")
NOT_FOUND_RC = 127  # what a shell returns for a command it cannot find
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
    if rank(level) < 1:
        return {}
    out = {s.tool: s.timeout for s in (*node_steps(level), NVLINK_BEFORE)}
    if rank(level) >= 2:
        out |= {"ib_write_bw": RDMA_TIMEOUT, A2A_BINARY: nccl_timeout}
    return out | {k: v for k, v in overrides.items() if k in out}


def rank(level: str) -> int:
    return LEVELS.index(level)


def node_steps(level: str) -> list[Step]:
    """The deeper single-node tests run before the node's NCCL test, in order."""
    if rank(level) < 1:
        return []
    return [DCGM_R3 if rank(level) >= 2 else DCGM_R2, NVBANDWIDTH]


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
    result: CommandResult  # the client's output (it prints the figure)
    server_result: CommandResult | None = None


# ------------------------------------------------------------------ judging what the levels gathered

def tool_of(command: str) -> str:
    """The --tool-timeout name of a command: its program, `nvlink` for `nvidia-smi nvlink -e`."""
    words = command.split()
    tool = words[0].rsplit("/", 1)[-1] if words else "the tool"
    return "nvlink" if tool == "nvidia-smi" and "nvlink" in words else tool


def _not_measured(host: str, check: str, res: CommandResult,
                  timeouts: Mapping[str, float] = {}) -> CheckResult | None:  # noqa: B006 - read only
    if res.rc == NOT_FOUND_RC and not res.stdout.strip():
        tool = (res.command.split() or ["the tool"])[0]
        return CheckResult(host, check, "warn", None, None, f"not measured: {tool} is not installed on this node")
    if res.timed_out:
        tool = tool_of(res.command)
        limit = timeouts.get(tool) or round(res.seconds)
        return CheckResult(host, check, "warn", None, limit,
                           f"not measured: {tool} timed out after {limit:g} s -> a longer --tool-timeout "
                           f"{tool}=SECONDS if the tool is slow here; if it hangs at a generous timeout, "
                           "check the node")
    if res.error:
        return CheckResult(host, check, "warn", None, None, f"not measured: {res.reason()}")
    return None


def _parse(res: CommandResult, parse: Callable[[str], Any]) -> Any:
    cache = res.__dict__.setdefault("_parsed", {})
    key = "deep:" + getattr(parse, "__name__", "")
    if key not in cache:
        try:
            cache[key] = parse(res.stdout)
        except ParseError as exc:
            cache[key] = exc
    return cache[key]


def collapse(host: str, findings: Sequence[Finding]) -> list[CheckResult]:
    """One CheckResult per check: its worst status, naming every GPU/link/NIC that was not a pass."""
    by: dict[str, list[Finding]] = {}
    for f in findings:
        by.setdefault(f.check, []).append(f)
    out = []
    for check, fs in by.items():
        worst = max(fs, key=lambda f: STATUS_ORDER[f.status])
        bad = [f for f in fs if f.status != "pass"]
        if bad:
            msg = "; ".join(f.message if f.message.startswith(f.component) else f"{f.component}: {f.message}"
                            for f in sorted(bad, key=lambda f: -STATUS_ORDER[f.status]))
            if worst.remediation:
                msg += f" -> {worst.remediation}"
        else:
            msg = worst.message
        out.append(CheckResult(host, check, worst.status, worst.figure, worst.threshold, msg))
    return out


def _judged(host: str, check: str, res: CommandResult, parse: Callable[[str], Any],
            judge: Callable[[Any], list[Finding]], timeouts: Mapping[str, float]) -> list[CheckResult]:
    gone = _not_measured(host, check, res, timeouts)
    if gone is not None:
        return [gone]
    parsed = _parse(res, parse)
    if isinstance(parsed, ParseError):
        return [CheckResult(host, check, "warn", None, None, f"not judged: unparseable output: {parsed}")]
    return collapse(host, judge(parsed))


def deep_checks(results: PreflightResults) -> list[CheckResult]:
    """The standard and long levels' checks, for every node that ran them."""
    out: list[CheckResult] = []
    for host, probes in results.probes.items():
        if "dcgm-diag" in probes:
            out += _judged(host, "dcgm", probes["dcgm-diag"], parse_dcgm_diag,
                           partial(judge_dcgm_diag, node=host), results.tool_timeouts)
        if "nvbandwidth" in probes:
            out += _judged(host, "nvbandwidth", probes["nvbandwidth"], parse_nvbandwidth,
                           partial(judge_nvbandwidth, node=host), results.tool_timeouts)
        if "nvlink-errors-after" in probes:
            before = probes.get("nvlink-errors")
            prior = _parse(before, parse_nvlink_errors) if before is not None and before.ok else None
            prior = None if isinstance(prior, ParseError) else prior
            judged = _judged(host, "nvlink_errors", probes["nvlink-errors-after"], parse_nvlink_errors,
                             partial(judge_nvlink_errors, before=prior, node=host),
                             results.tool_timeouts)
            for c in judged:  # the judge says "nvlink"; the quick level's `nvlink -s` check has that name
                c.check = "nvlink_errors" if c.check == "nvlink" else c.check
            out += judged
    out += rdma_checks(results.rdma, results.tool_timeouts)
    out += a2a_checks(results)
    return out


def rdma_checks(runs: Sequence[RdmaRun], timeouts: Mapping[str, float] = {}) -> list[CheckResult]:  # noqa: B006
    """Per (node, NIC), the best figure over the pairs it ran in: a NIC that reaches line rate with
    some partner is sound; one slow with every partner (round 2 re-pairs suspects with good nodes) is not."""
    best: dict[tuple[str, str], tuple[float, RdmaRun, Any]] = {}
    failed: dict[tuple[str, str], RdmaRun] = {}
    for r in runs:
        parsed = _parse(r.result, parse_perftest) if r.result.ok else None
        bw = parsed.bw_avg_gbps if parsed is not None and not isinstance(parsed, ParseError) else None
        for host in (r.client, r.server):
            key = (host, r.nic)
            if bw is None:
                failed.setdefault(key, r)
            elif key not in best or bw > best[key][0]:
                best[key] = (bw, r, parsed)
    out: list[CheckResult] = []
    for (host, nic), (_bw, r, parsed) in best.items():
        fs = judge_perftest(parsed, host, link_rate_gbps=r.link_gbps)
        for f in fs:
            f.component = nic  # the NIC asked for (a capture's Device line may name another)
        out += [CheckResult(c.node, f"rdma:{nic}", c.status, c.value, c.threshold,
                            f"{c.message} (best of its pairs; GPU {r.gpu})") for c in collapse(host, fs)]
    for (host, nic), r in failed.items():
        if (host, nic) in best:
            continue
        gone = _not_measured(host, f"rdma:{nic}", r.result, timeouts)
        out.append(gone or CheckResult(host, f"rdma:{nic}", "warn", None, None,
                                       f"ib_write_bw with {r.server if host == r.client else r.client} gave no "
                                       f"figure: {r.result.reason() if not r.result.ok else 'unparseable'}"))
    return out


def a2a_checks(results: PreflightResults) -> list[CheckResult]:
    """all_to_all_perf per node and per pair: a run that failed fails; otherwise the figure is recorded."""
    from checks.parsing import parse_nccl_run

    out = []
    for run in results.nccl:
        if run.kind not in ("a2a-node", "a2a-pair"):
            continue
        check = "alltoall_node" if run.kind == "a2a-node" else "alltoall_inter"
        if run.result.rc == NOT_FOUND_RC and not run.result.stdout.strip():
            out += [CheckResult(h, check, "warn", None, None, f"not measured: {A2A_BINARY} is not installed")
                    for h in run.hosts]
            continue
        t, why = parse_nccl_run(run.result, "alltoall")
        where = "+".join(run.hosts)
        if t is None or t.failed:
            out += [CheckResult(h, check, "fail", None, None, f"{where}: {why or '; '.join(t.errors[:3] if t else [])}")
                    for h in run.hosts]
        else:
            out += [CheckResult(h, check, "pass", t.busbw_at_max_size, None,
                                f"{where}: all-to-all busbw {t.busbw_at_max_size} GB/s") for h in run.hosts]
    return out


def record_figures(bw: BandwidthMap, results: PreflightResults) -> None:
    """Put the measured all-to-all and per-NIC RDMA figures into the map (healthy nodes' medians)."""
    from checks.parsing import parse_nccl_run

    bw.level = results.level
    node_a2a, pair_a2a = [], []
    for run in results.nccl:
        if run.kind not in ("a2a-node", "a2a-pair"):
            continue
        t, _ = parse_nccl_run(run.result, "alltoall")
        fig = t.busbw_at_max_size if t is not None and not t.failed else None
        if not fig or any(h in bw.exclude for h in run.hosts):
            continue
        if run.kind == "a2a-node" and run.hosts[0] in bw.nodes:
            bw.nodes[run.hosts[0]].alltoall_busbw_gbs = fig
            node_a2a.append(fig)
        elif run.kind == "a2a-pair":
            pair_a2a.append(fig)
    bw.alltoall_intra_busbw_gbs = round(statistics.median(node_a2a), 2) if node_a2a else None
    bw.alltoall_inter_busbw_gbs = round(statistics.median(pair_a2a), 2) if pair_a2a else None
    for c in bw.checks:
        if c.check.startswith("rdma:") and c.node in bw.nodes and isinstance(c.value, (int, float)):
            bw.nodes[c.node].rdma_gbps[c.check.split(":", 1)[1]] = c.value


# ------------------------------------------------------------------ raw outputs (--save-raw / import)

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
            res.nccl.append(NcclRun("a2a-node", [host], "alltoall", CommandResult(
                host, m.get("command", f"(from {f})"), read_text(f, "all_to_all_perf output", errors="replace"),
                m.get("stderr", ""), m.get("rc", 0), bool(m.get("timed_out")), m.get("error"))))
    for f in sorted((root / A2A_PAIRS_DIR).glob("*.txt")) if (root / A2A_PAIRS_DIR).is_dir() else []:
        hosts = f.stem.split("+")
        if len(hosts) == 2:
            res.nccl.append(NcclRun("a2a-pair", hosts, "alltoall",
                                    CommandResult(hosts[0], f"(from {f})", read_text(f, "all_to_all_perf output",
                                                                                      errors="replace"), "", 0)))
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
                                        e.get("link_gbps"), CommandResult(str(e["client"]), str(e.get("command", "")),
                                                                          out, "", e.get("rc", 0))))
            except (KeyError, TypeError, OSError):
                continue
    if res.rdma or any(r.kind.startswith("a2a") for r in res.nccl):
        res.level = "long"
    elif any("dcgm-diag" in p or "nvbandwidth" in p or "nvlink-errors-after" in p for p in res.probes.values()):
        res.level = "standard"
