"""`launch verify PLAN|JOB`: trace the bundled trainer at the plan's full size on this CPU.

Thin: reads a plan.json (or plans a job file), hands it to launcher.verify, prints the table.
torch is imported only when a plan is traced, never at `launch` start-up.
"""

from __future__ import annotations

from pathlib import Path

import click

from launcher.commands import emit, json_option, progress
from launcher.errors import UserError
from launcher.plan.model import Plan


def load_plan_or_job(path: str, bwmap: str | None = None, plan_path: str | None = None) -> Plan:
    """A plan.json as written by `launch plan -o`, a job file planned now (its best plan), or a job file
    with --plan plan.json (the plan, checked against the job)."""
    from launcher.commands.sources import load_launch

    if not Path(path).is_file():
        raise UserError(f"{path}: no such file (give a plan.json or a job file)")
    return load_launch(path, plan_path, bwmap).plan


def own_code_line(plan: Plan) -> str:
    """Why a plan that runs train.entrypoint is not traced: verify builds the bundled trainer, not foreign code."""
    from launcher.plan.entrypoint import NOT_VERIFIED

    entry = plan.train.entrypoint
    label = entry.label if entry is not None else "?"
    return (f"{plan.name}: memory {NOT_VERIFIED}: train.entrypoint runs {label}, and launch verify can trace only "
            "the bundled trainer; the plan's memory figures are the bundled trainer's ledger")


def verify_plan(plan: Plan, as_json: bool, quiet: bool = False):
    """Trace `plan` and return the report; progress lines go to stderr."""
    from launcher.verify import trace_plan

    return trace_plan(plan, progress=None if (as_json or quiet) else progress)


@click.command()
@click.argument("plan_or_job", type=click.Path(dir_okay=False))
@click.option("--bwmap", type=click.Path(dir_okay=False), help="A BandwidthMap, when PLAN_OR_JOB is a job file.")
@click.option("--plan", "plan_path", type=click.Path(dir_okay=False),
              help="With a job file: trace this plan.json, after checking it was made for the job.")
@json_option
def verify(plan_or_job: str, bwmap: str | None, plan_path: str | None, as_json: bool) -> None:
    """Trace the trainer for every rank role of a plan at its full world size (fake process group,
    no real memory): peak memory by category beside the ledger, and proof that the plan builds.

    Exit 0 when every role builds and fits, 1 when one does not. A plan whose job runs its own code
    (train.entrypoint) is not traced: one line says so, exit 0."""
    from launcher.verify import render

    plan = load_plan_or_job(plan_or_job, bwmap, plan_path)
    if plan.train.entrypoint is not None:
        from launcher.plan.entrypoint import NOT_VERIFIED

        line = own_code_line(plan)
        emit({"verdict": NOT_VERIFIED, "traced": False, "fits": None, "reason": line}, as_json, lambda: line)
        return
    rep = verify_plan(plan, as_json)
    emit(rep.to_dict(), as_json, lambda: render(rep))
    if not rep.fits:
        raise click.exceptions.Exit(1)
