"""Llama-style decoder (RMSNorm, RoPE or ALiBi, grouped-query attention with any head width, SwiGLU,
GeGLU or GELU MLP, mixture-of-experts layers after the first `first_dense_layers`).

Why it looks like this: every parallelism in this package edits this model from the outside
(TP swaps Linear weights for DTensors, CP swaps the attention core, PP deletes the layers a
stage does not own, FSDP shards what is left), so the model itself is plain and its module
names (`layers.<global index>...`) never change with the layout.

Initialisation is per parameter: each one is drawn from a CPU generator seeded by
(seed, parameter name), so any rank can build exactly the parameters it keeps and every
layout starts from bit-identical weights without materialising the whole model anywhere.
"""

from __future__ import annotations

import math
import zlib
from functools import partial
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from launcher.plan.spec import ModelSpec
from launcher.trainer import float8
from launcher.trainer import sequence_parallel as sp_ops
from launcher.trainer.recompute import selective_contexts

NORM_EPS = 1e-5


class RMSNorm(nn.Module):
    """Written with plain ops so a sequence-sharded DTensor input works unchanged."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [len(positions), head_dim] (rotate-half layout) for the given absolute positions."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    ang = positions.to(torch.float64)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, s, h, d]; cos/sin [s, d]."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    c, s = cos[None, :, None, :].to(x.dtype), sin[None, :, None, :].to(x.dtype)
    return x * c + rot * s


def alibi_slopes(heads: int) -> torch.Tensor:
    """ALiBi's per-head slopes (Press et al.; BLOOM's build_alibi_tensor for a head count that is not a
    power of two: the closest power's geometric sequence, then every other slope of the next)."""
    def powers(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(heads))
    slopes = powers(closest)
    if closest < heads:
        slopes += powers(2 * closest)[0::2][:heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


class AlibiBias:
    """ALiBi's additive attention bias with the causal mask folded in, [1, heads, L, S]: query i at position
    q0 + i and key j get -slope·(q0 + i - j), -inf for j > q0 + i. Built once per shape and shared by every
    layer of a model part (each layer's heads are the same), so it costs one heads·L·S tensor."""

    def __init__(self, heads: int):
        self.heads = heads              # slopes made where the bias is (the model is built on the meta device)
        self._cache: dict[tuple, torch.Tensor] = {}

    def bias(self, first_head: int, n_heads: int, q0: int, L: int, S: int, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
        key = (first_head, n_heads, q0, L, S, dtype, device)
        if key not in self._cache:
            dist = (torch.arange(q0, q0 + L, device=device)[:, None] - torch.arange(S, device=device)[None, :])
            slopes = alibi_slopes(self.heads)[first_head:first_head + n_heads].to(device)
            b = -slopes[:, None, None] * dist.to(torch.float32)[None]
            b = b.masked_fill(dist[None] < 0, float("-inf"))
            self._cache[key] = b[None].to(dtype)
        return self._cache[key]


class Attention(nn.Module):
    def __init__(self, a: ModelSpec, alibi: AlibiBias | None = None):
        super().__init__()
        assert a.head_dim is not None
        self.head_dim = a.head_dim
        self.wq = nn.Linear(a.hidden, a.q_width, bias=False)
        self.wk = nn.Linear(a.hidden, a.kv_width, bias=False)
        self.wv = nn.Linear(a.hidden, a.kv_width, bias=False)
        self.wo = nn.Linear(a.q_width, a.hidden, bias=False)
        self.cp = None                  # context_parallel's CPAttention or UlyssesAttention once CP is applied
        self.alibi = alibi              # ALiBi instead of RoPE
        self.sp: tuple[int, str] | None = None   # (size, name) of the TP group once TP is applied
        self.first_head = 0             # this rank's first query head (tensor_parallel.apply_tp sets it)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.sp is None:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        else:
            # x is this rank's sequence shard: gathered inside the op, q/k/v for this rank's heads out
            q, k, v = sp_ops.gather_linear(x, [local(self.wq.weight), local(self.wk.weight),
                                                local(self.wv.weight)], *self.sp,
                                           float8.fp8_flags(self.wq, self.wk, self.wv))
        b, s = q.shape[0], q.shape[1]
        # After TP the projections return this rank's heads only; -1 picks that count up.
        q, k, v = (t.view(b, s, -1, self.head_dim) for t in (q, k, v))
        if self.alibi is None:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.core(q, k, v).reshape(b, s, -1)
        if self.sp is None:
            return self.wo(out)
        return sp_ops.linear_scatter(out, local(self.wo.weight), *self.sp, *float8.fp8_flags(self.wo))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))      # [b, heads, s, d]
        gqa = q.shape[1] != k.shape[1]
        if self.cp is not None:
            o = self.cp.attention(q, k, v, self.alibi_bias if self.alibi is not None else None)
        elif self.alibi is not None:
            L = q.shape[2]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=self.alibi_bias(0, L, L, q), enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return o.transpose(1, 2)

    def alibi_bias(self, q0: int, L: int, S: int, q: torch.Tensor, head0: int = 0) -> torch.Tensor:
        """The bias for q [b, heads, L, d], queries at positions q0.. against keys 0..S-1: this rank's heads, from
        its `head0`-th on (all-to-all CP hands each cp rank a group of them)."""
        assert self.alibi is not None
        return self.alibi.bias(self.first_head + head0, q.shape[1], q0, L, S, q.dtype, q.device)


