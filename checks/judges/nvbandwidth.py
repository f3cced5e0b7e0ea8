"""nvbandwidth judged per GPU: the published figure for the model, the node's median, the fleet's."""

from __future__ import annotations

import statistics

from checks.judges.finding import Finding
from checks.parsers.nvbandwidth import NvBandwidth

# GB/s. Azure's health checks for ND H100 v5 run `check_gpu_bw 48 335` (nvbandwidth host<->device
# 48 GB/s, device<->device 335 GB/s). No published figure for other models: judged against the node
# (and, given peer_median, the fleet) instead.
NVB_THRESHOLDS: dict[str, dict[str, float]] = {
    "H100": {"host_device": 48.0, "device_to_device": 335.0},
}
NVB_SOURCE = "Azure azurehpc-health-checks nd96isr_h100_v5 check_gpu_bw 48 335"
OUTLIER_FAIL, OUTLIER_WARN = 0.75, 0.9  # fractions of a median, as checks.judges.config.JudgeConfig
WARN_MARGIN = 0.05  # Azure's nvbandwidth checks warn within 5% of the threshold


def judge_nvbandwidth(result: NvBandwidth, node: str = "", model: str | None = None,
                      peer_median: dict[str, float] | None = None) -> list[Finding]:
    """Per GPU: the lowest figure it took part in, against the model's figure, the node's median
    and (`peer_median`, test name -> GB/s) the same test's median over other nodes."""
    out: list[Finding] = []
    model = model or result.model
    figures = next((v for k, v in NVB_THRESHOLDS.items() if model and k.lower() in model.lower()), {})
    for t in result.tests:
        per = t.per_gpu()
        check = f"nvbandwidth:{t.name}"
        floor = figures.get(t.kind)
        med = statistics.median(per.values()) if len(per) >= 3 else None
        for g, v in sorted(per.items()):
            comp = f"GPU {g}"
            if floor is not None and v < floor:
                out.append(Finding(node, comp, check, "fail", v, floor, f"{v:.1f} GB/s is below {floor:g} GB/s "
                                   f"for {model}", "check the GPU's links (nvidia-smi nvlink -s / -q -d PCIE); reset "
                                   "the GPU; if it stays low, drain and RMA", NVB_SOURCE))
                continue
            if floor is not None and v < floor * (1 + WARN_MARGIN):
                out.append(Finding(node, comp, check, "warn", v, floor, f"{v:.1f} GB/s is within 5% of "
                                   f"{floor:g} GB/s", "rerun; watch this GPU", NVB_SOURCE))
                continue
            if med and v < med * OUTLIER_FAIL:
                out.append(Finding(node, comp, check, "fail", v, round(med * OUTLIER_FAIL, 2),
                                   f"{v:.1f} GB/s is {1 - v / med:.0%} below the node median {med:.1f}",
                                   "compare its PCIe/NVLink state with the other GPUs; reset; RMA if it persists",
                                   "node median x 0.75"))
            elif med and v < med * OUTLIER_WARN:
                out.append(Finding(node, comp, check, "warn", v, round(med * OUTLIER_WARN, 2),
                                   f"{v:.1f} GB/s is {1 - v / med:.0%} below the node median {med:.1f}",
                                   "rerun; watch this GPU", "node median x 0.9"))
        peer = (peer_median or {}).get(t.name or "")
        if peer and per:
            node_fig = statistics.median(per.values())
            if node_fig < peer * OUTLIER_FAIL:
                out.append(Finding(node, "node", check, "fail", node_fig, round(peer * OUTLIER_FAIL, 2),
                                   f"node median {node_fig:.1f} GB/s vs {peer:.1f} on the other nodes",
                                   "compare driver, PCIe/NVLink settings and clocks with a good node",
                                   "fleet median x 0.75"))
        if not any(f.check == check for f in out):
            lo = min(per.values(), default=None)
            out.append(Finding(node, "node", check, "pass", lo, floor,
                               f"lowest {lo} GB/s" + (f" >= {floor:g}" if floor else " (judged against the node "
                                                      "median; no published figure for this model)"), "",
                               NVB_SOURCE if floor else "node median"))
    return out


