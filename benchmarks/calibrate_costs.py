"""Calibrate the time model against published step times and print the error per stack family.

Every row is a published run (source cited per row), run through the same `estimate()` the planner
uses with the stack profile of the software that ran it (launcher.plan.costs.STACKS). Rows alternate
between a fit half and a held-out half (within each family, in the order listed); `--fit` refits
each family's compute-efficiency ceiling (and, for DeepSpeed, its overlap) on the fit half and
reports the held-out error with the refitted value beside the shipped constants (a stack with a
ceiling per GPU generation, the eager one, gets each generation's refitted on that generation's fit
rows). `sweeps` checks the planner's sense of order: where one publication measured one model on one
GPU type at one sequence length in several layouts, the layout it measured fastest (per GPU) must be
the one the model predicts fastest.

Sources (transcriptions in ../shared/notes/planner.md unless marked):
- K22: Korthikanti et al. 2022, "Reducing Activation Recomputation", Table 5 (A100-80GB, Selene).
- N340: Nemotron-4 340B technical report, Table 2; NV-dgxc: NVIDIA dgxc-benchmarking
  nemotron/README_340b.md (BF16).
- N21: Narayanan et al. SC21, "Efficient Large-Scale Language Model Training on GPU Clusters",
  Table 2 (PTD-P vs ZeRO-3 without model parallelism, A100 Selene, TFLOP/s per GPU counted with
  full recompute, 96·B·s·l·h²(1 + s/6h + V/16lh)). The 175B/530B ZeRO-3 end points are quoted
  in issue 10; the middle rows and batch sizes are this file's transcription, unverified.
- TT: torchtitan benchmarks/llama3_h100_202412_torchtitan.md (H100 at 500 W, bf16 rows: Tables 1
  and 3, eager FSDP) and the June 2025 bf16 70B figure (benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md,
  with torch.compile). Every other torchtitan table there (and the Trainy H200 files) uses Float8 or
  torch.compile + Float8: not rows for a bf16 model.
- FMS: PyTorch blog "Maximizing training throughput using PyTorch FSDP" (IBM + Meta, 2024-03,
  pytorch.org/blog/maximizing-training, Table 1): eager FSDP + SDPA FlashAttention-2, Llama 2
  7B/34B/70B (architectures: foundation-model-stack/fms-fsdp fms_fsdp/utils/config_utils.py), seq
  4096, 2 sequences per GPU, tokens/s per GPU on 128 A100-80GB and on 96 H100-80GB. Activation
  checkpointing: none (7B), every block (34B, 70B) = full; the 13B rows checkpoint every n-th block
  with n not stated, so they are left out. Sharding is not named in the blog; fms-fsdp's default is
  HSDP (shard within a node, replicate across nodes), and full sharding over 16 nodes at the stated
  400 Gb/s per node could not reach the published 3,700 tok/s: the rows are costed as FSDP over one
  node, the cross-node all-reduce of each GPU's 1/8 gradient shard uncharged (the planner has no HSDP).
  Its follow-up (pytorch.org/blog/maximizing-training-throughput, 2024) repeats the same no-compile
  MFUs and adds torch.compile ones: not separate rows.
- L3: Llama 3 paper (Grattafiori et al., arXiv 2407.21783), Table 4 (BF16 TFLOP/s per GPU, model FLOPs,
  H100-80GB, 16M tokens a step) and §3.3.2: 8,192 GPUs TP8 CP1 PP16 DP64 seq 8,192 32 sequences per DP
  rank: 430; 16,384 GPUs DP128 16 per DP rank: 400; 16,384 GPUs TP8 CP16 PP16 seq 131,072 16 per DP
  rank: 380 (DP 8 from 16,384 GPUs and 16M tokens; one transcription of the table prints 4). From
  §3.3.2: FSDP shards optimizer state and gradients but keeps parameters gathered after forward (ZeRO 2
  here), fp32 gradient reduce-scatter; interleaved 1F1B with V stages a rank, bubble (PP-1)/(V·M); one
  layer fewer on the first and last stage so that "the first model chunk on the first stage has only
  the embedding, and the last ... only output projection and loss": one-layer chunks, 128 slots for 126
  layers, so V = 8 (inferred: V is not printed); no activation checkpointing at 8K (none; assumed
  also for the 128K row, whose per-rank tokens are the same 8K); micro-batch 1 (not printed; M then
  equals the batch per DP rank). CP: K/V all-gathered, latency exposed (STACKS["llama3"]).
"""

