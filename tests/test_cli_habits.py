"""CLI habits (issue 15 section 7): -v/-q through logging, shell completion through click, and
user-facing text that speaks of the product alone."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from launcher.cli import COMMANDS
from tests.conftest import REPO

pytestmark = pytest.mark.unit

ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def launch(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher", *args], capture_output=True, text=True, cwd=REPO,
                          env=env or ENV, timeout=120)


def test_verbosity(tmp_path):
    """A local preflight on this machine (no GPU: every probe fails, quickly): progress by default,
    nothing on stderr with -q, and with -v also the commands it ran."""
    args = ["preflight", "--backend", "local", "--no-nccl", "-o", str(tmp_path / "bw.json")]
    plain, quiet, verbose = launch(*args), launch("-q", *args), launch("-v", *args)
    assert "bandwidth map written to" in plain.stderr and "[probe]" in plain.stderr
    assert "debug:" not in plain.stderr
    assert quiet.stderr == ""
    assert "[probe]" in verbose.stderr and "debug: launcher.transport.local: run here:" in verbose.stderr
    assert plain.stdout == quiet.stdout == verbose.stdout  # stdout (the report) never depends on -v/-q
    assert launch("-q", "plan", "no-such.yaml").stderr.startswith("error: ")  # errors are never quieted


def test_shell_completion_is_clicks():
    """README's completion line works: click's _LAUNCH_COMPLETE prints a script, and completes names."""
    script = launch(env={**ENV, "_LAUNCH_COMPLETE": "bash_source"})
    assert script.returncode == 0 and "_LAUNCH_COMPLETE=bash_complete" in script.stdout
    words = launch(env={**ENV, "_LAUNCH_COMPLETE": "bash_complete", "COMP_WORDS": "launch pre", "COMP_CWORD": "1"})
    assert "plain,preflight" in words.stdout.split()


# What a user of launch4d never needs to know: the project's internal notes and history.
INTERNAL = re.compile(r"seed failure|failure mode \d|seed's|the seed\b|notes/|seed\.md|DESIGN\.md|COMMON\.md|"
                      r"issue \d+", re.I)


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_speaks_of_the_product(command):
    out = launch(*([command] if command else []), "--help")
    assert out.returncode == 0, out.stderr
    assert INTERNAL.findall(out.stdout) == []


def test_docs_speak_of_the_product():
    found = [f"{p.name}: {m}" for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
             for m in INTERNAL.findall(p.read_text())]
    assert found == []
