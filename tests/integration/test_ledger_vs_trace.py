"""The ledger against `launch verify`'s trace of the real trainer at full world size (fake process
group, FakeTensorMode, torch's memory tracker), per pipeline rank: the total AND each category
(parameters, gradients, optimizer state, activations, temporaries, communication buffers) within
10 %, or within 3 % of the rank's traced total where a category is that small (a few hundred bytes
of a tiny model's gradient that exist at the peak are not a wrong term, and no relative bound means
anything near zero): benchmarks/ledger_vs_trace.py's `misses`.

The layouts come from benchmarks/ledger_vs_trace.py: MATRIX covers every feasible pair of values
of (model shape, ZeRO, recompute, pp, schedule, cp, tp) in 24 layouts, the large shapes (Llama 3
8B / 70B / 405B, Mixtral 8x7B) at their real widths, heads, vocabulary and sequence length with 2
layers per pipeline chunk: tracing under FakeTensorMode costs per op, not per byte, and the ledger
is priced for the same reduced-depth model, so every per-layer and per-rank term is checked at full
size in seconds. EXTRA holds cheap layouts the matrix does not (dp 8, fp32, ...).

TESTED is the layouts the ledger meets today: the whole matrix and most of EXTRA; the others are not run here (never xfail: a test
that cannot fail checks nothing) — `python benchmarks/ledger_vs_trace.py` prints every layout and
what each one still misses. Add a layout here once the ledger meets it.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

from benchmarks.ledger_vs_trace import CATEGORIES, EXTRA, LAYOUTS, MATRIX, compare, misses, uncovered_pairs

pytestmark = pytest.mark.integration

TESTED = [
    # the pairwise matrix: the layouts the ledger meets today
    "tiny tp2 cp1 pp1 z0 full", "tiny tp1 cp1 pp2 1f1b z1 none",
    "llama3-8b/2L tp2 cp1 pp1 z2 none", "llama3-70b/2L tp8 cp1 pp1 z1 selective", "llama3-405b/4L tp2 cp2 pp2 1f1b z1 full",
    "mha-gelu/4L tp1 cp2 pp1 z0 full",
    # pipelines whose peak is a later micro-batch's backward (whole gradients, one fewer in flight) or the end of the
    # first (FSDP's fp32 upcast of the embedding gradient): 3.0, 4.8, 3.9 s CPU
    "mha-gelu/4L tp1 cp2 pp2 1f1b z2 selective", "llama3-8b/4L tp2 cp2 pp2 gpipe z3 selective",
    # FSDP's post-backward (reduce-scatter input beside the block's gradients), ZeRO 3 under PP after a backward
    # left every block gathered, EP's dispatch copies in a recomputed MoE (~2-4 s CPU each)
    "llama3-405b/2L tp1 cp2 pp1 z3 none", "llama3-70b/4L tp1 cp1 pp2 1f1b z3 full", "tiny-moe tp1 cp2 pp1 z3 full ep4",
    "tiny-moe tp1 cp1 pp2 gpipe z0 none ep2",
    # beside it
    "tiny dp8 z0 none", "tiny dp8 z1 selective", "tiny dp8 z2 none", "tiny dp8 z3 full", "tiny tp2 dp4 z3",
    "tiny cp2 dp4 z1", "tiny pp2 1f1b z2", "tiny pp2 gpipe z0", "mha-gelu tp2 pp2 z3",
    "tiny dp4 z2 fp32", "moe ep2 dp8 z2", "moe ep4 dp8 z0",
    # MoE under TP (expert TP 1: the router and experts whole per TP rank) with EP, the lean ZeRO 1 (2-4 s CPU)
    "moe tp2 ep2 dp4 z1", "mixtral-mini tp2 ep4 pp2 z1 selective",
    # reduced llama3-8b shapes: autocast over several micro-batches, several loss chunks; an uneven stage split.
    # "dense tp2 pp2 z2 chunks" is not met since TP's embedding gradient is this rank's rows only
    # (sequence_parallel.embedding_scatter; DTensor's made the whole vocabulary's): its totals agree (-4.4 %)
    # but stage 0's peak is now a forward's FSDP all-gather with two micro-batches in flight (comm 201 MB,
    # activations 115 MB traced), a moment the ledger does not price under ZeRO 2 with pipelining
    "dense cp2 z1 full", "uneven pp4 1f1b z2", "dense dp8 z1 fp32 grads",
    # a scaled-down Mixtral (expert weights dominate its blocks): ZeRO 3, ZeRO 3 under PP, EP with FSDP experts
    "mixtral-mini dp8 z3 selective", "mixtral-mini pp2 z3 selective", "mixtral-mini ep4 pp2 z2 selective",
    # interleaved 1F1B, priced per model chunk from the rank's own action order (4.0 and 6.4 s CPU)
    "llama3-8b/8L tp1 cp2 pp2 interleaved z1 full", "mixtral-8x7b/8L tp1 cp2 pp2 interleaved z1 none ep8",
    # selective recompute under TP with interleaving and CP, 2 s CPU
    "tiny tp2 cp2 pp2 interleaved z2 selective",
    # the rest of the matrix: the larger pipelines (5-9 s CPU each)
    "tiny/8L tp2 cp2 pp4 gpipe z3 full",
    "mixtral-8x7b/8L tp1 cp2 pp4 1f1b z2 selective ep4", "llama3-8b/8L tp8 cp2 pp4 1f1b z0 full",
    "llama3-405b/8L tp8 cp1 pp4 gpipe z2 full",
    # the optimizer step as a GPU runs it (foreach): AdamW's sqrt(v) of every local parameter at once is the
    # peak of a replicated 405B stage; SGD's weight decay on a copy of every gradient (3.5 and 1 s CPU)
    "llama3-405b/8L tp1 cp2 pp2 interleaved z0 selective", "dense dp8 z0 sgd decay",
    # HuggingFace families' shapes (issue 22): DeepSeek-MoE's dense first layer (pipeline rank 0 only) and shared
    # expert with heads·head_dim ≠ hidden, under EP and TP; Gemma's GeGLU with ALiBi's cached bias under TP and CP.
    # "deepseek-mini dp8 z3 full" is not met: ZeRO 3 with full recompute over-counts a MoE block's communication
    # buffers (+199 %, 5.9 vs 2.0 MB; a plain 4-expert block of the same widths reads 2.8 vs 1.2 MB)
    "deepseek-mini pp2 ep2 dp4 z1", "deepseek-mini tp2 dp4 z0", "geglu-alibi tp2 dp4 z1",
    "geglu-alibi cp2 dp4 z3 selective",
    # hybrid sharding (issue 25): FSDP2's (replicate, shard) mesh with its partial sums between micro-batches, the
    # lean ZeRO 1 over dp_shard, with TP and CP, under PP (2-5 s CPU each)
    "tiny dp8 shard4 z3 hsdp", "dense dp8 shard4 z1 hsdp", "llama3-8b/2L tp2 cp2 dp4 shard2 z2 hsdp",
    # with one rank per shard group: met since the norm and head are an FSDP unit of their own (fsdp.apply_fsdp),
    # resharded after their backward instead of held gathered to the end with the 128k-row embedding
    "llama3-8b/2L tp2 cp2 dp4 shard1 z2 hsdp",
    "llama3-8b/4L dp16 shard8 pp2 z3 hsdp",
    # all-to-all CP (issue 25 §3): the exchanged q/k/v SDPA keeps and wo's copy of the output exchanged back, kv heads
    # repeated up to cp (tiny tp2), ALiBi's bias per head group, selective recompute's exchanged q/k/v, under PP
    # (1-6 s CPU each)
    "mha-gelu cp4 a2a dp2 z1 none", "dense tp2 cp2 a2a dp2 z3 selective", "tiny tp2 cp2 a2a dp2 z2 full",
    "geglu-alibi cp2 a2a dp4 z0 none", "llama3-8b/2L tp2 cp4 a2a z1 none", "llama3-8b/4L tp1 cp2 a2a pp2 1f1b z2 selective",
    # fp8 (issue 25 §4): the sequence-parallel ops' casts in the MLP's backward (full recompute and none), torchao's
    # Float8Linear under FSDP and Llama 3's widths under the auto filter, where the loss or the step is the peak
    # (2-10 s CPU each)
    "dense tp2 dp4 z1 full fp8", "dense tp2 dp4 z1 none fp8",
    "llama3-8b/2L tp2 dp4 z1 selective fp8", "llama3-70b/2L tp8 z1 full fp8",
    # the split-backward schedules (issue 25 §1), each pipeline rank priced action by action of torch's own order:
    # ZB-V under TP, ZB1P over two chunks, DualPipe-V (10-20 s CPU each). "dense/8L zbv pp2 z2" is not met: FSDP's
    # bf16 weight gradients under a split backward (benchmarks/ledger_vs_trace.py says how far)
    "dense/8L zbv tp2 pp2 z1", "dense/8L izb pp2 v2 z1", "dense/8L dpv pp2 z0",
    # pipelines whose peak is a near-tie of a middle micro-batch's moments (met since the lean first backward is
    # priced block by block and the sequence-parallel MLP input's backward holds its gathered input)
    "mha-gelu tp2 cp1 pp4 gpipe z1 none", "tiny pp4 1f1b z1",
    # near-ties of the top block's backward and the loss's (the norm and head an FSDP unit of their own), and tp 1 fp8:
    # met since the MLP's backward is priced at each linear as traced (the row-parallel w2's gathered output gradient
    # and, several sequences a micro-batch, its two copies; the sequence-parallel w1/w3's weight gradients beside
    # their summed input gradients; a gated MLP's w3; torchao's casts of the weight; the lean optimizer's gradients in
    # .grad as each linear finishes) and a first backward's loss runs before any gradient exists (2-30 s CPU each)
    "tiny-cpu example", "llama3-8b/2L dp8 z3 none fp8", "llama3-70b/4L tp8 cp2 pp2 gpipe z2 none",
    "dense dp8 z3 full fp8", "dense dp8 z3 none fp8", "dense dp8 z1 none fp8",
    # a lean chunk's first backward under interleaving with each finished linear's gradient in .grad (pp 0 and 1
    # +0.3 %: the ledger's peak is the chunk's top block, the trace's its bottom one, 9 MB apart in the ledger)
    "llama3-70b/16L tp2 cp2 pp4 interleaved z0 none",
]
# Not met since the lean trainer (bf16 weights) made this small rank smaller, so the 3 % floor is tighter: its
# total agrees but the peak is a near-tie of two moments the ledger and the trace pick differently:
# "mha-gelu tp8 cp1 pp2 interleaved z3 full" (pp 1, +0.8 %: gradients +35 %, activations -12 %): the ledger's peak
# is chunk 0's top block of micro-batch 1 (8.166 MB), priced with one gathered block and its prefetch's all-gather
# buffer, where the trace holds no all-gather buffer there (8.040 MB: the chunk stays gathered from its previous
# backward); the trace's is chunk 1's top of micro-batch 1 (8.104 MB, the ledger's 8.035: 0.05 MB fewer
# activations). benchmarks/ledger_vs_trace.py prints them.
KNOWN_MISSES = {"mha-gelu tp8 cp1 pp2 interleaved z3 full"}
#: layouts whose busiest pipeline rank is a middle one (uneven split): the trace's busiest is the ledger's
BUSIEST = {"uneven pp4 1f1b z2": 1}


@pytest.fixture(scope="module")
def traced(request) -> Iterator[dict[str, Future]]:
    """Every layout this session runs, traced two at a time (a one-role layout keeps one CPU busy)."""
    pytest.importorskip("torch")
    params = [getattr(getattr(item, "callspec", None), "params", {}) for item in request.session.items
              if getattr(item, "module", None) is request.module]
    names = [p["name"] for p in params if "name" in p]
    with ThreadPoolExecutor(2) as pool:
        yield {n: pool.submit(compare, n, LAYOUTS[n]) for n in dict.fromkeys(names)}


@pytest.mark.parametrize("name", TESTED)
def test_ledger_within_ten_percent_of_the_trace_per_category(name, traced):
    rows = traced[name].result()
    assert rows and all(set(r.get("traced", {})) == set(CATEGORIES) for r in rows), rows
    bad = {r["role"]: r["misses"] for r in rows if r["misses"]}
    assert not bad, (name, bad, rows)


@pytest.mark.parametrize("name", list(BUSIEST))
def test_the_ledgers_busiest_pipeline_rank_is_the_traced_one(name, traced):
    """launcher.plan.ledger.busiest_rank (the planner's fit) finds the rank the trace finds busiest."""
    rows = traced[name].result()
    busiest = max(rows, key=lambda r: r["traced_gb"])
    assert busiest["role"].startswith(f"pp {BUSIEST[name]} "), busiest
    assert max(rows, key=lambda r: r["ledger_gb"])["role"] == busiest["role"]


def test_the_matrix_covers_every_pair_of_axis_values():
    """Pairwise over shape x ZeRO x recompute x pp x schedule x cp x tp, every name unique, and every
    layout of the matrix tested."""
    assert uncovered_pairs([n for n, _ in MATRIX]) == []
    names = [n for n, _ in MATRIX + EXTRA]
    assert len(set(names)) == len(names) and set(TESTED) <= set(names)
    assert {n for n, _ in MATRIX} - KNOWN_MISSES <= set(TESTED) and not KNOWN_MISSES & set(TESTED)


def test_misses_applies_the_bound_to_the_total_and_each_category():
    row: dict[str, Any] = {"traced_gb": 2.0, "ledger_gb": 2.1, "traced": {**dict.fromkeys(CATEGORIES, 0.5), "temporaries": 0.01},
                           "ledger": {**dict.fromkeys(CATEGORIES, 0.5), "temporaries": 0.01}}
    assert misses(row) == []
    row["ledger"] = {**row["ledger"], "grads": 0.6, "temporaries": 0.05}   # 0.04 GB: under 3 % of 2 GB
    assert misses(row) == ["grads +0.1 GB (+20%)"]
    assert misses({**row, "ledger_gb": 2.3}) == ["total +15.0%", "grads +0.1 GB (+20%)"]
    assert misses({"error": "boom"}) == ["not traced: boom"]
