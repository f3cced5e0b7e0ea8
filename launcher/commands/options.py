"""Options declared once: groups that reach a command as one typed value, and the options several
commands share (--plan, --preflight, --templates, --dry-run, --tolerance).

    SSH = group(SSHOptions, "ssh", click.option("--user"), ...)
    @click.command()
    @SSH
    def cmd(ssh: SSHOptions): ...

A group's options keep their order in --help; their values are the fields of its dataclass, by
parameter name.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import click

Decorator = Callable[[Any], Any]


def options(*opts: Decorator) -> Decorator:
    """Several click options as one decorator, in the order given (as --help lists them)."""
    def decorate(f: Any) -> Any:
        for opt in reversed(opts):
            f = opt(f)
        return f
    return decorate


def group(cls: type, name: str, *opts: Decorator) -> Decorator:
    """`opts`, handed to the command as the one argument `name` = cls(**their values)."""
    fields = [f.name for f in dataclasses.fields(cls)]

    def decorate(f: Any) -> Any:
        @functools.wraps(f)
        def command(*args: Any, **kwargs: Any) -> Any:
            kwargs[name] = cls(**{n: kwargs.pop(n) for n in fields})
            return f(*args, **kwargs)
        return options(*opts)(command)
    return decorate


def dry_run_option(help: str) -> Decorator:
    return click.option("--dry-run", is_flag=True, help=help)


def tolerance_option(help: str) -> Decorator:
    """How far below the plan's assumed bandwidth a group may measure (preflight --plan, the in-job gate)."""
    return click.option("--tolerance", type=click.FloatRange(0, 1, max_open=True), default=0.3, show_default=True,
                        help=help)


def plan_option(verb: str = "launch", argument: str = "JOB_FILE", more: str = "") -> Decorator:
    """--plan: a plan.json used as it is (render, submit, run)."""
    return click.option("--plan", "plan_path", type=click.Path(dir_okay=False),
                        help=f"A plan.json to {verb} as it is (its layout, rank map and stage split), after checking "
                             f"it was made for {argument} (same model, cluster and train).{more}")


BWMAP_OPTION = click.option("--preflight", "bwmap", type=click.Path(dir_okay=False),
                            help="Bandwidth map from `launch preflight`.")


def templates_option(help: str = "Directory whose templates override ours.") -> Decorator:
    return click.option("--templates", type=click.Path(file_okay=False), help=help)
