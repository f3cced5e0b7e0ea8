"""`launch export PLAN --to torchtitan|megatron`: the plan's layout as that stack's configuration.

Thin: reads a plan.json (or plans a job file), hands it to launcher.plan.export, prints the text."""

from __future__ import annotations

import click

from launcher.commands import emit, json_option, warn


@click.command()
@click.argument("plan_or_job", type=click.Path(dir_okay=False))
@click.option("--to", "target", required=True, type=click.Choice(["torchtitan", "megatron"]),
              help="torchtitan: the TOML job file's [parallelism], [training] and [activation_checkpoint] "
                   "sections; megatron: Megatron-LM's command-line flags.")
@click.option("--bwmap", type=click.Path(dir_okay=False), help="A BandwidthMap, when PLAN_OR_JOB is a job file.")
@json_option
def export(plan_or_job: str, target: str, bwmap: str | None, as_json: bool) -> None:
    """Print the configuration that realises PLAN_OR_JOB's layout in torchtitan or Megatron-LM.

    Exit 0 when the stack expresses the layout exactly; 1 when it cannot (one line each says what,
    and the nearest settings it can run are printed)."""
    from launcher.commands.verify_cmd import load_plan_or_job
    from launcher.plan.export import export as make

    out = make(load_plan_or_job(plan_or_job, bwmap), target)
    emit(out.to_dict(), as_json, lambda: out.text.rstrip("\n"))
    for line in out.cannot:
        warn(f"launch: {target} cannot express: {line}")
    if out.cannot:
        raise click.exceptions.Exit(1)
