"""launcher/plan/schedules.py's torch-free copies of the pipeline schedules' orders against torch 2.13's own
tables (torch/distributed/pipelining/schedules.py, built without stages: launcher.verify.memtrace), and
capabilities.schedule_problem's micro-batch rules against what torch builds and runs.

Why: the ledger prices each pipeline rank at the actions of its order and the time model simulates the
orders for the bubble; a copy that drifted from torch's would price a schedule the trainer does not run.
"""

from __future__ import annotations

import contextlib
import io

import pytest

from launcher.plan import capabilities, schedules

pytestmark = pytest.mark.unit

GRID = [(pp, m) for pp in (2, 3, 4, 8) for m in (1, 2, 3, 4, 5, 7, 8, 12, 16, 17, 32)]
KINDS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}


def torch_order(schedule: str, pp: int, v: int, m: int) -> dict[int, list]:
    from launcher.verify.replay import compute_orders

    out = {}
    for r, acts in compute_orders(schedule, pp, v, m).items():
        local = {s: k for k, s in enumerate(capabilities.rank_stages(schedule, r, pp, v))}
        out[r] = [(local[a.stage_index], a.microbatch_index, KINDS[a.computation_type.name]) for a in acts]
    return out


def _valid(schedule: str, pp: int, v: int, m: int) -> bool:
    """Whether torch's table for these lowers to communication and simulates without a deadlock."""
    from torch.distributed.pipelining.schedules import (
        OVERLAP_F_B,
        REDUCE_GRAD,
        RESHARD,
        UNSHARD,
        _simulate_comms_compute,
    )

    from launcher.verify.replay import _built_without_stages

    try:
        s = _built_without_stages(schedule, pp, v, m)
        s._prepare_schedule_with_comms(s.pipeline_order)
        order = {r: [x for a in acts if a.computation_type not in (UNSHARD, RESHARD, REDUCE_GRAD)
                     for x in (a.sub_actions if a.computation_type == OVERLAP_F_B else (a,))]
                 for r, acts in s.pipeline_order_with_comms.items()}
        with contextlib.redirect_stdout(io.StringIO()):
            _simulate_comms_compute(order, lambda st: s.stage_index_to_group_rank[st], pp * v)
    except (ValueError, AssertionError, ZeroDivisionError):
        return False
    # torch's constructors' own checks beyond the table (ScheduleDualPipeV: at least as many as stages;
    # ScheduleInterleavedZeroBubble: whole rounds of max(1, m // pp))
    if schedule == "interleaved-zero-bubble" and m % max(1, m // pp):
        return False
    return not (schedule == "dualpipe-v" and m < 2 * pp)


@pytest.mark.parametrize("schedule, v", [("interleaved-zero-bubble", 1), ("interleaved-zero-bubble", 2),
                                         ("interleaved-zero-bubble", 3), ("zero-bubble-v", 2),
                                         ("dualpipe-v", 2), ("interleaved-1f1b", 2)])
def test_the_copies_are_torchs_orders(schedule, v):
    pytest.importorskip("torch")
    for pp, m in GRID:
        if capabilities.schedule_problem(schedule, m, pp):
            continue
        want = torch_order(schedule, pp, v, m)
        for r in range(pp):
            assert list(schedules.rank_order(schedule, pp, v, m, r)) == want[r], (schedule, pp, v, m, r)


@pytest.mark.parametrize("schedule, v", [("interleaved-zero-bubble", 1), ("interleaved-zero-bubble", 2),
                                         ("zero-bubble-v", 2), ("dualpipe-v", 2)])
def test_the_micro_batch_rules_are_torchs(schedule, v):
    """schedule_problem refuses exactly the counts whose table torch cannot build or would deadlock on."""
    pytest.importorskip("torch")
    for pp, m in GRID:
        ours = capabilities.schedule_problem(schedule, m, pp) is None
        assert ours == _valid(schedule, pp, v, m), (schedule, pp, m, capabilities.schedule_problem(schedule, m, pp))


def test_every_action_once():
    for schedule, v in (("zero-bubble-v", 2), ("dualpipe-v", 2), ("interleaved-zero-bubble", 2)):
        for pp, m in ((4, 8), (8, 16)):
            for r in range(pp):
                order = schedules.rank_order(schedule, pp, v, m, r)
                for k in range(v):
                    f = [j for kk, j, kind in order if kk == k and kind == "F"]
                    back = [j for kk, j, kind in order if kk == k and kind in ("B", "I")]
                    w = [j for kk, j, kind in order if kk == k and kind in ("B", "W")]
                    assert f == list(range(m)) and sorted(back) == list(range(m)) and sorted(w) == list(range(m))


@pytest.mark.parametrize("schedule, v", [("interleaved-zero-bubble", 2), ("interleaved-zero-bubble", 1),
                                         ("zero-bubble-v", 2), ("dualpipe-v", 2)])
def test_the_replay_count_traces_every_kind_of_action(schedule, v):
    """launch verify traces a split-backward plan at roles.replay_micro_batches and replays each rank's order
    at the plan's count through the traced actions: every action key (replay.action_keys) of torch's orders
    at larger counts must be among those of the traced one."""
    pytest.importorskip("torch")
    from launcher.verify.replay import action_keys, schedule_orders, with_waits
    from launcher.verify.roles import replay_micro_batches
    from tests.trainer_helpers import make_plan

    for pp in (2, 3, 4):
        plan = make_plan(pp=pp, schedule=schedule, virtual_stages=v, stage_layers=[1] * (pp * v),
                         model_over={"layers": pp * v}, global_batch=16, micro_batch=1)
        n = replay_micro_batches(plan)
        short = schedule_orders(schedule, pp, v, n)
        for m in (n + 1, 2 * n + 1, 4 * pp + 3):
            if capabilities.schedule_problem(schedule, m, pp):
                continue
            real = schedule_orders(schedule, pp, v, m)
            for r in range(pp):
                have = set(action_keys(with_waits(short[r]), n, pp, second=True))
                need = set(action_keys(with_waits(real[r]), m, pp, second=True))
                assert need <= have, (schedule, pp, m, r, need - have)
