"""Mixture of experts in the bundled trainer, checked in one process: routing/dispatch/combine
equals a dense loop over experts (values and gradients), the seeded init of an EP-sharded
layer equals the full layer's, the EP group layout, and the config's one-line refusals.
The multi-process EP parity runs live in test_trainer_parity.py (test_moe_expert_parallel_parity).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from launcher.errors import UserError
from launcher.trainer.config import config_from_plan
from tests.trainer_helpers import make_plan

pytestmark = pytest.mark.integration

MOE = {"experts": 4, "experts_per_token": 2}


def _moe_model(**over):
    from launcher.trainer.model import Transformer

    args = make_plan(model_over={**MOE, **over}).model
    m = Transformer(args, seq_len=8)
    m.init_weights(5)
    return m


@pytest.mark.parametrize("mlp", ["swiglu", "gelu"])
def test_dispatch_and_combine_equal_dense_loop_over_experts(mlp):
    from launcher.trainer.moe import MoE, dense_reference

    moe = _moe_model(mlp=mlp).layers["0"].feed_forward
    assert isinstance(moe, MoE) and len(moe.experts) == 4
    x = torch.randn(3, 8, 64, requires_grad=True)
    out = moe(x)
    grads = torch.autograd.grad(out.pow(2).sum(), [x, *moe.parameters()])
    ref = dense_reference(moe, x)
    ref_grads = torch.autograd.grad(ref.pow(2).sum(), [x, *moe.parameters()])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
    # every token really used exactly top-2 of 4 experts, weights renormalised
    from launcher.trainer.moe import route

    w, idx = route(moe.router(x.reshape(-1, 64)), 2)
    assert torch.allclose(w.sum(-1), torch.ones(24)) and idx.shape == (24, 2)
    assert len(set(idx.reshape(-1).tolist())) > 1


def test_moe_runs_in_bf16():
    """Without FSDP, bf16 means bf16 weights: expert outputs and the residual stream are bf16."""
    from launcher.trainer.moe import dense_reference

    moe = _moe_model().layers["0"].feed_forward.to(torch.bfloat16)
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16)
    out = moe(x)
    ref = dense_reference(moe, x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_expert_sharded_init_equals_full_layer():
    from launcher.trainer.model import Transformer
    from launcher.trainer.moe import EPGroups, apply_ep

    full = _moe_model()
    part = Transformer(make_plan(model_over=MOE).model, seq_len=8)
    apply_ep(part, EPGroups(ep=2, ep_rank=1, ep_group=None, replica_group=None, replica_size=2))
    part.init_weights(5)
    names = [n for n, _ in part.named_parameters() if ".experts." in n]
    assert {n.split(".experts.")[1].split(".")[0] for n in names} == {"2", "3"}
    ref = dict(full.named_parameters())
    for name, p in part.named_parameters():
        assert torch.equal(p, ref[name]), name


def test_ep_layout_groups_split_dp_cp_only():
    from launcher.trainer.mesh import ep_layout

    sizes = {"pp": 2, "dp": 4, "cp": 1, "tp": 1}
    ep_groups, replicas = ep_layout(sizes, ["pp", "dp", "cp", "tp"], 2)
    assert ep_groups == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert replicas == [[0, 2], [1, 3], [4, 6], [5, 7]]
    # cp inside dp: dp·cp flattened; EP never mixes pipeline stages
    sizes = {"pp": 1, "dp": 2, "cp": 2, "tp": 1}
    ep_groups, replicas = ep_layout(sizes, ["pp", "dp", "cp", "tp"], 4)
    assert ep_groups == [[0, 1, 2, 3]] and replicas == [[0], [1], [2], [3]]


def test_config_accepts_moe_and_refuses_what_it_cannot_run():
    cfg = config_from_plan(make_plan(dp=4, ep=2, zero=1, model_over=MOE))
    assert cfg.model.experts == 4 and cfg.model.experts_per_token == 2 and cfg.plan.ep == 2
    config_from_plan(make_plan(dp=2, zero=3, model_over=MOE))          # ep=1: experts sharded by FSDP
    config_from_plan(make_plan(dp=4, ep=2, zero=3, model_over=MOE))    # experts: FSDP over dp·cp/ep
    cases: list[tuple[dict[str, Any], str]] = [
        (dict(tp=2, dp=2, model_over=MOE), r"plan.layout.zero=3 with a mixture-of-experts model under tp 2: .* choose zero 0 or 1"),
        (dict(dp=4, ep=2, zero=1), r"plan.layout.ep=2 needs a mixture-of-experts model"),
        (dict(dp=6, ep=3, zero=1, global_batch=6, model_over=MOE), r"plan.layout.ep=3 does not divide model.experts=4"),
        (dict(dp=2, ep=4, zero=1, model_over=MOE), r"plan.layout.ep=4 does not divide dp·cp=2"),
        (dict(model_over={"experts": 4, "experts_per_token": 5}), r"plan.model.experts_per_token: 5 exceeds experts=4"),
    ]
    for kw, msg in cases:
        with pytest.raises(UserError, match=msg):
            config_from_plan(make_plan(**kw))


@pytest.mark.slow
def test_expert_parallel_checkpoint_resumes_in_same_and_other_layout(tmp_path):
    """An ep=2 ZeRO-3 run checkpointed at step 3 resumes to the uninterrupted run's losses, in
    the same layout and re-sharded to ep=4 ZeRO 0 (experts move between ranks by name)."""
    from tests.trainer_helpers import spawn_layouts

    def plan(**kw):
        return make_plan(steps=5, model_over=MOE, **kw).to_dict()

    ckpt = "full/checkpoints/step-3"
    res = spawn_layouts([dict(name="full", plan=plan(dp=4, ep=2, zero=3, checkpoint_every=3)),
                         dict(name="same_layout", plan=plan(dp=4, ep=2, zero=3), resume=ckpt),
                         dict(name="ep4_zero0", plan=plan(dp=4, ep=4, zero=0), resume=ckpt)], tmp_path)
    full = res["full"]["losses"]
    assert len(full) == 5, res["full"]
    for name in ("same_layout", "ep4_zero0"):
        assert "losses" in res[name], res[name]
        assert res[name]["losses"] == pytest.approx(full[3:], rel=1e-5), name
