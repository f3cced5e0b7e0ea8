"""Activation checkpointing as planned: none, selective (attention core) or full (whole block).

Why flags on the model rather than checkpoint_wrapper: the module names (and therefore the
checkpoint keys) stay the same in every recompute mode, so a run can be resumed with a
different mode. Applied after TP and before FSDP (torchtitan's order).
"""

from __future__ import annotations

from launcher.trainer.model import Transformer

MODES = ("none", "selective", "full")


def apply_recompute(model: Transformer, mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"recompute mode {mode!r} is not one of {MODES}")
    for block in model.layers.values():
        # selective: recompute only softmax(QKᵀ)V, the s² term of the activation ledger
        block.attention.recompute_core = mode == "selective"
        # full: store only each block's input, recompute the whole block in backward
        block.recompute_all = mode == "full"
