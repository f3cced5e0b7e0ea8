"""The bundled trainer runs the planner's uneven pipeline splits: interleaved 1F1B with a layer count
that pp·v does not divide, the first and last stage one layer fewer (launcher.plan.layout.stage_layers,
as Llama 3's 126 layers on pp 16). Loss and gradient-norm parity with one process (real gloo ranks),
at the tolerance of tests/test_trainer_parity.py."""

from __future__ import annotations

import pytest

from launcher.plan.layout import stage_layers
from tests.trainer_helpers import make_plan, spawn_layouts

pytestmark = pytest.mark.integration

RTOL = 1e-5
SIX = {"layers": 6}


@pytest.mark.slow
def test_interleaved_uneven_stage_layers_match_one_process(tmp_path):
    split = stage_layers(6, 4)
    assert split == [1, 2, 2, 1]
    jobs = [dict(name="ref6", plan=make_plan(steps=4, model_over=SIX).to_dict()),
            dict(name="pp2_v2_uneven", plan=make_plan(pp=2, dp=2, schedule="interleaved-1f1b", virtual_stages=2,
                                                      stage_layers=split, zero=1, steps=4,
                                                      model_over=SIX).to_dict())]
    res = spawn_layouts(jobs, tmp_path)
    for name in ("ref6", "pp2_v2_uneven"):
        assert "losses" in res[name], f"{name}: {res[name].get('error')}\n{res[name].get('trace', '')}"
    assert res["pp2_v2_uneven"]["losses"] == pytest.approx(res["ref6"]["losses"], rel=RTOL)
    assert res["pp2_v2_uneven"]["grad_norms"] == pytest.approx(res["ref6"]["grad_norms"], rel=RTOL)
    assert res["ref6"]["losses"][0] != res["ref6"]["losses"][-1]


@pytest.mark.slow
def test_interleaved_end_chunks_without_layers_match_one_process(tmp_path):
    """Llama 3's split of 126 layers over pp 16 × v 8: 128 one-layer chunks with the first holding
    only the embedding and the last only the output head and loss (here 6 layers over pp 2 × v 4)."""
    split = stage_layers(6, 8)
    assert split == [0, 1, 1, 1, 1, 1, 1, 0]
    jobs = [dict(name="ref6", plan=make_plan(steps=4, model_over=SIX).to_dict()),
            dict(name="pp2_v4_ends_empty", plan=make_plan(pp=2, dp=2, schedule="interleaved-1f1b", virtual_stages=4,
                                                          stage_layers=split, zero=1, steps=4,
                                                          model_over=SIX).to_dict())]
    res = spawn_layouts(jobs, tmp_path)
    for name in ("ref6", "pp2_v4_ends_empty"):
        assert "losses" in res[name], f"{name}: {res[name].get('error')}\n{res[name].get('trace', '')}"
    assert res["pp2_v4_ends_empty"]["losses"] == pytest.approx(res["ref6"]["losses"], rel=RTOL)
    assert res["pp2_v4_ends_empty"]["grad_norms"] == pytest.approx(res["ref6"]["grad_norms"], rel=RTOL)


@pytest.mark.slow
def test_interleaved_micro_batches_not_a_multiple_of_pp_match_one_process(tmp_path):
    """torch's Interleaved1F1B runs m micro-batches when m is a multiple of max(1, m // pp): 3 on pp 2
    (the planner's and the trainer's rule, capabilities.schedule_problem), with uneven chunks."""
    split = stage_layers(6, 4)
    jobs = [dict(name="ref3", plan=make_plan(steps=3, global_batch=3, model_over=SIX).to_dict()),
            dict(name="pp2_v2_m3", plan=make_plan(pp=2, schedule="interleaved-1f1b", virtual_stages=2,
                                                  stage_layers=split, zero=1, steps=3, global_batch=3,
                                                  model_over=SIX).to_dict())]
    res = spawn_layouts(jobs, tmp_path)
    for name in ("ref3", "pp2_v2_m3"):
        assert "losses" in res[name], f"{name}: {res[name].get('error')}\n{res[name].get('trace', '')}"
    assert res["pp2_v2_m3"]["losses"] == pytest.approx(res["ref3"]["losses"], rel=RTOL)
    assert res["pp2_v2_m3"]["grad_norms"] == pytest.approx(res["ref3"]["grad_norms"], rel=RTOL)
