"""Our traced per-GPU peak beside Megatron-LM's own theoretical memory estimate, layout by layout.

For >= 30 Megatron-style layouts of 7B-405B dense and MoE shapes (Llama 2 7B / 13B / 70B, Llama 3
8B / 70B / 405B, a GPT-3 175B-like GELU model, Mixtral 8x7B) — TP <= 8 inside a node, PP across
nodes, CP, ZeRO 1 (the lean distributed optimizer: Megatron's --use-distributed-optimizer), a few
ZeRO 0 rows (Megatron without it: 18 B/param), recompute none / selective / full, 1F1B and
interleaved 1F1B — the plan is traced by `launch verify`'s tracer (launcher.verify.trace_plan:
fake process group, FakeTensorMode, torch's memory tracker) and its per-GPU peak (the largest
traced pipeline rank) is printed beside `megatron_estimate` for the same layout: our own
re-derivation of megatron/training/theoretical_memory_usage.py (NVIDIA/Megatron-LM, read at
d98e8a64, 2026-08-22), which implements Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", Table 2).

Every row uses `train.grad_dtype: fp32` (gradients accumulate in an fp32 buffer: Megatron's
main_grad, the "6" of its 6 + 12/dp B/param is 2 bf16 weight + 4 fp32 main grad).

Reduced depth: tracing under FakeTensorMode costs per op, not per byte, so each model keeps its real
width, heads, vocabulary and sequence length but only 2 layers per pipeline chunk (as
benchmarks/ledger_vs_trace.py does), and Megatron's estimate is computed for that same depth
(num_layers = 2·pp·v): the embedding, output layer and per-layer terms are all at full size.

What Megatron's file does and does not model (so read the ratio with it):
  * weights + optimizer only for the most loaded (first) pipeline stage: its layers plus the input
    embedding (plus the output layer only when pp = 1 and untied); the last stage's output layer
    and its logits are not counted when pp > 1;
  * the distributed optimizer shards over args.data_parallel_size, which excludes CP (Megatron-core's
    optimizer actually shards over dp·cp): for cp > 1 it over-counts the optimizer state;
  * activations: the sequence-parallel formula 18 + 4·ffn/h bytes·s·b·h per layer / tp only with
    sequence parallelism AND selective recompute; every other case (tp 1, no recompute, FULL
    recompute) takes the no-SP formula s·b·h·(10 + 24/tp) per layer, ×1.05 — full recompute is
    priced as if nothing were recomputed; the sequence is never divided by CP; the MLP term ignores
    SwiGLU's third matrix and MoE's top-k.
So `korthikanti_estimate` is printed beside it: the same weights with the optimizer over dp·cp, and
Table 2's activations as they apply here (s/cp tokens; SP with tp > 1; flash attention, so no
5·a·s²·b term and selective = none; full recompute 2·s·b·h/tp per layer + one layer's working set).
The goal (issue 20 §5: median <= 1.0, worst <= 1.1) is judged against Megatron's own estimate; the
stricter column says how much of the margin comes from what the file does not model.

Reading the table: "state" is our params + grads + optimizer beside Megatron's weights + optimizer,
"working" our activations + temporaries + comm_buffers beside its activations; "above" names the
side that is over, our largest category on it and, for the first stage under none/selective
recompute, the activations it stores per layer in flight in units of s·b·h/(tp·cp) bytes beside
Megatron's 18 + 4·ffn/h. Under ZeRO 0/1 the tracer files the fp32 main-grad buffer as temporaries
(refile_main_grads moves it to grads; totals unchanged); under interleaved 1F1B the traced peak
holds no gradient buffer at all (it comes before they exist), so those rows are not refiled.
`--tp-sweep` fits the stored activations a layer to a + b/tp: a > 0 is what our TP keeps whole
on every rank where Korthikanti's sequence parallelism shards everything.

    python benchmarks/megatron_memory.py              # every layout (minutes)
    python benchmarks/megatron_memory.py --only NAME  # one layout (repeatable)
    python benchmarks/megatron_memory.py --json
    python benchmarks/megatron_memory.py --list       # the layout names
    python benchmarks/megatron_memory.py --tp-sweep   # stored activations a layer = a + b/tp (~2 min)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from launcher.plan import presets

GB = 1e9                 # the tracer's unit (launcher.verify.report.GB); Megatron prints MiB
CATEGORIES = ("params", "grads", "optimizer", "activations", "temporaries", "comm_buffers")
STATE = ("params", "grads", "optimizer")                 # Megatron's "weight and optimizer"
WORKING = ("activations", "temporaries", "comm_buffers")  # Megatron's "activation"

LLAMA2_13B = dict(layers=40, hidden=5120, heads=40, kv_heads=40, ffn_hidden=13824, vocab=32000, mlp="swiglu",
                  tied_embeddings=False)
LLAMA2_70B = dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672, vocab=32000, mlp="swiglu",
                  tied_embeddings=False)
SHAPES = {"llama2-7b": presets.MODELS["llama2-7b"], "llama2-13b": LLAMA2_13B, "llama2-70b": LLAMA2_70B,
          **{k: presets.MODELS[k] for k in ("llama3-8b", "llama3-70b", "llama3-405b", "gpt3-175b", "mixtral-8x7b")}}


# --- Megatron's estimate, re-derived ------------------------------------------------------------

def _get(obj, key: str, default=None):
    """A field of a dict or of a dataclass (ModelSpec, Layout)."""
    if isinstance(obj, dict):
        return obj.get(key, default)
    return getattr(obj, key, default)


def _shape(model) -> dict:
    """The fields of `model` the estimate reads, defaults as launcher.plan.spec.ModelSpec has them."""
    h, heads = _get(model, "hidden"), _get(model, "heads")
    return {"layers": _get(model, "layers"), "h": h, "heads": heads, "kv": _get(model, "kv_heads") or heads,
            "ffn": _get(model, "ffn_hidden") or 4 * h, "vocab": _get(model, "vocab"),
            "swiglu": _get(model, "mlp", "swiglu") == "swiglu", "tied": bool(_get(model, "tied_embeddings", False)),
            "experts": _get(model, "experts", 1) or 1, "topk": _get(model, "experts_per_token", 1) or 1,
            "vocab_multiple": _get(model, "vocab_multiple", 128) or 128}


def _layout(layout) -> dict:
    tp, pp, cp, dp = (int(_get(layout, k, 1) or 1) for k in ("tp", "pp", "cp", "dp"))
    return {"tp": tp, "pp": pp, "cp": cp, "dp": dp, "ep": int(_get(layout, "ep", 1) or 1),
            "v": int(_get(layout, "virtual_stages", 1) or 1), "zero": int(_get(layout, "zero", 1)),
            "recompute": _get(layout, "recompute", "none"), "b": int(_get(layout, "micro_batch", 1)),
            "s": int(_get(layout, "seq_len")), "m": _get(layout, "grad_accum"),
            "schedule": _get(layout, "schedule", "1f1b")}


def padded_vocab(vocab: int, tp: int, multiple: int = 128) -> int:
    """Megatron's vocab_size_with_padding (core/tokenizers/utils/build_tokenizer.py): up to a multiple of
    make_vocab_size_divisible_by (128) × tp. The file reads args.padded_vocab_size."""
    step = multiple * tp
    return -(-vocab // step) * step


def _params_on_first_stage(sh: dict, ly: dict) -> dict:
    """Parameters on the most loaded (first) pipeline stage, split as theoretical_memory_usage.py's
    compute_weight_and_optimizer_memory splits them (lines 12-305 at d98e8a64): TP-sharded,
    replicated (norms, router), expert-sharded."""
    h, L, tp, pp = sh["h"], sh["layers"], ly["tp"], ly["pp"]
    V = padded_vocab(sh["vocab"], tp, sh["vocab_multiple"])
    glu = 1.5 if sh["swiglu"] else 1.0                       # gated_linear_multiplier (l. 21)
    norm = 1                                                 # norm_size (l. 60): the trainer builds RMSNorm
    # self_attn_term (l. 82-93): Q and O are h×h, K and V h×(kv·head_dim) = h×(h·kv/heads);
    # query_projection_to_hidden_size_ratio is 1 (kv_channels·heads = hidden here)
    attn = 2 * h * h * (1 + sh["kv"] / sh["heads"])
    moe = sh["experts"] > 1
    n_moe = L if moe else 0                                  # moe_layer_freq 1: every layer MoE (l. 29-44)
    n_dense = L - n_moe
    dense_mlp = 2 * h * sh["ffn"] * glu                      # l. 103
    routed = 2 * h * sh["ffn"] * sh["experts"] * glu if moe else 0   # l. 110-112 (moe_ffn_hidden = ffn)
    router = h * sh["experts"] if moe else 0                 # l. 128-132, no bias (add_bias_linear off)
    ln = 2 * h * norm                                        # layernorm_params (l. 127)
    final_ln = norm * h                                      # l. 96
    embedding = h * V                                        # l. 95
    tp_block = (attn + dense_mlp) * n_dense + attn * n_moe   # l. 215-218
    repl_block = ln * n_dense + (ln + router) * n_moe + final_ln   # l. 219-229
    expert_block = routed * n_moe                            # l. 230
    # l. 248-259: the first stage has 1/pp of the layers and the input embedding
    tp_sharded = (tp_block / pp + embedding) / tp
    replicated = repl_block / pp
    expert_sharded = expert_block / pp / (1 * ly["ep"])      # expert_tensor_parallel_size 1
    if not sh["tied"] and pp == 1:                           # l. 265-267: the output layer, pp 1 only
        tp_sharded += embedding / tp
    return {"dense": tp_sharded + replicated, "expert": expert_sharded, "padded_vocab": V}


def _bytes_per_param(distributed: bool, shards: float) -> float:
    # num_bytes_per_parameter (l. 293-296): bf16 weight 2 + fp32 main grad 4 + fp32 master, Adam m, v
    # 12 — the 12 divided over the data-parallel ranks under the distributed optimizer
    return 6 + 12 / shards if distributed else 18


def _weights_optimizer(sh: dict, ly: dict, dp_shards: int) -> tuple[float, float]:
    """(bytes, parameters) of weights + gradients + optimizer state on the first stage (l. 298-303)."""
    p = _params_on_first_stage(sh, ly)
    distributed = ly["zero"] >= 1                            # args.use_distributed_optimizer
    world = ly["tp"] * ly["pp"] * ly["cp"] * ly["dp"]
    expert_dp = world // (1 * ly["ep"] * ly["pp"])           # expert_data_parallel_size (l. 207-212)
    return (p["dense"] * _bytes_per_param(distributed, dp_shards)
            + p["expert"] * _bytes_per_param(distributed, expert_dp), p["dense"] + p["expert"])


def _pipeline_factor(ly: dict) -> float:
    """The in-flight factor on the first stage's activations: the per-layer term is already × the
    whole model's layers (pp micro-batches of L/pp layers each); interleaving multiplies by
    1 + (pp-1)/(pp·v) (l. 341-355); a plain schedule with fewer than pp micro-batches discounts by
    m/pp (l. 357-366)."""
    pp, v, m = ly["pp"], ly["v"], ly["m"]
    if v > 1:                                                # virtual_pipeline_model_parallel_size set
        return 1 + (pp - 1) / (pp * v)
    if pp > 1 and m is not None:
        return min(1.0, m / pp)
    return 1.0


def megatron_estimate(model, layout) -> dict:
    """Megatron-LM's report_theoretical_memory for `model` (a ModelSpec or a job's model dict) under
    `layout` (tp, pp, cp, dp, ep, virtual_stages, zero, recompute, micro_batch, seq_len, grad_accum):
    {weights_optimizer_gb, activations_gb, total_gb} per GPU (1e9 bytes) and how it got there.

    Re-derived from megatron/training/theoretical_memory_usage.py (d98e8a64), not copied:
      * zero >= 1 is --use-distributed-optimizer, sharded over args.data_parallel_size = dp (CP excluded);
      * sequence parallelism is on when tp > 1 (Megatron turns it off at tp 1, arguments.py l. 1433-1439);
      * num_microbatches = grad_accum (training.py passes get_num_microbatches()).
    """
    sh, ly = _shape(model), _layout(layout)
    h, L, s, b, tp, pp = sh["h"], sh["layers"], ly["s"], ly["b"], ly["tp"], ly["pp"]
    V = padded_vocab(sh["vocab"], tp, sh["vocab_multiple"])
    weights, params = _weights_optimizer(sh, ly, ly["dp"])
    sbh = s * b * h
    sp = tp > 1
    if sp and ly["recompute"] == "selective":
        # compute_activation_memory (l. 308-379), Table 2's "sequence parallel + selective" row:
        # sbh·(18 + 4·ffn/h) per layer (34 for ffn = 4h), × all L layers (pp micro-batches in flight
        # on the first stage, L/pp layers each)
        branch = "sp+selective"
        act = sbh * (18 + 4 * sh["ffn"] / h) * L
        act += 8 * s * b * pp                                # token ids (int64), pp in flight (l. 330-332)
        act += sbh * pp                                      # embedding dropout mask, 1 byte (l. 334-339)
        act *= _pipeline_factor(ly)
        if pp == 1:                                          # output layer input + fp32 logits for CE (l. 368-376)
            act += sbh * 4 * (1 + V / h)
        act /= tp                                            # everything sharded by TP+SP (l. 379)
    else:
        # compute_activation_memory_without_sp (l. 382-453): Table 2's "no recompute, tensor parallel"
        # row without the attention-score term, whatever the recompute setting (full included)
        branch = "without-sp"
        act = sbh * (10 + 24 / tp) * L                       # l. 386
        act += 8 * s * b * pp + sbh * pp                     # l. 399-408, not divided by tp
        act *= _pipeline_factor(ly)                          # l. 410-435
        if pp == 1:                                          # bf16 logits / tp + final norm output (l. 438-447)
            act += (s * b * V / tp + sbh) * 2
        act *= 1.05                                          # "optimizer and miscellaneous temporaries" (l. 450)
    return {"weights_optimizer_gb": weights / GB, "activations_gb": act / GB, "total_gb": (weights + act) / GB,
            "branch": branch, "params_first_stage": params, "padded_vocab": V,
            "bytes_per_param": weights / params if params else 0.0}


def korthikanti_estimate(model, layout) -> dict:
    """What Megatron's formulas give where its file's shortcuts are replaced by what applies to this
    layout (see the module docstring): the optimizer over dp·cp, s/cp tokens per rank, Table 2's
    SP rows at tp > 1 (34·sbh/t generalised to 18 + 4·ffn/h; no 5·a·s²·b term under flash attention,
    so none = selective), full recompute 2·sbh/t per layer (each layer's bf16 input) + one layer's
    working set recomputed in backward; pipeline factors, embedding and output terms as the file."""
    sh, ly = _shape(model), _layout(layout)
    h, L, b, tp, pp, cp = sh["h"], sh["layers"], ly["b"], ly["tp"], ly["pp"], ly["cp"]
    s = ly["s"] // cp
    V = padded_vocab(sh["vocab"], tp, sh["vocab_multiple"])
    weights, _ = _weights_optimizer(sh, ly, ly["dp"] * cp)
    sbh = s * b * h
    layer = sbh * (18 + 4 * sh["ffn"] / h) / tp
    per_layer = 2 * sbh / tp if ly["recompute"] == "full" else layer
    act = per_layer * L + (8 * s * b + sbh) * pp / tp
    act *= _pipeline_factor(ly)
    if ly["recompute"] == "full":
        act += layer                                         # the layer being recomputed in backward
    if pp == 1:
        act += sbh * 4 * (1 + V / h) / tp
    return {"weights_optimizer_gb": weights / GB, "activations_gb": act / GB, "total_gb": (weights + act) / GB}


# --- layouts ------------------------------------------------------------------------------------

def layout(shape: str, *, tp: int = 1, pp: int = 1, cp: int = 1, dp: int = 2, ep: int = 1, v: int = 1,
           zero: int = 1, recompute: str = "selective", mb: int = 1, seq: int = 4096,
           ga: int | None = None) -> tuple[str, dict]:
    """(name, job) of one layout at 2 layers per pipeline chunk; world tp·cp·pp·dp, 8 GPUs a node
    (TP inside the node, PP across); pipelines run pp micro-batches (all pp in flight on the first
    stage: Megatron's factor 1), others 2."""
    base = SHAPES[shape]
    layers = 2 * pp * v
    model = dict(base, layers=layers)
    world = tp * cp * pp * dp
    gpn = min(8, world)
    ga = ga or (pp if pp > 1 else 2)
    par = {"tp": tp, "cp": cp, "pp": pp, "zero": zero, "recompute": recompute, "micro_batch": mb}
    if pp > 1:
        par["schedule"] = "interleaved-1f1b" if v > 1 else "1f1b"
    if v > 1:
        par["virtual_stages"] = v
    if ep > 1:
        par["ep"] = ep
    name = " ".join([f"{shape}/{layers}L", f"tp{tp}", f"pp{pp}" + (f"v{v}" if v > 1 else ""), f"cp{cp}", f"dp{dp}"]
                    + ([f"ep{ep}"] if ep > 1 else []) + [f"z{zero}", recompute, f"mb{mb}", f"s{seq // 1024}k"])
    job = {"model": model,
           # eager blocks, as Megatron runs them (the planner would compile them on H100: another activation profile)
           "train": {"seq_len": seq, "global_batch": mb * ga * dp, "precision": "bf16", "grad_dtype": "fp32",
                     "compile": False},
           "cluster": {"nodes": world // gpn, "gpus_per_node": gpn, "gpu": "h100-sxm"}, "parallel": par}
    return name, job


LAYOUTS = dict([
    # Llama 2 7B: data parallel, TP in the node, CP
    layout("llama2-7b", dp=8, recompute="full"),
    layout("llama2-7b", dp=8, recompute="selective"),
    layout("llama2-7b", tp=2, dp=4, recompute="selective", mb=2),
    layout("llama2-7b", tp=4, pp=2, dp=2, recompute="none"),
    layout("llama2-7b", tp=2, cp=2, dp=2, recompute="selective", seq=8192),
    layout("llama2-7b", tp=8, dp=2, recompute="none", mb=2),
    layout("llama2-7b", dp=8, zero=0, recompute="full"),
    # Llama 2 13B
    layout("llama2-13b", tp=2, pp=2, dp=2, recompute="selective"),
    layout("llama2-13b", tp=4, dp=2, recompute="full", mb=2),
    layout("llama2-13b", tp=8, pp=2, dp=2, recompute="none"),
    layout("llama2-13b", tp=4, pp=2, v=2, dp=2, recompute="selective"),
    # Llama 2 70B (Megatron's published tp 8 pp 4-8 layouts)
    layout("llama2-70b", tp=8, pp=4, dp=2, recompute="selective"),
    layout("llama2-70b", tp=8, pp=8, dp=2, recompute="full"),
    layout("llama2-70b", tp=4, pp=4, v=2, dp=2, recompute="selective"),
    layout("llama2-70b", tp=8, pp=2, cp=2, dp=1, recompute="selective", seq=8192),
    # Llama 3 8B, seq 8192
    layout("llama3-8b", dp=8, recompute="full", seq=8192),
    layout("llama3-8b", tp=2, dp=4, recompute="selective", seq=8192),
    layout("llama3-8b", tp=4, cp=2, dp=2, recompute="none", seq=8192),
    layout("llama3-8b", tp=8, dp=2, recompute="selective", mb=2, seq=8192),
    layout("llama3-8b", tp=2, pp=2, v=2, dp=2, recompute="selective", seq=8192),
    layout("llama3-8b", tp=1, cp=2, dp=4, zero=0, recompute="full", seq=8192),
    # Llama 3 70B
    layout("llama3-70b", tp=8, pp=4, dp=2, recompute="selective", seq=8192),
    layout("llama3-70b", tp=8, pp=4, cp=2, dp=1, recompute="full", seq=8192),
    layout("llama3-70b", tp=8, pp=2, v=2, dp=2, recompute="selective", seq=8192),
    layout("llama3-70b", tp=4, pp=8, dp=2, recompute="full", seq=8192),
    # Llama 3 405B (Llama 3's own: tp 8, cp 2, pp 16)
    layout("llama3-405b", tp=8, pp=8, dp=2, recompute="full", seq=8192),
    layout("llama3-405b", tp=8, pp=16, cp=2, dp=1, recompute="full", seq=8192),
    layout("llama3-405b", tp=8, pp=4, v=2, dp=2, recompute="selective", seq=8192),
    # GPT-3 175B-like (GELU, MHA, tied embeddings)
    layout("gpt3-175b", tp=8, pp=8, dp=2, recompute="selective"),
    layout("gpt3-175b", tp=8, pp=4, v=2, dp=2, recompute="full"),
    layout("gpt3-175b", tp=4, pp=8, dp=2, recompute="none"),
    # Mixtral 8x7B (experts over dp·cp; the trainer runs MoE at tp 1)
    layout("mixtral-8x7b", dp=8, ep=8, recompute="full"),
    layout("mixtral-8x7b", pp=4, dp=4, ep=4, recompute="selective"),
    layout("mixtral-8x7b", pp=2, cp=2, dp=4, ep=4, recompute="full"),
])


def model_and_layout(job: dict) -> tuple[dict, dict]:
    """The estimate's inputs from a job dict: its model, and its parallel section with dp, seq_len
    and grad_accum filled in."""
    par, tr, cl = job["parallel"], job["train"], job["cluster"]
    world = cl["nodes"] * cl["gpus_per_node"]
    dp = world // (par["tp"] * par["cp"] * par["pp"])
    return job["model"], {**par, "dp": dp, "seq_len": tr["seq_len"],
                          "grad_accum": tr["global_batch"] // (par["micro_batch"] * dp)}


# --- the comparison -----------------------------------------------------------------------------

def above(ours: dict, meg: dict, coef: float | None = None, meg_coef: float | None = None,
          head: bool = False) -> str:
    """Which of Megatron's two terms our traced figures exceed, by how much, and our largest
    category there; for the working side also our stored activations per layer in flight, in
    units of s·b·h/(tp·cp) bytes, beside Megatron's 18 + 4·ffn/h."""
    out = []
    for side, cats, key in (("state", STATE, "weights_optimizer_gb"), ("working", WORKING, "activations_gb")):
        mine = sum(ours[c] for c in cats)
        if mine > meg[key] + max(0.05, 0.02 * meg[key]):     # what is above, not rounding
            big = max(cats, key=lambda c: ours[c])
            why = (f"; stored {coef:.0f}·sbh/(t·cp) a layer in flight{' with the head' if head else ''} vs "
                   f"Megatron's {meg_coef:.0f}"
                   if side == "working" and coef is not None else "")
            out.append(f"{side} +{mine - meg[key]:.2f} ({big} {ours[big]:.2f}{why})")
    return "; ".join(out)


def refile_main_grads(cats: dict, zero: int, grad_dtype: str) -> bool:
    """Under ZeRO 0/1 with grad_dtype fp32 the tracer before commit 9043260 filed the fp32 main-grad buffer
    as temporaries and read grads 0 (it files them as gradients since; this only moves figures that read 0). Traced at grad_dtype bf16, the same layout reads grads = params
    (2 B/param); at fp32 grads 0 and temporaries 4 B/param more (llama2-7b/2L tp1 dp8 z1 full: grads
    1.334 -> 0 GB, temporaries 0.978 -> 3.645 GB, +2.667 = 2 × its 1.336 GB of bf16 weights). For the
    per-term comparison (Megatron's "6" is 2 B weight + 4 B main grad) move 4 B/param, twice the bf16
    params, from temporaries to grads, in place; the total is unchanged. True when it did."""
    move = 2 * cats["params"]
    if zero <= 1 and grad_dtype == "fp32" and cats["grads"] < 0.01 * cats["params"] and cats["temporaries"] >= move:
        cats["grads"], cats["temporaries"] = round(cats["grads"] + move, 4), round(cats["temporaries"] - move, 4)
        return True
    return False


def activation_coefficient(act_gb: float, model, lay: dict) -> float:
    """Stored activations per layer in flight on the first stage, in units of s·b·h/(tp·cp) bytes:
    Megatron's count of layers in flight there (all L layers of the model: pp micro-batches of L/pp
    layers, × its interleaving or short-pipeline factor). At pp 1 the head's tensors are included."""
    sh, ly = _shape(model), _layout(lay)
    in_flight = sh["layers"] * (_pipeline_factor(ly) if ly["pp"] > 1 else 1.0)
    return act_gb * GB / (in_flight * ly["s"] * ly["b"] * sh["h"] / (ly["tp"] * ly["cp"]))


def compare(name: str, job: dict, workers: int | None = None) -> dict:
    """One row: the largest traced pipeline rank beside Megatron's estimate (GB)."""
    from launcher.plan.planner import plan_job
    from launcher.plan.spec import spec_from_dict
    from launcher.verify import trace_plan

    model, lay = model_and_layout(job)
    meg = megatron_estimate(model, lay)
    strict = korthikanti_estimate(model, lay)
    row = {"layout": name, "megatron": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in meg.items()},
           "korthikanti": {k: round(v, 4) for k, v in strict.items()}}
    t0 = time.perf_counter()
    try:
        plan = plan_job(spec_from_dict(job), top=0).best
        report = trace_plan(plan, build_last_rank=False, workers=workers)
    except Exception as e:   # the trainer is being changed under us: report, do not stop
        row.update(error=f"{type(e).__name__}: {e}".splitlines()[0][:300], seconds=round(time.perf_counter() - t0, 1))
        return row
    row["seconds"] = round(time.perf_counter() - t0, 1)
    row["cpu_seconds"] = round(report.cpu_seconds, 1)
    roles = [r for r in report.roles if r.peak_gb is not None]
    failed = [f"{r.role.name}: {r.error}" for r in report.roles if r.peak_gb is None]
    if failed:
        row["error"] = " | ".join(failed)[:500]
    if not roles:
        return row
    top = max(roles, key=lambda r: r.peak_gb)
    first = min(roles, key=lambda r: r.role.pp_rank)
    zero, grad_dtype = lay["zero"], job["train"].get("grad_dtype", "bf16")
    cats = {c: round(top.categories_gb.get(c, 0.0), 4) for c in CATEGORIES}
    first_cats = {c: round(first.categories_gb.get(c, 0.0), 4) for c in CATEGORIES}
    row["traced_as_filed"] = dict(cats)
    row["main_grads_refiled"] = refile_main_grads(cats, zero, grad_dtype)
    refile_main_grads(first_cats, zero, grad_dtype)
    coef = (round(activation_coefficient(first_cats["activations"], model, lay), 1)
            if lay["recompute"] != "full" and first.role.pp_rank == 0 else None)
    meg_coef = 18 + 4 * _shape(model)["ffn"] / _shape(model)["h"]
    row.update(role=top.role.name, traced_gb=round(top.peak_gb, 4), traced=cats,
               first_stage_gb=round(first.peak_gb, 4) if first.role.pp_rank == 0 else None,
               first_stage=first_cats if first.role.pp_rank == 0 else None,
               activations_per_layer_sbh_t=coef, megatron_per_layer_sbh_t=meg_coef,
               ratio=round(top.peak_gb / meg["total_gb"], 4), ratio_strict=round(top.peak_gb / strict["total_gb"], 4),
               above=above(cats, meg, coef if top is first else None, meg_coef, head=lay["pp"] == 1)
               if top.peak_gb > meg["total_gb"] else "")
    params = cats["params"] / 2 if cats["params"] else 0.0          # bf16 weights: 2 B each
    if params:
        row["ours_state_bytes_per_param"] = round(sum(cats[c] for c in STATE) / params, 2)
    return row


def render(rows: list[dict], summary: bool = True) -> str:
    out = [f"{'layout':50} {'rank':>4} {'ours GB':>8} {'Megatron (w+o + act)':>22} {'ratio':>6} {'strict':>6}  "
           f"{'ours state + working':>20}  B/param ours/Meg  above (where ours > Megatron)"] if summary else []
    for r in rows:
        m = r["megatron"]
        if "traced_gb" not in r:
            out.append(f"{r['layout']:50} not traced: {r.get('error')}")
            continue
        t = r["traced"]
        meg = f"{m['total_gb']:.2f} ({m['weights_optimizer_gb']:.2f}+{m['activations_gb']:.2f})"
        ours = f"{sum(t[c] for c in STATE):.2f}+{sum(t[c] for c in WORKING):.2f}"
        bpp = f"{r.get('ours_state_bytes_per_param', 0):.2f}/{m['bytes_per_param']:.2f}"
        rank = r["role"].split(" stage")[0].replace(" ", "") if r["role"].startswith("pp") else "all"
        out.append(f"{r['layout']:50} {rank:>4} {r['traced_gb']:>8.2f} {meg:>22} {r['ratio']:>6.3f} {r['ratio_strict']:>6.3f}  "
                   f"{ours:>20}  {bpp:>16}  {r['above']}" + (f"  [partial: {r['error']}]" if r.get("error") else ""))
    if not summary:
        return "\n".join(out)
    ratios = [r["ratio"] for r in rows if "ratio" in r]
    strict = [r["ratio_strict"] for r in rows if "ratio_strict" in r]
    out.append("")
    if ratios:
        worst = max((r for r in rows if "ratio" in r), key=lambda r: r["ratio"])
        out.append(f"{len(ratios)} of {len(rows)} layouts traced. ours / Megatron's estimate: median "
                   f"{statistics.median(ratios):.3f}, worst {worst['ratio']:.3f} ({worst['layout']}; "
                   f"{worst['above'] or 'not above'}); {sum(x > 1.0 for x in ratios)} above 1.0, "
                   f"{sum(x > 1.1 for x in ratios)} above 1.1 (goal: median <= 1.0, worst <= 1.1)")
        out.append(f"ours / the recompute- and CP-aware estimate (strict): median {statistics.median(strict):.3f}, "
                   f"worst {max(strict):.3f}")
    for r in rows:
        if "traced_gb" not in r:
            out.append(f"  NOT TRACED {r['layout']}: {r.get('error')}")
    secs = sum(r.get("seconds", 0) for r in rows)
    out.append(f"tracing {secs:.0f} s wall, {sum(r.get('cpu_seconds', 0) for r in rows):.0f} s CPU "
               f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs). 'state' = params+grads+optimizer "
               f"vs Megatron's weights+optimizer; 'working' = activations+temporaries+comm_buffers vs its activations; "
               f"ours is the largest traced pipeline rank, Megatron's the first stage; grads include the fp32 main-grad "
               f"buffer the tracer files as temporaries under ZeRO 0/1 ({sum(bool(r.get('main_grads_refiled')) for r in rows)} "
               f"rows refiled, totals unchanged: refile_main_grads)")
    return "\n".join(out)


def tp_sweep(shape: str = "llama2-70b", workers: int | None = None) -> list[dict]:
    """Where stored activations scale with tp: the first stage of `shape` at pp 4 (1F1B, 2 layers a
    stage, all 4 micro-batches in flight), none and selective recompute, tp 1/2/4/8, each fitted to
    a + b/tp bytes·s·b·h a layer in flight. Korthikanti's sequence parallelism shards every stored
    tensor (a = 0); a > 0 is what our TP keeps whole on every rank."""
    out = []
    for rc in ("selective", "none"):
        pts = []
        for tp in (1, 2, 4, 8):
            name, job = layout(shape, tp=tp, pp=4, dp=2, recompute=rc)
            row = compare(name, job, workers=workers)
            if row.get("activations_per_layer_sbh_t") is not None:
                pts.append((tp, row["activations_per_layer_sbh_t"] / tp))      # in s·b·h units
        if len(pts) >= 2:                                                  # least squares in x = 1/tp
            xs, ys = [1 / t for t, _ in pts], [y for _, y in pts]
            mx, my = statistics.fmean(xs), statistics.fmean(ys)
            b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
            out.append({"shape": shape, "recompute": rc, "per_layer_sbh": dict(pts),
                        "unsharded_a": round(my - b * mx, 2), "sharded_b": round(b, 2),
                        "korthikanti_b": 18 + 4 * SHAPES[shape]["ffn_hidden"] / SHAPES[shape]["hidden"]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", metavar="NAME", help="one layout by name (repeatable)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--list", action="store_true", help="print the layout names and exit")
    ap.add_argument("--workers", type=int, default=None, help="tracing processes (default: one per CPU)")
    ap.add_argument("--tp-sweep", action="store_true",
                    help="instead: fit stored activations a layer to a + b/tp over tp 1-8 (Llama 2 70B, pp 4)")
    args = ap.parse_args()
    if args.tp_sweep:
        fits = tp_sweep(workers=args.workers)
        print(json.dumps(fits, indent=1) if args.json else "\n".join(
            f"{f['shape']} pp4 {f['recompute']}: stored a layer in flight = {f['unsharded_a']} + "
            f"{f['sharded_b']}/tp bytes·s·b·h (Korthikanti SP: 0 + {f['korthikanti_b']:.0f}/tp); traced "
            + ", ".join(f"tp{t} {y:.2f}" for t, y in f["per_layer_sbh"].items()) for f in fits))
        return
    if args.list:
        print("\n".join(LAYOUTS))
        return
    unknown = [n for n in args.only or [] if n not in LAYOUTS]
    if unknown:
        ap.error(f"unknown layout {unknown[0]!r} (--list names them)")
    todo = [(n, LAYOUTS[n]) for n in args.only] if args.only else list(LAYOUTS.items())
    rows = []
    for name, job in todo:
        row = compare(name, job, workers=args.workers)
        rows.append(row)
        if not args.json:
            print(render([row], summary=False), f"  [{row.get('seconds', 0):.1f} s]", flush=True)
    print(json.dumps(rows, indent=1) if args.json else "\n" + render(rows))


if __name__ == "__main__":
    main()
