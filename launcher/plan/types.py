"""The plan's value vocabulary: the value sets its fields take (ZeRO stages, precisions, schedules, ...), their
Literal types, and the decoder shape (ModelSpec) every check reads.

Why apart from capabilities.py: the job file (spec.py), the Plan (model.py) and the checks of what the trainer
runs (capabilities.py) all name these values, and capabilities' checks take a ModelSpec; with the vocabulary and
the shape below all three, none of them needs another back. capabilities.py holds what the trainer refuses of
them (ZERO_REFUSED, PRECISION_REFUSED) and the table `launch schema` prints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from launcher.plan.schema import bounded

#: ZeRO stages the trainer runs as the ledger counts them: 0 replicated, 1 optimizer state sharded
#: over dp·cp (dist_optim.py), 2 and 3 FSDP2 (fsdp.py). A stage the trainer cannot run goes into
#: capabilities.ZERO_REFUSED with the reason, and out of ZERO_STAGES: the job file and the planner follow.
ZERO_STAGES = (0, 1, 2, 3)
#: Compute precisions (engine.py: bf16 weights and activations with fp32 masters — FSDP's mixed
#: precision under ZeRO 2/3, dist_optim.py under 0/1 — or fp32; fp8: bf16 with the linears' GEMMs in fp8,
#: FP8_LINEARS). fp16 would need loss scaling, which the trainer does not do.
PRECISIONS = ("bf16", "fp32", "fp8")
#: Where gradients accumulate over micro-batches without FSDP: in the weights' dtype (the seed's
#: 2 B/param, the default), or an fp32 buffer per weight (Megatron's main_grad, 4 B/param). FSDP (ZeRO
#: 2/3) reduces in fp32 either way. Measured (benchmarks/bf16_grads.py, 200 steps x 16 micro-batches):
#: both follow the fp32 reference within 1.5e-3 per step, the bf16 weights dominating the difference.
GRAD_DTYPES = ("bf16", "fp32")
OPTIMIZERS = ("adam", "sgd", "adam8bit")
RECOMPUTE = ("none", "selective", "full")
#: Pipeline schedules (pipeline.py, torch.distributed.pipelining); "none" when pp = 1. The last three are torch
#: 2.13's ScheduleInterleavedZeroBubble (ZB1P: Qi et al. 2023, arXiv 2401.10241), ScheduleZBVZeroBubble (the ZB
#: paper's ZB-V, §6) and ScheduleDualPipeV (DeepSeek-V3's DualPipe folded into a V, arXiv 2412.19437 §3.2.1).
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zero-bubble", "zero-bubble-v", "dualpipe-v")
#: schedules whose backward is split into the input gradient (torch's BACKWARD_INPUT, the ZB paper's B) and the
#: weight gradient (BACKWARD_WEIGHT, W), W run later to fill the bubble (pipelining/_backward.py)
SPLIT_BACKWARD = ("interleaved-zero-bubble", "zero-bubble-v", "dualpipe-v")
#: V-shaped stage layouts: exactly 2 stages per rank, rank r holding stages r and 2·pp-1-r (torch's
#: generate_rank_to_stage_mapping style "v"), so rank 0 holds the embedding and the head
V_SCHEDULES = ("zero-bubble-v", "dualpipe-v")
#: schedules that run several stages (virtual_stages) per rank
MULTI_STAGE = ("interleaved-1f1b", "interleaved-zero-bubble", *V_SCHEDULES)
MLPS = ("swiglu", "geglu", "gelu")
#: Position encodings (model.py): rotary embeddings, or ALiBi's per-head linear biases on the attention
#: scores (an explicit bias beside causal SDPA: no flash kernel, and any head_dim).
POSITIONS = ("rope", "alibi")
#: Context parallelism (context_parallel.py), over a load-balanced head+tail split of the sequence into 2·cp
#: chunks: all-gather (keys and values all-gathered over the cp group, Llama 3's) or all-to-all (DeepSpeed-Ulysses:
#: q/k/v exchanged for a group of heads over the whole sequence, heads/tp divisible by cp: cp_attention_problem).
CP_ATTENTIONS = ("all-gather", "all-to-all")
#: FP8 (train.precision fp8, trainer/float8.py): torchtitan's float8 recipe, torchao's Float8Linear with dynamic
#: rowwise scaling (recipe "rowwise": input, weight and output gradient cast to e4m3, one power-of-two scale per
#: row of each GEMM operand along the GEMM's inner dimension, so no amax history is kept) inside a bf16 trainer:
#: bf16 weights and activations, fp32 masters, every collective in bf16 ("for float8 with rowwise scaling, all
#: distributed communication is done in high precision", torchtitan's float8.md). Which linears convert
#: (train.fp8_linears, fp8_converts): auto, torchtitan's auto_filter_small_kn (torchao's _auto_filter_for_rowwise,
#: from H100 microbenchmarks: too small a GEMM loses more to the casts than fp8 gains), or all with both dims
#: divisible by 16 (torchtitan's module_filter_fn). The output head (torchtitan filters lm_head), the embedding,
#: a MoE's router (router.gate) and its routed experts (torchtitan converts those only through its grouped-GEMM
#: path) stay bf16. Under TP the sequence-parallel linears run the same recipe (sequence_parallel.py).
FP8_LINEARS = ("auto", "all")

ZeroStage = Literal[ZERO_STAGES]            # type: ignore[valid-type]
Precision = Literal[PRECISIONS]             # type: ignore[valid-type]
GradDtype = Literal[GRAD_DTYPES]            # type: ignore[valid-type]
Optimizer = Literal[OPTIMIZERS]             # type: ignore[valid-type]
Recompute = Literal[RECOMPUTE]              # type: ignore[valid-type]
Schedule = Literal[SCHEDULES]               # type: ignore[valid-type]
PlanSchedule = Literal[("none", *SCHEDULES)]  # type: ignore[valid-type]
Mlp = Literal[MLPS]                         # type: ignore[valid-type]
Position = Literal[POSITIONS]               # type: ignore[valid-type]
CpAttention = Literal[CP_ATTENTIONS]        # type: ignore[valid-type]
Fp8Linears = Literal[FP8_LINEARS]           # type: ignore[valid-type]


@dataclass(frozen=True)
class ModelSpec:
    """Decoder shape. `preset` names where it came from (a preset, 'hf:<config>' or 'custom')."""

    layers: int = bounded(lo=1, hi=10_000, doc="transformer blocks")
    hidden: int = bounded(lo=1, hi=1 << 20, doc="model width")
    heads: int = bounded(lo=1, hi=1 << 14, doc="attention heads")
    vocab: int = bounded(lo=1, hi=1 << 24, doc="vocabulary size")
    kv_heads: int | None = bounded(None, 1, 1 << 14, doc="key/value heads (GQA); default: heads")
    head_dim: int | None = bounded(None, 1, 1 << 14, doc="width of one attention head; default: hidden / heads "
                                                        "(Qwen3 and Gemma set it apart: heads·head_dim ≠ hidden)")
    ffn_hidden: int | None = bounded(None, 1, 1 << 22, doc="MLP width (of the dense layers, in a mixture of "
                                                           "experts); default: 4·hidden")
    mlp: Mlp = bounded("swiglu", doc="MLP kind: swiglu (SiLU-gated), geglu (tanh-GELU-gated, Gemma's) or gelu")
    tied_embeddings: bool = bounded(False, doc="output head shares the embedding weights")
    experts: int = bounded(1, 1, 4096, doc="> 1: every MLP is a mixture of this many experts")
    experts_per_token: int = bounded(1, 1, 4096, doc="experts each token is routed to (top-k)")
    moe_ffn_hidden: int | None = bounded(None, 1, 1 << 22, doc="each expert's MLP width (experts > 1); "
                                                               "default: ffn_hidden")
    shared_experts: int = bounded(0, 0, 256, doc="experts every token passes through besides its routed ones, "
                                                 "each moe_ffn_hidden wide (DeepSeek's n_shared_experts)")
    first_dense_layers: int = bounded(0, 0, 10_000, doc="the first k layers have a dense MLP (ffn_hidden wide) "
                                                        "instead of experts (DeepSeek's first_k_dense_replace)")
    position: Position = bounded("rope", doc="rope (rotary, needs an even head_dim) or alibi (BLOOM's linear "
                                             "attention biases, any head_dim)")
    rope_theta: float = bounded(10000.0, 1.0, 1e12, doc="RoPE base frequency (Llama 3: 500000)")
    vocab_multiple: int = bounded(128, 1, 1 << 16, doc="the embedding and output head are padded to a multiple of "
                                                       "this × tp rows (Megatron's make-vocab-size-divisible-by); "
                                                       "the padding's logits are masked out of the loss")
    preset: str = bounded("custom", doc="the preset or HuggingFace config this shape came from")

    def __post_init__(self) -> None:
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        if self.ffn_hidden is None:
            object.__setattr__(self, "ffn_hidden", 4 * self.hidden)
        if self.moe_ffn_hidden is None and self.experts > 1:
            object.__setattr__(self, "moe_ffn_hidden", self.ffn_hidden)

    @property
    def is_moe(self) -> bool:
        return self.experts > 1

    @property
    def q_width(self) -> int:
        """Output width of the query projection (and input width of the attention's output one)."""
        return self.heads * self.head_dim  # type: ignore[operator]

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim  # type: ignore[operator]

    @property
    def expert_ffn(self) -> int:
        """One routed (or shared) expert's MLP width."""
        return (self.moe_ffn_hidden or self.ffn_hidden) if self.is_moe else self.ffn_hidden  # type: ignore[return-value]

    @property
    def shared_ffn(self) -> int:
        """The shared experts' width, built as one MLP (DeepSeek's: moe_ffn_hidden·shared_experts)."""
        return self.shared_experts * self.expert_ffn if self.is_moe else 0

    @property
    def moe_layers(self) -> int:
        """Layers whose MLP is a mixture of experts: all but the first `first_dense_layers`."""
        return max(0, self.layers - self.first_dense_layers) if self.is_moe else 0

    def is_moe_layer(self, index: int) -> bool:
        return self.is_moe and index >= self.first_dense_layers
