"""Time model: compute from model FLOPs at a size-dependent efficiency, plus the communication the
bundled trainer really issues (TP, CP, PP, DP/ZeRO, EP), each collective charged latency + volume
at the bandwidth of the links its group spans, and hidden only where the trainer overlaps it.

FLOP conventions (Korthikanti et al., Narayanan et al.): a layer's forward pass is 2 FLOPs per
parameter-token in its matmuls plus 4·b·s²·h for the attention scores and their product with V
(causal masking not discounted, as in the papers); the logits add 2·b·s·h·V. Model FLOPs (MFU) are
3× the forward. Hardware FLOPs (HFU) add what recompute repeats: a whole forward of every layer for
full recompute; for selective, the attention core in Megatron's sense (the bundled trainer's op-level
selective keeps every matmul's and SDPA's output and repeats only elementwise work, which is not
counted in FLOPs: STACKS[...].selective_attention_recompute). For a 4h GELU MLP with MHA this is exactly
72·B·L·s·h²·(1 + s/6h + V/12hL).

Collectives: a ring all-gather or reduce-scatter over g ranks takes (g-1)·alpha + N·(g-1)/g / busbw,
an all-reduce twice that (nccl-tests busbw semantics). Without a BandwidthMap, intra-node busbw is
the advertised NVLink figure (bidirectional) halved, times NVLINK_EFFICIENCY; the per-GPU network
figure times NET_EFFICIENCY. A group with k GPUs on each of n > 1 nodes runs at min(intra, k·net).

What the bundled trainer communicates, and where it overlaps (launcher/trainer, read from the code):
- ZeRO 0/1 (dist_optim.py): gradients packed into fp32 buckets of 32M elements once per step, after
  the last backward, and all-reduced (ZeRO 0) or reduce-scattered into each rank's even shard (ZeRO
  1), whose updated bf16 weights are then all-gathered: nothing overlaps either.
- ZeRO 2 (`fully_shard`, reshard_after_forward=False): outside PP every micro-batch all-gathers the
  parameters in forward and reduce-scatters fp32 gradients after its backward; under PP torch's
  pipelining keeps gradients unsharded until the last micro-batch (one all-gather, one
  reduce-scatter per step). FSDP2 prefetches the next block's all-gather and runs reduce-scatters on
  their own stream: overlap with the compute running at the same time (STACKS[...].fsdp_overlap).
- ZeRO 3 (reshard_after_forward=True): outside PP, all-gather in forward and again in backward, and
  a reduce-scatter, every micro-batch; under PP one all-gather per forward and per backward that
  follows a forward, and one reduce-scatter per step.
- Hybrid sharding (parallel.dp_shard < dp): the ZeRO 1-3 traffic above inside the dp_shard·cp shard group,
  at that group's bandwidth, plus the sharded gradients all-reduced across the dp / dp_shard replicas once per
  step at theirs (replica_traffic).
- CP (context_parallel.py): per layer, K and V all-gathered in forward and their gradients
  reduce-scattered in backward (again in forward under full recompute), synchronously: nothing
  hides it. Each rank's two query chunks (head/tail balanced) then attend to the keys up to
  themselves with `is_causal` / `causal_lower_right` SDPA, no mask tensor, so on GPUs the kernel
  skips the causal upper triangle and a rank does exactly 1/cp of the causal work
  (cp_attention_factor 1; CPU kernels take a mask, but plans are for GPUs).
  All-to-all CP (parallel.cp_attention, DeepSpeed-Ulysses): per layer 4 all-to-alls forward (q, k, v, the
  output), as many backward, again under recompute, at the all-to-all bandwidth; square causal SDPA on a
  head group of the whole sequence, 1/cp of the causal work.
- TP (sequence parallel): per layer 2 all-gathers + 2 reduce-scatters forward, as many backward, and the
  sequence-parallel linears, which keep only their input's sequence shard, all-gather it again in backward
  (2 more, Stack.sp_regathers); full recompute repeats the forward's 4: 10 a layer, 14 under full.
- What is hidden still costs: the compute beside a hidden collective runs slower (its kernels hold SMs and HBM
  bandwidth), OVERLAP_SLOWDOWN of each second hidden, in the DP/ZeRO and CP terms.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from functools import lru_cache

from launcher.plan.capabilities import SPLIT_BACKWARD, rank_stages
from launcher.plan.fp8 import fp8_terms
from launcher.plan.kernels import FLASH_BACKWARD, kernels
from launcher.plan.layout import stage_layers, strides
from launcher.plan.ledger import Layout, ParamCounts, param_counts, ulysses_kv_width
from launcher.plan.schedules import bubble_fraction as schedule_bubble

# --- calibration constants (fitted in benchmarks/calibrate_costs.py; errors printed there) -------
#: Fraction of the advertised per-direction NVLink bandwidth an all-reduce reaches (nccl-tests: ~370-480
#: GB/s busbw on 450 GB/s per direction).
NVLINK_EFFICIENCY = 0.8
#: Fraction of the NIC line rate NCCL reaches (46-48 GB/s on a 50 GB/s NDR port).
NET_EFFICIENCY = 0.92
#: Elements per ZeRO 0/1 gradient bucket (dist_optim.BUCKET_ELEMS).
GRAD_BUCKET_ELEMS = 1 << 25
#: A collective hidden behind compute is not free: its kernels hold SMs and HBM bandwidth the compute running
#: beside it would use. Lee et al. 2025 (arXiv 2507.03114, abstract: GPT and Llama training steps on 4 A100s and
#: H100s) measure the compute overlapped with communication "an average computational slowdown of 18.9%" against the
#: same compute alone; charged per second of communication hidden at the node's NVLink rate (estimate's contention).
OVERLAP_SLOWDOWN = 0.189


@dataclass(frozen=True)
class Stack:
    """How one software stack executes a layout: the parts of the time model that differ by stack.
    The planner charges the bundled trainer; the others exist so the calibration can compare the
    model with published runs of those stacks without pretending they run like ours."""

    name: str
    efficiency_max: float        # fitted factor on the kernel-level compute time (kernels.py): 1 = the kernels' rate
    fsdp_overlap: float          # share of the concurrent compute ZeRO 2/3 traffic can hide behind
    grad_sync_overlap: float     # fraction of the ZeRO 0/1 gradient reduction hidden behind backward
    cp_overlap: float            # fraction of the CP K/V exchange hidden behind attention
    cp_attention_factor: float   # attention time multiplier under CP
    zero2_sync_per_microbatch: bool  # FSDP2 outside PP; Megatron accumulates into its grad buffer
    zero1_allreduce: bool        # ZeRO 1 all-reduces gradients (not reduce-scatters) before the sharded step
    dp_collectives_per_layer: float   # separate DP collectives per layer and pass (the latency count)
    alpha_s: float               # latency per ring step of a collective
    grad_reduce_bytes: float          # bytes per gradient element reduced
    selective_matmul_recompute: float = 0.0   # share of the matmul forward that selective recompute repeats
    selective_attention_recompute: float = 1.0   # share of the attention core it repeats (Megatron's: all)
    selective_elementwise_recompute: float | None = None   # share of the forward's elementwise work it repeats
                                                           # (None: the matmuls' share)
    sp_regathers: bool = False        # TP's linears keep the sequence shard and all-gather it again in backward
    replicated_param_bytes: float = 2.0       # bytes per parameter ZeRO 1 gathers back (replicated state)
    dp_per_gpu_nic: bool = False      # DP collectives across nodes reach one NIC's bandwidth per GPU, not k·NIC
    ceiling_by_generation: tuple[tuple[str, float], ...] = ()   # efficiency_max per GPU generation, where it differs
    elementwise_passes: float = 12.0  # bf16 hidden-size passes per token and layer (fwd+bwd) of memory-bound ops,
                                      # a GPT block's; other blocks scale by their counted traffic (elementwise_width)
    norm_passes: float = 2.0          # elements a norm moves per input element, forward (2: one fused kernel)
    rope_passes: float = 2.0          # the same for RoPE, per element of q and k (rotary models only)
    glu_passes: float = 3.0           # a gated MLP's activation, per element of its width (3: silu(a)*b fused)
    fused_attention: bool = False     # cuDNN / FA3-class attention (Megatron, TE, XLA) instead of SDPA's FA2
    attention_slowdown: tuple[float, float] = (1.0, 1.0)   # (forward, backward) time of its attention kernel / FA2's
    qkv_bias_passes: float = 0.0      # elements per q/k/v output element a bias add outside the GEMM moves (2: read,
                                      # write; 0 where the stack fuses it or the model has no biases)

    def ceiling(self, gpu) -> float:
        """The efficiency ceiling on `gpu`: its generation's where the stack has one, else efficiency_max."""
        gen = GENERATIONS.get(getattr(gpu, "name", ""))
        return dict(self.ceiling_by_generation).get(gen, self.efficiency_max) if gen else self.efficiency_max