class FeedForward(nn.Module):
    def __init__(self, a: ModelSpec, width: int | None = None):
        super().__init__()
        self.gated = a.mlp in ("swiglu", "geglu")
        self.act = F.silu if a.mlp == "swiglu" else partial(F.gelu, approximate="tanh") if a.mlp == "geglu" \
            else F.gelu
        ffn = width or a.ffn_hidden or 4 * a.hidden  # the job file's default
        self.w1 = nn.Linear(a.hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, a.hidden, bias=False)
        if self.gated:
            self.w3 = nn.Linear(a.hidden, ffn, bias=False)
        self.sp: tuple[int, str] | None = None   # (size, name) of the TP group once TP is applied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sp is not None:
            return self._forward_sp(x)
        if self.gated:
            return self.w2(self.act(self.w1(x)) * self.w3(x))
        return self.w2(self.act(self.w1(x)))

    def _forward_sp(self, x: torch.Tensor) -> torch.Tensor:
        """x is this rank's sequence shard; so is the result (sequence_parallel.py)."""
        assert self.sp is not None
        if self.gated:
            a, g = sp_ops.gather_linear(x, [local(self.w1.weight), local(self.w3.weight)], *self.sp,
                                        float8.fp8_flags(self.w1, self.w3))
            inner = self.act(a) * g
        else:
            inner = self.act(sp_ops.gather_linear(x, [local(self.w1.weight)], *self.sp, float8.fp8_flags(self.w1))[0])
        return sp_ops.linear_scatter(inner, local(self.w2.weight), *self.sp, *float8.fp8_flags(self.w2))


class Embedding(nn.Embedding):
    """The token embedding as a module of its own (FSDP makes it a unit of its own, as torchtitan).
    Under TP it holds its vocabulary rows and scatters the sequence out (sequence_parallel.embedding_scatter):
    `sp` is (first vocabulary row of this rank, TP size, TP group name), set by tensor_parallel."""

    sp: tuple[int, int, str] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sp is None:
            return super().forward(x)
        return sp_ops.embedding_scatter(x, local(cast(torch.Tensor, self.weight)), *self.sp)


