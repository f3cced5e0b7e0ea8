"""Planner: search every valid layout, keep what fits, rank by estimated step time.

A layout is tp·cp·pp·dp = world (ep within dp·cp for MoE) × ZeRO stage × recompute mode ×
micro-batch × pipeline schedule (× virtual stages). Memory falls monotonically with ZeRO stage
and recompute (within the replicated ZeRO 0/1 and the sharded ZeRO 2/3 families) and never falls as
the micro-batch grows, so the search stops at the first micro-batch nothing fits and estimates the
lowest fitting stage of each family (the sharded one can be faster: its traffic overlaps compute).
Every layout skipped is counted under the reason it was skipped.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from launcher.errors import UserError
from launcher.formats.bwmap import BandwidthMap, BandwidthMapError
from launcher.plan import capabilities
from launcher.plan import layout as lay_mod
from launcher.plan.costs import Bandwidth, Estimate, advertised_bandwidth, estimate, train_budget
from launcher.plan.explain import describe_layout, nothing_fits
from launcher.plan.layout import stage_layers
from launcher.plan.ledger import (
    Layout,
    MemoryLedger,
    ParamCounts,
    fitting_ledger,
    memory_ledger,
    param_counts,
)
from launcher.plan.model import Plan
from launcher.plan.spec import JobSpec

RECOMPUTE_ORDER = ("none", "selective", "full")
#: Plans whose estimated step time is within this fraction of the fastest count as equal, and the
#: simplest of them wins. It is below the time model's own error: leave-one-source-out median |step-time
#: error| 7.3% Megatron-class, 6.1% eager PyTorch FSDP, the bundled trainer's class (benchmarks/
#: calibrate_costs.py --cv), so plans outside the band are not told apart either: launch plan's
#: uncertainty line (explain.CV_ERROR) names those within the error and `launch plan --benchmark` measures them.
TIE_BAND = 0.05
#: Below this sequence length context parallelism must beat the best plan without it by one more band:
#: no published run below 32k tokens used CP (Llama 3 used it at 128k, torchtitan's sweep starts at
#: 32k), and none checks the model's CP terms there.
CP_SHORT_SEQ = 32768
MAX_VIRTUAL_STAGES = 8


def divisors(n: int) -> list[int]:
    small, large = [], []
    i = 1
    while i * i <= n:
        if n % i == 0:
            small.append(i)
            if i * i != n:
                large.append(n // i)
        i += 1
    return small + large[::-1]


@dataclass
class Candidate:
    layout: Layout
    ledger: MemoryLedger
    estimate: Estimate

    def sort_key(self) -> tuple:
        lay = self.layout
        return (self.estimate.step_time_s, lay.pp, lay.tp, lay.cp, lay.zero,
                RECOMPUTE_ORDER.index(lay.recompute), -lay.micro_batch)

    @functools.cached_property
    def complexity(self) -> tuple:
        """Simpler first: fewer model-parallel dimensions (TP, CP, PP, EP; data parallelism is the
        baseline), less CP, fewer pipeline stages, lower ZeRO stage, one shard group over all of dp (not
        hybrid sharding), smaller TP, fewer chunks, a whole backward (not a split one: the zero-bubble and
        DualPipe-V schedules), less recompute, then more memory headroom."""
        lay, led = self.layout, self.ledger
        dims = sum(d > 1 for d in (lay.tp, lay.cp, lay.pp, lay.ep))
        return (dims, lay.cp, lay.pp, lay.zero, lay.dp_replicas, lay.tp, lay.virtual_stages,
                lay.schedule in capabilities.SPLIT_BACKWARD,
                RECOMPUTE_ORDER.index(lay.recompute), round(led.per_gpu_gb - led.limit_gb, 1))

    def ranked_time(self, seq_len: int) -> float:
        """Step time as ranked: CP below CP_SHORT_SEQ must win by one more band to be chosen."""
        t = self.estimate.step_time_s
        return t * (1 + TIE_BAND) if self.layout.cp > 1 and seq_len < CP_SHORT_SEQ else t


@dataclass
class PlanResult:
    best: Plan | None
    alternatives: list[Plan]
    searched: int
    rejected: dict[str, int]
    bandwidth: Bandwidth
    notes: list[str] = field(default_factory=list)
    choice: dict[str, Any] = field(default_factory=dict)
    budget: dict[str, Any] = field(default_factory=dict)     # time to train and cost, best and alternatives
    calibration: dict[str, Any] = field(default_factory=dict)  # the cluster profile used, if any
    nothing_fits: dict[str, Any] = field(default_factory=dict)  # no plan: how close the nearest came, what would fit
    model: dict[str, Any] = field(default_factory=dict)     # model_summary: where it came from, its parameters

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "best": self.best.to_dict() if self.best else None,
            "alternatives": [p.to_dict() for p in self.alternatives],
            "searched": self.searched,
            "rejected": dict(sorted(self.rejected.items(), key=lambda kv: -kv[1])),
            "bandwidth": self.bandwidth.to_dict(),
            "notes": self.notes,
            "choice": self.choice,
            "budget": self.budget,
            **({"calibration": self.calibration} if self.calibration else {}),
            **({"nothing_fits": self.nothing_fits} if self.nothing_fits else {}),
        }


# --- bandwidth and placement inputs -----------------------------------------------------------

@dataclass
class Cluster:
    """What the planner knows about the machines: counts, bandwidth, hosts, GPU order."""

    nodes: int
    gpus_per_node: int
    bandwidth: Bandwidth
    hosts: list[str] | None = None
    excluded: list[str] = field(default_factory=list)
    gpu_order: list[int] | None = None
    nvlink_groups: list[list[int]] | None = None
    gpu_nic: dict[str, dict[str, str]] = field(default_factory=dict)   # host -> "GPU<i>" -> NIC
    efficiency_max: float | None = None      # cluster.compute_efficiency, else a cluster profile's


def cluster_from(spec: JobSpec, bwmap: BandwidthMap | None, bwmap_name: str | None) -> Cluster:
    c = spec.cluster
    adv = advertised_bandwidth(spec.gpu)
    if c.network_gbs_per_gpu is not None:
        adv = dataclasses.replace(adv, source=adv.source + f"; network {c.network_gbs_per_gpu} GB/s per GPU from the job file")
    if bwmap is None:
        return Cluster(c.nodes, c.gpus_per_node, adv)
    healthy = bwmap.healthy_hosts
    if bwmap.nodes and len(healthy) < c.nodes:
        raise UserError(f"{bwmap_name}: only {len(healthy)} healthy nodes ({len(bwmap.exclude)} excluded) "
                        f"but cluster.nodes is {c.nodes}")
    intra = bwmap.intra_node_busbw_gbs
    inter = bwmap.inter_node_busbw_gbs
    hosts = healthy[: c.nodes] if bwmap.nodes else None
    parts = []
    if intra:
        parts.append(f"intra-node {intra:.1f} GB/s busbw")
    if inter:
        parts.append(f"inter-node {inter:.1f} GB/s busbw (= {inter / c.gpus_per_node:.1f} GB/s per GPU)")
    else:
        rdma = rdma_per_gpu_gbs(bwmap, hosts or [], c.gpus_per_node)
        if rdma:
            inter = rdma * c.gpus_per_node
            parts.append(f"inter-node from per-NIC GPUDirect RDMA (ib_write_bw), slowest node "
                         f"{rdma:.1f} GB/s per GPU")
    source = f"measured in {bwmap_name}: " + ", ".join(parts) if parts else adv.source
    if parts and not (intra and inter):
        source += "; the rest advertised"
    a2a = (bwmap.alltoall_intra_busbw_gbs, bwmap.alltoall_inter_busbw_gbs)
    if any(a2a):
        source += "; all-to-all " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in zip(("intra", "inter"), a2a) if v)
    bw = Bandwidth(intra_gbs=intra or adv.intra_gbs,
                   net_per_gpu_gbs=(inter / c.gpus_per_node) if inter else adv.net_per_gpu_gbs,
                   source=source, alltoall_intra_gbs=a2a[0], alltoall_inter_gbs=a2a[1])
    groups = None
    order = None
    if hosts:
        first = bwmap.nodes[hosts[0]]
        if first.nvlink_groups:
            groups = first.nvlink_groups
            order = lay_mod.gpu_order_from_nvlink_groups(groups, c.gpus_per_node)
    nics = {h: dict(bwmap.nodes[h].gpu_nic) for h in hosts or [] if bwmap.nodes[h].gpu_nic}
    return Cluster(c.nodes, c.gpus_per_node, bw, hosts=hosts, excluded=list(bwmap.exclude),
                   gpu_order=order, nvlink_groups=groups, gpu_nic=nics)


def rdma_per_gpu_gbs(bwmap: BandwidthMap, hosts: list[str], gpus_per_node: int) -> float | None:
    """Per-GPU network bandwidth (GB/s) from preflight's per-NIC `ib_write_bw --use_cuda` figures
    (Gb/s): each node's NICs summed, the slowest node's share per GPU, since a collective over nodes
    runs at its slowest member. Used where no inter-node NCCL figure was measured."""
    totals = [sum(bwmap.nodes[h].rdma_gbps.values()) / 8 for h in hosts if bwmap.nodes[h].rdma_gbps]
    if not totals or len(totals) < len(hosts):
        return None
    return min(totals) / gpus_per_node


def load_bwmap(spec: JobSpec, override: str | None) -> tuple[BandwidthMap | None, str | None]:
    path = override or spec.cluster.bwmap
    if not path:
        return None, None
    try:
        return BandwidthMap.load(path), path
    except BandwidthMapError as exc:
        raise UserError(str(exc)) from None


# --- the search -------------------------------------------------------------------------------

class Search:
    def __init__(self, spec: JobSpec, cluster: Cluster):
        self.spec = spec
        self.cluster = cluster
        self.model = spec.model
        self.train = spec.train
        self.gpu = spec.gpu
        self.par = spec.parallel
        self.counts: ParamCounts = param_counts(spec.model)
        self.world = cluster.nodes * cluster.gpus_per_node
        self.searched = 0
        self.rejected: Counter[str] = Counter()
        self.candidates: list[Candidate] = []
        self.unfit: list[Candidate] = []
        self.mesh_order = tuple(self.par.mesh_order)
        self.fully_fixed = self.par.fully_fixed
        self.attention = capabilities.CP_ATTENTION     # how the layouts being priced cross the cp group
        self.compile = spec.train.compile              # compiled blocks: True, False, None (both priced)

    def reject(self, reason: str, n: int = 1) -> None:
        if n > 0:
            self.searched += n
            self.rejected[reason] += n

    # choices that do not depend on each other
    def tp_choices(self) -> list[int]:
        if self.par.tp is not None:
            return [self.par.tp]
        out = []
        for tp in divisors(self.world):
            why = capabilities.tp_problem(self.model, tp)
            if why:
                self.reject(f"tp {why.split(':')[0]}")
            elif self.cluster.gpus_per_node % tp:
                self.reject("tp does not fit inside a node")
            else:
                out.append(tp)
        return out

    def schedule_choices(self, pp: int) -> list[tuple[str, int]]:
        if pp == 1:
            return [("none", 1)]
        scheds = [self.par.schedule] if self.par.schedule else ["1f1b", "interleaved-1f1b", "gpipe",
                                                                *capabilities.SPLIT_BACKWARD]
        out = []
        for sched in scheds:
            if sched in capabilities.V_SCHEDULES:
                # exactly 2 stages per rank, in a V (capabilities.rank_stages): 2·pp stages of layers
                if capabilities.interleave_problem(self.model.layers, pp, 2):
                    self.reject("layers do not split evenly over 2·pp V stages (ends one fewer)")
                else:
                    out.append((sched, 2))
                continue
            if sched not in ("interleaved-1f1b", "interleaved-zero-bubble"):
                out.append((sched, 1))
                continue
            # an even split, or Llama 3's uneven one: the first and last chunk, which also hold the
            # embedding and the head, one layer fewer, down to none (126 layers on pp 16 × v 8: one
            # layer a chunk, the ends embedding-only and head-only): stage_layers, charged in costs.py
            given = self.par.virtual_stages
            vs = [v for v in ([given] if given is not None else range(2, MAX_VIRTUAL_STAGES + 1))
                  if v == 1 or not capabilities.interleave_problem(self.model.layers, pp, v)]
            if not vs:
                self.reject("layers do not split evenly over pp·virtual_stages (ends one fewer)")
            # interleaved-zero-bubble also runs one stage per rank (ZB-H1's layout in torch's ZB1P order)
            out.extend((sched, v) for v in vs
                       if v > 1 or self.par.virtual_stages is not None or sched == "interleaved-zero-bubble")
        return out

    def run(self) -> None:
        p, m, t = self.par, self.model, self.train
        for tp in self.tp_choices():
            rest = self.world // tp
            for cp in ([p.cp] if p.cp is not None else divisors(rest)):
                if capabilities.cp_problem(t.seq_len, cp, tp):
                    self.reject("seq_len not divisible by 2·cp·tp")
                    continue
                for pp in ([p.pp] if p.pp is not None else divisors(rest // cp)):
                    if pp > m.layers:
                        self.reject("pp exceeds layers")
                        continue
                    if rest % (cp * pp):
                        self.reject("degrees do not multiply to the world size")
                        continue
                    dp = rest // (cp * pp)
                    if p.dp is not None and dp != p.dp:
                        self.reject("dp differs from parallel.dp")
                        continue
                    if t.global_batch % dp:
                        self.reject("global_batch not divisible by dp")
                        continue
                    for ep in self.ep_choices(dp, cp):
                        start = len(self.candidates)
                        for att in self.attention_choices(tp, cp):
                            self.attention = att
                            self.layouts(tp, cp, pp, dp, ep)
                        self.keep_faster_attention(start)

    def attention_choices(self, tp: int, cp: int) -> list[str]:
        """How attention crosses the cp group: parallel.cp_attention, else both all-gather and all-to-all where the
        heads split over cp (capabilities.cp_attention_problem); at cp 1 nothing crosses (the default)."""
        if cp == 1:
            return [capabilities.CP_ATTENTION]
        out = []
        for att in [self.par.cp_attention] if self.par.cp_attention else capabilities.CP_ATTENTIONS:
            if capabilities.cp_attention_problem(self.model, cp, tp, att):
                self.reject("all-to-all CP: heads or kv heads per TP rank do not split over cp")
            else:
                out.append(att)
        return out

    def keep_faster_attention(self, start: int) -> None:
        """Of the candidates from `start` on, of two that differ only in cp_attention the faster estimate: their
        compute and memory plan are the same but for the CP term, so the time model's own error (TIE_BAND), which
        lets the simpler of two layouts win, does not decide between them; the slower counts as dominated."""
        kept: dict[Layout, Candidate] = {}
        for c in self.candidates[start:]:
            key = dataclasses.replace(c.layout, cp_attention=capabilities.CP_ATTENTION)
            if key not in kept or c.estimate.step_time_s < kept[key].estimate.step_time_s:
                kept[key] = c
        dropped = len(self.candidates) - start - len(kept)
        if dropped:
            self.candidates[start:] = list(kept.values())
            self.rejected["slower than the same layout with the other cp_attention"] += dropped

    def ep_choices(self, dp: int, cp: int) -> list[int]:
        if self.par.ep is not None:
            if (dp * cp) % self.par.ep:
                self.reject("ep does not divide dp·cp")
                return []
            return [self.par.ep]
        if not self.model.is_moe:
            return [1]
        return [e for e in divisors(self.model.experts) if (dp * cp) % e == 0]

    def layouts(self, tp: int, cp: int, pp: int, dp: int, ep: int) -> None:
        p, t = self.par, self.train
        mbs = [p.micro_batch] if p.micro_batch is not None else divisors(t.global_batch // dp)
        zeros = [p.zero] if p.zero is not None else (list(capabilities.ZERO_STAGES) if dp * cp > 1 else [0])
        if self.model.is_moe and tp > 1:
            zeros = [z for z in zeros if capabilities.moe_tp_zero_problem(self.model, tp, z, dp * cp) is None]
        recomputes = [p.recompute] if p.recompute else list(RECOMPUTE_ORDER)
        shards = self.dp_shard_choices(tp, cp, pp, dp, ep, zeros)
        per_mb = sum(len(zs) for _, zs in shards) * len(recomputes)
        for sched, v in self.schedule_choices(pp):
            # a split-backward schedule runs no ZeRO 3 over FSDP and no recompute
            # (capabilities.split_backward_problem)
            rcs = [rc for rc in recomputes if not capabilities.split_backward_problem(sched, 0, rc, dp * cp)]
            sched_shards = [(ds, kept) for ds, zs in shards
                            if (kept := [z for z in zs
                                         if not capabilities.split_backward_problem(sched, z, "none", dp * cp)])]
            per = sum(len(zs) for _, zs in sched_shards) * len(rcs)
            if per < per_mb:
                self.reject("a split-backward schedule runs no ZeRO 3 over FSDP and no recompute",
                            (per_mb - per) * len(mbs))
            if not per:
                continue
            # memory never falls as the micro-batch grows (1F1B holds min(m, p)·b sequences, GPipe
            # all b·m) nor as recompute or the ZeRO stage drops: once the least memory-hungry choice
            # (most recompute, highest stage) does not fit, larger micro-batches are skipped
            too_big: set[str] = set()
            for i, mb in enumerate(mbs):
                if (t.global_batch // dp) % mb:
                    self.reject("global_batch not divisible by dp·micro_batch", per)
                    continue
                ga = t.global_batch // (dp * mb)
                if pp > 1 and sched in ("1f1b", "interleaved-1f1b") and ga < pp:
                    self.reject("micro-batches < pipeline stages", per)
                    continue
                if sched == "gpipe" and ga >= pp and p.schedule is None:
                    # the same bubble and traffic as 1F1B, holding all m micro-batches instead of p
                    self.reject("gpipe dominated by 1f1b (same time, more memory)", per)
                    continue
                if sched in ("interleaved-1f1b", "interleaved-zero-bubble") and \
                        capabilities.schedule_problem(sched, ga, pp):
                    # torch's Interleaved1F1B / InterleavedZeroBubble: micro-batches a multiple of max(1, m // pp)
                    self.reject("interleaved schedules need micro-batches a multiple of max(1, m // pp)", per)
                    continue
                if sched == "dualpipe-v" and capabilities.schedule_problem(sched, ga, pp):
                    self.reject("dualpipe-v needs micro-batches >= 2·pp", per)
                    continue
                if len(too_big) == len(rcs):
                    self.reject("does not fit in GPU memory", per * (len(mbs) - i))
                    break
                for rc in reversed(rcs):      # least memory first
                    if rc in too_big:
                        self.reject("does not fit in GPU memory", len(zeros))
                    elif not any([self.fitting_zeros(tp, cp, pp, dp, ep, zs, rc, mb, ga, sched, v, ds)
                                  for ds, zs in sched_shards]):
                        too_big.add(rc)
                        too_big.update(rcs[:rcs.index(rc)])    # less recompute needs more

    def dp_shard_choices(self, tp: int, cp: int, pp: int, dp: int, ep: int,
                         zeros: list[int]) -> list[tuple[int | None, list[int]]]:
        """(dp_shard, the ZeRO stages it goes with) to price: sharding over all of dp (None, every stage), and
        hybrid sharding over the shard group the cluster's topology offers inside one node — the largest
        dp_shard whose dp_shard·cp ranks sit on one node (NVLink), replicated across nodes — for ZeRO 1-3
        (parallel.dp_shard fixes it). The bandwidth map has no level between a node and the whole cluster
        (racks, rails), so a rack-sized group is not searched; set parallel.dp_shard for one."""
        fixed = self.par.dp_shard
        hybrid = [z for z in zeros if z >= 1]
        if fixed is not None:
            if dp % fixed:
                self.reject("dp_shard does not divide dp")
                return []
            if fixed == dp:
                return [(None, zeros)]
            why = capabilities.dp_shard_problem(fixed, dp, cp, 1, ep)
            if why:
                self.reject(f"dp_shard {why.split(';')[0].split(' (')[0]}")
                return []
            return [(fixed, hybrid)] if hybrid else []
        out: list[tuple[int | None, list[int]]] = [(None, zeros)]
        if not hybrid or ep > 1 or self.cluster.nodes == 1:
            return out
        st = lay_mod.strides({"tp": tp, "cp": cp, "pp": pp, "dp": dp}, self.mesh_order)
        span = max(st["dp"], st["cp"] * cp if cp > 1 else 1)     # the ranks one dp index covers with its cp
        node = [d for d in divisors(dp) if d < dp and d * cp > 1 and self.cluster.gpus_per_node % (d * span) == 0]
        if node:
            out.append((node[-1], hybrid))
        return out

    def fitting_zeros(self, tp, cp, pp, dp, ep, zeros, rc, mb, ga, sched, v, dp_shard=None) -> bool:
        """Estimate the lowest fitting stage of each family: replicated (ZeRO 0/1, reduced after
        backward, unhidden) and FSDP (ZeRO 2/3, overlapped), since either can be the faster. Within a
        family time does not fall with the stage (ZeRO 1 adds a gather to 0's all-reduce, ZeRO 3
        gathers more than 2 with as much overlap): the stages above the lowest that fits count as
        dominated, and are not priced. Memory mostly falls with the stage, not always: ZeRO 3's
        prefetch of the next block can outweigh what it reshards (llama3-405b on pp 64, two layers a
        stage: 72.5 GB against ZeRO 2's 71.7). Across the families it need not fall either: under PP
        torch's pipelining keeps ZeRO 2/3 gradients and parameters whole, which at a small dp·cp
        outweighs ZeRO 1's fp32 copies."""
        headroom = self.spec.cluster.memory_headroom
        if self.compile and capabilities.compile_problem(self.model, sched, tp, rc):
            self.reject("compiled blocks (train.compile) do not run with this schedule or recompute", len(zeros))
            return True       # refused, not too big: the memory walk goes on to less recompute
        ledgers: dict[int, MemoryLedger | None] = {}

        def lay_of(z: int) -> Layout:
            return Layout(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, zero=z, recompute=rc, micro_batch=mb,
                          grad_accum=ga, schedule=sched, virtual_stages=v, dp_shard=dp_shard,
                          cp_attention=self.attention, compile=bool(self.compile))

        def fits(z: int) -> bool:
            if z not in ledgers:             # the ledger only where it fits: most layouts here do not
                ledgers[z] = fitting_ledger(self.model, self.train, self.gpu, lay_of(z), headroom)
            return ledgers[z] is not None

        chosen = []
        for family in ([z for z in zeros if z < 2], [z for z in zeros if z >= 2]):
            first = next((i for i, z in enumerate(family) if fits(z)), None)
            if first is None:
                self.reject("does not fit in GPU memory", len(family))
                continue
            self.reject("does not fit in GPU memory", first)
            self.reject("dominated by a lower ZeRO stage that fits", len(family) - first - 1)
            chosen.append(family[first])
        if not chosen:
            if self.fully_fixed:
                lay = lay_of(zeros[0])
                full = memory_ledger(self.model, self.train, self.gpu, lay, headroom)
                self.unfit.append(Candidate(lay, full, self.estimate(lay)))
            return False
        for z in chosen:
            lay = lay_of(z)
            fit = ledgers[z]
            assert fit is not None               # chosen stages fit
            self.searched += 1
            self.candidates.append(self.compile_choice(lay, fit))
        return True

    def compile_choice(self, lay: Layout, fit: MemoryLedger) -> Candidate:
        """The layout with eager or compiled blocks, train.compile's; unset, the faster of the two where compile
        runs (capabilities.compile_problem). They differ only in the blocks' elementwise time (costs.compiled_elementwise)
        and their ledger, so the time model's error band does not decide between them; a tie keeps eager blocks (on
        the cpu preset nothing is gained). The other counts as dominated."""
        eager = Candidate(lay, fit, self.estimate(lay))
        if self.compile is not None or capabilities.compile_problem(self.model, lay.schedule, lay.tp, lay.recompute):
            return eager
        c = dataclasses.replace(lay, compile=True)
        c_fit = fitting_ledger(self.model, self.train, self.gpu, c, self.spec.cluster.memory_headroom)
        compiled = Candidate(c, c_fit, self.estimate(c)) if c_fit is not None else None
        if compiled is not None and compiled.estimate.step_time_s < eager.estimate.step_time_s:
            self.reject("slower with eager blocks than compiled (train.compile)")
            return compiled
        self.reject("no faster with compiled blocks (train.compile)")
        return eager

    def estimate(self, lay: Layout) -> Estimate:
        return estimate(self.model, self.train, self.gpu, lay, self.cluster.bandwidth,
                        self.cluster.gpus_per_node, self.mesh_order, self.counts,
                        self.cluster.efficiency_max)


# --- from candidate to Plan -----------------------------------------------------------------------

def warnings_for(spec: JobSpec, cand: Candidate, cluster: Cluster, tp_local: bool) -> list[str]:
    lay, led, est = cand.layout, cand.ledger, cand.estimate
    out = []
    if not tp_local:
        out.append(f"TP group of {lay.tp} spans nodes: its {est.tp_comm_s:.3f} s/step of TP traffic runs at "
                   f"{cluster.bandwidth.net_per_gpu_gbs:.0f} GB/s per GPU instead of "
                   f"{cluster.bandwidth.intra_gbs:.0f} GB/s over NVLink")
    if cluster.nvlink_groups and not lay_mod.tp_blocks_on_nvlink(cluster.gpu_order or [], cluster.nvlink_groups, lay.tp):
        out.append(f"TP groups of {lay.tp} cannot all sit on NVLink-connected GPUs "
                   f"(NVLink islands {cluster.nvlink_groups}); TP traffic crosses PCIe")
    if led.logits_unchunked_gb > 0.1 * led.capacity_gb:
        out.append(f"unchunked logits s·b·V would take {led.logits_unchunked_gb:.1f} GB per GPU; the loss is "
                   f"computed in chunks of {spec.train.loss_chunk} tokens ({led.logits_gb:.2f} GB)")
    if lay.pp > 1:
        m = lay.grad_accum
        if m < lay.pp:
            out.append(f"{m} micro-batches < {lay.pp} pipeline stages: stages idle and a schedule may hang")
        elif m < 4 * lay.pp:
            out.append(f"{m} micro-batches < 4 × {lay.pp} stages: bubble {est.bubble_fraction:.1%} of compute "
                       "(raise global_batch or lower pp)")
    shard = lay.dp * lay.cp
    if lay.pp > 1 and lay.zero >= 2 and shard > 1:
        # torch's pipelining turns FSDP's gradient reduce-scatter (and ZeRO 3's reshard after backward) off
        # until a stage's last micro-batch: its gradients accumulate unsharded in the fp32 reduce dtype
        out.append(f"ZeRO {lay.zero} under pipeline parallelism: torch's pipelining keeps each stage's gradients "
                   f"unsharded in fp32 until its last micro-batch ({led.grads_gb:.1f} GB per GPU here, not "
                   f"1/{shard} of it); ZeRO 1 shards optimizer state only but keeps gradients in bf16")
    unsharded = led.params_gb + (led.grads_gb if lay.zero < 2 else 0.0)
    what = "params+grads" if lay.zero < 2 else "params"
    if shard > 1 and lay.zero < 3 and unsharded > 0.25 * led.capacity_gb:
        out.append(f"ZeRO stage {lay.zero} leaves {unsharded:.1f} GB of {what} unsharded per GPU: adding GPUs "
                   "will not shrink it (ZeRO 3 would)")
    if not led.fits:
        out.append(f"does not fit: {led.per_gpu_gb:.1f} GB needed per GPU, {led.limit_gb:.1f} GB allowed "
                   f"({led.capacity_gb:.0f} GB less {led.headroom:.0%} headroom)")
    return out


def to_plan(spec: JobSpec, cand: Candidate, cluster: Cluster, with_ranks: bool = True) -> Plan:
    lay = cand.layout
    degrees = lay.degrees
    order = list(spec.parallel.mesh_order)
    ranks = lay_mod.placements(degrees, order, cluster.gpus_per_node, cluster.gpu_order) if with_ranks else []
    if cluster.hosts and cluster.gpu_nic:
        for r in ranks:
            r.nic = cluster.gpu_nic.get(cluster.hosts[r.node], {}).get(f"GPU{r.gpu}")
    tp_groups = lay_mod.groups(degrees, order, "tp")
    tp_local = lay_mod.groups_node_local(tp_groups, cluster.gpus_per_node)
    bandwidth = cluster.bandwidth.to_dict()
    if cluster.excluded:
        bandwidth["excluded_nodes"] = list(cluster.excluded)
    return Plan(
        name=spec.name, world_size=lay.world, nodes=cluster.nodes, gpus_per_node=cluster.gpus_per_node,
        layout=lay, mesh_order=order, ranks=ranks, stage_layers=stage_layers(spec.model.layers, lay.pp * lay.virtual_stages),
        fits=cand.ledger.fits, memory=cand.ledger.to_dict(), estimate=cand.estimate.to_dict(),
        bandwidth=bandwidth, warnings=warnings_for(spec, cand, cluster, tp_local),
        model=spec.model, train=spec.train, gpu=spec.gpu, diagnostics=spec.diagnostics,
        hosts=cluster.hosts, gpu_order=cluster.gpu_order, tp_node_local=tp_local,
        forced=spec.parallel.allow_cross_node_tp and not tp_local,
        cluster=spec.cluster, backend=spec.backend,
    )


def order_candidates(candidates: list[Candidate], seq_len: int) -> tuple[list[Candidate], int]:
    """Candidates in the order the planner prefers them, and how many lead as equals: those within
    TIE_BAND of the fastest, simplest first; then the rest by step time."""
    ordered = sorted(candidates, key=lambda c: (c.ranked_time(seq_len),) + c.sort_key())
    if not ordered:
        return [], 0
    limit = ordered[0].ranked_time(seq_len) * (1 + TIE_BAND)
    band = [c for c in ordered if c.ranked_time(seq_len) <= limit]
    band.sort(key=lambda c: (c.complexity, c.estimate.step_time_s))
    return band + ordered[len(band):], len(band)


def why_chosen(best: Candidate, ordered: list[Candidate], band: int, seq_len: int = 0,
               fixed: tuple[str, ...] = ()) -> dict[str, Any]:
    """Why the chosen plan won, as the rule that decided it and its numbers: the fastest estimate; or a
    faster plan within TIE_BAND (the time model's error) lost to a simpler one; or a faster plan with CP
    below CP_SHORT_SEQ tokens, charged one more band, lost; or the job file fixed the layout. Then the
    fastest strictly simpler layout it beat, by how much and on which cost terms. `line` is the sentence."""
    t_best = best.estimate.step_time_s
    out: dict[str, Any] = {"band": TIE_BAND, "equal_plans": band,
                           "fastest_step_s": round(min(c.estimate.step_time_s for c in ordered[:band]), 6)}
    fastest = min(ordered, key=lambda c: (c.estimate.step_time_s,) + c.sort_key())
    t_fast = fastest.estimate.step_time_s
    fixed_note = (f" (the job file fixed {', '.join(fixed)}; the rest was searched)" if fixed else "")
    if len(ordered) == 1 and fixed:
        out.update(rule="forced", fixed=list(fixed))
        line = (f"forced: the job file's parallel section fixed {', '.join(fixed)}, which leaves this one "
                f"layout ({t_best:.3f} s); nothing was chosen")
    elif fastest is best or t_fast >= t_best:
        out.update(rule="fastest")
        charged = (f", though with context parallelism below {CP_SHORT_SEQ // 1024}k tokens (seq_len {seq_len}) it "
                   f"was counted a further {TIE_BAND:.0%} slower ({best.ranked_time(seq_len):.3f} s)"
                   if best.layout.cp > 1 and seq_len < CP_SHORT_SEQ else "")
        line = (f"the fastest estimate ({t_best:.3f} s){charged}"
                + (f"; of the {band} plans within {TIE_BAND:.0%} of it (the time model's error) none is simpler"
                   if band > 1 else f"; no other plan is within {TIE_BAND:.0%} of it") + fixed_note)
    else:
        faster_by = t_best / t_fast - 1
        how = _simpler_how(best, fastest)
        anchor = min(ordered[:band], key=lambda c: c.ranked_time(seq_len))
        limit = anchor.ranked_time(seq_len) * (1 + TIE_BAND)
        out.update(fastest=describe_layout(fastest.layout), fastest_faster_by=round(faster_by, 4),
                   band_limit_s=round(limit, 6))
        tie = (f"plans within {TIE_BAND:.0%} of the fastest (the time model's error)"
               + f", up to {limit:.3f} s, count as equal, and this "
               f"plan ({t_best:.3f} s) is the simplest of those {band} ({how})")
        if fastest.layout.cp > 1 and seq_len < CP_SHORT_SEQ and t_best > t_fast * (1 + TIE_BAND):
            counted = fastest.ranked_time(seq_len)
            out.update(rule="cp_short_seq", penalty=TIE_BAND, counted_step_s=round(counted, 6))
            line = (f"the fastest estimate, {describe_layout(fastest.layout)} ({t_fast:.3f} s), is {faster_by:.1%} faster, "
                    f"but it uses context parallelism below {CP_SHORT_SEQ // 1024}k tokens (seq_len {seq_len}), "
                    f"which must win by a further {TIE_BAND:.0%} (counted as {counted:.3f} s); then " + tie
                    + fixed_note)
        else:
            out.update(rule="tie_band")
            line = (f"the fastest estimate, {describe_layout(fastest.layout)} ({t_fast:.3f} s), is only {faster_by:.1%} "
                    f"faster: " + tie + fixed_note)
    # the fastest strictly simpler layout, outside the band (the band is sorted simplest first)
    other = next((c for c in ordered[band:] if c.complexity[:6] < best.complexity[:6]), None)
    if other is None:
        if out["rule"] != "forced" and (best.complexity[0] or best.layout.zero):
            line += ". No simpler layout fits in GPU memory"
        out["reason"] = line
        out["line"] = line + "."
        return out
    mine, theirs = best.estimate.terms(), other.estimate.terms()
    diffs = sorted(((k, theirs[k] - mine[k]) for k in mine), key=lambda kv: -abs(kv[1]))
    slower = other.estimate.step_time_s / t_best - 1
    terms = ", ".join(f"{k} {d:+.3g} s" for k, d in diffs[:3] if abs(d) > 1e-9)
    out["simpler"] = describe_layout(other.layout)
    out["simpler_slower_by"] = round(slower, 4)
    line += (f". It beats the simpler {describe_layout(other.layout)} ({other.estimate.step_time_s:.3f} s, outside the "
             f"band) by "
             f"{slower:.1%} ({terms} there)")
    out["reason"] = line
    out["line"] = line + "."
    return out


def _simpler_how(best: Candidate, other: Candidate) -> str:
    """In what way `best` is simpler than `other`: the first term of Candidate.complexity they differ in."""
    a, b = best.complexity, other.complexity
    la, lb = best.layout, other.layout

    def dims(lay: Layout) -> str:
        names = [n for n in ("tp", "cp", "pp", "ep") if getattr(lay, n) > 1]
        return ", ".join(names) or "none"

    words = [f"fewer model-parallel dimensions: {dims(la)} against {dims(lb)}", f"less CP: cp={la.cp} against {lb.cp}",
             f"fewer pipeline stages: pp={la.pp} against {lb.pp}", f"a lower ZeRO stage: {la.zero} against {lb.zero}",
             f"fewer shard-group replicas (hybrid sharding): {la.dp_replicas} against {lb.dp_replicas}",
             f"smaller TP: tp={la.tp} against {lb.tp}",
             f"fewer chunks: v={la.virtual_stages} against {lb.virtual_stages}",
             f"less recompute: {la.recompute} against {lb.recompute}", "more memory headroom"]
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(words) - 1)
    return words[min(i, len(words) - 1)]


