"""`launch verify`: the real trainer traced at a plan's full world size under a fake process group.

The CLI tests run the real tracer (torch, FakeTensorMode, the fake process group) on the tiny
example and on a large one; the torch-free parts (roles, micro-batch counts) are unit-tested.
What the tracer reports is checked against a real gloo run in test_verify_trust.py.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from launcher.verify.roles import extend, micro_batch_counts, plan_roles
from tests.conftest import EXAMPLES, REPO
from tests.trainer_helpers import make_plan

pytestmark = pytest.mark.integration


def launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=900)


def test_roles_are_pipeline_ranks_with_their_stages():
    plan = make_plan(tp=2, pp=2, dp=2, virtual_stages=2, schedule="interleaved-1f1b", global_batch=8)
    roles = plan_roles(plan)
    assert [(r.pp_rank, r.rank, r.stages, r.embedding, r.head) for r in roles] == [
        (0, 0, (0, 2), True, False), (1, 4, (1, 3), False, True)]
    assert [r.layers for r in roles] == [(1, 1), (1, 1)]
    only = plan_roles(make_plan(tp=2, dp=2))
    assert len(only) == 1 and only[0].name == "every rank"


def test_micro_batch_counts_trace_two_counts_only_when_cheaper():
    assert micro_batch_counts("none", 1, 4) == ([4], "all 4 micro-batches traced")
    counts, _ = micro_batch_counts("1f1b", 8, 256)
    assert counts == [10, 12]                      # past pp in flight, same parity as 256
    counts, _ = micro_batch_counts("1f1b", 8, 255)
    assert counts == [11, 13]
    counts, _ = micro_batch_counts("1f1b", 8, 256, pp_rank=6)
    assert counts == [8, 10]                       # 2 in flight, but 1F1B needs >= pp micro-batches
    counts, _ = micro_batch_counts("interleaved-1f1b", 4, 64)
    assert counts == [8, 12]                       # whole rounds of pp


def test_layer_extension_equals_the_full_trace():
    """Under FSDP a stage's peak is linear in its (identical) layers: traced at 2 and 3 (ZeRO 3) or
    1 and 2 (ZeRO 2, 1F1B) layers and extended to 8 (4 per stage), it equals the full trace, per category."""
    from launcher.verify import trace_plan

    model = {"layers": 8, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn_hidden": 128, "vocab": 256}
    for kw in (dict(tp=2, dp=2, zero=3), dict(pp=2, dp=2, zero=2, schedule="1f1b")):
        plan = make_plan(**kw, seq_len=64, model_over=model, global_batch=8)
        ext = trace_plan(plan, build_last_rank=False)
        full = trace_plan(plan, build_last_rank=False, full_layers=True)
        for a, b in zip(ext.roles, full.roles):
            assert "layers extended" in a.sources["activations"] and "layers" not in b.sources["activations"]
            for c, v in b.categories_gb.items():
                assert a.categories_gb[c] == pytest.approx(v, rel=1e-6, abs=1e-9), (kw, a.role.name, c)


def test_extend_steady_state_and_linear_growth():
    steady, note = extend([4, 6], [{"total": 10.0, "a": 4.0}, {"total": 10.0, "a": 4.0}], 100)
    assert steady == {"total": 10.0, "a": 4.0} and "steady" in note
    grown, note = extend([4, 6], [{"total": 10.0}, {"total": 12.0}], 100)
    assert grown == {"total": 106.0} and "linearly" in note
    moved, note = extend([4, 6], [{"total": 10.0, "a": 5.0}, {"total": 12.0, "a": 4.0}], 100)
    assert moved == {"total": 12.0, "a": 4.0} and "NOT extended" in note


def test_plan_verify_tiny_example_traces_every_category(tmp_path):
    """`launch plan --verify` on the tiny example: verify's report in the plan's JSON, and the plan
    written with memory_traced."""
    out = tmp_path / "plan.json"
    r = launch("plan", str(EXAMPLES / "tiny-cpu.yaml"), "--verify", "-o", str(out), "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)["verify"]
    assert rep["builds"] and rep["fits"] and rep["world_size"] == 4
    (role,) = rep["roles"]
    assert role["status"] == "traced" and role["role"]["name"] == "every rank"
    cats = role["categories_gb"]
    for c in ("params", "grads", "optimizer", "activations", "temporaries", "comm_buffers"):
        assert c in cats and role["sources"][c] == "traced"
    # tp=2 x dp=2, ZeRO 3, fp32, Adam: the traced optimizer state is exactly the two moments of this
    # rank's shards (plus Adam's step counters), i.e. twice the sharded fp32 parameters
    state = role["state_gb"]
    assert cats["optimizer"] == pytest.approx(state["optimizer"], rel=1e-3)
    assert cats["optimizer"] == pytest.approx(2 * state["grads"], rel=0.02)
    assert cats["activations"] > 0
    assert role["peak_gb"] == pytest.approx(sum(cats.values()), rel=1e-6)
    assert role["ledger_gb"] is not None and set(role["ledger_gb"]) == set(cats)
    assert rep["build_checks"] == [{"rank": 3, "ok": True, "error": None}]
    assert json.loads(out.read_text())["memory_traced"] is True


def test_verify_exits_1_when_a_role_does_not_fit(tmp_path):
    plan = make_plan(tp=2, dp=2)
    plan.gpu = dataclasses.replace(plan.gpu, memory_gb=1)     # 1 GB: less than the runtime allowance alone
    path = tmp_path / "plan.json"
    plan.save(path)
    r = launch("verify", str(path))
    assert r.returncode == 1, r.stderr
    assert "DOES NOT FIT" in r.stdout


def test_verify_bad_input_is_one_line_exit_2(tmp_path):
    r = launch("verify", str(tmp_path / "missing.json"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no such file" in r.stderr
    plan = make_plan(tp=2, dp=2)
    plan.layout = dataclasses.replace(plan.layout, tp=3)
    path = tmp_path / "bad.json"
    plan.save(path)
    r = launch("verify", str(path))
    assert r.returncode == 2 and r.stderr.startswith("error: plan.") and r.stderr.count("\n") == 1


def test_verify_large_example_llama3_8b():
    """A real model at its planned size: 8 ranks of Llama 3 8B (ZeRO 2, selective recompute, bf16)."""
    r = launch("verify", str(EXAMPLES / "llama3-8b-8xh100.yaml"), "--json")
    assert r.returncode in (0, 1), r.stderr
    rep = json.loads(r.stdout)
    (role,) = rep["roles"]
    assert role["status"] == "traced", role.get("error")
    cats = role["categories_gb"]
    # 8.03e9 parameters, ZeRO 2 over dp=8: fp32 master shards 4 B/param/8, Adam moments 8 B/param/8
    n = 8_030_261_248
    assert role["state_gb"]["params"] == pytest.approx(4 * n / 8 / 1e9, rel=0.01)
    assert cats["optimizer"] == pytest.approx(8 * n / 8 / 1e9, rel=0.01)
    assert role["ledger_gb"] is not None and role["difference_gb"] is not None