from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import dataclass, replace

from launcher.plan.costs import (
    GENERATIONS,
    STACKS,
    Stack,
    advertised_bandwidth,
    estimate,
    model_flops_per_token,
)
from launcher.plan.ledger import Layout
from launcher.plan.spec import ModelSpec, TrainSpec, resolve_gpu, resolve_model


def gpt(layers: int, hidden: int, heads: int) -> ModelSpec:
    return ModelSpec(layers=layers, hidden=hidden, heads=heads, vocab=51200, mlp="gelu", tied_embeddings=True)


NEMOTRON = ModelSpec(layers=96, hidden=18432, heads=96, kv_heads=8, ffn_hidden=73728, vocab=256000,
                     mlp="gelu", tied_embeddings=False)
GPT175, GPT530 = gpt(96, 12288, 96), gpt(105, 20480, 128)
LLAMA2_7B = resolve_model("llama2-7b")
LLAMA3_405B = resolve_model("llama3-405b")
LLAMA2_34B = ModelSpec(layers=48, hidden=8192, heads=64, kv_heads=8, ffn_hidden=22016, vocab=32000, mlp="swiglu",
                       tied_embeddings=False)
LLAMA2_70B = ModelSpec(layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672, vocab=32000, mlp="swiglu",
                       tied_embeddings=False)


@dataclass(frozen=True)
class Case:
    label: str
    source: str
    family: str          # the stack family the row counts under (FAMILIES)
    model: ModelSpec
    gpu: str
    seq: int
    gbs: int
    layout: dict
    published: float
    unit: str            # "s" (step time), "tok/s/GPU", "TF-N21" (TFLOP/s per GPU, Narayanan's count) or
                         # "TF" (model TFLOP/s per GPU, this model's count = PaLM's 6N + 12·L·h·s)
    gpus_per_node: int = 8
    stack: str = ""      # the profile in launcher.plan.costs.STACKS, when not the family's own

    def profile(self, fitted: dict[str, Stack] | None = None) -> Stack:
        base = (fitted or {}).get(self.family) or STACKS[self.family]
        if self.stack:
            own = STACKS[self.stack]
            # the family's ceiling(s), the stack's habits
            return replace(own, efficiency_max=base.efficiency_max, ceiling_by_generation=base.ceiling_by_generation)
        return base


def mp(tp, pp, dp, mb, rc="selective", v=1, zero=1, cp=1):
    return dict(tp=tp, pp=pp, dp=dp, micro_batch=mb, recompute=rc, v=v, zero=zero, cp=cp)


