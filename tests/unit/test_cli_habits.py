"""CLI habits (issue 15 section 7): -v/-q through logging, shell completion through click, and
user-facing text that speaks of the product alone."""

from __future__ import annotations

import json
import os
import re

import pytest

from launcher.cli import COMMANDS
from tests.cli_helpers import launch
from tests.conftest import REPO

pytestmark = pytest.mark.unit

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
    # the global flags work after the command too
    quiet_after, verbose_after = launch(*args, "-q"), launch(*args, "-v")
    assert quiet_after.stderr == ""
    assert "debug: launcher.transport.local: run here:" in verbose_after.stderr
    both = launch("-v", *args, "-q").stderr                # counted together, wherever they stand: the default
    assert "[probe]" in both and "debug:" not in both
    assert launch("-q", "plan", "no-such.yaml").stderr.startswith("error: ")  # errors are never quieted


def test_shell_completion_is_clicks():
    """README's completion line works: click's _LAUNCH_COMPLETE prints a script, and completes names."""
    script = launch(env={**os.environ, "_LAUNCH_COMPLETE": "bash_source"})
    assert script.returncode == 0 and "_LAUNCH_COMPLETE=bash_complete" in script.stdout
    words = launch(env={**os.environ, "_LAUNCH_COMPLETE": "bash_complete", "COMP_WORDS": "launch pre", "COMP_CWORD": "1"})
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


def test_errors_under_json_are_json_on_stdout(tmp_path):
    """--json (the command's, or the group's before it): an error is {"error", "field"} on stdout, as well
    as the one line on stderr, exit 2."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: tiny\ntrain: {seq_len: 64, global_batch: 8}\ncluster: {gpus_per_node: 4, gpu: cpu}\n"
                   "parallel: {tp: 2, pp: 4}\n")
    for args in (["plan", str(bad), "--json"], ["--json", "plan", str(bad)], ["render", str(bad), "--json"]):
        r = launch(*args)
        assert r.returncode == 2, args
        assert r.stderr.startswith("error: parallel.pp: 4 with tp=2 makes 8 GPUs") and len(r.stderr.splitlines()) == 1
        out = json.loads(r.stdout)
        assert out["field"] == "parallel.pp" and out["error"] == r.stderr.removeprefix("error: ").rstrip("\n")
    r = launch("plan", str(tmp_path / "none.yaml"), "--json")
    assert r.returncode == 2 and json.loads(r.stdout)["file"] == str(tmp_path / "none.yaml")
    r = launch("plan", str(bad), "--top", "x", "--json")       # click's own usage errors too
    assert r.returncode == 2 and "--top" in json.loads(r.stdout)["error"]
    r = launch("plan", str(bad))                                # without --json stdout stays empty
    assert r.returncode == 2 and r.stdout == ""


def test_log_lines_show_one_rank_prefix():
    """`launch logs`: torchrun's prefix and the trainer's logging prefix are one prefix on screen."""
    from launcher.commands.launch_cmds import one_prefix

    assert one_prefix("[rank0]: [rank0] 2026-12-01 10:00:00,000 INFO resumed") == "[rank0]: 2026-12-01 10:00:00,000 INFO resumed"
    assert one_prefix("1: [rank3]: [rank3] x") == "1: [rank3]: x"                     # after srun --label
    assert one_prefix("[rank0]: step 1/8 | loss 5.0") == "[rank0]: step 1/8 | loss 5.0"
    assert one_prefix("[rank0]: [rank1] not its own") == "[rank0]: [rank1] not its own"


def test_no_ghost_commands():
    """Every `launch X` the README, the docs and the job file's schema name is a command `launch` has
    (the schema once sent users to a `launch tokenize` that never existed)."""
    from launcher.plan.spec import job_schema

    named = re.compile(r"`launch ([a-z][a-z-]*)|^\$? ?launch ([a-z][a-z-]*)", re.M)
    ghosts = [f"{p.name}: launch {m.group(1) or m.group(2)}"
              for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
              for m in named.finditer(p.read_text()) if (m.group(1) or m.group(2)) not in COMMANDS]
    ghosts += [f"job schema: launch {w}" for w in re.findall(r"\blaunch ([a-z][a-z-]*)", json.dumps(job_schema()))
               if w not in COMMANDS]
    assert ghosts == []
    assert "export" in COMMANDS and launch("export", "--help").returncode == 0


def test_make_demo_shows_its_install_progress():
    """`make demo` on a fresh clone installs for minutes: each step says what it does before it starts,
    and the big download (torch) keeps pip's progress bar (no -q on it)."""
    recipe = (REPO / "Makefile").read_text().split("$(VENV)/.installed:", 1)[1].split("\n\n", 1)[0]
    lines = [ln.strip() for ln in recipe.splitlines()[1:] if ln.strip() and not ln.strip().startswith("#")]
    installs = [i for i, ln in enumerate(lines) if "install" in ln and not ln.startswith("@echo")]
    assert installs and all(lines[i - 1].startswith("@echo") for i in installs), lines
    torch = next(ln for ln in lines if "torch" in ln and not ln.startswith("@echo"))
    assert " -q" not in torch and "--progress-bar on" in torch
