"""Calibrate the time model against published step times and print the error we reach.

Anchors (../shared/notes/planner.md): Korthikanti et al. 2022 Table 5 (A100-80GB, Selene),
Nemotron-4 340B (H100; technical report and NVIDIA dgxc-benchmarking), torchtitan Llama 3 on H100
(bf16 rows only). Each case is run through the same `estimate()` the planner uses.
"""

from __future__ import annotations

import statistics

from launcher.costs import advertised_bandwidth, estimate
from launcher.ledger import Layout
from launcher.spec import ModelSpec, TrainSpec, resolve_gpu, resolve_model


def gpt(layers: int, hidden: int, heads: int) -> ModelSpec:
    return ModelSpec(layers=layers, hidden=hidden, heads=heads, vocab=51200, mlp="gelu", tied_embeddings=True)


NEMOTRON = ModelSpec(layers=96, hidden=18432, heads=96, kv_heads=8, ffn_hidden=73728, vocab=256000,
                     mlp="gelu", tied_embeddings=False)

# (label, model, gpu, seq, global batch, layout kwargs, gpus_per_node, published value, unit)
CASES = [
    ("Korthikanti 22B  t8      sel+SP", gpt(48, 6144, 64), "a100-80gb", 2048, 4,
     dict(tp=8, pp=1, dp=1, micro_batch=4, recompute="selective"), 8, 1.10, "s"),
    ("Korthikanti 175B t8 p8v3 sel+SP", gpt(96, 12288, 96), "a100-80gb", 2048, 64,
     dict(tp=8, pp=8, dp=1, micro_batch=1, recompute="selective", v=3), 8, 13.75, "s"),
    ("Korthikanti 530B t8p35v3 sel+SP", gpt(105, 20480, 128), "a100-80gb", 2048, 280,
     dict(tp=8, pp=35, dp=1, micro_batch=1, recompute="selective", v=3), 8, 37.83, "s"),
    ("Korthikanti 1T   t8 p64  sel+SP", gpt(128, 25600, 160), "a100-80gb", 2048, 512,
     dict(tp=8, pp=64, dp=1, micro_batch=1, recompute="selective"), 8, 71.49, "s"),
    ("Korthikanti 22B  t8      full  ", gpt(48, 6144, 64), "a100-80gb", 2048, 4,
     dict(tp=8, pp=1, dp=1, micro_batch=4, recompute="full"), 8, 1.42, "s"),
    ("Korthikanti 175B t8 p8v3 full  ", gpt(96, 12288, 96), "a100-80gb", 2048, 64,
     dict(tp=8, pp=8, dp=1, micro_batch=1, recompute="full", v=3), 8, 18.13, "s"),
    ("Korthikanti 530B t8p35v3 full  ", gpt(105, 20480, 128), "a100-80gb", 2048, 280,
     dict(tp=8, pp=35, dp=1, micro_batch=1, recompute="full", v=3), 8, 49.05, "s"),
    ("Korthikanti 1T   t8 p64  full  ", gpt(128, 25600, 160), "a100-80gb", 2048, 512,
     dict(tp=8, pp=64, dp=1, micro_batch=1, recompute="full"), 8, 94.42, "s"),
    ("Nemotron-4 340B t8p12 dp16     ", NEMOTRON, "h100-sxm", 4096, 768,
     dict(tp=8, pp=12, dp=16, micro_batch=1, recompute="selective", v=8, zero=1), 8, 10.3, "s"),
    ("dgxc Nemotron 340B t8p8v12 128 ", NEMOTRON, "h100-sxm", 4096, 32,
     dict(tp=8, pp=8, dp=2, micro_batch=1, recompute="selective", v=12, zero=1), 8, 4.61, "s"),
    ("dgxc Nemotron 340B t8p8v12 1024", NEMOTRON, "h100-sxm", 4096, 256,
     dict(tp=8, pp=8, dp=16, micro_batch=1, recompute="selective", v=12, zero=1), 8, 4.73, "s"),
    ("torchtitan 8B FSDP8 sel, 8 GPUs", resolve_model("llama3-8b"), "h100-sxm", 8192, 16,
     dict(tp=1, pp=1, dp=8, micro_batch=2, recompute="selective", zero=3), 8, 5762, "tok/s/GPU"),
    ("torchtitan 8B FSDP128 sel      ", resolve_model("llama3-8b"), "h100-sxm", 8192, 256,
     dict(tp=1, pp=1, dp=128, micro_batch=2, recompute="selective", zero=3), 8, 5605, "tok/s/GPU"),
    ("torchtitan 70B FSDP32 TP8 full ", resolve_model("llama3-70b"), "h100-sxm", 8192, 512,
     dict(tp=8, pp=1, dp=32, micro_batch=16, recompute="full", zero=3), 8, 597, "tok/s/GPU"),
]


#: torchtitan runs eager PyTorch (no fused Megatron kernels): its rows are also shown at this
#: compute-efficiency ceiling, which a job sets as cluster.compute_efficiency.
EAGER_EFFICIENCY = 0.42


def run_case(model, gpu_name, seq, gbs, kw, gpn, efficiency_max=None):
    gpu = resolve_gpu(gpu_name)
    v = kw.get("v", 1)
    dp, mb = kw["dp"], kw["micro_batch"]
    lay = Layout(tp=kw["tp"], cp=1, pp=kw["pp"], dp=dp, ep=1, zero=kw.get("zero", 1),
                 recompute=kw["recompute"], micro_batch=mb, grad_accum=gbs // (dp * mb),
                 schedule="interleaved-1f1b" if v > 1 else "1f1b", virtual_stages=v)
    train = TrainSpec(seq_len=seq, global_batch=gbs, grad_dtype="fp32")
    return estimate(model, train, gpu, lay, advertised_bandwidth(gpu), gpn, efficiency_max=efficiency_max)


def main() -> None:
    errors, megatron = [], []
    print(f"{'case':40} {'published':>10} {'model':>10} {'error':>8}  {'MFU':>6} {'HFU':>6}")
    for label, model, gpu, seq, gbs, kw, gpn, published, unit in CASES:
        variants = [(label, None)]
        if label.startswith("torchtitan"):
            variants.append((label.rstrip() + f" @{EAGER_EFFICIENCY}", EAGER_EFFICIENCY))
        for name, eff in variants:
            est = run_case(model, gpu, seq, gbs, kw, gpn, eff)
            ours = est.step_time_s if unit == "s" else est.tokens_per_s / (kw["tp"] * kw["pp"] * kw["dp"])
            err = (ours - published) / published
            print(f"{name:40} {published:>10.2f} {ours:>10.2f} {err:>+8.1%}  {est.mfu:>6.1%} {est.hfu:>6.1%}  {unit}")
            if not label.startswith("torchtitan"):
                megatron.append(abs(err))
            if eff is not None or not label.startswith("torchtitan"):
                errors.append(abs(err))
    print(f"\nMegatron-class stacks (Korthikanti, Nemotron): mean |error| {statistics.mean(megatron):.1%}, "
          f"max {max(megatron):.1%} over {len(megatron)} cases")
    print(f"all cases (torchtitan at compute_efficiency {EAGER_EFFICIENCY}): mean |error| "
          f"{statistics.mean(errors):.1%}, max {max(errors):.1%} over {len(errors)} cases")


if __name__ == "__main__":
    main()
