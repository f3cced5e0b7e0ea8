"""`launch verify`: the real trainer traced at a plan's full world size under a fake process group.

The CLI tests run the real tracer (torch, FakeTensorMode, the fake process group) on the tiny
example and on the MoE one (tests/integration/test_verify_examples.py: the other tiny ones and Llama 3 8B);
the torch-free parts (roles, micro-batch counts) are unit-tested.
What the tracer reports is checked against a real gloo run in test_verify_trust.py.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from launcher.verify.roles import extend, extend_in_flight, micro_batch_counts, plan_roles, shared_traces
from tests.cli_helpers import LAUNCH, launch
from tests.conftest import EXAMPLES, REPO
from tests.trainer_helpers import make_plan

pytestmark = pytest.mark.integration


def test_roles_are_pipeline_ranks_with_their_stages():
    plan = make_plan(tp=2, pp=2, dp=2, virtual_stages=2, schedule="interleaved-1f1b", global_batch=8)
    roles = plan_roles(plan)
    assert [(r.pp_rank, r.rank, r.stages, r.embedding, r.head) for r in roles] == [
        (0, 0, (0, 2), True, False), (1, 4, (1, 3), False, True)]
    assert [r.layers for r in roles] == [(1, 1), (1, 1)]
    only = plan_roles(make_plan(tp=2, dp=2))
    assert len(only) == 1 and only[0].name == "every rank"


def test_micro_batch_counts_one_steady_state_count_or_two_that_grow():
    assert micro_batch_counts("none", 1, 3)[0] == [3]
    assert micro_batch_counts("none", 1, 64)[0] == [3]               # the 2nd backward is the steady state
    assert micro_batch_counts("1f1b", 8, 256)[0] == [10]             # 8 in flight on the first stage, + 2
    assert micro_batch_counts("1f1b", 8, 256, pp_rank=6)[0] == [4]   # 2 in flight: fewer than pp are traced
    assert micro_batch_counts("1f1b", 8, 9)[0] == [9]
    assert micro_batch_counts("gpipe", 4, 64)[0] == [4, 6]           # the peak grows with the count
    assert micro_batch_counts("interleaved-1f1b", 4, 64)[0] == [8, 12]   # whole rounds of pp


def test_pipeline_ranks_with_identical_shards_share_traces():
    """16 stages of 7, 8 x 14, 7 layers: 1F1B traces the first, the last and the two middle ranks with
    the fewest micro-batches in flight; GPipe one middle rank; interleaved 1F1B every rank."""
    layers = [7] + [8] * 14 + [7]
    plan = make_plan(pp=16, dp=2, stage_layers=layers, global_batch=128, model_over={"layers": sum(layers)})
    roles = plan_roles(plan)
    assert [r.in_flight for r in roles] == list(range(16, 0, -1))
    shares = shared_traces(roles, "1f1b")
    assert {r for r, s in shares.items() if s == (r,)} == {0, 13, 14, 15}
    assert all(shares[r] == (13, 14) for r in range(1, 13))
    gpipe_plan = make_plan(pp=16, dp=2, stage_layers=layers, global_batch=128, schedule="gpipe",
                           model_over={"layers": sum(layers)})
    gpipe = shared_traces(plan_roles(gpipe_plan), "gpipe")        # 64 in flight everywhere: one trace
    assert {r for r, s in gpipe.items() if s == (r,)} == {0, 1, 15} and gpipe[7] == (1,)
    assert shared_traces(roles, "interleaved-1f1b") == {r: (r,) for r in range(16)}


def test_extend_in_flight_is_linear_and_says_when_it_cannot_be():
    figs, linear = extend_in_flight([(3, {"a": 5.0}), (2, {"a": 4.0})], 10)
    assert linear and figs == {"a": 12.0}
    figs, linear = extend_in_flight([(2, {"a": 5.0}), (3, {"a": 4.0})], 10)
    assert not linear and figs == {"a": 4.0}


def test_shortcuts_equal_the_exact_trace():
    """Layers extended linearly (ZeRO 3 over tp x dp; ZeRO 3 with full recompute, whose buffers first
    peak at 3 layers), and a 5-stage 1F1B pipeline traced at f + 2 micro-batches with the other
    micro-batches' step-long buffers added and a middle rank extended in flight from two others: per
    role and category, what tracing every rank with all its layers and micro-batches gives.
    The six traces run two at a time (the one-role layouts keep one CPU busy each)."""
    from launcher.verify import trace_plan

    cases: list[tuple[dict[str, int], dict[str, Any]]] = [({"layers": 8}, dict(tp=2, dp=2, zero=3, global_batch=8)),
             ({"layers": 8}, dict(dp=4, zero=3, recompute="full", global_batch=8)),
             # ZeRO 2 extends from 3 and 4 layers a stage, as ZeRO 3 (roles.layer_variants): 6 a stage here;
             # 8 micro-batches: the first rank (5 in flight) traces 7 and adds the 8th's buffers
             ({"layers": 30}, dict(pp=5, dp=2, zero=2, schedule="1f1b", global_batch=16))]
    plans = [make_plan(**kw, seq_len=64, model_over={"hidden": 64, "heads": 4, "kv_heads": 2, "ffn_hidden": 128,
                                                     "vocab": 256, **over}) for over, kw in cases]
    with ThreadPoolExecutor(2) as pool:
        traces = [(pool.submit(trace_plan, p, build_last_rank=False),
                   pool.submit(trace_plan, p, build_last_rank=False, exact=True)) for p in plans]
    for (_, kw), plan, (fast_f, exact_f) in zip(cases, plans, traces):
        fast, exact = fast_f.result(), exact_f.result()
        assert any("layers extended" in r.sources["activations"] for r in fast.roles)
        if plan.pp > 1:
            assert [r.trace_of for r in fast.roles] == [[], [2, 3], [], [], []]
            assert fast.roles[0].micro_batches_traced == [7] and exact.roles[0].micro_batches_traced == [8]
            assert fast.roles[2].micro_batches_traced == [5] and exact.roles[2].micro_batches_traced == [8]
        for a, b in zip(fast.roles, exact.roles):
            assert b.status == "traced" and not b.trace_of
            for c, v in b.categories_gb.items():
                # 1e-4: the last stage's one 4-byte loss per micro-batch is not added for the untraced ones
                assert a.categories_gb[c] == pytest.approx(v, rel=1e-4, abs=1e-9), (kw, a.role.name, c)


@pytest.mark.parametrize("v, stage_layers", [(2, [1, 2, 2, 2, 2, 2, 2, 1]), (4, [0, *[1] * 14, 0])],
                         ids=["v2-uneven", "v4-evicting"])
def test_interleaved_replay_equals_the_exact_trace(v, stage_layers):
    """Interleaved 1F1B (pp 4, 8 micro-batches, ZeRO 2; v 2 with uneven stages, v 4 with the 405B
    pick's shape, embedding and head stages without layers, where torch's runtime evicts and re-gathers
    stages within the step): the embedding rank, one middle rank and the head rank traced action by
    action at 3 micro-batches, every rank's peak replayed through its own order at 8 (the other middle
    rank from its identical shard's trace): per role and category, to the byte, what tracing every
    rank's whole step gives."""
    from launcher.verify import trace_plan
    from launcher.verify.report import GB
    from launcher.verify.roles import REPLAY_MICRO_BATCHES, replays

    model = {"hidden": 64, "heads": 4, "kv_heads": 2, "ffn_hidden": 128, "vocab": 256, "layers": sum(stage_layers)}
    plan = make_plan(pp=4, dp=2, zero=2, virtual_stages=v, schedule="interleaved-1f1b", global_batch=16,
                     seq_len=64, model_over=model, stage_layers=stage_layers)
    assert replays(plan) and not replays(dataclasses.replace(plan, layout=dataclasses.replace(plan.layout, zero=3)))
    with ThreadPoolExecutor(2) as pool:        # both at once: the fast one's 3 roles leave a CPU idle
        fast_f = pool.submit(trace_plan, plan, build_last_rank=False)
        exact_f = pool.submit(trace_plan, plan, build_last_rank=False, exact=True)
    fast, exact = fast_f.result(), exact_f.result()
    assert [r.trace_of for r in fast.roles] == [[], [], [1], []]
    assert [r.micro_batches_traced for r in fast.roles] == [[REPLAY_MICRO_BATCHES]] * 2 + [[], [REPLAY_MICRO_BATCHES]]
    assert all("replaying this rank's interleaved 1F1B order at 8" in r.sources["activations"] for r in fast.roles)
    assert any(n.startswith("interleaved 1F1B: traced action by action") for n in fast.notes)
    assert all("WARNING" not in r.schedule_note for r in fast.roles)      # every replayed step closes
    for a, b in zip(fast.roles, exact.roles):
        assert b.status == "traced" and b.micro_batches_traced == [8]
        assert a.peak_gb is not None and b.peak_gb is not None, a.role.name
        assert round(a.peak_gb * GB) == round(b.peak_gb * GB), a.role.name
        for c, x in b.categories_gb.items():
            assert round(a.categories_gb[c] * GB) == round(x * GB), (a.role.name, c)


