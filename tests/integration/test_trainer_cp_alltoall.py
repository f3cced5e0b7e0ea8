"""All-to-all context parallelism (DeepSpeed-Ulysses, `parallel.cp_attention: all-to-all`): the attention
core on real gloo ranks against one causal SDPA over the whole sequence (forward and every input's gradient,
GQA with key/value heads repeated up to cp, ALiBi's per-head biases), the whole trainer's loss parity with
the single-process reference (as tests/integration/test_trainer_parity.py for the other layouts), and the head rules
refused with one line by the trainer's plan check.

Tolerance as tests/integration/test_trainer_parity.py: relative 1e-5 on every step's loss and pre-clip gradient norm
(fp32 on CPU); the attention core alone to 1e-10 in float64.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from launcher.errors import UserError
from launcher.plan import capabilities
from launcher.trainer.config import config_from_plan
from tests.plan_helpers import refused
from tests.trainer_helpers import job_losses, make_plan, spawn, spawn_layouts

pytestmark = pytest.mark.integration

RTOL = 1e-5
STEPS = 3

#: (heads, kv_heads, cp, alibi): MHA; GQA with kv heads divisible by cp; GQA with fewer kv heads than cp
#: (repeated up to cp); ALiBi's biases per head group
CORE_CASES = [(4, 4, 2, False), (8, 4, 4, False), (4, 2, 4, False), (8, 2, 4, True), (6, 3, 3, False)]


def _core_worker(rank: int, world: int, port: int, cases: list) -> None:
    """On each of `world` gloo ranks, every case on its first cp ranks (_check_core)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=120))
    for i, case in enumerate(cases):
        if rank >= case[2]:
            continue
        dist.init_process_group("gloo", store=dist.PrefixStore(f"case{i}", store), rank=rank, world_size=case[2])
        try:
            _check_core(rank, i, *case)
        finally:
            dist.destroy_process_group()


def _check_core(rank: int, seed: int, heads: int, kv: int, cp: int, alibi: bool) -> None:
    """UlyssesAttention on this rank's head/tail chunks of q, k, v against SDPA over the whole sequence: the
    outputs and gradients of this rank's positions."""
    import torch
    import torch.nn.functional as F

    from launcher.trainer.context_parallel import UlyssesAttention, positions
    from launcher.trainer.model import AlibiBias

    s, d = 8 * cp, 4
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, n, s, d, generator=g, dtype=torch.float64) for n in (heads, kv, kv))
    gout = torch.randn(2, heads, s, d, generator=g, dtype=torch.float64)
    bias = AlibiBias(heads)

    def alibi_fn(q0, L, S, x, head0=0):
        return bias.bias(head0, x.shape[1], q0, L, S, x.dtype, x.device)

    full = [t.clone().requires_grad_() for t in (q, k, v)]
    mask = alibi_fn(0, s, s, full[0]) if alibi else None
    ref = F.scaled_dot_product_attention(full[0], full[1], full[2], attn_mask=mask, is_causal=not alibi, enable_gqa=heads != kv)
    want = torch.autograd.grad(ref, full, gout)
    pos = positions(s, rank, cp)
    mine = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
    out = UlyssesAttention(None, rank, cp).attention(mine[0], mine[1], mine[2], alibi_fn if alibi else None)
    where = f"heads {heads} kv {kv} cp {cp} alibi {alibi} rank {rank}"
    torch.testing.assert_close(out, ref[:, :, pos], rtol=1e-10, atol=1e-10, msg=lambda m: f"{where} out: {m}")
    got = torch.autograd.grad(out, mine, gout[:, :, pos])
    for name, a, b in zip("qkv", got, want):
        def msg(m: str, n: str = name) -> str:
            return f"{where} d{n}: {m}"

        torch.testing.assert_close(a, b[:, :, pos], rtol=1e-10, atol=1e-10, msg=msg)


def test_ulysses_core_is_causal_attention_on_gloo():
    """Every rank's output and q/k/v gradients equal SDPA's over the whole sequence at its own positions:
    the exchange, the sequence order of the head/tail chunks, the inverse exchange, the repeated kv heads'
    summed gradients and each rank's ALiBi slopes."""
    from tests.trainer_helpers import free_port

    spawn(_core_worker, (4, free_port(), CORE_CASES), 4)