#: GPU presets by generation (launcher/plan/presets.py): an eager stack's ceiling depends on it (STACKS).
GENERATIONS = {"a100-40gb": "ampere", "a100-80gb": "ampere", "h100-sxm": "hopper", "h100-pcie": "hopper",
               "h200": "hopper", "b200": "blackwell", "l40s": "ada"}


STACKS: dict[str, Stack] = {
    # eager PyTorch FSDP2 + SDPA (torchtitan-class). Its factor and elementwise passes are fitted on the
    # eager rows (benchmarks/calibrate_costs.py --fit; cross-validated by source with --cv): the GEMMs and
    # attention run at the kernels' rates (kernels.py), the norms, RoPE, activations and casts between
    # them at HBM speed, which is why the same code reaches a smaller share of an H100's peak (3x the
    # A100's FLOPs, 1.6x its bandwidth). FSDP2 prefetches the next block's all-gather during the current
    # block and reduce-scatters on its own stream: all but the first gather and last reduce of a pass can
    # hide behind the compute running then (fsdp_overlap 1).
    # DP collectives across nodes run at the node's k NICs (min(intra, k·net)): llm-foundry's FSDP runs of
    # MPT-13B hold 4,767-4,811 tok/s/GPU from 8 to 64 H100s, which one NIC per GPU could not (+150%).
    # Factor 0.938 and 200 passes (a GPT block's; a Llama block's eager traffic is 3.8x: elementwise_width):
    # `benchmarks/calibrate_costs.py --fit` on all 156 rows of the family, the passes at the grid's edge.
    # The optimizer step (fused AdamW over the rank's fp32 shard, one pass) is not charged.
    "bundled": Stack("bundled trainer (eager PyTorch, FSDP2)", efficiency_max=0.938, fsdp_overlap=1.0,
                     grad_sync_overlap=0.0, cp_overlap=0.0, cp_attention_factor=1.0,
                     zero2_sync_per_microbatch=True, zero1_allreduce=False, dp_collectives_per_layer=1, alpha_s=8e-6,
                     grad_reduce_bytes=4.0, dp_per_gpu_nic=False, replicated_param_bytes=2.0,
                     # op-level selective recompute (trainer/recompute.py) keeps every matmul's and
                     # SDPA's output: backward repeats only norms, RoPE and activations (no FLOPs here);
                     # the sequence-parallel linears (trainer/sequence_parallel.py) gather again in backward
                     selective_attention_recompute=0.0, sp_regathers=True, elementwise_passes=200.0,
                     # trainer/model.py in plain ops: RMSNorm (x.float(), pow, mean, multiply, type_as, weight: 18
                     # elements per input element), rotate-half RoPE (neg, cat, two products, a sum: 12), SwiGLU (5)
                     norm_passes=18.0, rope_passes=12.0, glu_passes=5.0),
    # Megatron-LM / NeMo: fused kernels (TE, cuDNN attention), distributed optimizer overlapping grad reduce
    # and param gather with compute; factor 0.836 and 60 passes of fused elementwise work: --fit on its 54 rows
    "megatron": Stack("Megatron-LM / NeMo", efficiency_max=0.836, fsdp_overlap=0.8, grad_sync_overlap=0.8,
                      cp_overlap=0.8, cp_attention_factor=1.0, zero2_sync_per_microbatch=False,
                      zero1_allreduce=False, dp_collectives_per_layer=1, alpha_s=8e-6, grad_reduce_bytes=4.0,
                      elementwise_passes=60.0, fused_attention=True),
    # DeepSpeed ZeRO-3 as measured in 2021 (Narayanan et al. Table 2): per-parameter collectives
    # (its collectives reach one NIC's bandwidth per GPU, and several per layer: the fit's choice)
    "deepspeed": Stack("DeepSpeed ZeRO-3 (2021)", efficiency_max=0.770, fsdp_overlap=0.5,
                       grad_sync_overlap=0.5, cp_overlap=0.0, cp_attention_factor=1.0,
                       zero2_sync_per_microbatch=True, zero1_allreduce=False, dp_collectives_per_layer=4,
                       alpha_s=8e-6, grad_reduce_bytes=2.0, dp_per_gpu_nic=True, elementwise_passes=0.0),
    # JAX/XLA FSDP (MaxText, PaxML): the compiler fuses the elementwise work and schedules the FSDP
    # all-gathers and reduce-scatters asynchronously behind the layers' compute. Factor 0.887 and 200 passes
    # (--fit on its 10 rows, the passes at the grid's edge). PaxML's rows run its own profile (STACKS['paxml']:
    # TE's fused attention recomputed, the q/k/v bias outside the GEMM) and hybrid sharding; --cv prints the rest
    "jax": Stack("JAX / XLA (MaxText, PaxML)", efficiency_max=0.887, fsdp_overlap=1.0, grad_sync_overlap=0.8,
                 cp_overlap=0.0, cp_attention_factor=1.0, zero2_sync_per_microbatch=True, zero1_allreduce=False,
                 dp_collectives_per_layer=1, alpha_s=8e-6, grad_reduce_bytes=4.0, dp_per_gpu_nic=True,
                 elementwise_passes=200.0, fused_attention=True),
}
# Meta's Llama 3 stack (arXiv 2407.21783 §3.3.2) runs like Megatron but for its CP: K and V all-gathered
# with the latency "exposed in the critical path"; FSDP keeps parameters gathered from forward to backward
# (ZeRO 2) and reduce-scatters fp32 gradients
STACKS["llama3"] = replace(STACKS["megatron"], name="Meta's Llama 3 stack (4D, FSDP ZeRO 2)", cp_overlap=0.0)
BUNDLED = STACKS["bundled"]
# torchtitan runs like the bundled trainer, but its op-level SAC recomputes every second matmul
# (../shared/notes/trainers.md §1.4), where ours keeps them all; its RoPE goes through complex numbers (x.float(), the
# complex product, type_as: 10 elements per element of q and k)
STACKS["torchtitan"] = replace(BUNDLED, name="torchtitan (eager, op-level selective AC)",
                               selective_matmul_recompute=0.5, rope_passes=10.0)
