"""The planner's choice among issue 25's capabilities, one pair of tests each: where the published evidence says a
capability should win, the planner picks it with everything about it left to the search; where the evidence says
it should not be used, the planner leaves it out. The winning shapes are the examples' own jobs (examples/*.yaml),
so an example's claim that "the planner picks this" is checked here too.

The evidence each pair follows:
- split-backward schedules: Qi et al. 2023 (arXiv 2401.10241) §5/§6, ZB-V's lead over 1F1B largest at m = p and
  shrinking as m grows; Narayanan et al. 2021 §2.2, 1F1B's bubble (p-1)/m.
- hybrid sharding: MiCS (arXiv 2205.00119), up to 2.89x over whole-cluster ZeRO-3 on 100-400 Gb/s cloud networks;
  PyTorch FSDP (arXiv 2304.11277) §3.2.2, hybrid sharding for slow inter-node links, full sharding the default.
- all-to-all CP: DeepSpeed-Ulysses (arXiv 2309.14509) §3.2, traffic per GPU falling with the CP degree; USP
  (arXiv 2405.07719) §4, Ulysses inside a node, ring with GQA; no published run below 32k tokens used CP.
- fp8: torchao's torchao/float8/README.md "Training benchmarks", Llama 3 8B on 8 H100, FSDP + compile: rowwise (the
  trainer's recipe) +10.05%, tensorwise +25.03%; torchtitan's benchmarks/llama3_h100_202412_torchtitan.md Table 1,
  6,667 -> 8,532 tokens/s/GPU (1.28x, tensorwise); no FP8 tensor cores before Hopper.
- compiled blocks: the same table, 5,762 eager -> 6,667 compiled; torch's split backward refuses compiled stages.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import yaml

from launcher.errors import SpecError
from launcher.plan import capabilities
from launcher.plan.costs import estimate
from launcher.plan.fp8 import rank_linears
from launcher.plan.ledger import memory_ledger
from launcher.plan.planner import TIE_BAND, PlanResult, plan_job
from launcher.plan.spec import spec_from_dict
from tests.conftest import EXAMPLES
from tests.plan_helpers import chosen

pytestmark = pytest.mark.unit


def example(name: str) -> dict:
    """An example job file as a mapping, without what the planner does not read."""
    job = yaml.safe_load((EXAMPLES / name).read_text())
    for section in ("backend", "diagnostics"):
        job.pop(section, None)
    return job


def pick(job: dict) -> PlanResult:
    result = plan_job(spec_from_dict(job), top=0)
    assert chosen(result).fits, result.rejected
    return result


def step(result: PlanResult) -> float:
    return chosen(result).estimate["step_time_s"]


# --- §1 pipeline schedules --------------------------------------------------------------------------------------

ZBV = "llama3-8b-zbv-32xh100.yaml"


def test_a_zero_bubble_schedule_wins_the_bubble_bound_pipeline():
    """16 stages, 16 micro-batches (m = p): with the schedule left to the search the planner splits the backward
    (ZB-V, both stages of a V on each rank) and beats the best whole-backward schedule, compiled blocks included,
    by more than the tie band; its bubble is a small share of what 1F1B's (p-1)/m = 15/16 and interleaving's leave."""
    job = example(ZBV)
    del job["parallel"]["schedule"]
    best = chosen(pick(job))
    assert best.layout.schedule in capabilities.SPLIT_BACKWARD and best.layout.recompute == "none"
    whole = {s: pick(copy.deepcopy(job) | {"parallel": {**job["parallel"], "schedule": s}})
             for s in ("1f1b", "interleaved-1f1b")}
    assert chosen(whole["1f1b"]).estimate["bubble_fraction"] == pytest.approx(15 / 16)
    assert best.estimate["bubble_fraction"] < chosen(whole["interleaved-1f1b"]).estimate["bubble_fraction"] / 4
    assert best.estimate["step_time_s"] * (1 + TIE_BAND) < min(step(r) for r in whole.values())


def test_the_same_pipeline_with_many_micro_batches_keeps_a_whole_backward():
    """The same model and stages with 512 micro-batches: 1F1B's bubble is 15/512, what a split backward saves lies
    inside the tie band, and the whole-backward schedule (which may also compile its blocks) is the plan."""
    job = example(ZBV)
    del job["parallel"]["schedule"]
    job["train"]["global_batch"] = 512
    best = chosen(pick(job))
    assert best.layout.pp == 16 and best.layout.schedule not in capabilities.SPLIT_BACKWARD
    assert best.estimate["bubble_fraction"] < 0.05


# --- §2 hybrid sharding -----------------------------------------------------------------------------------------

HSDP = "llama3-1b-hsdp-1024xh100.yaml"


def test_hybrid_sharding_wins_on_128_nodes_at_100_gbits():
    """Llama 3.2 1B over 1,024 H100 at 100 Gb/s per GPU, dp_shard left to the search: shard inside each node,
    replicate across the 128; the same layout sharded over all 1,024 is slower by more than the tie band."""
    result = pick(example(HSDP))
    best = chosen(result)
    assert best.layout.dp_shard == 8 and best.dp_replicas == 128
    spec, bw = spec_from_dict(example(HSDP)), result.bandwidth
    full = estimate(spec.model, spec.train, spec.gpu, dataclasses.replace(best.layout, dp_shard=None), bw, 8)
    assert full.step_time_s > (1 + TIE_BAND) * step(result)


def test_full_sharding_stays_on_two_nodes_at_400_gbits():
    """The same model on 2 nodes at the preset's 400 Gb/s per GPU: a 16-rank ring costs little, hybrid sharding
    (which fits: it is a real alternative) gains nothing worth its replicas' all-reduce and its memory, and the plan
    shards over all of dp."""
    job = example(HSDP)
    job["cluster"]["nodes"] = 2
    del job["cluster"]["network_gbs_per_gpu"]
    job["train"]["global_batch"] = 32
    best = chosen(pick(job))
    assert best.layout.dp_shard is None and best.layout.zero >= 1 and best.layout.dp == 16
    spec = spec_from_dict(job)
    hybrid = dataclasses.replace(best.layout, dp_shard=8)
    assert memory_ledger(spec.model, spec.train, spec.gpu, hybrid, spec.cluster.memory_headroom).fits


# --- §3 all-to-all context parallelism ------------------------------------------------------------------------

ULYSSES = "llama2-7b-128k-ulysses.yaml"


def test_ulysses_wins_with_32_kv_heads_at_128k():
    """Llama 2 7B (32 heads, no GQA) at 128k on two 8-GPU nodes, the whole layout searched: cp 8 inside each node,
    by all-to-all, the example's layout without its cp_attention line."""
    job = example(ULYSSES)
    job["parallel"] = "auto"
    lay = chosen(pick(job)).layout
    assert (lay.cp, lay.cp_attention, lay.tp * lay.cp) == (8, "all-to-all", 8)