def forced_choice(fixed: tuple[str, ...], ledger: MemoryLedger) -> dict[str, Any]:
    """The why of a fixed layout that does not fit: it was forced, and by how much it is over."""
    line = (f"forced: the job file's parallel section fixed {', '.join(fixed)}; this layout does not fit: "
            f"{ledger.per_gpu_gb:.1f} GB needed per GPU, {ledger.limit_gb:.1f} GB allowed.")
    return {"rule": "forced", "fixed": list(fixed), "fits": False, "reason": line, "line": line}


def fixed_fields(spec: JobSpec) -> tuple[str, ...]:
    """The parallel fields the job file fixed (None: searched)."""
    p = spec.parallel
    return tuple(k for k in ("tp", "cp", "pp", "dp", "ep", "zero", "recompute", "micro_batch", "schedule",
                             "virtual_stages", "dp_shard", "cp_attention") if getattr(p, k) is not None)


def plan_job(spec: JobSpec, bwmap: BandwidthMap | None = None, top: int = 5,
             bwmap_name: str | None = None, ranks_for: int = 1) -> PlanResult:
    """_plan_job's result with the model's summary (model_summary)."""
    result = _plan_job(spec, bwmap, top, bwmap_name, ranks_for)
    result.model = model_summary(spec.model)
    return result