class Block(nn.Module):
    def __init__(self, a: ModelSpec, index: int = 0, alibi: AlibiBias | None = None):
        super().__init__()
        self.attention_norm = RMSNorm(a.hidden, NORM_EPS)
        self.attention = Attention(a, alibi)
        self.ffn_norm = RMSNorm(a.hidden, NORM_EPS)
        if a.is_moe_layer(index):
            from launcher.trainer.moe import MoE

            self.feed_forward: nn.Module = MoE(a, FeedForward)
        else:
            self.feed_forward = FeedForward(a)
        self.recompute = "none"         # recompute.MODES: full keeps only the block input

    @property
    def is_moe(self) -> bool:
        from launcher.trainer.moe import MoE

        return isinstance(self.feed_forward, MoE)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.recompute == "full":
            return checkpoint(self._body, x, cos, sin, use_reentrant=False)
        if self.recompute == "selective":
            return checkpoint(self._body, x, cos, sin, use_reentrant=False, context_fn=selective_contexts)
        return self._body(x, cos, sin)

    def _body(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """The whole decoder, or one pipeline stage of it (modules it does not own are None).

    forward returns the final hidden states (after the last norm on the last stage); the
    output projection is applied inside the chunked loss, so full logits never exist.
    """

    def __init__(self, a: ModelSpec, seq_len: int):
        super().__init__()
        self.args = a
        self.tok_embeddings: Embedding | None = Embedding(a.vocab, a.hidden)
        alibi = AlibiBias(a.heads) if a.position == "alibi" else None
        self.layers = nn.ModuleDict({str(i): Block(a, i, alibi) for i in range(a.layers)})
        self.norm: nn.Module | None = RMSNorm(a.hidden, NORM_EPS)
        self.output: nn.Module | None = None if a.tied_embeddings else nn.Linear(a.hidden, a.vocab, bias=False)
        # RoPE's tables (empty under ALiBi: its bias is built per attention shape, AlibiBias)
        width = int(a.head_dim or 0) if a.position == "rope" else 0
        self.register_buffer("rope_cos", torch.empty(seq_len, width), persistent=False)
        self.register_buffer("rope_sin", torch.empty(seq_len, width), persistent=False)
        self.positions = torch.arange(seq_len)   # this rank's absolute token positions (CP changes it)
        self.rope_dtype = torch.float32         # the compute dtype (the engine sets bf16): no cast per forward

    def keep_only(self, first: int, last: int, has_embedding: bool, has_head: bool) -> None:
        """Turn this model into a pipeline stage owning layers [first, last)."""
        for name in list(self.layers.keys()):
            if not first <= int(name) < last:
                del self.layers[name]
        if not has_embedding:
            self.tok_embeddings = None
        if not has_head:
            self.norm = None
            self.output = None
        elif self.args.tied_embeddings and not has_embedding:
            # Tied weights on different pipeline stages (Megatron): the last stage owns a copy of
            # the embedding as its output head, initialised identically (same seed name, see
            # init_weights); the engine sums the two copies' gradients so they stay identical.
            assert self.norm is not None  # the head's stage keeps its norm
            self.output = nn.Linear(self.args.hidden, self.args.vocab, bias=False,
                                    device=self.norm.weight.device)

    @property
    def tied_head_copy(self) -> bool:
        """True on a pipeline stage whose output head is a copy of the (tied) embedding."""
        return self.args.tied_embeddings and self.output is not None

    def output_weight(self) -> torch.Tensor:
        """The [vocab, hidden] projection (the embedding when tied, unless this stage holds a copy)."""
        head = self.output if self.output is not None else self.tok_embeddings
        assert head is not None, "a stage holding neither the head nor the embedding has no output weight"
        return cast(torch.Tensor, head.weight)

    @property
    def is_last(self) -> bool:
        return self.norm is not None

    def set_positions(self, positions: torch.Tensor) -> None:
        self.positions = positions
        cos, sin = rope_tables(positions, self.rope_cos.shape[1], self.args.rope_theta)  # type: ignore[has-type]
        self.rope_cos = cos.to(self.rope_cos.device, self.rope_dtype)  # type: ignore[has-type]
        self.rope_sin = sin.to(self.rope_sin.device, self.rope_dtype)  # type: ignore[has-type]

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Seeded per-parameter init: same values for a parameter whatever the layout.

        Each parameter's full value is drawn on CPU from its own generator (one parameter at a
        time, so peak host memory is one full matrix); a TP-sharded DTensor keeps only its
        local shard of it.
        """
        from torch.distributed.tensor import DTensor, distribute_tensor

        std_out = 0.02 / math.sqrt(2 * self.args.layers)
        for name, p in self.named_parameters():
            if self.tied_head_copy and name.replace("_checkpoint_wrapped_module.", "") == "output.weight":
                name = "tok_embeddings.weight"     # the copy of a tied embedding starts identical
            g = torch.Generator().manual_seed(param_seed(seed, name))
            if name.endswith("norm.weight"):
                vals = torch.ones(p.shape)
            elif name.endswith(("wo.weight", "w2.weight")):
                vals = torch.randn(p.shape, generator=g) * std_out
            else:
                vals = torch.randn(p.shape, generator=g) * 0.02
            if isinstance(p, DTensor):
                local = distribute_tensor(vals.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
                p._local_tensor.copy_(local._local_tensor)
            else:
                p.copy_(vals.to(device=p.device, dtype=p.dtype))
        self.set_positions(self.positions)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x if self.tok_embeddings is None else self.tok_embeddings(x)
        # the tables are held in the compute dtype (rope_dtype): no copy here, and FSDP's cast of each
        # block's inputs to bf16 finds them cast
        cos, sin = self.rope_cos.to(h.dtype), self.rope_sin.to(h.dtype)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.norm is not None:
            h = self.norm(h)
        if hasattr(h, "to_local"):      # sequence-parallel DTensor -> this rank's sequence shard
            h = h.to_local()
        return h


def local(w: torch.Tensor) -> torch.Tensor:
    """A TP-sharded weight's local shard (differentiable: its gradient returns as the same DTensor).
    isinstance, not hasattr: dynamo answers hasattr on a DTensor parameter False (compiled blocks)."""
    return w.to_local() if isinstance(w, DTensor) else w


def param_seed(seed: int, name: str) -> int:
    clean = name.replace("_checkpoint_wrapped_module.", "")
    return (seed * 1_000_003 + zlib.crc32(clean.encode())) % (2**63)
