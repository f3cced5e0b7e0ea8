"""Memory headroom (cluster.memory_headroom): nothing above it is ranked as fitting, and every plan
says how close it runs (used/limit %) and whether its memory was traced."""

from __future__ import annotations

import json

import pytest

from launcher.plan.planner import plan_job
from launcher.plan.spec import spec_from_dict
from tests.cli_helpers import invoke
from tests.conftest import EXAMPLES
from tests.plan_helpers import chosen

pytestmark = pytest.mark.unit


def job(headroom=None, **parallel):
    cluster = {"nodes": 1, "gpus_per_node": 8, "gpu": "h100-sxm"}
    if headroom is not None:
        cluster["memory_headroom"] = headroom
    return spec_from_dict({"model": "llama3-8b", "train": {"seq_len": 8192, "global_batch": 64},
                           "cluster": cluster, "parallel": parallel or "auto"})


def test_default_headroom_is_ten_percent_and_no_plan_runs_above_it():
    result = plan_job(job(), top=20)
    assert result.best is not None
    for p in [chosen(result)] + result.alternatives:
        m = p.memory
        assert m["headroom"] == 0.1 and m["limit_gb"] == 72.0
        assert m["per_gpu_gb"] <= m["limit_gb"] and m["used_pct"] <= 100
        assert abs(m["used_pct"] - 100 * m["per_gpu_gb"] / m["limit_gb"]) < 1e-3
        assert p.memory_traced is False


def test_larger_headroom_changes_what_fits():
    # the same fixed layout fits with no headroom and not with a headroom 1% larger than its slack
    fixed = dict(tp=1, cp=1, pp=1, zero=3, recompute="full", micro_batch=1)
    loose = chosen(plan_job(job(0.0, **fixed)))
    need = loose.memory["per_gpu_gb"]
    headroom = round(1 - 0.99 * need / 80, 3)
    tight = chosen(plan_job(job(headroom, **fixed)))
    assert loose.fits and not tight.fits and tight.memory["per_gpu_gb"] == need
    assert any(f"GB allowed (80 GB less {headroom:.0%} headroom)" in w for w in tight.warnings)
    # searched: a tighter limit picks a lighter layout, still under its limit
    best = chosen(plan_job(job(0.5)))
    assert best.fits and best.memory["per_gpu_gb"] <= 40.0


def test_bad_headroom_is_one_line_exit_2(tmp_path):
    f = tmp_path / "j.yaml"
    f.write_text("model: tiny\ntrain: {seq_len: 64, global_batch: 8}\ncluster: {gpu: cpu, memory_headroom: 1.5}\n")
    r = invoke("plan", str(f))
    assert r.exit_code == 2 and "cluster.memory_headroom" in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_plan_output_says_how_close_and_json_records_traced(tmp_path):
    r = invoke("plan", str(EXAMPLES / "llama3-8b-8xh100.yaml"))
    assert r.exit_code == 0 and "% of the limit (80 GB less 10% headroom; ledger)" in r.output
    assert "mem %" in r.output
    out = tmp_path / "plan.json"
    invoke("plan", str(EXAMPLES / "llama3-8b-8xh100.yaml"), "-o", str(out))
    d = json.loads(out.read_text())
    assert d["memory_traced"] is False and {"limit_gb", "used_pct", "headroom"} <= set(d["memory"])