CASES = [
    Case("22B  t8 sel+SP", "K22 T5", "megatron", gpt(48, 6144, 64), "a100-80gb", 2048, 4, mp(8, 1, 1, 4), 1.10, "s"),
    Case("175B t8p8v3 sel+SP", "K22 T5", "megatron", GPT175, "a100-80gb", 2048, 64, mp(8, 8, 1, 1, v=3), 13.75, "s"),
    Case("530B t8p35v3 sel+SP", "K22 T5", "megatron", GPT530, "a100-80gb", 2048, 280, mp(8, 35, 1, 1, v=3), 37.83, "s"),
    Case("1T   t8p64 sel+SP", "K22 T5", "megatron", gpt(128, 25600, 160), "a100-80gb", 2048, 512,
         mp(8, 64, 1, 1), 71.49, "s"),
    Case("22B  t8 full", "K22 T5", "megatron", gpt(48, 6144, 64), "a100-80gb", 2048, 4, mp(8, 1, 1, 4, "full"), 1.42, "s"),
    Case("175B t8p8v3 full", "K22 T5", "megatron", GPT175, "a100-80gb", 2048, 64, mp(8, 8, 1, 1, "full", 3), 18.13, "s"),
    Case("530B t8p35v3 full", "K22 T5", "megatron", GPT530, "a100-80gb", 2048, 280,
         mp(8, 35, 1, 1, "full", 3), 49.05, "s"),
    Case("1T   t8p64 full", "K22 T5", "megatron", gpt(128, 25600, 160), "a100-80gb", 2048, 512,
         mp(8, 64, 1, 1, "full"), 94.42, "s"),
    Case("Nemotron-4 340B t8p12v8 dp16", "N340 T2", "megatron", NEMOTRON, "h100-sxm", 4096, 768,
         mp(8, 12, 16, 1, v=8), 10.3, "s"),
    Case("Nemotron 340B t8p8v12 128 GPUs", "NV-dgxc", "megatron", NEMOTRON, "h100-sxm", 4096, 32,
         mp(8, 8, 2, 1, v=12), 4.61, "s"),
    Case("Nemotron 340B t8p8v12 1024 GPUs", "NV-dgxc", "megatron", NEMOTRON, "h100-sxm", 4096, 256,
         mp(8, 8, 16, 1, v=12), 4.73, "s"),
    Case("175B PTD-P t8p12 384 GPUs", "N21 T2", "megatron", GPT175, "a100-80gb", 2048, 1536,
         mp(8, 12, 4, 1, "full"), 153, "TF-N21"),
    Case("175B PTD-P t8p12 1536 GPUs", "N21 T2", "megatron", GPT175, "a100-80gb", 2048, 1536,
         mp(8, 12, 16, 1, "full"), 141, "TF-N21"),
    Case("530B PTD-P t8p35 1120 GPUs", "N21 T2", "megatron", GPT530, "a100-80gb", 2048, 2240,
         mp(8, 35, 4, 1, "full"), 167, "TF-N21"),
    Case("Llama3 405B t8p16v8 dp64", "L3 T4", "megatron", LLAMA3_405B, "h100-sxm", 8192, 2048,
         mp(8, 16, 64, 1, "none", v=8, zero=2), 430, "TF", stack="llama3"),
    Case("Llama3 405B t8p16v8 dp128", "L3 T4", "megatron", LLAMA3_405B, "h100-sxm", 8192, 2048,
         mp(8, 16, 128, 1, "none", v=8, zero=2), 400, "TF", stack="llama3"),
    Case("Llama3 405B t8c16p16v8 dp8 128K", "L3 T4", "megatron", LLAMA3_405B, "h100-sxm", 131072, 128,
         mp(8, 16, 8, 1, "none", v=8, zero=2, cp=16), 380, "TF", stack="llama3"),
    Case("175B ZeRO-3 dp384 mb4", "N21 T2", "deepspeed", GPT175, "a100-80gb", 2048, 1536,
         mp(1, 1, 384, 4, "full", zero=3), 144, "TF-N21"),
    Case("175B ZeRO-3 dp768 mb2", "N21 T2", "deepspeed", GPT175, "a100-80gb", 2048, 1536,
         mp(1, 1, 768, 2, "full", zero=3), 88, "TF-N21"),
    Case("175B ZeRO-3 dp1536 mb1", "N21 T2", "deepspeed", GPT175, "a100-80gb", 2048, 1536,
         mp(1, 1, 1536, 1, "full", zero=3), 44, "TF-N21"),
    Case("530B ZeRO-3 dp640 mb4", "N21 T2", "deepspeed", GPT530, "a100-80gb", 2048, 2560,
         mp(1, 1, 640, 4, "full", zero=3), 138, "TF-N21"),
    Case("530B ZeRO-3 dp2240 mb1", "N21 T2", "deepspeed", GPT530, "a100-80gb", 2048, 2240,
         mp(1, 1, 2240, 1, "full", zero=3), 48, "TF-N21"),
    Case("530B ZeRO-3 dp1120 mb2", "N21 T2", "deepspeed", GPT530, "a100-80gb", 2048, 2240,
         mp(1, 1, 1120, 2, "full", zero=3), 98, "TF-N21"),
    Case("8B FSDP8 sel, 8 GPUs", "TT 2024-12", "bundled", resolve_model("llama3-8b"), "h100-sxm", 8192, 16,
         mp(1, 1, 8, 2, zero=3), 5762, "tok/s/GPU", stack="torchtitan"),
    Case("8B FSDP128 sel", "TT 2024-12", "bundled", resolve_model("llama3-8b"), "h100-sxm", 8192, 256,
         mp(1, 1, 128, 2, zero=3), 5605, "tok/s/GPU", stack="torchtitan"),
    Case("70B FSDP32 TP8 full", "TT 2025-06", "bundled", resolve_model("llama3-70b"), "h100-sxm", 8192, 512,
         mp(8, 1, 32, 16, "full", zero=3), 597, "tok/s/GPU"),
    # FMS rows: one node's HSDP shard group (dp 8) stands for the whole cluster (see the docstring)
    Case("Llama2 7B HSDP, 128 A100, no AC", "FMS T1", "bundled", LLAMA2_7B, "a100-80gb", 4096, 16,
         mp(1, 1, 8, 2, "none", zero=3), 3700, "tok/s/GPU"),
    Case("Llama2 7B HSDP, 96 H100, no AC", "FMS T1", "bundled", LLAMA2_7B, "h100-sxm", 4096, 16,
         mp(1, 1, 8, 2, "none", zero=3), 7500, "tok/s/GPU"),
    Case("Llama2 34B HSDP, 96 H100, full AC", "FMS T1", "bundled", LLAMA2_34B, "h100-sxm", 4096, 16,
         mp(1, 1, 8, 2, "full", zero=3), 1550, "tok/s/GPU"),
    Case("Llama2 34B HSDP, 128 A100, full AC", "FMS T1", "bundled", LLAMA2_34B, "a100-80gb", 4096, 16,
         mp(1, 1, 8, 2, "full", zero=3), 700, "tok/s/GPU"),
    Case("Llama2 70B HSDP, 128 A100, full AC", "FMS T1", "bundled", LLAMA2_70B, "a100-80gb", 4096, 16,
         mp(1, 1, 8, 2, "full", zero=3), 370, "tok/s/GPU"),
    Case("Llama2 70B HSDP, 96 H100, full AC", "FMS T1", "bundled", LLAMA2_70B, "h100-sxm", 4096, 16,
         mp(1, 1, 8, 2, "full", zero=3), 800, "tok/s/GPU"),
]

