"""`launch export`: a plan's layout in another stack's own terms (torchtitan's TOML job file, Megatron-LM's
command-line flags), so the layout chosen here can be trained with that stack.

Why a translation and not a guess: every option name written here is one the stack documents (the
versions are named in SOURCES; tests/unit/test_export.py checks the names against a list transcribed from
that source). A choice the stack can only approximate gets a note; one it cannot express at all gets a
line in `cannot`, and the nearest runnable settings are written beside it (`launch export` then exits 1).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from launcher.plan.capabilities import SPLIT_BACKWARD
from launcher.plan.model import Plan

#: Where the option names come from.
SOURCES = {
    "torchtitan": "pytorch/torchtitan v0.2.2 (73a0e697), torchtitan/config/job_config.py: the TOML job file "
                  "(--job.config_file); torchtitan after 2026-02 (#2386) configures in Python, where these "
                  "fields live on the same-named sections of Trainer.Config",
    "megatron": "NVIDIA/Megatron-LM d98e8a64, megatron/training/arguments.py (and the config dataclasses it "
                "turns into flags: megatron/core/model_parallel_config.py, transformer_config.py, "
                "megatron/training/config/)",
}
TARGETS = tuple(SOURCES)

#: The bundled trainer's schedules by torch.distributed.pipelining's names (get_schedule_class).
TORCH_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B",
                   "interleaved-zero-bubble": "InterleavedZeroBubble", "zero-bubble-v": "ZBVZeroBubble",
                   "dualpipe-v": "DualPipeV"}
DEFAULT_ORDER = ["pp", "dp", "cp", "tp"]


@dataclass
class Export:
    """One plan in one stack's terms: `options` as the stack spells them, `text` ready to paste."""

    target: str
    source: str
    plan: str
    options: dict[str, Any]
    text: str = ""
    notes: list[str] = field(default_factory=list)
    cannot: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return not self.cannot

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "exact": self.exact}


def export(plan: Plan, target: str) -> Export:
    if target == "torchtitan":
        return torchtitan(plan)
    if target == "megatron":
        return megatron(plan)
    raise ValueError(target)


def _summary(p: Plan) -> str:
    lay = p.layout
    return (f"tp={lay.tp} cp={lay.cp} pp={lay.pp} dp={lay.dp} ep={lay.ep}, ZeRO {lay.zero}, recompute {lay.recompute}, "
            f"micro-batch {lay.micro_batch} × {lay.grad_accum}, schedule {lay.schedule}")


# --- torchtitan ------------------------------------------------------------------------------------

def stage_modules(p: Plan) -> list[list[str]]:
    """The plan's exact stage split as torchtitan's module_fqns_per_model_part: one list per model chunk
    in model order (chunk c runs on pipeline rank c mod pp), with the embedding first and norm/output last."""
    out, start = [], 0
    for n in p.stage_layers:
        out.append([f"layers.{i}" for i in range(start, start + n)])
        start += n
    out[0].insert(0, "tok_embeddings")
    out[-1] += ["norm", "output"]
    return out


