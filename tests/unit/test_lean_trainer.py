"""The lean trainer as the ledger prices it: the seed's mixed-precision state (2 B weights + 2 B gradients
+ 12 B fp32 master and Adam moments), ZeRO 1 as an even split, and a padded vocabulary that lets
any TP degree divide it (Megatron's make-vocab-size-divisible-by).

The traced side (launch verify's full-size trace of the real trainer agreeing with these ledgers) is
tests/integration/test_ledger_vs_trace.py and tests/integration/test_seed_table_traced.py.
"""

from __future__ import annotations

import pytest

from launcher.plan.capabilities import padded_vocab, tp_problem
from launcher.plan.ledger import GB, Layout, rank_memory
from launcher.plan.spec import spec_from_dict
from tests.plan_helpers import chosen

pytestmark = pytest.mark.unit

#: the issue's 6.7B SwiGLU model: 32 layers, hidden 4096, vocab 32000, on 8 GPUs at seq 4096
MODEL_6_7B = {"layers": 32, "hidden": 4096, "heads": 32, "vocab": 32000, "ffn_hidden": 11008, "mlp": "swiglu"}


def _spec(model, **train):
    return spec_from_dict({"model": model, "train": {"seq_len": 4096, "global_batch": 8, **train},
                           "cluster": {"nodes": 1, "gpus_per_node": 8, "gpu": "h100-sxm"}})


def _dp8(zero: int) -> Layout:
    return Layout(tp=1, cp=1, pp=1, dp=8, ep=1, zero=zero, recompute="full", micro_batch=1, grad_accum=1,
                  schedule="none", virtual_stages=1)


@pytest.mark.parametrize("vocab, tp, multiple, want", [(50257, 1, 128, 50304), (50257, 8, 128, 51200),
                                                       (32000, 8, 128, 32768), (128256, 8, 128, 129024),
                                                       (250, 4, 1, 252), (256, 2, 128, 256)])
def test_padded_vocab_is_megatrons(vocab, tp, multiple, want):
    spec = _spec({**MODEL_6_7B, "vocab": vocab, "vocab_multiple": multiple})
    assert padded_vocab(spec.model, tp) == want and want % tp == 0


def test_a_gpt2_vocabulary_no_longer_refuses_tp():
    spec = _spec({**MODEL_6_7B, "vocab": 50257})
    assert all(tp_problem(spec.model, tp) is None for tp in (1, 2, 4, 8))


@pytest.mark.parametrize("zero, seed_gb", [(0, 107.8), (1, 37.1), (2, 25.3), (3, 13.5)])
def test_the_ledgers_state_is_the_seeds_zero_table(zero, seed_gb):
    """Parameters + gradients + optimizer state of the 6.7B model on 8 GPUs (grad_dtype bf16, the seed's
    count) at the peak the ledger prices: within 15 % of the seed's per_gpu_state_gb for the model's own
    6.74e9 parameters (ZeRO 0's step holds the fp32 gradient beside the bf16 weights: +12 %)."""
    spec = _spec(MODEL_6_7B, grad_dtype="bf16")
    m = rank_memory(spec.model, spec.train, spec.gpu, _dp8(zero), "first")
    state = (m.params + m.grads + m.optimizer) / GB
    assert state == pytest.approx(seed_gb, rel=0.15), (zero, m)


def test_zero1_is_an_even_split_even_when_the_embedding_is_huge():
    """dp 256 of an 8B model: each rank steps 1/256 of every tensor, not the whole 525M-element embedding."""
    spec = spec_from_dict({"model": "llama3-8b", "train": {"seq_len": 4096, "global_batch": 256},
                           "cluster": {"nodes": 32, "gpus_per_node": 8, "gpu": "h100-sxm"}})
    lay = Layout(tp=1, cp=1, pp=1, dp=256, ep=1, zero=1, recompute="full", micro_batch=1, grad_accum=1,
                 schedule="none", virtual_stages=1)
    opt = rank_memory(spec.model, spec.train, spec.gpu, lay, "first").optimizer
    assert opt == pytest.approx(12 * 8.03e9 / 256, rel=0.02)


def test_grad_dtype_fp32_adds_two_bytes_per_parameter():
    lay = Layout(tp=1, cp=1, pp=1, dp=8, ep=1, zero=1, recompute="full", micro_batch=1, grad_accum=4,
                 schedule="none", virtual_stages=1)
    bf16 = _spec(MODEL_6_7B, grad_dtype="bf16", global_batch=32)
    fp32 = _spec(MODEL_6_7B, grad_dtype="fp32", global_batch=32)
    g16 = rank_memory(bf16.model, bf16.train, bf16.gpu, lay, "first").grads
    g32 = rank_memory(fp32.model, fp32.train, fp32.gpu, lay, "first").grads
    assert g32 / g16 == pytest.approx(2.0, rel=0.01)


def test_a_mixtral_shaped_moe_plans_at_tp2_with_ep8():
    """Attention TP with the experts whole per TP rank (expert TP 1) and split over ep: how Mixtral-class
    models are trained; ZeRO 0/1 only (FSDP would not sum the experts' TP-replicated gradients)."""
    from launcher.plan.planner import plan_job

    spec = spec_from_dict({"model": "mixtral-8x7b", "train": {"seq_len": 4096, "global_batch": 256},
                           "cluster": {"nodes": 8, "gpus_per_node": 8, "gpu": "h100-sxm"},
                           "parallel": {"tp": 2, "ep": 8}})
    best = chosen(plan_job(spec, top=0))
    assert best.fits and (best.layout.tp, best.layout.ep) == (2, 8) and best.layout.zero in (0, 1)


def test_moe_under_tp_refuses_fsdp_with_the_field():
    from launcher.errors import SpecError

    with pytest.raises(SpecError, match="parallel.zero"):
        spec_from_dict({"model": "mixtral-8x7b", "train": {"seq_len": 4096, "global_batch": 256},
                        "cluster": {"nodes": 8, "gpus_per_node": 8}, "parallel": {"tp": 2, "zero": 3}})
