"""The judges for one parsed output by the KIND `launch preflight parse` names (checks.parsers.KINDS)."""

from __future__ import annotations

from typing import Any

from checks.judges.dcgm import judge_dcgm_diag
from checks.judges.finding import Finding
from checks.judges.ibstat import judge_ibstat
from checks.judges.memory import judge_gpu_q
from checks.judges.nvbandwidth import judge_nvbandwidth
from checks.judges.nvlink import judge_nvlink_errors, judge_nvlink_status
from checks.judges.perftest import judge_perftest
from checks.judges.xid import judge_xid


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