FAMILIES = {"megatron": "Megatron-class (Megatron-LM, NeMo, Llama 3)", "bundled": "torchtitan-class (eager FSDP2)",
            "deepspeed": "DeepSpeed ZeRO-3"}


def n21_flops(model: ModelSpec, gbs: int, s: int) -> float:
    """Narayanan et al.'s FLOPs per iteration (full recompute counted): 96·B·s·l·h²(1 + s/6h + V/16lh)."""
    h, layer = model.hidden, model.layers
    return 96 * gbs * s * layer * h * h * (1 + s / (6 * h) + model.vocab / (16 * layer * h))


def layout_of(case: Case) -> Layout:
    kw = case.layout
    dp, mb, v = kw["dp"], kw["micro_batch"], kw["v"]
    return Layout(tp=kw["tp"], cp=kw["cp"], pp=kw["pp"], dp=dp, ep=1, zero=kw["zero"], recompute=kw["recompute"],
                  micro_batch=mb, grad_accum=case.gbs // (dp * mb),
                  schedule="interleaved-1f1b" if v > 1 else "1f1b", virtual_stages=v)


def model_step(case: Case, stack: Stack) -> float:
    """The model's step time (s) for the case's layout under `stack`."""
    gpu = resolve_gpu(case.gpu)
    train = TrainSpec(seq_len=case.seq, global_batch=case.gbs)
    return estimate(case.model, train, gpu, layout_of(case), advertised_bandwidth(gpu), case.gpus_per_node,
                    stack=stack).step_time_s


