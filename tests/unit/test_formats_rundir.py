"""launcher.formats.rundir owns the run directory: its paths, its readers (metrics, heartbeats), the
checkpoints' `latest` pointer, and no other module spells the layout (issue 15 section 4)."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest

from launcher.errors import UserError
from launcher.formats import rundir
from launcher.formats.rundir import (
    RunDir,
    latest_checkpoint,
    read_heartbeats,
    read_metrics,
    resume_target,
)
from launcher.formats.tokens import check_token_file
from tests.conftest import REPO

pytestmark = pytest.mark.unit

# The names of the layout. A path made of one of these anywhere but launcher/formats is a second copy.
FILES = {rundir.PLAN, rundir.JOB, rundir.METRICS, rundir.LOCK, "node0.log", "rank*.json", "rank*.txt",
         rundir.CHECKPOINT_EXTRA}
PARTS = {*FILES, "logs", "nccl", "flight", "stacks", "ras", "heartbeat", "checkpoints", "exit_code", "latest"}


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def _is_layout(text: str, joined: bool) -> bool:
    """Whether a string literal spells part of the layout: a layout file name on its own, a path with
    a layout component ('logs/nccl', '/heartbeat'), or (when it is joined onto a path) any part."""
    if any(c.isspace() for c in text):
        return False  # prose (help text, messages) may name the files
    if text in FILES:
        return True
    parts = [p for p in text.split("/") if p]
    if joined:
        return any(p in PARTS for p in parts)
    return "/" in text and any(p in PARTS for p in parts)


def layout_spellings(path: Path, root: Path = REPO) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        operands = []
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):  # Path / "heartbeat"
            operands = [node.left, node.right]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "Path", "joinpath", "join", "glob", "rglob"):
            operands = list(node.args)
        for op in operands:
            if isinstance(op, ast.Constant) and isinstance(op.value, str) and _is_layout(op.value, True):
                found.append(f"{path.relative_to(root)}:{op.lineno} {op.value!r}")
        if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
                and _is_layout(node.value, False)):
            found.append(f"{path.relative_to(root)}:{node.lineno} {node.value!r}")
    return sorted(set(found))


def _sources() -> list[Path]:
    return [p for pkg in ("launcher", "checks") for p in sorted((REPO / pkg).rglob("*.py"))
            if not p.is_relative_to(REPO / "launcher" / "formats")]


def test_the_spelling_check_finds_a_copy(tmp_path):
    """The rule below would pass on a blind scan: it must catch each way a copy was written before."""
    src = tmp_path / "copy.py"
    src.write_text('"""plan.json is named in a docstring, which is fine."""\n'
                   'from pathlib import Path\n'
                   'a = Path(d) / "heartbeat"\n'
                   'b = Path(d, "checkpoints", "latest")\n'
                   'c = f"{d}/logs/nccl/%h.%p.log"\n'
                   'e = "metrics.jsonl"\n'
                   'f = sorted(Path(d).glob("rank*.json"))\n'
                   'g = {"heartbeat": 8}  # a finding kind, not a path\n'
                   'h = "see logs/nccl for more"\n')
    found = layout_spellings(src, tmp_path)
    lines = sorted({int(f.split(":")[1].split()[0]) for f in found})
    assert lines == [3, 4, 5, 6, 7], found


def test_no_module_outside_formats_spells_the_run_dir():
    found = [f for p in _sources() for f in layout_spellings(p)]
    assert found == [], "spell these through launcher.formats.rundir (RunDir):\n" + "\n".join(found)


def test_paths(tmp_path):
    rd = RunDir(tmp_path)
    assert rd.plan == tmp_path / "plan.json" and rd.metrics == tmp_path / "metrics.jsonl"
    assert rd.heartbeat_file(3) == tmp_path / "heartbeat" / "rank3.json"
    assert rd.nccl_debug_file() == f"{tmp_path}/logs/nccl/%h.%p.log"
    assert rd.flight_prefix() == f"{tmp_path}/logs/flight/rank_"
    assert rd.exit_code == tmp_path / "logs" / "exit_code"
    assert rd.stack_file(0) == tmp_path / "logs" / "stacks" / "rank0.txt"


def test_read_metrics_last_record_wins_and_torn_lines_are_skipped(tmp_path):
    assert read_metrics(tmp_path) == []
    RunDir(tmp_path).metrics.write_text('{"step": 1, "loss": 9}\n{"step": 2, "loss": 8}\nnot json\n'
                                        '{"step": 2, "loss": 7}\n{"loss": 1}\n{"step": 3, "lo')
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [(1, 9), (2, 7)]


def test_read_heartbeats_by_rank_skipping_unreadable(tmp_path):
    rd = RunDir(tmp_path)
    rd.heartbeat.mkdir()
    for rank in (2, 0, 1):
        rd.heartbeat_file(rank).write_text(json.dumps({"rank": rank, "step": 5}))
    rd.heartbeat_file(3).write_text('{"rank": 3, "st')
    assert [b["rank"] for b in read_heartbeats(tmp_path)] == [0, 1, 2]


def _checkpoint(d: Path, step: int, complete: bool = True) -> Path:
    p = d / f"step-{step}"
    p.mkdir(parents=True)
    if complete:
        (p / ".metadata").write_bytes(b"")
        (p / rundir.CHECKPOINT_EXTRA).write_bytes(b"")
    return p


def test_latest_checkpoint_follows_the_pointer_else_the_newest_complete(tmp_path, capsys):
    ck = RunDir(tmp_path).checkpoints
    assert latest_checkpoint(ck) is None
    s2, s4 = _checkpoint(ck, 2), _checkpoint(ck, 4)
    _checkpoint(ck, 6, complete=False)
    assert latest_checkpoint(ck) == s4                      # no pointer: the newest complete one
    (ck / rundir.LATEST).write_text("step-2\n")
    assert latest_checkpoint(ck) == s2                      # the pointer wins
    (ck / rundir.LATEST).write_text("step-6")
    assert latest_checkpoint(ck) == s4                      # it names an incomplete one: said, and skipped
    assert "names 'step-6', which is not a complete checkpoint; using step-4" in capsys.readouterr().err
    (ck / rundir.LATEST).write_text("../../elsewhere")
    assert latest_checkpoint(ck, warn=False) == s4


def test_resume_target(tmp_path):
    ck = RunDir(tmp_path).checkpoints
    s2 = _checkpoint(ck, 2)
    assert resume_target(tmp_path) == (ck, None)
    assert resume_target(ck) == (ck, None)
    assert resume_target(s2) == (ck, s2)
    assert resume_target(_checkpoint(ck, 3, complete=False)) is None
    assert resume_target(tmp_path / "nothing") is None


def test_token_file_checked_without_the_trainer(tmp_path):
    """`launch run` checks a token file through formats.tokens (no torch in the CLI process)."""
    data = tmp_path / "d.bin"
    data.write_bytes(b"\x01\x00" * 10)
    with pytest.raises(UserError, match="has no sidecar"):
        check_token_file(data, 256, 4)
    side = Path(str(data) + ".json")
    side.write_text(json.dumps({"dtype": "uint16", "vocab": 256, "tokens": 10}))
    assert check_token_file(data, 256, 4)["tokens"] == 10
    with pytest.raises(UserError, match="fewer than one sequence"):
        check_token_file(data, 256, 16)
    os.truncate(data, 19)
    with pytest.raises(UserError, match="truncated or the sidecar stale"):
        check_token_file(data, 256, 4)


def test_formats_doc_is_current():
    """docs/formats.md: plan.json's table is the model's, and every BandwidthMap field is described."""
    import dataclasses

    from launcher.formats.bwmap import BandwidthMap, CheckResult, NodeReport, PairReport
    from launcher.plan.model import plan_schema
    from launcher.plan.schema_doc import table

    text = (REPO / "docs" / "formats.md").read_text()
    assert "\n".join(table(plan_schema())) in text, "docs/formats.md's plan.json table is stale"
    for cls in (BandwidthMap, NodeReport):
        missing = [f.name for f in dataclasses.fields(cls) if f"| `{f.name}` |" not in text]
        assert missing == [], f"docs/formats.md does not describe {cls.__name__}.{missing}"
    for record in (PairReport, CheckResult):
        assert all(f"`{f.name}`" in text for f in dataclasses.fields(record)), record.__name__
    assert "[docs/formats.md](docs/formats.md)" in (REPO / "README.md").read_text()
