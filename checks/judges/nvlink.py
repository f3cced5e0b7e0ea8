"""NVLink judged per GPU and link: links down or inactive, error counters that rise under load."""

from __future__ import annotations

import statistics

from checks.judges.finding import Finding
from checks.parsers.nvlink import NvlinkStatus
from checks.parsers.nvlink_errors import NvlinkErrors

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


