"""benchmarks/megatron_memory.py's re-derivation of Megatron-LM's theoretical memory estimate
(megatron/training/theoretical_memory_usage.py at d98e8a64) against figures worked by hand from that
file's formulas, so the implementation is pinned: the seed's 6.7B shape (Llama 2 7B) on 8 GPUs, a
Llama 2 70B tp 8 pp 4 layout (the sequence-parallel + selective branch, padded vocabulary, the
pipeline and interleaving factors) and Mixtral 8x7B's expert term."""

from __future__ import annotations

import pytest

from benchmarks.megatron_memory import (
    LAYOUTS,
    korthikanti_estimate,
    megatron_estimate,
    model_and_layout,
    padded_vocab,
)
from launcher.plan import presets

pytestmark = pytest.mark.unit

LLAMA2_70B = dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672, vocab=32000, mlp="swiglu",
                  tied_embeddings=False)


def test_seed_7b_dp8_zero1_full_recompute():
    """6.7B SwiGLU (32 layers, h 4096, ffn 11008, vocab 32000, MHA), tp 1 pp 1 dp 8, seq 4096, mb 1.

    Parameters: attention 2·h²·(1 + 32/32) = 67,108,864; MLP 2·h·ffn·3/2 = 135,266,304; norms 2·h =
    8,192 a layer; ×32 = 6,476,005,376 TP-sharded + 262,144 replicated, + final norm 4,096, +
    embedding and (untied, pp 1) output layer 2·4096·32000 = 262,144,000: 6,738,415,616 (the 6.74B).
    Distributed optimizer: 6 + 12/8 = 7.5 B/param -> 50,538,117,120 B.
    Activations: tp 1 is not sequence-parallel, so the file's without-SP branch whatever the
    recompute: sbh·(10 + 24) ·32 = 16,777,216·34·32 = 18,253,611,008, + token ids 8·4096 = 32,768,
    + embedding dropout mask sbh = 16,777,216, + (logits s·b·V + final norm sbh)·2 = 295,698,432 ->
    18,566,119,424, ×1.05 = 19,494,425,395.2 B."""
    e = megatron_estimate(presets.MODELS["llama2-7b"],
                          dict(tp=1, pp=1, cp=1, dp=8, zero=1, recompute="full", micro_batch=1, seq_len=4096,
                               grad_accum=4))
    assert e["params_first_stage"] == 6_738_415_616
    assert e["weights_optimizer_gb"] == pytest.approx(50.538117120, rel=1e-12)
    assert e["activations_gb"] == pytest.approx(19.4944253952, rel=1e-12)
    assert e["total_gb"] == pytest.approx(50.538117120 + 19.4944253952, rel=1e-12)
    assert e["branch"] == "without-sp"
    # without the distributed optimizer (ZeRO 0): 18 B/param
    e0 = megatron_estimate(presets.MODELS["llama2-7b"],
                           dict(tp=1, pp=1, dp=8, zero=0, recompute="full", micro_batch=1, seq_len=4096))
    assert e0["weights_optimizer_gb"] == pytest.approx(6_738_415_616 * 18 / 1e9, rel=1e-12)


