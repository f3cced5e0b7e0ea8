"""ZeRO 0 and 1 without FSDP: bf16 model weights, fp32 master weights and optimizer state in flat
buffers sharded evenly over the data-parallel group (Megatron's distributed optimizer).

Why this shape (the seed's ledger: 2 B weights + 2 B gradients + 12 B fp32 master, m and v):
- The model holds its weights in the compute dtype only (bf16 on a GPU): no fp32 copy beside
  them, no autocast, so activations and the residual stream are bf16 too. Gradients arrive in
  the weights' dtype and accumulate over micro-batches there (train.grad_dtype bf16), or in an
  fp32 buffer beside each weight (grad_dtype fp32: Megatron's main_grad, 2 B more per param).
- The fp32 master weights and the optimizer's state live in one flat buffer per group, each
  parameter split along one dimension into `n` equal (padded) chunks, one per rank: ZeRO 1
  gives every rank 1/n of every tensor (even at small dp and with a huge embedding), ZeRO 0
  is the same with n = 1 (every rank the whole).
- After backward the gradients are packed rank-major into fp32 buckets and reduce-scattered
  (ZeRO 1) or all-reduced (ZeRO 0) into the owner's fp32 gradient shard; the grad-norm clip
  reads the shards; the inner torch optimizer steps the flat master shard; the updated weights
  are cast to the model dtype and all-gathered back, bucket by bucket (transients bounded by
  BUCKET_ELEMS).
- Checkpoints: each parameter's master, m and v are offered to torch.distributed.checkpoint as
  DTensor views of the flat buffers, sharded over the group along the chunk dimension (and over
  TP like the weight), under the keys FSDP2's and plain layouts use (`model.<fqn>`,
  `optim.state.<fqn>.exp_avg`, ...): a checkpoint loads into any layout and any layout's loads
  here. The split dimension avoids TP's own (a column-parallel weight is split along its rows
  by TP, so along its columns here), so the DTensors are plain Shard placements. adam8bit's
  block-quantised state follows the flat shard and reloads into the same layout only
  (keyed by global rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from launcher.trainer.fsdp import local_grads

#: Elements per fp32 pack/reduce bucket (all ranks' chunks together): the step's transient is one
#: such bucket in fp32 plus its model-dtype gather (the ledger's ALLREDUCE_BUCKET_ELEMS).
BUCKET_ELEMS = 1 << 25


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def split_dim(p: torch.Tensor) -> int:
    """The dimension a parameter is chunked along over the data-parallel group: not TP's (a
    DTensor's Shard dim), so the checkpoint's DTensor is (Shard(d) over dp·cp, TP's placement)."""
    local = _local(p)
    tp_dims = {pl.dim for pl in getattr(p, "placements", ()) if pl.is_shard()}
    for d in range(local.dim()):
        if d not in tp_dims:
            return d
    raise ValueError(f"parameter of shape {tuple(local.shape)} is sharded by TP on every dimension")


@dataclass
class Segment:
    """One parameter's place in its group's flat shard: chunked along `dim`, `chunk` rows per rank."""

    name: str
    param: nn.Parameter
    dim: int
    chunk: int                      # padded chunk length along dim: ceil(size / n)
    shape: tuple[int, ...]          # one rank's padded chunk
    offset: int                     # in the flat shard
    numel: int

    def valid(self, r: int) -> int:
        """Rows of rank r's chunk that hold data (torch.chunk's split: the last ranks may hold less)."""
        size = _local(self.param).shape[self.dim]
        return max(0, min(self.chunk, size - r * self.chunk))

    def scatter(self, full: torch.Tensor, row: torch.Tensor, r: int, base: int = 0) -> None:
        """Rank r's chunk of `full` (a tensor of the weight's local shape) into its place in `row`, a 1-D
        tensor starting at flat offset `base`."""
        k = self.valid(r)
        if k:
            _place(self, row, base).narrow(self.dim, 0, k).copy_(full.narrow(self.dim, r * self.chunk, k))

    def gather(self, row: torch.Tensor, full: torch.Tensor, r: int, base: int = 0) -> None:
        """The reverse of scatter: rank r's chunk in `row` back into its rows of `full`."""
        k = self.valid(r)
        if k:
            full.narrow(self.dim, r * self.chunk, k).copy_(_place(self, row, base).narrow(self.dim, 0, k))


@dataclass
class Bucket:
    """Consecutive segments reduced, stepped and gathered together: [lo, hi) of the flat shard, the
    master's slice for those elements (a parameter of the inner optimizer)."""

    segments: list[Segment]
    lo: int
    hi: int
    master: torch.Tensor = field(init=False)


@dataclass
class Group:
    """Parameters reduced and sharded over one process group (dense: dp·cp; EP experts: their replicas)."""

    segments: list[Segment]
    group: object | None            # the reduction group (None: a group of one)
    size: int                       # ranks in the reduction group
    n: int                          # chunks per parameter: size under ZeRO 1, 1 under ZeRO 0
    rank: int                       # this rank's chunk (0 when n = 1)
    mesh: object | None             # the group as a 1-D DeviceMesh (checkpoint DTensors)
    replicas: object | None = None  # hybrid sharding: the ranks holding the same shard (its gradient all-reduced)
    buckets: list[Bucket] = field(default_factory=list)
    master: torch.Tensor = field(init=False)       # the flat fp32 shard; each bucket's master is a slice

    def layout(self) -> int:
        """Offsets and buckets (at most BUCKET_ELEMS over all ranks, or one larger segment alone); the row length."""
        offset, start = 0, 0
        for i, s in enumerate(self.segments):
            if i > start and (offset + s.numel - self.segments[start].offset) * self.n > BUCKET_ELEMS:
                self.buckets.append(Bucket(self.segments[start:i], self.segments[start].offset, offset))
                start = i
            s.offset = offset
            offset += s.numel
        if self.segments:
            self.buckets.append(Bucket(self.segments[start:], self.segments[start].offset, offset))
        return offset


def _tp_summed(p: nn.Parameter, g: torch.Tensor) -> torch.Tensor:
    """A weight TP leaves whole under MoE (tensor_parallel.tag_tp_replicated): every TP rank's gradient is
    its own tokens' share, summed over the TP group here."""
    group = getattr(p, "tp_sum_group", None)
    if group is not None:
        g = g.contiguous()
        dist.all_reduce(g, group=group)
    return g


def _replicated_slice(p: nn.Parameter, g: torch.Tensor) -> torch.Tensor | None:
    """This rank's shard of a weight's gradient that is Replicate where the weight is Shard(d) on a 1-D TP
    mesh, as a view (torch.chunk's split, as DTensor shards); None for any other placement pair."""
    if not (hasattr(p, "placements") and hasattr(g, "placements")) or len(p.placements) != 1:
        return None
    pl, gl = p.placements[0], g.placements[0]
    if not (pl.is_shard() and gl.is_replicate()) or g.device_mesh != p.device_mesh:  # type: ignore[attr-defined]
        return None
    mesh = p.device_mesh  # type: ignore[attr-defined]
    return g._local_tensor.chunk(mesh.size(0), dim=pl.dim)[mesh.get_local_rank(0)]  # type: ignore[attr-defined]


def _segment(name: str, p: nn.Parameter, n: int) -> Segment:
    local = _local(p)
    if local.dim() == 0:
        raise ValueError(f"{name}: a scalar parameter cannot be chunked")
    d = split_dim(p)
    chunk = math.ceil(local.shape[d] / n) if local.shape[d] else 0
    shape = tuple(chunk if i == d else s for i, s in enumerate(local.shape))
    return Segment(name, p, d, chunk, shape, 0, math.prod(shape))


def _place(s: Segment, row: torch.Tensor, base: int = 0) -> torch.Tensor:
    """Segment s's padded chunk inside `row`, a 1-D tensor starting at flat offset `base`."""
    return row[s.offset - base:s.offset - base + s.numel].view(s.shape)


class MixedPrecisionOptimizer:
    """Model weights in their dtype; fp32 master, gradient shard and an inner torch optimizer over
    the master slices of each bucket. `reduce_grads`, the clip, then `step` (engine.step).

    `groups`: (named parameters, process group or None, 1-D DeviceMesh of that group or None[, replica
    process group]): under hybrid sharding each shard's reduced gradient is then all-reduced over the
    replica group (the ranks of the other shard groups holding the same shard), so the group's ranks
    step identical copies, as MiCS / HSDP do.
    `shard`: ZeRO 1 (chunks over the group) or ZeRO 0 (whole on every rank, gradients all-reduced).
    The inner optimizer steps one bucket at a time, so a foreach implementation's temporaries (AdamW's
    sqrt(v)) are one bucket's, not the whole shard's.
    """

    def __init__(self, groups: list[tuple], make_inner, shard: bool, grad_dtype: str = "bf16"):
        self.groups: list[Group] = []
        for named, pg, mesh, *rest in groups:
            if not named:
                continue
            size = dist.get_world_size(pg) if pg is not None else 1
            n = size if shard else 1
            rank = dist.get_rank(pg) if pg is not None and shard else 0
            g = Group([_segment(name, p, n) for name, p in named], pg, size, n, rank, mesh,
                      rest[0] if rest else None)
            row = g.layout()
            g.master = torch.zeros(row, dtype=torch.float32, device=_local(named[0][1]).device)
            for b in g.buckets:
                b.master = g.master[b.lo:b.hi]
            with torch.no_grad():
                for s in g.segments:
                    s.scatter(_local(s.param), g.master, g.rank)
            self.groups.append(g)
        self.masters = [g.master for g in self.groups]
        self.slices = [b.master for g in self.groups for b in g.buckets]
        self.inner: torch.optim.Optimizer = make_inner(self.slices)
        self.main_grads: dict[int, torch.Tensor] = {}
        self.hooked: set[int] = set()
        if grad_dtype == "fp32":
            for g in self.groups:
                for s in g.segments:
                    if _local(s.param).dtype != torch.float32:
                        # looked up at call time, so launch verify's tracker can file what it makes
                        s.param.register_post_accumulate_grad_hook(lambda p: self._accumulate(p))
                        self.hooked.add(id(s.param))

    # --- gradients ---------------------------------------------------------------------------------

    @torch.no_grad()
    def _accumulate(self, p: nn.Parameter) -> None:
        """grad_dtype fp32: add this micro-batch's gradient into the fp32 buffer, free the bf16 one."""
        (_, g), = local_grads([p])
        buf = self.main_grads.get(id(p))
        if buf is None:
            self.main_grads[id(p)] = g.float()
        else:
            buf.add_(g)
        p.grad = None

    def take_grads(self, module: nn.Module) -> None:
        """What the post-accumulate-grad hook does, for gradients written without AccumulateGrad: a split
        backward's weight step (pipeline.Stage.after_weight) sets .grad itself."""
        if not self.hooked:
            return
        for p in module.parameters():
            if id(p) in self.hooked and p.grad is not None:
                self._accumulate(p)

    def grads_of(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        """The tensors holding these parameters' gradients so far (the fp32 buffer, or the local .grad)."""
        out = []
        for p in params:
            if id(p) in self.main_grads:
                out.append(self.main_grads[id(p)])
            else:
                out.extend(g for _, g in local_grads([p]))
        return out

    def _take_grad(self, p: nn.Parameter) -> torch.Tensor | None:
        """The parameter's gradient (its TP placement), released from the parameter. A replicated gradient
        of a TP-sharded weight (DTensor's embedding backward computes the whole vocabulary's) is read as a
        view of this rank's slice, not redistributed into a copy beside it."""
        if id(p) in self.main_grads:
            return _tp_summed(p, self.main_grads.pop(id(p)))
        g = p.grad
        view = _replicated_slice(p, g) if g is not None else None
        if view is not None:
            p.grad = None
            return view
        found = local_grads([p])
        p.grad = None
        return _tp_summed(p, found[0][1]) if found else None

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """Every group's gradients summed over its ranks into this rank's fp32 shard (each bucket
        master's .grad), bucket by bucket: the weights' gradients are released as they are packed."""
        for g in self.groups:
            for b in g.buckets:
                pack = torch.zeros((g.n, b.hi - b.lo), dtype=torch.float32, device=g.master.device)
                for s in b.segments:
                    grad = self._take_grad(s.param)
                    for r in range(g.n if grad is not None else 0):
                        s.scatter(grad, pack[r], r, b.lo)  # type: ignore[arg-type]
                    del grad
                if g.n == 1:
                    if g.size > 1:
                        dist.all_reduce(pack, group=g.group)
                    b.master.grad = pack[0]
                else:
                    shard = torch.empty(b.hi - b.lo, dtype=torch.float32, device=g.master.device)
                    dist.reduce_scatter_single(shard, pack.view(-1), group=g.group)
                    if g.replicas is not None:        # hybrid sharding: the shard summed over its copies
                        dist.all_reduce(shard, group=g.replicas)
                    b.master.grad = shard
                del pack
                self.reduced(b.master.grad)

    def reduced(self, grad: torch.Tensor) -> None:
        """Called with each bucket's fp32 gradient once it is reduced (under ZeRO 0 it is the reduce's own
        buffer): nothing here; launch verify's tracer files it as a gradient from then on."""

    def grad_sq(self, ranks_per_stage: int, exclude=frozenset()) -> torch.Tensor:
        """This rank's share of the global squared gradient norm: each shard element over the number of
        ranks holding an identical copy of it (as loss.clip_grad_norm counts whole gradients)."""
        from launcher.trainer.loss import _norm_sq, _replication

        sq = torch.zeros((), dtype=torch.float64, device=self.masters[0].device if self.masters else "cpu")
        for g in self.groups:
            for b in g.buckets:
                for s in b.segments:
                    if id(s.param) not in exclude and b.master.grad is not None:
                        copies = _replication(s.param, ranks_per_stage) / g.n
                        sq += _norm_sq(_place(s, b.master.grad, b.lo)) / copies
        return sq

    def shard_grads(self) -> list[torch.Tensor]:
        return [m.grad for m in self.slices if m.grad is not None]

    # --- the step ------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> None:
        """The inner optimizer bucket by bucket on the fp32 shards, then the updated weights back into the model."""
        group = self.inner.param_groups[0]
        every = group["params"]
        try:
            for m in self.slices:
                group["params"] = [m]
                self.inner.step()
                m.grad = None
        finally:
            group["params"] = every
        self.gather_params()

    @torch.no_grad()
    def gather_params(self) -> None:
        """Every rank's updated chunks, cast to the model dtype, into every rank's weights."""
        for g in self.groups:
            dtype = _local(g.segments[0].param).dtype
            for b in g.buckets:
                mine = b.master.to(dtype)
                if g.n == 1:
                    rows = mine.view(1, -1)
                else:
                    rows = torch.empty((g.n, b.hi - b.lo), dtype=dtype, device=mine.device)
                    dist.all_gather_single(rows.view(-1), mine, group=g.group)
                del mine
                for s in b.segments:
                    for r in range(g.n):
                        s.gather(rows[r], _local(s.param), r, b.lo)
                del rows

    # --- checkpoints -----------------------------------------------------------------------------------

    def _dtensor(self, g: Group, s: Segment, row: torch.Tensor, base: int) -> torch.Tensor:
        """Segment `s` of a shard (`row`, starting at flat offset `base`) as the tensor DCP sees: a
        DTensor over (the group, TP) with the parameter's global shape."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        local = _place(s, row, base).narrow(s.dim, 0, s.valid(g.rank))
        p = s.param
        if g.mesh is None or g.size == 1:
            if hasattr(p, "device_mesh"):
                return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,  # type: ignore[attr-defined]
                                          shape=p.shape, stride=p.stride())
            return local
        dp = Shard(s.dim) if g.n > 1 else Replicate()
        if hasattr(p, "device_mesh"):
            mesh = _joint_mesh(g.mesh, p.device_mesh)
            placements = (dp, *p.placements)  # type: ignore[attr-defined]
        else:
            mesh, placements = g.mesh, (dp,)
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=p.shape,
                                  stride=p.stride())

    def init_state(self) -> None:
        """Allocate the inner optimizer's state now (a checkpoint loads into it before any step): one
        step at lr 0 without weight decay (the weights stay as they are), then every state tensor zeroed."""
        if not self.slices or self.inner.state.get(self.slices[0]):
            return
        group = self.inner.param_groups[0]
        saved = group["lr"], group.get("weight_decay", 0.0)
        group["lr"] = 0.0
        if "weight_decay" in group:
            group["weight_decay"] = 0.0
        for m in self.slices:
            m.grad = torch.zeros_like(m)
        try:
            self.inner.step()
        finally:
            group["lr"] = saved[0]
            if "weight_decay" in group:
                group["weight_decay"] = saved[1]
            for m in self.slices:
                m.grad = None
        for st in self.inner.state.values():
            for v in st.values():
                if torch.is_tensor(v):
                    v.zero_()

    def checkpoint_state(self, aliases: dict[str, str]) -> tuple[dict, dict]:
        """(model entries, flattened optimizer entries) for DCP, keyed as torch's state dicts are: per
        weight its master as the model entry, per-element state (exp_avg, ...) and scalar state (step)
        under `state.<name>.`, the hyperparameters under `param_groups.<name>.`."""
        self.init_state()
        model: dict = {}
        optim: dict = {}
        hyper = {k: v for k, v in self.inner.param_groups[0].items() if k != "params"}
        for g in self.groups:
            for bi, b in enumerate(g.buckets):
                st = self.inner.state[b.master]
                elementwise = [k for k, v in st.items() if torch.is_tensor(v) and v.shape == b.master.shape]
                for s in b.segments:
                    name = aliases.get(s.name, s.name)
                    model[name] = self._dtensor(g, s, g.master, 0)
                    for k in elementwise:
                        optim[f"state.{name}.{k}"] = self._dtensor(g, s, st[k], b.lo)
                    for k, v in st.items():
                        if torch.is_tensor(v) and v.dim() == 0:
                            optim[f"state.{name}.{k}"] = v
                    for k, v in hyper.items():
                        optim[f"param_groups.{name}.{k}"] = v
                for k, v in st.items():            # adam8bit: block codes follow the flat shard
                    if k not in elementwise and torch.is_tensor(v) and v.dim() > 0:
                        optim[f"flat.rank{dist.get_rank()}.{g.segments[0].name}.{bi}.{k}"] = v
        return model, optim

    def after_load(self, optim: dict, aliases: dict[str, str]) -> None:
        """After dcp.load: the hyperparameters DCP read back (the LR the schedule had reached) into the
        inner optimizer, and the loaded masters (written into the flat buffers' views) into the weights."""
        group = self.inner.param_groups[0]
        if self.groups:
            first = self.groups[0].segments[0].name
            name = aliases.get(first, first)
            for k in list(group):
                key = f"param_groups.{name}.{k}"
                if k != "params" and key in optim:
                    group[k] = optim[key]
        self.gather_params()


_JOINT: dict[tuple[int, int], object] = {}


def _joint_mesh(dp_mesh, tp_mesh):
    """The 2-D mesh (dp·cp group, TP group) for a TP weight's master: the same ranks as both 1-D meshes."""
    from torch.distributed.device_mesh import DeviceMesh

    key = (id(dp_mesh), id(tp_mesh))
    if key not in _JOINT:
        world = dist.get_world_size()
        # the rank grid: for each dp·cp index of this rank's group, its TP group's ranks
        dp_ranks = dp_mesh.mesh.flatten().tolist()
        tp_ranks = tp_mesh.mesh.flatten().tolist()
        me = dist.get_rank()
        tp_off = [r - me for r in tp_ranks]
        grid = torch.tensor([[d + o for o in tp_off] for d in dp_ranks])
        assert int(grid.max()) < world
        _JOINT[key] = DeviceMesh(dp_mesh.device_type, grid, mesh_dim_names=("dp_cp", "tp"),
                                 _init_backend=False)
    return _JOINT[key]
