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
  matmul_with_hp_or_float8_args; sequence_parallel.py's ops the same), each in eager ops: |t|, its amax, an fp32
  copy, the scaling, the saturation, the e4m3 result (CAST_BYTES of HBM traffic an element), plus the transposed
  copies the kernel's layouts need and the two backward outputs rescaled (torchao's tensorwise kernel with the
  output scaled after: RESCALE_BYTES). All of it memory-bound, at the GPU's HBM bandwidth; a recomputed forward
  casts again. This is why torchao's docs ask for torch.compile (which fuses the casts): in this eager trainer a
  GEMM must be large for FP8 to win, which is what torchtitan's auto filter (train.fp8_linears auto) selects.
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


def fp8_terms(model, tp: int, tokens: float, rule: str, recompute_forward: float) -> tuple[float, float]:
    """(GEMM FLOPs that run in fp8, cast and copy bytes) per layer of one micro-batch on one rank, averaged over the
    model's layers: `tokens` the rank's tokens a dense linear sees (all-gathered under TP), `recompute_forward` the
    share of the forward that recompute repeats (its GEMMs and casts again)."""
    flops = traffic = 0.0
    for n, k, layers, split in rank_linears(model, tp, rule):
        t, w = tokens / split, layers / model.layers
        flops += 2 * t * n * k * (3 + recompute_forward) * w
        casts = (t * k + n * k) * (1 + recompute_forward) + 2 * t * n + n * k + t * k
        copies = t * n + t * k + n * k
        traffic += (CAST_BYTES * casts + COPY_BYTES * copies + RESCALE_BYTES * (t * k + n * k)) * w
    return flops, traffic