# --- the whole trainer: loss parity with one process ----------------------------------------------

A2A = dict(cp_attention="all-to-all")
LAYOUTS: dict[str, dict[str, Any]] = {
    "ref": dict(),
    # tiny: 4 heads, 2 kv heads. cp 2: one kv head per rank; tp 2 × cp 2: the TP rank's one kv head repeated
    "a2a_cp2_dp2_zero3": dict(A2A, cp=2, dp=2, micro_batch=2),
    "a2a_cp2_tp2_dp2_zero1": dict(A2A, cp=2, tp=2, dp=2, zero=1, micro_batch=2),
    "a2a_cp4_dp2_selective": dict(A2A, cp=4, dp=2, recompute="selective", micro_batch=2),
    "a2a_pp2_cp2_tp2_full": dict(A2A, pp=2, cp=2, tp=2, recompute="full", micro_batch=2),
}
ALIBI = dict(model_over={"position": "alibi"})
ALIBI_LAYOUTS: dict[str, dict[str, Any]] = {
    "alibi_ref": dict(ALIBI),
    "alibi_a2a_cp2_tp2_dp2": dict(ALIBI, **A2A, cp=2, tp=2, dp=2, micro_batch=2),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    work = tmp_path_factory.mktemp("cp_a2a")
    jobs = [dict(name=n, plan=make_plan(steps=STEPS, **kw).to_dict())
            for n, kw in {**LAYOUTS, **ALIBI_LAYOUTS}.items()]
    return spawn_layouts(jobs, work)


@pytest.mark.slow
@pytest.mark.parametrize("name,ref", [(n, "ref") for n in LAYOUTS if n != "ref"]
                         + [(n, "alibi_ref") for n in ALIBI_LAYOUTS if n != "alibi_ref"])
def test_all_to_all_loss_parity_with_single_process(results, name, ref):
    want, got = job_losses(results, ref, STEPS), job_losses(results, name, STEPS)
    for step, (a, b) in enumerate(zip(got, want), start=1):
        assert a == pytest.approx(b, rel=RTOL), f"{name} step {step}: {a} vs reference {b}"
    assert want[0] != want[-1], "the reference did not train"
    assert results[name]["grad_norms"] == pytest.approx(results[ref]["grad_norms"], rel=RTOL)


# --- the head rules, refused in one line -----------------------------------------------------------

def test_head_rules():
    tiny = make_plan().model                     # 4 heads, 2 kv heads
    ok = capabilities.cp_attention_problem
    assert ok(tiny, 2, 1, "all-to-all") is None and ok(tiny, 4, 1, "all-to-all") is None  # kv 2 repeated to 4
    assert ok(tiny, 2, 2, "all-to-all") is None  # 1 kv head per TP rank, repeated to 2
    assert ok(tiny, 8, 1, "all-gather") is None and ok(tiny, 1, 4, "all-to-all") is None
    assert "4 query heads divisible by cp=8" in refused(ok(tiny, 8, 1, "all-to-all"))
    assert "2 query heads per TP rank (of 4, tp=2) divisible by cp=4" in refused(ok(tiny, 4, 2, "all-to-all"))
    six = dataclasses.replace(tiny, heads=12, kv_heads=6)
    assert "6 key/value heads divisible by cp=4" in refused(ok(six, 4, 1, "all-to-all"))
    gqa = dataclasses.replace(tiny, heads=12, kv_heads=4)
    assert "repeats the 4 key/value heads up to cp=6" in refused(ok(gqa, 6, 1, "all-to-all"))


def test_trainer_refuses_a_plan_the_heads_do_not_split_for():
    with pytest.raises(UserError, match=r"plan.layout.cp_attention=all-to-all with cp=4: all-to-all needs the 2 "
                                        r"query heads per TP rank \(of 4, tp=2\) divisible by cp=4"):
        config_from_plan(make_plan(cp=4, tp=2, cp_attention="all-to-all", seq_len=64))
    config_from_plan(make_plan(cp=4, tp=2, seq_len=64))          # all-gather has no head rule