# llm-foundry / Composer: FSDP1 FULL_SHARD with backward prefetch and its own flash attention in Triton (the
# benchmark tables ran submit_benchmarks.py's default attn_impl 'triton'). FlashAttention-2 (Dao 2023, §4.1) is
# "around 1.3-1.5x faster than FlashAttention in Triton in the forward pass and around 2x faster in the backward
# pass": that kernel takes 1.4x FA2's forward time and 2x its backward (a fwd+bwd 1.8x FA2's, in the 1 + 2.5 count)
STACKS["llmfoundry"] = replace(BUNDLED, name="llm-foundry (Composer FSDP1, Triton flash attention)",
                               attention_slowdown=(1.4, 2.0),
                               # MPT's low-precision LayerNorm is one F.layer_norm kernel; no rotary (learned positions)
                               norm_passes=2.0)
# MaxText's remat_policy save_qkv_proj (dgxc-benchmarking maxtext/configure.sh; MaxText layers/models.py
# save_only_these_names query/key/value_proj): backward repeats the attention core and the matmuls whose outputs
# it needs. jax.checkpoint recomputes only those (ad_checkpoint.remat_partial_eval dead-code-eliminates the
# staged forward): the MLP's down projection feeds only the residual add and the layer's output, which the scan
# saves, so it is not repeated; the out projection is (the second norm reads the sum it makes), and so are the
# gate and up projections (the down projection's weight gradient reads their product). Of Llama 3 70B's 855.6M
# matmul parameters a layer: o 67.1M + gate/up 469.8M repeated (0.627); q, k, v 83.9M saved, down 234.9M dead
# Every other op of the layer's forward (norms, RoPE, the activation, the residual adds) is no saved name either:
# backward repeats all its elementwise work (selective_elementwise_recompute 1, as full recompute's).
STACKS["maxtext"] = replace(STACKS["jax"], name="MaxText (remat save_qkv_proj)", selective_matmul_recompute=0.627,
                            selective_attention_recompute=1.0, selective_elementwise_recompute=1.0)
# PaxML's GPT with Transformer Engine's layers (dgxc-benchmarking paxml/configure.sh: ENABLE_TE=1, NVTE_FUSED_ATTN=1;
# JAX-Toolbox's praxis PR-36 patch swaps praxis' transformer layer for TE's, LayerNorm, biased linears, GELU) under
# remat SAVE_DOT_ONLY (paxml_mod_configs.py: jax.checkpoint_policies.checkpoint_dots). TE's BF16 linears are plain
# dot_generals (transformer_engine/jax/dot.py type_safe_dot_general @9b2fed5, the container's TE): saved, no matmul
# repeats. Its fused attention is a custom call, no dot: backward recomputes it (the patch's check_checkpoint_policy
# says as much: with dropout only policies that save the context are allowed, "it's necessary to bypass recomputation
# in the attention layer"), selective in Megatron's sense. The q/k/v bias (flax/module.py: `x += bias` after the
# dot) is added outside the GEMM and its sum written for the custom call to read: 2 elements per element; the
# other biases fuse into the GELU and the residual adds that follow them. checkpoint_dots saves dots only: every
# other op of the forward (LayerNorms, bias adds, GELU, residual adds) is recomputed in backward, all its elementwise
# work (selective_elementwise_recompute 1, as full recompute's), though none of its matmuls.
STACKS["paxml"] = replace(STACKS["jax"], name="PaxML (praxis + TE layers, SAVE_DOT_ONLY)",
                          selective_matmul_recompute=0.0, selective_attention_recompute=1.0, qkv_bias_passes=2.0,
                          selective_elementwise_recompute=1.0)


@dataclass(frozen=True)
class Bandwidth:
    intra_gbs: float          # effective bus bandwidth of a collective inside one node
    net_per_gpu_gbs: float    # effective per-GPU inter-node bandwidth, one direction
    source: str               # what the figures came from, for the plan's report
    alltoall_intra_gbs: float | None = None  # measured all_to_all_perf busbw in one node (preflight --level long)
    alltoall_inter_gbs: float | None = None  # measured all_to_all_perf busbw over a node pair
    latency_s: float | None = None           # per ring step of a collective (a cluster profile's); else the stack's

    @property
    def ratio(self) -> float:
        return self.intra_gbs / self.net_per_gpu_gbs

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.latency_s is None:
            del d["latency_s"]
        d["ratio"] = round(self.ratio, 2)
        return d


def advertised_bandwidth(gpu) -> Bandwidth:
    return Bandwidth(intra_gbs=gpu.nvlink_gbs / 2 * NVLINK_EFFICIENCY,
                     net_per_gpu_gbs=gpu.network_gbs_per_gpu * NET_EFFICIENCY,
                     source=f"advertised figures of GPU preset {gpu.name!r}")


