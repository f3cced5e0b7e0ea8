"""Judges: turn a measured figure into pass / warn / fail with the threshold it was held to.

Bandwidth thresholds default per GPU model to the figures Azure's health checks publish for a
single-node all_reduce (../shared/notes/preflight.md §3, §9): H100 460 GB/s, H200 431, A100 228. There is no
published figure for a two-node all-GPU all_reduce, so inter-node pairs are judged against the
cluster itself (outliers below the median) unless the user sets one. Everything is configurable
from a YAML/JSON file (`JudgeConfig.load`) or flags.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from checks.health_judges import judge_xid
from checks.parsed import NodeData, parse_nccl_run
from checks.parsers.gpu_query import GpuQuery
from checks.parsers.ibstat import IbStatus
from checks.results import PreflightResults
from launcher.formats.bwmap import CheckResult, PairReport

STATUS_ORDER = {"pass": 0, "warn": 1, "fail": 2}
# Clock event reasons that are normal: none, GPU idle, software power cap (Azure logs the rest).
BENIGN_CLOCK_REASONS = {0x0, 0x1, 0x4}


@dataclass(frozen=True)
class ModelThresholds:
    intra_busbw_gbs: float | None = None
    inter_busbw_gbs: float | None = None
    source: str = ""


DEFAULT_THRESHOLDS: dict[str, ModelThresholds] = {
    "H100": ModelThresholds(460.0, None, "Azure ND H100 v5 check_nccl_allreduce 460 GB/s"),
    "H200": ModelThresholds(431.0, None, "Azure ND H200 v5 check_nccl_allreduce 431 GB/s"),
    "A100": ModelThresholds(228.0, None, "Azure ND A100 v4 check_nccl_allreduce 228 GB/s"),
}


class JudgeConfigError(ValueError):
    """A thresholds file or value that cannot be used; the message names it."""


@dataclass
class JudgeConfig:
    expected_gpus: int | None = None
    thresholds: dict[str, ModelThresholds] = field(default_factory=lambda: dict(DEFAULT_THRESHOLDS))
    min_intra_busbw_gbs: float | None = None  # overrides the per-model figure for every model
    min_inter_busbw_gbs: float | None = None
    min_all_busbw_gbs: float | None = None
    outlier_fail: float = 0.75  # below this fraction of the median: fail
    outlier_warn: float = 0.9  # below this fraction: warn
    warn_margin: float = 0.0  # within this fraction above a threshold: warn (Azure uses 0.05 for nvbandwidth)
    ecc_corrected_warn: int = 10000
    ib_rate_gbps: float | None = None  # expected port rate; default: the best seen for that HCA

    def for_model(self, model: str | None) -> ModelThresholds:
        base = ModelThresholds()
        if model:
            for key, t in self.thresholds.items():
                if key.lower() in model.lower():
                    base = t
                    break
        if self.min_intra_busbw_gbs is not None:
            base = replace(base, intra_busbw_gbs=self.min_intra_busbw_gbs, source="--min-intra-busbw")
        if self.min_inter_busbw_gbs is not None:
            base = replace(base, inter_busbw_gbs=self.min_inter_busbw_gbs)
        return base

    @classmethod
    def load(cls, path: str | Path) -> JudgeConfig:
        """YAML or JSON: {expected_gpus, outlier_fail, ..., models: {H100: {intra_busbw_gbs: 460}}}."""
        import yaml

        from launcher.errors import UserError
        from launcher.formats.files import JOB_FILE_LIMIT, read_text

        p = Path(path)
        try:
            text = read_text(p, "thresholds file", JOB_FILE_LIMIT)
            data = yaml.safe_load(text) if p.suffix in (".yaml", ".yml") else json.loads(text)
        except UserError as exc:
            raise JudgeConfigError(str(exc)) from None
        except (yaml.YAMLError, json.JSONDecodeError) as exc:
            raise JudgeConfigError(f"{p}: not valid YAML/JSON ({exc})") from None
        except RecursionError:
            raise JudgeConfigError(f"{p}: nested too deeply") from None
        return cls.from_dict(data or {}, where=str(p))

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "thresholds") -> JudgeConfig:
        if not isinstance(data, dict):
            raise JudgeConfigError(f"{where}: expected a mapping")
        cfg = cls()
        models = data.pop("models", {}) or {}
        scalars = {f for f in cls.__dataclass_fields__ if f != "thresholds"}
        for k, v in data.items():
            if k not in scalars:
                raise JudgeConfigError(f"{where}: unknown key {k!r} (valid: models, {', '.join(sorted(scalars))})")
            if v is not None and not isinstance(v, int | float):
                raise JudgeConfigError(f"{where}: {k} must be a number")
            setattr(cfg, k, v)
        if not isinstance(models, dict):
            raise JudgeConfigError(f"{where}: models must map a GPU model name to thresholds")
        for name, t in models.items():
            if not isinstance(t, dict) or set(t) - {"intra_busbw_gbs", "inter_busbw_gbs"}:
                raise JudgeConfigError(f"{where}: models.{name}: valid keys are intra_busbw_gbs, inter_busbw_gbs")
            mine = {str(name): ModelThresholds(t.get("intra_busbw_gbs"), t.get("inter_busbw_gbs"),
                                               f"{where} models.{name}")}
            cfg.thresholds = {**mine, **{k: v for k, v in cfg.thresholds.items() if k != str(name)}}  # first match wins
        return cfg


def worst(*statuses: str) -> str:
    return max(statuses, key=lambda s: STATUS_ORDER.get(s, 0)) if statuses else "pass"


def at_least(node: str, check: str, value: float, minimum: float | None, margin: float, unit: str = "GB/s",
             source: str = "") -> CheckResult:
    """value >= minimum passes; within `margin` above it warns; below fails."""
    if minimum is None:
        return CheckResult(node, check, "pass", value, None, f"{value:.1f} {unit} (no threshold set)")
    src = f" ({source})" if source else ""
    if value < minimum:
        return CheckResult(node, check, "fail", value, minimum, f"{value:.1f} {unit} is below {minimum:g} {unit}{src}")
    if value < minimum * (1 + margin):
        return CheckResult(node, check, "warn", value, minimum,
                           f"{value:.1f} {unit} is within {margin:.0%} of the {minimum:g} {unit} threshold{src}")
    return CheckResult(node, check, "pass", value, minimum, f"{value:.1f} {unit} >= {minimum:g} {unit}{src}")


def outliers(values: dict[str, float], fail_frac: float, warn_frac: float) -> dict[str, tuple[str, float, str]]:
    """Values well below the median of their peers: {key: (status, median, message)}; needs >= 3 values."""
    if len(values) < 3:
        return {}
    med = statistics.median(values.values())
    out: dict[str, tuple[str, float, str]] = {}
    if med <= 0:
        return out
    for k, v in values.items():
        frac = v / med
        if frac < fail_frac:
            out[k] = ("fail", med, f"outlier: {v:.1f} is {1 - frac:.0%} below the median {med:.1f}")
        elif frac < warn_frac:
            out[k] = ("warn", med, f"{v:.1f} is {1 - frac:.0%} below the median {med:.1f}")
    return out


def merge(base: CheckResult, status: str, message: str, threshold: Any = None) -> CheckResult:
    """`base` made at least as bad as `status`, with `message` appended."""
    if STATUS_ORDER[status] > STATUS_ORDER[base.status]:
        base.status = status
        if threshold is not None and base.threshold is None:
            base.threshold = threshold
    base.message = f"{base.message}; {message}" if base.message else message
    return base


def mode(values: list[Any]) -> Any:
    """The most common value (ties: the first seen)."""
    if not values:
        return None
    counts: dict[Any, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    return max(counts, key=lambda v: counts[v])


# ---- hardware and pair judging: one CheckResult per node and check --------------------------

def hardware_checks(data: dict[str, NodeData], cfg: JudgeConfig) -> list[CheckResult]:
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
            found: CheckResult | None = nd.problems.pop(check, None)  # a probe-level problem says it better
            out.append(found or CheckResult(h, check, status, value, threshold, msg))

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
                add("xid", worst(*(f.status for f in found)), sorted({f.figure for f in found if isinstance(f.figure, int)}),
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


def nvlink_check(h: str, nd: NodeData, common_active: int) -> list[CheckResult]:
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


def gpu_health(h: str, q: GpuQuery, cfg: JudgeConfig) -> list[CheckResult]:
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


def ib_check(h: str, ib: IbStatus, cfg: JudgeConfig, best: dict[str, float],
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


def intra_checks(data: dict[str, NodeData], cfg: JudgeConfig) -> list[CheckResult]:
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


def pair_checks(results: PreflightResults, data: dict[str, NodeData],
                 cfg: JudgeConfig) -> tuple[list[PairReport], list[CheckResult]]:
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
    checks: list[CheckResult] = []
    for h, lst in per_node.items():
        model_th = cfg.for_model(data[h].model if h in data else None)
        if score[h] <= 0:
            reasons = "; ".join(r for _, r in lst if r)
            checks.append(CheckResult(h, "nccl_inter", "fail", 0.0, model_th.inter_busbw_gbs,
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
