"""Plan: the one contract between planner, renderer and trainer, serialized as plan.json.

Everything the trainer needs to build its DeviceMesh and model travels in it, as the same typed
sections the job file is checked with (ModelSpec, TrainSpec, GpuSpec, DiagnosticsSpec) and one
Layout (the degrees and choices the ledger, the time model and the trainer all read), together
with the memory ledger and time estimate the layout was chosen on, so a plan can be reviewed
long after it was made. plan.json is loaded back through the same typed loader, so a hand-edited
or stale plan fails with one line naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.errors import SpecError, UserError
from launcher.plan import capabilities
from launcher.plan.capabilities import ZERO_REFUSED
from launcher.plan.layout import RankPlacement, strides
from launcher.plan.schema import bounded, json_schema, load_dataclass, show
from launcher.plan.spec import ClusterSpec, GpuSpec, ModelSpec, TrainSpec
from launcher.plan.spec_backend import BackendSpec, DiagnosticsSpec
from launcher.plan.types import (
    CP_ATTENTIONS,
    PRECISIONS,
    ZERO_STAGES,
    CpAttention,
    PlanSchedule,
    Recompute,
    ZeroStage,
)

#: 2: typed sections, `layout` replaces degrees/zero_stage/recompute/... at the top level.
PLAN_VERSION = 2


@dataclass(frozen=True)
class Layout:
    """The degrees and choices of one layout: what the ledger and time model price, and what the
    trainer builds (its DeviceMesh adds only the rank order, `Plan.mesh_order`)."""

    tp: int = bounded(lo=1, doc="tensor-parallel degree")
    cp: int = bounded(lo=1, doc="context-parallel degree")
    pp: int = bounded(lo=1, doc="pipeline stages")
    dp: int = bounded(lo=1, doc="data-parallel degree")
    ep: int = bounded(lo=1, doc="expert-parallel degree (splits dp·cp; not a mesh dimension)")
    zero: ZeroStage = bounded(doc="ZeRO stage", why_not=ZERO_REFUSED)
    recompute: Recompute = bounded(doc="activation recomputation")
    micro_batch: int = bounded(lo=1, doc="sequences per micro-batch")
    grad_accum: int = bounded(lo=1, doc="micro-batches per optimizer step")
    schedule: PlanSchedule = bounded(doc="pipeline schedule ('none' when pp = 1)")
    virtual_stages: int = bounded(lo=1, doc="model chunks per pipeline rank")
    cp_attention: CpAttention = bounded("all-gather", doc="how attention crosses the cp group: all-gather (keys and "
                                                          "values) or all-to-all (heads, DeepSpeed-Ulysses)")
    dp_shard: int | None = bounded(None, lo=1, doc="dp ranks ZeRO 1-3 shard over (with cp); dp / dp_shard "
                                                    "replicas (HSDP). None: all of dp")
    compile: bool = bounded(False, doc="each transformer block compiled with torch.compile (train.compile; "
                                       "trainer/compiled.py)")

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def dp_shard_size(self) -> int:
        """The dp ranks of one ZeRO shard group (all of dp unless hybrid sharding)."""
        return self.dp_shard or self.dp

    @property
    def dp_replicas(self) -> int:
        """Copies of each ZeRO shard across dp (1 unless hybrid sharding)."""
        return max(1, self.dp // self.dp_shard_size)

    @property
    def shard_group(self) -> int:
        """Ranks ZeRO shards over: dp_shard·cp (FSDP and the lean optimizer fold CP in)."""
        return self.dp_shard_size * self.cp

    @property
    def hybrid(self) -> bool:
        """Hybrid sharding: ZeRO state sharded inside dp_shard·cp, replicated over dp / dp_shard."""
        return self.dp_replicas > 1

    @property
    def degrees(self) -> dict[str, int]:
        return {"tp": self.tp, "cp": self.cp, "pp": self.pp, "dp": self.dp, "ep": self.ep}


@dataclass
class RankColumns:
    """plan.json's rank map, one column per field (rank r is entry r of each): a 16,384-rank plan
    stays a few hundred kB. Mesh coordinates are not stored: they follow from the layout and
    mesh_order (launcher.plan.layout.coords_of)."""

    node: list[int] = bounded(doc="node index of each rank")
    local_rank: list[int] = bounded(doc="local rank on its node")
    gpu: list[int] = bounded(doc="physical GPU index")
    nic: list[str | None] | None = bounded(None, doc="NIC nearest each rank's GPU, when a bandwidth map said")

    @classmethod
    def of(cls, ranks: list[RankPlacement]) -> RankColumns:
        nics = [r.nic for r in ranks]
        return cls(node=[r.node for r in ranks], local_rank=[r.local_rank for r in ranks],
                   gpu=[r.gpu for r in ranks], nic=nics if any(n is not None for n in nics) else None)

    def expand(self, degrees: dict[str, int], mesh_order: list[str], world: int) -> list[RankPlacement]:
        """The RankPlacement list, or SpecError naming plan.ranks when a column has the wrong length."""
        for name in ("node", "local_rank", "gpu") + (("nic",) if self.nic is not None else ()):
            n = len(getattr(self, name))
            if n != world:
                raise SpecError(f"plan.ranks.{name}", f"has {n} entries but world_size is {world}")
        for name in ("node", "local_rank", "gpu"):
            if any(x < 0 for x in getattr(self, name)):
                raise SpecError(f"plan.ranks.{name}", "entries must be >= 0")
        st = strides(degrees, mesh_order)
        dims = [(d, st[d], degrees[d]) for d in mesh_order]
        nics = self.nic or [None] * world
        return [RankPlacement(rank=r, node=self.node[r], local_rank=self.local_rank[r], gpu=self.gpu[r],
                              coords={d: (r // k) % n for d, k, n in dims}, nic=nics[r]) for r in range(world)]


#: Placeholder for the rank map while the rest of plan.json is indented (the columns go on one line each).
_RANKS_SLOT = "@@launch4d-rank-columns@@"


@dataclass
class Plan:
    name: str = bounded(doc="the job's name")
    world_size: int = bounded(lo=1, doc="ranks: tp·cp·pp·dp")
    nodes: int = bounded(lo=1, doc="nodes")
    gpus_per_node: int = bounded(lo=1, doc="ranks per node")
    layout: Layout = bounded(doc="degrees and choices")
    mesh_order: list[str] = bounded(doc="mesh dimensions outer→inner")
    ranks: list[RankPlacement] = bounded(doc="rank → node, local rank, GPU, mesh coordinates")
    stage_layers: list[int] = bounded(doc="layers per pipeline stage (pp·virtual_stages entries)")
    fits: bool = bounded(doc="the memory ledger fits the GPU")
    memory: dict[str, Any] = bounded(doc="the memory ledger, GB per GPU")
    estimate: dict[str, Any] = bounded(doc="the time estimate")
    bandwidth: dict[str, Any] = bounded(doc="the bandwidth figures used, and their source")
    warnings: list[str] = bounded(doc="what the planner warns about this layout")
    model: ModelSpec = bounded(doc="the job file's model, resolved")
    train: TrainSpec = bounded(doc="the job file's train section")
    gpu: GpuSpec = bounded(doc="the GPU's figures, resolved")
    diagnostics: DiagnosticsSpec = dataclasses.field(default_factory=DiagnosticsSpec,
                                                     metadata={"doc": "the job file's diagnostics section"})
    hosts: list[str] | None = bounded(None, doc="node names, when a bandwidth map gave them")
    gpu_order: list[int] | None = bounded(None, doc="physical GPU order on each node (NVLink islands)")
    tp_node_local: bool = bounded(True, doc="every TP group sits on one node")
    forced: bool = bounded(False, doc="a TP group spans nodes because the job file allowed it")
    memory_traced: bool = bounded(False, doc="set by `launch verify` once the real trainer was traced")
    cluster: ClusterSpec | None = bounded(None, doc="the job file's cluster section (with the backend section: "
                                                    "what `launch run`, `render` and `submit` launch a plan.json with)")
    backend: BackendSpec | None = bounded(None, doc="the job file's backend section")
    version: int = bounded(PLAN_VERSION, doc="plan.json format version")

    # --- views of the layout (read-only; the layout is the one copy) ------------------------
    @property
    def degrees(self) -> dict[str, int]:
        return self.layout.degrees

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def cp(self) -> int:
        return self.layout.cp

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def ep(self) -> int:
        return self.layout.ep

    @property
    def zero_stage(self) -> int:
        return self.layout.zero

    @property
    def recompute(self) -> str:
        return self.layout.recompute

    @property
    def micro_batch(self) -> int:
        return self.layout.micro_batch

    @property
    def grad_accum(self) -> int:
        return self.layout.grad_accum

    @property
    def schedule(self) -> str:
        return self.layout.schedule

    @property
    def virtual_stages(self) -> int:
        return self.layout.virtual_stages

    @property
    def dp_shard(self) -> int:
        """dp ranks of one ZeRO shard group (all of dp unless hybrid sharding)."""
        return self.layout.dp_shard_size

    @property
    def dp_replicas(self) -> int:
        return self.layout.dp_replicas

    @property
    def cp_attention(self) -> str:
        return self.layout.cp_attention

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Mesh sizes in `mesh_order` (outer→inner), as init_device_mesh wants them."""
        return tuple(self.degrees[d] for d in self.mesh_order)

    def to_dict(self) -> dict[str, Any]:
        """plan.json as a dict; the rank map in columns (RankColumns)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "ranks":
                cols = RankColumns.of(value)   # flat lists of ints: asdict's per-element recursion is slow
                out[f.name] = {c.name: getattr(cols, c.name) for c in dataclasses.fields(cols)}
            elif dataclasses.is_dataclass(value) and not isinstance(value, type):
                out[f.name] = dataclasses.asdict(value)
            else:
                out[f.name] = json.loads(json.dumps(value)) if isinstance(value, (dict, list)) else value
        return out

    def to_json(self) -> str:
        return plan_json(self.to_dict())

    def save(self, path: str | Path) -> None:
        """Write atomically so a reader never sees half a plan."""
        from launcher.formats.files import atomic_write, make_dirs

        p = Path(path)
        make_dirs(p.parent, "plan directory")
        atomic_write(p, self.to_json() + "\n", "plan")

    @classmethod
    def from_dict(cls, data: Any) -> Plan:
        """Through the job file's typed loader: SpecError naming `plan.<field>` when anything is off."""
        if not isinstance(data, dict):
            raise SpecError("plan", f"a plan is a JSON object, not {type(data).__name__}")
        version = data.get("version")
        if version != PLAN_VERSION:
            raise SpecError("plan.version", f"{version!r} is not supported (expected {PLAN_VERSION}); "
                                            "re-run `launch plan`")
        ranks = data.get("ranks")
        if not isinstance(ranks, dict):                  # a rank list (hand-written plans): typed as is
            plan = load_dataclass(cls, {**data, "ranks": []}, "plan")
            check_shape(plan)
            plan.ranks = load_dataclass(_RankList, {"ranks": ranks}, "plan").ranks
        else:
            plan = load_dataclass(cls, {**data, "ranks": []}, "plan")
            check_shape(plan)
            cols = load_dataclass(RankColumns, ranks, "plan.ranks")
            plan.ranks = cols.expand(plan.degrees, plan.mesh_order, plan.world_size)
        check_rank_map(plan)
        return plan

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        from launcher.formats.files import read_text

        try:
            data = json.loads(read_text(path, "plan"))
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}: not a plan.json (line {exc.lineno}: {exc.msg})") from None
        except RecursionError:
            raise UserError(f"{path}: not a plan.json (nested too deeply)") from None
        try:
            return cls.from_dict(data)
        except SpecError as exc:
            raise UserError(f"{path}: {exc}") from None


