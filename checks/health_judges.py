"""Judges for the deep health checks: DCGM diag, NVLink errors, nvbandwidth, perftest, `nvidia-smi -q`, Xids.

Each `judge_X(result, node=..., ...)` takes a parser's result and returns Findings: one per GPU,
link or NIC concerned, each with the figure, the threshold it was held to and where that threshold
comes from, and what to do about it. Pure functions: the orchestrator (levels, drain) calls them
on what it gathered; `launch preflight parse KIND FILE` calls them on one captured file.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from checks.parsers.dcgm_diag import DcgmDiag, DcgmTest
from checks.parsers.gpu_q import GpuQ
from checks.parsers.ibstat import IbStatus
from checks.parsers.nvbandwidth import NvBandwidth
from checks.parsers.nvlink import NvlinkStatus
from checks.parsers.nvlink_errors import NvlinkErrors
from checks.parsers.perftest import Perftest
from checks.parsers.xid import XID_CATALOG, XID_SOURCE, XidLog
from checks.parsers.xid_catalog import verdict as xid_verdict

STATUS_ORDER = {"pass": 0, "warn": 1, "fail": 2}


@dataclass
class Finding:
    node: str
    component: str  # "GPU 1", "GPU 0000:a1:00", "mlx5_4", "GPU 0 link 3", "node"
    check: str  # dcgm:<test> | nvlink | nvbandwidth:<test> | rdma | memory | xid
    status: str  # pass | warn | fail
    figure: Any = None
    threshold: Any = None
    message: str = ""
    remediation: str = ""
    source: str = ""  # where the threshold comes from

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def worst(findings: list[Finding]) -> str:
    return max((f.status for f in findings), key=STATUS_ORDER.__getitem__, default="pass")


# ---------------------------------------------------------------- DCGM diag

DCGM_SOURCE = "DCGM's own verdict (dcgmi diag), per GPU"
SKIP_ONLY = {"denylist", "nvml library", "cuda main library", "permissions and os blocks", "persistence mode",
             "environment variables", "page retirement/row remap", "graphics processes", "inforom", "software"}


def _dcgm_remedy(test: DcgmTest, text: str) -> str:
    low, name = text.lower(), test.name.lower()
    if "cuinit" in low or "not yet initialized" in low:
        return ("CUDA could not initialise: on NVSwitch systems start nvidia-fabricmanager, check `nvidia-smi -q` "
                "Fabric state, then rerun dcgmi diag")
    if "row remapping" in low or "row remap" in name:
        return "reset the GPU (nvidia-smi -r -i N) or reboot to apply the pending row remaps, then rerun"
    if "thermal" in low:
        return "check the node's cooling (fans, airflow, thermal interface), then rerun dcgmi diag -r 3"
    if "internal error" in low:
        return "DCGM internal error, not attributed to a GPU: restart nv-hostengine / the DCGM pod and rerun"
    if "power" in name:
        return "check power delivery and clocks (nvidia-smi -q -d POWER,CLOCK); if it fails again, drain for RMA"
    if "pcie" in name:
        return "check the PCIe link (nvidia-smi -q -d PCIE, lspci -vv), reseat if degraded, rerun"
    return "reset the GPU and rerun dcgmi diag -r 3; if it fails again, drain the node and RMA the GPU"


def judge_dcgm_diag(diag: DcgmDiag, node: str = "") -> list[Finding]:
    out: list[Finding] = []
    n = diag.gpu_count
    for m in diag.category_messages:
        if m.level == "error":
            comp = f"GPU {m.gpu}" if m.gpu is not None else "node"
            fake = DcgmTest(category="Deployment", name="deployment")
            out.append(Finding(node, comp, "dcgm:deployment", "fail", m.text, "no Error rows", m.text,
                               _dcgm_remedy(fake, m.text), DCGM_SOURCE))
    for t in diag.tests:
        if t.result != "fail" and t.result != "warn":
            continue
        failing = sorted(g for g, s in t.gpus.items() if s in ("fail", "warn"))
        notes = {m.gpu: m.text for m in t.messages if m.level in ("warning", "error") and m.gpu is not None}
        if not failing and t.all_gpus in ("fail", "warn"):
            failing = list(range(n)) if n else sorted(notes)  # a fragment without the device list
        general = [m.text for m in t.messages if m.level in ("warning", "error") and m.gpu is None]
        status = "fail" if t.result == "fail" else "warn"
        if failing:
            for g in failing:
                text = notes.get(g) or "; ".join(general) or f"{t.name}: {t.gpus.get(g, t.all_gpus)}"
                out.append(Finding(node, f"GPU {g}", f"dcgm:{t.name}", t.gpus.get(g, status) or status,
                                   t.gpus.get(g, t.all_gpus), "Pass", text, _dcgm_remedy(t, text), DCGM_SOURCE))
        else:
            per = f" (every GPU's own row says {', '.join(sorted(set(t.gpus.values())))})" if t.gpus else ""
            text = "; ".join(general) or f"{t.name} failed"
            out.append(Finding(node, "node" if not t.all_gpus else "all GPUs", f"dcgm:{t.name}", status, t.result,
                               "Pass", f"{t.name} {t.result}{per}: {text}", _dcgm_remedy(t, text), DCGM_SOURCE))
    plugins = [t for t in diag.tests if t.name.lower() not in SKIP_ONLY]
    if plugins and all(t.result == "skip" for t in plugins) and not out:
        out.append(Finding(node, "node", "dcgm:coverage", "warn", "all skipped", "at least one test run",
                           f"every diagnostic test was skipped ({', '.join(t.name for t in plugins)}): nothing "
                           "was tested", "check that this DCGM version supports the GPU (a newer DCGM for new "
                           "GPU models) and that the diag runs with the GPUs idle and as root", DCGM_SOURCE))
    if not out:
        ran = [t.name for t in diag.tests if t.result == "pass"]
        out.append(Finding(node, "node", "dcgm", "pass", f"{len(ran)} passed", "Pass",
                           f"{len(ran)} tests passed" + (" (fragment)" if diag.truncated else ""), "", DCGM_SOURCE))
    return out


# ---------------------------------------------------------------- NVLink

NVLINK_SOURCE = ("NVLink CRC/replay/recovery error thresholds 0 (Meta gcm nvlink check defaults; DCGM's "
                 "NVLink health watch)")
NVLINK_DOWN_FIX = ("reset the GPU (nvidia-smi -r) or reboot; on NVSwitch systems check nvidia-fabricmanager; if "
                   "links stay down, drain the node and RMA the GPU/baseboard")


def judge_nvlink_errors(now: NvlinkErrors, before: NvlinkErrors | None = None, node: str = "") -> list[Finding]:
    """Links down or inactive fail; counters rising between `before` and `now` fail; non-zero in one read warns."""
    out: list[Finding] = []
    for g in now.gpus:
        if g.all_inactive:
            out.append(Finding(node, f"GPU {g.index}", "nvlink", "fail", "all links inactive", "links active",
                               "NVML: all NVLinks of this GPU are inActive", NVLINK_DOWN_FIX, "nvidia-smi nvlink"))
        if g.down:
            out.append(Finding(node, f"GPU {g.index}", "nvlink", "fail", f"{len(g.down)} links down",
                               "0 links down", f"links {g.down} Down (dcgmi nvlink --link-status)",
                               NVLINK_DOWN_FIX, "dcgmi nvlink link states"))
        prev = before.gpu(g.index) if before is not None else None
        for link, counters in sorted(g.counters.items()):
            for name, value in counters.items():
                if prev is not None:
                    was = prev.counters.get(link, {}).get(name)
                    if was is not None and value > was:
                        out.append(Finding(node, f"GPU {g.index} link {link}", "nvlink", "fail", value - was, 0,
                                           f"{name} rose from {was} to {value} between two reads",
                                           "reseat/inspect the NVLink path; reset the GPU; if errors keep rising, "
                                           "drain and RMA", NVLINK_SOURCE))
                elif value > 0:
                    out.append(Finding(node, f"GPU {g.index} link {link}", "nvlink", "warn", value, 0,
                                       f"{name} = {value} (counted since boot; read again around a load to see "
                                       "whether it rises)", "read `nvidia-smi nvlink -e` before and after an NCCL "
                                       "test; rising counters fail", NVLINK_SOURCE))
    if not out:
        out.append(Finding(node, "node", "nvlink", "pass", 0, 0,
                           "no link down" + (", no error counter rising" if before else ", error counters zero")
                           + (" (output elided some links)" if now.elided else ""), "", NVLINK_SOURCE))
    return out


def judge_nvlink_status(status: NvlinkStatus, node: str = "") -> list[Finding]:
    out = [Finding(node, f"GPU {g.index}", "nvlink", "fail", "all links inactive", "links active",
                   "NVML: all NVLinks of this GPU are inActive", NVLINK_DOWN_FIX, "nvidia-smi nvlink -s")
           for g in status.gpus if g.all_inactive]
    common = statistics.mode([g.active for g in status.gpus if g.links]) if any(g.links for g in status.gpus) else 0
    out += [Finding(node, f"GPU {g.index}", "nvlink", "fail", g.active, common,
                    f"{g.active}/{len(g.links)} links active (inactive: {g.inactive})", NVLINK_DOWN_FIX,
                    "the link count most GPUs of the node have")
            for g in status.gpus if g.links and g.active < common and not g.cut]
    return out or [Finding(node, "node", "nvlink", "pass", common, common, f"{common} links up per GPU", "", "")]


# ---------------------------------------------------------------- nvbandwidth

# GB/s. Azure's health checks for ND H100 v5 run `check_gpu_bw 48 335` (nvbandwidth host<->device
# 48 GB/s, device<->device 335 GB/s). No published figure for other models: judged against the node
# (and, given peer_median, the fleet) instead.
NVB_THRESHOLDS: dict[str, dict[str, float]] = {
    "H100": {"host_device": 48.0, "device_to_device": 335.0},
}
NVB_SOURCE = "Azure azurehpc-health-checks nd96isr_h100_v5 check_gpu_bw 48 335"
OUTLIER_FAIL, OUTLIER_WARN = 0.75, 0.9  # fractions of a median, as checks.judges.JudgeConfig
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


# ---------------------------------------------------------------- perftest (RDMA per NIC)

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


# ---------------------------------------------------------------- nvidia-smi -q (memory health)

MEM_SOURCE = "NVIDIA GPU memory error management (row remapping, page retirement, SRAM ECC)"
# Meta gcm's check-nvidia-smi gpu_retired_pages: critical above 10 retired pages or any pending
RETIRED_PAGES_LIMIT = 10
RETIRED_SOURCE = "Meta gcm gpu_retired_pages (threshold 10 retired pages; pending retirement is critical)"


def judge_gpu_q(result: GpuQ, node: str = "") -> list[Finding]:
    out: list[Finding] = []
    for bus, err in result.inaccessible.items():
        out.append(Finding(node, f"GPU {bus}", "memory", "fail", err, "reachable",
                           f"nvidia-smi cannot reach the GPU: {err}", "reboot the node; if the GPU is lost again "
                           "(Xid 79), drain it and RMA", "nvidia-smi"))
    for i, g in enumerate(result.gpus):
        s = g.summary()
        comp = f"GPU {g.bus_id}" if g.bus_id else f"GPU #{i}"

        def add(status: str, figure: Any, threshold: Any, msg: str, fix: str, comp: str = comp) -> None:
            out.append(Finding(node, comp, "memory", status, figure, threshold, msg, fix, MEM_SOURCE))

        if s["remapping_failure"]:
            add("fail", True, False, "row remapping failed", "drain the node and RMA the GPU")
        if s["remapped_pending"]:
            add("fail", s["remapped_uncorrectable"], "no pending remap",
                f"row remapping pending ({s['remapped_uncorrectable']} uncorrectable rows)",
                "reset the GPU (nvidia-smi -r -i N) or reboot so the remap takes effect")
        hist = s["bank_histogram"]
        if (hist.get("None") or 0) > 0:
            add("fail", hist["None"], 0, f"{hist['None']} banks have no spare rows left", "drain and RMA the GPU")
        elif (hist.get("Low") or 0) > 0:
            add("warn", hist["Low"], 0, f"{hist['Low']} banks are low on spare rows", "plan an RMA")
        if s["sram_threshold_exceeded"]:
            add("fail", True, False, "SRAM error threshold exceeded", "drain and RMA the GPU")
        if (s["sram_uncorrectable_volatile"] or 0) > 0:
            add("fail", s["sram_uncorrectable_volatile"], 0,
                f"SRAM uncorrectable errors: {s['sram_uncorrectable_volatile']} since boot, "
                f"{s['sram_uncorrectable_aggregate']} lifetime", "reset the GPU; RMA if they recur")
        elif (s["sram_uncorrectable_aggregate"] or 0) > 0:
            add("warn", s["sram_uncorrectable_aggregate"], 0,
                f"SRAM uncorrectable errors in the GPU's lifetime: {s['sram_uncorrectable_aggregate']}",
                "watch; RMA if they recur")
        if (s["dram_uncorrectable_volatile"] or 0) > 0:
            add("fail", s["dram_uncorrectable_volatile"], 0,
                f"{s['dram_uncorrectable_volatile']} uncorrectable DRAM ECC errors since boot",
                "reset the GPU to remap/retire the rows; RMA if they recur")
        retired = (s["retired_single_bit"] or 0) + (s["retired_double_bit"] or 0)
        if s["retired_pending"]:
            out.append(Finding(node, comp, "memory", "fail", True, False, "page retirement pending",
                               "reboot (or reload the driver) so the pages are retired", RETIRED_SOURCE))
        if retired > RETIRED_PAGES_LIMIT:
            out.append(Finding(node, comp, "memory", "fail", retired, RETIRED_PAGES_LIMIT, f"{retired} pages retired",
                               "drain the node and RMA the GPU", RETIRED_SOURCE))
        elif (s["retired_double_bit"] or 0) > 0:
            add("warn", s["retired_double_bit"], 0, f"{s['retired_double_bit']} pages retired for double-bit errors",
                "watch the count")
    if not out:
        out.append(Finding(node, "node", "memory", "pass", len(result.gpus), None,
                           f"{len(result.gpus)} GPUs: no pending remap or retirement, no uncorrectable errors", "",
                           MEM_SOURCE))
    return out


# ---------------------------------------------------------------- Xid

def classify_xid(code: int, message: str = "") -> tuple[str, str, str]:
    """(meaning, status, remediation) for one Xid, from NVIDIA's catalog: an action that takes the GPU out
    of service -> fail (drain); the application's, or nothing to do -> warn; a code not in it -> warn, unknown."""
    v = xid_verdict(code, message)
    return v.meaning, v.status, v.action


