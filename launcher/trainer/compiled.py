"""Compiled blocks (plan.layout.compile): each transformer block through torch.compile, as torchtitan's
apply_compile does it (torchtitan/distributed/compile.py: `block.compile(fullgraph=True)` per block).

Why per block, not the whole model: the blocks are identical, so dynamo traces one and every other block
reuses its graph (its parameters are the graph's inputs), and the compile time stays that of one layer
whatever the depth. Why after TP and activation checkpointing and before FSDP (torchtitan's order): the
compiled region then holds the block's sequence-parallel ops, DTensor norms and checkpoint (selective or
full recompute become part of the graph), while FSDP's hooks stay outside it. Only the blocks: the
embedding, the last norm and the chunked loss stay eager.

fullgraph=True: a block that would not trace whole fails at its first forward instead of running
silently in pieces; what cannot trace whole is refused at plan time (capabilities.compile_problem).
The backend is inductor; LAUNCH4D_COMPILE_BACKEND names another (aot_eager: the same graphs and
partition, eager kernels, for a quick CPU check).
"""

from __future__ import annotations

import os

from launcher.trainer.model import Transformer

BACKEND_ENV = "LAUNCH4D_COMPILE_BACKEND"
DEFAULT_BACKEND = "inductor"


def backend() -> str:
    return os.environ.get(BACKEND_ENV, "") or DEFAULT_BACKEND


def apply_compile(model: Transformer, enabled: bool, backend_name: str | None = None) -> None:
    """Compile every block of `model` (a whole model or one pipeline stage) in place."""
    if not enabled:
        return
    name = backend_name or backend()
    for block in model.layers.values():
        block.compile(backend=name, fullgraph=True)