def test_llama2_70b_tp8_pp4_selective():
    """Llama 2 70B, tp 8 pp 4 dp 2, seq 4096, mb 1, 8 micro-batches, selective recompute.

    Vocabulary padded to a multiple of 128·8: 32,768. Attention 2·h²·(1 + 8/64) = 150,994,944, MLP
    3·h·ffn = 704,643,072 a layer: ×80 = 68,451,041,280; first stage (68,451,041,280/4 + embedding
    8192·32768 = 268,435,456)/8 = 2,172,649,472 TP-sharded + (2·8192·80 + 8192)/4 = 329,728 norms
    = 2,172,979,200 params × (6 + 12/2) B = 26,075,750,400 B.
    Activations (SP + selective): sbh = 33,554,432; (18 + 4·28672/8192) = 32 → ·sbh·80 =
    85,899,345,920, + 8·s·b·pp = 131,072, + sbh·pp = 134,217,728 = 86,033,694,720; 8 >= pp micro-
    batches: factor 1; pp > 1: no output term; /8 = 10,754,211,840 B."""
    lay = dict(tp=8, pp=4, cp=1, dp=2, zero=1, recompute="selective", micro_batch=1, seq_len=4096, grad_accum=8)
    e = megatron_estimate(LLAMA2_70B, lay)
    assert e["padded_vocab"] == 32768 == padded_vocab(32000, 8)
    assert e["params_first_stage"] == 2_172_979_200
    assert e["weights_optimizer_gb"] == pytest.approx(26.0757504, rel=1e-12)
    assert e["activations_gb"] == pytest.approx(10.75421184, rel=1e-12)
    assert e["branch"] == "sp+selective"
    # interleaved, v = 2: × (1 + (4-1)/(4·2)) = 1.375
    ev = megatron_estimate(LLAMA2_70B, {**lay, "virtual_stages": 2})
    assert ev["activations_gb"] == pytest.approx(10.75421184 * 1.375, rel=1e-12)
    assert ev["weights_optimizer_gb"] == pytest.approx(26.0757504, rel=1e-12)
    # 1F1B with fewer micro-batches than stages: × 2/4 on everything but the (absent) output term
    e2 = megatron_estimate(LLAMA2_70B, {**lay, "grad_accum": 2})
    assert e2["activations_gb"] == pytest.approx(10.75421184 / 2, rel=1e-12)
    # no recompute at tp 8: the without-SP branch, sbh·(10 + 24/8)·80 + (131,072 + 134,217,728), ×1.05
    en = megatron_estimate(LLAMA2_70B, {**lay, "recompute": "none"})
    assert en["activations_gb"] == pytest.approx((33_554_432 * 13 * 80 + 131_072 + 134_217_728) * 1.05 / 1e9,
                                                 rel=1e-12)


def test_mixtral_expert_term():
    """Mixtral 8x7B at tp 1, dp 8, ep 8: routed experts 2·4096·14336·8·3/2 = 1,409,286,144 a layer,
    ×32 / ep 8 = 5,637,144,576 params at 6 + 12/1 = 18 B (expert dp = world 8 / (etp 1·ep 8·pp 1) = 1); the rest
    (attention 2·h²·(1 + 8/32) = 41,943,040 ×32, norms and router (2·4096 + 4096·8)·32 + 4096,
    embedding + output 2·4096·32000) = 1,605,636,096 params at 6 + 12/8 = 7.5 B."""
    e = megatron_estimate(presets.MODELS["mixtral-8x7b"],
                          dict(tp=1, pp=1, cp=1, dp=8, ep=8, zero=1, recompute="full", micro_batch=1, seq_len=4096))
    assert e["params_first_stage"] == 5_637_144_576 + 1_605_636_096
    assert e["weights_optimizer_gb"] == pytest.approx((5_637_144_576 * 18 + 1_605_636_096 * 7.5) / 1e9, rel=1e-12)


def test_strict_estimate_and_layouts():
    """The stricter column shards the optimizer over dp·cp and the sequence over cp; full recompute keeps
    each layer's bf16 input (2·sbh/tp) plus one layer's working set. And the benchmark has >= 30 layouts."""
    lay = dict(tp=8, pp=4, cp=2, dp=1, zero=1, recompute="full", micro_batch=1, seq_len=8192, grad_accum=4)
    k = korthikanti_estimate(LLAMA2_70B, lay)
    m = megatron_estimate(LLAMA2_70B, lay)
    assert k["weights_optimizer_gb"] < m["weights_optimizer_gb"]        # 6 + 12/2 vs 6 + 12/1
    sbh = 4096 * 8192
    layer = sbh * 32 / 8
    want = 2 * sbh / 8 * 80 + (8 * 4096 + sbh) * 4 / 8 + layer
    assert k["activations_gb"] == pytest.approx(want / 1e9, rel=1e-12)
    assert len(LAYOUTS) >= 30
    model, lay = model_and_layout(LAYOUTS["llama2-70b/8L tp8 pp4 cp1 dp2 z1 selective mb1 s4k"])
    assert (lay["dp"], lay["grad_accum"], lay["seq_len"], model["layers"]) == (2, 4, 4096, 8)
