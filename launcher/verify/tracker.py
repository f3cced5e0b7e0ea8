"""torch's FSDP-aware MemTracker, taught what a rank of the bundled trainer holds: every part of a rank
(virtual pipeline stages), the parameters and gradients FSDP does not manage, one forward per micro-batch,
and categories by what a tensor is rather than when it was made (memtrace's docstring lists them)."""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
from torch import nn
from torch._guards import active_fake_mode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType, _FSDPState
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard import _fsdp_param_group
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
from torch.utils.weak import WeakIdKeyDictionary

from launcher.plan.capabilities import SPLIT_BACKWARD
from launcher.trainer import pipeline as pipeline_mod
from launcher.trainer import sequence_parallel as sp_ops
from launcher.trainer.model import Block

#: tracker categories -> the categories launch verify reports
CATEGORIES = {
    "params": (_FSDPRefType.SHARDED_PARAM, _FSDPRefType.UNSHARDED_PARAM, _FSDPRefType.BUFFER),
    "grads": (_FSDPRefType.SHARDED_GRAD, _FSDPRefType.UNSHARDED_GRAD),
    "optimizer": (_FSDPRefType.OPT,),
    "activations": (_FSDPRefType.ACT, _FSDPRefType.INP),
    "temporaries": (_FSDPRefType.TEMP,),
    "comm_buffers": (_FSDPRefType.ALL_GATHER, _FSDPRefType.REDUCE_SCATTER),
}


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


class _Handles:
    """The grad hooks one registration made, removed together (what register_multi_grad_hook returns)."""

    def __init__(self, handles: list) -> None:
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


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
