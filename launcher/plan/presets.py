"""Named models and GPUs, so a job file can say `llama3-70b` on `h100-sxm`.

Model shapes are the published configurations. GPU figures are vendor-advertised: dense BF16
peak TFLOP/s, HBM capacity, and NVLink bandwidth as advertised (bidirectional, per GPU; for
cards without NVLink, the PCIe figure). `network_gbs_per_gpu` is the usual NIC per GPU in one
direction (HDR 200 Gb/s = 25 GB/s, NDR 400 Gb/s = 50 GB/s). Measured figures from a
BandwidthMap always replace these in the planner.
"""

from __future__ import annotations

MODELS: dict[str, dict] = {
    "tiny": dict(layers=4, hidden=64, heads=4, kv_heads=2, ffn_hidden=176, vocab=256, mlp="swiglu",
                 tied_embeddings=False),
    "llama2-7b": dict(layers=32, hidden=4096, heads=32, kv_heads=32, ffn_hidden=11008, vocab=32000,
                      mlp="swiglu", tied_embeddings=False),
    "llama3-1b": dict(layers=16, hidden=2048, heads=32, kv_heads=8, ffn_hidden=8192, vocab=128256,
                      mlp="swiglu", tied_embeddings=True),
    "llama3-8b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab=128256,
                      mlp="swiglu", tied_embeddings=False),
    "llama3-70b": dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672, vocab=128256,
                       mlp="swiglu", tied_embeddings=False),
    "llama3-405b": dict(layers=126, hidden=16384, heads=128, kv_heads=8, ffn_hidden=53248, vocab=128256,
                        mlp="swiglu", tied_embeddings=False),
    "gpt3-175b": dict(layers=96, hidden=12288, heads=96, kv_heads=96, ffn_hidden=49152, vocab=51200,
                      mlp="gelu", tied_embeddings=True),
    "mixtral-8x7b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab=32000,
                         mlp="swiglu", tied_embeddings=False, experts=8, experts_per_token=2),
}

