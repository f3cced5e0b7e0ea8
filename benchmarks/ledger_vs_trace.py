"""The planning ledger beside `launch verify`'s trace of the real trainer, per rank role and category.

For every layout of a matrix over the axes of issue 9 — model shape (tiny GQA, an MHA/GELU model,
Llama 3 8B / 70B / 405B, MoE: a tiny one and Mixtral 8x7B), ZeRO 0-3, recompute none/selective/full,
pp 1/2/4 with gpipe / 1F1B / interleaved 1F1B, cp 1/2, tp 1/2/8 — the plan is traced at its full
world size (launcher.verify.trace_plan: fake process group, FakeTensorMode, torch's memory
tracker) and each pipeline rank's traced peak and categories are printed beside
launcher.plan.ledger.rank_memory for that rank, with the difference and whether it passes the
bound of tests/integration/test_ledger_vs_trace.py (`misses`).

MATRIX covers every feasible pair of axis values (pairwise, not the full product: 24 layouts where
the product has thousands; `uncovered_pairs` proves it). The large shapes keep their real widths,
heads, vocabulary and sequence length but only a few layers (2 per pipeline chunk): tracing under
FakeTensorMode costs per op, not per byte, so a 405B layer traces as fast as a tiny one, and the
ledger is computed for that same reduced-depth model — every per-layer, per-rank and per-vocabulary
term is checked at the real sizes; only the layer count is small. FULL_DEPTH adds a few large
models at their real depth (verify extends their traces over layers: slower, not in the test).

    python benchmarks/ledger_vs_trace.py              # MATRIX + EXTRA (minutes)
    python benchmarks/ledger_vs_trace.py --all        # + FULL_DEPTH (slow)
    python benchmarks/ledger_vs_trace.py --only NAME  # one layout (repeatable)
    python benchmarks/ledger_vs_trace.py --json

Both sides file a tensor by what it is: FSDP's gathered parameters are parameters, the lean optimizer's
fp32 masters optimizer state (its packed reduce buckets communication buffers), FSDP's unsharded gradients accumulated under PP are gradients, a block recomputed in
backward (full recompute) is a temporary, as torch's tracker sees it made in backward.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time

from launcher.plan import presets
from launcher.plan.ledger import GB, rank_memory
from launcher.plan.planner import plan_job
from launcher.plan.spec import spec_from_dict

CATEGORIES = ("params", "grads", "optimizer", "activations", "temporaries", "comm_buffers")
#: the test's bound: the total and each category within REL of the trace, or within FLOOR of the
#: rank's traced total where the category is that small (no relative bound means anything near zero)
REL, FLOOR = 0.10, 0.03

TINY_MOE = {"layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn_hidden": 96, "vocab": 256,
            "experts": 4, "experts_per_token": 2}
#: Mixtral's shape (8 experts, top 2, GQA, SwiGLU) scaled down: expert weights dominate each block as in
#: Mixtral, so the per-layer MoE terms (gathered experts, their gradients) are what the test checks
MIXTRAL_MINI = {"layers": 8, "hidden": 512, "heads": 8, "kv_heads": 2, "ffn_hidden": 1792, "vocab": 4096,
                "mlp": "swiglu", "tied_embeddings": False, "experts": 8, "experts_per_token": 2}
MHA = {"layers": 8, "hidden": 256, "heads": 8, "kv_heads": 8, "ffn_hidden": 1024, "vocab": 1024, "mlp": "gelu"}
SHAPES = {"tiny": presets.MODELS["tiny"], "mha-gelu": MHA, "tiny-moe": TINY_MOE,
          **{k: presets.MODELS[k] for k in ("llama3-8b", "llama3-70b", "llama3-405b", "mixtral-8x7b")}}
#: the shape axis of the matrix: both MoE shapes are its "moe" value
FAMILY = {"tiny": "tiny", "mha-gelu": "mha-gelu", "tiny-moe": "moe", "mixtral-8x7b": "moe",
          "llama3-8b": "llama3-8b", "llama3-70b": "llama3-70b", "llama3-405b": "llama3-405b"}
SEQ = {"tiny": 256, "mha-gelu": 512, "tiny-moe": 256, "mixtral-8x7b": 4096}
SHORT = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved-1f1b": "interleaved", "interleaved-zero-bubble": "izb",
         "zero-bubble-v": "zbv", "dualpipe-v": "dpv"}


#: a reduced llama3-8b (GQA, SwiGLU, ffn 3.5h): its terms at a few layers and a small vocabulary
DENSE = {"layers": 4, "hidden": 1536, "heads": 12, "kv_heads": 4, "ffn_hidden": 5376, "vocab": 4096}
#: a GELU MHA model whose 6 layers split unevenly over pp 4 (1, 2, 2, 1): under 1F1B rank 1 is the busiest
UNEVEN = {**MHA, "layers": 6}
#: DeepSeek-MoE's features scaled down (HuggingFace config families, issue 22): heads·head_dim ≠ hidden, experts
#: narrower than the dense layers' MLP, a shared expert, the first layer dense
DEEPSEEK_MINI = {"layers": 4, "hidden": 256, "heads": 4, "kv_heads": 2, "head_dim": 96, "ffn_hidden": 1024,
                 "vocab": 2048, "experts": 4, "experts_per_token": 2, "moe_ffn_hidden": 256, "shared_experts": 1,
                 "first_dense_layers": 1}
#: Gemma's GeGLU and wide heads with ALiBi (BLOOM's biases), tied embeddings
GEGLU_ALIBI = {"layers": 4, "hidden": 256, "heads": 4, "kv_heads": 4, "head_dim": 96, "ffn_hidden": 768,
               "vocab": 2048, "mlp": "geglu", "position": "alibi", "tied_embeddings": True}


def case(model, nodes: int, gpn: int, seq: int, gb: int, precision: str = "bf16", loss_chunk: int | None = None,
         train_extra: dict | None = None, **parallel) -> dict:
    train = {"seq_len": seq, "global_batch": gb, "precision": precision, **(train_extra or {})}
    if loss_chunk is not None:
        train["loss_chunk"] = loss_chunk
    return {"model": model, "train": train,
            "cluster": {"nodes": nodes, "gpus_per_node": gpn, "gpu": "h100-sxm"}, "parallel": parallel}


def entry(shape: str, *, zero: int, recompute: str, pp: int = 1, schedule: str = "none", cp: int = 1,
          tp: int = 1, dp: int = 2, ep: int = 1, layers: int | None = None, mb: int | None = None,
          precision: str = "bf16") -> tuple[str, dict]:
    """(name, job) of one layout. Large shapes get `layers` (default 2 per pipeline chunk) instead of
    their real depth; the world is tp·cp·pp·dp ranks; pipelines run pp micro-batches, others 2."""
    base = SHAPES[shape]
    small = base["hidden"] <= 256
    v = 2 if schedule == "interleaved-1f1b" else 1
    if layers is None and not small:
        layers = 2 * pp * v
    model = dict(base, layers=layers) if layers and layers != base["layers"] else (shape if shape in presets.MODELS
                                                                                   else dict(base))
    mb = mb or (2 if small else 1)
    ga = pp if pp > 1 else 2
    world = tp * cp * pp * dp
    gpn = min(8, world)
    par = {"tp": tp, "cp": cp, "pp": pp, "zero": zero, "recompute": recompute, "micro_batch": mb}
    if pp > 1:
        par["schedule"] = schedule
    if v > 1:
        par["virtual_stages"] = v
    if ep > 1:
        par["ep"] = ep
    name = " ".join([shape + (f"/{layers}L" if layers and layers != base["layers"] else ""), f"tp{tp}", f"cp{cp}",
                     f"pp{pp}" + (f" {SHORT[schedule]}" if pp > 1 else ""), f"z{zero}", recompute]
                    + ([f"ep{ep}"] if ep > 1 else []) + ([precision] if precision != "bf16" else []))
    return name, case(model, world // gpn, gpn, SEQ.get(shape, 8192), mb * ga * dp, precision, **par)


#: pairwise over (shape, zero, recompute, pp, schedule, cp, tp): every feasible pair of values in
#: some layout (tiny has 2 kv heads: no tp 8; the trainer runs MoE without TP)
MATRIX = [
    entry("tiny", zero=0, recompute="full", tp=2),
    entry("tiny", zero=1, recompute="none", pp=2, schedule="1f1b"),
    entry("tiny", zero=2, recompute="selective", pp=2, schedule="interleaved-1f1b", cp=2, tp=2, dp=1),
    entry("tiny", zero=3, recompute="full", pp=4, schedule="gpipe", cp=2, tp=2, dp=1, layers=8),
    entry("mha-gelu", zero=0, recompute="full", cp=2, layers=4),
    entry("mha-gelu", zero=1, recompute="none", pp=4, schedule="gpipe", tp=2),
    entry("mha-gelu", zero=2, recompute="selective", pp=2, schedule="1f1b", cp=2, layers=4),
    entry("mha-gelu", zero=3, recompute="full", pp=2, schedule="interleaved-1f1b", tp=8),
    entry("tiny-moe", zero=0, recompute="none", pp=2, schedule="gpipe", dp=4, ep=2),
    entry("tiny-moe", zero=3, recompute="full", cp=2, ep=4),
    entry("mixtral-8x7b", zero=1, recompute="none", pp=2, schedule="interleaved-1f1b", cp=2, dp=4, ep=8),
    entry("mixtral-8x7b", zero=2, recompute="selective", pp=4, schedule="1f1b", cp=2, dp=2, ep=4),
    entry("llama3-8b", zero=0, recompute="full", pp=4, schedule="1f1b", cp=2, tp=8),
    entry("llama3-8b", zero=1, recompute="full", pp=2, schedule="interleaved-1f1b", cp=2),
    entry("llama3-8b", zero=2, recompute="none", tp=2),
    entry("llama3-8b", zero=3, recompute="selective", pp=2, schedule="gpipe", cp=2, tp=2),
    entry("llama3-70b", zero=0, recompute="none", pp=4, schedule="interleaved-1f1b", cp=2, tp=2),
    entry("llama3-70b", zero=1, recompute="selective", tp=8),
    entry("llama3-70b", zero=2, recompute="none", pp=2, schedule="gpipe", cp=2, tp=8),
    entry("llama3-70b", zero=3, recompute="full", pp=2, schedule="1f1b"),
    entry("llama3-405b", zero=0, recompute="selective", pp=2, schedule="interleaved-1f1b", cp=2),
    entry("llama3-405b", zero=1, recompute="full", pp=2, schedule="1f1b", cp=2, tp=2),
    entry("llama3-405b", zero=2, recompute="full", pp=4, schedule="gpipe", tp=8),
    entry("llama3-405b", zero=3, recompute="none", cp=2),
]
#: layouts kept beside the matrix: cheap ones it does not hold (dp 8 at pp 1, fp32, ZeRO 1/2 at pp 4, the
#: tiny example's own)
EXTRA = [
    ("tiny dp8 z0 none", case("tiny", 1, 8, 256, 16, tp=1, cp=1, pp=1, zero=0, recompute="none", micro_batch=2)),
    ("tiny dp8 z1 selective", case("tiny", 1, 8, 256, 16, tp=1, cp=1, pp=1, zero=1, recompute="selective",
                                   micro_batch=2)),
    ("tiny dp8 z2 none", case("tiny", 1, 8, 256, 16, tp=1, cp=1, pp=1, zero=2, recompute="none", micro_batch=2)),
    ("tiny dp8 z3 full", case("tiny", 1, 8, 256, 16, tp=1, cp=1, pp=1, zero=3, recompute="full", micro_batch=2)),
    ("tiny tp2 dp4 z3", case("tiny", 1, 8, 256, 16, tp=2, cp=1, pp=1, zero=3, recompute="none", micro_batch=2)),
    ("tiny cp2 dp4 z1", case("tiny", 1, 8, 256, 16, tp=1, cp=2, pp=1, zero=1, recompute="none", micro_batch=2)),
    ("tiny pp2 1f1b z2", case("tiny", 1, 8, 256, 32, tp=1, cp=1, pp=2, zero=2, recompute="none", micro_batch=2,
                              schedule="1f1b")),
    ("tiny pp2 gpipe z0", case("tiny", 1, 8, 256, 32, tp=1, cp=1, pp=2, zero=0, recompute="none", micro_batch=2,
                               schedule="gpipe")),
    ("tiny pp2 interleaved z3", case("tiny", 1, 8, 256, 16, tp=1, cp=1, pp=2, zero=3, recompute="none",
                                     micro_batch=1, schedule="interleaved-1f1b", virtual_stages=2)),
    ("tiny pp4 1f1b z1", case("tiny", 1, 8, 256, 16, tp=1, cp=1, pp=4, zero=1, recompute="selective",
                              micro_batch=2, schedule="1f1b")),
    ("tiny dp4 z2 fp32", case("tiny", 1, 4, 256, 8, "fp32", tp=1, cp=1, pp=1, zero=2, recompute="selective",
                              micro_batch=2)),
    ("mha-gelu tp2 pp2 z3", case(MHA, 1, 8, 512, 16, tp=2, cp=1, pp=2, zero=3, recompute="selective",
                                 micro_batch=1, schedule="1f1b")),
    # bf16 weights over several micro-batches (the lean ZeRO 1: flat fp32 masters, the reduce bucket)
    ("dense cp2 z1 full", case(DENSE, 1, 8, 512, 32, tp=1, cp=2, pp=1, zero=1, recompute="full", micro_batch=1)),
    # train.grad_dtype fp32: each micro-batch's bf16 gradient added into an fp32 buffer (Megatron's main_grad)
    ("dense dp8 z1 fp32 grads", case(DENSE, 1, 8, 512, 32, tp=1, cp=1, pp=1, zero=1, recompute="full", micro_batch=1,
                                     train_extra={"grad_dtype": "fp32"})),
    # the optimizer step as the GPU runs it (foreach): SGD adds weight decay to a copy of every gradient
    ("dense dp8 z0 sgd decay", case(DENSE, 1, 8, 512, 8, train_extra={"optimizer": "sgd", "weight_decay": 0.1},
                                    tp=1, cp=1, pp=1, zero=0, recompute="full", micro_batch=1)),
    # several loss chunks (head-gradient accumulation), TP's whole-vocabulary embedding gradient,
    # selective recompute's backward under TP
    ("dense tp2 pp2 z2 chunks", case({**DENSE, "vocab": 65536}, 1, 8, 1024, 16, loss_chunk=256, tp=2, cp=1, pp=2,
                                     zero=2, recompute="selective", micro_batch=1, schedule="1f1b")),
    ("uneven pp4 1f1b z2", case(UNEVEN, 1, 8, 512, 16, tp=1, cp=1, pp=4, zero=2, recompute="none", micro_batch=1,
                                schedule="1f1b")),
    ("tiny-cpu example", case("tiny", 1, 4, 64, 8, "fp32", tp=2, cp=1, pp=1, zero=3, recompute="none",
                              micro_batch=2)),
    ("moe ep2 dp8 z2", case(TINY_MOE, 1, 8, 256, 16, tp=1, cp=1, pp=1, ep=2, zero=2, recompute="none",
                            micro_batch=2)),
    ("moe ep4 dp8 z0", case(TINY_MOE, 1, 8, 256, 16, tp=1, cp=1, pp=1, ep=4, zero=0, recompute="full",
                            micro_batch=2)),
    # attention TP with the experts whole per TP rank (expert TP 1), experts over ep, the lean ZeRO 1
    ("moe tp2 ep2 dp4 z1", case(TINY_MOE, 1, 8, 256, 16, tp=2, cp=1, pp=1, ep=2, zero=1, recompute="none",
                                micro_batch=2)),
    ("mixtral-mini tp2 ep4 pp2 z1 selective", case(MIXTRAL_MINI, 1, 16, 512, 32, tp=2, cp=1, pp=2, ep=4, zero=1,
                                                   recompute="selective", micro_batch=1, schedule="1f1b")),
    ("mixtral-mini dp8 z3 selective", case(MIXTRAL_MINI, 1, 8, 512, 32, tp=1, cp=1, pp=1, ep=1, zero=3,
                                           recompute="selective", micro_batch=1)),
    ("mixtral-mini pp2 z3 selective", case(MIXTRAL_MINI, 1, 8, 512, 32, tp=1, cp=1, pp=2, ep=1, zero=3,
                                           recompute="selective", micro_batch=1, schedule="1f1b")),
    ("mixtral-mini ep4 pp2 z2 selective", case(MIXTRAL_MINI, 1, 8, 512, 32, tp=1, cp=1, pp=2, ep=4, zero=2,
                                               recompute="selective", micro_batch=1, schedule="1f1b")),
    # HuggingFace families' shapes (issue 22): a dense first layer on pipeline rank 0 only, shared experts under TP
    ("deepseek-mini pp2 ep2 dp4 z1", case(DEEPSEEK_MINI, 1, 8, 512, 16, tp=1, cp=1, pp=2, ep=2, zero=1,
                                          recompute="none", micro_batch=1, schedule="1f1b")),
    ("deepseek-mini tp2 dp4 z0", case(DEEPSEEK_MINI, 1, 8, 512, 16, tp=2, cp=1, pp=1, zero=0, recompute="none",
                                      micro_batch=1)),
    ("deepseek-mini dp8 z3 full", case(DEEPSEEK_MINI, 1, 8, 512, 16, tp=1, cp=1, pp=1, zero=3, recompute="full",
                                       micro_batch=1)),
    ("geglu-alibi tp2 dp4 z1", case(GEGLU_ALIBI, 1, 8, 512, 16, tp=2, cp=1, pp=1, zero=1, recompute="none",
                                    micro_batch=1)),
    ("geglu-alibi cp2 dp4 z3 selective", case(GEGLU_ALIBI, 1, 8, 512, 16, tp=1, cp=2, pp=1, zero=3,
                                              recompute="selective", micro_batch=1)),
    # all-to-all CP (DeepSpeed-Ulysses, parallel.cp_attention): MHA, GQA under TP, kv heads repeated up to cp
    # (tiny: 1 kv head per TP rank, cp 2), ALiBi's bias per head group, Llama 3 8B's widths at 8k tokens
    ("mha-gelu cp4 a2a dp2 z1 none", case(MHA, 1, 8, 512, 8, tp=1, cp=4, pp=1, zero=1, recompute="none",
                                          micro_batch=2, cp_attention="all-to-all")),
    ("dense tp2 cp2 a2a dp2 z3 selective", case(DENSE, 1, 8, 1024, 4, tp=2, cp=2, pp=1, zero=3,
                                                recompute="selective", micro_batch=1, cp_attention="all-to-all")),
    ("tiny tp2 cp2 a2a dp2 z2 full", case("tiny", 1, 8, 256, 8, tp=2, cp=2, pp=1, zero=2, recompute="full",
                                          micro_batch=2, cp_attention="all-to-all")),
    ("geglu-alibi cp2 a2a dp4 z0 none", case(GEGLU_ALIBI, 1, 8, 512, 16, tp=1, cp=2, pp=1, zero=0,
                                             recompute="none", micro_batch=1, cp_attention="all-to-all")),
    ("llama3-8b/2L tp2 cp4 a2a z1 none", case({**presets.MODELS["llama3-8b"], "layers": 2}, 1, 8, 8192, 2, tp=2,
                                              cp=4, pp=1, zero=1, recompute="none", micro_batch=1,
                                              cp_attention="all-to-all")),
    ("llama3-8b/4L tp1 cp2 a2a pp2 1f1b z2 selective",
     case({**presets.MODELS["llama3-8b"], "layers": 4}, 1, 8, 8192, 4, tp=1, cp=2, pp=2, zero=2,
          recompute="selective", micro_batch=1, schedule="1f1b", cp_attention="all-to-all")),
    # hybrid sharding (parallel.dp_shard, issue 25): FSDP2 on a (replicate, shard) mesh, each node's GPUs a
    # shard group; the lean ZeRO 1 sharded over dp_shard·cp; with TP and CP; under PP
    ("tiny dp8 shard4 z3 hsdp", case("tiny", 2, 4, 256, 32, tp=1, cp=1, pp=1, zero=3, recompute="none",
                                     micro_batch=2, dp_shard=4)),
    ("dense dp8 shard4 z1 hsdp", case(DENSE, 1, 8, 512, 32, tp=1, cp=1, pp=1, zero=1, recompute="full",
                                      micro_batch=1, dp_shard=4)),
    ("llama3-8b/2L tp2 cp2 dp4 shard2 z2 hsdp", case({**presets.MODELS["llama3-8b"], "layers": 2}, 2, 8, 8192, 8,
                                                     tp=2, cp=2, pp=1, zero=2, recompute="selective", micro_batch=1,
                                                     dp_shard=2)),
    # one rank per shard group: its peak was the root unit's gather of the 128k-row embedding and head until the
    # norm and head became a unit of their own (fsdp.apply_fsdp)
    ("llama3-8b/2L tp2 cp2 dp4 shard1 z2 hsdp", case({**presets.MODELS["llama3-8b"], "layers": 2}, 2, 8, 8192, 8,
                                                     tp=2, cp=2, pp=1, zero=2, recompute="selective", micro_batch=1,
                                                     dp_shard=1)),
    ("llama3-8b/4L dp16 shard8 pp2 z3 hsdp", case({**presets.MODELS["llama3-8b"], "layers": 4}, 4, 8, 8192, 32,
                                                  tp=1, cp=1, pp=2, zero=3, recompute="full", micro_batch=1,
                                                  schedule="1f1b", dp_shard=8)),
    # fp8 (train.precision, issue 25 §4): torchao's Float8Linear under FSDP (tp 1) and the sequence-parallel ops' fp8
    # GEMMs (tp 2), their casts in the MLP's backward (ledger.dense_mlp_backward_bytes); Llama 3's widths under the
    # auto filter (k and v stay bf16). fp8_linears all on the reduced shapes, whose linears auto would leave bf16
    ("dense tp2 dp4 z1 full fp8", case(DENSE, 1, 8, 2048, 8, "fp8", train_extra={"fp8_linears": "all"}, tp=2, cp=1,
                                       pp=1, zero=1, recompute="full", micro_batch=1)),
    ("dense tp2 dp4 z1 none fp8", case(DENSE, 1, 8, 2048, 8, "fp8", train_extra={"fp8_linears": "all"}, tp=2, cp=1,
                                       pp=1, zero=1, recompute="none", micro_batch=1)),
    ("llama3-8b/2L dp8 z3 none fp8", case({**presets.MODELS["llama3-8b"], "layers": 2}, 1, 8, 8192, 8, "fp8", tp=1,
                                          cp=1, pp=1, zero=3, recompute="none", micro_batch=1)),
    ("llama3-8b/2L tp2 dp4 z1 selective fp8", case({**presets.MODELS["llama3-8b"], "layers": 2}, 1, 8, 8192, 8, "fp8",
                                                   tp=2, cp=1, pp=1, zero=1, recompute="selective", micro_batch=1)),
    ("llama3-70b/2L tp8 z1 full fp8", case({**presets.MODELS["llama3-70b"], "layers": 2}, 1, 8, 8192, 8, "fp8", tp=8,
                                           cp=1, pp=1, zero=1, recompute="full", micro_batch=1)),
    # a tp 1 MLP's backward with torchao's casts (Float8Linear): where hidden > tokens the peak is w3's input gradient,
    # its weight's fp32 copies beside the finished gradients (FSDP's unsharded ones, the lean ZeRO 1's in .grad)
    ("dense dp8 z3 full fp8", case(DENSE, 1, 8, 1024, 8, "fp8", train_extra={"fp8_linears": "all"}, tp=1, cp=1, pp=1,
                                   zero=3, recompute="full", micro_batch=1)),
    ("dense dp8 z3 none fp8", case(DENSE, 1, 8, 1024, 8, "fp8", train_extra={"fp8_linears": "all"}, tp=1, cp=1, pp=1,
                                   zero=3, recompute="none", micro_batch=1)),
    ("dense dp8 z1 none fp8", case(DENSE, 1, 8, 1024, 8, "fp8", train_extra={"fp8_linears": "all"}, tp=1, cp=1, pp=1,
                                   zero=1, recompute="none", micro_batch=1)),
    # the split-backward schedules (issue 25 §1): each rank priced action by action of torch's own order
    # (launcher/plan/schedules.py), the held weight-gradient inputs from each I to its W, the receive buffers'
    # input gradients; ZB-V and DualPipe-V's V (rank 0 holds the embedding and the head), ZB1P over two chunks,
    # TP's sequence-parallel ops in both backward halves (8 layers of the reduced llama3-8b, 10-20 s CPU each)
    ("dense/8L zbv tp2 pp2 z1", case(dict(DENSE, layers=8), 1, 8, 512, 16, tp=2, cp=1, pp=2, zero=1, recompute="none",
                                     micro_batch=1, schedule="zero-bubble-v", virtual_stages=2)),
    ("dense/8L izb pp2 v2 z1", case(dict(DENSE, layers=8), 1, 4, 512, 16, tp=1, cp=1, pp=2, zero=1, recompute="none",
                                    micro_batch=1, schedule="interleaved-zero-bubble", virtual_stages=2)),
    ("dense/8L dpv pp2 z0", case(dict(DENSE, layers=8), 1, 4, 512, 16, tp=1, cp=1, pp=2, zero=0, recompute="none",
                                 micro_batch=1, schedule="dualpipe-v", virtual_stages=2)),
    # not met: FSDP (ZeRO 2) under a split backward, where each W's bf16 .grad waits for a post-backward the ledger
    # places by rule (the chunk's next I or F, a whole backward's end): pp 0 grads +25 %, pp 1 -17 % (totals
    # +3.1 %, -1.0 %)
    ("dense/8L zbv pp2 z2", case(dict(DENSE, layers=8), 1, 4, 512, 16, tp=1, cp=1, pp=2, zero=2, recompute="none",
                                 micro_batch=1, schedule="zero-bubble-v", virtual_stages=2)),
]
#: large models at their real depth (verify traces 1-3 layers per stage and extends: minutes each)
FULL_DEPTH = [
    ("llama3-1b dp8 z1", case("llama3-1b", 1, 8, 4096, 32, tp=1, cp=1, pp=1, zero=1, recompute="none", micro_batch=1)),
    ("llama3-8b dp8 z3", case("llama3-8b", 1, 8, 8192, 64, tp=1, cp=1, pp=1, zero=3, recompute="none", micro_batch=1)),
    ("llama3-8b tp2 pp2 z2", case("llama3-8b", 1, 8, 8192, 64, tp=2, cp=1, pp=2, zero=2, recompute="selective",
                                  micro_batch=1, schedule="1f1b")),
    ("llama3-8b cp2 z1 full", case("llama3-8b", 1, 8, 8192, 64, tp=1, cp=2, pp=1, zero=1, recompute="full",
                                   micro_batch=1)),
    ("llama3-70b tp8 pp4 z3", case("llama3-70b", 64, 8, 8192, 512, tp=8, cp=1, pp=4, zero=3, recompute="full",
                                   micro_batch=1, schedule="interleaved-1f1b", virtual_stages=5)),
    ("mixtral ep8 z3", case("mixtral-8x7b", 8, 8, 4096, 256, tp=1, cp=1, pp=1, ep=8, zero=3, recompute="full",
                            micro_batch=1)),
    # examples/mixtral-8x7b.yaml's layouts: ZeRO 3 under PP (every expert of a stage stays gathered
    # through backward) and EP with FSDP experts under selective recompute. No MoE row with TP: the
    # trainer runs experts without tensor parallelism (capabilities.MOE_WITH_TP)
    ("mixtral pp8 z3 selective", case("mixtral-8x7b", 8, 8, 4096, 1024, tp=1, cp=1, pp=8, ep=1, zero=3,
                                      recompute="selective", micro_batch=1, schedule="1f1b")),
    ("mixtral ep4 pp4 z2 selective", case("mixtral-8x7b", 8, 8, 4096, 1024, tp=1, cp=1, pp=4, ep=4, zero=2,
                                          recompute="selective", micro_batch=1, schedule="1f1b")),
    ("llama3-405b tp8 pp8 cp2", case("llama3-405b", 128, 8, 8192, 512, tp=8, cp=2, pp=8, zero=3, recompute="full",
                                     micro_batch=1, schedule="1f1b")),
]
LAYOUTS = dict(MATRIX + EXTRA + FULL_DEPTH)


def axes(job: dict) -> dict:
    """The matrix axes of one job: shape family, zero, recompute, pp, schedule, cp, tp."""
    m, p = job["model"], job["parallel"]
    shape = m if isinstance(m, str) else next(
        (k for k, s in SHAPES.items() if {**s, "layers": m.get("layers", s["layers"])} == {**s, **m}), "custom")
    return {"shape": FAMILY.get(shape, shape), "zero": p["zero"], "recompute": p["recompute"], "pp": p["pp"],
            "schedule": p.get("schedule", "none") if p["pp"] > 1 else "none", "cp": p["cp"], "tp": p["tp"]}


def feasible(a: dict) -> bool:
    """What the trainer can build: tiny has 2 kv heads (tp <= 2), MoE runs without TP, pp 1 has no schedule."""
    return not ((a["shape"] == "tiny" and a["tp"] > 2) or (a["shape"] == "moe" and a["tp"] > 1)
                or ((a["pp"] == 1) != (a["schedule"] == "none")))


AXES = {"shape": list(dict.fromkeys(FAMILY.values())), "zero": [0, 1, 2, 3], "recompute": ["none", "selective", "full"],
        "pp": [1, 2, 4], "schedule": ["none", "gpipe", "1f1b", "interleaved-1f1b"], "cp": [1, 2], "tp": [1, 2, 8]}


def uncovered_pairs(names: list[str]) -> list[tuple]:
    """Every feasible (axis, value, axis, value) pair no layout of `names` holds."""
    have = set()
    for n in names:
        a = axes(LAYOUTS[n])
        have |= {(x, a[x], y, a[y]) for x, y in itertools.combinations(AXES, 2)}
    full = [dict(zip(AXES, v)) for v in itertools.product(*AXES.values())]
    need = {(x, a[x], y, a[y]) for a in full if feasible(a) for x, y in itertools.combinations(AXES, 2)}
    return sorted(need - have, key=str)


def misses(row: dict) -> list[str]:
    """What breaks the bound in one role's row: [] when the total and every category are within it."""
    if "traced_gb" not in row:
        return [f"not traced: {row.get('error')}"]
    out = []
    t, led = row["traced_gb"], row["ledger_gb"]
    if abs(led - t) > REL * t:
        out.append(f"total {led / t - 1:+.1%}")
    for c in CATEGORIES:
        tc, lc = row["traced"][c], row["ledger"][c]
        if abs(lc - tc) > max(REL * tc, FLOOR * t):
            out.append(f"{c} {lc - tc:+.3g} GB ({(lc - tc) / tc:+.0%})" if tc else f"{c} {lc - tc:+.3g} GB (traced 0)")
    return out


