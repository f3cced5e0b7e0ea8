"""`launch diagnose`: explain a hang or failure from what a job left behind.

The seed's sixth failure mode: a timeout usually means one rank died or one node is slow, so find
which instead of raising the timeout. Parsers (nccl_init, failures, flight, heartbeat) each read
their own kind of evidence; collect walks the input and ranks the findings (findings).
"""

from __future__ import annotations

from pathlib import Path

from launcher.diagnose.collect import build_report, read_sources
from launcher.diagnose.findings import Finding, Report
from launcher.errors import UserError

__all__ = ["Finding", "Report", "diagnose"]


def diagnose(target: str | Path, plan_path: str | Path | None = None,
             bwmap_path: str | Path | None = None) -> Report:
    """Read a log dir or file (plus an optional plan.json and bandwidth map) and explain it."""
    from launcher.formats.bwmap import BandwidthMap, BandwidthMapError
    from launcher.plan.model import Plan

    plan = Plan.load(plan_path) if plan_path else None
    bwmap = None
    if bwmap_path:
        try:
            bwmap = BandwidthMap.load(bwmap_path)
        except BandwidthMapError as exc:
            raise UserError(str(exc)) from None
    src = read_sources(Path(target))
    if plan is None:
        for p in src.plan_paths:
            try:
                plan = Plan.load(p)
                break
            except UserError:
                src.skipped.append(f"{p} (not a usable plan.json)")
    return build_report(src, plan, bwmap)
