"""What one GPU's kernels reach, by shape, from public kernel benchmarks (not from training runs): the
compute part of the time model prices every GEMM of a block by its own (m, n, k) (Kernels.gemm_seconds),
attention at the flash-attention rate, and memory-bound elementwise work at the HBM bandwidth. A stack's
fitted factor (costs.STACKS, benchmarks/calibrate_costs.py) and `launch calibrate`'s cluster factor scale
this kernel-level time; nothing here is fitted to training runs.

GEMMs, by shape: t = gemm_fixed_s + 2·b·m·n·k / (gemm · peak) + 2·b·(m·k + k·n + m·n) / (gemm_bw · HBM): a fixed
launch time, the FLOPs at the maximum achievable matmul rate (MAMF, the large-shape limit), the bf16 operands and
result at an effective bandwidth (a multiple of the datasheet HBM figure: above 1 where the operands stay in L2). Skinny GEMMs (a TP-split width, few tokens, a
MoE expert's share of them) fall well below the large-shape rate; large ones approach it.

Sources (each figure in KERNELS names its own; the GEMM figures are printed with their errors by
`benchmarks/fit_gemm.py`):
- GEMM table: OpenXLA's measured BF16 matmul table (xla/service/gpu/model/default_matmul_perf_table.txtpb,
  openxla/xla @336bb15c), transcribed entry by entry into benchmarks/published_gemms.csv: sm_90 (H100 SXM),
  sm_100_B200 (B200), gfx942 (MI300X), 256 to 16,384 rows, widths 256 to 4,096. Fitted there, at MAMF's rate:
  H100 gemm_bw 4.76 t0 5.68 µs: median |error| 5.5%, worst 36% (n = 68); B200 1.61 / 5.63 µs: 6.5%, 38%
  (n = 69); MI300X 0.79 / 6.19 µs: 3.2%, 47% (n = 34). The worst entries are the smallest (256-row) shapes; the
  block GEMMs of a training step are larger.
- MAMF: stas00/ml-engineering compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS comparison
  table" (BF16, @744d01e): A100 SXM 271.2/312 (86.9%), H100 SXM 794.5/989 (80.3%, "H200 is the same"),
  B200 SXM 1745/2250 (77.6%), MI300X 668.4/1300 (51.4%), A100 PCIe 81.1%. GPUs the table above does not hold
  (A100, L40S) take MAMF as their compute rate (a best-shape measurement: a lower bound on the rate) and H100's
  effective bandwidth multiple and launch time (`assumed`); H200 and H100 PCIe are sm_90 with their own HBM.
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
GPUs without a published figure say so (`assumed`); the kernels of an unknown preset are H100's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: H100's fitted launch time per GEMM (benchmarks/fit_gemm.py), the figure GPUs without a table take.
GEMM_FIXED_S = 5.68e-6
#: H100's fitted effective operand bandwidth, a multiple of HBM (the figure GPUs without a table take).
GEMM_BW = 4.76
#: Forwards' worth of attention work in its backward (FlashAttention's recompute; see the module docstring).
FLASH_BACKWARD = 2.5


@dataclass(frozen=True)
class Kernels:
    gemm: float              # maximum achievable matmul rate / advertised peak (MAMF: gemm_seconds' large-shape limit)
    attention: float         # flash-attention forward + backward rate / peak (torch SDPA's FlashAttention-2)
    attention_fused: float   # the same for a fused cuDNN / FA3-class kernel (Megatron, TE)
    hbm_tbs: float           # HBM bandwidth, TB/s (elementwise, memory-bound work)
    gemm_fixed_s: float = GEMM_FIXED_S
    gemm_bw: float = GEMM_BW  # GEMM operand traffic's effective bandwidth / hbm_tbs
    assumed: str = ""        # which figures have no public benchmark behind them

    def gemm_seconds(self, m: float, n: float, k: float, peak_flops: float, batch: float = 1.0) -> float:
        """Seconds for `batch` [m, k] x [k, n] bf16 GEMMs as one call: launch, FLOPs at the compute rate, the
        operands and result at the effective bandwidth (the module docstring; benchmarks/fit_gemm.py)."""
        flops = 2 * batch * m * n * k
        nbytes = 2 * batch * (m * k + k * n + m * n)
        return self.gemm_fixed_s + flops / (peak_flops * self.gemm) + nbytes / (self.gemm_bw * self.hbm_tbs * 1e12)


_FA2_A100, _FA2_H100, _FA3_H100 = 0.6, 0.35, 0.75
_H100: dict[str, Any] = dict(gemm=0.803, gemm_bw=GEMM_BW, gemm_fixed_s=GEMM_FIXED_S)
KERNELS: dict[str, Kernels] = {
    "a100-80gb": Kernels(gemm=0.869, attention=_FA2_A100, attention_fused=_FA2_A100, hbm_tbs=2.039,
                         assumed="GEMM shapes (H100's bandwidth multiple and launch time)"),
    "a100-40gb": Kernels(gemm=0.869, attention=_FA2_A100, attention_fused=_FA2_A100, hbm_tbs=1.555,
                         assumed="GEMM shapes (H100's bandwidth multiple and launch time)"),
    "h100-sxm": Kernels(**_H100, attention=_FA2_H100, attention_fused=_FA3_H100, hbm_tbs=3.35),
    "h100-pcie": Kernels(**_H100, attention=_FA2_H100, attention_fused=_FA3_H100, hbm_tbs=2.0,
                         assumed="GEMM shapes (H100 SXM's table)"),
    "h200": Kernels(**_H100, attention=_FA2_H100, attention_fused=_FA3_H100, hbm_tbs=4.8,
                    assumed="GEMM shapes (H100 SXM's table: the same sm_90 chip)"),
    "b200": Kernels(gemm=0.776, gemm_bw=1.61, gemm_fixed_s=5.63e-6, attention=_FA2_H100, attention_fused=_FA3_H100,
                    hbm_tbs=8.0, assumed="attention (Hopper's figures)"),
    "l40s": Kernels(gemm=0.811, attention=_FA2_A100, attention_fused=_FA2_A100, hbm_tbs=0.864,
                    assumed="GEMM shapes (MAMF of A100 PCIe, 81.1%, H100's bandwidth multiple and launch time) and "
                            "attention (A100's)"),
    "mi300x": Kernels(gemm=0.514, gemm_bw=0.79, gemm_fixed_s=6.19e-6, attention=_FA2_H100, attention_fused=_FA2_H100,
                      hbm_tbs=5.3, assumed="attention (FlashAttention-2 on H100's)"),
    # a CPU "device" for `launch run` on a laptop: no kernel effects to speak of
    "cpu": Kernels(gemm=1.0, attention=1.0, attention_fused=1.0, hbm_tbs=1e9, gemm_fixed_s=0.0),
}


def kernels(gpu) -> Kernels:
    """The kernel figures of a GPU preset (by name); an unknown GPU gets H100's."""
    return KERNELS.get(getattr(gpu, "name", "") or "", KERNELS["h100-sxm"])
