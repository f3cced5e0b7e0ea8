"""NCCL bandwidth judged per node: its own all_reduce (against the GPU model's figure and the other
nodes' median) and its node pairs (a node is as good as its best pair), with the pairs' reports."""

from __future__ import annotations

import statistics

from checks.judges.config import JudgeConfig
from checks.judges.figures import at_least, outliers
from checks.judges.finding import Finding, merge, verdict
from checks.parsed import NodeData, parse_nccl_run
from checks.results import PreflightResults
from launcher.formats.bwmap import PairReport


def _has_active_ib(nd: NodeData | None) -> bool:
    return bool(nd and nd.ib and any(p.active for p in nd.ib.ports))


def intra_checks(data: dict[str, NodeData], cfg: JudgeConfig) -> list[Finding]:
    out: list[Finding] = []
    values: dict[str, float] = {}
    results: dict[str, Finding] = {}
    for h, nd in data.items():
        if "nccl_node" in nd.problems:
            out.append(nd.problems.pop("nccl_node"))
            continue
        t = nd.nccl
        if t is None:
            continue
        if t.failed:
            out.append(verdict(h, "nccl_node", "fail", t.busbw_at_max_size, None, "; ".join(t.errors[:3])))
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


def pair_checks(results: PreflightResults, data: dict[str, NodeData],
                 cfg: JudgeConfig) -> tuple[list[PairReport], list[Finding]]:
    pairs: list[PairReport] = []
    per_node: dict[str, list[tuple[PairReport, str]]] = {}
    for run in (r for r in results.nccl if r.kind == "pair"):
        a, b = run.hosts[0], run.hosts[1]
        t, why = parse_nccl_run(run.result, run.collective)
        if t is None or t.failed:
            reason = why or ("; ".join(t.errors[:2]) if t is not None else "")
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
    checks: list[Finding] = []
    for h, lst in per_node.items():
        model_th = cfg.for_model(data[h].model if h in data else None)
        if score[h] <= 0:
            reasons = "; ".join(r for _, r in lst if r)
            checks.append(verdict(h, "nccl_inter", "fail", 0.0, model_th.inter_busbw_gbs,
                                      f"every pair run of this node failed: {reasons}"))
            continue
        c = at_least(h, "nccl_inter", score[h], model_th.inter_busbw_gbs, cfg.warn_margin)
        partners = ", ".join(f"{p.b if p.a == h else p.a} {p.busbw_gbs:.1f}" for p, _ in lst)
        c.message = f"best pair busbw {c.message} (pairs: {partners})"
        if h in flagged:
            status, m, msg = flagged[h]
            merge(c, status, msg + " of the nodes' best pairs", threshold=round(m * cfg.outlier_fail, 2))
        checks.append(c)
    return pairs, checks
