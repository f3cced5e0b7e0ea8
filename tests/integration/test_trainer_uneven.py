"""The bundled trainer runs the planner's uneven pipeline splits: interleaved 1F1B with a layer count
that pp·v does not divide, the first and last stage one layer fewer (launcher.plan.layout.stage_layers,
as Llama 3's 126 layers on pp 16). Loss and gradient-norm parity with one process (real gloo ranks),
at the tolerance of tests/integration/test_trainer_parity.py."""

from __future__ import annotations

import pytest

from launcher.plan.layout import stage_layers
from tests.trainer_helpers import make_plan, spawn_layouts

pytestmark = pytest.mark.integration

RTOL = 1e-5
SIX = {"layers": 6}


def run_against_one_process(tmp_path, name: str, steps: int = 4, **layout) -> dict:
    """Train `layout` and the same model on one process; assert loss and grad-norm parity and return
    the reference's results."""
    ref = make_plan(steps=steps, model_over=SIX, **{k: v for k, v in layout.items() if k == "global_batch"})
    jobs = [dict(name="ref", plan=ref.to_dict()),
            dict(name=name, plan=make_plan(schedule="interleaved-1f1b", zero=1, steps=steps, model_over=SIX,
                                           **layout).to_dict())]
    res = spawn_layouts(jobs, tmp_path)
    for job in ("ref", name):
        assert "losses" in res[job], f"{job}: {res[job].get('error')}\n{res[job].get('trace', '')}"
    assert res[name]["losses"] == pytest.approx(res["ref"]["losses"], rel=RTOL)
    assert res[name]["grad_norms"] == pytest.approx(res["ref"]["grad_norms"], rel=RTOL)
    return res["ref"]


@pytest.mark.slow
def test_interleaved_uneven_stage_layers_match_one_process(tmp_path):
    split = stage_layers(6, 4)
    assert split == [1, 2, 2, 1]
    ref = run_against_one_process(tmp_path, "pp2_v2_uneven", pp=2, dp=2, virtual_stages=2, stage_layers=split)
    assert ref["losses"][0] != ref["losses"][-1]


@pytest.mark.slow
def test_interleaved_end_chunks_without_layers_match_one_process(tmp_path):
    """Llama 3's split of 126 layers over pp 16 × v 8: 128 one-layer chunks with the first holding
    only the embedding and the last only the output head and loss (here 6 layers over pp 2 × v 4)."""
    split = stage_layers(6, 8)
    assert split == [0, 1, 1, 1, 1, 1, 1, 0]
    run_against_one_process(tmp_path, "pp2_v4_ends_empty", pp=2, dp=2, virtual_stages=4, stage_layers=split)


@pytest.mark.slow
def test_interleaved_micro_batches_not_a_multiple_of_pp_match_one_process(tmp_path):
    """torch's Interleaved1F1B runs m micro-batches when m is a multiple of max(1, m // pp): 3 on pp 2
    (the planner's and the trainer's rule, capabilities.schedule_problem), with uneven chunks."""
    run_against_one_process(tmp_path, "pp2_v2_m3", steps=3, pp=2, virtual_stages=2,
                            stage_layers=stage_layers(6, 4), global_batch=3)
