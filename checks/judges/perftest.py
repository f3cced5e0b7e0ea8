"""ib_write_bw judged per NIC: against the link rate, and GPUDirect against host memory on the same link."""

from __future__ import annotations

from checks.judges.finding import Finding
from checks.parsers.ibstat import IbStatus
from checks.parsers.perftest import Perftest

RDMA_SOURCE = ("ib_write_bw reaches 92-98% of line rate on healthy links (98.01 of 100, 392.34 of 400 Gb/s in "
               "the shared captures); fail below 75%, warn below 90%")
GDR_SOURCE = ("GPUDirect RDMA should run near the host-memory figure on the same link; the degraded T4 capture "
              "runs at 11% (10.50 vs 92.56 Gb/s); fail below 50%, warn below 80%")


def judge_perftest(result: Perftest, node: str = "", link_rate_gbps: float | None = None,
                   host_baseline: Perftest | None = None, ibstat: IbStatus | None = None) -> list[Finding]:
    """`link_rate_gbps`, or else the rate `ibstat` (of the same node) gives the NIC perftest ran on."""
    out: list[Finding] = []
    if link_rate_gbps is None and ibstat is not None:
        link_rate_gbps = next((p.rate_gbps for p in ibstat.ports if p.ca == result.device and p.active), None)
    bw = result.bw_avg_gbps or 0.0
    nic = result.device or "NIC"
    path = f"GPU memory ({result.gpu})" if result.use_cuda else "host memory"
    if link_rate_gbps:
        frac = bw / link_rate_gbps
        status = "fail" if frac < 0.75 else "warn" if frac < 0.9 else "pass"
        out.append(Finding(node, nic, "rdma", status, bw, link_rate_gbps,
                           f"{bw:.2f} Gb/s from {path} = {frac:.0%} of the {link_rate_gbps:g} Gb/s link",
                           "" if status == "pass" else "check the port (ibstat rate, cable, switch port counters "
                           "with perfquery), MTU and PFC/ECN on RoCE; rerun with more QPs (-q 4)", RDMA_SOURCE))
    if result.use_cuda and host_baseline is not None and host_baseline.bw_avg_gbps:
        base = host_baseline.bw_avg_gbps
        frac = bw / base
        status = "fail" if frac < 0.5 else "warn" if frac < 0.8 else "pass"
        out.append(Finding(node, nic, "rdma:gpudirect", status, bw, base,
                           f"GPUDirect {bw:.2f} Gb/s vs {base:.2f} Gb/s from host memory ({frac:.0%})",
                           "" if status == "pass" else "the GPU<->NIC path is slow: check nvidia-peermem / dmabuf, "
                           "PCIe ACS and relaxed ordering, and that the NIC and GPU share a PCIe switch "
                           "(nvidia-smi topo -m: PIX/PXB)", GDR_SOURCE))
    if not out:
        out.append(Finding(node, nic, "rdma", "pass", bw, None, f"{bw:.2f} Gb/s from {path} (no link rate or "
                           "host-memory baseline given to judge it against)", "", ""))
    return out


