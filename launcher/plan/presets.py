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

GPUS: dict[str, dict] = {
    "a100-40gb": dict(memory_gb=40, peak_tflops=312, nvlink_gbs=600, network_gbs_per_gpu=25),
    "a100-80gb": dict(memory_gb=80, peak_tflops=312, nvlink_gbs=600, network_gbs_per_gpu=25),
    "h100-sxm": dict(memory_gb=80, peak_tflops=989, nvlink_gbs=900, network_gbs_per_gpu=50),
    "h100-pcie": dict(memory_gb=80, peak_tflops=756, nvlink_gbs=600, network_gbs_per_gpu=25),
    "h200": dict(memory_gb=141, peak_tflops=989, nvlink_gbs=900, network_gbs_per_gpu=50),
    "b200": dict(memory_gb=180, peak_tflops=2250, nvlink_gbs=1800, network_gbs_per_gpu=50),
    "l40s": dict(memory_gb=48, peak_tflops=362, nvlink_gbs=64, network_gbs_per_gpu=25),
    # A CPU "device" for `launch run` on a laptop or CI box: tiny figures, so plans still compute.
    "cpu": dict(memory_gb=16, peak_tflops=1, nvlink_gbs=10, network_gbs_per_gpu=1),
}
