"""Memory ledger: bytes per GPU for state (by optimizer and ZeRO stage), activations (by recompute
mode, TP with sequence parallelism, CP, pipeline in-flight micro-batches), logits, and buffers.

Conventions (the seed's, which are Korthikanti et al.'s and the ZeRO paper's):
- GB are 10^9 bytes; GiB figures from the papers are converted where compared.
- State: bf16/fp16 params 2 B + grads 2 B (4 B when grad_dtype is fp32) + fp32 master 4 B + Adam
  m, v 8 B = 16 B/param (18 with fp32 grads, Megatron's figure). SGD keeps momentum only (12 B),
  8-bit Adam keeps two 1-byte moments (10 B). fp32 training has no separate master copy.
- Activations per layer (2-byte activations, 1-byte dropout masks, Korthikanti Table 2):
  sbh(34 + 5as/h) stored, sbh·34 with selective recompute (attention core recomputed), 2sbh with
  full recompute (layer input only). The bundled trainer's own terms (trainer_layer_activation_bytes)
  differ: SDPA keeps no s² scores, and its selective is op-level (matmul and SDPA outputs kept).
  The 34 is 18 + 4·ffn/h for a GELU MLP of width ffn (Megatron's
  general form); a SwiGLU MLP keeps one more ffn-wide tensor, 18 + 6·ffn/h.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import lru_cache

from launcher.plan.capabilities import SPLIT_BACKWARD, V_SCHEDULES, fp8_converts, padded_model
from launcher.plan.layout import stage_layers
from launcher.plan.model import Layout
from launcher.plan.schedules import rank_order

GB = 1e9
GIB = 2**30

#: What torch's allocator never sees: the CUDA context, cuBLAS workspaces, NCCL's own buffers.
#: Allocator fragmentation is what the headroom below is for.
BUFFER_FIXED_GB = 1.0

#: Fraction of the GPU's memory no plan may use (job file: cluster.memory_headroom): the ledger's
#: estimate is not exact, and a run that needs 99% of HBM fails on the first fragmented allocation.
DEFAULT_HEADROOM = 0.1


# --- parameters ---------------------------------------------------------------------------

@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts by where they live (they shard differently)."""

    embedding: int          # token embedding (first pipeline stage)
    head: int               # output projection (last stage; 0 when tied)
    final_norm: int
    layer_dense: int        # per layer: attention + norms + router + shared experts (replicated across EP)
    layer_expert: int       # per layer: all experts' MLPs (sharded across EP); dense MLP when experts=1
    layers: int
    experts: int
    dense_layers: int = 0   # a MoE model's first layers with a dense MLP instead (model.first_dense_layers)
    dense_layer: int = 0    # one such layer: attention, norms and its ffn_hidden-wide MLP

    @property
    def per_layer(self) -> int:
        """One mixture-of-experts layer (every layer of a dense model)."""
        return self.layer_dense + self.layer_expert

    @property
    def largest_layer(self) -> int:
        return max(self.per_layer, self.dense_layer)

    @property
    def total(self) -> int:
        return self.embedding + self.head + self.final_norm + self.layers_total

    @property
    def layers_total(self) -> int:
        return (self.layers - self.dense_layers) * self.per_layer + self.dense_layers * self.dense_layer

    def active_per_layer(self, experts_per_token: int) -> int:
        """Parameters a token passes through in one (MoE) layer: only its top-k experts."""
        return self.layer_dense + self.layer_expert * experts_per_token // self.experts

    def active_layers(self, experts_per_token: int) -> int:
        """Parameters a token passes through in all the layers (the matmuls' FLOPs: 2 per parameter)."""
        return (self.layers - self.dense_layers) * self.active_per_layer(experts_per_token) + \
            self.dense_layers * self.dense_layer

    def active(self, experts_per_token: int) -> int:
        """Parameters a token uses, embedding and head included (MoE's "activated parameters")."""
        return self.embedding + self.head + self.final_norm + self.active_layers(experts_per_token)


def mlp_params(hidden: int, ffn: int, mlp: str) -> int:
    return (3 if mlp != "gelu" else 2) * hidden * ffn


@lru_cache(maxsize=256)  # the search asks again for every layout of one model
def param_counts(model) -> ParamCounts:
    h = model.hidden
    attn = 2 * h * model.q_width + 2 * h * model.kv_width
    moe = model.experts > 1
    whole = moe_whole_params(model)
    return ParamCounts(
        embedding=model.vocab * h,
        head=0 if model.tied_embeddings else model.vocab * h,
        final_norm=h,
        layer_dense=attn + 2 * h + whole,
        layer_expert=model.experts * mlp_params(h, model.expert_ffn, model.mlp),
        layers=model.layers,
        experts=model.experts,
        dense_layers=model.layers - model.moe_layers if moe else 0,
        dense_layer=attn + 2 * h + mlp_params(h, model.ffn_hidden, model.mlp) if model.layers > model.moe_layers
        and moe else 0,
    )


def moe_whole_params(model) -> int:
    """A MoE layer's parameters every TP rank holds whole and every EP rank replicates: the router and
    the shared experts (moe.MoE)."""
    if model.experts <= 1:
        return 0
    return model.hidden * model.experts + (mlp_params(model.hidden, model.shared_ffn, model.mlp)
                                           if model.shared_experts else 0)


def dense_view(model):
    """A MoE model's dense layers (first_dense_layers) as a dense model of the same attention, for the
    per-layer activation terms (the busier of the two kinds is priced for every layer)."""
    import dataclasses

    return dataclasses.replace(model, experts=1, experts_per_token=1, moe_ffn_hidden=None, shared_experts=0,
                               first_dense_layers=0)


def moe_view(model):
    """A MoE model's mixture-of-experts layers, every layer one (dense_view's counterpart)."""
    import dataclasses

    return dataclasses.replace(model, first_dense_layers=0)


# --- state -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class BytesPerParam:
    param: float
    grad: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.param + self.grad + self.optimizer


OPTIMIZER_STATE_BYTES = {"adam": 8.0, "sgd": 4.0, "adam8bit": 2.0}


def bytes_per_param(optimizer: str = "adam", precision: str = "bf16", grad_dtype: str = "bf16") -> BytesPerParam:
    states = OPTIMIZER_STATE_BYTES[optimizer]
    if precision == "fp32":
        return BytesPerParam(4.0, 4.0, states)
    return BytesPerParam(2.0, 4.0 if grad_dtype == "fp32" else 2.0, 4.0 + states)


def state_bytes(params: float, shard: int, stage: int, bpp: BytesPerParam) -> dict[str, float]:
    """Bytes of params, grads and optimizer state held by one GPU for `params` parameters
    replicated over a sharding group of `shard` GPUs under ZeRO `stage` (0 = DDP)."""
    param, grad, opt = bpp.param * params, bpp.grad * params, bpp.optimizer * params
    if stage >= 1:
        opt /= shard
    if stage >= 2:
        grad /= shard
    if stage >= 3:
        param /= shard
    return {"params": param, "grads": grad, "optimizer": opt}


def per_gpu_state_gb(params_b: float, world: int, stage: int, bpp: BytesPerParam | None = None) -> float:
    """The seed's per_gpu_state_gb: state memory of one GPU (GB), activations excluded."""
    parts = state_bytes(params_b * 1e9, world, stage, bpp or bytes_per_param())
    return sum(parts.values()) / GB


# --- activations -------------------------------------------------------------------------------

def layer_activation_bytes(s: int, b: int, h: int, a: int, mode: str, *, tp: int = 1, cp: int = 1,
                           ffn: int | None = None, mlp: str = "gelu", sequence_parallel: bool = True) -> float:
    """Activation bytes one GPU stores for one transformer layer and one micro-batch.

    With TP and sequence parallelism everything is divided by t (Korthikanti: sbh(34/t + 5as/(ht)));
    without SP the 10·sbh of norms/dropout stays whole (sbh(10 + 24/t + 5as/(ht))). CP divides the
    whole term (each rank keeps s/cp queries; keys and values are gathered per layer).
    """
    ffn = 4 * h if ffn is None else ffn
    linear = 18 + (6 if mlp != "gelu" else 4) * ffn / h      # 34 for a 4h GELU MLP
    sbh = s * b * h
    if mode == "full":
        per = 2 * sbh / (tp if sequence_parallel else 1)
    else:
        if sequence_parallel or tp == 1:
            kept = linear / tp
        else:
            kept = 10 + (linear - 10) / tp
        per = sbh * kept
        if mode == "none":
            per += 5 * a * s * s * b / tp
        elif mode != "selective":
            raise ValueError(f"recompute mode {mode!r}")
    return per / cp


def act_gb(s: int, b: int, h: int, a: int, layers: int, mode: str) -> float:
    """The seed's act_gb: activations of `layers` layers, one micro-batch, no parallelism (GB)."""
    return layer_activation_bytes(s, b, h, a, mode) * layers / GB


def in_flight_microbatches(schedule: str, pp: int, grad_accum: int, virtual_stages: int = 1, rank: int = 0) -> float:
    """Micro-batches whose activations pipeline rank `rank` holds at its peak, as a multiple of one
    micro-batch of that rank's layers. 1F1B: min(m, p - rank); interleaved (torch's and Megatron's
    warm-up of (v-1)·p + 2(p-1-rank) chunks, plus one): rank 0 holds p·(1 + (p-1)/(p·v));
    GPipe: all m. Without a pipeline, one micro-batch at a time."""
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(grad_accum)
    if schedule == "interleaved-1f1b" and virtual_stages > 1:
        v = virtual_stages
        chunks = min((v - 1) * pp + 2 * (pp - 1 - rank) + 1, grad_accum * v)
        return chunks / v
    return float(min(grad_accum, pp - rank))


def logits_bytes(s: int, b: int, vocab: int, *, tp: int = 1, cp: int = 1, chunk: int | None = None) -> float:
    """The logits of the last stage: bf16 logits kept for backward plus their fp32 upcast (6 B per
    element), vocab-parallel over TP. A chunked loss holds only `chunk` tokens' worth at a time."""
    tokens = s * b / cp
    if chunk is not None:
        tokens = min(tokens, chunk)
    return tokens * vocab / tp * 6


def tp_bytes_per_step(s: int, b: int, h: int, layers: int, tp: int, dtype_bytes: int = 2) -> float:
    """The seed's tp_bytes_per_step: bytes one GPU moves for TP per micro-batch (ring all-reduce)."""
    tensor = s * b * h * dtype_bytes
    ring = 2 * (tp - 1) / tp
    return 4 * tensor * ring * layers