def test_three_micro_batches_hold_every_action_of_the_405b_pick():
    """The replay's claim, from torch's own schedule code (no trace): at 3 micro-batches, with the probe
    (each stage gathered, waited for and resharded once), the embedding rank, the first middle rank and
    the head rank run an action of every key that any rank of its shard runs at the plan's count —
    Llama 3 405B's pick (pp 32 x v 4, 128 micro-batches, torch evicting and re-gathering stages) and
    smaller shapes. Without the probe the middle ranks lack a reshard before the last backward."""
    from torch.distributed.pipelining.schedules import RESHARD, UNSHARD, _Action

    from launcher.verify.replay import Wait, action_keys, interleaved_orders, with_waits

    for pp, v, m in [(32, 4, 128), (32, 2, 128), (4, 4, 8), (4, 3, 12), (8, 4, 24), (2, 4, 8)]:
        real, short = interleaved_orders(pp, v, m), interleaved_orders(pp, v, 3)
        for traced, group in [(0, [0]), (1, range(1, pp - 1)), (pp - 1, [pp - 1])]:
            probe = [a for s in range(traced, pp * v, pp) for a in (_Action(s, UNSHARD), Wait(s), _Action(s, RESHARD))]
            have = set(action_keys([*probe, *with_waits(short[traced])], 3, pp))
            need = {k for r in group for k in action_keys(with_waits(real[r]), m, pp)}
            assert need <= have, (pp, v, m, traced, sorted(need - have))
            if (pp, v, traced) == (32, 4, 1):
                assert need - set(action_keys(with_waits(short[traced]), 3, pp)), (pp, v, m)


