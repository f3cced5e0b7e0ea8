"""Memory ledger: bytes per GPU for state (by optimizer and ZeRO stage), activations (by recompute
mode, TP with sequence parallelism, CP, pipeline in-flight micro-batches), logits, and buffers.

Conventions (the seed's, which are Korthikanti et al.'s and the ZeRO paper's):
- GB are 10^9 bytes; GiB figures from the papers are converted where compared.
- State: bf16/fp16 params 2 B + grads 2 B (4 B when grad_dtype is fp32) + fp32 master 4 B + Adam
  m, v 8 B = 16 B/param (18 with fp32 grads, Megatron's figure). SGD keeps momentum only (12 B),
  8-bit Adam keeps two 1-byte moments (10 B). fp32 training has no separate master copy.
- Activations per layer (2-byte activations, 1-byte dropout masks, Korthikanti Table 2):
  sbh(34 + 5as/h) stored, sbh·34 with selective recompute (attention core recomputed), 2sbh with
  full recompute (layer input only). The 34 is 18 + 4·ffn/h for a GELU MLP of width ffn (Megatron's
  general form); a SwiGLU MLP keeps one more ffn-wide tensor, 18 + 6·ffn/h.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache

GB = 1e9
GIB = 2**30

#: Stated allowance for what the ledger does not itemise: CUDA context and cuBLAS workspaces,
#: NCCL buffers, allocator fragmentation. 1 GB plus 5% of the device's memory.
BUFFER_FIXED_GB = 1.0
BUFFER_FRACTION = 0.05

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
    layer_dense: int        # per layer: attention + norms + router (replicated across EP)
    layer_expert: int       # per layer: all experts' MLPs (sharded across EP); dense MLP when experts=1
    layers: int
    experts: int

    @property
    def per_layer(self) -> int:
        return self.layer_dense + self.layer_expert

    @property
    def total(self) -> int:
        return self.embedding + self.head + self.final_norm + self.layers * self.per_layer

    def active_per_layer(self, experts_per_token: int) -> int:
        """Parameters a token passes through in one layer (MoE: only its top-k experts)."""
        return self.layer_dense + self.layer_expert * experts_per_token // self.experts


def mlp_params(hidden: int, ffn: int, mlp: str) -> int:
    return (3 if mlp == "swiglu" else 2) * hidden * ffn


def param_counts(model) -> ParamCounts:
    h, hd = model.hidden, model.hidden // model.heads
    attn = h * (model.heads * hd) + 2 * h * (model.kv_heads * hd) + (model.heads * hd) * h
    router = h * model.experts if model.experts > 1 else 0
    return ParamCounts(
        embedding=model.vocab * h,
        head=0 if model.tied_embeddings else model.vocab * h,
        final_norm=h,
        layer_dense=attn + 2 * h + router,
        layer_expert=model.experts * mlp_params(h, model.ffn_hidden, model.mlp),
        layers=model.layers,
        experts=model.experts,
    )


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
    linear = 18 + (6 if mlp == "swiglu" else 4) * ffn / h      # 34 for a 4h GELU MLP
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


def in_flight_microbatches(schedule: str, pp: int, grad_accum: int, virtual_stages: int = 1) -> float:
    """Micro-batches whose activations the first pipeline stage holds at its peak, as a multiple of
    one micro-batch of that stage's layers. 1F1B: min(m, p); interleaved: × (1 + (p-1)/(p·v));
    GPipe: all m. Without a pipeline, one micro-batch at a time."""
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(grad_accum)
    held = float(min(grad_accum, pp))
    if schedule == "interleaved-1f1b" and virtual_stages > 1:
        held *= 1 + (pp - 1) / (pp * virtual_stages)
    return held


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


# --- the full ledger ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    """The choices the ledger and time model need (a candidate plan, before rank placement)."""

    tp: int
    cp: int
    pp: int
    dp: int
    ep: int
    zero: int
    recompute: str
    micro_batch: int
    grad_accum: int
    schedule: str
    virtual_stages: int

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp


@dataclass(frozen=True)
class MemoryLedger:
    params_gb: float
    grads_gb: float
    optimizer_gb: float
    activations_gb: float
    logits_gb: float
    logits_unchunked_gb: float
    zero3_buffers_gb: float
    buffers_gb: float
    per_gpu_gb: float
    capacity_gb: float
    worst_stage: str
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

    def to_dict(self) -> dict:
        d = asdict(self)
        d["limit_gb"] = self.limit_gb
        d["used_pct"] = self.used_pct
        d["fits"] = self.fits
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in d.items()}


@lru_cache(maxsize=65536)
def _stage_states(model, train, tp: int, pp: int, cp: int, dp: int, ep: int, zero: int) -> tuple[dict, dict]:
    """State bytes of the first and last pipeline stage (cached: the search revisits them often)."""
    counts = param_counts(model)
    bpp = bytes_per_param(train.optimizer, train.precision, train.grad_dtype)
    shard = dp * cp                       # FSDP folds CP into the sharding group
    layers_per_stage = model.layers / pp
    dense_stage = counts.layer_dense * layers_per_stage / tp
    expert_stage = counts.layer_expert * layers_per_stage / (tp * ep)
    expert_shard = max(1, shard // ep)
    if zero < 2:
        # ZeRO 0/1 run without FSDP (trainer/fsdp.py): the trainer keeps fp32 parameters and runs bf16
        # under autocast, so the fp32 master weights are the parameters, whole on every rank, with
        # fp32 gradients; optimizer state is the moments alone (sharded over dp·cp under ZeRO 1).
        bpp = bytes_per_param(train.optimizer, "fp32")

    def state(extra_dense: float) -> dict[str, float]:
        a = state_bytes(dense_stage + extra_dense / tp, shard, zero, bpp)
        b = state_bytes(expert_stage, expert_shard, zero, bpp)
        return {k: a[k] + b[k] for k in a}

    first = state(counts.embedding + (counts.head + counts.final_norm if pp == 1 else 0))
    last = state(counts.head + counts.final_norm)
    return first, last


@lru_cache(maxsize=65536)
def _layer_activations(model, s: int, b: int, mode: str, tp: int, cp: int) -> float:
    return layer_activation_bytes(s, b, model.hidden, model.heads, mode, tp=tp, cp=cp,
                                  ffn=model.ffn_hidden, mlp=model.mlp)


def memory_ledger(model, train, gpu, lay: Layout, headroom: float = DEFAULT_HEADROOM) -> MemoryLedger:
    """Peak bytes on the most loaded GPU: the first stage (embedding, most in-flight activations) or
    the last (output head, logits), whichever is larger. It fits when it stays under the GPU's memory
    less `headroom` (a fraction)."""
    first_state, last_state = _stage_states(model, train, lay.tp, lay.pp, lay.cp, lay.dp, lay.ep, lay.zero)
    s, b = train.seq_len, lay.micro_batch
    layers_per_stage = model.layers / lay.pp
    per_layer = _layer_activations(model, s, b, lay.recompute, lay.tp, lay.cp)
    held = in_flight_microbatches(lay.schedule, lay.pp, lay.grad_accum, lay.virtual_stages)
    act_first = per_layer * layers_per_stage * held
    act_last = per_layer * layers_per_stage * (1.0 if lay.pp > 1 and lay.schedule != "gpipe" else held)
    logits = logits_bytes(s, b, model.vocab, tp=lay.tp, cp=lay.cp, chunk=train.loss_chunk)
    logits_full = logits_bytes(s, b, model.vocab, tp=lay.tp, cp=lay.cp)
    # ZeRO-3 gathers the current and the prefetched layer; the local shard is already counted.
    shard = lay.dp * lay.cp
    gathered = min(2.0, layers_per_stage) * _layer_params(model) / lay.tp * (4 if train.precision == "fp32" else 2)
    zero3 = gathered * (1 - 1 / shard) if lay.zero >= 3 else 0.0
    buffers = BUFFER_FIXED_GB * GB + BUFFER_FRACTION * gpu.memory_gb * GB

    first = sum(first_state.values()) + act_first + (logits if lay.pp == 1 else 0)
    last = sum(last_state.values()) + act_last + logits
    if lay.pp == 1 or first >= last:
        worst, st, act, lg = "first", first_state, act_first, (logits if lay.pp == 1 else 0.0)
    else:
        worst, st, act, lg = "last", last_state, act_last, logits
    total = sum(st.values()) + act + lg + zero3 + buffers
    return MemoryLedger(
        params_gb=st["params"] / GB, grads_gb=st["grads"] / GB, optimizer_gb=st["optimizer"] / GB,
        activations_gb=act / GB, logits_gb=lg / GB, logits_unchunked_gb=logits_full / GB,
        zero3_buffers_gb=zero3 / GB, buffers_gb=buffers / GB, per_gpu_gb=total / GB,
        capacity_gb=float(gpu.memory_gb), worst_stage=worst if lay.pp > 1 else "only", headroom=headroom,
    )


@lru_cache(maxsize=256)
def _layer_params(model) -> int:
    return param_counts(model).per_layer
