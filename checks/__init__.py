"""Preflight: probe nodes (nvidia-smi topo, nccl-tests, health), judge them, write a BandwidthMap.

Never imports `launcher` (dependencies run launcher → checks).
"""