@pytest.mark.parametrize("change, why", [
    ({"model": "llama3-8b"}, "GQA: 8 kv heads make the gathered keys and values a quarter of all-to-all's q and out"),
    ({"train": {"seq_len": 8192, "global_batch": 256, "steps": 100}}, "8k tokens: no CP at all"),
])
def test_all_gather_or_no_cp_where_ulysses_should_not_be_used(change, why):
    job = example(ULYSSES) | change
    job["parallel"] = "auto"
    lay = chosen(pick(job)).layout
    assert lay.cp_attention == "all-gather", why
    if "train" in change:
        assert lay.cp == 1, why


# --- §4 fp8 -----------------------------------------------------------------------------------------------------

COMPILE = "llama3-8b-compile-8xh100.yaml"


def test_fp8_is_faster_than_bf16_on_torchtitans_h100_shape():
    """Llama 3 8B on 8 H100, FSDP, selective recompute, compiled blocks: the planner keeps the layout and fp8 linears
    (the rowwise recipe the trainer runs) are faster than bf16 by about torchao's published figure for that recipe
    on this shape (+10%: launcher/plan/fp8.py), at least 5% and less than the tensorwise recipe's +28% (torchtitan's
    6,667 -> 8,532)."""
    bf16 = example(COMPILE)
    fp8 = copy.deepcopy(bf16)
    fp8["train"] |= {"precision": "fp8", "fp8_linears": "auto"}
    assert chosen(pick(fp8)).layout == chosen(pick(bf16)).layout
    assert 1.05 < step(pick(bf16)) / step(pick(fp8)) < 1.28


