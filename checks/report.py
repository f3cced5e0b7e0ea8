"""Human report of a BandwidthMap: a nodes x checks table, problems, pair bandwidths slowest first.

Plain text (no colour codes) so it reads the same in a terminal, a CI log and an email.
"""

from __future__ import annotations

from launcher.formats.bwmap import BandwidthMap

CHECK_ORDER = ["reachable", "gpu_count", "gpu_model", "driver", "topology", "nvlink", "ecc", "xid", "pcie",
               "clocks", "ib", "nccl_node", "nccl_inter"]
MARK = {"pass": "ok", "warn": "WARN", "fail": "FAIL"}


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def render(bw: BandwidthMap, max_pairs: int = 20) -> str:
    present = {c.check for c in bw.checks}
    cols = [c for c in CHECK_ORDER if c in present] + sorted(present - set(CHECK_ORDER) - {"nccl_all"})
    grid: dict[tuple[str, str], str] = {}
    for c in bw.checks:
        grid[(c.node, c.check)] = MARK.get(c.status, c.status)
    hosts = list(bw.nodes)
    rows = [["node", "status", "gpus", "intra GB/s"] + cols]
    for h in hosts:
        n = bw.nodes[h]
        rows.append([h, MARK.get(n.status, n.status), str(n.gpus or "-"),
                     f"{n.intra_busbw_gbs:.1f}" if n.intra_busbw_gbs else "-"]
                    + [grid.get((h, c), "-") for c in cols])
    out = [f"Preflight of {len(hosts)} node(s): {len(bw.exclude)} to exclude", ""]
    out += _table(rows)
    problems = [c for c in bw.checks if c.status != "pass"]
    if problems:
        out += ["", "Problems:"]
        for c in sorted(problems, key=lambda c: (c.status != "fail", c.node, c.check)):
            thr = f" (threshold {c.threshold})" if c.threshold not in (None, [], "") else ""
            out.append(f"  {MARK[c.status]:4}  {c.node:<12} {c.check:<11} {c.message}{thr}")
    if bw.pairs:
        out += ["", f"Node pairs, slowest first (all_reduce busbw, GB/s){'' if len(bw.pairs) <= max_pairs else ', first ' + str(max_pairs)}:"]
        for p in sorted(bw.pairs, key=lambda p: p.busbw_gbs)[:max_pairs]:
            out.append(f"  {p.busbw_gbs:8.1f}  {p.a} <-> {p.b}  {MARK.get(p.status, p.status)}")
    out += [""]
    fig = []
    if bw.intra_node_busbw_gbs:
        fig.append(f"intra-node {bw.intra_node_busbw_gbs:.1f}")
    gpus = sorted(n.gpus for h, n in bw.nodes.items() if n.gpus and h not in bw.exclude)
    if bw.inter_node_busbw_gbs:
        per_gpu = f" = {bw.inter_node_busbw_gbs / gpus[len(gpus) // 2]:.1f} per GPU" if gpus else ""
        fig.append(f"inter-node pair {bw.inter_node_busbw_gbs:.1f}{per_gpu}")
    if bw.ratio:
        fig.append(f"intra/inter {bw.ratio:.1f}x")
    if bw.all_nodes_busbw_gbs:
        fig.append(f"all healthy nodes {bw.all_nodes_busbw_gbs:.1f}")
    if fig:
        out.append("Median busbw (GB/s): " + ", ".join(fig))
    all_checks = [c for c in bw.checks if c.check == "nccl_all"]
    for c in all_checks:
        out.append(f"All-node run: {MARK[c.status]}: {c.message}")
    out.append("Exclude: " + (",".join(bw.exclude) if bw.exclude else "none"))
    if bw.commands:
        out += ["", "Commands run:"] + [f"  {c}" for c in bw.commands]
    return "\n".join(out)
