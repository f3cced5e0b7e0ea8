"""Context-parallel attention is exact causal attention and never hands SDPA an explicit mask on a
GPU: each of a rank's two query chunks attends to a prefix of the sequence, square-causal or
bottom-right causal (torch's causal_lower_right, which torch runs as flash or memory-efficient
attention). The all-gather and the whole trainer are checked by tests/integration/test_trainer_parity.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias, CausalVariant
from torch.overrides import TorchFunctionMode

from launcher.trainer.context_parallel import CPAttention, positions

pytestmark = pytest.mark.unit


def qkv(s: int, heads: int = 4, kv_heads: int = 2, d: int = 8, device: str = "cpu"):
    g = torch.Generator().manual_seed(s)
    q, k, v = (torch.randn(2, n, s, d, generator=g, dtype=torch.float64).to(device)
               for n in (heads, kv_heads, kv_heads))
    return q, k, v


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_every_rank_matches_causal_attention_forward_and_backward(cp):
    s = 8 * cp
    q, k, v = (t.requires_grad_() for t in qkv(s))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    gout = torch.randn_like(ref)
    want = torch.autograd.grad(ref, (q, k, v), gout)
    got_grads = [torch.zeros_like(t) for t in (q, k, v)]
    for r in range(cp):
        pos = positions(s, r, cp)
        out = CPAttention(None, r, cp, s).local(q[:, :, pos], k, v)
        torch.testing.assert_close(out, ref[:, :, pos], rtol=1e-10, atol=1e-10)
        for acc, g in zip(got_grads, torch.autograd.grad(out, (q, k, v), gout[:, :, pos])):
            acc += g
    for g, w in zip(got_grads, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_no_explicit_mask_off_the_cpu(rank):
    """On a non-CPU device (meta here) every SDPA call is square is_causal or a lower-right bias."""
    cp, s = 3, 48
    q, k, v = qkv(s, device="meta")
    calls = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.scaled_dot_product_attention:
                calls.append((kwargs.get("attn_mask"), kwargs.get("is_causal", False),
                              args[0].shape[2], args[1].shape[2]))
            return func(*args, **kwargs)

    with Record():
        CPAttention(None, rank, cp, s).local(q[:, :, :s // cp], k, v)
    c = s // (2 * cp)
    # head chunk `rank` sees chunks 0..rank, tail chunk 2cp-1-rank sees 0..2cp-1-rank
    assert [(L, S) for _, _, L, S in calls] == [(c, (rank + 1) * c), (c, (2 * cp - rank) * c)]
    for mask, causal, L, S in calls:
        if L == S:
            assert mask is None and causal
        else:
            assert isinstance(mask, CausalBias) and mask.variant == CausalVariant.LOWER_RIGHT and not causal