@dataclass
class _RankList:
    ranks: list[RankPlacement]


MESH_DIMS = ("pp", "dp", "cp", "tp")
#: Names in a plan that become path components, #SBATCH values or /sys paths: host and NIC names.
HOST_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,252})")
NIC_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._:-]{0,63})")


def check_shape(plan: Plan) -> None:
    """What a plan promises about itself before its rank map is read: a mesh of the four dimensions,
    degrees that multiply to the world, nodes × GPUs per node = the world, names that stay one path
    component. SpecError naming `plan.<field>` (a hand-edited plan.json is refused, not trusted)."""
    from launcher.plan.spec import NAME

    if sorted(plan.mesh_order) != sorted(MESH_DIMS) or len(plan.mesh_order) != len(MESH_DIMS):
        raise SpecError("plan.mesh_order", f"{show(plan.mesh_order)} must order exactly {', '.join(MESH_DIMS)}")
    lay = plan.layout
    if lay.world != plan.world_size:
        raise SpecError("plan.world_size", f"{plan.world_size}, but layout tp·cp·pp·dp = {lay.tp}·{lay.cp}·{lay.pp}·"
                                           f"{lay.dp} = {lay.world}")
    if plan.nodes * plan.gpus_per_node != plan.world_size:
        raise SpecError("plan.nodes", f"nodes × gpus_per_node = {plan.nodes} × {plan.gpus_per_node} = "
                                      f"{plan.nodes * plan.gpus_per_node}, but world_size is {plan.world_size}")
    if not NAME.fullmatch(plan.name) or ".." in plan.name:
        raise SpecError("plan.name", f"{show(plan.name)} is not a job name (1-63 letters, digits, '.', '_' or '-', "
                                     "no '..'): it names directories")
    for i, host in enumerate(plan.hosts or []):
        if not HOST_NAME.fullmatch(host) or ".." in host:
            raise SpecError(f"plan.hosts[{i}]", f"{show(host)} is not a host name")
    if plan.gpu_order is not None and sorted(plan.gpu_order) != list(range(plan.gpus_per_node)):
        raise SpecError("plan.gpu_order", f"{show(plan.gpu_order)} is not an order of the GPUs "
                                          f"0..{plan.gpus_per_node - 1}")
    stages = lay.pp * lay.virtual_stages
    if len(plan.stage_layers) != stages or sum(plan.stage_layers) != plan.model.layers \
            or min(plan.stage_layers, default=0) < 0:
        raise SpecError("plan.stage_layers", f"{show(plan.stage_layers)} must be pp·virtual_stages = {stages} "
                                             f"counts >= 0 summing to model.layers = {plan.model.layers}")


