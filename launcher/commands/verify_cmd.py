"""`launch verify PLAN|JOB`: trace the bundled trainer at the plan's full size on this CPU.

Thin: reads a plan.json (or plans a job file), hands it to launcher.verify, prints the table.
torch is imported only when a plan is traced, never at `launch` start-up.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from launcher.commands import emit, json_option, progress
from launcher.errors import UserError
from launcher.plan.model import Plan


def load_plan_or_job(path: str, bwmap: str | None = None) -> Plan:
    """A plan.json as written by `launch plan -o`, or a job file planned now (its best plan)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{path}: no such file (give a plan.json or a job file)")
    if p.suffix == ".json":
        try:
            is_plan = "world_size" in json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            is_plan = False
        if is_plan:
            return Plan.load(path)
    from launcher.plan.planner import load_bwmap, plan_job
    from launcher.plan.spec import load_spec

    spec = load_spec(path)
    bw, name = load_bwmap(spec, bwmap)
    result = plan_job(spec, bw, top=0, bwmap_name=name)
    if result.best is None:
        raise UserError(f"{path}: no layout fits, so there is no plan to verify; see `launch plan {path}`")
    return result.best


def verify_plan(plan: Plan, as_json: bool, quiet: bool = False):
    """Trace `plan` and return the report; progress lines go to stderr."""
    from launcher.verify import trace_plan

    return trace_plan(plan, progress=None if (as_json or quiet) else progress)


@click.command()
@click.argument("plan_or_job", type=click.Path(dir_okay=False))
@click.option("--bwmap", type=click.Path(dir_okay=False), help="A BandwidthMap, when PLAN_OR_JOB is a job file.")
@json_option
def verify(plan_or_job: str, bwmap: str | None, as_json: bool) -> None:
    """Trace the trainer for every rank role of a plan at its full world size (fake process group,
    no real memory): peak memory by category beside the ledger, and proof that the plan builds.

    Exit 0 when every role builds and fits, 1 when one does not."""
    from launcher.verify import render

    plan = load_plan_or_job(plan_or_job, bwmap)
    rep = verify_plan(plan, as_json)
    emit(rep.to_dict(), as_json, lambda: render(rep))
    if not rep.fits:
        raise click.exceptions.Exit(1)
