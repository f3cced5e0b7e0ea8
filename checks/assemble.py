"""Build the BandwidthMap from what preflight gathered: parse every output, judge every check.

Input is a PreflightResults (from orchestrate, or from `load_dir` for outputs gathered by other
means); output is the BandwidthMap the planner reads, with one CheckResult per node and check,
the pair bandwidths and the nodes to exclude. Checks (names are stable, tests and users rely on
them): reachable, gpu_count, gpu_model, driver, topology, nvlink, ecc, xid, pcie, clocks, ib,
nccl_node, nccl_inter, nccl_all (node "*").
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from checks.bwmap import BandwidthMap, CheckResult, NodeReport, PairReport
from checks.health_judges import judge_xid
from checks.judges import (
    BENIGN_CLOCK_REASONS,
    STATUS_ORDER,
    JudgeConfig,
    at_least,
    merge,
    mode,
    outliers,
    worst,
)
from checks.levels import deep_checks, load_runs, record_figures, save_runs
from checks.parsers import ParseError
from checks.parsers.gpu_query import GpuQuery, parse_gpu_query
from checks.parsers.ibstat import IbStatus, parse_ibstat
from checks.parsers.nccl_tests import NcclTestResult, parse_nccl_tests
from checks.parsers.nvlink import NvlinkStatus, parse_nvlink_status
from checks.parsers.topo import Topology, parse_topo
from checks.parsers.xid import XidLog, parse_xid
from checks.probe import EXTRA_FILES, META_FILE, NCCL_NODE_FILE, PROBES, Probe
from checks.results import CommandResult, NcclRun, PreflightResults

CLUSTER = "*"
UNREACHABLE_FILE = "unreachable.json"


@dataclass
class NodeData:
    host: str
    topo: Topology | None = None
    gpu: GpuQuery | None = None
    nvlink: NvlinkStatus | None = None
    ib: IbStatus | None = None
    xid: XidLog | None = None
    nccl: NcclTestResult | None = None
    problems: dict[str, CheckResult] = field(default_factory=dict)  # probe-level failures by check

    @property
    def gpu_count(self) -> int | None:
        if self.gpu is not None:
            return self.gpu.count
        return self.topo.gpu_count if self.topo is not None else None

    @property
    def model(self) -> str | None:
        if self.gpu is not None and self.gpu.gpus:
            return self.gpu.gpus[0].name
        if self.nccl is not None and self.nccl.ranks:
            return self.nccl.ranks[0].gpu or None
        return None


PROBE_CHECK = {"topo": "topology", "gpu-query": "gpu_count", "nvlink": "nvlink", "ibstat": "ib", "xid": "xid"}
PARSERS = {"topo": parse_topo, "gpu-query": parse_gpu_query, "nvlink": parse_nvlink_status,
           "ibstat": parse_ibstat, "xid": parse_xid}
ATTR = {"topo": "topo", "gpu-query": "gpu", "nvlink": "nvlink", "ibstat": "ib", "xid": "xid"}


def _cached(res: CommandResult, key: str, fn: Any) -> Any:
    """Parse each output once, however often it is judged (orchestrate judges between phases)."""
    cache = res.__dict__.setdefault("_parsed", {})
    if key not in cache:
        cache[key] = fn()
    return cache[key]


def parse_nccl_run(res: CommandResult, collective: str) -> tuple[NcclTestResult | None, str | None]:
    """The parsed test, or None and why not (died, hung, unparseable)."""
    return _cached(res, "nccl:" + collective, lambda: _parse_nccl_run(res, collective))


def _parse_nccl_run(res: CommandResult, collective: str) -> tuple[NcclTestResult | None, str | None]:
    if res.error:
        return None, res.error
    try:
        t = parse_nccl_tests(res.stdout, collective)
    except ParseError as exc:
        why = res.reason() if not res.ok else f"unparseable output: {exc}"
        return None, why
    if res.timed_out:
        t.errors.append(f"timed out after {res.seconds:.0f}s")
    elif res.rc not in (0, None):
        t.errors.append(f"exit status {res.rc}")
    return t, None


def _node_data(host: str, probes: dict[str, CommandResult]) -> NodeData:
    nd = NodeData(host)
    files = {p.name: p.file for p in PROBES}
    for kind in PARSERS:
        if kind not in probes:  # no output at all (an imported folder without that file): not measured,
            check = PROBE_CHECK[kind]  # which is no fault of the node
            nd.problems[check] = CheckResult(host, check, "warn", None, None,
                                             f"not measured (no {files.get(kind, kind)} for this node)")
    for kind, res in probes.items():
        if kind not in PARSERS:
            continue
        check = PROBE_CHECK[kind]
        if kind == "ibstat" and not res.ok and not res.stdout.strip():
            nd.problems[check] = CheckResult(host, check, "warn", None, None,
                                             f"ibstat/ibv_devinfo gave nothing ({res.reason()}); no InfiniBand?")
            continue
        if kind == "xid" and not res.ok and not res.stdout.strip():
            # no permission to read the kernel log is not a node fault, but nothing was checked either
            nd.problems[check] = CheckResult(host, check, "warn", None, None,
                                             f"XIDs not checked: {res.reason()}")
            continue
        if not res.ok:
            nd.problems[check] = CheckResult(host, check, "fail", None, None,
                                             f"`{res.command.split(' 2>')[0][:60]}` failed: {res.reason()}")
            continue
        def parse(kind: str = kind, res: CommandResult = res) -> Any:
            try:
                return PARSERS[kind](res.stdout)
            except ParseError as exc:
                return exc

        parsed = _cached(res, kind, parse)
        if isinstance(parsed, ParseError):
            nd.problems[check] = CheckResult(host, check, "fail", None, None, f"unparseable output: {parsed}")
        else:
            setattr(nd, ATTR[kind], parsed)
    return nd


def assemble(results: PreflightResults, config: JudgeConfig | None = None) -> BandwidthMap:
    cfg = config or JudgeConfig()
    checks: list[CheckResult] = []
    nodes: dict[str, NodeReport] = {}
    data: dict[str, NodeData] = {}

    for host in results.hosts:
        if host in results.unreachable:
            checks.append(CheckResult(host, "reachable", "fail", None, None, results.unreachable[host]))
            nodes[host] = NodeReport(host=host, status="fail")
            continue
        checks.append(CheckResult(host, "reachable", "pass", None, None, "ok"))
        data[host] = _node_data(host, results.probes.get(host, {}))

    node_runs = {r.hosts[0]: r for r in results.nccl if r.kind == "node"}
    for host, nd in data.items():
        run = node_runs.get(host)
        if run is not None:
            t, why = parse_nccl_run(run.result, run.collective)
            nd.nccl = t
            if t is None:
                nd.problems["nccl_node"] = CheckResult(host, "nccl_node", "fail", None, None, why or "")

    checks += _hardware_checks(data, cfg)
    checks += _intra_checks(data, cfg)
    pair_reports, pair_checks = _pair_checks(results, data, cfg)
    checks += pair_checks
    checks += deep_checks(results)

    for host, nd in data.items():
        topo = nd.topo
        nodes[host] = NodeReport(
            host=host, gpus=nd.gpu_count or 0, gpu_model=nd.model,
            driver=nd.gpu.gpus[0].driver if nd.gpu and nd.gpu.gpus else None,
            links=topo.links if topo else {}, nvlink_groups=topo.nvlink_groups if topo else [],
            gpu_nic=topo.nearest_nic if topo else {},
            intra_busbw_gbs=nd.nccl.busbw_at_max_size if nd.nccl and not nd.nccl.failed else None,
        )
    nodes = {h: nodes[h] for h in results.hosts if h in nodes}  # in the order the hosts were given
    for c in checks:
        if c.node in nodes:
            nodes[c.node].status = worst(nodes[c.node].status, c.status)
    exclude = [h for h, n in nodes.items() if n.status == "fail"]

    all_busbw = None
    for run in (r for r in results.nccl if r.kind == "all"):
        t, why = parse_nccl_run(run.result, run.collective)
        hosts = ",".join(run.hosts)
        if t is None or t.failed:
            checks.append(CheckResult(CLUSTER, "nccl_all", "fail", None, None,
                                      f"all-node run over {hosts}: {why or '; '.join(t.errors[:3])}"))
            continue
        all_busbw = t.busbw_at_max_size
        c = at_least(CLUSTER, "nccl_all", all_busbw or 0.0, cfg.min_all_busbw_gbs, cfg.warn_margin)
        c.message = f"all {len(run.hosts)} nodes: {c.message}"
        checks.append(c)

    intra = [n.intra_busbw_gbs for h, n in nodes.items() if h not in exclude and n.intra_busbw_gbs]
    inter = [p.busbw_gbs for p in pair_reports if p.a not in exclude and p.b not in exclude and p.busbw_gbs > 0]
    bw = BandwidthMap(
        nodes=nodes, pairs=sorted(pair_reports, key=lambda p: p.busbw_gbs), checks=checks,
        intra_node_busbw_gbs=round(statistics.median(intra), 2) if intra else None,
        inter_node_busbw_gbs=round(statistics.median(inter), 2) if inter else None,
        all_nodes_busbw_gbs=all_busbw, exclude=exclude, commands=list(results.commands),
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )
    record_figures(bw, results)
    return bw


def _hardware_checks(data: dict[str, NodeData], cfg: JudgeConfig) -> list[CheckResult]:
    out: list[CheckResult] = []
    counts = {h: nd.gpu_count for h, nd in data.items() if nd.gpu_count is not None}
    # the count most nodes have; on a tie the larger one (a node is more often missing a GPU than gaining one)
    tally = {c: list(counts.values()).count(c) for c in set(counts.values())}
    expected = cfg.expected_gpus or (max(tally, key=lambda c: (tally[c], c)) if tally else None)
    models = {h: nd.model for h, nd in data.items() if nd.model}
    common_model = mode(list(models.values()))
    drivers = {h: nd.gpu.gpus[0].driver for h, nd in data.items() if nd.gpu and nd.gpu.gpus}
    common_driver = mode(list(drivers.values()))
    sigs = {h: nd.topo.signature() for h, nd in data.items() if nd.topo}
    common_sig = mode(list(sigs.values()))
    active_counts = [g.active for nd in data.values() if nd.nvlink for g in nd.nvlink.gpus if g.links]
    common_active = max(active_counts) if active_counts else 0
    ib_best: dict[str, float] = {}
    ib_active_anywhere: set[tuple[str, int]] = set()
    for nd in data.values():
        for p in nd.ib.ports if nd.ib else []:
            if p.active:
                ib_active_anywhere.add((p.ca, p.port))
                ib_best[p.ca] = max(ib_best.get(p.ca, 0.0), p.rate_gbps or 0.0)

    for h, nd in data.items():
        def add(check: str, status: str, value: Any, threshold: Any, msg: str, h: str = h,
                nd: NodeData = nd) -> None:
            out.append(nd.problems.pop(check, None) or CheckResult(h, check, status, value, threshold, msg))

        # gpu_count
        n = nd.gpu_count
        if "gpu_count" not in nd.problems and n is not None:
            src = "expected" if cfg.expected_gpus else "as on most nodes"
            if expected is not None and n < expected:
                add("gpu_count", "fail", n, expected, f"{n} GPUs, {expected} {src}")
            elif expected is not None and n > expected:
                add("gpu_count", "warn", n, expected, f"{n} GPUs, more than the {expected} {src}")
            else:
                add("gpu_count", "pass", n, expected, f"{n} GPUs")
        elif "gpu_count" in nd.problems:
            add("gpu_count", "fail", None, expected, "")
        # gpu_model / driver
        if nd.gpu and nd.gpu.gpus:
            names = {g.name for g in nd.gpu.gpus}
            if len(names) > 1:
                add("gpu_model", "fail", sorted(names), common_model, f"mixed GPU models: {', '.join(sorted(names))}")
            elif nd.model != common_model:
                add("gpu_model", "fail", nd.model, common_model, f"{nd.model}, most nodes have {common_model}")
            else:
                add("gpu_model", "pass", nd.model, common_model, str(nd.model))
            drv = drivers.get(h)
            if drv != common_driver:
                add("driver", "warn", drv, common_driver, f"driver {drv}, most nodes run {common_driver}")
            else:
                add("driver", "pass", drv, common_driver, f"driver {drv}")
        # topology
        if "topology" in nd.problems:
            add("topology", "fail", None, None, "")
        elif nd.topo:
            groups = nd.topo.nvlink_groups
            desc = f"{nd.topo.gpu_count} GPUs, NVLink groups {groups}" if groups else f"{nd.topo.gpu_count} GPUs, no NVLink"
            if len(sigs) > 1 and sigs[h] != common_sig:
                add("topology", "warn", desc, None, f"link matrix differs from most nodes ({desc})")
            else:
                add("topology", "pass", desc, None, desc)
        # nvlink
        if "nvlink" in nd.problems:
            add("nvlink", "fail", None, None, "")
        else:
            out.extend(_nvlink_check(h, nd, common_active))
        # ecc, pcie, clocks
        if nd.gpu and nd.gpu.gpus:
            out.extend(_gpu_health(h, nd.gpu, cfg))
        # xid
        if "xid" in nd.problems:
            add("xid", "fail", None, None, "")
        elif nd.xid is not None:
            # NVIDIA's Xid catalog: hardware Xids (and a GPU lost without one) fail, application ones warn
            found = [f for f in judge_xid(nd.xid, h) if f.status != "pass"]
            if found:
                add("xid", worst(*(f.status for f in found)), sorted({f.figure for f in found if isinstance(f.figure, int)}),
                    [], "; ".join(f"{f.component}: {f.message}" for f in found))
            else:
                add("xid", "pass", [], [], "no XID events")
        # ib
        if "ib" in nd.problems:
            add("ib", nd.problems["ib"].status, None, None, "")
        elif nd.ib is not None:
            out.append(_ib_check(h, nd.ib, cfg, ib_best, ib_active_anywhere))
        for c in list(nd.problems.values()):
            if c.check not in ("nccl_node",):
                out.append(c)
                nd.problems.pop(c.check)
    return out


def _nvlink_check(h: str, nd: NodeData, common_active: int) -> list[CheckResult]:
    has_nv = bool(nd.topo and nd.topo.nvlink_groups)
    if nd.nvlink is None or not any(g.links or g.all_inactive for g in nd.nvlink.gpus):
        if has_nv:
            return [CheckResult(h, "nvlink", "fail", 0, None, "topology shows NVLink but `nvidia-smi nvlink -s` "
                                                              "reports no links")]
        return [CheckResult(h, "nvlink", "pass", 0, None, "no NVLink on this node")] if nd.nvlink else []
    bad = [f"GPU{g.index}: all NVLinks inActive" for g in nd.nvlink.gpus if g.all_inactive]
    for g in nd.nvlink.gpus:
        if g.all_inactive:
            continue
        if g.links and g.active < common_active and not g.cut:
            bad.append(f"GPU{g.index} {g.active}/{len(g.links)} links up (inactive: {g.inactive})")
        elif not g.links and has_nv:
            bad.append(f"GPU{g.index} has no NVLink")
    if bad:
        return [CheckResult(h, "nvlink", "fail", len(bad), common_active, "; ".join(bad))]
    return [CheckResult(h, "nvlink", "pass", common_active, common_active, f"{common_active} links up per GPU")]


def _gpu_health(h: str, q: GpuQuery, cfg: JudgeConfig) -> list[CheckResult]:
    ecc = CheckResult(h, "ecc", "pass", 0, 0, "")
    pcie = CheckResult(h, "pcie", "pass", None, None, "")
    clocks = CheckResult(h, "clocks", "pass", None, None, "")
    unc_total = 0
    for g in q.gpus:
        gid = f"GPU{g.index}"
        if g.ecc_uncorrected:
            unc_total += g.ecc_uncorrected
            merge(ecc, "fail", f"{gid}: {g.ecc_uncorrected} uncorrectable ECC errors")
        if g.remapped_failure:
            merge(ecc, "fail", f"{gid}: row remapping failed")
        if g.remapped_pending:
            merge(ecc, "warn", f"{gid}: row remap pending (reset the GPU)")
        if g.retired_pending:
            merge(ecc, "warn", f"{gid}: page retirement pending")
        if g.ecc_corrected and g.ecc_corrected > cfg.ecc_corrected_warn:
            merge(ecc, "warn", f"{gid}: {g.ecc_corrected} corrected ECC errors (> {cfg.ecc_corrected_warn})")
        if g.pcie_width is not None and g.pcie_width_max and g.pcie_width < g.pcie_width_max:
            merge(pcie, "fail", f"{gid}: PCIe x{g.pcie_width} of x{g.pcie_width_max}")
        busy = g.clock_event_reasons is not None and not int(g.clock_event_reasons, 16) & 0x1
        if g.pcie_gen is not None and g.pcie_gen_max and g.pcie_gen < g.pcie_gen_max and busy:
            # an idle GPU downshifts its link to save power (clock event reason 0x1): only a GPU known to be
            # busy counts (without the reasons column, Gen1 of Gen4 at idle is normal, as on the L40S capture)
            merge(pcie, "warn", f"{gid}: PCIe gen {g.pcie_gen} of {g.pcie_gen_max} while not idle")
        if g.clock_event_reasons is not None and int(g.clock_event_reasons, 16) not in BENIGN_CLOCK_REASONS:
            merge(clocks, "warn", f"{gid}: clocks limited (event reasons {g.clock_event_reasons})")
    ecc.value = unc_total
    ecc.message = ecc.message or "no uncorrectable ECC errors"
    pcie.message = pcie.message or "every GPU at full PCIe width and generation"
    clocks.message = clocks.message or "no clock limits besides idle / power cap"
    return [ecc, pcie, clocks]


def _ib_check(h: str, ib: IbStatus, cfg: JudgeConfig, best: dict[str, float],
              active_anywhere: set[tuple[str, int]]) -> CheckResult:
    c = CheckResult(h, "ib", "pass", len([p for p in ib.ports if p.active]), cfg.ib_rate_gbps, "")
    for ca in ib.missing:
        merge(c, "fail", f"{ca} vanished while ibstat listed the adapters")
    unused = {(p.ca, p.port) for p in ib.unused_ethernet}  # Ethernet ports switched off: not a rail
    for p in ib.ports:
        name = f"{p.ca}/{p.port}"
        if (p.ca, p.port) in unused and (p.ca, p.port) not in active_anywhere:
            continue
        if not p.active:
            if (p.ca, p.port) in active_anywhere:
                merge(c, "fail", f"{name} is {p.state}/{p.physical_state}, active on other nodes")
            else:
                merge(c, "warn", f"{name} is {p.state}/{p.physical_state} on every node (unused?)")
            continue
        want = cfg.ib_rate_gbps or best.get(p.ca)
        if want and (p.rate_gbps or 0) < want:
            merge(c, "fail", f"{name} runs at {p.rate_gbps:g} Gb/s, expected {want:g}", threshold=want)
    c.message = c.message or f"{c.value} ports active"
    return c


def _has_active_ib(nd: NodeData | None) -> bool:
    return bool(nd and nd.ib and any(p.active for p in nd.ib.ports))


def _intra_checks(data: dict[str, NodeData], cfg: JudgeConfig) -> list[CheckResult]:
    out: list[CheckResult] = []
    values: dict[str, float] = {}
    results: dict[str, CheckResult] = {}
    for h, nd in data.items():
        if "nccl_node" in nd.problems:
            out.append(nd.problems.pop("nccl_node"))
            continue
        t = nd.nccl
        if t is None:
            continue
        if t.failed:
            out.append(CheckResult(h, "nccl_node", "fail", t.busbw_at_max_size, None, "; ".join(t.errors[:3])))
            continue
        bw = t.busbw_at_max_size or 0.0
        th = cfg.for_model(nd.model)
        c = at_least(h, "nccl_node", bw, th.intra_busbw_gbs, cfg.warn_margin, source=th.source)
        c.message = f"all_reduce busbw {c.message}" + (f" [{t.warnings[0]}]" if t.warnings else "")
        if t.warnings:
            merge(c, "warn", f"{len(t.warnings)} NCCL WARN line(s)")
        values[h] = bw
        results[h] = c
    for h, (status, med, msg) in outliers(values, cfg.outlier_fail, cfg.outlier_warn).items():
        merge(results[h], status, msg, threshold=round(med * cfg.outlier_fail, 2))
    return out + list(results.values())


def _pair_checks(results: PreflightResults, data: dict[str, NodeData],
                 cfg: JudgeConfig) -> tuple[list[PairReport], list[CheckResult]]:
    pairs: list[PairReport] = []
    per_node: dict[str, list[tuple[PairReport, str]]] = {}
    for run in (r for r in results.nccl if r.kind == "pair"):
        a, b = run.hosts[0], run.hosts[1]
        t, why = parse_nccl_run(run.result, run.collective)
        if t is None or t.failed:
            reason = why or "; ".join(t.errors[:2]) if t is None or why else "; ".join(t.errors[:2])
            p = PairReport(a, b, 0.0, "fail")
            pairs.append(p)
            for h in (a, b):
                per_node.setdefault(h, []).append((p, f"{a}<->{b}: {reason}"))
            continue
        if "NET/Socket" in t.transports and any(_has_active_ib(data.get(h)) for h in (a, b)):
            # an IB/RoCE cluster whose pair fell back to TCP: a broken RDMA path, whatever the figure
            p = PairReport(a, b, t.busbw_at_max_size or 0.0, "fail")
            pairs.append(p)
            for h in (a, b):
                per_node.setdefault(h, []).append((p, f"{a}<->{b}: NCCL used TCP sockets (NET/Socket) between "
                                                      "the nodes although InfiniBand/RoCE ports are active"))
            continue
        p = PairReport(a, b, t.busbw_at_max_size or 0.0, "pass")
        pairs.append(p)
        for h in (a, b):
            per_node.setdefault(h, []).append((p, ""))
    # A node is as good as its best pair: if any pair of it is fast, its own links are fine.
    score = {h: max((p.busbw_gbs for p, _ in lst if p.status != "fail"), default=0.0) for h, lst in per_node.items()}
    flagged = outliers({h: s for h, s in score.items() if s > 0}, cfg.outlier_fail, cfg.outlier_warn)
    med = statistics.median([s for s in score.values() if s > 0]) if any(s > 0 for s in score.values()) else 0.0
    for p in pairs:
        if p.status == "fail":
            continue
        th = cfg.for_model(data[p.a].model if p.a in data else None).inter_busbw_gbs
        if th is not None and p.busbw_gbs < th:
            p.status = "fail"
        elif len(score) >= 3 and med and p.busbw_gbs < cfg.outlier_fail * med:
            p.status = "fail"
        elif len(score) >= 3 and med and p.busbw_gbs < cfg.outlier_warn * med:
            p.status = "warn"
    checks: list[CheckResult] = []
    for h, lst in per_node.items():
        th = cfg.for_model(data[h].model if h in data else None)
        if score[h] <= 0:
            reasons = "; ".join(r for _, r in lst if r)
            checks.append(CheckResult(h, "nccl_inter", "fail", 0.0, th.inter_busbw_gbs,
                                      f"every pair run of this node failed: {reasons}"))
            continue
        c = at_least(h, "nccl_inter", score[h], th.inter_busbw_gbs, cfg.warn_margin)
        partners = ", ".join(f"{p.b if p.a == h else p.a} {p.busbw_gbs:.1f}" for p, _ in lst)
        c.message = f"best pair busbw {c.message} (pairs: {partners})"
        if h in flagged:
            status, m, msg = flagged[h]
            merge(c, status, msg + " of the nodes' best pairs", threshold=round(m * cfg.outlier_fail, 2))
        checks.append(c)
    return pairs, checks


# ---- outputs gathered by other means --------------------------------------------------------

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
        meta: dict[str, Any] = {}
        if (d / META_FILE).exists():
            try:
                meta = json.loads(read_text(d / META_FILE, "probe metadata"))
            except json.JSONDecodeError:
                meta = {}
        probes: dict[str, CommandResult] = {}
        for fname, probe in files.items():
            if (d / fname).exists():
                m = meta.get(probe.name, {})
                out = read_text(d / fname, "probe output", errors="replace")
                probes[probe.name] = CommandResult(host, m.get("command", probe.command), out, m.get("stderr", ""),
                                                   m.get("rc", 0), bool(m.get("timed_out")), m.get("error"))
        res.probes[host] = probes
        if (d / NCCL_NODE_FILE).exists():
            m = meta.get("nccl-node", {})
            r = CommandResult(host, m.get("command", f"(from {d / NCCL_NODE_FILE})"),
                              read_text(d / NCCL_NODE_FILE, "nccl-tests output", errors="replace"), "", m.get("rc", 0),
                              bool(m.get("timed_out")))
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
            hosts = named if named and all(h in res.hosts for h in named) else (_hosts_in(text) or named)
            if kind == "pairs" and len(hosts) != 2:
                continue
            r = CommandResult(hosts[0], f"(from {f})", text, "", 0)
            res.nccl.append(NcclRun("pair" if kind == "pairs" else "all", hosts, "all_reduce", r))
    load_runs(root, res)
    return res


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


def _hosts_in(text: str) -> list[str]:
    try:
        from checks.parsers.nccl_tests import parse_nccl_tests_all

        tests = parse_nccl_tests_all(text)
    except ParseError:
        return []
    return tests[0].hosts if tests else []


def status_of(bwmap: BandwidthMap) -> str:
    return worst(*(c.status for c in bwmap.checks)) if bwmap.checks else "pass"


def failed_checks(bwmap: BandwidthMap) -> list[CheckResult]:
    return [c for c in bwmap.checks if c.status == "fail"]


__all__ = ["assemble", "load_dir", "status_of", "failed_checks", "STATUS_ORDER"]


def main(argv: list[str] | None = None) -> int:
    """`python -m checks.assemble DIR [-o bwmap.json]`: what the Slurm preflight job runs last."""
    import argparse

    from checks.report import render

    ap = argparse.ArgumentParser(prog="python -m checks.assemble")
    ap.add_argument("dir")
    ap.add_argument("-o", "--output")
    args = ap.parse_args(argv)
    bw = assemble(load_dir(args.dir))
    if args.output:
        bw.save(args.output)
    print(render(bw))
    return 1 if failed_checks(bw) else 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
