"""Models brought as HuggingFace configs (tests/data/hf, written from the families' published config.json):
a shrunken copy of each — the same features (explicit head_dim, GeGLU, experts beside a dense width,
shared experts, the first layers dense, ALiBi) at toy widths — trains on CPU in one process, and under
TP, CP and EP over gloo with the single process's losses (within RTOL, as tests/integration/test_trainer_parity.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from launcher.plan.spec import ModelSpec, resolve_model
from tests.trainer_helpers import job_losses, make_plan, spawn_layouts

pytestmark = pytest.mark.integration

HF = Path(__file__).parents[1] / "data" / "hf"
RTOL = 1e-5
STEPS = 3


def shrink(m: ModelSpec) -> dict:
    """The model's features at toy widths: 64 wide, 4 heads (GQA kept), 4 experts, vocab 256."""
    out = dict(layers=2 + min(1, m.first_dense_layers), hidden=64, heads=4, kv_heads=4 if m.kv_heads == m.heads else 2,
               ffn_hidden=96, vocab=256, mlp=m.mlp, tied_embeddings=m.tied_embeddings, position=m.position,
               rope_theta=m.rope_theta)
    if m.head_dim != m.hidden // m.heads:
        out["head_dim"] = 32                         # heads·head_dim = 128 ≠ hidden, as Qwen3's and Gemma's
    if m.is_moe:
        out.update(experts=4, experts_per_token=2, first_dense_layers=min(1, m.first_dense_layers),
                   shared_experts=min(2, m.shared_experts))
        if m.moe_ffn_hidden != m.ffn_hidden:
            out["moe_ffn_hidden"] = 32
    return out


FAMILIES = {p.stem: p for p in sorted(HF.glob("*.json")) if p.stem != "deepseek-v3"}
TP = ("tp2_dp2_zero1", dict(tp=2, dp=2, zero=1, micro_batch=2))
CP_TP = ("cp2_tp2_zero3", dict(cp=2, tp=2, zero=3, micro_batch=2))
EP_PP = ("pp2_dp2_ep2_zero1", dict(pp=2, dp=2, ep=2, zero=1, schedule="1f1b"))
EP_FSDP = ("dp2_ep2_zero3", dict(dp=2, ep=2, zero=3))
#: layouts beside the single process, where a family brings a feature the parity suite's Llama and Mixtral
#: shapes lack (their plain shapes: tests/integration/test_trainer_parity.py)
LAYOUTS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "gemma-7b": [TP, CP_TP],                        # head_dim apart from hidden/heads, GeGLU, tied
    "qwen3-30b-a3b": [TP, EP_PP],                   # head_dim apart, experts narrower than ffn_hidden
    "deepseek-moe-16b": [TP, EP_PP, EP_FSDP],       # shared experts, the first layer dense (stage 0's)
    "bloom-7b1": [TP, CP_TP],                       # ALiBi
}
#: ALiBi with an odd head_dim (15: RoPE would refuse it), under TP and CP
ODD_ALIBI = dict(layers=2, hidden=60, heads=4, kv_heads=4, ffn_hidden=96, vocab=256, mlp="gelu", position="alibi",
                 tied_embeddings=True)


def _jobs() -> dict[str, tuple[dict, dict, str]]:
    """name -> (model, layout kwargs, reference name)."""
    out: dict[str, tuple[dict, dict, str]] = {}
    models = {fam: shrink(resolve_model(str(path))) for fam, path in FAMILIES.items()}
    models["odd-alibi"] = ODD_ALIBI
    for fam, model in models.items():
        out[f"{fam}/ref"] = (model, {}, f"{fam}/ref")
        for name, kw in LAYOUTS.get(fam, [TP, CP_TP] if fam == "odd-alibi" else []):
            out[f"{fam}/{name}"] = (model, kw, f"{fam}/ref")
    return out


JOBS = _jobs()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    work = tmp_path_factory.mktemp("families")
    jobs = [dict(name=n.replace("/", "__"), plan=make_plan(steps=STEPS, model_over=m, **kw).to_dict())
            for n, (m, kw, _) in JOBS.items()]
    got = spawn_layouts(jobs, work)
    return {n.replace("__", "/"): r for n, r in got.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in JOBS if n.endswith("/ref")])
def test_shrunken_family_trains_in_one_process(results, name):
    losses = job_losses(results, name, STEPS)
    assert losses[-1] < losses[0], f"{name} did not train: {losses}"


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in JOBS if not n.endswith("/ref")])
def test_shrunken_family_layout_matches_one_process(results, name):
    ref = JOBS[name][2]
    assert job_losses(results, name, STEPS) == pytest.approx(job_losses(results, ref, STEPS), rel=RTOL)
    assert results[name]["grad_norms"] == pytest.approx(results[ref]["grad_norms"], rel=RTOL)


def test_families_differ_from_each_other(results):
    """The features change the model (a shrunken Gemma is not the shrunken Llama under another name)."""
    firsts = {n: tuple(job_losses(results, n, STEPS)) for n in JOBS if n.endswith("/ref")}
    assert len(set(firsts.values())) == len(firsts)