#: Dense (no 2:4 sparsity) BF16 tensor-core TFLOP/s, memory in GB as the datasheet states it, the GPU-to-GPU
#: fabric per GPU, bidirectional (NVLink; AMD Infinity Fabric; PCIe where there is neither), and the NIC that
#: the vendor's reference system pairs with each GPU (one direction). `fp8_tflops`: the dense FP8 tensor-core
#: peak (e4m3, no sparsity; the datasheets print FP8 with sparsity, twice it), absent where the GPU has no FP8
#: tensor cores (Ampere): train.precision fp8 is refused there (capabilities.fp8_problem). Sources, per entry.
GPUS: dict[str, dict] = {
    # NVIDIA A100 Tensor Core GPU datasheet (2021): BF16 312 TFLOPS (624 sparse), 40 GB HBM2 / 80 GB HBM2e,
    # NVLink 600 GB/s; DGX A100: 8x HDR 200 Gb/s
    # (Ampere: no FP8 tensor cores)
    "a100-40gb": dict(memory_gb=40, peak_tflops=312, nvlink_gbs=600, network_gbs_per_gpu=25),
    "a100-80gb": dict(memory_gb=80, peak_tflops=312, nvlink_gbs=600, network_gbs_per_gpu=25),
    # NVIDIA H100 Tensor Core GPU datasheet: SXM BF16 989 TFLOPS (1,979 sparse), 80 GB, NVLink 900 GB/s;
    # PCIe 756 (1,513 sparse), 80 GB, NVLink bridge 600 GB/s; NVL 835 (1,671 sparse), 94 GB, NVLink bridge
    # 600 GB/s. DGX H100: 8x ConnectX-7 NDR 400 Gb/s. FP8: SXM 3,958 sparse (1,979 dense), PCIe 3,026 (1,513), NVL
    # 3,341 (1,671)
    "h100-sxm": dict(memory_gb=80, peak_tflops=989, nvlink_gbs=900, network_gbs_per_gpu=50, fp8_tflops=1979),
    "h100-pcie": dict(memory_gb=80, peak_tflops=756, nvlink_gbs=600, network_gbs_per_gpu=25, fp8_tflops=1513),
    "h100-nvl": dict(memory_gb=94, peak_tflops=835, nvlink_gbs=600, network_gbs_per_gpu=50, fp8_tflops=1671),
    # NVIDIA H200 Tensor Core GPU datasheet: SXM BF16 989 TFLOPS (1,979 sparse), 141 GB HBM3e, NVLink
    # 900 GB/s; NVL 835 (1,671 sparse), 141 GB, NVLink bridge 900 GB/s. FP8: SXM 3,958 sparse (1,979 dense), NVL
    # 3,341 (1,671)
    "h200": dict(memory_gb=141, peak_tflops=989, nvlink_gbs=900, network_gbs_per_gpu=50, fp8_tflops=1979),
    "h200-nvl": dict(memory_gb=141, peak_tflops=835, nvlink_gbs=900, network_gbs_per_gpu=50, fp8_tflops=1671),
    # NVIDIA HGX B200 / DGX B200 datasheets: 8 GPUs FP16/BF16 36 PFLOPS sparse (2.25 dense per GPU), 1,440 GB
    # HBM3e (180 per GPU), NVLink 5 1.8 TB/s per GPU; DGX B200: 8x ConnectX-7 400 Gb/s. FP8 72 PFLOPS sparse for 8
    # GPUs (4.5 dense per GPU)
    "b200": dict(memory_gb=180, peak_tflops=2250, nvlink_gbs=1800, network_gbs_per_gpu=50, fp8_tflops=4500),
    # NVIDIA GB200 NVL72 datasheet: 72 GPUs FP16/BF16 360 PFLOPS sparse (2.5 dense per GPU), 13.4 TB HBM3e
    # (186 per GPU), NVLink 5 1.8 TB/s per GPU across the rack (set gpus_per_node to the NVLink domain you
    # plan on: 4 per compute tray, up to 72); 400 Gb/s per GPU scale-out. FP8 720 PFLOPS sparse for 72 GPUs (5 dense
    # per GPU)
    "gb200": dict(memory_gb=186, peak_tflops=2500, nvlink_gbs=1800, network_gbs_per_gpu=50, fp8_tflops=5000),
    # NVIDIA L40S datasheet: BF16 362.05 TFLOPS (733 sparse), 48 GB GDDR6, no NVLink: PCIe Gen4 x16 64 GB/s. FP8
    # 1,466 sparse (733 dense; Ada's rowwise-scaled torch._scaled_mm since torch 2.7)
    "l40s": dict(memory_gb=48, peak_tflops=362, nvlink_gbs=64, network_gbs_per_gpu=25, fp8_tflops=733),
    # AMD Instinct MI300X datasheet: BF16 1,307.4 TFLOPS dense (2,614.9 sparse), 192 GB HBM3, Infinity Fabric
    # 896 GB/s aggregate bidirectional (7 links x 128 GB/s); 400 Gb/s NIC per GPU in AMD's reference platform. FP8
    # 2,614.9 dense (5,229.8 sparse; e4m3fnuz, which torchao picks on MI300)
    "mi300x": dict(memory_gb=192, peak_tflops=1307, nvlink_gbs=896, network_gbs_per_gpu=50, fp8_tflops=2615),
    # AMD Instinct MI325X datasheet: BF16 1,307.4 TFLOPS dense, 256 GB HBM3E, Infinity Fabric 896 GB/s; FP8 2,614.9
    # dense
    "mi325x": dict(memory_gb=256, peak_tflops=1307, nvlink_gbs=896, network_gbs_per_gpu=50, fp8_tflops=2615),
    # A CPU "device" for `launch run` on a laptop or CI box: tiny figures, so plans still compute (torch._scaled_mm
    # has a CPU kernel: fp8 runs there too).
    "cpu": dict(memory_gb=16, peak_tflops=1, nvlink_gbs=10, network_gbs_per_gpu=1, fp8_tflops=1),
}

#: Other names for a GPU preset (matched case-insensitively, as the presets themselves).
GPU_ALIASES: dict[str, str] = {
    "a100": "a100-80gb", "a100-40": "a100-40gb", "a100-80": "a100-80gb", "a100-sxm": "a100-80gb",
    "h100": "h100-sxm", "h100-sxm5": "h100-sxm", "h100-80gb": "h100-sxm",
    "h200-sxm": "h200", "h200-141gb": "h200", "b200-sxm": "b200", "gb200-nvl72": "gb200",
    "l40s-48gb": "l40s", "mi300": "mi300x", "mi325": "mi325x",
}


def canonical(kind: str, name: str) -> str | None:
    """The preset a name means (case-insensitive; GPUs through GPU_ALIASES), or None."""
    table = GPUS if kind == "GPU" else MODELS
    key = name.strip().lower()
    if key in table:
        return key
    if name in table:
        return name
    return GPU_ALIASES.get(key) if kind == "GPU" else None