def group_busbw(bw: Bandwidth, size: int, stride: int, gpus_per_node: int, per_gpu_nic: bool = False) -> float:
    """Bus bandwidth (GB/s) of a collective over `size` ranks spaced `stride` apart in the rank order.

    Inside one node: the intra-node figure. Across n nodes with k GPUs each: large bucketed
    collectives (DP) use all k NICs of a node, min(intra, k·net); per-layer activation collectives
    (TP, CP: `per_gpu_nic`) are each rank's own traffic through its own NIC, as the seed counts them.
    """
    if size <= 1:
        return float("inf")
    per_node = max(1, min(size, gpus_per_node // stride)) if stride < gpus_per_node else 1
    nodes = -(-size // per_node)
    if nodes == 1:
        return bw.intra_gbs
    if per_gpu_nic:
        return bw.net_per_gpu_gbs
    return min(bw.intra_gbs, per_node * bw.net_per_gpu_gbs)


def alltoall_busbw(bw: Bandwidth, size: int, stride: int, gpus_per_node: int, per_gpu_nic: bool = False) -> float:
    """All-to-all bus bandwidth (GB/s) of a group: the measured all_to_all_perf figure for a group in one
    node or across nodes when preflight measured it, else half the all-reduce figure (all-to-all
    reaches about half the busbw of a ring collective; `per_gpu_nic` as group_busbw's: a per-layer
    activation exchange, all-to-all CP's, through each rank's own NIC)."""
    per_node = max(1, min(size, gpus_per_node // stride)) if stride < gpus_per_node else 1
    measured = bw.alltoall_intra_gbs if -(-size // per_node) == 1 else bw.alltoall_inter_gbs
    return measured or group_busbw(bw, size, stride, gpus_per_node, per_gpu_nic) * 0.5


def ring(nbytes: float, g: int, busbw_gbs: float, alpha_s: float, allreduce: bool = False) -> float:
    """Seconds for one ring all-gather / reduce-scatter (or all-reduce) of `nbytes` over g ranks."""
    if g <= 1:
        return 0.0
    k = 2 if allreduce else 1
    return k * ((g - 1) * alpha_s + nbytes * (g - 1) / g / (busbw_gbs * 1e9))


@dataclass(frozen=True)
class Collective:
    """One collective of a group kind as the time model prices it: the operation, one call's message
    (nccl-tests' size: the whole gathered / reduced buffer; per direction for send_recv), the group's
    size and stride in the rank order, and the bus bandwidth the model charges it at."""

    kind: str            # tp, cp, pp, dp, ep
    op: str              # all_gather, reduce_scatter, all_reduce, all_to_all, send_recv
    nbytes: float
    size: int            # ranks in one group (2 for a PP neighbour pair)
    stride: int
    busbw_gbs: float
    alpha_s: float       # latency per ring step

    def seconds(self, busbw_gbs: float | None = None) -> float:
        """One call's time in the model (at `busbw_gbs` instead of the model's figure when given)."""
        bw = busbw_gbs or self.busbw_gbs
        if self.op == "send_recv":
            return self.nbytes / (bw * 1e9)
        if self.op == "all_to_all":
            return self.nbytes * (self.size - 1) / self.size / (bw * 1e9)
        return ring(self.nbytes, self.size, bw, self.alpha_s, allreduce=self.op == "all_reduce")

    def busbw_for(self, seconds: float) -> float:
        """The bus bandwidth at which the model's time for one call is `seconds` (the inverse of
        seconds(); latency-bound calls faster than the model's latency alone read as the raw busbw)."""
        g = self.size
        if self.op == "send_recv":
            return self.nbytes / seconds / 1e9
        if self.op == "all_to_all":
            return self.nbytes * (g - 1) / g / seconds / 1e9
        k = 2 if self.op == "all_reduce" else 1
        left = seconds / k - (g - 1) * self.alpha_s
        if left <= seconds / k * 0.05:
            left = seconds / k
        return self.nbytes * (g - 1) / g / left / 1e9


def collectives(model, train, lay: Layout, bw: Bandwidth, gpus_per_node: int,
                mesh_order: tuple[str, ...] = ("pp", "dp", "cp", "tp"), counts: ParamCounts | None = None,
                stack: Stack = BUNDLED) -> dict[str, Collective]:
    """The collective of every group kind the layout communicates over (groups of one rank left out),
    with the message sizes and bandwidths estimate() charges: what `launch preflight --plan` measures.
    DP is the ZeRO / gradient group, dp·cp ranks (FSDP folds CP in); its message is one gradient bucket
    (ZeRO 0/1) or one block's gradients (ZeRO 2/3)."""
    counts = counts or param_counts(model)
    alpha = bw.latency_s if bw.latency_s is not None else stack.alpha_s
    st = strides({"tp": lay.tp, "cp": lay.cp, "pp": lay.pp, "dp": lay.dp}, mesh_order)
    dtype = 4 if train.precision == "fp32" else 2
    s_local, b, h = train.seq_len / lay.cp, lay.micro_batch, model.hidden
    out: dict[str, Collective] = {}
    if lay.tp > 1:
        out["tp"] = Collective("tp", "all_gather", s_local * b * h * dtype, lay.tp, st["tp"],
                               group_busbw(bw, lay.tp, st["tp"], gpus_per_node, per_gpu_nic=True), alpha)
    if lay.cp > 1 and lay.cp_attention == "all-to-all":
        # one call's message: this rank's q [s/cp, heads/tp, d], the larger of what each layer exchanges (q, k, v, out)
        out["cp"] = Collective("cp", "all_to_all", s_local * b * model.q_width / lay.tp * dtype, lay.cp, st["cp"],
                               alltoall_busbw(bw, lay.cp, st["cp"], gpus_per_node, per_gpu_nic=True), alpha)
    elif lay.cp > 1:
        kv_heads_local = max(1, model.kv_heads // lay.tp)
        out["cp"] = Collective("cp", "all_gather", train.seq_len * b * kv_heads_local * model.head_dim * dtype,
                               lay.cp, st["cp"], group_busbw(bw, lay.cp, st["cp"], gpus_per_node, per_gpu_nic=True),
                               alpha)
    if lay.pp > 1:
        out["pp"] = Collective("pp", "send_recv", s_local * b * h * dtype / lay.tp, 2, st["pp"],
                               group_busbw(bw, lay.pp, st["pp"], gpus_per_node), alpha)
    if model.experts > 1 and lay.ep > 1:
        out["ep"] = Collective("ep", "all_to_all", s_local * b * h * dtype * model.experts_per_token / lay.tp,
                               lay.ep, st["dp"], alltoall_busbw(bw, lay.ep, st["dp"], gpus_per_node), alpha)
    shard = lay.shard_group                 # dp·cp, or dp_shard·cp under hybrid sharding (its replicas apart)
    if shard > 1:
        dp_stride = min(st["dp"], st["cp"]) if lay.cp > 1 else st["dp"]
        most = max(rank_stage_layers(model.layers, lay.pp, lay.virtual_stages, lay.schedule))
        emb = counts.embedding + (counts.head if lay.pp == 1 else 0)
        stage_params = (counts.largest_layer * most + max(emb, counts.head)) / lay.tp
        grad_elem = 4 if train.precision == "fp32" else stack.grad_reduce_bytes
        elems = min(GRAD_BUCKET_ELEMS, stage_params) if lay.zero in (0, 1) else stage_params / max(most, 1)
        out["dp"] = Collective("dp", "all_reduce" if lay.zero == 0 else "reduce_scatter", elems * grad_elem, shard,
                               dp_stride, group_busbw(bw, shard, dp_stride, gpus_per_node,
                                                      per_gpu_nic=stack.dp_per_gpu_nic), alpha)
    return out


# --- FLOPs ----------------------------------------------------------------------------------------

def forward_flops_per_sequence(model, s: int, counts: ParamCounts | None = None) -> dict[str, float]:
    """Forward FLOPs of one sequence of length s, split into what recompute modes repeat."""
    counts = counts or param_counts(model)
    matmul = 2 * s * counts.active_layers(model.experts_per_token)
    attention = 4 * s * s * model.q_width * model.layers
    logits = 2 * s * model.hidden * model.vocab
    return {"matmul": matmul, "attention": attention, "logits": logits}


def model_flops_per_token(model, s: int) -> float:
    """Training FLOPs per token (forward + backward, no recompute): the MFU numerator."""
    f = forward_flops_per_sequence(model, s)
    return 3 * sum(f.values()) / s


def step_flops(f: dict[str, float], global_batch: int, recompute: str) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one optimizer step, from forward_flops_per_sequence."""
    fwd = sum(f.values())
    extra = {"none": 0.0, "selective": f["attention"], "full": f["matmul"] + f["attention"]}[recompute]
    return 3 * fwd * global_batch, (3 * fwd + extra) * global_batch


@lru_cache(maxsize=256)
def _sequence_flops(model, s: int, recompute: str, selective_matmul: float,
                    selective_attention: float) -> tuple[dict[str, float], float, float]:
    """(forward FLOPs by part, model FLOPs, hardware FLOPs) of one sequence (cached for the search)."""
    fwd = forward_flops_per_sequence(model, s)
    model_fl, hw_fl = step_flops(fwd, 1, recompute)
    if recompute == "selective":     # step_flops charges Megatron's selective: the attention core again
        hw_fl += selective_matmul * fwd["matmul"] - (1 - selective_attention) * fwd["attention"]
    return fwd, model_fl, hw_fl


#: Share of the counted attention FLOPs (4·s²·h, causal masking not discounted) a causal flash kernel does.
CAUSAL_WORK = 0.5


@lru_cache(maxsize=256)
def _forward_flops(model, s: int) -> dict[str, float]:
    """forward_flops_per_sequence, cached for the search (callers must not change the dict)."""
    return forward_flops_per_sequence(model, s)


def gemm_calls_per_layer(model, lay: Layout) -> int:
    """GEMM calls of one block's forward on one rank (q, k, v, o; the MLP's two or three, per local expert)."""
    mlp = 3 if model.mlp != "gelu" else 2
    if model.experts > 1:
        return 4 + 1 + mlp * max(1, model.experts // max(lay.ep, 1))      # + the router
    return 4 + mlp


def block_gemms(model, tp: int, ep: int, tokens: float) -> list[tuple[float, float, float, float]]:
    """(m, n, k, layers) of every GEMM of one block's forward on one rank: m rows (tokens), the [k, n] weight's
    shard, and the share of the model's layers that have it. `tokens`: the rank's tokens a dense linear sees
    (b·s/cp, all-gathered under TP's sequence parallelism). Column-parallel linears (q, k, v, the MLP's first)
    split n by tp, row-parallel ones (o, the MLP's last) split k. A MoE block routes each TP rank's own sequence
    shard (tokens/tp): the router and shared experts whole on it, and each of the E/ep local experts the tokens the
    ep ranks send it, ep·(tokens/tp)·top-k/E on average (balanced routing). The FLOPs add up to
    forward_flops_per_sequence's matmuls (its norm weights aside)."""
    h, q, kv = model.hidden, model.q_width, model.kv_width
    gated = model.mlp != "gelu"
    out = [(tokens, q / tp, h, 1.0), (tokens, kv / tp, h, 1.0), (tokens, kv / tp, h, 1.0), (tokens, h, q / tp, 1.0)]

    def mlp(m: float, width: float, split: int, share: float, calls: float = 1.0) -> None:
        out.extend([(m, width / split, h, share * calls)] * (2 if gated else 1))
        out.append((m, h, width / split, share * calls))

    moe_share = model.moe_layers / model.layers
    if moe_share < 1:
        mlp(tokens, model.ffn_hidden, tp, 1 - moe_share)
    if moe_share > 0:
        local = tokens / tp
        out.append((local, model.experts, h, moe_share))                           # the router
        if model.shared_experts:
            mlp(local, model.shared_ffn, 1, moe_share)
        experts = max(1, model.experts // max(ep, 1))
        mlp(local * model.experts_per_token * max(ep, 1) / model.experts, model.expert_ffn, 1, moe_share, experts)
    return out


def gemm_seconds(model, lay: Layout, tokens: float, gpu, layers: float, passes: float, logits: bool) -> float:
    """Seconds of a micro-batch's GEMMs on one rank, each by its shape (kernels.Kernels.gemm_seconds): `layers`
    blocks, `passes` times each block's forward GEMMs (3: forward, input gradient, weight gradient, which have the
    same three sizes, [m, k]·[k, n], [m, n]·[n, k] and [k, m]·[m, n], and so the same time in this model; more under
    recompute), and the logits' three (vocabulary split by tp) when `logits`."""
    k, peak = kernels(gpu), gpu.peak_tflops * 1e12
    block = sum(share * k.gemm_seconds(m, n, kk, peak) for m, n, kk, share in block_gemms(model, lay.tp, lay.ep,
                                                                                            tokens))
    seconds = block * passes * layers
    if logits:
        seconds += 3 * k.gemm_seconds(tokens, model.vocab / lay.tp, model.hidden, peak)
    return seconds


#: Elements a GPT block's forward moves per token through memory-bound ops, in hidden widths: two residual
#: adds (3 each), two fused LayerNorms (2 each), GELU over 4h (2 per element), attention's output copy (2).
GPT_BLOCK_ELEMENTWISE = 20.0


def elementwise_width(model, stack: Stack) -> float:
    """Hidden widths of memory-bound traffic per token in one block's forward, relative to a GPT block's: what
    elementwise_passes scales. Counted op by op as the stack runs them: residual adds, norms, the MLP's
    activation (GELU reads and writes its width; a gated one, eager, silu then the product: 5 per element),
    RoPE on q and k (rotary models), the attention output's copy back to [b, s, h]."""
    h, qw = model.hidden, model.q_width
    ffn = model.ffn_hidden if model.experts <= 1 else \
        model.moe_ffn_hidden * (model.experts_per_token + model.shared_experts)
    act = 2.0 * ffn if model.mlp == "gelu" else stack.glu_passes * ffn
    rope = stack.rope_passes * (qw + model.kv_width) if model.position == "rope" else 0.0
    bias = stack.qkv_bias_passes * (qw + 2 * model.kv_width)
    return (6 * h + 2 * stack.norm_passes * h + act + rope + 2 * qw + bias) / GPT_BLOCK_ELEMENTWISE


def compute_seconds(model, lay: Layout, seq_len: int, gpu, stack: Stack = BUNDLED, layers: float = 1.0,
                    logits: bool = False, factor: float | None = None, fp8: str | None = None) -> tuple[float, float]:
    """(seconds, hardware FLOPs) of one micro-batch's forward + backward (+ recompute) on one rank for
    `layers` blocks (and the logits when `logits`): every GEMM by its shape (gemm_seconds: kernels.py's model
    fitted to public GEMM benchmarks per GPU), attention at the
    flash-attention rate on the causal half (its backward FLASH_BACKWARD forwards, as FlashAttention counts it), elementwise work at HBM speed (the stack's passes over
    the activations), all divided by the stack's fitted factor (or `factor`: cluster.compute_efficiency /
    `launch calibrate`'s, which scales this kernel-level time). `fp8`: train.fp8_linears under precision fp8 (the
    converted GEMMs at the FP8 rate, their casts at HBM speed: launcher/plan/fp8.py)."""
    k = kernels(gpu)
    peak = gpu.peak_tflops * 1e12
    fwd = _forward_flops(model, seq_len)
    share = lay.micro_batch / (lay.tp * lay.cp)               # this rank's part of one sequence's work
    rc_mm = {"none": 0.0, "selective": stack.selective_matmul_recompute, "full": 1.0}[lay.recompute]
    rc_attn = {"none": 0.0, "selective": stack.selective_attention_recompute, "full": 1.0}[lay.recompute]
    rc_elem = 1.0 if lay.recompute == "full" else 0.0 if lay.recompute == "none" else \
        rc_mm if stack.selective_elementwise_recompute is None else stack.selective_elementwise_recompute
    mm = fwd["matmul"] / model.layers * (3 + rc_mm) * share * layers
    if logits:
        mm += 3 * fwd["logits"] * share
    attn = fwd["attention"] / model.layers * (3 + rc_attn) * share * layers
    if lay.cp > 1:
        attn *= stack.cp_attention_factor
    # the kernel's work: FlashAttention's backward recomputes the scores, FLASH_BACKWARD forwards (FLOPs stay 3x)
    fwd_slow, bwd_slow = stack.attention_slowdown
    attn_work = attn * ((1 + rc_attn) * fwd_slow + FLASH_BACKWARD * bwd_slow) / (3 + rc_attn)
    attn_rate = k.attention_fused if stack.fused_attention else k.attention
    tokens = lay.micro_batch * seq_len / lay.cp
    elem_bytes = stack.elementwise_passes * 2 * tokens * elementwise_width(model, stack) / lay.tp * layers \
        * (3 + rc_elem) / 3
    fp8_mm = fp8_bytes = 0.0
    if fp8:
        per_layer, fp8_bytes = fp8_terms(model, lay.tp, tokens, fp8, rc_mm, compiled=lay.compile)
        fp8_mm, fp8_bytes = min(mm, per_layer * layers), fp8_bytes * layers
    if lay.compile:
        elem_bytes *= compiled_elementwise(gpu)     # compiled blocks fuse it; the GEMMs and attention are as eager
    seconds = (gemm_seconds(model, lay, tokens, gpu, layers, 3 + rc_mm, logits)
               + attn_work * CAUSAL_WORK / (peak * attn_rate) + (elem_bytes + fp8_bytes) / (k.hbm_tbs * 1e12))
    if fp8_mm:
        # the converted GEMMs' compute at the FP8 peak instead, at the share of it the BF16 ones reach
        # (launcher/plan/fp8.py); their launch and operand terms as in bf16
        seconds += fp8_mm / (gpu.fp8_tflops * 1e12 * k.gemm) - fp8_mm / (peak * k.gemm)
    return seconds / (factor or stack.ceiling(gpu)), mm + attn


def compute_efficiency(model, lay: Layout, seq_len: int, efficiency_max: float | None = None,
                       stack: Stack = BUNDLED, gpu=None) -> float:
    """Achieved fraction of peak of one block's compute (compute_seconds): the kernels' rate at this
    layout's shapes times the stack's factor (`efficiency_max`: cluster.compute_efficiency or a cluster
    profile's replaces it), so it is linear in that factor. Without a GPU, an H100's kernels."""
    from launcher.plan.spec import resolve_gpu
    gpu = gpu or resolve_gpu("h100-sxm")
    seconds, flops = compute_seconds(model, lay, seq_len, gpu, stack, factor=efficiency_max)
    return flops / (gpu.peak_tflops * 1e12 * seconds)


#: torchtitan's published eager and compiled throughput of one layout (tok/s/GPU): Llama 3.1 8B, FSDP (ZeRO 3),
#: selective (op) recompute, local batch 2 at 8,192 tokens, H100 (benchmarks/llama3_h100_202412_torchtitan.md,
#: Tables 1 and 3: "FSDP" against "FSDP + torch.compile"). The only such pairs it publishes: its 70B, 405B and
#: async-TP rows all run compiled. (label, dp, eager, compiled)
COMPILE_PAIRS = (("Llama 3.1 8B, FSDP 8, 8 H100", 8, 5762.0, 6667.0),
                 ("Llama 3.1 8B, FSDP 128, 128 H100", 128, 5605.0, 6514.0))


@lru_cache(maxsize=64)
def compiled_elementwise(gpu) -> float:
    """The share of a block's elementwise time that compiled blocks (train.compile) still spend: what inductor's
    fusion of the norms, RoPE, activations and casts leaves, the GEMMs and attention unchanged. Solved from
    COMPILE_PAIRS at this model's own breakdown of those runs (torchtitan's stack: its step time t, the same without
    elementwise work t0, the published speedup r: share = (t/r - t0) / (t - t0)), the mean of the two pairs, solved
    at first use so a refit of the eager figures keeps it consistent (benchmarks/compile_factor.py prints it).
    1 on the cpu preset: nothing measured compile's gain there, and the planner then keeps eager blocks."""
    if getattr(gpu, "name", "") == "cpu":
        return 1.0
    from launcher.plan.spec import TrainSpec, resolve_gpu, resolve_model

    model, h100 = resolve_model("llama3-8b"), resolve_gpu("h100-sxm")
    stack = STACKS["torchtitan"]
    shares = []
    for _, dp, eager, compiled in COMPILE_PAIRS:
        lay = Layout(tp=1, cp=1, pp=1, dp=dp, ep=1, zero=3, recompute="selective", micro_batch=2, grad_accum=1,
                     schedule="none", virtual_stages=1)
        train = TrainSpec(seq_len=8192, global_batch=2 * dp)
        bw = advertised_bandwidth(h100)
        t = estimate(model, train, h100, lay, bw, 8, stack=stack).step_time_s
        t0 = estimate(model, train, h100, lay, bw, 8, stack=replace(stack, elementwise_passes=0.0)).step_time_s
        shares.append((t * eager / compiled - t0) / (t - t0))
    return min(1.0, max(0.0, sum(shares) / len(shares)))


def split_bubble(model, lay: Layout, fwd: dict[str, float]) -> float:
    """The bubble of a split-backward schedule (interleaved-zero-bubble, zero-bubble-v, dualpipe-v) as a fraction
    of the busiest rank's compute, by simulating torch's own orders (schedules.bubble_fraction) with each layer's
    forward F, input gradient I and weight gradient W in FLOPs: F its matmuls and attention, W the matmuls again
    (a weight's gradient costs its forward: Qi et al. 2023 §2, "T_F ≈ T_B ≈ T_W" for matmuls alone), I the matmuls
    and attention's backward (FLASH_BACKWARD forwards: it has no weights), the last stage's logits likewise. The
    ZB paper's bubble formulas are this simulation's answer for F = I = W (tests/unit/test_costs_schedules.py). Not
    charged: p2p latency inside the bubble, and DualPipe-V's overlap of one micro-batch's forward with another's
    backward, which hides EP's all-to-all (DeepSeek-V3 §3.2.1), not compute, and the bundled trainer runs
    them one after the other."""
    per_layer_mm = fwd["matmul"] / model.layers
    per_layer_attn = fwd["attention"] / model.layers
    f = per_layer_mm + per_layer_attn
    i = per_layer_mm + FLASH_BACKWARD * per_layer_attn
    w = per_layer_mm
    logits = fwd["logits"] / f
    v = max(1, lay.virtual_stages)
    split = tuple(stage_layers(model.layers, lay.pp * v))
    return schedule_bubble(lay.schedule, lay.pp, v, lay.grad_accum, split, 1.0, round(i / f, 3), round(w / f, 3),
                           (round(logits, 3), round(logits, 3), round(logits, 3)))


@lru_cache(maxsize=4096)
def rank_stage_layers(layers: int, pp: int, v: int, schedule: str = "1f1b") -> tuple[int, ...]:
    """Layers each pipeline rank runs: rank r holds stages r, r+pp, ... of the uneven split (r and 2·pp-1-r
    under a V schedule: capabilities.rank_stages)."""
    split = stage_layers(layers, pp * v)
    return tuple(sum(split[s] for s in rank_stages(schedule, r, pp, v)) for r in range(pp))


# --- the estimate ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Estimate:
    step_time_s: float
    compute_s: float
    tp_comm_s: float
    cp_comm_s: float
    ep_comm_s: float
    pp_p2p_s: float
    bubble_s: float
    bubble_fraction: float
    dp_comm_s: float
    dp_exposed_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float
    hfu: float
    efficiency: float
    flop_formula: str = "model FLOPs = 3 x forward (2/param-token + 4bs^2h attention + 2bshV logits); HFU adds recompute"
    dp_replica_s: float = 0.0   # hybrid sharding: the cross-replica all-reduce, before overlap (in dp_comm_s)

    def to_dict(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}

    def terms(self) -> dict[str, float]:
        """The step's cost terms in seconds (what a comparison between two plans names)."""
        return {"compute": self.compute_s, "TP": self.tp_comm_s, "CP": self.cp_comm_s, "EP": self.ep_comm_s,
                "PP transfers": self.pp_p2p_s, "pipeline bubble": self.bubble_s, "DP/ZeRO": self.dp_exposed_s}


def dp_traffic(lay: Layout, stack: Stack, elems: float, dtype: int, grad_elem: float, g: int, bw: float,
               blocks: int) -> float:
    """Seconds of ZeRO/DP collectives per step on one GPU (before overlap), as the stack issues them:
    `elems` parameters of this rank's stage, `blocks` transformer blocks, over g ranks at bw GB/s."""
    m, pp = lay.grad_accum, lay.pp
    lat = (g - 1) * stack.alpha_s                           # one ring collective's latency
    per_pass = stack.dp_collectives_per_layer * max(blocks, 1)
    param_bytes, grad_bytes = elems * dtype, elems * grad_elem

    def passes(nbytes: float, count: float) -> float:
        """`count` passes over the stage, each `per_pass` collectives moving nbytes in all."""
        return count * (per_pass * lat + nbytes * (g - 1) / g / (bw * 1e9))

    if lay.zero in (0, 1):
        buckets = -(-elems // GRAD_BUCKET_ELEMS)
        reduce = buckets * lat + grad_bytes * (g - 1) / g / (bw * 1e9)     # one reduce-scatter's worth
        if lay.zero == 0:
            return 2 * reduce                                           # all-reduce
        # ZeRO 1: gradients reduce-scattered (the bundled dist_optim.py, Megatron's distributed optimizer) or
        # all-reduced, then every rank receives the parameters others updated, per bucket
        gather = buckets * lat + elems * stack.replicated_param_bytes * (g - 1) / g / (bw * 1e9)
        return (2 if stack.zero1_allreduce else 1) * reduce + gather
    if lay.zero == 2:
        count = m if stack.zero2_sync_per_microbatch and pp == 1 else 1
        return passes(grad_bytes, count) + passes(param_bytes, count)
    if pp == 1:                                             # ZeRO 3
        return passes(param_bytes, 2 * m) + passes(grad_bytes, m)
    return passes(param_bytes, m + min(m, pp)) + passes(grad_bytes, 1)


def replica_group(lay: Layout, mesh_order: tuple[str, ...]) -> tuple[int, int]:
    """(size, stride) of a hybrid-sharding replica group: the dp / dp_shard ranks holding the same shard, dp
    coordinates dp_shard apart (mesh.py splits dp into (dp_replicate, dp_shard), outer to inner)."""
    st = strides({"tp": lay.tp, "cp": lay.cp, "pp": lay.pp, "dp": lay.dp}, mesh_order)
    return lay.dp_replicas, st["dp"] * lay.dp_shard_size


def replica_traffic(lay: Layout, stack: Stack, elems: float, grad_elem: float, bw: float, blocks: int) -> float:
    """Seconds per step of hybrid sharding's cross-replica all-reduce of the sharded gradients (before
    overlap): each rank's 1/(dp_shard·cp) of `elems` stage parameters, all-reduced over dp / dp_shard replicas
    once per step (MiCS's "amortized" synchronisation, arXiv 2205.00119 §3.3; FSDP2's HSDP all-reduce, which
    the bundled trainer turns off until the last micro-batch, FSDPModule.set_requires_all_reduce, and
    pipelining until a stage's last): per FSDP unit under ZeRO 2/3, per bucket after its reduce-scatter under
    ZeRO 1 (dist_optim.py)."""
    r = lay.dp_replicas
    if r <= 1:
        return 0.0
    calls = -(-elems // GRAD_BUCKET_ELEMS) if lay.zero == 1 else stack.dp_collectives_per_layer * max(blocks, 1)
    return ring(elems / lay.shard_group * grad_elem, r, bw, stack.alpha_s, allreduce=True) \
        + (calls - 1) * 2 * (r - 1) * stack.alpha_s


def estimate(model, train, gpu, lay: Layout, bw: Bandwidth, gpus_per_node: int,
             mesh_order: tuple[str, ...] = ("pp", "dp", "cp", "tp"),
             counts: ParamCounts | None = None, efficiency_max: float | None = None,
             stack: Stack = BUNDLED, busbw: Mapping[str, float] | None = None) -> Estimate:
    """The step time of a layout. `busbw`: bus bandwidths (GB/s) by group kind (tp, cp, pp, dp, ep) that
    replace what the model derives from `bw` for those groups (`launch preflight --plan`'s measured figures)."""
    counts = counts or param_counts(model)
    if bw.latency_s is not None and bw.latency_s != stack.alpha_s:
        stack = replace(stack, alpha_s=bw.latency_s)
    # every group's bandwidth from the one table preflight --plan measures against (collectives())
    inf = float("inf")
    bws = {k: c.busbw_gbs for k, c in collectives(model, train, lay, bw, gpus_per_node, mesh_order, counts,
                                                 stack).items()} | dict(busbw or {})

    def contention(hidden_s: float, busbw_gbs: float) -> float:
        """What `hidden_s` seconds of a collective hidden behind compute cost that compute (OVERLAP_SLOWDOWN), scaled
        by the rate it moves bytes through HBM and the SMs against a collective inside the node, the paper's (over
        NVLink): one bound by the NICs moves fewer a second."""
        return hidden_s * OVERLAP_SLOWDOWN * min(1.0, busbw_gbs / bw.intra_gbs)

    s, b, h = train.seq_len, lay.micro_batch, model.hidden
    m, v, p = lay.grad_accum, lay.virtual_stages, lay.pp
    dtype = 4 if train.precision == "fp32" else 2
    peak = gpu.peak_tflops * 1e12

    fwd, model_seq, hw_seq = _sequence_flops(model, s, lay.recompute, stack.selective_matmul_recompute,
                                             stack.selective_attention_recompute)
    model_fl, hw_fl = model_seq * train.global_batch, hw_seq * train.global_batch
    factor = efficiency_max or stack.ceiling(gpu)
    attn_again = {"none": 0.0, "selective": stack.selective_attention_recompute, "full": 1.0}[lay.recompute]
    attn_layer = fwd["attention"] * (3 + attn_again) / model.layers
    # The pipeline runs at the pace of its busiest rank: its layers (uneven splits and interleaving
    # with layer counts not divisible by pp·v included) plus, on the last rank, the logits and loss.
    per_rank = rank_stage_layers(model.layers, p, v, lay.schedule)
    most = max(per_rank)
    fp8 = train.fp8_linears if train.precision == "fp8" else None
    t_most, fl_most = compute_seconds(model, lay, s, gpu, stack, most, p == 1, factor, fp8)
    t_last, fl_last = (t_most, fl_most) if p == 1 else compute_seconds(model, lay, s, gpu, stack, per_rank[-1],
                                                                       True, factor, fp8)
    layers_stage = per_rank[-1] if t_last >= t_most else most
    compute_mb, mb_flops = (t_last, fl_last) if t_last >= t_most else (t_most, fl_most)
    eff = mb_flops / (peak * compute_mb)
    s_local = s / lay.cp
    # TP (+SP): per layer 2 all-gathers + 2 reduce-scatters of s·b·h forward, as many backward; full
    # recompute repeats the forward's.
    tp_bw = bws.get("tp", inf)
    # linears that keep only the sequence shard (sp_regathers: the bundled trainer's sequence_parallel.py)
    # all-gather it again in backward: 2 more
    tp_colls = (12 if lay.recompute == "full" else 8) + (2 if stack.sp_regathers else 0)
    if model.experts > 1:
        tp_colls //= 2      # a MoE block: attention's collectives only (the experts route each rank's own shard)
    tp_mb = tp_colls * ring(s_local * b * h * dtype, lay.tp, tp_bw, stack.alpha_s) * layers_stage
    # CP: K and V all-gathered forward (again under recompute), their gradients reduce-scattered
    # backward: 2 collectives per pass per layer, each of the full sequence's K (or V) for this rank's
    # kv heads. The bundled trainer runs them synchronously.
    cp_bw = bws.get("cp", inf)
    kv_heads_local = max(1, model.kv_heads // lay.tp)
    k_bytes = s * b * kv_heads_local * model.head_dim * dtype
    cp_passes = 2 if lay.recompute == "none" else 3
    cp_raw = 2 * cp_passes * ring(k_bytes, lay.cp, cp_bw, stack.alpha_s) * layers_stage
    attn_compute = attn_layer * layers_stage * b / (lay.tp * lay.cp) / (peak * eff)
    cp_mb = max(cp_raw * (1 - stack.cp_overlap), cp_raw - attn_compute * stack.cp_overlap)
    cp_mb += contention(cp_raw - cp_mb, cp_bw)
    if lay.cp > 1 and lay.cp_attention == "all-to-all":
        # all-to-all CP (DeepSpeed-Ulysses: Jacobs et al. 2023, arXiv 2309.14509 §3.2, 4·N·h/P per GPU per layer):
        # q, k and v exchanged before attention and the output after, 4 all-to-alls of this rank's s/cp tokens per
        # layer forward (k, v: kv heads repeated up to cp, ledger.ulysses_kv_width), as many backward, again in the
        # recompute (selective too: an exchange is no kept op). At cp_bw, the all-to-all figure (collectives():
        # measured all_to_all_perf where the bandwidth map has it), N(g-1)/g / busbw as nccl-tests count it, plus
        # one latency a call (NCCL sends to every peer at once, not a ring's g-1 steps). Synchronous: attention
        # needs all of it first, so nothing hides it.
        q_bytes = s_local * b * model.q_width / lay.tp * dtype
        kv_bytes = s_local * b * ulysses_kv_width(model, lay.tp, lay.cp) * dtype
        moved = (2 * q_bytes + 2 * kv_bytes) * (lay.cp - 1) / lay.cp
        cp_mb = cp_passes * (4 * stack.alpha_s + moved / (cp_bw * 1e9)) * layers_stage
    # EP: all-to-all dispatch + combine, forward and backward, of each token's top-k hidden states.
    ep_mb = 0.0
    if model.experts > 1 and lay.ep > 1:
        ep_bw = bws["ep"] * 1e9
        ep_mb = 4 * s_local * b * h * dtype * model.experts_per_token * (lay.ep - 1) / lay.ep * layers_stage / lay.tp / ep_bw
    mb_time = compute_mb + tp_mb + cp_mb + ep_mb

    # PP: steady state m·v chunks of 1/v the work, plus the bubble (p-1)/(m·v) (Narayanan et al. 2021, §2.2.2:
    # 1F1B's (p-1)/m, interleaved's ÷v); boundary transfers.
    bubble_fraction = (p - 1) / (m * v) if p > 1 else 0.0
    if p > 1 and lay.schedule in SPLIT_BACKWARD:
        bubble_fraction = split_bubble(model, lay, fwd)
    pp_bw = bws.get("pp", inf) * 1e9
    p2p = 2 * s_local * b * h * dtype / lay.tp / pp_bw if p > 1 else 0.0
    pp_p2p = p2p * (m * v + p - 1) * 0.5 if p > 1 else 0.0   # forward + backward, half hidden by compute
    busy = mb_time * m
    bubble = busy * bubble_fraction

    # DP / ZeRO over dp·cp (FSDP folds CP in), for the stage holding the most parameters.
    # Hybrid sharding: the ZeRO traffic above inside dp_shard·cp at that group's bandwidth (inside a node when it
    # fits there), and the sharded gradients' all-reduce across the dp / dp_shard replicas at theirs (one rank a
    # node: its own NIC), replica_traffic
    shard = lay.shard_group
    dp_bw = bws.get("dp", inf)
    emb = counts.embedding + (counts.head if p == 1 else 0)
    stage_params = (counts.largest_layer * most + max(emb, counts.head)) / lay.tp
    grad_elem = 4 if train.precision == "fp32" else stack.grad_reduce_bytes
    dp_comm = dp_traffic(lay, stack, stage_params, dtype, grad_elem, shard, dp_bw, most) \
        if shard > 1 else 0.0
    rep_comm, rep_bw = 0.0, inf
    if lay.dp_replicas > 1:
        r_size, r_stride = replica_group(lay, mesh_order)
        rep_bw = bws.get("dp_replica") or group_busbw(bw, r_size, r_stride, gpus_per_node,
                                                      per_gpu_nic=stack.dp_per_gpu_nic)
        rep_comm = replica_traffic(lay, stack, stage_params, grad_elem, rep_bw, most)
    if lay.zero >= 2:
        # FSDP overlaps with the compute running at the same time: every micro-batch's outside PP; under
        # PP the per-step gather and reduce meet only the first forward and the last backward.
        concurrent = busy if p == 1 or lay.zero == 3 else mb_time
        # the first block's all-gather of each pass and the last block's reduce-scatter have no compute
        # beside them (prefetch starts from the second block): one block's collectives per pass exposed
        edge = dp_comm / max(most, 1)
        rest = dp_comm - edge
        shard_exposed = edge + max(rest * (1 - stack.fsdp_overlap), rest - concurrent * stack.fsdp_overlap)
        # HSDP's all-reduce follows each unit's reduce-scatter in the last backward (FSDP2's all-reduce stream,
        # on the NICs while the shard group's traffic is on NVLink): behind that backward, the last unit's exposed
        r_edge = rep_comm / max(most, 1)
        r_rest = rep_comm - r_edge
        rep_exposed = r_edge + max(r_rest * (1 - stack.fsdp_overlap), r_rest - mb_time * 2 / 3 * stack.fsdp_overlap)
        dp_exposed = shard_exposed + rep_exposed + contention(dp_comm - shard_exposed, dp_bw) \
            + contention(rep_comm - rep_exposed, rep_bw)
    else:
        backward = busy * 2 / 3
        sync = dp_comm + rep_comm                  # ZeRO 1: each bucket reduce-scattered, then all-reduced
        dp_exposed = max(sync * (1 - stack.grad_sync_overlap), sync - backward * stack.grad_sync_overlap)
        if sync:       # the hidden share of each part, as they make up the sync
            hidden = 1 - dp_exposed / sync
            dp_exposed += contention(dp_comm * hidden, dp_bw) + contention(rep_comm * hidden, rep_bw)
    dp_comm += rep_comm

    step = busy + bubble + pp_p2p + dp_exposed
    world = lay.world
    return Estimate(
        step_time_s=step, compute_s=compute_mb * m, tp_comm_s=tp_mb * m, cp_comm_s=cp_mb * m,
        ep_comm_s=ep_mb * m, pp_p2p_s=pp_p2p, bubble_s=bubble, bubble_fraction=bubble_fraction,
        dp_comm_s=dp_comm, dp_exposed_s=dp_exposed, dp_replica_s=rep_comm,
        tokens_per_s=train.global_batch * s / step,
        tflops_per_gpu=model_fl / step / world / 1e12,
        mfu=model_fl / step / world / peak, hfu=hw_fl / step / world / peak, efficiency=eff,
    )


def train_budget(step_time_s: float, steps: int, world: int, tokens_per_step: int,
                 price_per_gpu_hour: float | None) -> dict[str, float | None]:
    """Time to train and what it costs: the first numbers a budget holder asks for."""
    wall = step_time_s * steps
    gpu_hours = wall * world / 3600
    return {"steps": steps, "tokens": steps * tokens_per_step, "wall_time_s": round(wall, 3),
            "gpu_hours": round(gpu_hours, 3), "price_per_gpu_hour": price_per_gpu_hour,
            "cost": round(gpu_hours * price_per_gpu_hour, 2) if price_per_gpu_hour is not None else None}


def duration(seconds: float) -> str:
    """A wall time people read: 42 s, 17 min, 5.2 h, 3.1 days."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"