def in_unit(case: Case, step: float) -> float:
    """A step time (s) in the case's published unit."""
    world = layout_of(case).world
    if case.unit == "s":
        return step
    if case.unit == "tok/s/GPU":
        return case.gbs * case.seq / step / world
    if case.unit == "TF":
        return model_flops_per_token(case.model, case.seq) * case.gbs * case.seq / step / world / 1e12
    return n21_flops(case.model, case.gbs, case.seq) / step / world / 1e12


def published_step(case: Case) -> float:
    """The published figure as a step time (s): every unit is a step time or inversely proportional to one."""
    return case.published if case.unit == "s" else in_unit(case, 1.0) / case.published


def predicted(case: Case, stack: Stack) -> float:
    """The model's figure in the case's unit."""
    return in_unit(case, model_step(case, stack))


def error(case: Case, fitted: dict[str, Stack] | None = None) -> float:
    """Relative step-time error (positive = the model is slower than published)."""
    return model_step(case, case.profile(fitted)) / published_step(case) - 1


def sweeps(rows: list[Case] | None = None) -> list[list[Case]]:
    """Rows of one publication measuring one model on one GPU type at one sequence length in several
    layouts (any stack): the comparisons a planner must get the order of."""
    groups: dict[tuple, list[Case]] = {}
    for c in rows or CASES:
        groups.setdefault((c.source.split()[0], c.model, c.gpu, c.seq), []).append(c)
    return [g for g in groups.values() if len(g) > 1]


def per_gpu_rate(case: Case, step: float) -> float:
    """Tokens per second per GPU at `step` seconds a step (the fair order across world sizes)."""
    return case.gbs * case.seq / step / layout_of(case).world


def sweep_order(group: list[Case], fitted: dict[str, Stack] | None = None) -> tuple[list[str], list[str]]:
    """(labels fastest first as published, as the model predicts), per GPU."""
    measured = sorted(group, key=lambda c: -per_gpu_rate(c, published_step(c)))
    ours = sorted(group, key=lambda c: -per_gpu_rate(c, model_step(c, c.profile(fitted))))
    return [c.label for c in measured], [c.label for c in ours]


def halves(family: str) -> tuple[list[Case], list[Case]]:
    rows = [c for c in CASES if c.family == family]
    return rows[0::2], rows[1::2]


def fit(family: str, gpu: str | None = None) -> Stack:
    """Refit the family's efficiency ceiling (and DeepSpeed's overlap) on its fit half (of one GPU type
    when given): the grid point with the smallest mean |log(model/published)| (symmetric in over- and
    under-estimates). A stack with a ceiling per GPU generation gets each refitted on its own rows."""
    base = STACKS[family]
    fit_rows = [c for c in halves(family)[0] if gpu in (None, c.gpu)]
    own = dict(base.ceiling_by_generation)
    grid = [dict(efficiency_max=e / 100) for e in range(30, 81)]
    if family == "deepspeed":
        grid = [dict(efficiency_max=e / 100, fsdp_overlap=o / 20) for e in range(30, 81, 2) for o in range(0, 21)]

    def best(rows: list[Case], stack_of) -> dict:
        def loss(kw: dict) -> float:
            return statistics.mean(abs(math.log1p(error(c, {family: stack_of(kw)}))) for c in rows)
        return min(grid, key=loss)

    default_rows = [c for c in fit_rows if GENERATIONS.get(c.gpu) not in own]
    out = replace(base, **best(default_rows, lambda kw: replace(base, **kw))) if default_rows else base
    for gen in own:
        rows = [c for c in fit_rows if GENERATIONS.get(c.gpu) == gen]
        if rows:
            own[gen] = best(rows, lambda kw, g=gen: replace(out, ceiling_by_generation=tuple(
                {**own, g: kw["efficiency_max"]}.items())))["efficiency_max"]
    return replace(out, ceiling_by_generation=tuple(own.items()))