def model_summary(model) -> dict[str, Any]:
    """Where the model came from and its parameter count (the model's own vocabulary, unpadded): total,
    and for a mixture of experts the parameters each token uses (embedding and head included)."""
    from launcher.plan.ledger import param_counts

    c = param_counts(model)
    out: dict[str, Any] = {"source": model.preset, "params": c.total}
    if model.experts > 1:
        out["active_params"] = c.active(model.experts_per_token)
    return out


def _plan_job(spec: JobSpec, bwmap: BandwidthMap | None, top: int, bwmap_name: str | None,
              ranks_for: int) -> PlanResult:
    """Search layouts for `spec`; the best Plan (or the fixed one, fitting or not) and alternatives.
    Only the first `ranks_for` plans carry per-rank records (what a launch needs; the best by default)."""
    if bwmap is None and spec.cluster.bwmap:
        bwmap, bwmap_name = load_bwmap(spec, None)
    cluster = cluster_from(spec, bwmap, bwmap_name or "bandwidth map")
    cluster.efficiency_max = spec.cluster.compute_efficiency
    notes = [f"model: {n}" for n in spec.notes] + [f"bandwidth: {cluster.bandwidth.source}"]
    calibration = apply_profile(spec, cluster, notes)
    search = Search(spec, cluster)
    search.run()
    ranked, band = order_candidates(search.candidates, spec.train.seq_len)
    if not ranked:
        if search.unfit:
            forced = min(search.unfit, key=lambda c: c.ledger.per_gpu_gb)
            notes.append("the fixed layout does not fit in GPU memory")
            return PlanResult(to_plan(spec, forced, cluster), [], search.searched, dict(search.rejected),
                              cluster.bandwidth, notes, forced_choice(fixed_fields(spec), forced.ledger),
                              calibration=calibration)
        return PlanResult(None, [], search.searched, dict(search.rejected), cluster.bandwidth, notes,
                          calibration=calibration, nothing_fits=nothing_fits(spec, cluster, search, Search))
    best = ranked[0]
    choice = why_chosen(best, ranked, band, spec.train.seq_len, fixed_fields(spec))
    notes.append(f"why: {choice['line']}")
    seen = {_shape(best.layout)}
    alts: list[Plan] = []
    for cand in ranked[1:]:
        if len(alts) >= top:
            break
        if _shape(cand.layout) in seen:
            continue
        seen.add(_shape(cand.layout))
        alts.append(to_plan(spec, cand, cluster, with_ranks=len(alts) + 1 < ranks_for))
    best_plan = to_plan(spec, best, cluster)
    return PlanResult(best_plan, alts, search.searched, dict(search.rejected), cluster.bandwidth, notes, choice,
                      budget_of(spec, [best_plan] + alts), calibration)


