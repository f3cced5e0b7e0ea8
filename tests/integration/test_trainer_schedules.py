"""torch 2.13's split-backward pipeline schedules in the bundled trainer (`parallel.schedule:
interleaved-zero-bubble | zero-bubble-v | dualpipe-v`): loss parity with the single process on real gloo
ranks, the V stage layout, and the combinations the trainer cannot run refused with one line at plan time.

Tolerance as tests/integration/test_trainer_parity.py: every step's loss and pre-clip global gradient norm within
relative 1e-5 of the reference (fp32 on CPU; observed ~1e-7, summation order only). The layouts put the
split backward (input gradient, then the weight gradient by hand: pipelining/_backward.py) through the
trainer's own autograd ops: the sequence-parallel linears under TP (launcher/trainer/sequence_parallel.py),
CP's exchanges, FSDP2 (ZeRO 2), the lean optimizer (ZeRO 0/1), EP's all-to-all, and fewer micro-batches than
stages under ZB-V.
"""

from __future__ import annotations

from typing import Any

import pytest

from launcher.errors import UserError
from launcher.plan import capabilities
from launcher.trainer.config import config_from_plan
from tests.plan_helpers import refused
from tests.trainer_helpers import job_losses, make_plan, spawn_layouts

pytestmark = pytest.mark.integration

RTOL = 1e-5
STEPS = 3
L8 = dict(model_over={"layers": 8})
MOE = dict(model_over={"experts": 4, "experts_per_token": 2})

#: name -> (make_plan kwargs, reference name)
LAYOUTS: dict[str, tuple[dict[str, Any], str]] = {
    # ZB1P over two chunks per rank: TP's custom ops run their backward in both halves; the lean ZeRO 1
    "izb_pp2_v2_tp2_dp2_z1": (dict(pp=2, tp=2, dp=2, schedule="interleaved-zero-bubble", virtual_stages=2,
                                   zero=1, micro_batch=2), "ref"),
    # one stage per rank (ZB-H1's layout), FSDP2 ZeRO 2
    "izb_pp2_v1_dp4_z2": (dict(pp=2, dp=4, schedule="interleaved-zero-bubble", zero=2), "ref"),
    # the V: rank 0 holds stages 0 and 3 (embedding and head); CP all-gather + TP + FSDP2
    "zbv_pp2_cp2_tp2_z2": (dict(pp=2, cp=2, tp=2, schedule="zero-bubble-v", virtual_stages=2, zero=2,
                                micro_batch=2), "ref"),
    # ZB-V with fewer micro-batches (2) than pp (4): torch's order drops the missing ones
    "zbv_pp4_dp2_m2_z0": (dict(L8, pp=4, dp=2, schedule="zero-bubble-v", virtual_stages=2, zero=0,
                               micro_batch=2), "l8_ref"),
    # DualPipe-V at its fewest micro-batches (2·pp): overlapped pairs, whole and split backwards
    "dpv_pp2_dp2_z1": (dict(pp=2, dp=2, schedule="dualpipe-v", virtual_stages=2, zero=1, micro_batch=1), "ref"),
    # a mixture of experts under DualPipe-V: EP's all-to-all in both backward halves
    "moe_dpv_pp2_dp2_ep2_z1": (dict(MOE, pp=2, dp=2, ep=2, schedule="dualpipe-v", virtual_stages=2, zero=1,
                                    micro_batch=1), "moe_ref"),
}
REFS: dict[str, dict[str, Any]] = {"ref": dict(), "l8_ref": dict(L8), "moe_ref": dict(MOE)}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    work = tmp_path_factory.mktemp("schedules")
    jobs = [dict(name=n, plan=make_plan(steps=STEPS, **kw).to_dict()) for n, kw in REFS.items()]
    jobs += [dict(name=n, plan=make_plan(steps=STEPS, **kw).to_dict()) for n, (kw, _) in LAYOUTS.items()]
    return spawn_layouts(jobs, work)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_split_backward_schedules_match_the_single_process(results, name):
    ref_name = LAYOUTS[name][1]
    ref, got = job_losses(results, ref_name, STEPS), job_losses(results, name, STEPS)
    assert got == pytest.approx(ref, rel=RTOL), f"{name}: {got} vs {ref_name} {ref}"
    assert ref[0] != ref[-1], "the reference did not train"
    # a weight gradient lost or counted twice in the split (I then W) changes the norm, which Adam hides
    assert results[name]["grad_norms"] == pytest.approx(results[ref_name]["grad_norms"], rel=RTOL)


def test_the_v_layout_puts_both_ends_on_pipeline_rank_0():
    from launcher.trainer.pipeline import local_stage_ids

    assert [local_stage_ids(r, 4, 2, "zero-bubble-v") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [local_stage_ids(r, 4, 2, "interleaved-zero-bubble") for r in range(4)] == [[0, 4], [1, 5], [2, 6],
                                                                                        [3, 7]]


@pytest.mark.parametrize("kw, field", [
    (dict(pp=2, dp=4, schedule="zero-bubble-v", virtual_stages=2, zero=3), r"plan.layout.zero=3 cannot run"),
    (dict(pp=2, dp=4, schedule="interleaved-zero-bubble", virtual_stages=2, zero=2, recompute="selective"),
     r"plan.layout.recompute=selective cannot run"),
    (dict(pp=2, dp=4, schedule="zero-bubble-v", virtual_stages=2, zero=1, recompute="full"),
     r"plan.layout.recompute=full cannot run .* once per weight"),
    (dict(pp=2, dp=4, schedule="dualpipe-v", virtual_stages=2), r"plan.layout.grad_accum=2: schedule dualpipe-v "
                                                                 r"needs at least 2·pp=4"),
    (dict(pp=2, dp=4, schedule="zero-bubble-v", virtual_stages=1),
     r"plan.layout.virtual_stages=1 must be 2 with schedule zero-bubble-v"),
    (dict(pp=2, dp=4, schedule="1f1b", virtual_stages=2), r"plan.layout.virtual_stages=2 needs a schedule"),
    (dict(pp=2, dp=4, schedule="zero-bubble-v", virtual_stages=2, model_over={"tied_embeddings": True}),
     r"plan.model.tied_embeddings: cannot be tied under schedule zero-bubble-v"),
])
def test_what_the_trainer_cannot_run_is_one_line(kw, field):
    with pytest.raises(UserError, match=field) as err:
        config_from_plan(make_plan(**kw))
    assert "\n" not in str(err.value)


def test_zero_3_runs_the_split_schedules_without_data_parallelism():
    """ZeRO 3 over dp·cp = 1 shards nothing (no FSDP): nothing to refuse."""
    assert capabilities.split_backward_problem("zero-bubble-v", 3, "none", 1) is None
    assert capabilities.split_backward_problem("1f1b", 3, "selective", 8) is None


def test_compiled_stages_are_refused_under_the_split_schedules():
    assert capabilities.compile_schedule_problem("interleaved-1f1b", True) is None
    for s in capabilities.SPLIT_BACKWARD:
        assert "train.compile" in refused(capabilities.compile_schedule_problem(s, True))
        assert capabilities.compile_schedule_problem(s, False) is None
