"""What train.precision fp8 changes in the time model (torch-free): which GEMMs run at the FP8 rate, and what the
casts around them cost.

Why a module of its own: the time model (costs.compute_seconds) charges both from the converted linears' shapes on
one rank, which capabilities.fp8_converts decides on the whole model's (as the trainer converts, trainer/float8.py).

- Rate: a converted GEMM runs at the GPU's dense FP8 peak (presets' fp8_tflops, vendor datasheets) times the same
  share of it the BF16 GEMMs reach (kernels.Kernels.gemm, the BF16 MAMF): no public maximum-achievable-matmul figure
  for FP8 was found, so FP8 GEMMs are taken to reach the BF16 fraction of their own peak (cuBLAS's FP8 kernels are
  the same tile shapes at twice the rate).
- Casts: every converted linear casts, per micro-batch, its input and weight in forward, and in backward the output
  gradient twice (along each dimension), the weight again and the input along the tokens (torchao's
  matmul_with_hp_or_float8_args; sequence_parallel.py's ops the same). All of it memory-bound, at the GPU's HBM
  bandwidth; a recomputed forward casts again. What a cast costs depends on whether the block is compiled:
  - eager blocks: each cast in eager ops, |t|, its amax, an fp32 copy, the scaling, the saturation, the e4m3 result
    (CAST_BYTES an element), plus the transposed copies the kernel's layouts need and the two backward outputs
    rescaled (torchao's tensorwise kernel with the output scaled after: RESCALE_BYTES). This is why torchao's docs
    ask for torch.compile: eager, a GEMM must be large for FP8 to win.
  - compiled blocks (train.compile): the trainer converts the linears before it compiles the blocks, so inductor
    fuses each tensor's casts into the one or two kernels torchao's own roofline counts (COMPILED_*_BYTES), and the
    input gradient's rescale into the op that reads it; the weight gradient, a graph output, is rescaled by one fused
    pointwise kernel (COMPILED_RESCALE_BYTES). Checked against the published end-to-end gain of this recipe
    (tests/unit/test_capability_picks.py): torchao's float8 README, "Training benchmarks" (torchtitan, Llama 3 8B, 8 H100,
    batch 1 at 8,192, compile, FSDP2, per-op SAC): bf16 6,150 tok/s, rowwise with bf16 all-gather 6,768 (+10.05%),
    tensorwise with float8 all-gather 7,689.5 (+25.03%); torchtitan's Dec 2024 table's 6,667 -> 8,532 (+28%) is
    tensorwise (its only float8 recipe until pytorch/torchtitan#808, Feb 2025), not the rowwise recipe run here.
"""

from __future__ import annotations

from launcher.plan.capabilities import fp8_converts

#: HBM bytes one eager cast of a bf16 element moves: abs (2 read, 2 written), amax (2), the fp32 copy (2 + 4), the
#: scaling (4 + 4), the saturation (4 + 4), the e4m3 result (4 + 1)
CAST_BYTES = 33.0
#: a transposed e4m3 copy (1 + 1) for the kernel's operand layout
COPY_BYTES = 2.0
#: a backward output rescaled by the fp32 outer product of the scales: the product written (4), read (4), the bf16
#: output read and written (2 + 2)
RESCALE_BYTES = 12.0
#: compiled: an input or output gradient's casts in both directions, as torchao's roofline counts the rowwise recipe
#: (torchao/testing/float8/roofline_utils.py get_tensor_memory_traffic_ovhd_s, "rowwise", unfused with the op before):
#: read bf16, write e4m3 and a bf16 transposed copy (2 + 1 + 2), then read that copy, write e4m3 (2 + 1)
COMPILED_ACT_BYTES = 8.0
#: compiled: a weight's, the same roofline: cast (2 + 1), transpose (2 + 2), cast the transpose (2 + 1)
COMPILED_WEIGHT_BYTES = 10.0
#: compiled: the forward's casts again under recompute, the first kernel of each (input 2 + 1 + 2, weight 2 + 1)
COMPILED_RECAST_ACT_BYTES, COMPILED_RECAST_WEIGHT_BYTES = 5.0, 3.0
#: compiled: the weight gradient's rescale (torchao's addmm_float8_unwrapped multiplies the tensorwise kernel's output
#: by the scales' outer product, "hoping Inductor will be able to fuse it"): one pointwise kernel, bf16 read and written
COMPILED_RESCALE_BYTES = 4.0

def rank_linears(model, tp: int, rule: str) -> list[tuple[float, float, float, int]]:
    """(N, K, layers, token split) of each converted linear on one TP rank (column-parallel: N/tp, row-parallel:
    K/tp; the all-gathered tokens, split 1), with how many of the model's layers have it: the attention's in every
    layer, a dense MLP's in the dense layers, a MoE's shared experts in its MoE layers, whole on every TP rank on the
    rank's own sequence shard (split tp); its router and routed experts stay bf16."""
    h, q, kv = model.hidden, model.q_width, model.kv_width
    moe_layers = model.moe_layers
    dense_layers = model.layers - moe_layers
    out: list[tuple[float, float, float, int]] = []

    def add(n: int, k: int, layers: int, col: int, row: int, split: int = 1) -> None:
        if layers and fp8_converts(n, k, rule):
            out.append((n / col, k / row, layers, split))

    add(q, h, model.layers, tp, 1)
    add(kv, h, model.layers, tp, 1)
    add(kv, h, model.layers, tp, 1)
    add(h, q, model.layers, 1, tp)
    for _ in range(2 if model.mlp != "gelu" else 1):
        add(model.ffn_hidden, h, dense_layers, tp, 1)
        if model.shared_experts:
            add(model.shared_ffn, h, moe_layers, 1, 1, tp)
    add(h, model.ffn_hidden, dense_layers, 1, tp)
    if model.shared_experts:
        add(h, model.shared_ffn, moe_layers, 1, 1, tp)
    return out


def fp8_terms(model, tp: int, tokens: float, rule: str, recompute_forward: float,
              compiled: bool = False) -> tuple[float, float]:
    """(GEMM FLOPs that run in fp8, cast and copy bytes) per layer of one micro-batch on one rank, averaged over the
    model's layers: `tokens` the rank's tokens a dense linear sees (all-gathered under TP), `recompute_forward` the
    share of the forward that recompute repeats (its GEMMs and casts again), `compiled` whether the blocks are
    compiled (the casts fused: the module docstring)."""
    flops = traffic = 0.0
    for n, k, layers, split in rank_linears(model, tp, rule):
        t, w = tokens / split, layers / model.layers
        flops += 2 * t * n * k * (3 + recompute_forward) * w
        if compiled:
            traffic += (COMPILED_ACT_BYTES * (t * k + t * n) + COMPILED_WEIGHT_BYTES * n * k
                        + recompute_forward * (COMPILED_RECAST_ACT_BYTES * t * k + COMPILED_RECAST_WEIGHT_BYTES * n * k)
                        + COMPILED_RESCALE_BYTES * n * k) * w
            continue
        casts = (t * k + n * k) * (1 + recompute_forward) + 2 * t * n + n * k + t * k
        copies = t * n + t * k + n * k
        traffic += (CAST_BYTES * casts + COPY_BYTES * copies + RESCALE_BYTES * (t * k + n * k)) * w
    return flops, traffic
