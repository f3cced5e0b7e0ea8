"""The job gate's part of a rendering (`launch submit --preflight-plan`): the plan's communication
groups to measure (preflight-plan.spec.json, beside plan.json in the run dir) and what the batch
script or the gang's init container needs to run them (templates/slurm/groupprobe.sh.j2)."""

from __future__ import annotations

from typing import Any

from launcher.formats import rundir
from launcher.plan.commgroups import probe_spec
from launcher.plan.model import Plan


def probe_files(plan: Plan, tolerance: float, timeout_s: int) -> tuple[dict[str, Any], dict[str, str]]:
    """(template context `probe`, files for the run dir)."""
    import json

    spec = probe_spec(plan, tolerance=tolerance)
    ctx = {"spec": rundir.PREFLIGHT_PLAN_SPEC, "result": rundir.PREFLIGHT_PLAN, "log": rundir.PREFLIGHT_PLAN_LOG,
           "timeout_s": int(timeout_s), "tolerance": tolerance, "groups": len(spec.groups)}
    return ctx, {rundir.PREFLIGHT_PLAN_SPEC: json.dumps(spec.to_dict(), indent=1) + "\n"}