def apply_profile(spec: JobSpec, cluster: Cluster, notes: list[str]) -> dict[str, Any]:
    """Put a cluster profile's fitted figures (cluster.profile, from `launch calibrate`) in place; what
    the plan reports about it (empty without one). cluster.compute_efficiency in the job file wins."""
    if not spec.cluster.profile:
        return {}
    from launcher.plan.profile import ClusterProfile

    prof = ClusterProfile.load(spec.cluster.profile)
    prof.check(spec.gpu, spec.cluster.gpus_per_node)
    cluster.bandwidth = prof.bandwidth(cluster.bandwidth)
    fitted_ce = prof.params.get("compute_efficiency")
    overridden = fitted_ce is not None and spec.cluster.compute_efficiency is not None
    if fitted_ce is not None and not overridden:
        cluster.efficiency_max = fitted_ce
    line = f"calibrated cluster profile {prof.path}: {prof.summary()}"
    if overridden:
        line += f"; cluster.compute_efficiency {spec.cluster.compute_efficiency} in the job file replaces its ceiling"
    notes.append(line)
    return {"profile": prof.path, "params": prof.params, "runs": len(prof.runs), "line": line}


def budget_of(spec: JobSpec, plans: list[Plan]) -> dict[str, Any]:
    """Wall time, GPU-hours and (with cluster.price_per_gpu_hour) cost of the whole run for each plan."""
    t = spec.train
    per = [train_budget(p.estimate["step_time_s"], t.steps, p.world_size, t.global_batch * t.seq_len,
                        spec.cluster.price_per_gpu_hour) for p in plans]
    return {"source": "train.tokens" if t.tokens is not None else "train.steps", "best": per[0],
            "alternatives": per[1:]}


def _shape(lay: Layout) -> tuple:
    """Alternatives differ in their degrees, not only in micro-batch or ZeRO details."""
    return (lay.tp, lay.cp, lay.pp, lay.dp, lay.ep, lay.dp_shard_size)
