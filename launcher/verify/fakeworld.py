"""The world a traced rank runs in: torch's fake process group and FakeTensorMode around the real Engine,
DeviceMeshes built from real tensors, the model built on the meta device, and what the plan's GPUs run their
own way (compiled blocks, CP's attention, balanced MoE routing) run that way here (memtrace's docstring says
why each is needed)."""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh

from launcher.trainer import engine as engine_mod
from launcher.trainer.config import TrainerConfig
from launcher.trainer.mesh import build_mesh
from launcher.trainer.model import Transformer


@contextlib.contextmanager
def fake_world(rank: int, world: int):
    """This process is `rank` of `world` under the fake process group (no peers, no traffic)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers backend "fake"

    if dist.is_initialized():
        raise RuntimeError("launch verify needs a process without a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        _MESHES.clear()
        dist.destroy_process_group()


@contextlib.contextmanager
def real_device_meshes():
    """Build every DeviceMesh from real tensors, also inside FakeTensorMode (they are metadata)."""
    orig = DeviceMesh.__init__

    def init(self, *args, **kwargs):
        with unset_fake_temporarily():
            orig(self, *args, **kwargs)

    DeviceMesh.__init__ = init
    try:
        yield
    finally:
        DeviceMesh.__init__ = orig


class MetaBuiltTransformer(Transformer):
    """The trainer's Transformer, its meta-device construction run outside FakeTensorMode.

    Why: under the mode, the initialisers' ops on meta parameters make fake copies that keep a
    weakref to each parameter, and to_empty cannot then swap a plain (non-DTensor) parameter
    for its fake storage. The nodes build on the meta device too; nothing else differs."""

    def __init__(self, *args, **kwargs):
        with unset_fake_temporarily():
            super().__init__(*args, **kwargs)

    def keep_only(self, *args, **kwargs) -> None:
        with unset_fake_temporarily():
            super().keep_only(*args, **kwargs)

    def init_weights(self, seed: int) -> None:
        """Only the RoPE tables: fake tensors hold no values. (The seeded init draws every full
        matrix and shards it: seconds per rank at 405B, and nothing of it is alive at step time.)"""
        self.set_positions(self.positions)

    def __call__(self, *args, **kwargs):
        """A received activation (a leaf that requires grad) enters as a view of itself: the tracker's module
        hooks wait for its gradient with register_multi_grad_hook, which autograd.grad refuses on a leaf (a
        split backward's input-gradient step is one). A view allocates nothing and leaves the graph's leaf,
        what the pipeline differentiates to, as it was."""
        args = tuple(a.view_as(a) if isinstance(a, torch.Tensor) and a.is_leaf and a.requires_grad else a
                     for a in args)
        return super().__call__(*args, **kwargs)


_MESHES: dict[tuple, object] = {}


def mesh_for(cfg: TrainerConfig):
    """This rank's MeshInfo, built once per fake world (its thousands of fake process groups cost
    seconds at 16,384 ranks; the layer and micro-batch variants of a plan share the same mesh)."""
    p = cfg.plan
    key = (dist.get_rank(), dist.get_world_size(), p.tp, p.cp, p.pp, p.dp, p.ep, tuple(p.mesh_order), p.dp_shard)
    if key not in _MESHES:
        _MESHES[key] = build_mesh(cfg, torch.device("cpu"))      # real tensors: a mesh is metadata
    return _MESHES[key]


#: what `launch verify` assumes of MoE routing, which FakeTensorMode cannot know (no router values)
ROUTING_ASSUMPTION = ("MoE routing assumed balanced: each expert gets tokens·top_k/experts rows, on every "
                      "EP rank (no capacity factor, no dropped tokens, as the trainer routes)")


@contextlib.contextmanager
def assumed_routing():
    """MoE layers take their per-expert row counts from shapes (moe.balanced_counts) while tracing."""
    from launcher.trainer import moe

    moe.MoE.assumed_counts = moe.balanced_counts
    try:
        yield
    finally:
        moe.MoE.assumed_counts = None


#: How verify compiles a block (plan.layout.compile): inductor's decompositions and its min-cut partition of each
#: block's forward and backward, so what a compiled block saves for backward and recomputes is inductor's, the
#: graphs then run op by op (inductor's kernels do not run on fake tensors; its fusions allocate no more than this)
TRACE_BACKEND = "aot_eager_decomp_partition"


@contextlib.contextmanager
def compiled_as_traced():
    """Compiled blocks as the tracker can see them: compiled with TRACE_BACKEND, each block's call inside dynamo's
    optimized-module flag, which torch's module tracker reads to keep its hooks out of the traced graph (they would
    break it: fullgraph=True); the tracker itself steps aside while a block compiles (ignore_compile_internals)."""
    from torch._dynamo.eval_frame import _set_in_optimized_module

    from launcher.trainer import compiled

    real = compiled.apply_compile

    def apply(model, enabled: bool, backend_name: str | None = None) -> None:
        real(model, enabled, TRACE_BACKEND)
        for block in model.layers.values() if enabled else ():
            inner = block._compiled_call_impl

            def call(*args, _inner=inner, **kwargs):
                with _set_in_optimized_module():
                    return _inner(*args, **kwargs)

            block._compiled_call_impl = call

    with mock.patch.object(engine_mod, "apply_compile", apply):
        yield


@contextlib.contextmanager
def attention_as_on_the_nodes(cfg: TrainerConfig):
    """CP's attention against a longer prefix of keys (context_parallel.CPAttention._prefix) as a GPU runs
    it: the bottom-right causal bias is applied inside the kernel (causal_lower_right), no mask tensor.
    On this CPU it takes a cached boolean mask [s/2cp, up to s], which SDPA copies to the query's dtype
    and keeps for backward: GBs at long context that a GPU never allocates. The outputs and the rest of
    what SDPA saves are the same without it."""
    if cfg.plan.gpu.name == "cpu":
        yield
        return
    import torch.nn.functional as F

    from launcher.trainer import context_parallel

    real = context_parallel.CPAttention._prefix

    def prefix(attn, q, k, v, alibi=None):
        if alibi is not None:                # ALiBi's bias is a tensor on a GPU too
            return real(attn, q, k, v, alibi)
        return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] == k.shape[2],
                                              enable_gqa=q.shape[1] != k.shape[1])

    with mock.patch.object(context_parallel.CPAttention, "_prefix", prefix):
        yield


@contextlib.contextmanager
def untracked_sharding_propagation():
    """DTensor's sharding propagation derives an output's metadata by running the op on fake
    tensors of every operand's GLOBAL shape, in whatever fake mode is active: under ours the tracker
    would count them (a 405B output head's whole fp32 gradient, GBs, whenever DTensor's cache is cold,
    so the first trace in a process peaked there). Give it a fake mode of its own, which torch's
    tracker skips by design (it counts ops of the mode it was entered in)."""
    from torch.distributed.tensor import _sharding_prop

    own = FakeTensorMode()
    with mock.patch.object(_sharding_prop, "detect_fake_mode", lambda *a, **k: own):
        yield
