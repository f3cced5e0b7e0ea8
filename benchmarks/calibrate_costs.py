"""Calibrate the time model against published step times and print the error per stack family.

Every row is a published run (source cited per row), run through the same `estimate()` the planner
uses with the stack profile of the software that ran it (launcher.plan.costs.STACKS). Rows alternate
between a fit half and a held-out half (within each family, in the order listed); `--fit` refits
each family's compute-efficiency ceiling (and, for DeepSpeed, its overlap) on the fit half and
reports the held-out error with the refitted value beside the shipped constants, and per GPU type
where a family's rows span GPU generations (each GPU's rows refitted alone).

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
"""

from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import dataclass, replace

from launcher.plan.costs import STACKS, Stack, advertised_bandwidth, estimate
from launcher.plan.ledger import Layout
from launcher.plan.spec import ModelSpec, TrainSpec, resolve_gpu, resolve_model


def gpt(layers: int, hidden: int, heads: int) -> ModelSpec:
    return ModelSpec(layers=layers, hidden=hidden, heads=heads, vocab=51200, mlp="gelu", tied_embeddings=True)


NEMOTRON = ModelSpec(layers=96, hidden=18432, heads=96, kv_heads=8, ffn_hidden=73728, vocab=256000,
                     mlp="gelu", tied_embeddings=False)
GPT175, GPT530 = gpt(96, 12288, 96), gpt(105, 20480, 128)
LLAMA2_7B = resolve_model("llama2-7b")
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
    unit: str            # "s" (step time), "tok/s/GPU", or "TF-N21" (TFLOP/s per GPU, Narayanan's count)
    gpus_per_node: int = 8
    stack: str = ""      # the profile in launcher.plan.costs.STACKS, when not the family's own

    def profile(self, fitted: dict[str, Stack] | None = None) -> Stack:
        base = (fitted or {}).get(self.family) or STACKS[self.family]
        if self.stack:
            own = STACKS[self.stack]
            return replace(own, efficiency_max=base.efficiency_max)   # the family's ceiling, the stack's habits
        return base


def mp(tp, pp, dp, mb, rc="selective", v=1, zero=1):
    return dict(tp=tp, pp=pp, dp=dp, micro_batch=mb, recompute=rc, v=v, zero=zero)


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

FAMILIES = {"megatron": "Megatron-class (Megatron-LM, NeMo)", "bundled": "torchtitan-class (eager FSDP2)",
            "deepspeed": "DeepSpeed ZeRO-3"}


def n21_flops(model: ModelSpec, gbs: int, s: int) -> float:
    """Narayanan et al.'s FLOPs per iteration (full recompute counted): 96·B·s·l·h²(1 + s/6h + V/16lh)."""
    h, layer = model.hidden, model.layers
    return 96 * gbs * s * layer * h * h * (1 + s / (6 * h) + model.vocab / (16 * layer * h))


def predicted(case: Case, stack: Stack) -> float:
    """The model's figure in the case's unit."""
    kw = case.layout
    gpu = resolve_gpu(case.gpu)
    dp, mb, v = kw["dp"], kw["micro_batch"], kw["v"]
    lay = Layout(tp=kw["tp"], cp=1, pp=kw["pp"], dp=dp, ep=1, zero=kw["zero"], recompute=kw["recompute"],
                 micro_batch=mb, grad_accum=case.gbs // (dp * mb),
                 schedule="interleaved-1f1b" if v > 1 else "1f1b", virtual_stages=v)
    train = TrainSpec(seq_len=case.seq, global_batch=case.gbs)
    est = estimate(case.model, train, gpu, lay, advertised_bandwidth(gpu), case.gpus_per_node, stack=stack)
    if case.unit == "s":
        return est.step_time_s
    if case.unit == "tok/s/GPU":
        return est.tokens_per_s / lay.world
    return n21_flops(case.model, case.gbs, case.seq) / est.step_time_s / lay.world / 1e12


def error(case: Case, fitted: dict[str, Stack] | None = None) -> float:
    """Relative step-time error (positive = the model is slower than published)."""
    ours = predicted(case, case.profile(fitted))
    if case.unit == "s":
        return (ours - case.published) / case.published
    return case.published / ours - 1           # throughput units: step time ∝ 1/throughput


def halves(family: str) -> tuple[list[Case], list[Case]]:
    rows = [c for c in CASES if c.family == family]
    return rows[0::2], rows[1::2]


def fit(family: str, gpu: str | None = None) -> Stack:
    """Refit the family's efficiency ceiling (and DeepSpeed's overlap) on its fit half (of one GPU type
    when given): the grid point with the smallest mean |log(model/published)| (symmetric in over- and
    under-estimates)."""
    base = STACKS[family]
    fit_rows = [c for c in halves(family)[0] if gpu in (None, c.gpu)]
    grid = [dict(efficiency_max=e / 100) for e in range(30, 81)]
    if family == "deepspeed":
        grid = [dict(efficiency_max=e / 100, fsdp_overlap=o / 20) for e in range(30, 81, 2) for o in range(0, 21)]

    def loss(kw: dict) -> float:
        return statistics.mean(abs(math.log1p(error(c, {family: replace(base, **kw)}))) for c in fit_rows)

    return replace(base, **min(grid, key=loss))


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
        print(f"  {name:36} ceiling {STACKS[family].efficiency_max:.2f}  fit half: {summary(fit_rows)}"
              f"   held-out: {summary(held)}")
    if args.fit:
        print("\nrefitted on the fit half, error on the held-out half:")
        for family, name in FAMILIES.items():
            s = {family: fit(family)}
            fit_rows, held = halves(family)
            extra = f" overlap {s[family].fsdp_overlap:.2f}" if family == "deepspeed" else ""
            print(f"  {name:36} ceiling {s[family].efficiency_max:.2f}{extra}  fit half: {summary(fit_rows, s)}"
                  f"   held-out: {summary(held, s)}")
        print("\nper GPU type (a stack has one ceiling; where its rows span GPU generations, each refitted alone):")
        for family, name in FAMILIES.items():
            fit_rows, held = halves(family)
            gpus = sorted({c.gpu for c in fit_rows + held})
            for gpu in gpus if len(gpus) > 1 else []:
                f_g, h_g = [c for c in fit_rows if c.gpu == gpu], [c for c in held if c.gpu == gpu]
                s = {family: fit(family, gpu)} if f_g else None
                refit = f"refit ceiling {s[family].efficiency_max:.2f}: held-out {summary(h_g, s)}" if s else \
                    "no fit row"
                print(f"  {name:36} {gpu:10} shipped: held-out {summary(h_g)}   {refit}")


if __name__ == "__main__":
    main()
