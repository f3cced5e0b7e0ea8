"""Hybrid sharding (parallel.dp_shard) on real gloo processes: ZeRO 1-3 sharded over dp_shard·cp and
replicated over dp / dp_shard give the single process's losses and pre-clip grad norms (relative 1e-5,
as tests/integration/test_trainer_parity.py), with TP, CP, PP and a non-default mesh order; an HSDP checkpoint
resumes into plain layouts (one process, full sharding) as the uninterrupted run (DCP reshards).
"""

from __future__ import annotations

from typing import Any

import pytest

from launcher.errors import UserError
from launcher.trainer.config import config_from_plan
from tests.trainer_helpers import job_losses, make_plan, spawn_layouts

pytestmark = pytest.mark.integration

RTOL = 1e-5
STEPS = 3

LAYOUTS: dict[str, dict[str, Any]] = {
    "ref": dict(),
    # FSDP2 on the 2-D (dp_replicate 2, dp_shard 2) mesh, two micro-batches: the all-reduce once, after the last
    "dp4_shard2_zero3": dict(dp=4, dp_shard=2, zero=3),
    "dp4_shard2_zero2": dict(dp=4, dp_shard=2, zero=2),
    # the lean optimizer sharded over 2 ranks, each shard all-reduced over its 2 copies
    "dp4_shard2_zero1": dict(dp=4, dp_shard=2, zero=1),
    # the shard group is the cp pair (dp_shard 1): each CP pair a replica
    "cp2_dp2_shard1_zero3": dict(cp=2, dp=2, dp_shard=1, zero=3, micro_batch=2),
    "tp2_dp4_shard2_zero2": dict(tp=2, dp=4, dp_shard=2, zero=2, micro_batch=2),
    "tp2_cp2_dp2_shard1_zero1": dict(tp=2, cp=2, dp=2, dp_shard=1, zero=1, micro_batch=2),
    # pipelining keeps gradient sync (reduce-scatter and all-reduce) off until a stage's last micro-batch
    "pp2_dp4_shard2_zero3": dict(pp=2, dp=4, dp_shard=2, zero=3, schedule="1f1b"),
    # cp outermost: the shard group (cp, dp_shard) and the replicas are not adjacent in the rank grid
    "order_cp_pp_dp_tp_shard1_zero2": dict(cp=2, pp=2, dp=2, dp_shard=1, zero=2, micro_batch=2,
                                           mesh_order=("cp", "pp", "dp", "tp")),
}
# checkpoints written by HSDP layouts at step 2, resumed by plain ones
CKPT: dict[str, dict[str, Any]] = {
    "dp4_shard2_zero3_ckpt": dict(dp=4, dp_shard=2, zero=3, checkpoint_every=2),
    "dp4_shard2_zero1_ckpt": dict(dp=4, dp_shard=2, zero=1, checkpoint_every=2),
}
RESUMED: dict[str, tuple[dict[str, Any], str]] = {
    "plain_dp4_zero2_from_hsdp_zero3": (dict(dp=4, zero=2), "dp4_shard2_zero3_ckpt/checkpoints/step-2"),
    "one_process_from_hsdp_zero1": (dict(), "dp4_shard2_zero1_ckpt/checkpoints/step-2"),
    "plain_dp2_zero1_from_hsdp_zero3": (dict(dp=2, zero=1), "dp4_shard2_zero3_ckpt/checkpoints/step-2"),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    work = tmp_path_factory.mktemp("hsdp")
    jobs = [dict(name=n, plan=make_plan(steps=STEPS, **kw).to_dict()) for n, kw in {**LAYOUTS, **CKPT}.items()]
    jobs += [dict(name=n, plan=make_plan(steps=STEPS, **kw).to_dict(), resume=ckpt)
             for n, (kw, ckpt) in RESUMED.items()]
    return spawn_layouts(jobs, work)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in {**LAYOUTS, **CKPT} if n != "ref"])
def test_hybrid_sharding_matches_the_single_process(results, name):
    ref = job_losses(results, "ref", STEPS)
    got = job_losses(results, name, STEPS)
    assert got == pytest.approx(ref, rel=RTOL), f"{name}: {got} vs reference {ref}"
    assert ref[0] != ref[-1], "the reference did not train"
    # a replica group that averaged, or summed twice, would scale the gradient: Adam hides it, the norm does not
    assert results[name]["grad_norms"] == pytest.approx(results["ref"]["grad_norms"], rel=RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RESUMED))
def test_an_hsdp_checkpoint_resumes_in_a_plain_layout(results, name):
    """Saved at step 2 sharded over dp_shard 2 with 2 replicas (FSDP2's (Replicate, Shard) DTensors, or the
    lean optimizer's shards offered by every replica), loaded by full sharding or one process: step 3 as the
    uninterrupted reference."""
    ref = job_losses(results, "ref", STEPS)
    assert job_losses(results, name, STEPS - 2) == pytest.approx(ref[2:], rel=RTOL)


def test_the_trainer_refuses_what_hybrid_sharding_cannot_run():
    with pytest.raises(UserError, match=r"plan.layout.dp_shard=3 does not divide dp=4"):
        config_from_plan(make_plan(dp=4, dp_shard=3, zero=3))
    with pytest.raises(UserError, match=r"plan.layout.dp_shard=2 needs zero 1, 2 or 3"):
        config_from_plan(make_plan(dp=4, dp_shard=2, zero=0))
    with pytest.raises(UserError, match=r"plan.layout.dp_shard=1 with cp 1 shards over one rank"):
        config_from_plan(make_plan(dp=4, dp_shard=1, zero=2))
    with pytest.raises(UserError, match=r"plan.layout.dp_shard=2 with ep > 1"):
        config_from_plan(make_plan(dp=4, dp_shard=2, zero=1, ep=2, model_over={"experts": 4, "experts_per_token": 2}))
    assert config_from_plan(make_plan(dp=4, dp_shard=4, zero=0)).plan.dp_replicas == 1   # dp_shard = dp: plain


def test_the_mesh_splits_dp_into_replicas_outside_the_shard_group():
    from launcher.trainer.mesh import mesh_dims

    names, sizes = mesh_dims(make_plan(pp=2, dp=4, dp_shard=2, cp=2, zero=3))
    assert names == ["pp", "dp_replicate", "dp_shard", "cp", "tp"]
    assert (sizes["dp_replicate"], sizes["dp_shard"], sizes["dp"]) == (2, 2, 4)
    assert mesh_dims(make_plan(dp=4, zero=3))[0] == ["pp", "dp", "cp", "tp"]
