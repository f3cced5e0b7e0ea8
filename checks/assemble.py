"""Build the BandwidthMap from what preflight gathered: parse every output, judge every check.

Input is a PreflightResults (from orchestrate, or from checks.folder.load_dir for outputs gathered by
other means); output is the BandwidthMap the planner reads, with one CheckResult per node and check,
the pair bandwidths and the nodes to exclude. Checks (names are stable, tests and users rely on
them): reachable, gpu_count, gpu_model, driver, topology, nvlink, ecc, xid, pcie, clocks, ib,
nccl_node, nccl_inter, nccl_all (node "*"), and the deeper levels' (checks/judges/deep.py). Parsing is
checks.parsed's, judging checks.judges' (Findings, folded to one verdict per node and check); here each
verdict becomes the map's CheckResult, and the nodes' statuses, the exclusions and the medians follow.
"""

from __future__ import annotations

import statistics
from datetime import datetime, timezone

from checks.judges.config import JudgeConfig
from checks.judges.deep import deep_checks
from checks.judges.figures import at_least
from checks.judges.finding import Finding, verdict, worst
from checks.judges.hardware import hardware_checks
from checks.judges.nccl import intra_checks, pair_checks
from checks.parsed import NodeData, node_data, parse_nccl_run
from checks.results import PreflightResults
from launcher.formats.bwmap import BandwidthMap, CheckResult, NodeReport

CLUSTER = "*"


def assemble(results: PreflightResults, config: JudgeConfig | None = None) -> BandwidthMap:
    cfg = config or JudgeConfig()
    checks: list[Finding] = []
    nodes: dict[str, NodeReport] = {}
    data: dict[str, NodeData] = {}

    for host in results.hosts:
        if host in results.unreachable:
            checks.append(verdict(host, "reachable", "fail", None, None, results.unreachable[host]))
            nodes[host] = NodeReport(host=host, status="fail")
            continue
        checks.append(verdict(host, "reachable", "pass", None, None, "ok"))
        data[host] = node_data(host, results.probes.get(host, {}))

    node_runs = {r.hosts[0]: r for r in results.nccl if r.kind == "node"}
    for host, nd in data.items():
        run = node_runs.get(host)
        if run is not None:
            t, why = parse_nccl_run(run.result, run.collective)
            nd.nccl = t
            if t is None:
                nd.problems["nccl_node"] = verdict(host, "nccl_node", "fail", None, None, why or "")

    checks += hardware_checks(data, cfg)
    checks += intra_checks(data, cfg)
    pair_reports, pair_results = pair_checks(results, data, cfg)
    checks += pair_results
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
            nodes[c.node].status = worst((nodes[c.node].status, c.status))
    exclude = [h for h, n in nodes.items() if n.status == "fail"]

    all_busbw = None
    for run in (r for r in results.nccl if r.kind == "all"):
        t, why = parse_nccl_run(run.result, run.collective)
        hosts = ",".join(run.hosts)
        if t is None or t.failed:
            checks.append(verdict(CLUSTER, "nccl_all", "fail", None, None,
                                  f"all-node run over {hosts}: {why or '; '.join(t.errors[:3] if t else [])}"))
            continue
        all_busbw = t.busbw_at_max_size
        c = at_least(CLUSTER, "nccl_all", all_busbw or 0.0, cfg.min_all_busbw_gbs, cfg.warn_margin)
        c.message = f"all {len(run.hosts)} nodes: {c.message}"
        checks.append(c)

    intra = [n.intra_busbw_gbs for h, n in nodes.items() if h not in exclude and n.intra_busbw_gbs]
    inter = [p.busbw_gbs for p in pair_reports if p.a not in exclude and p.b not in exclude and p.busbw_gbs > 0]
    bw = BandwidthMap(
        nodes=nodes, pairs=sorted(pair_reports, key=lambda p: p.busbw_gbs), checks=[result(c) for c in checks],
        intra_node_busbw_gbs=round(statistics.median(intra), 2) if intra else None,
        inter_node_busbw_gbs=round(statistics.median(inter), 2) if inter else None,
        all_nodes_busbw_gbs=all_busbw, exclude=exclude, commands=list(results.commands),
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )
    record_figures(bw, results)
    return bw


def result(f: Finding) -> CheckResult:
    """A node's verdict on one check as the map records it."""
    return CheckResult(f.node, f.check, f.status, f.figure, f.threshold, f.message)


def record_figures(bw: BandwidthMap, results: PreflightResults) -> None:
    """Put the measured all-to-all and per-NIC RDMA figures into the map (healthy nodes' medians)."""
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


def failed_checks(bwmap: BandwidthMap) -> list[CheckResult]:
    return [c for c in bwmap.checks if c.status == "fail"]
