"""Time model: compute from model FLOPs at a size-dependent efficiency, plus the communication each
split costs (TP, CP, PP, DP, EP) at the bandwidth of the links its group actually spans.

FLOP conventions (Korthikanti et al., Narayanan et al.): a layer's forward pass is 2 FLOPs per
parameter-token in its matmuls plus 4·b·s²·h for the attention scores and their product with V
(causal masking not discounted, as in the papers); the logits add 2·b·s·h·V. Model FLOPs (MFU) are
3× the forward. Hardware FLOPs (HFU) add what recompute repeats: a whole forward of every layer for
full recompute, the attention core for selective. For a 4h GELU MLP with MHA this is exactly
72·B·L·s·h²·(1 + s/6h + V/12hL).

Bandwidths: collective times use bus bandwidth (nccl-tests busbw semantics): an all-reduce of N
bytes over g ranks takes N·2(g-1)/g / busbw. Without a BandwidthMap, intra-node busbw is the
advertised NVLink figure (bidirectional) halved, times NVLINK_EFFICIENCY; the per-GPU network figure
times NET_EFFICIENCY. A group with k GPUs on each of n > 1 nodes runs at min(intra, k·net).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from launcher.layout import strides
from launcher.ledger import Layout, ParamCounts, param_counts

# --- calibration constants (fitted in benchmarks/calibrate_costs.py; errors printed there) -------
#: Achievable fraction of peak for large matmul-dominated layers (kernels, norms, softmax included).
COMPUTE_EFFICIENCY_MAX = 0.68
#: Per-GPU weight-slice size (h·h/tp, millions of elements) at which efficiency is half the maximum:
#: thin TP slices of small models leave the GPU underfed (Korthikanti 22B vs 530B).
COMPUTE_EFFICIENCY_HALF_MELEM = 1.5
#: Tokens per GPU per micro-batch (b·s/cp) at which efficiency is half the maximum: context
#: parallelism and tiny micro-batches shrink the GEMMs' other dimension.
COMPUTE_EFFICIENCY_HALF_TOKENS = 128
#: Fraction of the advertised per-direction NVLink bandwidth an all-reduce reaches (nccl-tests: ~370-480
#: GB/s busbw on 450 GB/s per direction).
NVLINK_EFFICIENCY = 0.8
#: Fraction of the NIC line rate NCCL reaches (46-48 GB/s on a 50 GB/s NDR port).
NET_EFFICIENCY = 0.92
#: Fraction of data-parallel communication hidden behind backward compute (FSDP prefetch, bucketing).
DP_OVERLAP = 0.8
#: Fraction of context-parallel K/V exchange hidden behind attention compute.
CP_OVERLAP = 0.5


@dataclass(frozen=True)
class Bandwidth:
    intra_gbs: float          # effective bus bandwidth of a collective inside one node
    net_per_gpu_gbs: float    # effective per-GPU inter-node bandwidth, one direction
    source: str               # what the figures came from, for the plan's report

    @property
    def ratio(self) -> float:
        return self.intra_gbs / self.net_per_gpu_gbs

    def to_dict(self) -> dict:
        d = asdict(self)
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


# --- FLOPs ----------------------------------------------------------------------------------------

def forward_flops_per_sequence(model, s: int, counts: ParamCounts | None = None) -> dict[str, float]:
    """Forward FLOPs of one sequence of length s, split into what recompute modes repeat."""
    counts = counts or param_counts(model)
    active = counts.active_per_layer(model.experts_per_token)
    matmul = 2 * s * active * model.layers
    attention = 4 * s * s * model.hidden * model.layers
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


def compute_efficiency(model, lay: Layout, seq_len: int, efficiency_max: float | None = None) -> float:
    """Achieved fraction of peak, rising with the per-GPU weight slice (thin slices starve the GPU).
    `efficiency_max` (cluster.compute_efficiency) replaces the calibrated ceiling for other stacks."""
    slice_m = model.hidden * model.hidden / lay.tp / 1e6
    tokens = lay.micro_batch * seq_len / lay.cp
    return ((efficiency_max or COMPUTE_EFFICIENCY_MAX) * slice_m / (slice_m + COMPUTE_EFFICIENCY_HALF_MELEM)
            * tokens / (tokens + COMPUTE_EFFICIENCY_HALF_TOKENS))


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

    def to_dict(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def estimate(model, train, gpu, lay: Layout, bw: Bandwidth, gpus_per_node: int,
             mesh_order: tuple[str, ...] = ("pp", "dp", "cp", "tp"),
             counts: ParamCounts | None = None, efficiency_max: float | None = None) -> Estimate:
    counts = counts or param_counts(model)
    s, b, h = train.seq_len, lay.micro_batch, model.hidden
    m, v, p = lay.grad_accum, lay.virtual_stages, lay.pp
    st = strides({"tp": lay.tp, "cp": lay.cp, "pp": lay.pp, "dp": lay.dp}, mesh_order)
    dtype = 4 if train.precision == "fp32" else 2
    peak = gpu.peak_tflops * 1e12

    fwd = forward_flops_per_sequence(model, s, counts)
    model_fl, hw_fl = step_flops(fwd, train.global_batch, lay.recompute)
    eff = compute_efficiency(model, lay, s, efficiency_max)
    # Hardware FLOPs of one micro-batch on one GPU of the busiest stage: the last stage carries the
    # logits and loss on top of its share of the layers, and the pipeline runs at its pace.
    layer_fl = hw_fl / train.global_batch - 3 * fwd["logits"]
    per_mb_gpu = (layer_fl / p + 3 * fwd["logits"]) * b / (lay.tp * lay.cp)
    compute_mb = per_mb_gpu / (peak * eff)

    layers_stage = model.layers / p
    s_local = s / lay.cp
    # TP (+SP): 4 all-reduce-equivalents of s·b·h per layer, forward 2 + backward 2 (seed formula);
    # full recompute repeats the forward's two.
    tp_bw = group_busbw(bw, lay.tp, st["tp"], gpus_per_node, per_gpu_nic=True) * 1e9
    tp_factor = 6 if lay.recompute == "full" else 4
    tp_mb = (tp_factor * s_local * b * h * dtype * 2 * (lay.tp - 1) / lay.tp * layers_stage / tp_bw
             if lay.tp > 1 else 0.0)
    # CP: all-gather K and V forward, reduce-scatter their gradients backward; partly overlapped.
    cp_bw = group_busbw(bw, lay.cp, st["cp"], gpus_per_node, per_gpu_nic=True) * 1e9
    kv = 2 * s * b * model.kv_heads * model.head_dim * dtype / lay.tp
    cp_raw = 2 * kv * (lay.cp - 1) / lay.cp * layers_stage / cp_bw if lay.cp > 1 else 0.0
    attn_compute = compute_mb * fwd["attention"] / sum(fwd.values())
    cp_mb = max(cp_raw * (1 - CP_OVERLAP), cp_raw - attn_compute)
    # EP: all-to-all dispatch + combine, forward and backward, of each token's top-k hidden states.
    ep_mb = 0.0
    if model.experts > 1 and lay.ep > 1:
        ep_bw = group_busbw(bw, lay.ep, st["dp"], gpus_per_node) * 1e9 * 0.5   # all-to-all reaches ~half busbw
        ep_mb = 4 * s_local * b * h * dtype * model.experts_per_token * (lay.ep - 1) / lay.ep * layers_stage / lay.tp / ep_bw
    mb_time = compute_mb + tp_mb + cp_mb + ep_mb

    # PP: steady state m·v chunks of 1/v the work, plus the bubble (p-1)/(m·v); boundary transfers.
    bubble_fraction = (p - 1) / (m * v) if p > 1 else 0.0
    pp_bw = group_busbw(bw, p, st["pp"], gpus_per_node) * 1e9
    p2p = 2 * s_local * b * h * dtype / lay.tp / pp_bw if p > 1 else 0.0
    pp_p2p = p2p * (m * v + p - 1) * 0.5 if p > 1 else 0.0   # forward + backward, half hidden by compute
    busy = mb_time * m
    bubble = busy * bubble_fraction

    # DP / ZeRO: gradients reduce-scattered (or all-reduced) and parameters all-gathered over dp·cp.
    shard = lay.dp * lay.cp
    dp_stride = min(st["dp"], st["cp"]) if lay.cp > 1 else st["dp"]
    dp_bw = group_busbw(bw, shard, dp_stride, gpus_per_node) * 1e9
    stage_params = (counts.per_layer * layers_stage + (counts.embedding if p == 1 else counts.embedding / p)) / lay.tp
    grad_bytes = stage_params * (4 if train.grad_dtype == "fp32" or train.precision == "fp32" else 2)
    param_bytes = stage_params * dtype
    ring = (shard - 1) / shard
    if shard == 1:
        dp_comm = 0.0
    elif lay.zero == 0:
        dp_comm = 2 * grad_bytes * ring / dp_bw
    elif lay.zero in (1, 2):
        dp_comm = (grad_bytes + param_bytes) * ring / dp_bw
    else:  # ZeRO-3: parameters gathered for forward and again for backward, every micro-batch
        dp_comm = (grad_bytes + 2 * param_bytes * m) * ring / dp_bw
    backward = busy * 2 / 3
    dp_exposed = max(dp_comm * (1 - DP_OVERLAP), dp_comm - backward * DP_OVERLAP)

    step = busy + bubble + pp_p2p + dp_exposed
    world = lay.world
    return Estimate(
        step_time_s=step, compute_s=compute_mb * m, tp_comm_s=tp_mb * m, cp_comm_s=cp_mb * m,
        ep_comm_s=ep_mb * m, pp_p2p_s=pp_p2p, bubble_s=bubble, bubble_fraction=bubble_fraction,
        dp_comm_s=dp_comm, dp_exposed_s=dp_exposed,
        tokens_per_s=train.global_batch * s / step,
        tflops_per_gpu=model_fl / step / world / 1e12,
        mfu=model_fl / step / world / peak, hfu=hw_fl / step / world / peak, efficiency=eff,
    )
