"""CLI commands, one module per area; shared option and output helpers live here."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import click

json_option = click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")


def emit(payload: Any, as_json: bool, human: Callable[[], str] | None = None) -> None:
    """Print JSON for CI, or the human rendering."""
    if as_json or human is None:
        click.echo(json.dumps(payload, indent=2, default=str))
    else:
        click.echo(human())


def progress(message: str) -> None:
    """Progress goes to stderr so --json stdout stays clean."""
    print(message, file=sys.stderr, flush=True)
