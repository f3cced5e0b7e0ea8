"""MetricsLogger lines (FLOPs from the planner's formula, MFU against the plan's GPU peak) and the
per-rank heartbeat file format that `launch diagnose` reads."""

from __future__ import annotations

import io
import json
import os
import threading

import pytest

from launcher.formats.rundir import read_heartbeats, read_metrics
from launcher.plan.costs import model_flops_per_token
from launcher.trainer.metrics import Heartbeat, MetricsLogger
from tests.unit.test_trainer_data import data_plan

pytestmark = pytest.mark.unit


def test_metrics_line_figures(tmp_path):
    plan = data_plan(dp=4, micro_batch=2, seq_len=16)
    out = io.StringIO()
    log = MetricsLogger(tmp_path, 0, plan, stream=out)
    rec = log.log_step(1, loss=5.5, grad_norm=2.0, step_time_s=0.5, tokens=8 * 16, lr=1e-3)
    assert rec is not None
    fpt = model_flops_per_token(plan.model, 16)
    assert rec["tokens_per_s"] == pytest.approx(256)
    assert rec["tflops_per_gpu"] == pytest.approx(fpt * 256 / 4 / 1e12, rel=1e-3)
    assert rec["mfu"] == pytest.approx(100 * rec["tflops_per_gpu"] / 1.0, rel=1e-3)
    assert rec["peak_mem_gb"] > 0 and rec["lr"] == 1e-3
    line = json.loads((tmp_path / "metrics.jsonl").read_text())
    for key in ("step", "loss", "grad_norm", "step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "peak_mem_gb"):
        assert key in line
    assert out.getvalue().startswith("step 1/5 | loss 5.5000 | grad 2.000")


def test_only_rank0_writes_and_resume_trims_redone_steps(tmp_path):
    plan = data_plan()
    MetricsLogger(tmp_path, 1, plan, stream=io.StringIO()).log_step(1, 1.0, 1.0, 1.0, 10)
    assert not (tmp_path / "metrics.jsonl").exists()
    log = MetricsLogger(tmp_path, 0, plan, stream=io.StringIO())
    for s in range(1, 6):
        log.log_step(s, 10.0 - s, 1.0, 0.1, 10)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "lo')  # torn by a crash
    # a run resumed from the step-3 checkpoint redoes steps 4..
    log2 = MetricsLogger(tmp_path, 0, plan, stream=io.StringIO())
    log2.log_step(4, 0.5, 1.0, 0.1, 10)
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    assert [r["loss"] for r in read_metrics(tmp_path)] == [9.0, 8.0, 7.0, 0.5]


def test_heartbeat_format_and_counts(tmp_path):
    hb = Heartbeat(tmp_path, 3, "node07")
    hb.beat(0, "init")
    hb.beat(1, "forward", last_collective="all_gather")
    rec = hb.beat(1, "backward", last_collective="reduce_scatter")
    data = json.loads((tmp_path / "heartbeat" / "rank3.json").read_text())
    assert data == rec
    assert set(data) == {"rank", "host", "pid", "step", "phase", "last_collective", "collectives", "updated"}
    assert (data["rank"], data["host"], data["pid"], data["step"], data["phase"]) == (3, "node07", os.getpid(), 1,
                                                                                     "backward")
    assert data["last_collective"] == "reduce_scatter" and data["collectives"] == 2
    hb.beat(1, "optimizer")  # no collective: keeps the last one
    assert read_heartbeats(tmp_path)[0]["last_collective"] == "reduce_scatter"
    with pytest.raises(ValueError, match="phase"):
        hb.beat(1, "thinking")
    assert [p.name for p in (tmp_path / "heartbeat").iterdir()] == ["rank3.json"]  # no temp files left


def test_heartbeat_reader_never_sees_partial_file(tmp_path):
    hb = Heartbeat(tmp_path, 0, "h")
    hb.beat(0, "init")
    stop = threading.Event()
    bad = []

    def reader():
        while not stop.is_set():
            try:
                json.loads((tmp_path / "heartbeat" / "rank0.json").read_text())
            except json.JSONDecodeError as exc:
                bad.append(exc)

    t = threading.Thread(target=reader)
    t.start()
    for i in range(300):
        hb.beat(i, "forward", last_collective="x" * (i % 50))
    stop.set()
    t.join()
    assert not bad
