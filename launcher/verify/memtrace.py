"""Trace one rank of a full-size job on this CPU: the real Engine, a fake world, no real memory.

Why: the ledger is a formula; what a rank really holds is whatever the trainer's own code
allocates (FSDP2 buffers, TP/SP shards, the pipeline schedule's in-flight micro-batches, SDPA's
kernels, the chunked loss). This module builds the trainer's Engine for one global rank of the
plan's full world under torch's fake process group (`FakeStore`, backend "fake": collectives
return at once) and FakeTensorMode (tensors have shapes, dtypes and storages of known size but
no data), runs one optimizer step through Engine.step, and measures that rank's peak with
torch's FSDP-aware MemTracker, by category.

What it takes to run the trainer unchanged in that world (../shared/notes/testbed.md lists what failed):
- DeviceMesh objects are metadata: they are built from real tensors even inside FakeTensorMode
  (FSDP2 concatenates the dp and tp meshes inside fully_shard, which under fake mode hit
  `aten.nonzero`).
- The pipeline's start-up vote and metadata exchange need peers; under the fake group each
  stage is given its input/output metadata up front (static mode), computed from the plan.
- The optimizer state is created before the traced step, as it exists from step 2 on.
- What the plan's GPU runs differently from this CPU is run its way: the optimizer's foreach step
  (step_as_on_the_nodes) and CP's prefix attention without a mask tensor (attention_as_on_the_nodes).
- The tracker is entered inside the fake mode (it only counts ops run under the mode it was
  entered in), counts every part of a rank (virtual pipeline stages), counts parameters and
  gradients that FSDP does not manage (ZeRO 0/1, dp·cp = 1), and accepts one forward per
  micro-batch.
- Categories follow what a tensor is, not when it was made (as the ledger files them): the lean
  optimizer's fp32 masters (ZeRO 0/1) are optimizer state and its fp32 gradient shards gradients,
  its packed reduce buffers and gathered weights communication buffers, and the
  fp32 gradients FSDP accumulates unsharded while pipelining disables gradient sync are gradients
  (torch's files them as backward temporaries), and the grad-norm clip's float64 copies, made
  between the backward and the optimizer, and what optimizer.step makes beside the state it updates
  are temporaries (torch's files them as activations and optimizer state).
  What recompute remakes in backward (a checkpointed block's body run again) is an activation, as
  Korthikanti's and Megatron's counts have it (torch's files it as a backward temporary, except what an
  FSDP unit inside the block, an EP expert, recomputes), and FSDP's
  reduce-scatter input is a communication buffer from its allocation on (torch's re-files it so
  only when the collective runs).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType, _FSDPState
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard import _fsdp_param_group
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
from torch.utils.weak import WeakIdKeyDictionary

from launcher.plan.capabilities import SPLIT_BACKWARD
from launcher.trainer import engine as engine_mod
from launcher.trainer import float8
from launcher.trainer import pipeline as pipeline_mod
from launcher.trainer import sequence_parallel as sp_ops
from launcher.trainer.config import TrainerConfig
from launcher.trainer.engine import Engine
from launcher.trainer.mesh import build_mesh
from launcher.trainer.model import Block, Transformer

#: tracker categories -> the categories launch verify reports
CATEGORIES = {
    "params": (_FSDPRefType.SHARDED_PARAM, _FSDPRefType.UNSHARDED_PARAM, _FSDPRefType.BUFFER),
    "grads": (_FSDPRefType.SHARDED_GRAD, _FSDPRefType.UNSHARDED_GRAD),
    "optimizer": (_FSDPRefType.OPT,),
    "activations": (_FSDPRefType.ACT, _FSDPRefType.INP),
    "temporaries": (_FSDPRefType.TEMP,),
    "comm_buffers": (_FSDPRefType.ALL_GATHER, _FSDPRefType.REDUCE_SCATTER),
}


@dataclass
class StepTrace:
    """The peak of one traced optimizer step with `micro_batches` micro-batches (bytes)."""

    micro_batches: int
    peak: int
    categories: dict[str, int]
    detail: dict[str, int]          # the tracker's own categories at the peak
    per_micro_batch: dict[str, int] = field(default_factory=dict)   # see step_long_bytes
    segments: list[dict] = field(default_factory=list)              # see ActionLog (per_action traces)


@dataclass
class RoleTrace:
    """What one rank holds: the traced step(s) and the state computed from local shard shapes."""

    rank: int
    stage_ids: list[int]
    state: dict[str, int]           # params / grads / optimizer from local shard shapes (exact)
    steps: list[StepTrace] = field(default_factory=list)
    dp_mode: str = ""
    seconds: float = 0.0


# --- the fake world ------------------------------------------------------------------------

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


# --- the tracker -----------------------------------------------------------------------------

class RankMemTracker(FSDPMemTracker):
    """FSDPMemTracker over all of one rank's model parts, FSDP-managed or not.

    Differences from torch's: several roots (virtual pipeline stages) and plain parameters
    (replicated or TP-only) are counted, each micro-batch's forward may re-enter a root, and
    per-module peak snapshots are not kept (only the rank's peak, which is all verify needs,
    and much cheaper per op).
    """

    #: compiled blocks (plan.layout.compile): the tracker steps aside while dynamo traces a block and sees the
    #: compiled graphs' ops run (compiled_as_traced), higher-order ones too (the recompute's saved RNG state)
    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self, parts: list[nn.Module], optimizer: torch.optim.Optimizer, lean=None) -> None:
        MemTracker.__init__(self)
        self._lean = lean                  # dist_optim.MixedPrecisionOptimizer (ZeRO 0/1), or None
        self._root_mod = nn.ModuleList(parts)  # type: ignore[assignment]
        self._optm = optimizer
        self._fsdp_mod_to_saved_methods = WeakIdKeyDictionary()
        self._fsdp_state = _FSDPState.PRE_FW
        self._ref_class = _FSDPRefType
        self._plain_hooks: list = []
        self._clipping = False
        self._rs_input_next = False        # foreach_reduce entered: its first allocation is the RS input
        self._rs_input = False             # that allocation is running
        self._rs_patches: list = []
        self._window: dict | None = None   # figures at the highest total since the last mark()
        self._filing: _FSDPRefType | None = None   # what an FSDP gather makes is (see _file_gathers)
        self._group_methods: dict = {}
        self._recomputing = False          # a checkpointed block's body is being run again in backward

    def _register_module_and_optimizer_hooks(self) -> None:
        super()._register_module_and_optimizer_hooks()
        self._one_wrap_per_unit()
        managed: set[int] = set()
        for m in self._root_mod.modules():
            if isinstance(m, FSDPModule) and (group := m._get_fsdp_state()._fsdp_param_group):
                managed.update(id(fp.sharded_param) for fp in group.fsdp_params)
        for p in self._root_mod.parameters():
            if id(p) in managed:
                continue
            self._update_and_maybe_create_winfos(p, _FSDPRefType.SHARDED_PARAM)
            if p.requires_grad:
                self._plain_hooks.append(p.register_post_accumulate_grad_hook(self._grad_hook))
        self._rs_patches = [mock.patch.object(_fsdp_param_group, "foreach_reduce",
                                              self._reducing(_fsdp_param_group.foreach_reduce)),
                            mock.patch.object(DefaultReduceScatter, "allocate",
                                              self._allocating(DefaultReduceScatter.allocate)),
                            mock.patch.object(pipeline_mod.Stage, "backward_weight_one_chunk",
                                              self._weight_step(pipeline_mod.Stage.backward_weight_one_chunk)),
                            mock.patch.object(Block, "_body", self._recompute(Block._body))]
        for patch in self._rs_patches:
            patch.start()
        self._file_gathers()
        for part in self._root_mod.children():     # named now: a compiled block's hooks do not run in its graph to name it
            self._mod_tracker._get_mod_name(part)
        if self._lean is not None:
            self._file_lean(self._lean)

    def _one_wrap_per_unit(self) -> None:
        """One FSDP unit over several modules (the final norm with the output head, fsdp.apply_fsdp) has one
        param group: torch's tracker wraps its pre- and post-backward once per module, so the group would run
        wrapped twice (its post-backward's buffers counted from the wrong module's stats) and stay wrapped
        once after the trace. Wrap it once, under its first module, and restore it from the original."""
        for m in list(self._fsdp_mod_to_saved_methods.keys()):
            state = m._get_fsdp_state()
            mods = state._modules
            if len(mods) < 2 or m is not mods[0] or not (group := state._fsdp_param_group):
                continue
            saved = self._fsdp_mod_to_saved_methods[m]
            group.pre_backward = self._fsdp_param_group_pre_backward(m, saved.pre_backward)
            group.post_backward = self._fsdp_param_group_post_backward(m, saved.post_backward)
            for other in mods[1:]:
                if other in self._fsdp_mod_to_saved_methods:
                    self._fsdp_mod_to_saved_methods[other] = saved

    def _file_lean(self, lean) -> None:
        """The lean optimizer's tensors by what they are: masters as optimizer state; what reduce_grads
        packs and all-reduces or reduce-scatters as communication buffers, the fp32 shard it leaves as
        gradients; the weights' gathers as communication buffers; the clip's float64 copies as
        temporaries; grad_dtype fp32's accumulation buffers as gradients."""
        for m in lean.masters:
            self._update_and_maybe_create_winfos(m, _FSDPRefType.OPT)
        lean.reduce_grads = self._flagged("_filing", lean.reduce_grads, _FSDPRefType.REDUCE_SCATTER, None)
        lean.reduced = lambda grad: self._update_and_maybe_create_winfos(grad, _FSDPRefType.SHARDED_GRAD)
        lean.gather_params = self._flagged("_filing", lean.gather_params, _FSDPRefType.ALL_GATHER, None)
        lean.grad_sq = self.clipping(lean.grad_sq)
        lean._accumulate = self._flagged("_filing", lean._accumulate, _FSDPRefType.SHARDED_GRAD, None)

    def _reducing(self, foreach_reduce):
        """FSDP's foreach_reduce, its reduce-scatter input filed as a communication buffer from its
        allocation on. Why: torch's tracker files that input as REDUCE_SCATTER only when the collective
        runs, after the copy-in; the peak of a post-backward is at the allocation, beside the unsharded
        gradients it copies, and was filed as a backward temporary there (the ledger and torch's own
        categories call it a reduce-scatter buffer)."""
        return self._flagged("_rs_input_next", foreach_reduce)

    def _flagged(self, flag: str, fn, on=True, off=False):
        """`fn` with this tracker's attribute `flag` set to `on` while it runs (`off` after)."""
        def run(*args, **kwargs):
            setattr(self, flag, on)
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, flag, off)

        return run

    def _allocating(self, allocate):
        def run(comm, *args, **kwargs):
            self._rs_input, self._rs_input_next = self._rs_input_next, False   # the input, not the output
            try:
                return allocate(comm, *args, **kwargs)
            finally:
                self._rs_input = False

        return run

    def _file_gathers(self) -> None:
        """File what FSDP's gathers allocate by what it is, whoever starts them: the all-gather's buffers
        as communication buffers, the gathered parameters as parameters. torch's tracker files them so
        only inside FSDP's own pre-forward and pre-backward; a pipeline runtime's UNSHARD (and its wait
        at the next compute) it files as activations or backward temporaries by whatever ran before,
        and a parameter keeps the category it was first seen with (interleaved 1F1B with more than 3
        stages per rank gathers a stage several times per step)."""
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        unshard, wait = FSDPParamGroup.unshard, FSDPParamGroup.wait_for_unshard
        self._group_methods = {"unshard": unshard, "wait_for_unshard": wait}
        tracker = self
        filed_unshard = self._flagged("_filing", unshard, _FSDPRefType.ALL_GATHER, None)

        def filed_wait(group):
            copies = group._all_gather_result is not None
            tracker._filing = _FSDPRefType.UNSHARDED_PARAM
            try:
                return wait(group)
            finally:
                tracker._filing = None
                for fp in group.fsdp_params if copies else ():
                    tracker._update_and_maybe_create_winfos(fp.unsharded_param, _FSDPRefType.UNSHARDED_PARAM)

        FSDPParamGroup.unshard = filed_unshard  # type: ignore[method-assign]
        FSDPParamGroup.wait_for_unshard = filed_wait  # type: ignore[method-assign]

    def _recompute(self, body):
        """Block._body, flagged while backward runs it again (recompute): what it remakes are the block's
        activations, held until the block's backward is done with them. A compiled block's graph is traced
        once, not flagged (dynamo must not see the flag flip)."""
        flagged = self._flagged("_recomputing", body)

        def run(block, *args, **kwargs):
            # inside autograd's engine (a backward's graph task): the recompute, whoever runs the backward
            # (asked only outside dynamo, which cannot trace the question)
            if torch._dynamo.is_compiling() or self._recomputing or torch._C._current_graph_task_id() == -1:
                return body(block, *args, **kwargs)
            return flagged(block, *args, **kwargs)

        return run

    def _weight_step(self, step):
        """A split backward's weight step (pipeline.Stage), with the gradients it writes into .grad by hand
        filed as gradients: no AccumulateGrad runs there, so neither _grad_hook nor torch's tracker sees
        them made (torch's files them as backward temporaries)."""
        def run(stage, *args, **kwargs):
            out = step(stage, *args, **kwargs)
            for q in stage.submod.parameters():
                if q.grad is not None:
                    self._update_and_maybe_create_winfos(q.grad, _FSDPRefType.SHARDED_GRAD)
            return out

        return run

    def _grad_hook(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self._update_and_maybe_create_winfos(p.grad, _FSDPRefType.SHARDED_GRAD)

    def _deregister_module_and_optimizer_hooks(self) -> None:
        super()._deregister_module_and_optimizer_hooks()
        for h in self._plain_hooks:
            h.remove()
        self._plain_hooks.clear()
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        for name, method in self._group_methods.items():
            setattr(FSDPParamGroup, name, method)
        self._group_methods = {}
        for patch in self._rs_patches:
            patch.stop()
        self._rs_patches.clear()

    def _fsdp_param_group_post_backward(self, fsdp_mod, orig):
        inner = super()._fsdp_param_group_post_backward(fsdp_mod, orig)

        def post_backward(*args, **kwargs):
            inner(*args, **kwargs)
            # without gradient sync (pipelining until the last micro-batch) FSDP keeps each unsharded
            # gradient, upcast to the reduce dtype, in unsharded_accumulated_grad
            if group := fsdp_mod._get_fsdp_state()._fsdp_param_group:
                for fp in group.fsdp_params:
                    if fp.unsharded_accumulated_grad is not None:
                        self._update_and_maybe_create_winfos(fp.unsharded_accumulated_grad,
                                                             _FSDPRefType.UNSHARDED_GRAD)
                # hybrid sharding before the last micro-batch (the all-reduce off): the reduce-scattered
                # gradients summed so far wait in the group's partial output, not in .grad: gradients
                partial = getattr(group, "_partial_reduce_output", None)
                if partial is not None:
                    self._update_and_maybe_create_winfos(partial, _FSDPRefType.SHARDED_GRAD)

        return post_backward

    def _track(self, reftype, t: torch.Tensor) -> None:
        if self._filing is not None and reftype in (_FSDPRefType.ACT, _FSDPRefType.TEMP):
            reftype = self._filing
        elif self._rs_input:
            reftype = _FSDPRefType.REDUCE_SCATTER
        elif self._clipping and reftype == _FSDPRefType.ACT:
            reftype = _FSDPRefType.TEMP
        elif self._in_opt and reftype == _FSDPRefType.OPT:
            # made inside optimizer.step: its transients (foreach AdamW's sqrt(v)); the state it updates in
            # place exists from step 2 on (init_optimizer_state), tracked as optimizer state already
            reftype = _FSDPRefType.TEMP
        elif self._recomputing and reftype == _FSDPRefType.TEMP:
            reftype = _FSDPRefType.ACT     # remade by recompute (see _recompute)
        super()._track(reftype, t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        """torch's, and a custom op's declared workspace (sequence_parallel.workspace_bytes: the gathered
        input, the partial sum) held as a temporary while the op's outputs are made: the tracker sees a
        custom op's outputs, not what its kernel allocates inside."""
        ws = sp_ops.workspace_bytes(func, args)
        if not ws or active_fake_mode() is not self._fake_mode_on_entry:
            return super().__torch_dispatch__(func, types, args, kwargs)
        buf = torch.empty(ws, dtype=torch.uint8, device=args[0].device)
        self._track(_FSDPRefType.TEMP, buf)
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            del buf

    def clipping(self, clip):
        """`clip` (the engine's clip_grad_norm) with what it makes filed as temporaries."""
        return self._flagged("_clipping", clip)

    def _fsdp_state_pre_forward(self, fsdp_mod, orig):
        inner = super()._fsdp_state_pre_forward(fsdp_mod, orig)

        def pre_forward(*args, **kwargs):
            if fsdp_mod in self.memory_tracking and not self._mod_tracker.is_bw:
                # the next micro-batch's forward: fresh stats for this module only; other modules'
                # backwards may still be pending (interleaved 1F1B), and look their stats up
                del self.memory_tracking[fsdp_mod]
            return inner(*args, **kwargs)

        return torch._dynamo.disable(pre_forward)     # run beside a compiled block's graph, as FSDP's own hook

    def _fsdp_state_post_forward(self, fsdp_mod, orig):
        return torch._dynamo.disable(super()._fsdp_state_post_forward(fsdp_mod, orig))

    def _update_peak_stats(self, peak_state) -> None:
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                self._peak_mem[dev] = snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = dict(snap)
        if self._window is not None and self._total(self._curr_mem_snap) > self._window["total"]:
            self._window = self._categories(self._curr_mem_snap)

    @staticmethod
    def _total(snaps: dict) -> int:
        return sum(snap.get(_TOTAL_KEY, 0) for snap in snaps.values())

    @staticmethod
    def _categories(snaps: dict) -> dict[str, int]:
        """verify's categories and "total" of per-device snapshots."""
        merged: dict = {}
        for snap in snaps.values():
            for k, v in snap.items():
                merged[k] = merged.get(k, 0) + v
        cats = {name: sum(merged.get(k, 0) for k in keys) for name, keys in CATEGORIES.items()}
        cats["total"] = merged.get(_TOTAL_KEY, 0)
        return cats

    def mark(self) -> tuple[dict[str, int], dict[str, int]]:
        """(the figures now, the figures at the highest total since the previous mark) by category;
        starts a new window."""
        now = self._categories(self._curr_mem_snap)
        window = self._window if self._window is not None and self._window["total"] >= now["total"] else now
        self._window = dict(now)
        return now, window

    def peak(self) -> tuple[int, dict[str, int], dict[str, int]]:
        """(total, verify's categories, the tracker's own categories) at this rank's peak."""
        snap: dict = {}
        for dev_snap in self._peak_mem_snap.values():
            for k, v in dev_snap.items():
                snap[k] = snap.get(k, 0) + v
        cats = {name: sum(snap.get(k, 0) for k in keys) for name, keys in CATEGORIES.items()}
        detail = {(k.value if hasattr(k, "value") else str(k)): v for k, v in snap.items() if k != _TOTAL_KEY}
        return snap.get(_TOTAL_KEY, 0), cats, detail


# --- building and stepping -------------------------------------------------------------------

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


def weak_module_grad_hooks(schedule: str):
    """torch's module tracker waits for each module's input gradients with register_multi_grad_hook, whose
    closures hold the inputs' grad_fn nodes: a split backward's input-gradient step retains the graph
    (retain_graph=True) and its weight step frees only the nodes it runs, so those closures kept every
    micro-batch's graph alive (430 MB of a 4-layer stage after the step; the trainer, without the tracker,
    frees it at the weight step). Under the split-backward schedules the tracker's hooks hold weak
    references to the inputs instead and find their nodes when the first gradient arrives."""
    if schedule not in SPLIT_BACKWARD:
        return contextlib.nullcontext()
    import threading
    import weakref

    from torch.autograd.graph import _get_grad_fn_or_grad_acc, register_multi_grad_hook
    from torch.distributed._tools import mod_tracker

    def weak_hook(tensors, fn, mode="all"):
        if mode != "all":
            return register_multi_grad_hook(tensors, fn, mode=mode)
        refs = [weakref.ref(t) for t in tensors]
        count: dict[int, int] = {}
        buffer: dict[int, tuple[list, int]] = {}
        fired: set[int] = set()           # graph tasks whose call is made: a late gradient starts no new count
        lock = threading.Lock()

        def inner(idx: int):
            def hook(grad):
                gid = torch._C._current_graph_task_id()
                with lock:
                    if gid in fired:
                        return
                    cur = count[gid] = count.get(gid, 0) + 1
                    if cur == 1:
                        nodes = [_get_grad_fn_or_grad_acc(t) for r in refs if (t := r()) is not None]
                        buffer[gid] = ([None] * len(refs), sum(map(torch._C._will_engine_execute_node, nodes)))
                    grads, expected = buffer[gid]
                    grads[idx] = grad
                    done = cur >= expected
                    if done:
                        del count[gid], buffer[gid]
                        fired.add(gid)
                if done:
                    fn(grads)
            return hook

        handles = [t.register_hook(inner(i)) for i, t in enumerate(tensors)]
        return _Handles(handles)

    return mock.patch.object(mod_tracker, "register_multi_grad_hook", weak_hook)


class _Handles:
    def __init__(self, handles: list) -> None:
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def run_fewer_micro_batches(eng: Engine, m: int) -> None:
    """Let a 1F1B schedule built for pp micro-batches run `m` < pp of them. The torch schedule refuses
    fewer than pp at construction because the other stages would starve; this rank's own order of
    operations (min(m, pp - stage) forwards in flight, then one backward / one forward) does not
    depend on them, and under the fake group nobody waits."""
    from torch.distributed.pipelining import Schedule1F1B

    if not isinstance(eng.schedule, Schedule1F1B):
        raise RuntimeError(f"only a 1F1B schedule runs fewer micro-batches than pp, not {type(eng.schedule)}")
    eng.schedule._n_microbatches = m

def with_micro_batches(cfg: TrainerConfig, m: int) -> TrainerConfig:
    """The same plan with `m` micro-batches per step (global batch follows)."""
    plan = cfg.plan
    if m == plan.grad_accum:
        return cfg
    lay = dataclasses.replace(plan.layout, grad_accum=m)
    train = dataclasses.replace(plan.train, global_batch=plan.micro_batch * m * plan.dp)
    return dataclasses.replace(cfg, plan=dataclasses.replace(plan, layout=lay, train=train))


def hidden_dtype(eng: Engine) -> torch.dtype:
    """What one pipeline stage sends the next: the compute dtype (bf16 weights or FSDP's bf16 gathers)."""
    return eng.compute_dtype


def make_pipeline_static(eng: Engine, cfg: TrainerConfig) -> None:
    """Give each of this rank's PipelineStages its input/output metadata (what the start-up vote
    and metadata exchange with the neighbouring ranks would have found) and skip that exchange."""
    from torch.distributed.pipelining._utils import InferenceMode, _StageMeta, extract_tensor_metas

    sched = eng.schedule
    p = cfg.plan
    seq = cfg.train.seq_len // p.cp
    hidden = torch.empty(p.micro_batch, seq // p.tp, cfg.model.hidden, dtype=hidden_dtype(eng),
                         device=eng.mesh.device)
    stages = list(getattr(sched, "_stages", None) or [sched._stage])  # type: ignore[union-attr]
    for st in stages:
        # a received activation requires grad, as the previous stage's output does: the stage's backward makes
        # its input gradient (what it sends back), and a split backward differentiates to it first
        x = torch.zeros(p.micro_batch, seq, dtype=torch.long, device=eng.mesh.device) if st.is_first else \
            hidden.detach().requires_grad_(True)
        y = hidden.detach().requires_grad_(True)
        st._user_meta = _StageMeta(inputs=extract_tensor_metas((x,)), outputs=extract_tensor_metas((y,)))

    def all_static(stages, has_backward, p2p_done) -> None:
        for s in stages:
            s._inference_mode = InferenceMode.STATIC

    sched._warmup_p2p = all_static  # type: ignore[union-attr]


def check_stage_output(eng: Engine, cfg: TrainerConfig) -> None:
    """The first stage's real output must be what the next stage was told to expect."""
    if eng.schedule is None or 0 not in eng.stage_ids:
        return
    p = cfg.plan
    part = eng.parts[eng.stage_ids.index(0)]
    x = torch.zeros(p.micro_batch, cfg.train.seq_len // p.cp, dtype=torch.long, device=eng.mesh.device)
    with torch.no_grad():
        y = part(x)
    for m in part.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    want = (p.micro_batch, cfg.train.seq_len // p.cp // p.tp, cfg.model.hidden)
    if tuple(y.shape) != want or y.dtype != hidden_dtype(eng):
        raise RuntimeError(f"pipeline stage 0 outputs {tuple(y.shape)} {y.dtype}, but the next stage "
                           f"expects {want} {hidden_dtype(eng)}")


def step_as_on_the_nodes(eng: Engine, cfg: TrainerConfig) -> None:
    """Run the optimizer's step as torch runs it on the plan's device: on a GPU, AdamW and SGD default to
    their foreach implementations (one kernel over every local tensor: AdamW makes sqrt(v) for all of
    them at once), on a CPU to one parameter at a time; the traced tensors live on this CPU."""
    on_gpu = cfg.plan.gpu.name != "cpu"
    for group in eng.optimizer.param_groups:
        if "foreach" in group and group["foreach"] is None:
            group["foreach"] = on_gpu


def init_optimizer_state(eng: Engine) -> None:
    """Create the optimizer state as it exists from step 2 on (zero gradients, one step)."""
    if eng.lean is not None:
        eng.lean.init_state()
        return
    for q in eng.params:
        if q.requires_grad:
            q.grad = torch.zeros_like(q)
    eng.optimizer.step()
    eng.optimizer.zero_grad(set_to_none=True)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (DTensors: their local shards)."""
    seen, total = set(), 0
    for t in tensors:
        for st in get_untyped_storages(t):
            if id(st) not in seen:
                seen.add(id(st))
                total += st.nbytes()
    return total


def computed_state(eng: Engine) -> dict[str, int]:
    """Parameters, gradients and optimizer state from the local shard shapes (exact, not traced).
    Gradients: one per trainable parameter, local shard in the parameter's dtype."""
    params = [q for m in eng.parts for q in m.parameters()]
    buffers = [b for m in eng.parts for b in m.buffers()]
    width = params[0].dtype.itemsize if params else 4
    if eng.lean is not None and eng.cfg.train.grad_dtype == "fp32":
        width = 4                               # the fp32 accumulation buffers (dist_optim: main_grad)
    grads = sum(q.to_local().numel() if hasattr(q, "to_local") else q.numel() for q in params
                if q.requires_grad) * width
    opt = [v for s in eng.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    if eng.lean is not None:
        opt += eng.lean.masters                 # the fp32 masters are optimizer state (the seed's 4 of 12 B)
    return {"params": storage_bytes(params) + storage_bytes(buffers), "grads": grads, "optimizer": storage_bytes(opt)}


def trace_step(cfg: TrainerConfig, bf16: bool, micro_batches: int,
               replay: tuple[int, list[int]] | None = None) -> tuple[StepTrace, RoleTrace]:
    """Build the rank's Engine and trace one optimizer step with `micro_batches` micro-batches
    (under 1F1B possibly fewer than pp: run_fewer_micro_batches); also the rank's state from its
    local shard shapes. Call inside fake_world() and real_device_meshes().

    `replay` = (m, pp ranks), multi-stage schedules only: `micro_batches` may be fewer than pp (the
    trainer's own check is skipped: torch's schedule is built for them); every action of the step
    is recorded (ActionLog) and StepTrace.segments holds, per pp rank, the figures at the peak of
    that rank's own action order at m micro-batches, replayed from the recorded actions (replay)."""
    pp = cfg.plan.pp
    fewer = pp > 1 and micro_batches < pp and cfg.plan.schedule == "1f1b"
    cfg_m = with_micro_batches(cfg, pp if fewer else micro_batches)
    mesh = mesh_for(cfg_m)
    allow_few = mock.patch.object(pipeline_mod, "check_microbatches", lambda *a: None) if replay else \
        contextlib.nullcontext()
    # engine.timed_sync times the wait for peers with a host sync on a one-element tensor: no peers,
    # no data and no memory here
    with FakeTensorMode(allow_non_fake_inputs=True), mock.patch.object(engine_mod, "timed_sync", lambda device: 0.0), \
            mock.patch.object(engine_mod, "Transformer", MetaBuiltTransformer), assumed_routing(), \
            untracked_sharding_propagation(), attention_as_on_the_nodes(cfg), compiled_as_traced(), \
            weak_module_grad_hooks(cfg.plan.schedule), \
            mock.patch.object(float8, "BACKWARD_FAST_ACCUM", False):     # fp8's backward GEMMs as a GPU runs them
        with allow_few:
            eng = Engine(cfg_m, mesh, bf16=bf16)
        if eng.schedule is not None:
            make_pipeline_static(eng, cfg_m)
            check_stage_output(eng, cfg_m)
            if fewer:
                run_fewer_micro_batches(eng, micro_batches)
        step_as_on_the_nodes(eng, cfg)
        init_optimizer_state(eng)
        p = cfg_m.plan
        batch = torch.randint(0, cfg.model.vocab, (p.micro_batch * micro_batches, cfg.train.seq_len + 1))
        tracker = RankMemTracker(eng.parts, eng.optimizer, eng.lean)  # type: ignore[arg-type]
        tracker.track_inputs((batch,))
        log = None
        if replay:
            sched = eng.schedule
            log = ActionLog(sched.pipeline_order_with_comms[sched.rank], tracker, sched)  # type: ignore[union-attr]
            sched.pipeline_order_with_comms[sched.rank] = log  # type: ignore[union-attr]
        with tracker, mock.patch.object(engine_mod, "clip_grad_norm", tracker.clipping(engine_mod.clip_grad_norm)):
            if log is not None:
                log.begin()
            eng.step(batch, lambda *a, **k: None)
            if log is not None:
                log.end()
        total, cats, detail = tracker.peak()
        per_mb = step_long_bytes(tracker, eng, batch, micro_batches)
        derived: list[dict] = []
        if log is not None and replay is not None:
            m, ranks = replay
            ran = list(list.__iter__(log))
            sched_name = cfg.plan.schedule
            if ran != schedule_orders(sched_name, pp, len(eng.stage_ids), micro_batches)[eng.schedule.rank]:  # type: ignore[union-attr]
                raise RuntimeError("replay: torch's schedule built without stages orders this rank's actions "
                                   "otherwise than the one that ran")
            orders = schedule_orders(sched_name, pp, len(eng.stage_ids), m)
            second = sched_name in SPLIT_BACKWARD
            carried = input_grad_bytes(eng) / micro_batches
            derived = [{"pp_rank": r, **replay_peak(log, orders[r], m, micro_batches, per_mb, pp, second, carried)}
                       for r in ranks]
        role = RoleTrace(rank=dist.get_rank(), stage_ids=list(eng.stage_ids), state=computed_state(eng),
                         dp_mode=eng.dp_mode)
    return StepTrace(micro_batches=micro_batches, peak=total, categories=cats, detail=detail,
                     per_micro_batch=per_mb, segments=derived), role


@dataclass(frozen=True)
class Wait:
    """The wait for a stage's pending unshard: FSDP's all-gather copy-out, which torch's runtime runs at
    the start of the stage's next compute action. Its own step in the trace and the replay, so a
    compute action moves memory alike whether or not an unshard is pending (with more than 3 stages
    per rank torch re-gathers stages within the step, and a forward or backward of any micro-batch
    may then be the one that waits)."""

    stage_index: int


def with_waits(order) -> list:
    """`order` with a Wait before each compute action that finds its stage's unshard pending (as torch's
    runtime then waits: _PipelineScheduleRuntime._assert_unsharded). Idempotent."""
    from torch.distributed.pipelining.schedules import UNSHARD

    pending: set[int] = set()
    out: list = []
    for a in order:
        if isinstance(a, Wait):
            pending.discard(a.stage_index)
        elif a.is_compute_op and a.stage_index in pending:
            out.append(Wait(a.stage_index))
            pending.discard(a.stage_index)
        elif a.computation_type == UNSHARD:
            pending.add(a.stage_index)
        out.append(a)
    return out


def action_keys(order, m: int, pp: int, second: bool = False) -> list[tuple]:
    """What decides each action's memory, for an action sequence with its Waits (with_waits): its kind,
    which of the rank's stages (local index), and
    - a compute, send or receive: whether its micro-batch is the first, the last or one in between
      (the first backward makes the accumulated gradients, the last reduces them; under ZeRO 0-2 a
      compute runs on a gathered stage whatever came before, once its Wait is its own step);
    - a RESHARD: whether the stage's last backward came before (it resharded the stage already, so the
      RESHARD frees nothing) or not (it frees the gathered parameters);
    - an UNSHARD, a Wait, a REDUCE_GRAD: nothing more (from sharded; once per gather; once per step).
    `second`: micro-batch 1 is a kind of its own (the split-backward schedules under FSDP: the second input-
    gradient step's post-backward turns the bf16 .grad the first weight step left into the fp32 sum, a later
    one adds into that sum), so a trace needs 4 micro-batches (roles.replay_micro_batches)."""
    from torch.distributed.pipelining.schedules import BACKWARD_WEIGHT, FULL_BACKWARD, RESHARD

    done: set[int] = set()
    out: list[tuple] = []
    for a in order:
        if isinstance(a, Wait):
            out.append(("WAIT", a.stage_index // pp, None))
            continue
        mb, local = a.microbatch_index, a.stage_index // pp
        if a.computation_type == RESHARD:
            out.append((a.computation_type.name, local, a.stage_index in done))
            continue
        which = None if mb is None else 0 if mb == 0 else 2 if mb == m - 1 else 3 if second and mb == 1 else 1
        out.append((a.computation_type.name, local, which))
        if a.computation_type in (FULL_BACKWARD, BACKWARD_WEIGHT) and mb == m - 1:
            done.add(a.stage_index)
    return out


class ActionLog(list):
    """This rank's lowered action list, as the schedule runtime iterates it once per step, marking the
    tracker at each action's start: per action, the figures at its start and the highest ones until
    the next action starts (the action, and whatever the runtime does before the next).

    Each Wait (with_waits) is run here as its own step, by the runtime's own method, before the compute
    that would have run it. Before the first action, a probe gathers, waits for and reshards each
    stage of the rank once (the runtime's own UNSHARD and RESHARD): what a RESHARD within the step
    frees, before the stage's last backward, which a short trace need not contain (torch keeps 3
    stages gathered: with more per rank it evicts them; the probe's steps are marked and only lend
    their effects to the replay)."""

    def __init__(self, actions, tracker: RankMemTracker, sched) -> None:
        from torch.distributed.pipelining.schedules import RESHARD, UNSHARD, _Action

        super().__init__(flat_actions(actions))
        self.tracker = tracker
        self.sched = sched
        self.stages = {st.stage_index: st for st in sched._stages}
        self.probe = [a for i in self.stages for a in (_Action(i, UNSHARD, None), Wait(i), _Action(i, RESHARD, None))]
        self.head: dict = {}                 # from the step's start to its first action
        self.actions: list[dict] = []        # {"action", "start", "peak", "end", "probe"}
        self.tail: dict = {}                 # from the end of the last action to the step's end

    def begin(self) -> None:
        now, _ = self.tracker.mark()
        self.head = {"start": now}

    def end(self) -> None:
        _, window = self.tracker.mark()
        self.tail["peak"] = window

    def __iter__(self):
        for i, a in enumerate([*self.probe, *with_waits(list.__iter__(self))]):
            now, window = self.tracker.mark()
            self._close(now, window)
            self.actions.append({"action": a, "start": now, "probe": i < len(self.probe)})
            if isinstance(a, Wait):
                self.sched._assert_unsharded(self.stages[a.stage_index])
            else:
                yield a
        self._close(*self.tracker.mark())
        self.tail = {"start": self.actions[-1]["end"]} if self.actions else {"start": self.head["start"]}

    def _close(self, now: dict, window: dict) -> None:
        if self.actions:
            self.actions[-1].update(peak=window, end=now)
        else:
            self.head["peak"] = window


def interleaved_orders(pp: int, v: int, m: int) -> dict[int, list]:
    """schedule_orders of interleaved 1F1B."""
    return schedule_orders("interleaved-1f1b", pp, v, m)


def schedule_orders(schedule: str, pp: int, v: int, m: int) -> dict[int, list]:
    """Every pp rank's lowered action list (compute, FSDP unshard/reshard, gradient reduction,
    send/recv) of a multi-stage schedule with `v` stages per rank at `m` micro-batches, by torch's own
    schedule code (the plan's class, built without stages: the order depends on these alone), with
    DualPipe-V's overlapped forward+backward pairs as their two actions (flat_actions)."""
    s = _built_without_stages(schedule, pp, v, m)
    s._prepare_schedule_with_comms(s.pipeline_order)
    return {r: flat_actions(a) for r, a in s.pipeline_order_with_comms.items()}


def compute_orders(schedule: str, pp: int, v: int, m: int) -> dict[int, list]:
    """Every pp rank's compute actions (no bubbles, no communication) of torch's schedule, flat_actions."""
    s = _built_without_stages(schedule, pp, v, m)
    return {r: flat_actions([a for a in acts if a is not None]) for r, acts in s.pipeline_order.items()}


def _built_without_stages(schedule: str, pp: int, v: int, m: int):
    """torch's schedule object for `schedule` with its pipeline_order, built without stages or a process group
    (what __init__ does, less the stages' bookkeeping and its checks of the micro-batch count)."""
    from torch.distributed.pipelining.schedules import (
        ScheduleInterleavedZeroBubble,
        generate_stage_to_rank_mapping,
    )

    from launcher.trainer.pipeline import MULTI

    cls = MULTI[schedule]
    s: Any = object.__new__(cls)         # the attributes its __init__ would set, per class
    s.pp_group_size, s.n_local_stages, s._num_stages, s._n_microbatches = pp, v, pp * v, m
    s.num_stages = pp * v
    s._stages, s._defer_pp_recv = [], False
    s.number_of_rounds = max(1, m // pp)
    s.microbatches_per_round = m // s.number_of_rounds
    if schedule in ("zero-bubble-v", "dualpipe-v"):
        s.stage_index_to_group_rank = generate_stage_to_rank_mapping(pp, pp * v, style="v")
    s.pipeline_order = {r: s._calculate_single_rank_operations(r) for r in range(pp)}
    if cls is ScheduleInterleavedZeroBubble:
        s.pipeline_order = s._add_bubbles_to_actions(pp * v)
    return s


def flat_actions(order) -> list:
    """An action list with each OVERLAP_F_B as its sub-actions, in order (what torch's runtime performs for it)."""
    from torch.distributed.pipelining.schedules import OVERLAP_F_B

    out: list = []
    for a in order:
        if a.computation_type == OVERLAP_F_B and a.sub_actions:
            out.extend(a.sub_actions)
        else:
            out.append(a)
    return out


def replay_peak(log: ActionLog, order: list, m: int, n: int, per_mb: dict[str, int], pp: int,
                second: bool = False, carried: float = 0.0) -> dict:
    """The figures at the peak of one pipeline rank's step at `m` micro-batches, replayed from the
    actions traced at `n`: each action of `order` (with its Waits) moves the live bytes by what the
    traced action of the same key (action_keys) did and rises above them by what it rose; the receive
    buffers and token ids of the m - n micro-batches not traced live through the whole step
    (step_long_bytes). RuntimeError when the order has an action whose key was not traced, or when two
    traced actions of one key moved memory differently (the key misses what decides it). Returns
    {"figures": at the peak, "closes": bytes by which the replayed step's end differs from the traced
    one's (0 when every allocation of the step is matched by its free), "at": where the peak is}."""
    keys = ("total", *CATEGORIES)
    extra = {k: per_mb.get(k, 0) * (m - n) for k in CATEGORIES}
    extra["total"] = sum(extra.values())

    def add(a: dict, b: dict, sign: int = 1) -> dict:
        return {k: a[k] + sign * b[k] for k in keys}

    by_key: dict[tuple, tuple[dict, dict]] = {}
    for seg, k in zip(log.actions, action_keys([s["action"] for s in log.actions], n, pp, second)):
        delta, rise = add(seg["end"], seg["start"], -1), add(seg["peak"], seg["start"], -1)
        if k in by_key:
            if by_key[k][0] != delta:
                raise RuntimeError(f"replay: traced action {k} moved memory by {by_key[k][0]} once and by {delta} "
                                   f"another time: what decides it is not in its key")
            if by_key[k][1]["total"] > rise["total"]:
                rise = by_key[k][1]
        by_key[k] = (delta, rise)
    first = next(s for s in log.actions if not s["probe"])
    level = add(first["start"], extra)
    best, at = add(log.head["peak"], extra), "before the first action"
    full = with_waits(order)
    i = -1
    for a, k in zip(full, action_keys(full, m, pp, second)):
        if k not in by_key:
            raise RuntimeError(f"replay: action {a} ({k}) of the order at {m} micro-batches was not traced at {n}")
        i += not isinstance(a, Wait)
        delta, rise = by_key[k]
        cand = add(level, rise)
        if cand["total"] > best["total"]:
            best, at = cand, (f"action {i} of {len(order)} ({a})" if not isinstance(a, Wait) else
                              f"action {i + 1} of {len(order)} ({order[i + 1]}) waiting for its unshard")
        level = add(level, delta)
    tail = add(level, add(log.tail["peak"], log.tail["start"], -1))
    if tail["total"] > best["total"]:
        best, at = tail, "after the last action (gradient clipping, optimizer)"
    # `carried`: bytes per micro-batch the step leaves for the next one to free (a split backward's input gradients
    # in the receive buffers' .grad: stage.py clears them at the next step), made by its actions, not up front
    closes = level["total"] - (log.tail["start"]["total"] + extra["total"] + carried * (m - n))
    return {"figures": best, "closes": closes, "at": at}


def step_long_bytes(tracker: RankMemTracker, eng: Engine, batch: torch.Tensor, m: int) -> dict[str, int]:
    """Bytes per micro-batch, by category, that live through the whole step: the token ids, and
    under a pipeline the receive buffers every stage allocates up front for each micro-batch
    (activations from the previous stage, gradients from the next). A step with more micro-batches
    holds exactly this much more at its peak, whatever the schedule keeps in flight."""
    out: dict[str, int] = {}

    def add(t: torch.Tensor | None, share: float = 1.0) -> None:
        if t is None:
            return
        for st in get_untyped_storages(t):
            winfo = tracker._WINFO.get(st, (None, None))[0]
            cat = next((c for c, keys in CATEGORIES.items() if winfo is not None and winfo.reftype in keys), None)
            if cat is not None:          # one the tracker did not see is not in the traced peak either
                out[cat] = out.get(cat, 0) + int(st.nbytes() * share)

    add(batch, 1 / m)
    stages = list(getattr(eng.schedule, "_stages", None) or [getattr(eng.schedule, "_stage", None)])
    for st in stages:
        if st is None:
            continue
        for info in (*st.args_recv_info.get(0, ()), *st.grad_recv_info.get(0, ())):
            add(info.buffer)
    return out


def input_grad_bytes(eng: Engine) -> int:
    """What the step's input-gradient steps left in the stages' receive buffers (.grad, until the next step)."""
    total = 0
    for st in getattr(eng.schedule, "_stages", None) or []:
        for infos in st.args_recv_info.values():
            for info in infos:
                g = getattr(info.buffer, "grad", None) if getattr(info, "buffer", None) is not None else None
                if g is not None:
                    total += storage_bytes([g])
    return total


def build_state(cfg: TrainerConfig, bf16: bool) -> dict[str, int]:
    """Build this (fake) rank's Engine (mesh, TP plan, stage split, FSDP wrapping, CP, optimizer)
    without stepping; its state from local shard shapes. Call inside fake_world() and
    real_device_meshes()."""
    mesh = mesh_for(cfg)
    with FakeTensorMode(allow_non_fake_inputs=True), mock.patch.object(engine_mod, "Transformer",
                                                                       MetaBuiltTransformer), assumed_routing():
        eng = Engine(cfg, mesh, bf16=bf16)
        if eng.schedule is not None:
            make_pipeline_static(eng, cfg)
        init_optimizer_state(eng)
        return computed_state(eng)