def ceilings(stack: Stack) -> str:
    extra = "".join(f", {g} {e:.2f}" for g, e in stack.ceiling_by_generation)
    return f"ceiling {stack.efficiency_max:.2f}{extra}"


def summary(rows: list[Case], fitted: dict[str, Stack] | None = None) -> str:
    errs = [abs(error(c, fitted)) for c in rows]
    if not errs:
        return "no rows"
    return f"median {statistics.median(errs):5.1%}  max {max(errs):5.1%}  (n={len(errs)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", action="store_true", help="also refit each family's ceiling on its fit half")
    args = ap.parse_args()
    print(f"{'case':34} {'source':11} {'half':5} {'published':>10} {'model':>10} {'step err':>9}  unit")
    for family in FAMILIES:
        fit_rows, _ = halves(family)
        for c in (c for c in CASES if c.family == family):
            half = "fit" if c in fit_rows else "held"
            print(f"{c.label:34} {c.source:11} {half:5} {c.published:>10.2f} {predicted(c, c.profile()):>10.2f} "
                  f"{error(c):>+9.1%}  {c.unit}")
    print("\n|step-time error| per stack family, shipped constants (launcher/plan/costs.py STACKS):")
    for family, name in FAMILIES.items():
        fit_rows, held = halves(family)
        print(f"  {name:44} {ceilings(STACKS[family]):26} fit half: {summary(fit_rows)}   held-out: {summary(held)}")
    print("\npublished sweeps (one source, model, GPU type and sequence length; fastest per GPU first):")
    for group in sweeps():
        measured, ours = sweep_order(group)
        verdict = "same order" if measured == ours else "fastest agrees" if measured[0] == ours[0] else "DIFFERENT"
        print(f"  {group[0].source:11} {verdict:14} measured: {' > '.join(measured)}")
        if measured != ours:
            print(f"  {'':11} {'':14} model:    {' > '.join(ours)}")
    if args.fit:
        print("\nrefitted on the fit half, error on the held-out half:")
        for family, name in FAMILIES.items():
            s = {family: fit(family)}
            fit_rows, held = halves(family)
            extra = f" overlap {s[family].fsdp_overlap:.2f}" if family == "deepspeed" else ""
            print(f"  {name:44} {ceilings(s[family]) + extra:26} fit half: {summary(fit_rows, s)}"
                  f"   held-out: {summary(held, s)}")
        print("\nper GPU type (each GPU's fit rows refitted alone; the held-out rows of that GPU):")
        for family, name in FAMILIES.items():
            fit_rows, held = halves(family)
            gpus = sorted({c.gpu for c in fit_rows + held})
            for gpu in gpus if len(gpus) > 1 else []:
                f_g, h_g = [c for c in fit_rows if c.gpu == gpu], [c for c in held if c.gpu == gpu]
                s = {family: fit(family, gpu)} if f_g else None
                refit = f"refit {ceilings(s[family])}: held-out {summary(h_g, s)}" if s else "no fit row"
                print(f"  {name:44} {gpu:10} shipped: held-out {summary(h_g)}   {refit}")

if __name__ == "__main__":
    main()
