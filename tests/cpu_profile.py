"""Opt-in pytest plugin: wall and CPU seconds per test, so slow tests can be compared across loads.

`pytest -p tests.cpu_profile tests/test_x.py` prints the 30 costliest tests (setup + call +
teardown; a module or session fixture is charged to the test that first needs it). CPU is the
test process's own, its reaped children's (getrusage SELF + CHILDREN), and what its live
descendants have used so far (/proc: the session's trainer worker pool is charged to the tests
whose jobs it runs). Not counted: processes that are not our descendants (the test Slurm's job
steps run under its slurmd) and those whose parent died before reaping them (a killed torchrun's
workers).
"busy" is the whole machine's CPU over the same span (/proc/stat), which includes Slurm job
steps but also anything else running: read it only on a quiet machine. Set
LAUNCH4D_CPU_PROFILE=FILE to also write every test's figures there as JSON lines (under pytest-xdist
only the file has them: each worker appends its tests', with its name; the table is not printed).
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Generator
from pathlib import Path

import pytest

TOP = 30
_rows: list[tuple[str, float, float, float]] = []


def _cpu() -> float:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime + _live_descendants_cpu()


def _live_descendants_cpu() -> float:
    """CPU seconds of our live descendants and the children they reaped (utime+stime+cutime+cstime):
    a process moves from here into its parent's figure when reaped, so nothing is counted twice."""
    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            rest = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parent[int(d.name)] = int(rest[1])
        ticks[int(d.name)] = sum(int(x) for x in rest[11:15])
    ours = {os.getpid()}
    while new := {p for p, pp in parent.items() if pp in ours and p not in ours}:
        ours |= new
    return sum(ticks[p] for p in ours - {os.getpid()}) / os.sysconf("SC_CLK_TCK")


def _busy() -> float:
    """CPU seconds the whole machine has spent not idle since boot (0 where /proc/stat is absent)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)      # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    wall, cpu, busy = time.monotonic(), _cpu(), _busy()
    yield
    _rows.append((item.nodeid, time.monotonic() - wall, _cpu() - cpu, _busy() - busy))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The JSON lines, from every process that ran tests (each pytest-xdist worker appends its own)."""
    out = os.environ.get("LAUNCH4D_CPU_PROFILE")
    if out and _rows:
        worker = os.environ.get("PYTEST_XDIST_WORKER")
        with open(out, "a") as f:
            for nodeid, wall, cpu, busy in _rows:
                f.write(json.dumps({"test": nodeid, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
                                    "busy_s": round(busy, 2), **({"worker": worker} if worker else {})}) + "\n")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _rows:
        return
    tr = terminalreporter
    tr.section(f"CPU per test (top {TOP}; cpu = this process + reaped children, busy = whole machine)")
    tr.write_line(f"{'cpu s':>8} {'wall s':>8} {'busy s':>8}  test")
    for nodeid, wall, cpu, busy in sorted(_rows, key=lambda r: -r[2])[:TOP]:
        tr.write_line(f"{cpu:8.1f} {wall:8.1f} {busy:8.1f}  {nodeid}")
    tr.write_line(f"{sum(r[2] for r in _rows):8.1f} {sum(r[1] for r in _rows):8.1f} "
                  f"{sum(r[3] for r in _rows):8.1f}  total over {len(_rows)} tests")