def torchtitan(p: Plan) -> Export:
    lay, t = p.layout, p.train
    notes: list[str] = []
    cannot: list[str] = []
    par: dict[str, Any] = {}
    # hybrid sharding is torchtitan's HSDP: dp_replicate × dp_shard
    rep, shard = lay.dp_replicas, lay.dp_shard_size
    if lay.zero == 3:
        par.update(data_parallel_replicate_degree=rep, data_parallel_shard_degree=shard,
                   fsdp_reshard_after_forward="always")
    elif lay.zero == 2:
        par.update(data_parallel_replicate_degree=rep, data_parallel_shard_degree=shard,
                   fsdp_reshard_after_forward="never")
    elif lay.zero == 0 and lay.tp == lay.cp == lay.pp == 1:
        par.update(data_parallel_replicate_degree=lay.dp, data_parallel_shard_degree=1)
    else:
        par.update(data_parallel_replicate_degree=1, data_parallel_shard_degree=lay.dp,
                   fsdp_reshard_after_forward="never")
        if lay.zero == 1:
            par.update(data_parallel_replicate_degree=rep, data_parallel_shard_degree=shard)
            cannot.append("ZeRO 1 (only the optimizer state sharded): torchtitan has no such mode; written instead: "
                          "FSDP without resharding after forward (ZeRO 2, gradients sharded too)")
        else:
            cannot.append("ZeRO 0 beside tp, cp or pp > 1: torchtitan runs DDP only as the sole parallelism, and "
                          "shards the weights over cp whenever cp > 1; written instead: FSDP without resharding "
                          "after forward (ZeRO 2)")
    par["tensor_parallel_degree"] = lay.tp
    par["context_parallel_degree"] = lay.cp
    par["pipeline_parallel_degree"] = lay.pp
    if lay.pp > 1:
        par["pipeline_parallel_schedule"] = TORCH_SCHEDULES[lay.schedule]
        par["pipeline_parallel_microbatch_size"] = lay.micro_batch
        par["module_fqns_per_model_part"] = stage_modules(p)
        notes.append("module_fqns_per_model_part names the modules of torchtitan's Llama-style models "
                     "(tok_embeddings, layers.N, norm, output)")
    if p.model.experts > 1:
        par["expert_parallel_degree"] = lay.ep
        if lay.tp > 1:
            cannot.append(f"experts under tp={lay.tp}: the bundled trainer keeps every expert whole on each TP rank; "
                          "torchtitan shards them over TP (ep = 1, or expert_tensor_parallel_degree = tp) or spreads "
                          "EP over the TP ranks (expert_tensor_parallel_degree = 1)")
    if list(p.mesh_order) != DEFAULT_ORDER:
        cannot.append(f"mesh_order {','.join(p.mesh_order)}: torchtitan's mesh is always pp, dp, cp, tp (outer→inner)")
    # torchtitan's local batch is what one data-parallel rank takes per step into the pipeline; with pp
    # it is cut into pipeline micro-batches, without it the global batch sets the gradient accumulation.
    training: dict[str, Any] = {
        "seq_len": t.seq_len,
        "local_batch_size": lay.micro_batch * (lay.grad_accum if lay.pp > 1 else 1),
        "global_batch_size": t.global_batch, "steps": t.steps, "max_norm": t.grad_clip,
        "mixed_precision_param": "bfloat16" if t.precision == "bf16" else "float32"}
    ac: dict[str, Any] = {"mode": lay.recompute}
    if lay.recompute == "selective":
        ac["selective_ac_option"] = "op"
        notes.append("selective recompute: torchtitan's per-op policy ('op') keeps other activations than the "
                     "bundled trainer's selective recompute, so activation memory differs")
    options = {"parallelism": par, "training": training, "activation_checkpoint": ac}
    head = [f"# torchtitan job-file sections for plan {p.name}: {_summary(p)}",
            f"# option names: {SOURCES['torchtitan']}"]
    head += [f"# cannot express: {c}" for c in cannot] + [f"# note: {n}" for n in notes]
    return Export("torchtitan", SOURCES["torchtitan"], p.name, options, "\n".join(head) + "\n" + toml(options),
                  notes, cannot)


def toml(sections: dict[str, dict[str, Any]]) -> str:
    """Tables of scalars and lists as TOML (JSON's strings, numbers and arrays are TOML's)."""
    out = []
    for name, values in sections.items():
        out.append(f"[{name}]")
        for key, value in values.items():
            text = ("true" if value else "false") if isinstance(value, bool) else json.dumps(value)
            out.append(f"{key} = {text}")
        out.append("")
    return "\n".join(out)


# --- Megatron-LM -------------------------------------------------------------------------------------

def pipeline_layout(p: Plan) -> str:
    """The stage split as --pipeline-model-parallel-layout: stages in model order split by '|', E the
    embedding, t a transformer layer, L the loss (Megatron's PipelineParallelLayerLayout)."""
    stages = ["t" * n for n in p.stage_layers]
    stages[0] = "E" + stages[0]
    stages[-1] += "L"
    return "|".join(stages)


