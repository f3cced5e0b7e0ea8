"""Options declared once (launcher/commands/options.py): a group reaches its command as one typed
value, its options keep their order in --help, and the preflight groups cover every option of
`launch preflight` (none left loose beside them)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import click
import pytest
from click.testing import CliRunner

from launcher.commands import preflight_opts as o
from launcher.commands.options import group
from launcher.commands.preflight_cmd import preflight

pytestmark = pytest.mark.unit


@dataclass(frozen=True)
class Pair:
    first: str
    second_value: int


def test_a_group_reaches_the_command_as_its_dataclass():
    seen = []

    @click.command()
    @click.option("--before")
    @group(Pair, "pair", click.option("--first", default="a"), click.option("--second", "second_value", type=int,
                                                                          default=2))
    @click.option("--after", is_flag=True)
    def cmd(before, pair, after):
        seen.append((before, pair, after))

    res = CliRunner().invoke(cmd, ["--second", "7", "--before", "x", "--after"])
    assert res.exit_code == 0, res.output
    assert seen == [("x", Pair("a", 7), True)]
    assert [p.name for p in cmd.params] == ["before", "first", "second_value", "after"]


def test_every_preflight_option_belongs_to_a_group_or_is_one_of_its_own():
    names = [p.name for p in preflight.params if p.expose_value]   # not launcher.cli's hidden -v/-q
    assert len(names) == len(set(names))
    ungrouped = {"backend", "dry_run", "as_json"}  # one option each, passed as they are
    grouped = {f.name for cls in (o.HostOptions, o.SSHOptions, o.CheckOptions, o.SlurmJobOptions, o.K8sOptions,
                                  o.PlanProbeOptions, o.JudgeOptions) for f in fields(cls)}
    assert set(names) == grouped | ungrouped
