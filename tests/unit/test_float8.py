"""train.precision fp8 (issue 25 §4): which linears convert (torchtitan's filters), where fp8 is refused (GPUs
without FP8 tensor cores, in one line naming the GPU), and the sequence-parallel ops' fp8 GEMMs against torchao's
Float8Linear, bit for bit (the same rowwise recipe on the same inputs: forward, input and weight gradients).
torch._scaled_mm has a CPU kernel in torch 2.13, so all of it runs here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from launcher.errors import SpecError, UserError
from launcher.plan import capabilities, presets
from launcher.plan.capabilities import fp8_converts, fp8_problem
from launcher.plan.model import check_plan
from launcher.plan.spec import resolve_gpu, spec_from_dict
from tests.plan_helpers import chosen
from tests.trainer_helpers import make_plan

pytestmark = pytest.mark.unit


def job(gpu, **train) -> dict:
    return {"model": "llama3-8b", "train": {"seq_len": 4096, "global_batch": 64, "precision": "fp8", **train},
            "cluster": {"gpu": gpu}}


def test_auto_converts_the_large_linears_as_torchtitans_auto_filter():
    # Llama 3 70B (torchao's _auto_filter_for_rowwise thresholds): q, o and the MLP convert, k and v (1024 wide) do not
    m = presets.MODELS["llama3-70b"]
    h, kv, f = m["hidden"], m["kv_heads"] * m["hidden"] // m["heads"], m["ffn_hidden"]
    assert [fp8_converts(n, k, "auto") for n, k in [(h, h), (kv, h), (h, h), (f, h), (h, f)]] == \
        [True, False, True, True, True]
    assert not fp8_converts(4096, 2048, "auto") and fp8_converts(4112, 2064, "auto")   # N <= 4096 with K <= 2048
    assert not fp8_converts(2048, 8192, "auto") and not fp8_converts(8192, 1024, "auto")
    # all: every linear whose dims divide by 16 (the tiny preset's 176-wide MLP does; a 100-wide one does not)
    assert fp8_converts(176, 64, "all") and not fp8_converts(100, 64, "all") and not fp8_converts(64, 72, "auto")


def test_fp8_is_refused_without_fp8_tensor_cores_naming_the_gpu():
    for name in ("a100-80gb", "a100-40gb"):
        why = fp8_problem(resolve_gpu(name))
        assert why and name in why and "bf16" in why
    for name in ("h100-sxm", "h100-pcie", "h200", "b200", "gb200", "l40s", "mi300x", "mi325x", "cpu"):
        assert fp8_problem(resolve_gpu(name)) is None, name
    with pytest.raises(SpecError, match=r"train.precision: fp8 needs FP8 tensor cores, which GPU a100-80gb lacks"):
        spec_from_dict(job("a100"))
    with pytest.raises(SpecError, match=r"set cluster.gpu.fp8_tflops"):
        spec_from_dict(job({"memory_gb": 80, "peak_tflops": 500, "nvlink_gbs": 600}))
    spec = spec_from_dict(job({"memory_gb": 80, "peak_tflops": 500, "nvlink_gbs": 600, "fp8_tflops": 1000}))
    assert spec.gpu.fp8_tflops == 1000 and spec.train.fp8_linears == "auto"
    with pytest.raises(SpecError, match=r"train.fp8_linears"):
        spec_from_dict(job("h100", fp8_linears="some"))
    assert "fp8" in capabilities.table()["precisions"] and capabilities.table()["fp8_linears"] == ["auto", "all"]


def test_a_plan_for_an_fp8_run_on_an_a100_is_refused_by_the_trainer():
    import dataclasses

    plan = make_plan(precision="fp8")
    check_plan(plan)                                     # the CPU preset runs torch._scaled_mm
    with pytest.raises(UserError, match=r"plan.train.precision=fp8 needs FP8 tensor cores, which GPU a100-80gb"):
        check_plan(dataclasses.replace(plan, gpu=resolve_gpu("a100-80gb")))


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_sequence_parallel_ops_fp8_gemms_are_torchaos_float8linear_bit_for_bit(fast, dtype, monkeypatch):
    torch = pytest.importorskip("torch")
    from launcher.trainer import float8

    monkeypatch.setattr(float8, "BACKWARD_FAST_ACCUM", fast)
    monkeypatch.setattr(float8, "POST_ROWS", 16)          # several chunks of the rescaled output
    dt = getattr(torch, dtype)
    torch.manual_seed(0)
    lin = torch.nn.Sequential(torch.nn.Linear(64, 48, bias=False, dtype=dt))
    w = lin[0].weight.detach().clone()
    assert float8.convert(lin, "all", torch.device("cpu")) == 1 and type(lin[0]).__name__ == "Float8Linear"
    x = (torch.randn(2, 40, 64, dtype=dt) * torch.logspace(-2, 2, 40, dtype=dt)[:, None]).requires_grad_()
    y = lin(x)
    g = torch.randn_like(y)
    y.backward(g)
    x2, g2 = x.detach().reshape(-1, 64), g.reshape(-1, 48)
    ours = float8.linear(x2, w)
    assert ours.dtype == dt and torch.equal(ours, y.detach().reshape(-1, 48))
    assert torch.equal(float8.input_grad(g2, w), x.grad.reshape(-1, 64))
    assert torch.equal(float8.weight_grad(g2, x2), lin[0].weight.grad)
    # and it is fp8: not the high-precision product
    assert not torch.equal(ours, (x2 @ w.t()).to(dt))
    assert (ours.float() - (x2 @ w.t()).float()).abs().max() < 0.1 * (x2 @ w.t()).float().abs().max()


def test_convert_follows_the_rule_and_keeps_the_head_and_router_in_bf16():
    torch = pytest.importorskip("torch")
    from launcher.plan.spec import resolve_model
    from launcher.trainer import float8
    from launcher.trainer.model import Transformer

    cpu = torch.device("cpu")
    for rule, expect in (("all", 4 * 7), ("auto", 0)):       # the tiny preset: 4 layers of q, k, v, o, w1, w2, w3
        with torch.device("meta"):
            m = Transformer(resolve_model("tiny"), seq_len=32)
        assert float8.convert(m, rule, cpu) == expect == float8.converted(m)
    with torch.device("meta"):
        moe = Transformer(resolve_model({"layers": 2, "hidden": 64, "heads": 4, "vocab": 256, "ffn_hidden": 128,
                                         "experts": 4, "experts_per_token": 2, "shared_experts": 1,
                                         "moe_ffn_hidden": 64, "tied_embeddings": False}), seq_len=32)
    float8.convert(moe, "all", cpu)
    kinds = {n: type(mod).__name__ for n, mod in moe.named_modules()}
    assert kinds["output"] == "Linear" and kinds["layers.0.feed_forward.router"] == "Linear"
    assert kinds["layers.0.feed_forward.experts.0.w1"] == "Linear"
    assert kinds["layers.0.feed_forward.shared.w1"] == "Float8Linear" and kinds["layers.1.attention.wq"] == "Float8Linear"


def test_the_time_model_runs_the_converted_gemms_at_the_fp8_rate_and_charges_the_casts(monkeypatch):
    from launcher.plan import costs, fp8
    from launcher.plan.model import Layout
    from launcher.plan.spec import resolve_model

    m, gpu = resolve_model("llama3-70b"), resolve_gpu("h100-sxm")
    lay = Layout(tp=8, cp=1, pp=1, dp=8, ep=1, zero=1, recompute="none", micro_batch=1, grad_accum=1,
                 schedule="none", virtual_stages=1)
    # converted: q, o and the three MLP matmuls of every layer (k, v are 1024 wide: auto leaves them bf16)
    linears = fp8.rank_linears(m, 8, "auto")
    assert sorted((n, k) for n, k, _, _ in linears) == sorted([(1024, 8192), (8192, 1024), (3584, 8192),
                                                                (3584, 8192), (8192, 3584)])
    flops, traffic = fp8.fp8_terms(m, 8, 8192, "auto", 0.0)
    bf16_s, hw = costs.compute_seconds(m, lay, 8192, gpu)
    fp8_s, hw8 = costs.compute_seconds(m, lay, 8192, gpu, fp8="auto")
    assert hw8 == hw                                    # the same FLOPs, at another rate
    k = costs.kernels(gpu)
    gemm_saved = flops * (1 / (989e12 * k.gemm) - 1 / (1979e12 * k.gemm))
    casts = traffic / (k.hbm_tbs * 1e12)
    assert fp8_s * costs.BUNDLED.ceiling(gpu) == pytest.approx(bf16_s * costs.BUNDLED.ceiling(gpu) - gemm_saved + casts)
    # eager casts (33 B an element, several per GEMM) outweigh the faster GEMMs at this shape: the model says so
    assert casts > gemm_saved
    # compiled blocks fuse them (torchao's roofline bytes): the same shape gains, and compute_seconds charges exactly that
    compiled = dataclasses.replace(lay, compile=True)
    _, fused = fp8.fp8_terms(m, 8, 8192, "auto", 0.0, compiled=True)
    assert fused / (k.hbm_tbs * 1e12) < gemm_saved
    bf16_c = costs.compute_seconds(m, compiled, 8192, gpu)[0] * costs.BUNDLED.ceiling(gpu)
    assert costs.compute_seconds(m, compiled, 8192, gpu, fp8="auto")[0] * costs.BUNDLED.ceiling(gpu) == \
        pytest.approx(bf16_c - gemm_saved + fused / (k.hbm_tbs * 1e12))
    monkeypatch.setattr(fp8, "CAST_BYTES", 0.0)
    monkeypatch.setattr(fp8, "COPY_BYTES", 0.0)
    monkeypatch.setattr(fp8, "RESCALE_BYTES", 0.0)
    assert costs.compute_seconds(m, lay, 8192, gpu, fp8="auto")[0] < bf16_s    # fused casts for free: faster


def test_the_planner_keeps_the_jobs_precision():
    from launcher.plan.planner import plan_job

    base: dict[str, Any] = {"model": "llama3-8b", "train": {"seq_len": 8192, "global_batch": 16},
            "cluster": {"nodes": 1, "gpu": "h100-sxm"},
            "parallel": {"tp": 1, "cp": 1, "pp": 1, "zero": 3, "recompute": "selective", "micro_batch": 2}}
    runs = {}
    for prec in ("bf16", "fp8"):
        job = {**base, "train": {**base["train"], "precision": prec}}
        res = plan_job(spec_from_dict(job))
        plan = chosen(res)
        assert plan.train.precision == prec
        runs[prec] = plan.estimate["step_time_s"]
    assert runs["fp8"] != runs["bf16"]
