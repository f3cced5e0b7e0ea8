"""`launch`: the click group. Thin: each command lives in launcher/commands and is imported
only when invoked, so `launch --help` starts fast on a login node."""

from __future__ import annotations

import importlib
import io
import json
import re
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
    "export": ("launcher.commands.export_cmd:export",
               "Print a plan's layout as torchtitan's job-file sections or Megatron-LM's flags."),
    "run": ("launcher.commands.run_cmd:run", "Plan and run a job on this machine with torchrun."),
    "diagnose": ("launcher.commands.diagnose_cmd:diagnose", "Explain a hang or failure from NCCL and trainer logs."),
    "schema": ("launcher.commands.schema_cmd:schema", "Print the JSON Schema of the job file or plan.json."),
}


def one_line(message: str) -> str:
    """An error is one line whatever user string it quotes: control characters are escaped."""
    return "".join(c if c.isprintable() or c == "\t" else repr(c)[1:-1] for c in message)


#: An error message's leading file name (`job.yaml: ...`) and field (`cluster.gpu: ...`, `--plan: ...`).
FILE = re.compile(r"^(?P<file>[^\s:]+\.(?:ya?ml|json)): ")
FIELD = re.compile(r"^(?P<field>--[a-z][a-z0-9-]*|[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_\[\]-]+)*):")

#: `--json` was given (before or after the command): errors then go to stdout as JSON too.
from launcher.commands import JSON_KEY, _json_seen  # noqa: E402  # the --json state the commands share


def error_payload(message: str, field: str | None = None, exit_code: int = 2) -> dict:
    """What an error is under --json: {"error": the line, "field": the job-file field or option it names}."""
    f = FILE.match(message)
    file = f.group("file") if f else None
    m = FIELD.match(message[f.end():] if f else message)
    if field is None and m:
        field = m.group("field")
    out = {"error": message, "field": field, "exit_code": exit_code}
    if file:
        out["file"] = file
    return out


def json_requested(ctx: click.Context | None = None) -> bool:
    return _json_seen[0] or bool(ctx is not None and ctx.find_root().meta.get(JSON_KEY))


class UserFacingError(click.ClickException):
    """A UserError on its way out of click: one line, exit 2, no traceback (under --json, also as
    JSON on stdout)."""

    exit_code = 2

    def __init__(self, message: str, field: str | None = None, as_json: bool = False):
        super().__init__(message)
        self.field, self.as_json = field, as_json

    def show(self, file=None) -> None:
        line = one_line(self.format_message())
        if self.as_json:
            click.echo(json.dumps(error_payload(line, self.field, self.exit_code)))
        click.echo(f"error: {line}", err=True, file=file)


def _verbosity(ctx: click.Context, param: click.Parameter, value: int) -> None:
    """-v/-q after the command: added to those before it."""
    if not value or ctx.resilient_parsing:
        return
    from launcher.commands import set_verbosity

    root = ctx.find_root()
    v, q = root.meta.get("launch4d.verbosity", (0, 0))
    v, q = (v + value, q) if param.name == "verbose" else (v, q + value)
    root.meta["launch4d.verbosity"] = (v, q)
    set_verbosity(v, q)


def _global_options(cmd: click.Command) -> click.Command:
    """Give a command the group's -v/-q (so `launch plan job.yaml -v` works as `launch -v plan ...`)."""
    if getattr(cmd, "_launch4d_globals", False):
        return cmd
    names = {o for p in cmd.params for o in getattr(p, "opts", [])}
    for short, long_, help_ in (("-v", "--verbose", "As before the command: more detail on stderr."),
                                ("-q", "--quiet", "As before the command: less on stderr.")):
        if short not in names and long_ not in names:
            cmd.params.append(click.Option([short, long_], count=True, expose_value=False, callback=_verbosity,
                                           help=help_, hidden=True))
    cmd._launch4d_globals = True  # type: ignore[attr-defined]
    return cmd


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
            return _global_options(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError):
            if ctx.resilient_parsing:
                return None
            raise

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except UserError as exc:
            raise UserFacingError(str(exc), getattr(exc, "path", None) or None, json_requested(ctx)) from None

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, help_) for name, (_, help_) in COMMANDS.items()])


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="launch4d")
@click.option("-v", "--verbose", count=True, help="More detail on stderr (-v: every command run, ...).")
@click.option("-q", "--quiet", count=True, help="Less on stderr (-q: warnings and errors only; -qq: errors).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON (as the command's own --json); "
                                                      "errors too, on stdout.")
@click.pass_context
def cli(ctx: click.Context, verbose: int, quiet: int, as_json: bool) -> None:
    """launch4d: preflight, plan and launch 4D-parallel LLM training on Slurm and Kubernetes.

    -v, -q and --json work before or after the command. Shell completion (bash, zsh or fish):
    eval "$(_LAUNCH_COMPLETE=bash_source launch)"."""
    from launcher.commands import set_verbosity

    _json_seen[0] = False
    ctx.meta["launch4d.verbosity"] = (verbose, quiet)
    ctx.meta[JSON_KEY] = as_json
    set_verbosity(verbose, quiet)


def _argv_json(args: list[str]) -> bool:
    """--json among the arguments (before a `--`): for errors click raises before any command ran."""
    head = args[:args.index("--")] if "--" in args else args
    return "--json" in head


def main() -> None:
    args = sys.argv[1:]
    for stream in (sys.stdout, sys.stderr):  # a latin-1 or ASCII terminal gets '?' for an em dash, not a traceback
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="replace")
    try:
        rv = cli.main(standalone_mode=False, prog_name="launch")  # also under python -m launcher
        if isinstance(rv, int):
            sys.exit(rv)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.exceptions.ClickException as exc:
        if not isinstance(exc, UserFacingError) and (_json_seen[0] or _argv_json(args)):
            click.echo(json.dumps(error_payload(one_line(exc.format_message()), None, exc.exit_code)))
        elif isinstance(exc, UserFacingError) and not exc.as_json and _argv_json(args):
            exc.as_json = True
        exc.show()
        sys.exit(exc.exit_code)
    except UserError as exc:
        if _json_seen[0] or _argv_json(args):
            click.echo(json.dumps(error_payload(one_line(str(exc)), getattr(exc, "path", None) or None, exc.exit_code)))
        click.echo(f"error: {one_line(str(exc))}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
