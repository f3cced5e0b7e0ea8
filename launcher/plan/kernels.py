"""What one GPU's kernels reach, by shape, from public kernel benchmarks (not from training runs): the
compute part of the time model prices every GEMM of a block at the GPU's maximum achievable matmul rate
plus a fixed time per GEMM, attention at the flash-attention rate, and memory-bound elementwise work at
the HBM bandwidth. A stack's fitted factor (costs.STACKS, benchmarks/calibrate_costs.py) and `launch
calibrate`'s cluster factor scale this kernel-level time; nothing here is fitted to training runs.

Sources (each figure in KERNELS names its own):
- MAMF: stas00/ml-engineering compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS comparison
  table" (BF16, @744d01e): A100 SXM 271.2/312 (86.9%), H100 SXM 794.5/989 (80.3%, "H200 is the same"),
  B200 SXM 1745/2250 (77.6%), MI300X 668.4/1300 (51.4%).
- GEMM_FIXED_S: OpenXLA's measured H100 (sm_90) bf16 matmul table
  (xla/service/gpu/model/matmul_interpolator_data.h, tensorflow/tensorflow @372d578): time = 2·b·m·n·k /
  MAMF + t0 with t0 = 6.2 µs fits 30 of its entries, from 256x2048x256 (4% of peak) to 4096³ (79%),
  with median |error| 5% and worst 43% (a k = 256 shape); e.g. 1024x2048x2048: 524 TF/s measured,
  505 modelled. No such table was found for other GPUs: they are given the same fixed time.
- Attention: FlashAttention-2 (Dao 2023, abstract): "50-73% of the theoretical maximum FLOPs/s on A100"
  (the low-middle, 0.6, for forward + backward); FlashAttention-3 (Shah et al. 2024, abstract):
  FlashAttention-2 "achieving only 35% utilization on the H100", FlashAttention-3 "up to 740 TFLOPs/s
  (75% utilization)" in BF16 forward. Stacks on torch SDPA run the FlashAttention-2 kernels
  (`attention`); Megatron/TE's cuDNN fused attention is FA3-class on Hopper (`attention_fused`).
- Attention's backward: FlashAttention recomputes the scores and probabilities from Q and K in its
  backward, so its own benchmarks count a backward as 2.5 forwards and fwd + bwd as 3.5
  (Dao-AILab/flash-attention benchmarks/benchmark_flash_attention.py, `flops(..., mode)`), and llm-foundry's
  benchmark README says the same ("our models use Flash Attention, which requires including an extra
  recompute factor for its recomputation in the forward pass"). The rates above are in that count, so
  the time model charges attention's backward FLASH_BACKWARD forwards at them (FLOPs and MFU keep 3x).
- HBM bandwidth: vendor datasheets (../shared/notes/planner.md §6 for A100/H100/H200).
GPUs without a published figure say so (`assumed`); the kernels of an unknown preset are H100's ratios.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Fixed seconds per GEMM call beyond its FLOPs at the MAMF rate (see the module docstring).
GEMM_FIXED_S = 6.2e-6
#: Forwards' worth of attention work in its backward (FlashAttention's recompute; see the module docstring).
FLASH_BACKWARD = 2.5


@dataclass(frozen=True)
class Kernels:
    gemm: float              # maximum achievable matmul rate / advertised peak (large, well-shaped GEMMs)
    attention: float         # flash-attention forward + backward rate / peak (torch SDPA's FlashAttention-2)
    attention_fused: float   # the same for a fused cuDNN / FA3-class kernel (Megatron, TE)
    hbm_tbs: float           # HBM bandwidth, TB/s (elementwise, memory-bound work)
    gemm_fixed_s: float = GEMM_FIXED_S
    assumed: str = ""        # which figures have no public benchmark behind them

    def gemm_seconds(self, flops: float, calls: float, peak_flops: float) -> float:
        """Seconds for `calls` GEMMs doing `flops` in all: the MAMF rate plus the fixed time per call."""
        return flops / (peak_flops * self.gemm) + calls * self.gemm_fixed_s


_FA2_A100, _FA2_H100, _FA3_H100 = 0.6, 0.35, 0.75
KERNELS: dict[str, Kernels] = {
    "a100-80gb": Kernels(gemm=0.869, attention=_FA2_A100, attention_fused=_FA2_A100, hbm_tbs=2.039),
    "a100-40gb": Kernels(gemm=0.869, attention=_FA2_A100, attention_fused=_FA2_A100, hbm_tbs=1.555),
    "h100-sxm": Kernels(gemm=0.803, attention=_FA2_H100, attention_fused=_FA3_H100, hbm_tbs=3.35),
    "h100-pcie": Kernels(gemm=0.803, attention=_FA2_H100, attention_fused=_FA3_H100, hbm_tbs=2.0,
                         assumed="MAMF (H100 SXM's)"),
    "h200": Kernels(gemm=0.803, attention=_FA2_H100, attention_fused=_FA3_H100, hbm_tbs=4.8),
    "b200": Kernels(gemm=0.776, attention=_FA2_H100, attention_fused=_FA3_H100, hbm_tbs=8.0,
                    assumed="attention (Hopper's figures)"),
    "l40s": Kernels(gemm=0.811, attention=_FA2_A100, attention_fused=_FA2_A100, hbm_tbs=0.864,
                    assumed="MAMF (A100 PCIe's 81.1%) and attention (A100's)"),
    "mi300x": Kernels(gemm=0.514, attention=_FA2_H100, attention_fused=_FA2_H100, hbm_tbs=5.3,
                      assumed="attention (FlashAttention-2 on H100's)"),
    # a CPU "device" for `launch run` on a laptop: no kernel effects to speak of
    "cpu": Kernels(gemm=1.0, attention=1.0, attention_fused=1.0, hbm_tbs=1e9, gemm_fixed_s=0.0),
}


def kernels(gpu) -> Kernels:
    """The kernel figures of a GPU preset (by name); an unknown GPU gets H100's."""
    return KERNELS.get(getattr(gpu, "name", "") or "", KERNELS["h100-sxm"])
