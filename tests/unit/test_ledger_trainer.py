"""The planning ledger states what the bundled trainer allocates.

- Activations: the trainer's real Block (model.py), run forward under a dispatch mode that records
  every storage it creates, keeps alive exactly the bytes trainer_layer_activation_bytes says (fp32,
  FSDP's bf16 parameters, bf16 weights; dense GQA/MHA, SwiGLU/GELU, MoE; each recompute mode).
  SDPA never keeps the s×s scores; selective recompute keeps about half of what none keeps.
- Published layouts that ran on 80 GB GPUs at 4k-8k tokens plan as fitting with their degrees.
- Under pipeline parallelism ZeRO 2/3 keep whole fp32 gradients (torch's pipelining disables
  gradient sync and reshard-after-backward until the last micro-batch).
"""

from __future__ import annotations

from typing import Any

import pytest

from launcher.plan.ledger import (
    GB,
    Layout,
    Numerics,
    act_gb,
    memory_ledger,
    rank_layers,
    rank_memory,
    rank_params,
    trainer_layer_activation_bytes,
)
from launcher.plan.planner import plan_job
from launcher.plan.spec import ModelSpec, resolve_gpu, spec_from_dict

pytestmark = pytest.mark.unit

SHAPES: dict[str, dict[str, Any]] = {
    "gqa-swiglu": dict(hidden=128, heads=4, kv_heads=2, ffn_hidden=352, vocab=512),
    "mha-gelu": dict(hidden=128, heads=4, kv_heads=4, ffn_hidden=512, vocab=512, mlp="gelu"),
    "moe": dict(hidden=128, heads=4, kv_heads=2, ffn_hidden=96, vocab=512, experts=4, experts_per_token=2),
}