def judge_xid(log: XidLog, node: str = "") -> list[Finding]:
    out: list[Finding] = []
    groups: dict[tuple[str, int, str], int] = {}
    first: dict[tuple[str, int, str], str] = {}
    for e in log.events:
        meaning, status, fix = classify_xid(e.code, e.message)
        key = (e.pci, e.code, meaning)
        groups[key] = groups.get(key, 0) + 1
        first.setdefault(key, e.message)
    for (pci, code, meaning), count in groups.items():
        _, status, fix = classify_xid(code, first[(pci, code, meaning)])
        out.append(Finding(node, f"GPU {pci}", "xid", status, code, "NVIDIA's action takes the GPU out of service: fail; "
                           "the application's, or none: warn; not in the catalog: warn",
                           f"Xid {code} x{count}: {meaning}", fix, XID_SOURCE))
    xid79 = {e.pci for e in log.events if e.code == 79}
    for b in log.bus_events:
        if b.message == "fallen off the bus" and b.pci not in xid79:
            out.append(Finding(node, f"GPU {b.pci}", "xid", "fail", "fallen off the bus", "no bus loss",
                               "the driver lost the GPU (fallen off the bus) without an Xid line",
                               XID_CATALOG[79][2], XID_SOURCE))
        elif b.message == "RmInitAdapter failed":
            out.append(Finding(node, f"GPU {b.pci}", "xid", "fail", "RmInitAdapter failed", "initialised",
                               "the driver could not initialise the GPU", XID_CATALOG[143][2], "NVIDIA driver log"))
    return out or [Finding(node, "node", "xid", "pass", 0, 0, "no Xid events", "", XID_SOURCE)]


