"""CLI commands, one module per area; shared option and output helpers live here."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from typing import Any

import click

#: where the root context remembers --json (before or after the subcommand); _json_seen[0] is set once any
#: command's --json was seen, for errors raised before a context exists (launcher.cli)
JSON_KEY = "launch4d.json"
_json_seen = [False]


def _json_flag(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
    """The command's --json, or the group's (`launch --json plan ...`); remembered for the errors."""
    value = bool(value) or bool(ctx.find_root().meta.get(JSON_KEY))
    if value:
        ctx.find_root().meta[JSON_KEY] = True
        _json_seen[0] = True
    return value


json_option = click.option("--json", "as_json", is_flag=True, callback=_json_flag,
                           help="Print machine-readable JSON (errors too: {\"error\", \"field\"} on stdout).")


def emit(payload: Any, as_json: bool, human: Callable[[], str] | None = None) -> None:
    """Print JSON for CI, or the human rendering."""
    if as_json or human is None:
        click.echo(json.dumps(payload, indent=2, default=str))
    else:
        click.echo(human())


class StderrHandler(logging.Handler):
    """Writes to whatever sys.stderr is when a record comes (click's test runner swaps it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(self.format(record), file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


#: What a command tells the person running it: progress lines on stderr (so --json stdout stays clean),
#: silenced by `launch -q`; `launch -v` adds launch4d's debug records (every command run, ...).
PROGRESS = logging.getLogger("launch")
if not PROGRESS.handlers:
    PROGRESS.addHandler(StderrHandler())
    PROGRESS.setLevel(logging.INFO)
    PROGRESS.propagate = False


def set_verbosity(verbose: int, quiet: int) -> None:
    """-v: debug records of launch4d's modules too; -q: warnings only; -qq: errors only."""
    level = logging.DEBUG if verbose > quiet else {0: logging.INFO, 1: logging.WARNING}.get(quiet - verbose,
                                                                                          logging.ERROR)
    PROGRESS.setLevel(level)
    lib = logging.getLogger("launcher")
    for h in [h for h in lib.handlers if isinstance(h, StderrHandler)]:
        lib.removeHandler(h)  # one process may run several commands (tests): each sets its own
    lib.setLevel(logging.NOTSET)
    if verbose > quiet:
        handler = StderrHandler()
        handler.setFormatter(logging.Formatter("debug: %(name)s: %(message)s"))
        lib.addHandler(handler)
        lib.setLevel(logging.DEBUG)


def progress(message: str) -> None:
    """One line for the person at the terminal (stderr; -q hides it)."""
    PROGRESS.info(message)


def warn(message: str) -> None:
    """A line that matters more than progress (still shown with -q)."""
    PROGRESS.warning(message)