def compare(name: str, job: dict, workers: int | None = None) -> list[dict]:
    """One row per traced role: the traced peak and categories beside the ledger's (GB). Eager blocks unless the
    job says train.compile (the planner would compile them on these GPUs; compiled blocks have their own terms:
    tests/integration/test_trainer_compile.py)."""
    from launcher.verify import trace_plan

    spec = spec_from_dict({**job, "train": {"compile": False, **job["train"]}})
    plan = plan_job(spec, top=0).best
    t0 = time.perf_counter()
    report = trace_plan(plan, build_last_rank=False, workers=workers)
    seconds = time.perf_counter() - t0
    lay = plan.layout
    rows = []
    for res in report.roles:
        led = rank_memory(spec.model, spec.train, spec.gpu, lay, res.role.pp_rank)
        row = {"layout": name, "role": res.role.name, "status": res.status, "seconds": round(seconds, 1),
               "cpu_seconds": round(report.cpu_seconds, 1),
               "ledger_gb": round(led.total / GB, 6), "ledger_phase": led.phase,
               "ledger": {c: round(getattr(led, c) / GB, 6) for c in CATEGORIES}}
        if res.peak_gb is not None:
            row["traced_gb"] = round(res.peak_gb, 6)
            row["traced"] = {c: round(res.categories_gb.get(c, 0.0), 6) for c in CATEGORIES}
            row["difference"] = round(led.total / GB / res.peak_gb - 1, 4)
        else:
            row["error"] = res.error
        row["misses"] = misses(row)
        rows.append(row)
    return rows


