"""The time model's pipeline bubble under the split-backward schedules: launcher/plan/schedules.bubble_fraction
simulates torch's own orders, and for the published papers' assumptions it gives their formulas.

Sources: 1F1B's (p-1)/m and interleaving's (p-1)/(m·v) (Narayanan et al. 2021, arXiv 2104.04473 §2.2);
ZB-H1's (p-1)(F+B-W) of a bubble against 1F1B's (p-1)(F+B+W) (Qi et al. 2023, arXiv 2401.10241 §3, B the
input-gradient pass; DeepSeek-V3's Table 2 writes the same (p-1)(F+B-2W) with B the whole backward); ZB-V's V
halves a chunk's time, so its bubble is half ZB-H1's once m >= 2p-1 (Qi et al. §6).
"""

from __future__ import annotations

import pytest

from launcher.plan import costs, schedules
from launcher.plan.costs import Bandwidth, estimate
from launcher.plan.model import Layout
from launcher.plan.spec import TrainSpec, resolve_gpu, resolve_model

pytestmark = pytest.mark.unit


def bubble(schedule: str, pp: int, v: int, m: int, f: float = 1.0, i: float = 1.0, w: float = 1.0) -> float:
    return schedules.bubble_fraction(schedule, pp, v, m, (1,) * (pp * v), f / v, i / v, w / v)


@pytest.mark.parametrize("pp, m", [(4, 4), (4, 8), (8, 8), (8, 32), (16, 16), (16, 64)])
def test_the_simulation_gives_the_papers_bubbles(pp, m):
    f = i = w = 1.0                                   # the ZB paper's F = B = W
    assert bubble("1f1b", pp, 1, m) == pytest.approx((pp - 1) / m)
    assert bubble("interleaved-1f1b", pp, 2, m) == pytest.approx((pp - 1) / (2 * m))
    # ZB-H1's bubble over the compute (F + B + W per micro-batch): (p-1)(F+B-W) / (m(F+B+W))
    assert bubble("interleaved-zero-bubble", pp, 1, m) == pytest.approx((pp - 1) * (f + i - w) / (m * (f + i + w)))
    if m >= 2 * pp - 1:
        assert bubble("zero-bubble-v", pp, 2, m) == pytest.approx(bubble("interleaved-zero-bubble", pp, 1, m) / 2)


def test_attention_heavy_layers_shrink_what_zero_bubble_saves():
    """W is the matmuls' weight gradients only: the more of a layer's backward is attention (input gradient
    only), the less W there is to fill the bubble with."""
    light = bubble("interleaved-zero-bubble", 8, 1, 8, 1.0, 1.0, 1.0)
    heavy = bubble("interleaved-zero-bubble", 8, 1, 8, 1.0, 1.6, 0.6)
    assert light < heavy < bubble("1f1b", 8, 1, 8)


def test_the_v_schedules_beat_interleaving_at_two_chunks():
    """Two chunks per rank each: ZB-V and DualPipe-V fill the bubble with weight gradients, interleaved 1F1B
    does not (F = B = W: a third of its bubble is left)."""
    for s in ("zero-bubble-v", "dualpipe-v"):
        assert bubble(s, 8, 2, 32) <= bubble("interleaved-1f1b", 8, 2, 32) / 3 + 1e-9


def test_the_step_time_charges_the_simulated_bubble():
    model = resolve_model("llama3-8b")
    train = TrainSpec(seq_len=2048, global_batch=16)
    gpu = resolve_gpu("h100-sxm")
    bw = Bandwidth(intra_gbs=450.0, net_per_gpu_gbs=50.0, source="test")

    def est(schedule: str, v: int):
        lay = Layout(tp=2, cp=1, pp=16, dp=1, ep=1, zero=0, recompute="none", micro_batch=1, grad_accum=16,
                     schedule=schedule, virtual_stages=v)
        return estimate(model, train, gpu, lay, bw, 8)

    one, zbv = est("1f1b", 1), est("zero-bubble-v", 2)
    assert one.bubble_fraction == pytest.approx(15 / 16)
    assert zbv.bubble_fraction < 0.1 < one.bubble_fraction
    assert zbv.step_time_s < one.step_time_s
    assert zbv.bubble_fraction == pytest.approx(costs.split_bubble(model, Layout(
        tp=2, cp=1, pp=16, dp=1, ep=1, zero=0, recompute="none", micro_batch=1, grad_accum=16,
        schedule="zero-bubble-v", virtual_stages=2), costs.forward_flops_per_sequence(model, 2048)))
