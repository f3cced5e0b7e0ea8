"""The quick probes judged per node: GPU count, model and driver, topology, NVLink, ECC, PCIe, clocks,
Xids and InfiniBand ports, each against what most nodes of the cluster have (or the configured figure)."""

from __future__ import annotations

from typing import Any

from checks.judges.config import JudgeConfig
from checks.judges.figures import mode
from checks.judges.finding import Finding, merge, verdict, worst
from checks.judges.xid import judge_xid
from checks.parsed import NodeData
from checks.parsers.gpu_query import GpuQuery
from checks.parsers.ibstat import IbStatus

# Clock event reasons that are normal: none, GPU idle, software power cap (Azure logs the rest).
BENIGN_CLOCK_REASONS = {0x0, 0x1, 0x4}


def hardware_checks(data: dict[str, NodeData], cfg: JudgeConfig) -> list[Finding]:
    out: list[Finding] = []
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
            found: Finding | None = nd.problems.pop(check, None)  # a probe-level problem says it better
            out.append(found or verdict(h, check, status, value, threshold, msg))

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
            names = {str(g.name) for g in nd.gpu.gpus}
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
            out.extend(nvlink_check(h, nd, common_active))
        # ecc, pcie, clocks
        if nd.gpu and nd.gpu.gpus:
            out.extend(gpu_health(h, nd.gpu, cfg))
        # xid
        if "xid" in nd.problems:
            add("xid", "fail", None, None, "")
        elif nd.xid is not None:
            # NVIDIA's Xid catalog: hardware Xids (and a GPU lost without one) fail, application ones warn
            found = [f for f in judge_xid(nd.xid, h) if f.status != "pass"]
            if found:
                add("xid", worst(found), sorted({f.figure for f in found if isinstance(f.figure, int)}),
                    [], "; ".join(f"{f.component}: {f.message}" for f in found))
            else:
                add("xid", "pass", [], [], "no XID events")
        # ib
        if "ib" in nd.problems:
            add("ib", nd.problems["ib"].status, None, None, "")
        elif nd.ib is not None:
            out.append(ib_check(h, nd.ib, cfg, ib_best, ib_active_anywhere))
        for c in list(nd.problems.values()):
            if c.check not in ("nccl_node",):
                out.append(c)
                nd.problems.pop(c.check)
    return out


def nvlink_check(h: str, nd: NodeData, common_active: int) -> list[Finding]:
    has_nv = bool(nd.topo and nd.topo.nvlink_groups)
    if nd.nvlink is None or not any(g.links or g.all_inactive for g in nd.nvlink.gpus):
        if has_nv:
            return [verdict(h, "nvlink", "fail", 0, None, "topology shows NVLink but `nvidia-smi nvlink -s` "
                                                              "reports no links")]
        return [verdict(h, "nvlink", "pass", 0, None, "no NVLink on this node")] if nd.nvlink else []
    bad = [f"GPU{g.index}: all NVLinks inActive" for g in nd.nvlink.gpus if g.all_inactive]
    for g in nd.nvlink.gpus:
        if g.all_inactive:
            continue
        if g.links and g.active < common_active and not g.cut:
            bad.append(f"GPU{g.index} {g.active}/{len(g.links)} links up (inactive: {g.inactive})")
        elif not g.links and has_nv:
            bad.append(f"GPU{g.index} has no NVLink")
    if bad:
        return [verdict(h, "nvlink", "fail", len(bad), common_active, "; ".join(bad))]
    return [verdict(h, "nvlink", "pass", common_active, common_active, f"{common_active} links up per GPU")]


def gpu_health(h: str, q: GpuQuery, cfg: JudgeConfig) -> list[Finding]:
    ecc = verdict(h, "ecc", "pass", 0, 0, "")
    pcie = verdict(h, "pcie", "pass", None, None, "")
    clocks = verdict(h, "clocks", "pass", None, None, "")
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
    ecc.figure = unc_total
    ecc.message = ecc.message or "no uncorrectable ECC errors"
    pcie.message = pcie.message or "every GPU at full PCIe width and generation"
    clocks.message = clocks.message or "no clock limits besides idle / power cap"
    return [ecc, pcie, clocks]


def ib_check(h: str, ib: IbStatus, cfg: JudgeConfig, best: dict[str, float],
              active_anywhere: set[tuple[str, int]]) -> Finding:
    c = verdict(h, "ib", "pass", len([p for p in ib.ports if p.active]), cfg.ib_rate_gbps, "")
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
        if want and p.rate_gbps is not None and p.rate_gbps < want:  # ibv_devinfo prints no rate
            merge(c, "fail", f"{name} runs at {p.rate_gbps:g} Gb/s, expected {want:g}", threshold=want)
    c.message = c.message or f"{c.figure} ports active"
    return c