def _mb(x: float) -> str:
    return f"{x * 1e3:.4g}"


def render(rows: list[dict], summary: bool = True) -> str:
    out = [f"{'layout':48} {'role':26} {'traced GB':>10} {'ledger GB':>10} {'diff':>6}  verdict"
           f"   categories traced/ledger (MB)"] if summary else []
    for r in rows:
        if "traced_gb" not in r:
            out.append(f"{r['layout']:48} {r['role']:26} {r['status']}: {r.get('error')}")
            continue
        cats = "  ".join(f"{c[:5]} {_mb(r['traced'][c])}/{_mb(r['ledger'][c])}" for c in CATEGORIES)
        verdict = "ok" if not r["misses"] else "MISS " + "; ".join(r["misses"])
        out.append(f"{r['layout']:48} {r['role']:26} {r['traced_gb']:>10.4g} {r['ledger_gb']:>10.4g} "
                   f"{r['difference']:>+6.1%}  {verdict}   {cats}")
    if not summary:
        return "\n".join(out)
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    failing = {n: [f"{r['role']}: {'; '.join(r['misses'])}" for r in rows if r["layout"] == n and r["misses"]]
               for n in layouts}
    failing = {n: f for n, f in failing.items() if f}
    seconds = {r["layout"]: (r["seconds"], r["cpu_seconds"]) for r in rows}
    diffs = [abs(r["difference"]) for r in rows if "difference" in r]
    out.append("")
    out.append(f"{len(layouts) - len(failing)} of {len(layouts)} layouts within the bound (total and every category "
               f"within {REL:.0%}, or {FLOOR:.0%} of the total); {len(rows)} roles, mean |difference| of the totals "
               f"{sum(diffs) / max(1, len(diffs)):.1%}; tracing {sum(s for s, _ in seconds.values()):.0f} s wall, "
               f"{sum(c for _, c in seconds.values()):.0f} s CPU")
    for n, f in failing.items():
        out.append(f"  MISS {n}: " + " | ".join(f))
    matrix = [n for n, _ in MATRIX if n in layouts]
    if matrix:
        passing = [n for n in matrix if n not in failing]
        out.append(f"pairs of axis values not covered by the passing matrix layouts: {len(uncovered_pairs(passing))} "
                   f"(by the whole matrix: {len(uncovered_pairs([n for n, _ in MATRIX]))})")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all", action="store_true", help="also the large models at their real depth (slow)")
    ap.add_argument("--only", action="append", metavar="NAME", help="one layout by name (repeatable)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    todo = [(n, LAYOUTS[n]) for n in args.only] if args.only else MATRIX + EXTRA + (FULL_DEPTH if args.all else [])
    rows = []
    for name, job in todo:
        new = compare(name, job)
        rows += new
        if not args.json:
            print(render(new, summary=False), f"  [{new[0]['seconds']:.1f} s, {new[0]['cpu_seconds']:.1f} s CPU]",
                  flush=True)
    print(json.dumps(rows, indent=1) if args.json else
          f"\n{render(rows)}\n(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