def saved_activation_bytes(shape: dict, layers: int, mode: str, numerics: str, s: int = 256, b: int = 2) -> int:
    """Bytes of the distinct storages created in a forward of the trainer's model that are still
    alive after it: what autograd saved, what checkpoint keeps (its inputs, and the outputs selective
    recompute caches), less the parameters and the forward's output."""
    import gc

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from torch.utils.weak import WeakIdKeyDictionary

    from launcher.plan.spec import ModelSpec
    from launcher.trainer.model import Transformer
    from launcher.trainer.recompute import apply_recompute

    class Created(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.storages = WeakIdKeyDictionary()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.storages[t.untyped_storage()] = t.untyped_storage().nbytes()
            return out

    m = Transformer(ModelSpec(layers=layers, **shape), seq_len=s)
    m.init_weights(0)
    apply_recompute(m, mode)
    if numerics != "fp32":   # what MixedPrecisionPolicy(param_dtype=bf16) hands the forward, or the bf16 weights
        m = m.to(torch.bfloat16)
    x = torch.randint(0, shape["vocab"], (b, s))
    created = Created()
    with created:
        out = m(x)
    gc.collect()
    not_acts = {p.untyped_storage().data_ptr() for p in m.parameters()} | {out.untyped_storage().data_ptr()}
    kept = sum(n for st, n in created.storages.items() if st.data_ptr() not in not_acts)
    return kept


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("numerics", ["fp32", "fsdp-bf16", "bf16"])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_activations_per_layer_are_what_the_block_keeps(shape, numerics, mode):
    per_layer = (saved_activation_bytes(SHAPES[shape], 3, mode, numerics)
                 - saved_activation_bytes(SHAPES[shape], 1, mode, numerics)) / 2
    ledger = trainer_layer_activation_bytes(ModelSpec(layers=3, **SHAPES[shape]), 256, 2, mode, Numerics(numerics))
    assert ledger == pytest.approx(per_layer, rel=0.005)


@pytest.mark.parametrize("numerics", ["fsdp-bf16", "fp32"])
def test_moe_activations_do_not_depend_on_routing(numerics, monkeypatch):
    """Every expert runs on however many rows it is routed, zero included, and the rows sum to
    tokens·top_k: all tokens sent to the first top_k experts (the others run on no rows) keep exactly
    the bytes the model's own routing keeps. This is what lets the ledger price MoE without knowing
    the router's values (and launch verify assume balanced routing)."""
    import torch

    from launcher.trainer import moe

    own = saved_activation_bytes(SHAPES["moe"], 1, "none", numerics)
    real_route, calls = moe.route, []

    def skewed(logits, top_k):
        w, idx = real_route(logits, top_k)
        calls.append(idx.numel())
        return w, torch.arange(top_k).expand_as(idx).contiguous()

    monkeypatch.setattr(moe, "route", skewed)
    assert saved_activation_bytes(SHAPES["moe"], 1, "none", numerics) == own
    assert calls == [2 * 256 * SHAPES["moe"]["experts_per_token"]]     # the skewed routing was the one used


def test_no_s_squared_term_but_the_seed_keeps_it():
    m = ModelSpec(layers=32, hidden=4096, heads=32, kv_heads=32, ffn_hidden=11008, vocab=32000)
    one = trainer_layer_activation_bytes(m, 4096, 1, "none", Numerics("fsdp-bf16"))
    two = trainer_layer_activation_bytes(m, 8192, 1, "none", Numerics("fsdp-bf16"))
    assert two == pytest.approx(2 * one, rel=1e-3)                  # linear in s: SDPA keeps no s×s scores
    assert f"{act_gb(4096, 1, 4096, 32, 32, 'none'):.2f}" == "104.15"   # `launch memory` still prints the seed


L2_13B = {"layers": 40, "hidden": 5120, "heads": 40, "ffn_hidden": 13824, "vocab": 32000}
#: name -> model, nodes of 8 × H100 80 GB, seq_len, global batch, the published degrees and micro-batch.
#: NeMo 2 recipes (nemo/collections/llm/recipes/llama31_*.py: TP/PP/VP/CP, mbs 1, gbs 512, seq 8192);
#: torchtitan (train_configs, benchmarks/llama3_h100_202412_torchtitan.md: FSDP, local batch, seq).
PUBLISHED: dict[str, tuple[Any, int, int, int, dict[str, Any]]] = {
    "nemo-llama31-8b": ("llama3-8b", 1, 8192, 512, dict(tp=1, cp=2, pp=1, micro_batch=1, recompute="none")),
    "nemo-llama31-70b": ("llama3-70b", 64, 8192, 512, dict(tp=4, cp=2, pp=4, virtual_stages=5,
                                                           schedule="interleaved-1f1b", micro_batch=1)),
    "torchtitan-llama3-8b": ("llama3-8b", 1, 8192, 16, dict(tp=1, cp=1, pp=1, micro_batch=2)),
    "torchtitan-llama2-13b": (L2_13B, 1, 4096, 64, dict(tp=1, cp=1, pp=1, micro_batch=8)),
    "torchtitan-llama3-70b": ("llama3-70b", 32, 8192, 512, dict(tp=8, cp=1, pp=1, micro_batch=2)),
    "torchtitan-llama3-405b": ("llama3-405b", 64, 8192, 256, dict(tp=8, cp=1, pp=8, schedule="1f1b", micro_batch=1)),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_layouts_plan_as_fitting(name):
    model, nodes, seq, gb, parallel = PUBLISHED[name]
    spec = spec_from_dict({"model": model, "train": {"seq_len": seq, "global_batch": gb},
                           "cluster": {"nodes": nodes, "gpus_per_node": 8, "gpu": "h100-sxm"}, "parallel": parallel})
    best = plan_job(spec, top=0).best
    assert best is not None and best.fits, name
    assert best.memory["per_gpu_gb"] <= 72.0                                   # 80 GB less the 10% headroom
    for k in ("tp", "cp", "pp"):
        assert best.degrees[k] == parallel[k]
    if "recompute" in parallel:
        # with the seed's s² term these activations alone would not fit: 8B at 8k, one sample, whole model
        assert act_gb(seq, 1, spec.model.hidden, spec.model.heads, spec.model.layers, "none") / parallel["cp"] > 80


def _lay(zero, pp, dp, **kw):
    base = dict(tp=1, cp=1, pp=pp, dp=dp, ep=1, zero=zero, recompute="full", micro_batch=1, grad_accum=8,
                schedule="1f1b" if pp > 1 else "none", virtual_stages=1)
    return Layout(**{**base, **kw})


def test_zero2_under_pp_holds_whole_fp32_gradients():
    spec = spec_from_dict({"model": "llama3-8b", "train": {"seq_len": 4096, "global_batch": 64}})
    m, t, g = spec.model, spec.train, spec.gpu
    stage = rank_params(m, _lay(2, 2, 8), "first").total
    with_pp = rank_memory(m, t, g, _lay(2, 2, 8), "first")
    assert with_pp.grads == pytest.approx(4 * stage)     # whole fp32 accumulation (the shard comes at the end)
    no_pp = rank_memory(m, t, g, _lay(2, 1, 8), "first")
    assert no_pp.grads == pytest.approx(4 * rank_params(m, _lay(2, 1, 8), "first").total / 8)


def test_zero1_shards_only_the_master_and_optimizer_state():
    """ZeRO 0 and 1 both hold the bf16 weights whole; ZeRO 1 splits the fp32 master, m and v (12 B) over dp."""
    spec = spec_from_dict({"model": "llama3-8b", "train": {"seq_len": 4096, "global_batch": 64}})
    m, t, g = spec.model, spec.train, spec.gpu
    z0, z1 = rank_memory(m, t, g, _lay(0, 1, 8), "first"), rank_memory(m, t, g, _lay(1, 1, 8), "first")
    whole = rank_params(m, _lay(1, 1, 8), "first").total
    assert 2 * whole <= z1.params == z0.params < 2.01 * whole        # bf16 weights (and RoPE's buffers)
    assert z0.optimizer == pytest.approx(12 * whole) and z1.optimizer == pytest.approx(z0.optimizer / 8)


def test_categories_sum_to_the_total_and_runtime_is_outside():
    spec = spec_from_dict({"model": "llama3-70b", "train": {"seq_len": 8192, "global_batch": 64},
                           "cluster": {"nodes": 8}})
    led = memory_ledger(spec.model, spec.train, resolve_gpu("h100-sxm"), _lay(3, 4, 16, tp=1, grad_accum=4))
    assert sum(led.categories().values()) + led.runtime_gb == pytest.approx(led.per_gpu_gb)


def test_the_busiest_pipeline_rank_is_priced():
    """Stage splits from layout.stage_layers (uneven: the end stages get the smaller share) and in-flight
    counts that fall with the rank: the ledger prices the most loaded of all pipeline ranks."""
    mha = {"layers": 6, "hidden": 256, "heads": 8, "kv_heads": 8, "ffn_hidden": 1024, "vocab": 1024, "mlp": "gelu"}
    uneven = spec_from_dict({"model": mha, "train": {"seq_len": 512, "global_batch": 16}})
    big = spec_from_dict({"model": "llama3-405b", "train": {"seq_len": 8192, "global_batch": 1024}})
    cases = [(uneven, _lay(2, 4, 2, recompute="none", grad_accum=8), "pp 1")] + [
        (big, _lay(z, 16, 16, tp=8, grad_accum=64, schedule=s, virtual_stages=v), None)
        for z in (1, 3) for s, v in (("1f1b", 1), ("interleaved-1f1b", 2))]
    g = resolve_gpu("h100-sxm")
    for spec, lay, worst in cases:
        m, t = spec.model, spec.train
        layers = [rank_layers(m, lay, r) for r in range(lay.pp)]
        assert sum(layers) == m.layers and layers[0] <= layers[1]
        totals = [rank_memory(m, t, g, lay, r).total for r in range(lay.pp)]
        led = memory_ledger(m, t, g, lay)
        assert led.per_gpu_gb - led.runtime_gb == pytest.approx(max(totals) / GB)
        if worst:
            assert led.worst_stage == worst and max(totals) > max(totals[0], totals[-1])
    assert [rank_layers(big.model, cases[1][1], r) for r in (0, 1, 15)] == [7, 8, 7]     # Llama 3: 126 on pp 16


@pytest.mark.parametrize("pp,v,m", [(2, 2, 2), (2, 2, 4), (4, 2, 4), (4, 2, 8), (4, 3, 12), (8, 4, 8), (3, 2, 6)])
def test_interleaved_order_is_torchs(pp, v, m):
    """The ledger prices interleaved 1F1B from each rank's own action order: torch's, without torch."""
    pytest.importorskip("torch")
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    from launcher.plan.ledger import interleaved_order

    s = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)
    s.pp_group_size, s.n_local_stages, s._n_microbatches = pp, v, m
    s.number_of_rounds = max(1, m // pp)
    s.microbatches_per_round = m // s.number_of_rounds
    for r in range(pp):
        s.rank = r
        torch_order = [(a.stage_index // pp, a.microbatch_index, a.computation_type == _ComputationType.FULL_BACKWARD)
                       for a in s._calculate_single_rank_operations(r) if a is not None]
        assert list(interleaved_order(pp, v, m, r)) == torch_order


def test_interleaved_moments_of_a_long_schedule_are_a_short_ones():
    """The ledger finds an interleaved rank's moments on a schedule with two steady periods (pp | m), not
    on all m micro-batches: the same chunks, micro-batches in flight and what the pricing reads of the
    backward counts (none run, some, all m) as the whole schedule's, for every rank."""
    from launcher.plan.ledger import interleaved_moments, schedule_moments

    def read(moments, m):
        return [(k, j > 0, held, tuple((d > 0, d == m) for d in done)) for k, j, held, done in moments]

    shortened = 0
    for pp in (2, 3, 4, 6):
        for v in (2, 3, 5):
            layers = tuple(1 + (i % 3) for i in range(v))
            for m in (pp, 4 * pp, 9 * pp, 10 * pp - 1):
                for r in range(pp):
                    for sharded in (False, True):
                        got = interleaved_moments(pp, v, m, r, layers, sharded)
                        assert read(got, m) == read(schedule_moments(pp, v, m, r, layers, sharded), m), \
                            (pp, v, m, r, sharded)
                        shortened += m > 6 * pp and m % pp == 0
    assert shortened  # the shortcut was taken