def megatron(p: Plan) -> Export:
    lay, t = p.layout, p.train
    notes: list[str] = []
    cannot: list[str] = []
    flags: dict[str, Any] = {"--tensor-model-parallel-size": lay.tp, "--pipeline-model-parallel-size": lay.pp,
                             "--context-parallel-size": lay.cp}
    if p.model.experts > 1:
        flags["--expert-model-parallel-size"] = lay.ep
        if lay.tp > 1:
            flags["--expert-tensor-parallel-size"] = 1
            if lay.ep > 1:
                cannot.append(f"ep={lay.ep} under tp={lay.tp}: Megatron-LM builds expert-parallel groups from the "
                              "innermost ranks (the TP ranks first); the bundled trainer's EP splits dp·cp and keeps "
                              "the experts whole on each TP rank")
    if lay.tp > 1:
        flags["--sequence-parallel"] = True
    if lay.pp > 1:
        even = len(set(p.stage_layers)) == 1
        if not even:
            flags["--pipeline-model-parallel-layout"] = pipeline_layout(p)
        elif lay.virtual_stages > 1:
            flags["--num-layers-per-virtual-pipeline-stage"] = p.stage_layers[0]
        if lay.schedule == "gpipe":
            cannot.append("schedule gpipe: Megatron-LM runs 1F1B (interleaved with virtual stages); no GPipe "
                          "schedule (1F1B has the same bubble and holds fewer micro-batches' activations)")
        elif lay.schedule in SPLIT_BACKWARD:
            cannot.append(f"schedule {lay.schedule}: Megatron-LM's schedules (megatron/core/pipeline_parallel/"
                          "schedules.py) run 1F1B and interleaved 1F1B, with no split input/weight backward; "
                          "written instead: 1F1B (interleaved where the plan has virtual stages)")
    if lay.dp_replicas > 1:
        cannot.append(f"hybrid sharding (dp_shard {lay.dp_shard_size} of dp {lay.dp}, {lay.dp_replicas} replicas): not "
                      "written as Megatron-LM flags here; written instead: sharding over all of dp")
    if lay.zero == 1:
        flags["--use-distributed-optimizer"] = True
    elif lay.zero in (2, 3):
        flags["--use-distributed-optimizer"] = True      # Megatron-FSDP version 1 runs under it
        flags["--use-megatron-fsdp"] = True
        flags["--data-parallel-sharding-strategy"] = "optim_grads" if lay.zero == 2 else "optim_grads_params"
        notes.append(f"ZeRO {lay.zero} is Megatron-FSDP's {flags['--data-parallel-sharding-strategy']} sharding "
                     "(megatron/core/distributed/fsdp), not the classic distributed optimizer")
    if lay.recompute == "selective":
        flags["--recompute-granularity"] = "selective"
        notes.append("selective recompute: Megatron-LM's recomputes the attention core (--recompute-modules "
                     "core_attn); the bundled trainer's keeps other activations, so activation memory differs")
    elif lay.recompute == "full":
        flags.update({"--recompute-granularity": "full", "--recompute-method": "uniform",
                      "--recompute-num-layers": 1})
    order = list(p.mesh_order)
    if order == ["dp", "pp", "cp", "tp"]:
        flags["--use-tp-pp-dp-mapping"] = True
    elif order != DEFAULT_ORDER:
        cannot.append(f"mesh_order {','.join(order)}: Megatron-LM orders ranks tp, cp, ep, dp, pp from the inside "
                      "(or tp, cp, ep, pp, dp with --use-tp-pp-dp-mapping)")
    flags.update({"--micro-batch-size": lay.micro_batch, "--global-batch-size": t.global_batch,
                  "--seq-length": t.seq_len, "--train-iters": t.steps})
    if t.precision == "bf16":
        flags["--bf16"] = True
    if t.grad_dtype == "fp32":
        flags["--accumulate-allreduce-grads-in-fp32"] = True
    head = [f"# Megatron-LM flags for plan {p.name}: {_summary(p)}", f"# option names: {SOURCES['megatron']}"]
    head += [f"# cannot express: {c}" for c in cannot] + [f"# note: {n}" for n in notes]
    return Export("megatron", SOURCES["megatron"], p.name, flags, "\n".join(head) + "\n" + shell_flags(flags),
                  notes, cannot)


def argv(flags: dict[str, Any]) -> list[str]:
    """The flags as command-line words: a True flag alone, any other value after its flag."""
    out: list[str] = []
    for flag, value in flags.items():
        out += [flag] if value is True else [flag, str(value)]
    return out


def shell_flags(flags: dict[str, Any]) -> str:
    import shlex

    lines = [shlex.join([f] if v is True else [f, str(v)]) for f, v in flags.items()]
    return " \\\n".join(lines) + "\n"