def test_extend_steady_state_and_linear_growth():
    steady, note = extend([4, 6], [{"total": 10.0, "a": 4.0}, {"total": 10.0, "a": 4.0}], 100)
    assert steady == {"total": 10.0, "a": 4.0} and "steady" in note
    grown, note = extend([4, 6], [{"total": 10.0}, {"total": 12.0}], 100)
    assert grown == {"total": 106.0} and "linearly" in note
    moved, note = extend([4, 6], [{"total": 10.0, "a": 5.0}, {"total": 12.0, "a": 4.0}], 100)
    assert moved == {"total": 12.0, "a": 4.0} and "NOT extended" in note
    buffers, note = extend([4], [{"total": 10.0, "a": 4.0, "b": 6.0}], 100, {"a": 0.5})
    assert buffers == {"total": 58.0, "a": 52.0, "b": 6.0} and "96 added" in note


def test_plan_verify_tiny_example_traces_every_category(tmp_path):
    """`launch plan --verify` on the tiny example: verify's report in the plan's JSON, and the plan
    written with memory_traced."""
    out = tmp_path / "plan.json"
    r = launch("plan", str(EXAMPLES / "tiny-cpu.yaml"), "--verify", "-o", str(out), "--json", timeout=900)
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
    assert role["peak_gb"] == pytest.approx(sum(cats.values()), rel=1e-5)     # each rounded to 6 digits
    assert role["ledger_gb"] is not None and set(role["ledger_gb"]) == set(cats)
    assert [(b["rank"], b["ok"], b["error"]) for b in rep["build_checks"]] == [(3, True, None)]
    assert json.loads(out.read_text())["memory_traced"] is True


def test_verify_exits_1_when_a_role_does_not_fit(tmp_path):
    plan = make_plan(tp=2, dp=2)
    plan.gpu = dataclasses.replace(plan.gpu, memory_gb=1)     # 1 GB: less than the runtime allowance alone
    path = tmp_path / "plan.json"
    plan.save(path)
    r = launch("verify", str(path), timeout=900)
    assert r.returncode == 1, r.stderr
    assert "DOES NOT FIT" in r.stdout


