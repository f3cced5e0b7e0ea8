"""`launch schema job|plan`: the JSON Schema of the job file or plan.json, from the typed models."""

from __future__ import annotations

import click

from launcher.commands import emit, json_option


@click.command()
@click.argument("which", type=click.Choice(["job", "plan"]))
@json_option
def schema(which: str, as_json: bool) -> None:
    """Print the job file's (or plan.json's) schema: a reference table, or JSON Schema with --json."""
    if which == "job":
        from launcher.plan.schema_doc import render_reference
        from launcher.plan.spec import job_schema

        s = job_schema()
        emit(s, as_json, lambda: render_reference(s))
        return
    from launcher.plan.model import plan_schema
    from launcher.plan.schema_doc import table

    s = plan_schema()

    def human() -> str:
        out = [f"plan.json, format version {s['properties']['version']['const']}", ""] + table(s)
        for name, d in s["$defs"].items():
            out += ["", f"{name}:", ""] + table(d)
        return "\n".join(out)
    emit(s, as_json, human)
