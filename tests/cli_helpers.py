"""The three ways a test runs `launch ARGS`, written once (with the state folder a test's runs need).

- `launch`: the console script in a child process, as a user's shell runs it (exit status, stdout and
  stderr as the user sees them; nothing of the test process leaks in);
- `invoke`: click's CliRunner in this process, where a test's monkeypatched fakes reach the command;
- `run_main`: main() in this process, which keeps the exit status a command returns (CliRunner drops it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from launcher.cli import cli, main

#: the console script `pip install` put beside this interpreter
LAUNCH = str(Path(sys.executable).with_name("launch"))


def launch(*args: object, env: Mapping[str, str] | None = None, cwd: Path | None = None,
           timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """`launch ARGS` (each str()'d) in a child process; env None inherits this one's."""
    return subprocess.run([LAUNCH, *map(str, args)], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=timeout)


def state_env(tmp_path: Path) -> dict[str, str]:
    """This environment with a job-state folder of the test's own, so no test sees another's jobs."""
    return {**os.environ, "LAUNCH4D_STATE": str(tmp_path / "state"), "OMP_NUM_THREADS": "1"}


def invoke(*args: object, check: bool = False) -> Result:
    """`launch ARGS` in this process; check: assert it exited 0 (its output the message)."""
    res = CliRunner().invoke(cli, [str(a) for a in args])
    if check:
        assert res.exit_code == 0, res.output
    return res


def run_main(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[int, str, str]:
    """`launch ARGS` through main() in this process: (the exit status the shell would see, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["launch", *args])
    capsys.readouterr()
    try:
        main()
        rc = 0
    except SystemExit as exc:
        rc = int(exc.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err