def test_verify_bad_input_is_one_line_exit_2(tmp_path):
    r = launch("verify", str(tmp_path / "missing.json"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no such file" in r.stderr
    plan = make_plan(tp=2, dp=2)
    plan.layout = dataclasses.replace(plan.layout, tp=3)
    path = tmp_path / "bad.json"
    plan.save(path)
    r = launch("verify", str(path), timeout=900)
    # the loader names the file, then the field (plan.json's invariants: one line)
    assert r.returncode == 2 and r.stderr.startswith(f"error: {path}: plan.") and r.stderr.count("\n") == 1


def test_moe_step_is_traced_with_routing_assumed_from_shapes():
    """MoE routing depends on router values FakeTensorMode does not have: under verify the trainer's
    MoE layer takes balanced per-expert counts from shapes (MoE.assumed_counts, which a real run
    leaves None), so the step — all-to-all dispatch over ep=2 included — is traced, not computed,
    and the report says which routing it assumed."""
    from launcher.trainer.moe import MoE
    from launcher.verify import trace_plan

    model = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn_hidden": 128, "vocab": 256,
             "experts": 4, "experts_per_token": 2}
    reps = {k: trace_plan(make_plan(dp=4, ep=2, zero=2, seq_len=64, global_batch=8,
                                    model_over={**model, "experts_per_token": k}), build_last_rank=False)
            for k in (1, 2)}
    for rep in reps.values():
        (role,) = rep.roles
        assert role.status == "traced" and set(role.sources.values()) == {"traced"}, role.error
        assert any(n.startswith("MoE routing assumed balanced") for n in rep.notes)
        assert role.categories_gb["optimizer"] == pytest.approx(role.state_gb["optimizer"], rel=1e-3)
    # twice the (token, expert) pairs through the experts: more activations, same state
    one, two = (reps[k].roles[0] for k in (1, 2))
    assert two.categories_gb["activations"] > one.categories_gb["activations"]
    assert two.state_gb == one.state_gb
    assert MoE.assumed_counts is None


def test_verify_mixtral_example_traces_every_moe_role(tmp_path):
    """The MoE example at its full size (64 ranks, 8 experts, top 2) under pipeline and expert parallelism
    (the planner picks plain ZeRO 3 for it since FSDP's prefetch overlap is priced, so the layout is set):
    every pipeline rank's step traced (not computed from shard shapes), with the routing assumption stated."""
    import yaml

    job = yaml.safe_load((EXAMPLES / "mixtral-8x7b.yaml").read_text())
    job["parallel"] = {"tp": 1, "cp": 1, "pp": 4, "ep": 4, "zero": 1, "recompute": "selective", "micro_batch": 1}
    path = tmp_path / "mixtral-pp4-ep4.yaml"
    path.write_text(yaml.safe_dump(job))
    r = launch("verify", str(path), "--json", timeout=900)
    assert r.returncode in (0, 1), r.stderr
    rep = json.loads(r.stdout)
    assert rep["builds"] and len(rep["roles"]) > 1
    for role in rep["roles"]:
        assert role["status"] == "traced", role.get("error")
        # traced itself, or extended from the traces of pipeline ranks with the identical shard
        assert all(s.startswith(("traced", "from the traces of")) and "computed" not in s
                   for s in role["sources"].values()), role["sources"]
    assert any(n.startswith("MoE routing assumed balanced") for n in rep["notes"])


def test_verify_traces_interleaved_1f1b_under_zero3(tmp_path):
    """Interleaved 1F1B runs a chunk's forward while another chunk's backward is pending: the tracker
    must keep the pending chunk's per-module stats (a reset on every forward lost them: KeyError on
    the FSDP block in the stage's backward, and nothing was traced)."""
    job = tmp_path / "job.yaml"
    job.write_text(
        "name: tint\nmodel: tiny\n"
        "train: {seq_len: 32, global_batch: 8, steps: 2, precision: fp32}\n"
        "cluster: {nodes: 1, gpus_per_node: 4, gpu: cpu}\n"
        "parallel: {tp: 1, cp: 1, pp: 2, dp: 2, zero: 3, virtual_stages: 2,"
        " schedule: interleaved-1f1b, micro_batch: 1, recompute: none}\n")
    r = launch("verify", str(job), "--json", timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(r.stdout)
    assert rep["builds"] and len(rep["roles"]) == 2
    for role in rep["roles"]:
        assert role["status"] == "traced", role.get("error")
        assert all(s.startswith("traced") for s in role["sources"].values()), role["sources"]


def _descendants(pid: int) -> set[int]:
    """Every live process below pid (by /proc's parent links)."""
    import os

    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out.update(kids)
        todo.extend(kids)
    return out


def test_sigterm_of_verify_leaves_no_tracing_process():
    """SIGTERM while the roles are traced: the fork server and its workers go with launch verify."""
    import os
    import signal
    import time

    proc = subprocess.Popen([LAUNCH, "verify", str(EXAMPLES / "llama3-70b-64xh100.yaml")],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline, seen = time.monotonic() + 120, set[int]()
    while len(seen) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
        seen |= _descendants(proc.pid)           # the fork server, then its tracing workers
    assert proc.poll() is None and len(seen) >= 2, proc.stderr.read()[-2000:] if proc.stderr else ""
    seen |= _descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) != 0
    time.sleep(1.0)
    alive = [p for p in seen if os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z"]
    assert alive == [], alive