# ---------------------------------------------------------------- ibstat

def judge_ibstat(ib: IbStatus, node: str = "", rate_gbps: float | None = None) -> list[Finding]:
    """Missing adapters and down IB ports fail; Ethernet ports switched off (Disabled) are unused, not flagged."""
    out: list[Finding] = []
    for ca in ib.missing:
        out.append(Finding(node, ca, "ib", "fail", "missing", "present", f"{ca} vanished while ibstat listed "
                           "the adapters", "check `dmesg | grep mlx5` and the PCIe device; reload mlx5_core or "
                           "reboot; replace the adapter if it recurs", "ibstat"))
    unused = {(p.ca, p.port) for p in ib.unused_ethernet}
    best = max((p.rate_gbps or 0 for p in ib.ports if p.active and (p.link_layer or "") == "InfiniBand"), default=0)
    for p in ib.ports:
        name = f"{p.ca}/{p.port}"
        if (p.ca, p.port) in unused:
            continue
        if not p.active:
            ib_port = (p.link_layer or "InfiniBand") == "InfiniBand"
            out.append(Finding(node, name, "ib", "fail" if ib_port else "warn", f"{p.state}/{p.physical_state}",
                               "Active/LinkUp", f"{name} ({p.link_layer}) is {p.state}/{p.physical_state}"
                               + ("" if ib_port else ": an Ethernet port that is down but not disabled (a RoCE "
                                  "rail with a fault, or an unused port; compare with the other nodes)"),
                               "check cable and switch port; `ibportstate` / reseat; replace the cable",
                               "ibstat"))
            continue
        want = rate_gbps or (best if (p.link_layer or "") == "InfiniBand" else None)
        if want and p.rate_gbps is not None and p.rate_gbps < want:
            out.append(Finding(node, name, "ib", "fail", p.rate_gbps, want, f"{name} at {p.rate_gbps:g} Gb/s",
                               "a degraded link width/speed: reseat or replace the cable", "fastest IB port"))
    return out or [Finding(node, "node", "ib", "pass", len([p for p in ib.ports if p.active]), None,
                           f"{len([p for p in ib.ports if p.active])} ports active"
                           + (f"; {len(unused)} unused Ethernet ports disabled" if unused else ""), "", "ibstat")]


def judge_parsed(kind: str, parsed: Any, node: str = "", against: Any = None, link_rate_gbps: float | None = None,
                 model: str | None = None) -> list[Finding]:
    """The judges for one parsed output of KIND; `against` is the earlier `nvlink -e` read (nvlink-errors)
    or the host-memory run on the same link (perftest)."""
    if kind == "dcgm-diag":
        return judge_dcgm_diag(parsed, node)
    if kind == "nvbandwidth":
        return judge_nvbandwidth(parsed, node, model=model)
    if kind == "perftest":
        return judge_perftest(parsed, node, link_rate_gbps=link_rate_gbps, host_baseline=against)
    if kind == "nvlink-errors":
        return judge_nvlink_errors(parsed, before=against, node=node)
    if kind == "gpu-q":
        return judge_gpu_q(parsed, node)
    if kind == "xid":
        return judge_xid(parsed, node)
    if kind == "ibstat":
        return judge_ibstat(parsed, node, rate_gbps=link_rate_gbps)
    if kind == "nvlink":
        return judge_nvlink_status(parsed, node)
    raise ValueError(f"no judge for {kind}")
