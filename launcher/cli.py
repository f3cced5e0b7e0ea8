"""`launch`: the click group. Thin: each command lives in launcher/commands and is imported
only when invoked, so `launch --help` starts fast on a login node."""

from __future__ import annotations

import importlib
import sys

import click

from launcher import __version__
from launcher.errors import UserError

COMMANDS = {
    "plan": ("launcher.commands.plan_cmd:plan", "Choose TP/CP/PP/DP, ZeRO, recompute and micro-batch for a job."),
    "memory": ("launcher.commands.memory_cmd:memory", "Print the memory ledger (worked examples with no arguments)."),
    "calibrate": ("launcher.commands.calibrate_cmd:calibrate",
                  "Fit this cluster's time-model efficiency to measured runs; write a cluster profile."),
    "preflight": ("launcher.commands.preflight_cmd:preflight", "Measure nodes and links; write a bandwidth map."),
    "render": ("launcher.commands.launch_cmds:render", "Render the sbatch script or PyTorchJob manifest."),
    "submit": ("launcher.commands.launch_cmds:submit", "Submit a job to Slurm or Kubernetes."),
    "status": ("launcher.commands.launch_cmds:status", "Show a submitted job's state."),
    "logs": ("launcher.commands.launch_cmds:logs", "Show (or follow) a submitted job's logs."),
    "cancel": ("launcher.commands.launch_cmds:cancel", "Cancel a submitted job."),
    "jobs": ("launcher.commands.launch_cmds:jobs", "List submitted jobs and their state."),
    "verify": ("launcher.commands.verify_cmd:verify", "Trace the trainer at the plan's full size: memory per rank role."),
    "run": ("launcher.commands.run_cmd:run", "Plan and run a job on this machine with torchrun."),
    "diagnose": ("launcher.commands.diagnose_cmd:diagnose", "Explain a hang or failure from NCCL and trainer logs."),
    "schema": ("launcher.commands.schema_cmd:schema", "Print the JSON Schema of the job file or plan.json."),
}


def one_line(message: str) -> str:
    """An error is one line whatever user string it quotes: control characters are escaped."""
    return "".join(c if c.isprintable() or c == "\t" else repr(c)[1:-1] for c in message)


class UserFacingError(click.ClickException):
    """A UserError on its way out of click: one line, exit 2, no traceback."""

    exit_code = 2

    def show(self, file=None) -> None:
        click.echo(f"error: {one_line(self.format_message())}", err=True, file=file)


class LazyGroup(click.Group):
    """A group whose subcommands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        target, _ = COMMANDS[name]
        module, attr = target.split(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            if ctx.resilient_parsing:
                return None
            raise

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except UserError as exc:
            raise UserFacingError(str(exc)) from None

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, help_) for name, (_, help_) in COMMANDS.items()])


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="launch4d")
@click.option("-v", "--verbose", count=True, help="More detail on stderr (-v: every command run, ...).")
@click.option("-q", "--quiet", count=True, help="Less on stderr (-q: warnings and errors only; -qq: errors).")
def cli(verbose: int, quiet: int) -> None:
    """launch4d: preflight, plan and launch 4D-parallel LLM training on Slurm and Kubernetes.

    Shell completion (bash, zsh or fish): eval "$(_LAUNCH_COMPLETE=bash_source launch)"."""
    from launcher.commands import set_verbosity

    set_verbosity(verbose, quiet)


def main() -> None:
    try:
        rv = cli.main(standalone_mode=False, prog_name="launch")  # also under python -m launcher
        if isinstance(rv, int):
            sys.exit(rv)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.exceptions.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except UserError as exc:
        click.echo(f"error: {one_line(str(exc))}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