def check_rank_map(plan: Plan) -> None:
    """Rank r runs where torchrun puts it (node r // gpus_per_node, local rank r % gpus_per_node, the
    static rendezvous every backend uses), on a GPU of that node no other rank there uses."""
    g, world = plan.gpus_per_node, plan.world_size
    if len(plan.ranks) != world:
        raise SpecError("plan.ranks", f"has {len(plan.ranks)} entries but world_size is {world}")
    used: set[tuple[int, int]] = set()
    dims = _dims(plan)
    for r, p in enumerate(plan.ranks):
        where = f"plan.ranks[{r}]"
        if p.rank != r:
            raise SpecError(f"{where}.rank", f"{p.rank}: entry {r} must describe rank {r}")
        if (p.node, p.local_rank) != (r // g, r % g):
            raise SpecError(f"{where}", f"node {p.node}, local rank {p.local_rank}: rank {r} runs as local rank "
                                        f"{r % g} of node {r // g} ({plan.nodes} node(s) × {g})")
        if not 0 <= p.gpu < g:
            raise SpecError(f"{where}.gpu", f"{p.gpu} is not a GPU of the node (0..{g - 1})")
        if (p.node, p.gpu) in used:
            raise SpecError(f"{where}.gpu", f"GPU {p.gpu} of node {p.node} is another rank's too")
        used.add((p.node, p.gpu))
        if p.nic is not None and (not NIC_NAME.fullmatch(p.nic) or ".." in p.nic):
            raise SpecError(f"{where}.nic", f"{show(p.nic)} is not a network device name")
        want = {d: (r // k) % n for d, k, n in dims}
        if p.coords and p.coords != want:
            raise SpecError(f"{where}.coords", f"{show(p.coords)}, but the layout and mesh_order put rank {r} at "
                                               f"{want}")
        if not p.coords:
            p.coords = want


def check_plan(plan: Plan) -> None:
    """Every check the trainer needs before a process group exists: one UserError naming the plan
    field, so 8 ranks do not each print a traceback. (plan.json's typed loader enforces the value
    sets too; a Plan built in memory, e.g. by a test or `launch verify`, meets them here.)"""
    m, t, lay = plan.model, plan.train, plan.layout

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise UserError(msg)

    need(lay.zero in ZERO_STAGES, f"plan.layout.zero={lay.zero} {ZERO_REFUSED.get(lay.zero, 'is not a ZeRO stage')}")
    need(t.precision in PRECISIONS, f"plan.train.precision={t.precision!r} "
                                    f"{capabilities.PRECISION_REFUSED.get(t.precision, 'is not a precision')}")
    why = capabilities.fp8_problem(plan.gpu) if t.precision == "fp8" else None
    need(why is None, f"plan.train.precision=fp8 {why}")
    bad = capabilities.model_problem(m)
    need(bad is None, f"plan.model.{bad[0]}: {bad[1]}" if bad else "")
    need(sorted(plan.mesh_order) == sorted(("pp", "dp", "cp", "tp")),
         f"plan.mesh_order={list(plan.mesh_order)} must order exactly pp, dp, cp, tp")
    need(lay.world == plan.world_size,
         f"plan.layout: tp·cp·pp·dp = {lay.world} but plan.world_size is {plan.world_size}")
    why = capabilities.tp_problem(m, lay.tp)
    need(why is None, f"plan.layout.tp={lay.tp} {why}")
    why = capabilities.moe_tp_zero_problem(m, lay.tp, lay.zero, lay.dp * lay.cp)
    need(why is None, f"plan.layout.zero={lay.zero} {why}")
    why = capabilities.cp_problem(t.seq_len, lay.cp, lay.tp)
    need(why is None, f"plan.layout.cp={lay.cp} {why}")
    need(lay.cp_attention in CP_ATTENTIONS, f"plan.layout.cp_attention={lay.cp_attention!r} is not one of "
                                            f"{', '.join(CP_ATTENTIONS)}")
    why = capabilities.cp_attention_problem(m, lay.cp, lay.tp, lay.cp_attention)
    need(why is None, f"plan.layout.cp_attention={lay.cp_attention} with cp={lay.cp}: {why}")
    why = capabilities.ep_problem(m, lay.ep, lay.dp, lay.cp)
    need(why is None, f"plan.layout.ep={lay.ep} {why}")
    why = capabilities.dp_shard_problem(lay.dp_shard_size, lay.dp, lay.cp, lay.zero, lay.ep)
    need(why is None, f"plan.layout.dp_shard={lay.dp_shard} {why}")
    need(lay.micro_batch * lay.grad_accum * lay.dp == t.global_batch,
         f"plan.layout: micro_batch {lay.micro_batch} × grad_accum {lay.grad_accum} × dp {lay.dp} = "
         f"{lay.micro_batch * lay.grad_accum * lay.dp}, but train.global_batch is {t.global_batch}")
    n_stages = lay.pp * lay.virtual_stages
    need(len(plan.stage_layers) == n_stages,
         f"plan.stage_layers has {len(plan.stage_layers)} entries, expected pp·virtual_stages = {n_stages}")
    need(sum(plan.stage_layers) == m.layers,
         f"plan.stage_layers sums to {sum(plan.stage_layers)}, but model.layers is {m.layers}")
    need(all(x >= 0 for x in plan.stage_layers), "plan.stage_layers entries must be >= 0")
    why = capabilities.virtual_stages_problem(lay.schedule, lay.pp, lay.virtual_stages)
    need(why is None, f"plan.layout.virtual_stages={lay.virtual_stages} {why}")
    why = capabilities.compile_problem(m, lay.schedule, lay.tp, lay.recompute) if lay.compile else None
    need(why is None, f"plan.layout.compile: {why}")
    why = capabilities.schedule_problem(lay.schedule, lay.grad_accum, lay.pp)
    need(why is None, f"plan.layout.grad_accum={lay.grad_accum}: schedule {why}")
    why = capabilities.v_tied_problem(lay.schedule, m.tied_embeddings) if lay.pp > 1 else None
    need(why is None, f"plan.model.tied_embeddings: {why}")
    bad = capabilities.split_backward_problem(lay.schedule, lay.zero, lay.recompute, lay.dp * lay.cp) if lay.pp > 1 else None
    need(bad is None, f"plan.layout.{bad[0]}={bad[1]}" if bad else "")


def _dims(plan: Plan) -> list[tuple[str, int, int]]:
    st = strides(plan.degrees, plan.mesh_order)
    return [(d, st[d], plan.degrees[d]) for d in plan.mesh_order]


def plan_json(data: dict[str, Any], indent: int = 2) -> str:
    """JSON text of a plan dict (or of anything holding one under "best"): indented, except that each
    rank column is written on one line, so a 16k-rank plan is small and quick to write and read."""
    slots: list[Any] = []

    def park(plan: Any) -> Any:
        if isinstance(plan, dict) and isinstance(plan.get("ranks"), dict):
            slots.append(plan["ranks"])
            return {**plan, "ranks": f"{_RANKS_SLOT}{len(slots) - 1}"}
        return plan

    top = park(data)
    if top is data and isinstance(data.get("best"), dict):
        top = {**data, "best": park(data["best"]),
               "alternatives": [park(a) for a in data.get("alternatives") or []]}
    text = json.dumps(top, indent=indent, default=str)
    for i, cols in enumerate(slots):
        token = json.dumps(f"{_RANKS_SLOT}{i}")
        if text.count(token) != 1:                      # a user string that looks like the slot: plain JSON
            return json.dumps(data, indent=indent, default=str)
        compact = "{" + ", ".join(f"{json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}"
                                  for k, v in cols.items()) + "}"
        text = text.replace(token, compact, 1)
    return text


def plan_schema() -> dict[str, Any]:
    """JSON Schema of plan.json (format PLAN_VERSION), from the dataclasses that load it."""
    defs: dict[str, Any] = {}
    json_schema(Plan, defs)
    root = defs.pop("Plan")
    defs.pop("RankPlacement", None)
    root["properties"]["ranks"] = {**json_schema(RankColumns, defs),
                                   "description": "the rank map in columns (RankColumns)"}
    root["properties"]["version"] = {"const": PLAN_VERSION, "description": "plan.json format version"}
    root["required"].append("version")
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "launch4d plan.json",
            **root, "$defs": defs}