def bubble_ratio(stages: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Pipeline bubble as a fraction of useful time: (p-1)/(m·v)."""
    return (stages - 1) / (micro_batches * virtual_stages)


# --- what the bundled trainer allocates ------------------------------------------------------------
# The seed's formulas above stay as they are (`launch memory` prints them). Planning uses the terms
# below: each is what launcher/trainer/ really allocates for one rank, with where it comes from.

#: The trainer sums ZeRO 0/1 gradients in flat buckets of at most this many elements (fsdp.all_reduce_grads).
ALLREDUCE_BUCKET_ELEMS = 1 << 25
#: 8-bit AdamW (optim8bit.py): int8 + uint8 moments and one fp32 absmax per 256 values for each.
ADAM8BIT_STATE_BYTES = 2.0 + 2 * 4 / 256
TRAINER_STATE_BYTES = {"adam": 8.0, "sgd": 4.0, "adam8bit": ADAM8BIT_STATE_BYTES}


@dataclass(frozen=True)
class Numerics:
    """How the trainer holds numbers for a plan (engine.py, fsdp.py).

    - fp32: everything fp32 (precision fp32, or any run on a CPU).
    - fsdp-bf16: ZeRO 2/3 over dp·cp > 1: fully_shard with MixedPrecisionPolicy(bf16 params, fp32
      reduce): fp32 sharded params, grads and optimizer state; bf16 gathered params and activations.
    - bf16: without FSDP (ZeRO 0/1 or dp·cp = 1): the weights themselves in bf16, their gradients in
      bf16 (or an fp32 buffer: train.grad_dtype), fp32 masters and optimizer state in the lean optimizer
      (dist_optim.py); activations and the residual stream bf16.
    """

    mode: str
    fp8: str = ""       # train.fp8_linears under train.precision fp8 (capabilities.fp8_converts), else ""

    @property
    def act(self) -> int:
        """Bytes of a matmul output and what follows it (attention, MLP)."""
        return 4 if self.mode == "fp32" else 2

    @property
    def residual(self) -> int:
        """Bytes of the residual stream (block inputs/outputs, norm inputs)."""
        return 4 if self.mode == "fp32" else 2

    @property
    def gathered(self) -> int:
        """Bytes of a weight as the matmuls use it (an FSDP-gathered one: MixedPrecisionPolicy.param_dtype;
        without FSDP the weight itself), and of its gradient as backward delivers it."""
        return 4 if self.mode == "fp32" else 2


def trainer_numerics(train, gpu, lay: Layout) -> Numerics:
    fsdp = lay.zero >= 2 and lay.dp * lay.cp > 1
    bf16 = train.precision != "fp32" and getattr(gpu, "name", "") != "cpu"   # the trainer runs fp32 on CPU
    fp8 = getattr(train, "fp8_linears", "auto") if train.precision == "fp8" else ""   # bf16 (or CPU fp32) with fp8 GEMMs
    if not bf16:
        return Numerics("fp32", fp8)
    return Numerics("fsdp-bf16" if fsdp else "bf16", fp8)


@lru_cache(maxsize=4096)  # the same (model, shape, degrees) recurs across ZeRO stages and pp
def trainer_layer_activation_bytes(model, s: int, b: int, mode: str, num: Numerics, *, tp: int = 1,
                                   cp: int = 1, ep: int = 1, cp_attention: str = "all-gather") -> float:
    """Bytes one rank keeps for backward for one transformer layer and one micro-batch, as the
    trainer's Block saves them (model.py; SDPA never materialises the s×s scores). A MoE model with dense
    first layers: the busier of its two kinds of layer."""
    if model.experts > 1 and model.first_dense_layers:
        kw = dict(tp=tp, cp=cp, ep=ep, cp_attention=cp_attention)
        return max(trainer_layer_activation_bytes(dense_view(model), s, b, mode, num, **kw),
                   trainer_layer_activation_bytes(moe_view(model), s, b, mode, num, **kw))
    h, a = model.hidden, model.heads
    hq, hkv = model.q_width, model.kv_width
    tokens = s / cp * b                    # this CP rank's tokens; TP all-gathers them before the matmuls
    sp = tp                                # with TP the norms run sequence-parallel on tokens/tp
    e, r = num.act, num.residual
    if mode == "full":
        # checkpoint(block) keeps the block input only (a sequence shard under TP)
        return r * h * tokens / sp
    if mode == "selective":
        return selective_layer_bytes(model, tokens, tp, num)
    # two RMSNorms: the fp32 input (x, or x.float()) and the normalised x before the weight multiply
    norms = 2 * (4 + r) * h * tokens / sp
    # the normed input of the attention's and the MLP's matmuls: under TP the sequence shard, which the
    # sequence-parallel linears keep and gather again in backward (trainer/sequence_parallel.py; a MoE routes
    # each TP rank's own sequence shard, moe_tokens)
    mt, mtp = moe_tokens(model, tokens, tp)
    linear_in = 2 * e * h * tokens / tp
    # SDPA keeps q, k (after RoPE; RoPE itself keeps only its cos/sin tables) and v, its output (which
    # wo keeps as its input, a view) and its fp32 logsumexp
    if mode != "none":
        raise ValueError(f"recompute mode {mode!r}")
    attn = (2 * hq + 2 * hkv) / tp * e * tokens + a / tp * 4 * tokens
    if cp > 1 and cp_attention == "all-to-all":
        # all-to-all (context_parallel.UlyssesAttention): SDPA keeps the exchanged q, k, v and its output, [heads/cp,
        # s] as many bytes as the rank's own [heads, s/cp] (k and v: kv heads repeated up to cp where fewer), and
        # the output exchanged back is one more copy, which wo keeps
        attn += 2 * (ulysses_kv_width(model, tp, cp) - hkv / tp) * e * tokens + hq / tp * e * tokens
    elif cp > 1:
        # K and V all-gathered over CP (context_parallel.py), kept by SDPA; its two query chunks' outputs
        # are kept by SDPA and joined into one more copy that wo keeps
        attn += 2 * hkv / tp * e * s * b + hq / tp * e * tokens
    return norms + linear_in + attn + mlp_activation_bytes(model, mt, mtp, e, ep=ep)


def ulysses_kv_width(model, tp: int, cp: int) -> float:
    """Width of one rank's keys (or values) as all-to-all CP exchanges them: its kv heads after TP, repeated up
    to cp where fewer (context_parallel.kv_repeats)."""
    return max(model.kv_heads // tp, cp) * model.head_dim


def moe_tokens(model, tokens: float, tp: int) -> tuple[float, int]:
    """(tokens, tp) as a block's MLP sees them: a dense MLP gets the all-gathered tokens and splits its
    width over TP; a MoE routes each TP rank's own sequence shard through whole experts (expert TP 1,
    tensor_parallel.block_plan)."""
    return (tokens / tp, 1) if model.experts > 1 else (tokens, tp)


def selective_layer_bytes(model, tokens: float, tp: int, num: Numerics) -> float:
    """What op-level selective recompute (trainer/recompute.py) keeps per layer: the block input and
    the outputs of the matmuls, SDPA and the TP collectives; norms, RoPE, activations are recomputed."""
    h, a, e, r = model.hidden, model.heads, num.act, num.residual
    hq, hkv = model.q_width, model.kv_width
    kept = r * h * tokens / tp                               # the block input (a sequence shard under TP)
    kept += (2 * hq + 2 * hkv) / tp * e * tokens             # wq, wk, wv outputs and SDPA's output
    kept += a / tp * 4 * tokens                              # SDPA's fp32 logsumexp
    moe = model.experts > 1
    if tp > 1:
        # the row-parallel linears' outputs, sequence shards (a MoE block: attention's only, moe_tokens); what
        # the sequence-parallel linears gather they gather again in their own backward (recompute.SAVED_OPS)
        kept += (1 if moe else 2) * h / tp * e * tokens
    else:
        kept += (1 if moe else 2) * h * e * tokens           # wo's (and w2's) matmul outputs
    mats = 2 if model.mlp != "gelu" else 1                 # w1 (and w3) outputs
    if not moe:
        return kept + mats * model.ffn_hidden / tp * e * tokens
    k = model.experts_per_token
    # the router's logits, and per routed (token, expert) pair its experts' matmul outputs
    return kept + tokens / tp * (model.experts * e + k * (mats * model.expert_ffn + h) * e
                                 + (mats * model.shared_ffn + h) * e * (model.shared_experts > 0))


def compiled_layer_savings(model, tokens: float, tp: int, num: Numerics, recompute: str = "none") -> float:
    """Bytes a compiled block (plan.layout.compile) does not keep for backward that the eager one does, per layer
    and micro-batch (negative: it keeps more). AOTAutograd's min-cut partition (torch/_functorch/partitioners.py,
    what inductor compiles) saves the cheapest set of the joint graph's tensors backward can start from and
    recomputes the rest. Without recompute: in place of each RMSNorm's fp32 input and normalised copy (4 + r B per
    element) it keeps the norm's input itself, the block's input and its middle residual (r B per element each),
    and the fp32 rsqrt per token, and recomputes the norms from them; of a gated MLP it recomputes the activation
    (silu or gelu of w1's output, e B per element of its width). Under TP it recomputes no collective: the
    all-gather each sequence-parallel linear repeats in its backward (sequence_parallel.gather_linear, attention's
    and the MLP's) runs in the forward instead and its full-sequence output is kept, where the eager op keeps its
    input's shard: 2·e·h·(1 - 1/tp) more. Measured on the trainer's block by its saved tensors, the block input
    beside them (Llama 3 8B's widths, bf16: 49.0 hidden widths a token eager, 34.0 compiled; at tp 2 the two
    gathered inputs in place of their shards) and traced (tests/unit/test_compile_plan.py). Selective recompute keeps
    what its policy says but for those gathered inputs (traced at Llama 3 8B: tp 1 8% under this, tp 8 6% over);
    full recompute keeps the block input either way (not compiled under tp > 1: capabilities.compile_problem).
    torchtitan's Llama 3.1 8B on 8 H100 (selective AC) reports 82.4 GiB eager, 77.0 compiled
    (benchmarks/llama3_h100_202412_torchtitan.md, Table 1)."""
    if model.experts > 1 or recompute == "full":
        return 0.0                      # MoE: not compiled (capabilities.compile_problem)
    r, e, h = num.residual, num.act, model.hidden
    regathered = 2 * e * h * (1 - 1 / tp) * tokens
    if recompute == "selective":
        return -regathered
    norms = 2 * (4 + r) * h - 2 * r * h - 2 * 4
    gated = e * model.ffn_hidden / tp if model.mlp != "gelu" else 0.0
    return norms * tokens / tp + gated * tokens - regathered


def mlp_activation_bytes(model, tokens: float, tp: int, e: int, input_copies: int = 1, ep: int = 1) -> float:
    """The MLP's saved tensors: SwiGLU w1 out, silu(w1), w3 out, their product (w2's input); GELU two.
    MoE: `input_copies` of each routed row in the matmul dtype (the gathered rows themselves, shared
    by the expert's Linears)."""
    f = model.expert_ffn / tp
    per_row = (4 if model.mlp != "gelu" else 2) * f * e
    if model.experts == 1:
        return per_row * tokens
    # shared experts (moe.MoE.shared): a dense MLP on the same rows, its output added
    shared = (4 if model.mlp != "gelu" else 2) * model.shared_ffn * e * tokens
    k, E, h = model.experts_per_token, model.experts, model.hidden
    # MoE (moe.py): the fp32 router softmax, the top-k weights and int64 routing indices (≈32 B per
    # pair), and per routed (token, expert) pair its gathered input (input_copies), the expert MLP, the
    # output kept for the gate multiply and the gated output index_add keeps. Every expert runs, on
    # however many rows it is routed (zero included), and the rows sum to tokens·k: nothing here
    # depends on the routing
    # with EP the experts' concatenated output (moe.MoE._experts: torch.cat, before its order is restored
    # and sent back) is kept as well (traced)
    kept_out = 3 if ep > 1 else 2
    return tokens * (E * 4 + 4 + k * (32 + (input_copies + kept_out) * h * e + per_row)) + shared


@dataclass(frozen=True)
class RankParams:
    """Parameters one rank holds, local to it (after TP and EP), by how FSDP treats them."""

    blocks_dense: float     # its transformer blocks: attention, norms (÷tp), the router (whole)
    blocks_expert: float    # its experts (÷ep; whole under TP), an FSDP unit of their own with ep > 1
    root: float             # embedding / output head / final norm: everything outside the blocks (÷tp)
    head: float             # the weight the loss multiplies with on this rank (0 without the head)
    largest: float          # the largest single local parameter (per-parameter optimizer temporaries)
    block: float            # one block's dense + expert parameters (one FSDP all-gather)
    block_mlp: float = 0.0  # one FSDP unit's MLP parameters: the block's MLP or experts, one expert with EP
    embedding_unit: float = 0.0   # the embedding as an FSDP unit of its own (fsdp.apply_fsdp; not a tied head)
    head_unit: float = 0.0        # the final norm and output head, one FSDP unit (a tied copy under PP)

    @property
    def total(self) -> float:
        return self.blocks_dense + self.blocks_expert + self.root

    @property
    def root_unit(self) -> float:
        """What FSDP's root unit holds: a tied embedding that is also this stage's head, with the final norm."""
        return self.root - self.embedding_unit - self.head_unit


def pp_rank_of(lay: Layout, role: str | int) -> int:
    """'first' (pipeline rank 0), 'last' (rank pp-1) or a pipeline rank."""
    return 0 if role == "first" else lay.pp - 1 if role == "last" else int(role)


def rank_layers(model, lay: Layout, role: str | int) -> int:
    """Layers pipeline rank `role` holds: its stages r, r + pp, ... of the plan's split, or r and 2·pp-1-r
    under a V schedule (layout.stage_layers: uneven splits give the first and last stage the smaller share)."""
    return _rank_layer_counts(model.layers, lay.pp, max(1, lay.virtual_stages), _vee(lay))[pp_rank_of(lay, role)]


def _vee(lay: Layout) -> bool:
    """The V stage layout (capabilities.rank_stages): rank r holds stages r and 2·pp-1-r."""
    return lay.schedule in V_SCHEDULES


def _ends(lay: Layout, r: int) -> tuple[bool, bool]:
    """Whether pipeline rank r holds the first stage (the embedding) and the last (the head and the loss):
    ranks 0 and pp-1, both rank 0 under a V."""
    return r == 0, r == (0 if _vee(lay) else lay.pp - 1)


def _stages_of(pp: int, v: int, r: int, vee: bool) -> tuple[int, ...]:
    return (r, 2 * pp - 1 - r) if vee else tuple(range(r, pp * v, pp))


@lru_cache(maxsize=1024)  # the search asks for every layout
def _rank_layer_counts(layers: int, pp: int, v: int, vee: bool = False) -> tuple[int, ...]:
    split = stage_layers(layers, pp * v)
    return tuple(sum(split[s] for s in _stages_of(pp, v, r, vee)) for r in range(pp))


@lru_cache(maxsize=4096)
def _chunk_layer_counts(layers: int, pp: int, v: int, r: int, vee: bool = False) -> tuple[int, ...]:
    """The layers of each of pipeline rank r's v model chunks (stage_layers over pp·v stages)."""
    split = stage_layers(layers, pp * v)
    return tuple(split[s] for s in _stages_of(pp, v, r, vee))


@lru_cache(maxsize=1024)
def _candidate_ranks(layers: int, pp: int, v: int, vee: bool = False) -> tuple[int, ...]:
    """Pipeline ranks that can be the busiest (busiest_rank): both ends, and each middle layer count's
    lowest rank (the most micro-batches in flight among ranks holding that many layers)."""
    counts = _rank_layer_counts(layers, pp, v, vee)
    middle: dict[int, int] = {}
    for r in range(1, pp - 1):
        middle.setdefault(counts[r], r)
    return tuple(sorted({0, pp - 1, *middle.values()}))


def rank_params(model, lay: Layout, role: str | int) -> RankParams:
    """Parameters of pipeline rank `role` ('first', 'last' or a rank): rank 0 holds the embedding
    (and, with pp = 1, the head), rank pp-1 the output head and final norm (model.keep_only)."""
    return _rank_params(model, lay.tp, lay.pp, lay.ep, max(1, lay.virtual_stages), pp_rank_of(lay, role), _vee(lay))


@lru_cache(maxsize=4096)  # one split's: the same for every micro-batch, recompute and ZeRO stage the search prices
def _rank_params(model, t: int, pp: int, ep: int, v: int, r: int, vee: bool = False) -> RankParams:
    c = param_counts(model)
    layers = _rank_layer_counts(model.layers, pp, v, vee)[r]
    # a MoE's router and experts are whole on every TP rank (expert TP 1), the rest of the block split over TP
    et = 1 if model.experts > 1 else t
    router = moe_whole_params(model)          # the router and shared experts, whole under TP
    dense_here = _rank_dense_layers(model.layers, pp, v, r, c.dense_layers, vee)   # first_dense_layers held here
    moe_here = layers - dense_here
    dense = ((c.layer_dense - router) / t + router) * moe_here + c.dense_layer / t * dense_here
    expert = c.layer_expert * moe_here / (et * ep)
    vh = model.vocab * model.hidden / t
    has_embedding, has_head = r == 0, r == (0 if vee else pp - 1)
    embedding_part = c.embedding / t if has_embedding else 0.0
    head_part, head_w = 0.0, 0.0
    if has_head:
        tied_copy = c.embedding if model.tied_embeddings and pp > 1 else 0   # model.keep_only
        head_part = (c.head + tied_copy + c.final_norm) / t
        head_w = vh          # the untied head, or the (tied) embedding the loss multiplies with
    root = embedding_part + head_part
    # FSDP's units outside the blocks (fsdp.apply_fsdp): the embedding, and the norm with the head, each its own,
    # but where the embedding is also this stage's head (tied, pp = 1): both stay in the root
    tied_here = has_embedding and has_head and model.tied_embeddings and pp == 1
    embedding_unit, head_unit = (0.0, 0.0) if tied_here else (embedding_part, head_part)
    largest = max(vh if root else 0.0, model.expert_ffn * model.hidden / et, model.q_width * model.hidden / t,
                  model.ffn_hidden * model.hidden / t if dense_here else 0.0)
    moe_block = (c.layer_dense - router) / t + router + c.layer_expert / (et * ep)
    block = max(moe_block if moe_here or not dense_here else 0.0, c.dense_layer / t if dense_here else 0.0)
    # the MLP weights whose gradients wait for one FSDP post-backward: the block's (all its experts), or
    # with EP one expert's (each expert is its own FSDP unit: fsdp.apply_fsdp)
    mlp_unit = c.layer_expert / (et * ep) if ep == 1 else c.layer_expert / (et * c.experts)
    if dense_here:
        mlp_unit = max(mlp_unit, mlp_params(model.hidden, model.ffn_hidden, model.mlp) / t)
    return RankParams(dense, expert, root, head_w, largest, block, mlp_unit, embedding_unit, head_unit)


@lru_cache(maxsize=4096)
def _rank_dense_layers(layers: int, pp: int, v: int, r: int, first_dense: int, vee: bool = False) -> int:
    """How many of the first `first_dense` layers pipeline rank r holds (its stages r, r + pp, ...)."""
    if not first_dense:
        return 0
    split = stage_layers(layers, pp * v)
    starts = [sum(split[:i]) for i in range(len(split))]
    return sum(max(0, min(starts[i] + split[i], first_dense) - starts[i]) for i in _stages_of(pp, v, r, vee))


def optimizer_temp_bytes(train, gpu, local_params: float, largest: float) -> float:
    """What optimizer.step allocates beyond its state: nothing for AdamW (engine.make_optimizer: fused, in
    place); 8-bit AdamW dequantises m, v and builds the update per parameter (optim8bit.py). SGD with
    weight decay adds it to a copy of the fp32 gradients: all at once under foreach (GPU), one at a
    time on a CPU; without weight decay it updates in place."""
    foreach = getattr(gpu, "name", "") != "cpu"
    if train.optimizer == "adam8bit":
        return 20 * largest
    if train.optimizer == "sgd":
        return 0.0 if not train.weight_decay else 4 * local_params if foreach else 4 * largest
    return 0.0


def logits_chunk_bytes(train, model, lay: Layout, num: Numerics) -> float:
    """The chunked loss (loss.py): one checkpointed chunk of `loss_chunk` tokens' logits exists at a time.
    At its backward's peak (in log-softmax's backward) the recomputed chunk holds three fp32 [n, V/tp]
    tensors: log-softmax's output, nll's gradient and log-softmax's gradient (12 B per element; the
    bf16 logits are already freed); the vocab-parallel loss (TP) keeps exp(z) and gathers and scatters
    through one more (16 B). The chunk's hidden states are a view."""
    tokens = min(train.loss_chunk, train.seq_len / lay.cp * lay.micro_batch)
    return tokens * model.vocab / lay.tp * (16 if lay.tp > 1 else 12)


def mlp_backward_bytes(model, tokens: float, tp: int, e: int) -> float:
    """The MLP's backward working set (autograd temporaries, traced): w2's input gradient and, for
    SwiGLU, the gradients of silu(w1 x) and w3 x, each [tokens, ffn/tp] in the matmul dtype."""
    return (3 if model.mlp != "gelu" else 2) * tokens * model.expert_ffn / tp * e


def selective_recomputed_bytes(model, tokens: float, seq_tokens: float, tp: int, num: Numerics,
                               kv_exchanged: float = 0.0) -> float:
    """What op-level selective recompute (recompute.py) makes again in a dense block's backward and holds
    while the MLP's backward runs (torch's checkpoint replays the whole block at its first unpack): the
    norms' fp32 input and normalised output, the matmuls' inputs (the normed input, all-gathered under TP),
    q and k after RoPE, and
    SwiGLU's silu(w1 x) (the gate's backward needs it). The gate product (GELU: the activation), w2's
    input, is counted in dense_mlp_backward_bytes: it is freed once w2's backward has run."""
    h, e, r = model.hidden, num.act, num.residual
    hq, hkv = model.q_width, model.kv_width
    out = 2 * (4 + r) * h * tokens / tp                      # both RMSNorms (sequence-parallel under TP)
    # the matmuls' input: the norm weight's product (a sequence shard under TP: the sequence-parallel linears'
    # outputs are kept, so the replay never gathers)
    out += 2 * e * h * tokens / tp
    out += (hq + hkv) / tp * e * tokens                      # apply_rope's q and k
    if kv_exchanged:
        # all-to-all CP: its exchange is not a kept op: the exchanged q, k and v (k and v `kv_exchanged` wide,
        # ulysses_kv_width) are made again and held for SDPA's backward (traced)
        out += (hq / tp + 2 * kv_exchanged) * e * tokens
    elif seq_tokens > tokens:
        # CP: _GatherKV's all_gather is not a kept op: the gathered keys and values are made again
        out += 2 * hkv / tp * e * seq_tokens
    if model.mlp != "gelu":
        out += model.ffn_hidden / tp * e * tokens            # silu(w1 x)
    return out


def dense_mlp_backward_bytes(model, tokens: float, lay: Layout, num: Numerics, fsdp: bool,
                             grad_bytes: float = 0.0) -> tuple[float, float, float]:
    """(what the moment adds to the activations, its temporaries, its gradients): a dense MLP's backward working set
    at its larger moment (traced): w2's backward (its input gradient [tokens, ffn/tp], its weight gradient [hidden,
    ffn/tp] as the mm makes it, under TP the block output's gradient all-gathered for it, and under selective
    recompute w2's recomputed input), the activation's backward (w2's input gradient and the gradients of silu(w1 x)
    and w3 x; GELU: of w1 x), w3's or w1's, while FSDP keeps each unsharded weight gradient until the block's
    post-backward. By the
    activation's backward w2's stored (or recomputed) input is freed: taken off the activations (what recompute
    remakes is filed as activations, as the trace files it). `grad_bytes`: bytes an element of a weight's gradient
    in .grad where a first backward without FSDP leaves it as each linear's backward ends (the lean optimizer's;
    AccumulateGrad runs before the next linear's backward, traced), 0 elsewhere (FSDP holds them as temporaries
    until the block's post-backward; a later backward adds them into .grad in place)."""
    e, h, f = num.act, model.hidden, model.ffn_hidden / lay.tp
    done = grad_bytes * h * f                            # one finished linear's gradient in .grad
    row = f * e * tokens
    wgrad = h * f * e
    selective = lay.recompute == "selective"
    # (w2's input remade by selective recompute, until its backward has run)
    remade = row if selective else 0.0
    at_w2 = remade, row + wgrad + (h * e * tokens if lay.tp > 1 else 0.0)
    w2_input = 0.0, 0.0
    w1_input = at_w3 = 0.0, 0.0, 0.0
    if lay.tp > 1:
        # linear_scatter's backward (sequence_parallel.py): beside the block output's gradient (a sequence shard of
        # the residual stream's) its all-gather, and with several sequences a micro-batch two copies of that
        # sequence-major gather: the reshape the weight gradient reads and the one g @ w folds it into (bf16: fp8's
        # input gradient reads the first), while the input gradient is made (the weight gradient after it; traced)
        gathered, copies = e * h * tokens, (e * h * tokens if lay.micro_batch > 1 else 0.0)
        fold = 0.0 if num.fp8 and fp8_converts(h, model.ffn_hidden, num.fp8) else copies
        out_grad = num.residual * h * tokens / lay.tp
        at_w2 = remade, out_grad + gathered + copies + row + wgrad
        w2_input = remade, out_grad + gathered + copies + fold + row
    at_act = -(0.0 if selective else row), (3 if model.mlp != "gelu" else 2) * row + (wgrad if fsdp else 0.0), done
    # w1's (and w3's) backward: the activation's gradients and the MLP input's gradient, summed over its
    # consumers; by then the MLP's own saved tensors are freed (stored: w1, w3 outputs, silu, product;
    # selective: w1, w3 outputs and the recomputed silu): taken off the activations
    mats = 2 if model.mlp != "gelu" else 1
    freed = (2 * mats if not selective else 2 * mats - 1) * row
    # w1's backward: the gradient of its output, w3's and w1's input gradients [tokens, hidden] (w3's done, w1's
    # being made) and, under FSDP, every MLP weight's unsharded gradient (w2, w3, w1) until the block's post-backward
    at_in = row + mats * e * h * tokens + ((mats + 1) * wgrad if fsdp else 0.0)
    # without FSDP: w1's gradient as its GEMM makes it, beside the finished ones in .grad (w2's and w3's)
    in_made = mats * done
    if not fsdp:
        at_in += wgrad
    if lay.tp > 1:
        # the sequence-parallel gather_linear's backward (w1 and w3 at once, sequence_parallel.py): the weight
        # gradients first (from the input gathered again), which it returns with the input gradient, then the sum
        # of w1's and w3's input gradients [tokens, hidden], reduce-scattered from a sequence-major copy where the
        # micro-batch is several sequences (a view for one): both outputs' gradients, the block output's gradient
        # (a sequence shard), and under FSDP w2's unsharded one (traced)
        in_made = done
        at_in = mats * row + max(mats, 2 if lay.micro_batch > 1 else 1) * e * h * tokens \
            + num.residual * h * tokens / lay.tp + (mats + (1 if fsdp else 0)) * wgrad
    if num.fp8:
        # fp8 (trainer/float8.py): a converted linear's backward casts its operands to e4m3, each cast holding an fp32
        # copy at its peak (torchao's out-of-place scaling and saturation: 8 B an element beside the e4m3 result; the
        # sequence-parallel ops' in place: 4 + 1). w2's largest is its input cast along the tokens for the weight
        # gradient, beside the output gradient's two e4m3 copies and the e4m3 weight; w1's (and w3's) the input
        # gradient's casts, or its output gradient's along the tokens for the weight gradient
        cast = 8 if lay.tp == 1 else 5
        if fp8_converts(h, model.ffn_hidden, num.fp8) and lay.tp == 1:
            # torchao's backward: the input gradient first (the output gradient cast along the hidden width, then
            # the weight beside its e4m3 copy), then the weight gradient's casts along the tokens (of the input, 8
            # B an element beside its e4m3 copy), before its GEMM: beside the block output's gradient
            out_grad = num.residual * h * tokens
            w2_input = remade, out_grad + max((cast + 1) * h * tokens, h * tokens + (cast + 1) * h * f)
            at_w2 = remade, out_grad + row + (cast + 1) * f * tokens + 2 * h * tokens + h * f
        elif fp8_converts(h, model.ffn_hidden, num.fp8):
            at_w2 = at_w2[0], at_w2[1] + cast * f * tokens + 2 * h * tokens + h * f
        if fp8_converts(model.ffn_hidden, h, num.fp8):
            # the input gradient's GEMM casts the output gradient along the ffn width, then the weight [ffn/tp,
            # hidden] beside that gradient's e4m3 copy (its fp32 copies and the e4m3 result: where hidden > tokens
            # the larger)
            in_gemm = max(cast * f * tokens, f * tokens + (cast + (1 if lay.tp == 1 else 0)) * h * f)
            if lay.tp == 1:
                # torchao's backward makes the input gradient first: w1's weight gradient is not made yet, nor its
                # input gradient (the block output's gradient beside w3's); its weight gradient's GEMM then casts
                # the output gradient along the tokens
                w1_input = -freed, row + mats * e * h * tokens + ((mats * wgrad) if fsdp else 0.0) + in_gemm, \
                    mats * done
                at_in += cast * f * tokens
            else:
                at_in += in_gemm          # the sequence-parallel op: the weight gradients first, then the input's
    if mats == 2 and lay.tp == 1:
        # a gated MLP's w3 backward (its own nn.Linear at tp 1: the sequence-parallel op runs w1 and w3 at once):
        # the gradients of silu(w1 x) and w3 x, the block output's gradient, FSDP's unsharded w2 gradient, and its
        # input gradient's GEMM ([tokens, hidden], or fp8's casts); w1's output is still kept (silu's backward)
        w3_gemm = in_gemm if num.fp8 and fp8_converts(model.ffn_hidden, h, num.fp8) else e * h * tokens
        at_w3 = -(freed - row), 2 * row + num.residual * h * tokens + (wgrad if fsdp else 0.0) + w3_gemm, done
    return max((*at_w2, 0.0), (*w2_input, 0.0), at_act, at_w3, w1_input, (-freed, at_in, in_made), key=sum)


def rope_buffer_bytes(model, train, lay: Layout, num: Numerics) -> float:
    """RoPE cos/sin tables, buffers of each of the rank's model parts (model.Transformer): [seq/cp,
    head_dim] twice per part (one part per virtual stage), in the compute dtype (no cast per block).
    None under ALiBi (alibi_bias_bytes: made in the first forward, an activation as the trace files it)."""
    if model.position == "alibi":
        return 0.0
    return 2 * num.act * model.head_dim * train.seq_len / lay.cp * max(1, lay.virtual_stages)


def alibi_bias_bytes(model, train, lay: Layout, num: Numerics) -> float:
    """ALiBi's cached bias (model.AlibiBias), made by each model part's first forward and kept: [heads/tp, s, s]
    in the compute dtype, under CP one per query chunk against its prefix of keys (c × (r+1)c and c × (2cp−r)c,
    c = s/2cp); under all-to-all CP one [heads/tp/cp, s, s] for the rank's head group."""
    if model.position != "alibi":
        return 0.0
    s, c = train.seq_len, train.seq_len / (2 * lay.cp)
    if lay.cp > 1 and lay.cp_attention == "all-to-all":
        return model.heads / lay.tp / lay.cp * s * s * num.act * max(1, lay.virtual_stages)
    keys = s * s if lay.cp == 1 else c * c * (2 * lay.cp + 1)
    return model.heads / lay.tp * keys * num.act * max(1, lay.virtual_stages)


@dataclass(frozen=True)
class RankMemory:
    """Peak bytes of one rank by category, and the phase where the peak falls."""

    params: float
    grads: float
    optimizer: float
    activations: float
    temporaries: float
    comm_buffers: float
    phase: str

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.temporaries + self.comm_buffers


def rank_memory(model, train, gpu, lay: Layout, role: str | int) -> RankMemory:
    """Peak memory of pipeline rank `role` ('first', 'last' or a rank) as the trainer runs the plan."""
    m = _rank_memory(model, train, gpu, lay, role)
    assert m is not None                             # no limit: always priced
    return m


def _rank_memory(model, train, gpu, lay: Layout, role: str | int, limit_gb: float = math.inf) -> RankMemory | None:
    """rank_memory, or None as soon as the rank's state alone (params and optimizer state: in every moment
    rank_memory prices) is over `limit_gb`
    (as MemoryLedger.per_gpu_gb): many layouts the search rejects are rejected there, unpriced. The
    vocabulary is the padded one the trainer builds (capabilities.padded_vocab)."""
    model = padded_model(model, lay.tp)
    num = trainer_numerics(train, gpu, lay)
    rp = rank_params(model, lay, role)
    # FSDP / ZeRO 1 group: dp·cp (mesh.dp_cp_mesh), or dp_shard·cp under hybrid sharding (mesh.shard_mesh; the
    # replicas hold copies: ZeRO's state ÷ dp_shard·cp, torchtitan's 16 B/param ÷ (dp_shard·cp))
    n = lay.shard_group
    n_exp = max(1, n // lay.ep)                      # an expert's replicas: dp·cp/ep
    fsdp = lay.zero >= 2 and n > 1
    opt_b = TRAINER_STATE_BYTES[train.optimizer]
    dense = rp.blocks_dense + rp.root
    buffers = rope_buffer_bytes(model, train, lay, num)
    # --- state: fp32 params and grads (the optimizer's masters), sharded by FSDP under ZeRO 2/3
    if fsdp:
        params = 4 * (dense / n + rp.blocks_expert / n_exp)
        grads = step_grads = 4 * (dense / n + rp.blocks_expert / n_exp)
        optimizer = opt_b * (dense / n + rp.blocks_expert / n_exp)
        gathered = num.gathered
        params += outside_gathered(lay, num, rp)
        if lay.zero == 2:
            # ZeRO 2 keeps every block gathered from forward to backward (under PP, torch's pipelining
            # also disables reshard-after-backward until the last micro-batch: stage.py); ZeRO 3 blocks
            # are resharded after each forward, so at the peak only the block in backward is gathered
            params += gathered * (rp.blocks_dense + rp.blocks_expert)
        if lay.pp > 1:
            # ... and gradient sync: unsharded grads accumulate in the fp32 reduce dtype for the whole
            # stage; the sharded ones appear only at the final reduce-scatter, after the activations
            grads = 4 * rp.total
    else:
        # ZeRO 0/1 (dist_optim.py): the weights in their own dtype and their gradients in it (or grad_dtype
        # fp32's buffer, into which each micro-batch's gradient is added and released); the fp32 masters and the optimizer's state of the even share the rank steps: every
        # tensor chunked over dp·cp under ZeRO 1 (EP experts over their dp·cp/ep replicas), all of it under 0
        w = num.gathered
        params = w * rp.total
        grads = 4 * rp.total if train.grad_dtype == "fp32" and w == 2 else w * rp.total
        owned = dense / n + rp.blocks_expert / n_exp if lay.zero == 1 else dense + rp.blocks_expert
        optimizer = (4 + opt_b) * owned
        step_grads = 4 * owned                   # the fp32 shard the reduce leaves (the weights' are released)
    if _per_gpu_gb(params + buffers + optimizer) > limit_gb:
        return None
    # --- activations: per micro-batch × the schedule's in-flight micro-batches
    s, b = train.seq_len, lay.micro_batch
    per_layer = trainer_layer_activation_bytes(model, s, b, lay.recompute, num, tp=lay.tp, cp=lay.cp, ep=lay.ep,
                                               cp_attention=lay.cp_attention)
    tokens = s / lay.cp * b
    if lay.compile:
        per_layer -= compiled_layer_savings(model, tokens, lay.tp, num, lay.recompute)
    layers = rank_layers(model, lay, role)
    held = in_flight_microbatches(lay.schedule, lay.pp, lay.grad_accum, lay.virtual_stages,
                                  rank=pp_rank_of(lay, role))
    r = pp_rank_of(lay, role)

    def acts_at(in_flight: float) -> float:
        """The stored activations with `in_flight` micro-batches in flight, and what the pipeline keeps."""
        # the step's token ids and labels on the device, int64 (engine.step: shard_sequence(...).to(device))
        a = per_layer * layers * in_flight + 2 * 8 * lay.grad_accum * b * s / lay.cp
        a += alibi_bias_bytes(model, train, lay, num)
        if lay.pp > 1:
            a += pipeline_buffer_bytes(model, lay, num, tokens, in_flight, r)
        if lay.cp > 1 and lay.cp_attention == "all-gather" and getattr(gpu, "name", "") == "cpu":
            # CPU kernels have no bottom-right causal variant: context_parallel.py's two cached boolean masks
            # (c×(r+1)c and c×(2cp−r)c, c = s/2cp; the largest pair, r > 0). GPUs take none.
            c = s / (2 * lay.cp)
            a += c * c * (2 * lay.cp + 1)
        return a

    acts = acts_at(held)
    recomputed = 0.0
    if lay.recompute == "full" or (lay.recompute == "selective" and model.experts > 1):
        # backward recomputes one block at a time: that block's whole activations exist meanwhile
        # (selective: less the outputs it kept, which the recompute reuses)
        recomputed = trainer_layer_activation_bytes(model, s, b, "none", num, tp=lay.tp, cp=lay.cp, ep=lay.ep,
                                                    cp_attention=lay.cp_attention)
        if lay.recompute == "selective":
            recomputed = max(0.0, recomputed - per_layer)
    elif lay.recompute == "selective":
        recomputed = selective_recomputed_bytes(model, s / lay.cp * b, s * b, lay.tp, num,
                                                ulysses_kv_width(model, lay.tp, lay.cp)
                                                if lay.cp > 1 and lay.cp_attention == "all-to-all" else 0.0)
    step = _step_memory(model, train, gpu, lay, num, rp, fsdp, n, n_exp, dense, params + buffers, grads,
                        step_grads, optimizer, r, layers)
    if lay.pp > 1 and (lay.virtual_stages > 1 or lay.schedule in SPLIT_BACKWARD):
        # interleaved 1F1B: the rank's model chunks are in flight and hold gradients unevenly: priced per chunk
        # (the split-backward schedules too, action by action of their own orders: _split_peak)
        state = RankMemory(params + buffers, grads, optimizer, acts - per_layer * layers * held
                           - pipeline_buffer_bytes(model, lay, num, tokens, held, r), 0.0, 0.0, "")
        peak = _split_peak if lay.schedule in SPLIT_BACKWARD else _interleaved_peak
        fwd_bwd = peak(model, train, lay, num, rp, state, tokens, per_layer, recomputed, fsdp, r,
                       step_grads / grads if fsdp and grads else 1.0)
        return fwd_bwd if fwd_bwd.total >= step.total else step
    has_head = r == lay.pp - 1
    # --- the forward/backward peak: the loss's backward (last stage) or the first block's backward
    # (on the last stage the other in-flight micro-batches' loss inputs wait beside a block's backward: GPipe)
    waiting = loss_input_bytes(model, lay, num, tokens) if has_head else 0.0
    block_acts = acts + waiting * (held - 1)
    # ZeRO 0/1 without a pipeline: the gradients of the head and the blocks (each a share of the rank's)
    per_param = grads / rp.total if rp.total else 0.0
    first = lay.grad_accum <= held           # no earlier backward here: each weight's gradient is new in .grad
    top_block = _block_peak(model, lay, num, tokens, block_acts, recomputed, rp.block if fsdp else 0.0,
                            lay.zero, per_layer, rp.block_mlp if fsdp else 0.0,
                            max(1, round(layers / max(1, lay.virtual_stages))),
                            per_param if first and not fsdp else 0.0)
    loss_peak = _loss_peak(model, train, lay, num, tokens, acts, held) if has_head else None
    if fsdp and lay.pp == 1 and rp.head_unit and loss_peak:
        # the norm-and-head unit is gathered for the loss (reshard_after_forward False) and, without a pipeline,
        # reduce-scatters right after the norm's backward: its fp32 reduce-scatter input lives through the top
        # block's backward, until the next unit's post-backward (torch keeps one such buffer)
        loss_peak = (loss_peak[0], loss_peak[1], loss_peak[2] + num.gathered * rp.head_unit, loss_peak[3])
        top_block = (*top_block[:3], top_block[3] + 4 * rp.head_unit, *top_block[4:])
    peaks = ([loss_peak] if loss_peak else []) + [top_block]
    if has_head and lay.pp == 1 and model.tied_embeddings:
        # the head's gradient waits in the tied weight's AccumulateGrad input buffer until the embedding's
        # backward adds its share, at the end of the backward (autograd's InputBuffer)
        peaks[-1] = (peaks[-1][0], peaks[-1][1] + _head_grad_bytes(num, rp), *peaks[-1][2:])
    lean_head_grads = per_param * rp.head_unit      # a tied head (no unit of its own) waits in AccumulateGrad
    if not first:
        # an earlier micro-batch's backward has run here: the whole stage's gradients exist
        accumulated = grads
    else:
        # the first backward (no pipeline and one micro-batch, GPipe, or a 1F1B rank whose warm-up holds
        # every micro-batch): gradients appear only as one micro-batch's activations are freed
        # (under a pipeline each micro-batch's backward is its own: at its top no gradient exists yet; without
        # one only the head's: FSDP's reduce-scattered shard, or the lean optimizer's gradient of an untied head
        # (a tied one waits in the embedding's AccumulateGrad); the lower blocks' backwards are priced below)
        # (interleaved and split-backward pipelines are priced in _interleaved_peak and _split_peak)
        accumulated = 0.0 if lay.pp > 1 else 4 * rp.head_unit / n if fsdp else lean_head_grads
    # the loss's backward of a first backward without a pipeline comes before any gradient: the head's is made by
    # it (its FSDP unit reduce-scatters after the final norm's backward; the lean one's lands in .grad then)
    before_any = 0.0 if lay.pp == 1 and first else accumulated
    # (the block's own: what its MLP's linears have left in .grad, _block_peak)
    candidates = [RankMemory(params + buffers + p[2], before_any if p is loss_peak else accumulated + p[4], optimizer,
                             p[0], p[1], p[3], "forward/backward") for p in peaks]   # on a tie the loss's (first)
    if r == 0:
        # the end of a micro-batch's backward: one micro-batch's blocks are freed, the others in flight stay
        end_acts = acts - per_layer * layers
        # the embedding's gradient, before it is accumulated: [vocab/tp, hidden] in the weight's dtype (under TP
        # sequence_parallel.embedding_scatter makes only this rank's rows); tied with pp = 1 it is added to the
        # head's waiting gradient, out of place (the sum, the two gradients)
        end_temps = embedding_backward_bytes(model, lay, num, tokens) + num.gathered * model.vocab * model.hidden \
            / lay.tp * (2 if model.tied_embeddings and has_head else 0)
        # ZeRO 3 under PP: every block of the stage (with interleaving: of the model chunk whose backward
        # ends) is still gathered: pipelining turns reshard-after-backward off until the last micro-batch
        # (ZeRO 2's gathered blocks are already in params); without PP the embedding's unit, gathered again
        # for its backward (ZeRO 3), and every block resharded after its backward (ZeRO 2)
        end_gathered = num.gathered * (rp.blocks_dense + rp.blocks_expert) / max(1, lay.virtual_stages) \
            if fsdp and lay.zero == 3 and lay.pp > 1 else \
            num.gathered * rp.embedding_unit if fsdp and lay.zero == 3 else \
            -num.gathered * (rp.blocks_dense + rp.blocks_expert) if fsdp and lay.pp == 1 else 0.0
        later_end = True
        if r == 0 and num.mode == "fsdp-bf16" and lay.pp > 1 and lay.virtual_stages <= 1 and lay.grad_accum <= held:
            # the first backward's end (no earlier one here): FSDP's post-backward upcasts the embedding's bf16
            # unsharded gradient (its .grad) to the fp32 reduce dtype (_fsdp_param.to_accumulated_grad_if_needed:
            # the whole vocabulary under TP), beside it; the incoming gradient is freed
            emb = param_counts(model).embedding / lay.tp
            candidates.append(RankMemory(params + buffers + end_gathered, grads - (4 - num.gathered) * emb,
                                         optimizer, end_acts, 4.0 * emb, 0.0, "end of the first backward"))
            # a later backward's end (the accumulated gradient exists): one micro-batch fewer in flight
            later_end, end_acts = held >= 2, acts_at(held - 1) - per_layer * layers
        if later_end:
            candidates.append(RankMemory(params + buffers + end_gathered, grads, optimizer, end_acts, end_temps,
                                         0.0, "end of backward"))
    if lay.pp > 1 and lay.virtual_stages <= 1 and held >= 2:
        # a backward right after another (GPipe's second, 1F1B's cool-down): one micro-batch fewer in flight,
        # the stage's gradients whole (FSDP's unsharded_accumulated_grad under PP), and under ZeRO 3 every
        # block still gathered: stage.py turns reshard-after-backward off and no forward has resharded since
        drained = acts_at(held - 1)
        later = ([_loss_peak(model, train, lay, num, tokens, drained, held - 1)] if has_head else []) + \
            [_block_peak(model, lay, num, tokens, drained + waiting * (held - 2), recomputed,
                         rp.block if fsdp else 0.0, min(lay.zero, 2), per_layer, rp.block_mlp if fsdp else 0.0,
                         layers)]
        l_acts, l_temps, _, l_comm = max(later, key=sum)[:4]      # (a later backward adds into .grad in place)
        kept = num.gathered * (rp.blocks_dense + rp.blocks_expert) if fsdp and lay.zero == 3 else 0.0
        candidates.append(RankMemory(params + buffers + kept, grads, optimizer, l_acts, l_temps, l_comm,
                                     "later backward"))
    if not fsdp and lay.pp == 1 and lay.grad_accum <= held and layers > 1:
        # the lean optimizer's first backward, block by block: the blocks above have left their gradients in the
        # weights' dtype (or grad_dtype fp32's buffer) and freed this micro-batch's activations
        blocks_grads = per_param * (rp.blocks_dense + rp.blocks_expert)
        for j in _lower_blocks(layers):
            candidates.append(RankMemory(params + buffers, lean_head_grads + blocks_grads * j / layers + peaks[-1][4],
                                         optimizer, peaks[-1][0] - j * per_layer, peaks[-1][1], 0.0,
                                         f"block {layers - 1 - j}'s backward"))
    if fsdp and lay.pp == 1 and layers > 0:
        # FSDP's post-backward of a block (fsdp.apply_fsdp: one unit per block, experts apart with EP):
        # foreach_reduce copies the unit's gradients (param dtype) into its fp32 reduce-scatter input,
        # which lives until the next unit's post-backward (torch keeps one such buffer); ZeRO 3 has
        # resharded the block and prefetched the one below. At the top block: its activations freed,
        # the head unit's gradient already reduce-scattered (its fp32 shard: the only gradient of a first backward)
        unit = rp.block - (rp.blocks_expert / layers if lay.ep > 1 else 0.0)
        rs, below = 4 * unit, (num.gathered * rp.block if lay.zero == 3 and layers > 1 else 0.0)
        held_grads = grads if lay.grad_accum > 1 else 4 * rp.head_unit / n
        own_gathered = num.gathered * rp.block if lay.zero == 2 else 0.0
        # the gradient the block passes down, and a tied head's gradient waiting for the root's post-backward
        # (an own head unit has reduce-scattered its gradient before the top block's backward)
        head_wait = num.residual * model.hidden * tokens / lay.tp + (0.0 if rp.head_unit else num.gathered * rp.head)
        candidates.append(RankMemory(params + buffers - own_gathered, held_grads + num.gathered * unit, optimizer,
                                     acts - per_layer, head_wait, rs + below, "top block's post-backward"))
        # a lower block's backward, j blocks from the top: its working set (as the top block's) beside the block
        # above's reduce-scatter input, its gathered weights and (ZeRO 3) the prefetch of the block below it (of
        # the embedding below the lowest); the j blocks above have freed this micro-batch's activations and, on a
        # first backward, left their fp32 gradient shards (full recompute keeps little per block: the gradients
        # grow faster than the activations shrink, and the peak is near the bottom), and under ZeRO 2 resharded
        blocks_sharded = step_grads - 4 * rp.root / n
        for j in _lower_blocks(layers):
            done = held_grads if lay.grad_accum > 1 else held_grads + blocks_sharded * j / layers
            below_j = num.gathered * (rp.block if j < layers - 1 else rp.embedding_unit) if lay.zero == 3 else 0.0
            here = num.gathered * rp.block * (1 if lay.zero == 3 else -j if lay.zero == 2 else 0)
            candidates.append(RankMemory(params + buffers + here, done, optimizer, peaks[-1][0] - j * per_layer,
                                         peaks[-1][1], rs + below_j,
                                         "second block's backward" if j == 1 else f"block {layers - 1 - j}'s backward"))
    fwd_bwd = max(candidates, key=lambda c: c.total)
    return fwd_bwd if fwd_bwd.total >= step.total else step


def _lower_blocks(layers: int) -> list[int]:
    """The lower blocks whose backward can be a first backward's peak, as j blocks from the top: the second
    (the top block's reduce-scatter input beside it) and the two lowest (the most gradients, the fewest
    activations; the lowest prefetches the embedding). Gradients and activations change linearly in between."""
    return sorted({1, layers - 2, layers - 1} & set(range(1, layers)))


def outside_gathered(lay: Layout, num: Numerics, rp: RankParams) -> float:
    """What FSDP keeps gathered outside the blocks through forward and backward (fsdp.apply_fsdp's units): the
    root unit (a tied embedding-and-head); the embedding under ZeRO 2 (reshard_after_forward False) and under
    PP (pipelining turns reshard-after-backward off until the last micro-batch: gathered again for the first
    backward, it stays); the norm and head under PP (without a pipeline they are gathered only for the loss
    and resharded at their post-backward: rank_memory prices that)."""
    units = rp.root_unit
    if lay.zero == 2 or lay.pp > 1:
        units += rp.embedding_unit
    if lay.pp > 1:
        units += rp.head_unit
    return num.gathered * units


def _step_memory(model, train, gpu, lay: Layout, num: Numerics, rp: RankParams, fsdp: bool, n: int, n_exp: int,
                 dense: float, params: float, grads: float, step_grads: float, optimizer: float, r: int,
                 layers: int) -> RankMemory:
    """The rank after backward: the lean optimizer's reduce (ZeRO 0/1) or the optimizer step's temporaries;
    `params` with the buffers."""
    if not fsdp:
        return _lean_step_memory(model, train, gpu, lay, rp, n, params, grads, step_grads, optimizer, r, layers)
    stepped = dense / n + rp.blocks_expert / n_exp          # what step() updates
    # (the grad-norm clip reduces each tensor in place: loss._norm_sq)
    temp = optimizer_temp_bytes(train, gpu, stepped, rp.largest / n)
    held_params = params - outside_gathered(lay, num, rp)
    if lay.zero == 2:
        # ZeRO 2's gathered blocks are resharded by the last backward (FSDP's reshard-after-backward, which
        # pipelining turns back on for the last micro-batch): the step holds the shards only
        held_params -= num.gathered * (rp.blocks_dense + rp.blocks_expert)
    return RankMemory(held_params, step_grads, optimizer, 0.0, temp, 0.0, "optimizer step")


def _chunk(shape: tuple[int, ...], dim: int, n: int) -> int:
    """Elements of one rank's padded chunk of a local tensor split along `dim` into n (dist_optim._segment)."""
    return -(-shape[dim] // n) * math.prod(shape) // max(1, shape[dim])


@lru_cache(maxsize=4096)
def lean_expert_pack_elems(model, ep: int, n: int, layers: int) -> float:
    """lean_pack_elems for the EP experts' own group (their dp·cp/ep replicas, chunked n ways): each layer's
    experts/ep local experts, whole under TP."""
    h, f = model.hidden, model.expert_ffn
    mlp = [((f, h), 0), ((h, f), 0)] + ([((f, h), 0)] if model.mlp != "gelu" else [])
    return _largest_pack(mlp * (model.experts // ep) * layers, n)


def _largest_pack(tensors: list[tuple[tuple[int, ...], int]], n: int) -> float:
    """dist_optim's bucketing over (local shape, split dim) in order: the largest pack's elements."""
    return _packs(tuple(tensors), n)[0]


def _packs(tensors: tuple[tuple[tuple[int, ...], int], ...], n: int) -> tuple[float, float]:
    """dist_optim's bucketing over (local shape, split dim) in order: (the largest pack's, the last pack's)
    elements."""
    largest, row = 0.0, 0
    for shape, dim in tensors:
        c = _chunk(shape, dim, n)
        if row and (row + c) * n > ALLREDUCE_BUCKET_ELEMS:
            largest, row = max(largest, row * n), 0
        row += c
    return max(largest, row * n), float(row * n)


@lru_cache(maxsize=4096)
def lean_pack_elems(model, tp: int, n: int, ep: int, first: bool, last: bool, layers: int,
                    which: int = 0) -> float:
    """The largest (`which` 1: the last) fp32 pack (all n ranks' chunks of one bucket)
    dist_optim.MixedPrecisionOptimizer forms for this rank's dense weights: its bucketing run over the
    rank's local tensors in module order (each split along a dimension TP does not split, chunks padded), a
    bucket closed before it would pass BUCKET_ELEMS; one tensor larger than that alone."""
    h, f, t = model.hidden, model.ffn_hidden, tp
    col = 1 if t > 1 else 0                      # a column-parallel weight [out/t, in] is chunked along `in`
    vocab = (model.vocab // t, h), col
    attn = [((h,), 0), ((model.q_width // t, h), col), ((model.kv_width // t, h), col),
            ((model.kv_width // t, h), col), ((h, model.q_width // t), 0), ((h,), 0)]
    gated = model.mlp != "gelu"

    def whole_mlp(w: int) -> list[tuple[tuple[int, ...], int]]:
        return [((w, h), 0), ((h, w), 0)] + ([((w, h), 0)] if gated else [])

    mlp = [((f // t, h), col), ((h, f // t), 0)] + ([((f // t, h), col)] if gated else [])
    dense_layers = min(layers, model.first_dense_layers) if first and model.experts > 1 else 0
    if model.experts > 1:
        # the router, shared and routed experts are whole under TP (expert TP 1); EP experts are a group of
        # their own
        layer = attn + [((model.experts, h), 0)]
        layer += whole_mlp(model.expert_ffn) * (model.experts if ep == 1 else 0)
        layer += whole_mlp(model.shared_ffn) if model.shared_experts else []
    else:
        layer = attn + mlp
    tensors = ([vocab] if first else []) + (attn + mlp) * dense_layers + layer * (layers - dense_layers)
    if last:
        tensors += [((h,), 0)] + ([vocab] if not model.tied_embeddings or not first else [])
    return _packs(tuple(tensors), n)[which]


def _lean_step_memory(model, train, gpu, lay: Layout, rp: RankParams, n: int, params: float, grads: float,
                      step_grads: float, optimizer: float, r: int, layers: int) -> RankMemory:
    """ZeRO 0/1 after backward (dist_optim.py), bucket by bucket: the reduce packs a bucket's gradients into
    fp32 (lean_pack_elems) beside every gradient not yet packed, then reduce-scatters it (ZeRO 1) or
    all-reduces it (ZeRO 0); the step then holds the fp32 shard whole and one bucket's optimizer temporaries; the gather casts one bucket's master and all-gathers it."""
    shards = n if lay.zero == 1 else 1
    pack = lean_pack_elems(model, lay.tp, shards, lay.ep, *_ends(lay, r), layers)
    stepped = pack / shards                       # the largest bucket the inner optimizer steps at once
    if model.experts > 1 and lay.ep > 1:
        ex_shards = max(1, n // lay.ep) if lay.zero == 1 else 1
        ex_pack = lean_expert_pack_elems(model, lay.ep, ex_shards, layers)
        pack, stepped = max(pack, ex_pack), max(stepped, ex_pack / ex_shards)
    # at a bucket's packing its weights' gradients still exist; its ZeRO 1 shard (4/n B an element) is made
    # once they are released (2 B an element): the pack beside every gradient is the reduce's peak
    reduce = 4 * pack
    temp = optimizer_temp_bytes(train, gpu, stepped, stepped)
    moments = [RankMemory(params, grads, optimizer, 0.0, 0.0, reduce, "gradient reduce"),
               RankMemory(params, step_grads, optimizer, 0.0, temp, 0.0, "optimizer step")]
    if shards == 1 and rp.total and not (model.experts > 1 and lay.ep > 1):
        # ZeRO 0's last bucket: every other bucket's fp32 sum exists whole (the all-reduce's own buffer), beside
        # the last one's weight gradients and its pack
        last = lean_pack_elems(model, lay.tp, shards, lay.ep, *_ends(lay, r), layers, 1)
        moments.append(RankMemory(params, step_grads - 4 * last + grads / rp.total * last, optimizer, 0.0, 0.0,
                                  4 * last, "gradient reduce"))
    return max(moments, key=lambda m: m.total)


def pipeline_buffer_bytes(model, lay: Layout, num: Numerics, tokens: float, held: float, r: int) -> float:
    """What torch's pipelining keeps beside the blocks' own activations on pipeline rank `r`
    (pipelining/stage.py), each [micro_batch, seq/cp/tp, hidden] in the stage-boundary dtype: one
    receive buffer per micro-batch for every stage's input (not stage 0's) and for its output's
    gradient (not the last stage's), allocated once for the whole step; and each in-flight micro-batch's
    stage output, kept for its backward (`held` in flight per local model chunk)."""
    each, recv, shares = _pipeline_buffers(model, lay, num, tokens, r)
    v = max(1, lay.virtual_stages)
    first, last = _ends(lay, r)
    kept = held * v - (held if last else 0.0)
    shared = held * v - (held if first else 0.0) if shares else 0.0
    return each * (recv + kept - shared)


def _pipeline_buffers(model, lay: Layout, num: Numerics, tokens: float, r: int) -> tuple[float, int, bool]:
    """pipeline_buffer_bytes' terms: the bytes of one stage tensor, the receive buffers rank r allocates, and
    whether a received input is shared with the blocks' activations: in fp32 the first block's
    norm saves it itself (x.float() is x), and full recompute's checkpoint keeps it as the block's input
    (so a kept stage input that was received is not counted twice)."""
    each = num.residual * model.hidden * tokens / lay.tp
    first, last = _ends(lay, r)
    recv = lay.grad_accum * (2 * max(1, lay.virtual_stages) - first - last)
    return each, recv, num.residual == 4 or lay.recompute == "full"


def interleaved_order(pp: int, v: int, m: int, r: int) -> tuple[tuple[int, int, bool], ...]:
    """Pipeline rank r's compute actions under torch's ScheduleInterleaved1F1B, as (local chunk, micro-batch,
    is backward) in the order its runtime runs them (pipelining/schedules.py: _get_warmup_ops and
    _get_1f1b_rank_ops): warm-up forwards, then one forward and one backward each, then the backwards."""
    rounds = max(1, m // pp)
    per_round = m // rounds
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - r), m * v)
    fwd_next, bwd_next = [0] * v, [0] * v
    out: list[tuple[int, int, bool]] = []
    for op in range(m * v + warmup):
        if op < m * v:
            k = (op // per_round) % v
            out.append((k, fwd_next[k], False))
            fwd_next[k] += 1
        if op >= warmup:
            k = v - 1 - ((op - warmup) // per_round) % v
            out.append((k, bwd_next[k], True))
            bwd_next[k] += 1
    return tuple(out)


def interleaved_moments(pp: int, v: int, m: int, r: int, chunk_layers: tuple[int, ...],
                        sharded: bool) -> tuple[tuple, ...]:
    """schedule_moments, found on a shorter schedule where that is exact. With pp | m each chunk runs pp
    micro-batches per round, so between the same warm-up and cool-down the order repeats one period of pp·v
    forwards and pp·v backwards (each chunk pp of each), which leaves every chunk's micro-batches in flight
    as they were: a schedule with two such periods or more has the moments of the shortest one that has two
    (the same keys, activations and in-flight counts, the first of equals in the same period), its backward
    counts only later in the cool-down, so read as the pricing reads them (none, some, all m)."""
    short = _short_microbatches(pp, v, m, r)
    if short == m:
        return schedule_moments(pp, v, m, r, chunk_layers, sharded)
    return tuple((k, j, held, tuple(m if d == short else d for d in done))
                 for k, j, held, done in schedule_moments(pp, v, short, r, chunk_layers, sharded))


def _short_microbatches(pp: int, v: int, m: int, r: int) -> int:
    """The fewest micro-batches (a multiple of pp) whose interleaved schedule on rank r has two whole
    steady periods after its warm-up, or m itself where m is not a multiple of pp or not longer."""
    if m % pp:
        return m
    warmup = (v - 1) * pp + 2 * (pp - 1 - r)
    period = pp * v
    short = pp * -(-(warmup + 2 * period) // period)
    return min(m, short)


@lru_cache(maxsize=4096)
def schedule_moments(pp: int, v: int, m: int, r: int, chunk_layers: tuple[int, ...],
                     sharded: bool) -> tuple[tuple, ...]:
    """The backward actions of interleaved_order where rank r's peak can fall, as (local chunk, micro-batch,
    micro-batches in flight per chunk, backwards run per chunk): of those in the same chunk, first or not,
    and with the same chunks' gradients begun and finished, only the one holding the most activations; and
    of those, none that another holds no more activations, gradients or in-flight head micro-batches than
    (the head chunk's only on the last rank; finished chunks only count when their gradient is then
    `sharded`)."""
    held, done = [0] * v, [0] * v
    live, begun, finished = 0, 0, 0           # layer-micro-batches in flight; bitmasks of chunks
    best: dict[tuple, tuple] = {}
    for k, _, backward in interleaved_order(pp, v, m, r):
        if not backward:
            held[k] += 1
            live += chunk_layers[k]
            continue
        key = (k, done[k] == 0, begun, finished if sharded else 0)
        rank = (live, held[-1] if r == pp - 1 else 0)
        if key not in best or best[key][0] < rank:
            best[key] = (rank, (k, done[k], tuple(held), tuple(done)))
        held[k] -= 1
        live -= chunk_layers[k]
        done[k] += 1
        begun |= 1 << k
        if done[k] == m:
            finished |= 1 << k

    def dominated(key: tuple, rank: tuple) -> bool:
        k, first, bg, fin = key
        return any(o != key and o[:2] == (k, first) and o[2] & bg == bg and o[3] & fin == o[3]
                   and orank[0] >= rank[0] and orank[1] >= rank[1] for o, (orank, _) in best.items())

    return tuple(moment for key, (rank, moment) in best.items() if not dominated(key, rank))


@lru_cache(maxsize=4096)
def _moment_features(pp: int, v: int, m: int, r: int, chunk_layers: tuple[int, ...],
                     sharded: bool) -> tuple[tuple, ...]:
    """interleaved_moments as what _interleaved_peak reads of each, all integers: (local chunk k, micro-batch
    j, layer-micro-batches in flight Σ held·layers, stage outputs kept and received inputs shared in the
    pipeline's buffers (pipeline_buffer_bytes' counts), micro-batches in flight of chunk k, the other chunks
    whose backward has run, which chunks have finished theirs)."""
    out = []
    for k, j, held, done in interleaved_moments(pp, v, m, r, chunk_layers, sharded):
        kept = sum(held) - (held[-1] if r == pp - 1 else 0)
        shared = sum(held) - (held[0] if r == 0 else 0)
        others = tuple(i for i in range(v) if done[i] and i != k)
        out.append((k, j, sum(h * c for h, c in zip(held, chunk_layers)), kept, shared, held[k], others,
                    tuple(d == m for d in done)))
    return tuple(out)


def _interleaved_peak(model, train, lay: Layout, num: Numerics, rp: RankParams, state: RankMemory, tokens: float,
                      per_layer: float, recomputed: float, fsdp: bool, r: int, sharded: float) -> RankMemory:
    """The forward/backward peak of pipeline rank r under interleaved 1F1B, from its own action order
    (interleaved_order): at each chunk's backward of a micro-batch, the activations of every (chunk,
    micro-batch) whose forward has run and backward has not; the gradients of each chunk whose backward has
    run once (ZeRO 0/1 and, under PP, FSDP accumulate a chunk's whole gradient from its first backward on).
    `state` holds the rank's params, all its gradients, optimizer state and, as
    activations, what lives beside the blocks' (the CPU's CP masks). FSDP reduce-scatters a chunk's gradient
    after its last micro-batch's backward: from then on it holds the `sharded` fraction of it.

    At each moment (chunk k's backward of micro-batch j, with `held` micro-batches in flight per chunk): the
    top of the chunk (or the loss), its bottom block, and the end of its backward; the first of the highest
    is the peak. The planner prices thousands of these, so each moment is read from _moment_features and
    only totals are summed (in RankMemory.total's order) until one is the highest so far."""
    pp, v, m = lay.pp, lay.virtual_stages, lay.grad_accum
    chunk_layers = _chunk_layer_counts(model.layers, pp, v, r)
    layers = sum(chunk_layers)
    c = param_counts(model)
    embedding = c.embedding / lay.tp if r == 0 else 0.0
    blocks = rp.blocks_dense + rp.blocks_expert
    # each chunk's gradient: its blocks'; the embedding's on stage 0;
    # the head's and final norm's on the last stage (everything outside the blocks but the embedding)
    # (FSDP under PP: unsharded, in the fp32 reduce dtype; ZeRO 0/1: in the weights' dtype, or grad_dtype fp32's)
    gw = 4 if fsdp or train.grad_dtype == "fp32" else num.gathered
    chunk_grads = [gw * blocks * n / max(1, layers) for n in chunk_layers]
    chunk_grads[0] += gw * embedding
    chunk_grads[-1] += gw * (rp.root - embedding)                 # 0 but on the last pipeline rank
    # the loss's and a block's backward peaks grow by the activations held beside them, nothing else: priced
    # once without them (the loss's per micro-batch in flight of the head chunk) and added to per moment
    loss = _loss_peak(model, train, lay, num, tokens, 0.0, 1) if r == pp - 1 else None
    block = {n: _block_peak(model, lay, num, tokens, 0.0, recomputed, rp.block if fsdp else 0.0, lay.zero,
                            per_layer, rp.block_mlp if fsdp else 0.0, n)
             for n in set(chunk_layers)}
    # a chunk's first backward without FSDP: each of a block's finished linears leaves its gradient in .grad
    first_block = block if fsdp else {
        n: _block_peak(model, lay, num, tokens, 0.0, recomputed, 0.0, lay.zero, per_layer, 0.0, n, gw)
        for n in set(chunk_layers)}
    # pipeline_buffer_bytes per moment: one stage tensor's bytes times received + kept - shared stage tensors
    buffer_bytes, received, shares = _pipeline_buffers(model, lay, num, tokens, r)
    base = state.params
    opt = state.optimizer
    embedding_grad = gw * c.embedding / lay.tp
    # per chunk: layers, whether it ends in the loss, whether it starts the model, its gathered blocks at its
    # backward's end (ZeRO 3 under PP)
    per_chunk = []
    for k, n in enumerate(chunk_layers):
        share = n / max(1, layers)
        per_chunk.append((n, r == pp - 1 and k == v - 1, r == 0 and k == 0,
                          num.gathered * (rp.blocks_dense + rp.blocks_expert) * share if fsdp and lay.zero == 3
                          else 0.0, block[n]))
    first_end_temps = embedding_backward_bytes(model, lay, num, tokens)
    kept_by_finished: dict[tuple, list[float]] = {}
    best_total: float = float("-inf")
    best: tuple = ()
    for k, j, live, kept_n, shared_n, held_k, others, finished in _moment_features(
            pp, v, m, r, chunk_layers, sharded < 1):
        kept = kept_by_finished.get(finished)
        if kept is None:
            kept = kept_by_finished[finished] = [g * (sharded if f else 1.0) for g, f in zip(chunk_grads, finished)]
        n, head_chunk, first_stage, end_gathered, blk = per_chunk[k]
        if j == 0:
            blk = first_block[n]
        acts = state.activations + per_layer * live + \
            buffer_bytes * (received + kept_n - (shared_n if shares else 0))
        before = 0.0
        for i in others:                          # the other chunks' gradients, summed in chunk order
            before += kept[i]
        own = kept[k] if j > 0 else 0.0           # the chunk's gradient exists from its first backward on
        # the top of the chunk (the loss's backward in the head chunk, when it holds more) ...
        if head_chunk and loss is not None and \
                acts + loss[0] * held_k + loss[1] + loss[2] + loss[3] >= acts + blk[0] + blk[1] + blk[2] + blk[3]:
            top = (base + loss[2], before + own, opt, acts + loss[0] * held_k, loss[1], loss[3])
        else:
            top = (base + blk[2], before + own + blk[4], opt, acts + blk[0], blk[1], blk[3])
        total = top[0] + top[1] + top[2] + top[3] + top[4] + top[5]
        if total > best_total:
            best_total, best = total, (*top, "forward/backward")
        # ... the end of its backward (the first stage's): embedding_dense_backward's [vocab, hidden] gradient
        # (whole vocabulary under TP) and its incoming one
        if first_stage:
            end_temps = first_end_temps
            # the first backward's embedding gradient is still the temporary above (AccumulateGrad then keeps it)
            fresh = embedding_grad if first_stage and j == 0 else 0.0
            end = (base + end_gathered, before + kept[k] - fresh, opt, acts - per_layer * n, end_temps, 0.0)
            total = end[0] + end[1] + end[2] + end[3] + end[4] + end[5]
            if total > best_total:
                best_total, best = total, (*end, "end of backward")
        if n > 1:
            # ... and its bottom block: the blocks above have freed this micro-batch's activations and left their
            # gradients (accumulated on the first backward)
            bottom = kept[k] * (n - 1) / n if j == 0 else own
            low = (base, before + bottom + blk[4], opt, acts - per_layer * (n - 1) + blk[0], blk[1], 0.0)
            total = low[0] + low[1] + low[2] + low[3] + low[4] + low[5]
            if total > best_total:
                best_total, best = total, (*low, "bottom block's backward")
    assert best
    return RankMemory(*best)


def held_dw_bytes(model, lay: Layout, num: Numerics, tokens: float, layers: int, head: bool) -> float:
    """What one micro-batch's split backward holds from its input-gradient step (I) to its weight step (W),
    beyond its activations (which the retained graph keeps whole until W: pipelining/_backward.py
    stage_backward_input runs autograd.grad with retain_graph=True): the gradient of each weight's consumer's
    output, which torch saves for W (param_groups' "grads", one per intermediate node that consumes a weight).
    The ZB paper's W needs exactly these and the layer inputs (Qi et al. 2023, arXiv 2401.10241 §2: "W ... only
    depends on its output gradient and the input"). Per layer, in the compute dtype: the two norms' outputs
    [tokens, h] (a sequence shard under TP), q, k and v and the MLP's inner rows (ffn, twice when gated) over the
    whole local sequence for this TP rank's columns, wo's and w2's outputs [tokens, h] (sequence shards); a MoE
    layer its router's logits and each routed row's expert rows. On the stage with the head: the final norm's
    output and the loss's logits gradient [tokens, vocab/tp] of every chunk (the chunked loss's matmuls), which
    W multiplies into the head's gradient."""
    t, e, h = lay.tp, num.act, model.hidden
    attn = (2 * h + model.q_width + 2 * model.kv_width + h) / t
    if model.experts > 1:
        mats = 2 if model.mlp != "gelu" else 1
        routed = tokens * model.experts_per_token * (mats * model.expert_ffn + h)
        shared = tokens * (mats * model.shared_ffn + h) if model.shared_experts else 0.0
        per_layer = attn * tokens + tokens * model.experts + routed + shared
    else:
        per_layer = (attn + ((2 if model.mlp != "gelu" else 1) * model.ffn_hidden + h) / t) * tokens
    out = per_layer * layers * e
    if head:
        out += (h / t + model.vocab / t) * tokens * e
    return out


@lru_cache(maxsize=4096)
def _split_moments(schedule: str, pp: int, v: int, m: int, r: int, chunk_layers: tuple[int, ...],
                   first: bool, last: bool) -> tuple[tuple, ...]:
    """Rank r's backward actions under a split-backward schedule (schedules.rank_order), each with what
    _split_peak reads of the rank at its start: (kind, chunk k, its micro-batches in flight, layer-micro-batches whose
    activations live, stage outputs kept, received inputs held, each chunk's I-done-W-pending micro-batches,
    input gradients made so far, each chunk's backward (B or W) count, and W's pending since the chunk's last
    I (FSDP's bf16 .grad beside its fp32 sum)). An activation lives from its F to its B or W; a stage output
    from its F to its I or B (detached there); the first stage's I does nothing (its input needs no gradient)
    and its W is a whole backward."""
    held = [0] * v
    outs = [0] * v
    pending = [0] * v
    done = [0] * v
    since = [False] * v
    live = ingrads = 0
    out = []
    for k, _j, kind in rank_order(schedule, pp, v, m, r):
        stage0 = first and k == 0
        if kind == "F":
            held[k] += 1
            outs[k] += 1
            live += chunk_layers[k]
            since[k] = False                        # FSDP's pre-forward has taken the .grad into its sum
            continue
        if kind == "I" and stage0:
            continue
        kept = sum(outs) - (outs[-1] if last else 0)
        shared = sum(held) - (held[0] if first else 0)
        out.append(("B" if stage0 else kind, k, held[k], live, kept, shared, tuple(pending), ingrads, tuple(done),
                    tuple(since)))
        if kind == "B" or stage0:
            since = [False] * v                     # a whole backward's final callback: every unit's post-backward
        if kind in ("B", "I"):
            outs[k] -= 1
            ingrads += kind == "I"             # stage_backward_input sets .grad; a whole backward returns it
        if kind == "I":
            pending[k] += 1
            since[k] = False
        else:                                       # B, or W: the activations and any held inputs go
            held[k] -= 1
            live -= chunk_layers[k]
            if kind == "W" and not stage0:
                pending[k] -= 1
                since[k] = True
            if kind == "W" and stage0:
                outs[k] -= 1
            done[k] += 1
    return tuple(out)


def _split_peak(model, train, lay: Layout, num: Numerics, rp: RankParams, state: RankMemory, tokens: float,
                per_layer: float, recomputed: float, fsdp: bool, r: int, sharded: float) -> RankMemory:
    """The forward/backward peak of pipeline rank r under a split-backward schedule (interleaved-zero-bubble,
    zero-bubble-v, dualpipe-v), at each backward action of its own order (_split_moments): as
    _interleaved_peak's, with what the split adds. An I holds everything (the graph is retained) and adds the
    micro-batch's held_dw_bytes until its W; its moments are the top of the chunk (the block's or the loss's
    backward working set, as a full backward's) and its end. A W frees the activations and the held inputs;
    the chunk's first W makes its whole gradient beside them (its peak: that gradient less the held inputs
    it has released, traced), a later one one weight's gradient at a time. Each received input's gradient an I
    makes stays in the stage's receive buffer's .grad for the whole step (stage.py clear_runtime_states runs at the
    next step). The held inputs and the input gradients are made in backward: temporaries, as torch's tracker
    files them. FSDP (ZeRO 2): W writes each unsharded parameter's .grad in bf16, which FSDP's post-backward,
    run at the chunk's next I, adds into its fp32 sum."""
    pp, v, m = lay.pp, max(1, lay.virtual_stages), lay.grad_accum
    vee = _vee(lay)
    first, last = _ends(lay, r)
    chunk_layers = _chunk_layer_counts(model.layers, pp, v, r, vee)
    layers = sum(chunk_layers)
    c = param_counts(model)
    embedding = c.embedding / lay.tp if first else 0.0
    blocks = rp.blocks_dense + rp.blocks_expert
    params = [blocks * n / max(1, layers) for n in chunk_layers]
    params[0] += embedding
    params[-1] += rp.root - embedding
    # a chunk's gradient from its first backward on: FSDP's fp32 sum (ZeRO 2), or the weights' dtype (grad_dtype
    # fp32: its buffer); under FSDP the bf16 .grad a W writes waits beside it until the post-backward that adds it
    # in: at the chunk's next I or F, or any whole backward's end on the rank (FSDP's final callback; traced)
    gw = 4 if fsdp or train.grad_dtype == "fp32" else num.gathered
    loss = _loss_peak(model, train, lay, num, tokens, 0.0, 1) if last else None
    block = {n: _block_peak(model, lay, num, tokens, 0.0, recomputed, rp.block if fsdp else 0.0, lay.zero,
                            per_layer, rp.block_mlp if fsdp else 0.0, n)
             for n in set(chunk_layers)}
    each, received, shares = _pipeline_buffers(model, lay, num, tokens, r)
    base, opt = state.params, state.optimizer
    dw = [held_dw_bytes(model, lay, num, tokens, n, last and k == v - 1) for k, n in enumerate(chunk_layers)]
    # one weight's gradient as W makes it (a later W adds it into .grad): the chunk's largest weight
    f = model.ffn_hidden if model.experts == 1 else model.expert_ffn
    w_temp = num.gathered * max(model.hidden * max(f, model.q_width) / (lay.tp if model.experts == 1 else 1),
                                model.vocab * model.hidden / lay.tp if last else 0.0)
    best_total, best = float("-inf"), ()

    def consider(parts: tuple, phase: str) -> None:
        nonlocal best_total, best
        total = parts[0] + parts[1] + parts[2] + parts[3] + parts[4] + parts[5]
        if total > best_total:
            best_total, best = total, (*parts, phase)

    for kind, k, held_k, live, kept, shared, pending, ingrads, done, since in _split_moments(
            lay.schedule, pp, v, m, r, chunk_layers, first, last):
        n = chunk_layers[k]
        acts = state.activations + per_layer * live + each * (received + kept - (shared if shares else 0))
        held = sum(p * d for p, d in zip(pending, dw))
        temps0 = held + each * ingrads
        grads = 0.0
        for i in range(v):
            if done[i]:
                grads += params[i] * gw * (sharded if fsdp and done[i] == m else 1.0) + \
                    (num.gathered * params[i] if fsdp and since[i] else 0.0)
        blk = block[n]
        head_chunk = last and k == v - 1
        if kind in ("B", "I"):
            # the top of the chunk: the loss's backward in the head chunk, when it holds more
            if head_chunk and loss is not None and loss[0] * held_k + sum(loss[1:4]) >= sum(blk[:4]):
                consider((base + loss[2], grads, opt, acts + loss[0] * held_k, temps0 + loss[1], loss[3]),
                         "forward/backward")
            else:
                consider((base + blk[2], grads, opt, acts + blk[0], temps0 + blk[1], blk[3]), "forward/backward")
        if kind == "I":
            # its end: the graph kept, this micro-batch's held inputs and input gradient made, its output freed
            consider((base, grads, opt, acts - (0.0 if head_chunk else each), temps0 + dw[k] + each, 0.0),
                     "end of an input-gradient step")
        elif kind == "W":
            if not done[k]:
                # the chunk's gradient as W makes it, a temporary until W returns (what torch's tracker sees made
                # in backward; verify refiles .grad as gradients after each W)
                own = params[k] * gw
                consider((base, grads, opt, acts, temps0 - dw[k] + own, 0.0), "first weight-gradient step")
            elif fsdp:
                # every weight's fresh bf16 .grad (FSDP's post-backward took the last one into its fp32 sum) as
                # the held inputs go
                consider((base, grads, opt, acts, temps0 + num.gathered * params[k] - dw[k], 0.0),
                         "weight-gradient step")
            else:
                consider((base, grads, opt, acts, temps0 + w_temp, 0.0), "weight-gradient step")
        elif first and k == 0:
            # the first stage's whole backward: its end (the embedding's gradient, as _interleaved_peak's)
            # (the first backward's embedding gradient is still the temporary there: AccumulateGrad then keeps it)
            own = 0.0 if done[k] else params[k] * gw - gw * c.embedding / lay.tp
            end_temps = embedding_backward_bytes(model, lay, num, tokens)
            consider((base, grads + own, opt, acts - per_layer * n, temps0 + end_temps, 0.0), "end of backward")
    assert best
    return RankMemory(*best)


def _loss_peak(model, train, lay: Layout, num: Numerics, tokens: float, acts: float,
               held: float) -> tuple[float, ...]:
    """(activations, temporaries, gathered block, comm buffers) in the chunked loss's backward: every
    stored activation, the final norm's and the loss's inputs (for each micro-batch in flight: GPipe
    runs every micro-batch's loss before the first backward), one chunk's logits; ZeRO 3 blocks are
    all resharded (the last block is gathered again only after the loss's backward)."""
    h, r = model.hidden, num.residual
    head = loss_input_bytes(model, lay, num, tokens)
    temps = logits_chunk_bytes(train, model, lay, num)
    if tokens > train.loss_chunk:
        # several chunks each add a [vocab/tp, hidden] gradient to the head weight's AccumulateGrad input
        # buffer: a later chunk's backward runs beside the running sum, and each accumulation (autograd's
        # InputBuffer, out of place) holds the sum, the new chunk's gradient and their total at once, beside
        # the chunk's hidden-state gradient; the whole hidden states' gradient (each chunk's slice backward
        # makes it full size) exists from the first chunk's backward on
        g = _head_grad_bytes(num, None, model.vocab * h / lay.tp)
        whole = r * h * tokens
        return max((acts + head * held, temps + g + whole, 0.0, 0.0),
                   (acts + head * held, 3 * g + r * h * train.loss_chunk + whole, 0.0, 0.0), key=sum)
    return acts + head * held, temps, 0.0, 0.0


def loss_input_bytes(model, lay: Layout, num: Numerics, tokens: float) -> float:
    """What one micro-batch keeps for the loss's backward on the last stage: the final norm's fp32 input and
    normed output, and the final hidden states the chunked loss keeps (all-gathered under TP)."""
    h, r = model.hidden, num.residual
    # under PP the schedule also keeps the stage's output (the final norm's, a sequence shard) for the loss's
    # backward: without TP that is the loss's hidden states themselves, under TP they are its all-gather
    stage_output = r * h * tokens / lay.tp if lay.tp > 1 and lay.pp > 1 else 0.0
    return (4 + r) * h * tokens / lay.tp + r * h * tokens + stage_output


def embedding_backward_bytes(model, lay: Layout, num: Numerics, tokens: float) -> float:
    """The embedding's backward working set: its incoming gradient (all-gathered under TP, and a masked copy of
    it: sequence_parallel.embedding_scatter) and the gradient it makes, this rank's [vocab/tp, hidden] rows."""
    incoming = num.residual * model.hidden * tokens * (2 if lay.tp > 1 else 1)
    return incoming + num.gathered * model.vocab * model.hidden / lay.tp


def _head_grad_bytes(num: Numerics, rp: RankParams | None, elems: float = 0.0) -> float:
    """One gradient of the head weight as the loss's matmul delivers it: in the weight's compute dtype."""
    return num.gathered * (rp.head if rp is not None else elems)


def _block_peak(model, lay: Layout, num: Numerics, tokens: float, acts: float, recomputed: float,
                fsdp_block: float, zero: int, per_layer: float = 0.0, fsdp_mlp: float = 0.0,
                part: int = 1, grad_bytes: float = 0.0) -> tuple[float, ...]:
    """(activations, temporaries, gathered block, comm buffers, gradients) in a block's backward near the top of
    the stack: the stored activations and what recompute remakes of the block (activations again, as
    Korthikanti counts them; inside a compiled block's backward graph, temporaries); as temporaries, what
    exists only during that block's backward (its MLP's gradient temporaries: one expert's routed tokens at
    a time under MoE). FSDP (`fsdp_block`:
    one block's parameters, 0 without FSDP): ZeRO 3 has gathered that block and prefetches the next
    (FSDP2's backward prefetch: one block's all-gather buffer); without a pipeline the block above's
    gradients are reduce-scattered after it (rank_memory's FSDP post-backward candidates). The gradients: what a
    first backward without FSDP has left in .grad of the block's dense MLP by the moment (`grad_bytes`:
    dense_mlp_backward_bytes)."""
    mt, mtp = moe_tokens(model, tokens, lay.tp)
    routed = mt * model.experts_per_token / model.experts if model.experts > 1 else tokens
    if lay.recompute == "selective" and model.experts == 1:
        # op-level selective recompute (recompute.py) replays the block at its backward's first unpack and then
        # drops the kept outputs nothing saves: wq's and wk's (RoPE makes q and k anew), wv's under CP (SDPA
        # saves the gathered V) and wo's (a sequence shard under TP)
        hkv = model.kv_width
        acts -= (model.q_width + model.hidden + hkv * (2 if lay.cp > 1 else 1)) / lay.tp * num.act * tokens
    def moment(remade: float, temps: float, made: float = 0.0) -> tuple[float, float, float]:
        """(activations, temporaries, gradients) a backward moment adds: what recompute remade, its working set and
        the gradients it has left."""
        return (0.0, remade + temps, made) if lay.compile else (remade, temps, made)

    if model.experts > 1:
        in_block = moment(recomputed, mlp_backward_bytes(model, routed, mtp, num.act))
        if lay.ep > 1 and recomputed > 0:
            # backward re-runs the MoE's forward: at its end, beside what it recomputed, EP's dispatch copies
            # of every routed row (moe.MoE._experts: the all-to-all receive buffer and its by-expert regrouping
            # in the input dtype; the empty_like the experts' output is copied into in its restored order, and
            # that copy, in the matmul dtype)
            rows = mt * model.experts_per_token
            in_block = max(in_block, moment(recomputed + rows * model.hidden * (2 * num.residual + 2 * num.act), 0.0),
                           key=sum)
    else:
        remade, temps, made = dense_mlp_backward_bytes(model, tokens, lay, num, fsdp_block > 0, grad_bytes)
        in_block = moment(recomputed + remade, temps, made)
    mlp_kept, after_mlp = _mlp_kept_bytes(model, mt, mtp, num, lay.recompute, lay.ep), (0.0, 0.0, 0.0)
    if fsdp_mlp and model.experts > 1:
        # after the MoE's backward, before the block's FSDP post-backward: all its local experts' weight
        # gradients in the parameter dtype (FSDP casts them to the fp32 reduce dtype only then), beside
        # what the attention's backward still needs of the recomputed block, and the MoE's input norm's
        # backward (RMSNorm in fp32: the upcast input, its square, the normalised x and their gradients,
        # about six fp32 [tokens, hidden] tensors, traced)
        mlp_recomputed = mlp_activation_bytes(model, mt, mtp, num.act, ep=lay.ep) - mlp_kept
        norm_backward = 6 * 4 * model.hidden * tokens / lay.tp
        after_mlp = moment(max(0.0, recomputed - mlp_recomputed), num.gathered * fsdp_mlp + norm_backward)
    gathered = num.gathered * fsdp_block if zero == 3 else 0.0
    if zero == 3 and lay.pp > 1:
        # torch's pipelining turns reshard-after-backward off (stage.py): every block of the part stays
        # gathered from its backward to its next forward. In block j's backward (from the top) blocks
        # 0..j are gathered and j+1 is prefetched (FSDP2), while the micro-batch's j blocks above (and
        # block j's MLP, once past it) have freed their activations: the peak is at the top (j = 0) or,
        # when a block's parameters outweigh its activations (MoE experts), near the bottom (j = L-2)
        j = max(0, part - 2)                 # part: the blocks of one of the rank's pipeline stages
        past = max(after_mlp, moment(recomputed, 0.0), key=sum)
        top = (acts + in_block[0], in_block[1], gathered, gathered, in_block[2])
        in_mlp = (acts - j * per_layer + in_block[0], in_block[1], (j + 1) * gathered, gathered, in_block[2])
        past_mlp = (acts - j * per_layer - mlp_kept + past[0], past[1], (j + 1) * gathered, gathered, past[2])
        return max(top, in_mlp, past_mlp, key=sum)
    # the top block's backward: ZeRO 3 prefetches the block below; nothing is reduce-scattered yet (the
    # blocks' post-backwards are priced in rank_memory)
    extra, temps, made = max(in_block, after_mlp, key=sum)
    return acts + extra, temps, gathered, gathered, made


def _mlp_kept_bytes(model, tokens: float, tp: int, num: Numerics, mode: str, ep: int = 1) -> float:
    """What one block keeps of its MLP for backward: all its saved tensors without recompute (as
    mlp_activation_bytes); under selective, the matmul outputs (selective_layer_bytes); none under full."""
    if mode == "none":
        return mlp_activation_bytes(model, tokens, tp, num.act, ep=ep)
    if mode == "full":
        return 0.0
    mats, e = (2 if model.mlp != "gelu" else 1), num.act
    if model.experts == 1:
        return (mats * model.ffn_hidden + model.hidden) / tp * e * tokens    # w2's: a sequence shard under TP
    return tokens * (model.experts * e + model.experts_per_token * (mats * model.expert_ffn + model.hidden) * e
                     + (mats * model.shared_ffn + model.hidden) * e * (model.shared_experts > 0))


@dataclass(frozen=True)
class MemoryLedger:
    """One rank's peak (the more loaded of the first and last pipeline ranks), by category, in GB."""

    params_gb: float
    grads_gb: float
    optimizer_gb: float
    activations_gb: float
    temporaries_gb: float
    comm_buffers_gb: float
    runtime_gb: float
    per_gpu_gb: float
    capacity_gb: float
    worst_stage: str
    peak_phase: str
    logits_unchunked_gb: float
    logits_gb: float
    headroom: float = DEFAULT_HEADROOM

    @property
    def limit_gb(self) -> float:
        """What a plan may use: the GPU's memory less the headroom kept free."""
        return self.capacity_gb * (1 - self.headroom)

    @property
    def used_pct(self) -> float:
        """How close the plan runs: per-GPU need as a percentage of the limit."""
        return 100 * self.per_gpu_gb / self.limit_gb

    @property
    def fits(self) -> bool:
        return self.per_gpu_gb <= self.limit_gb

    def categories(self) -> dict[str, float]:
        """What torch allocates, by category (the runtime allowance is outside torch's allocator)."""
        return {"params": self.params_gb, "grads": self.grads_gb, "optimizer": self.optimizer_gb,
                "activations": self.activations_gb, "temporaries": self.temporaries_gb,
                "comm_buffers": self.comm_buffers_gb}

    def to_dict(self) -> dict:
        d = asdict(self)
        d["limit_gb"] = self.limit_gb
        d["used_pct"] = self.used_pct
        d["fits"] = self.fits
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in d.items()}


def memory_ledger(model, train, gpu, lay: Layout, headroom: float = DEFAULT_HEADROOM) -> MemoryLedger:
    """Peak bytes on the most loaded GPU as the trainer runs `lay`: the busiest pipeline rank (busiest_rank),
    plus the runtime allowance. It fits when it stays under the GPU's memory less `headroom` (a fraction)."""
    r, m = busiest_rank(model, train, gpu, lay)
    return _ledger(model, train, gpu, lay, headroom, r, m)


def fitting_ledger(model, train, gpu, lay: Layout, headroom: float = DEFAULT_HEADROOM) -> MemoryLedger | None:
    """memory_ledger where it fits, else None: what the search asks of most layouts. Pricing stops at the
    first rank over the limit (the busiest is at least as full), so a layout that cannot fit costs one rank."""
    limit = _limit_gb(gpu, headroom)
    busiest, peak, most = 0, None, 0.0
    for r in _candidate_ranks(model.layers, lay.pp, max(1, lay.virtual_stages), _vee(lay)):
        m = _rank_memory(model, train, gpu, lay, r, limit)
        if m is None:
            return None
        total = m.total
        if _per_gpu_gb(total) > limit:
            return None
        if peak is None or total > most:          # as busiest_rank: on a tie the lowest rank
            busiest, peak, most = r, m, total
    assert peak is not None
    return _ledger(model, train, gpu, lay, headroom, busiest, peak)


def _per_gpu_gb(total: float) -> float:
    """A rank's need (RankMemory.total) with the runtime allowance: MemoryLedger.per_gpu_gb."""
    return (total + BUFFER_FIXED_GB * GB) / GB


def _limit_gb(gpu, headroom: float) -> float:
    """MemoryLedger.limit_gb."""
    return float(gpu.memory_gb) * (1 - headroom)


def _ledger(model, train, gpu, lay: Layout, headroom: float, r: int, m: RankMemory) -> MemoryLedger:
    """The ledger of a plan whose busiest pipeline rank is `r` with peak `m`."""
    worst = "first" if r == 0 else "last" if _ends(lay, r)[1] else f"pp {r}"
    num = trainer_numerics(train, gpu, lay)
    model = padded_model(model, lay.tp)
    unchunked = train.seq_len / lay.cp * lay.micro_batch * model.vocab / lay.tp * (num.act + 4)
    return MemoryLedger(
        params_gb=m.params / GB, grads_gb=m.grads / GB, optimizer_gb=m.optimizer / GB,
        activations_gb=m.activations / GB, temporaries_gb=m.temporaries / GB, comm_buffers_gb=m.comm_buffers / GB,
        runtime_gb=BUFFER_FIXED_GB * GB / GB, per_gpu_gb=_per_gpu_gb(m.total), capacity_gb=float(gpu.memory_gb),
        worst_stage=worst if lay.pp > 1 else "only", peak_phase=m.phase, logits_unchunked_gb=unchunked / GB,
        logits_gb=logits_chunk_bytes(train, model, lay, num) / GB, headroom=headroom,
    )


def busiest_rank(model, train, gpu, lay: Layout) -> tuple[int, RankMemory]:
    """(pipeline rank, its peak) of the most loaded pipeline rank. Ranks differ in their layers (the
    stage split), embedding (rank 0), head and loss (rank pp-1) and micro-batches in flight (falling with
    the rank under 1F1B and interleaving), so beside the two ends each middle rank that holds a layer
    count no lower-numbered middle rank holds is priced (with uneven splits, e.g. 126 layers on pp 16,
    rank 1 holds more layers than rank 0 and nearly as many micro-batches)."""
    priced = [(r, rank_memory(model, train, gpu, lay, r))
              for r in _candidate_ranks(model.layers, lay.pp, max(1, lay.virtual_stages), _vee(lay))]
    return max(priced, key=lambda x: x[1].total)   # on a tie the lowest rank
