"""GPU memory health from `nvidia-smi -q`, judged per GPU: row remapping, page retirement, SRAM/DRAM ECC."""

from __future__ import annotations

from typing import Any

from checks.judges.finding import Finding
from checks.parsers.gpu_q import GpuQ

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