def test_fp8_is_refused_without_fp8_tensor_cores_and_skips_small_linears():
    """An A100 has no FP8 tensor cores: one line naming train.precision. On an H100 the auto filter leaves Llama 3
    8B's k and v projections (1,024 x 4,096, below torchao's thresholds) in bf16, and converting them too
    (fp8_linears all) gains nothing material: their compiled casts cost about what their faster GEMMs save."""
    job = example(COMPILE)
    job["train"] |= {"precision": "fp8"}
    with pytest.raises(SpecError, match=r"^train.precision: .*FP8 tensor cores"):
        spec_from_dict(job | {"cluster": {**job["cluster"], "gpu": "a100-80gb"}})
    model = spec_from_dict(job).model
    auto, every = rank_linears(model, 1, "auto"), rank_linears(model, 1, "all")
    assert len(every) - len(auto) == 2 and all((n, k) != (1024, 4096) for n, k, _, _ in auto)
    auto_job = pick(job)
    all_job = copy.deepcopy(job)
    all_job["train"]["fp8_linears"] = "all"
    assert step(pick(all_job)) > 0.995 * step(auto_job)


def test_fp8_is_slower_where_its_casts_dominate():
    """Llama 3 1B in the same layout (micro-batch 1) at 1,024 tokens a sequence: every GEMM has 1,024 rows, so the
    weights' casts (per micro-batch, whatever its size) outweigh what the fp8 GEMMs save and fp8 is the slower plan
    (torchao's float8 README: a linear with M, K, N = 1024, 2048, 1024 runs at 0.80x of bf16)."""
    bf16 = example(COMPILE) | {"model": "llama3-1b"}
    bf16["train"] |= {"seq_len": 1024, "global_batch": 64}
    fp8 = copy.deepcopy(bf16)
    fp8["train"] |= {"precision": "fp8", "fp8_linears": "auto"}
    assert chosen(pick(fp8)).layout == chosen(pick(bf16)).layout
    assert step(pick(fp8)) > step(pick(bf16))


# --- §5 compiled blocks ------------------------------------------------------------------------------------------

def test_compiled_blocks_win_on_h100():
    """torchtitan's Table 1 job with train.compile left out: the plan compiles its blocks and is faster than the
    same layout eager (only the elementwise term differs: the tie band does not decide)."""
    job = example(COMPILE)
    del job["train"]["compile"]
    result = pick(job)
    assert chosen(result).layout.compile
    eager = copy.deepcopy(job)
    eager["train"]["compile"] = False
    assert chosen(pick(eager)).layout == dataclasses.replace(chosen(result).layout, compile=False)
    assert step(result) < step(pick(eager))


def test_eager_blocks_under_a_split_backward_and_on_the_cpu_preset():
    """The bubble-bound pipeline's ZB-V plan stays eager (torch refuses compiled stages under a split backward,
    and the split still wins over compiled whole-backward schedules: the schedule test above); on the cpu preset
    nothing measured compile's gain and the planner keeps eager blocks."""
    job = example(ZBV)
    del job["parallel"]["schedule"]
    best = chosen(pick(job))
    assert best.layout.schedule in capabilities.SPLIT_BACKWARD and not best.layout.compile
    cpu = pick(example("tiny-cpu.yaml") | {"parallel": "auto"})
    assert not chosen(cpu).layout.compile
    assert cpu.rejected["no faster with compiled blocks (train.compile)"] > 0
