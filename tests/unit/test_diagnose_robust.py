"""Garbled, truncated, interleaved or hostile input never makes diagnose raise (hypothesis).

Inputs are built from the real fixture lines (cut at random points, spliced with noise, shuffled),
random text and bytes, and random JSON / pickle-like structures in the shapes diagnose recognises.
"""

from __future__ import annotations

import json
import pickle
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from launcher.diagnose import diagnose
from launcher.diagnose.collect import Sources, build_report
from launcher.diagnose.flight import Flight, load_dump
from launcher.diagnose.heartbeat import Heartbeats, parse_beat
from tests.conftest import absent, fixtures_dir

pytestmark = pytest.mark.unit

FIXTURE_DIR = fixtures_dir() / "nccl-logs"


def _fixture_lines() -> list[str]:
    lines: list[str] = []
    if FIXTURE_DIR.is_dir():
        for p in sorted(FIXTURE_DIR.iterdir()):
            lines += p.read_text(errors="replace").splitlines()
    # a few shapes that must also survive when the fixtures are absent
    return lines or ["host:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via NET/IB/0/GDRDMA",
                     "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=X) ran for 1 "
                     "milliseconds before timing out."]


LINES = _fixture_lines()


def test_real_nccl_logs_are_present():
    """The fuzzing below draws from real NCCL logs; without them it sees only the two lines above."""
    if not FIXTURE_DIR.is_dir():
        absent(f"third-party NCCL logs {FIXTURE_DIR} are absent (set LAUNCH4D_FIXTURES)")


SETTINGS = settings(max_examples=int(__import__("os").environ.get("DIAG_EXAMPLES", "60")), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def mangled_line(draw) -> str:
    line = draw(st.sampled_from(LINES))
    cut = draw(st.integers(0, len(line)))
    how = draw(st.sampled_from(["keep", "truncate", "splice", "digits", "noise"]))
    if how == "truncate":
        return line[:cut]
    if how == "splice":
        return line[:cut] + draw(st.text(max_size=20)) + line[cut:]
    if how == "digits":
        return "".join(draw(st.sampled_from("0123456789x-")) if c.isdigit() else c for c in line)
    if how == "noise":
        return draw(st.text(max_size=200))
    return line


def _report_from_lines(lines: list[str]):
    src = Sources()
    for n, line in enumerate(lines, 1):
        ev = f"x.log:{n}"
        src.init.feed(line, ev)
        src.failures.feed(line, ev, "x.log")
        src.flight.feed(line, ev)
    src.files.append("x.log")
    return build_report(src)


@SETTINGS
@given(st.lists(mangled_line(), max_size=80))
def test_mangled_fixture_lines_never_raise(lines):
    report = _report_from_lines(lines)
    json.dumps(report.to_dict())
    assert isinstance(report.verdict, str) and report.verdict
    assert all(isinstance(r, int) for r in report.stalled_ranks)


@SETTINGS
@given(st.lists(st.text(max_size=300), max_size=40))
def test_random_text_never_raises(lines):
    _report_from_lines(lines)


@SETTINGS
@given(st.binary(max_size=3000), st.sampled_from([b"", b"\x80", b"{", b"\x80\x04\x95", b"\x00"]))
def test_random_files_never_raise(data, head):
    with tempfile.TemporaryDirectory() as d:
        Path(d, "rank_0").write_bytes(head + data)
        Path(d, "a.log").write_bytes(data + b"\n" + head)
        report = diagnose(d)
        json.dumps(report.to_dict())


JSONISH = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                       lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids,
                                                                                 max_size=4), max_leaves=12)


@SETTINGS
@given(st.fixed_dictionaries({"rank": JSONISH, "step": JSONISH, "phase": JSONISH, "updated": JSONISH},
                             optional={"host": JSONISH, "pid": JSONISH, "collectives": JSONISH,
                                       "last_collective": JSONISH}),
       st.integers(0, 8))
def test_heartbeat_like_json_never_raises(obj, world):
    hb = Heartbeats()
    beat = parse_beat(json.dumps(obj), "heartbeat/rank0.json:1")
    if beat is not None:
        hb.add(beat)
    hb.findings(world or None, {})


ENTRY = st.fixed_dictionaries({}, optional={
    "process_group": st.one_of(JSONISH, st.tuples(st.text(max_size=3), st.text(max_size=3))),
    "collective_seq_id": st.one_of(st.integers(0, 9), JSONISH), "profiling_name": JSONISH,
    "state": st.sampled_from(["scheduled", "started", "completed", "x"]), "is_p2p": JSONISH})


@SETTINGS
@given(st.dictionaries(st.integers(0, 4), st.fixed_dictionaries(
    {"entries": st.lists(st.one_of(ENTRY, JSONISH), max_size=6), "pg_config": JSONISH},
    optional={"pg_status": JSONISH, "version": JSONISH}), max_size=4))
def test_flight_dump_like_pickles_never_raise(dumps):
    fl = Flight()
    for rank, dump in dumps.items():
        try:
            data = pickle.dumps(dump)
        except Exception:  # noqa: BLE001 - hypothesis may build unpicklable keys; irrelevant here
            continue
        loaded = load_dump(data)
        if loaded is not None:
            fl.add_dump(f"flight/rank_{rank}", loaded, f"flight/rank_{rank}:1")
    fl.findings({})


def test_pickle_with_code_is_refused():
    """A dump is data: a pickle that would import and call anything is not loaded."""
    class Boom:
        def __reduce__(self):
            return (print, ("pwned",))

    data = pickle.dumps({"entries": [Boom()], "pg_config": {}})
    assert load_dump(data) is None
