"""`launch export --to torchtitan|megatron`: every option name we write is one the stack documents.

The names below are transcribed by hand from the stacks' own sources (not vendored), each with where it
is defined, at the versions launcher/plan/export.py names:

- torchtitan v0.2.2 (commit 73a0e6979dd1), torchtitan/config/job_config.py: JobConfig's sections
  `training` (class Training, line 243), `parallelism` (class Parallelism, line 312) and
  `activation_checkpoint` (class ActivationCheckpoint, line 651); a TOML job file's tables are these
  sections and its keys their fields.
- Megatron-LM d98e8a64ddf3, megatron/training/arguments.py. Some flags are add_argument calls there; the
  others are dataclass fields that megatron/training/argument_utils.py (ArgumentGroupFactory,
  _format_arg_name) turns into `--` + name.replace('_', '-'), a bool field defaulting to False becoming a
  store_true flag: ModelParallelConfig (megatron/core/model_parallel_config.py) and TransformerConfig
  (megatron/core/transformer/transformer_config.py) through arguments.py line 2373, TrainingConfig
  (megatron/training/config/training_config.py) through line 2863, DistributedInitConfig
  (megatron/training/config/common_config.py) through line 3092.

The pipeline schedules' names are checked against the installed torch itself (get_schedule_class).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tomllib

from launcher.plan.export import export, pipeline_layout, stage_modules

pytestmark = pytest.mark.unit

#: torchtitan v0.2.2 job_config.py: section -> {field: allowed values (None: any of its type)}, with lines.
TORCHTITAN = {
    "training": {
        "local_batch_size": None,            # line 253
        "global_batch_size": None,           # line 256
        "seq_len": None,                     # line 261
        "max_norm": None,                    # line 264
        "steps": None,                       # line 267
        "mixed_precision_param": {"bfloat16", "float32"},   # line 282, Literal
    },
    "parallelism": {
        "data_parallel_replicate_degree": None,             # line 313
        "data_parallel_shard_degree": None,                 # line 324
        "fsdp_reshard_after_forward": {"default", "always", "never"},   # line 336, Literal
        "tensor_parallel_degree": None,                     # line 351
        "pipeline_parallel_degree": None,                   # line 360
        "module_fqns_per_model_part": None,                 # line 367, list[list[str]]
        "pipeline_parallel_schedule": None,                 # line 396, a torch.distributed.pipelining name
        "pipeline_parallel_microbatch_size": None,          # line 412
        "context_parallel_degree": None,                    # line 428
        "expert_parallel_degree": None,                     # line 454
        "expert_tensor_parallel_degree": None,              # line 464
    },
    "activation_checkpoint": {
        "mode": {"selective", "full", "memory_budget", "none"},   # line 652, Literal
        "selective_ac_option": None,         # line 655: 'int' (every nth layer) or 'op'
    },
}

#: Megatron-LM d98e8a64 flags that take a value: flag -> allowed values (None: any), with where defined.
MEGATRON_VALUES = {
    "--tensor-model-parallel-size": None,        # model_parallel_config.py:55
    "--pipeline-model-parallel-size": None,      # model_parallel_config.py:83
    "--context-parallel-size": None,             # model_parallel_config.py:100
    "--expert-model-parallel-size": None,        # model_parallel_config.py:127
    "--expert-tensor-parallel-size": None,       # model_parallel_config.py:130
    "--recompute-granularity": {"full", "selective"},    # transformer_config.py:532
    "--recompute-method": {"uniform", "block"},          # transformer_config.py:543
    "--recompute-num-layers": None,              # transformer_config.py:551
    "--micro-batch-size": None,                  # training/config/training_config.py:11
    "--global-batch-size": None,                 # training/config/training_config.py:15
    "--train-iters": None,                       # training/config/training_config.py:64
    "--pipeline-model-parallel-layout": None,    # arguments.py:3103
    "--num-layers-per-virtual-pipeline-stage": None,     # arguments.py:3114
    "--data-parallel-sharding-strategy": {"no_shard", "optim", "optim_grads", "optim_grads_params"},  # :3190
    "--seq-length": None,                        # arguments.py:3305
}
#: ... and store_true flags (no value).
MEGATRON_SWITCHES = {
    "--sequence-parallel",                       # model_parallel_config.py:94 (bool, default False)
    "--bf16",                                    # model_parallel_config.py:180
    "--use-distributed-optimizer",               # arguments.py:3156
    "--use-megatron-fsdp",                       # training/config/common_config.py:92
    "--use-tp-pp-dp-mapping",                    # training/config/common_config.py:105
    "--accumulate-allreduce-grads-in-fp32",      # arguments.py:3069
}
#: --pipeline-model-parallel-layout's letters (megatron/core/transformer/pipeline_parallel_layer_layout.py,
#: parse_str_to_list): E embedding, L loss, t transformer layer, m MTP layer; stages split by '|'.
LAYOUT = re.compile(r"[ELtm]*(\|[ELtm]*)*")


def plan(gpus: int = 8, model: object = "tiny", **parallel):
    from launcher.plan.planner import plan_job
    from launcher.plan.spec import spec_from_dict

    fixed = {"zero": 1, "recompute": "none", "micro_batch": 1, **parallel}
    spec = spec_from_dict({"name": "x", "model": model, "train": {"seq_len": 64, "global_batch": 16, "steps": 5},
                           "cluster": {"nodes": 1, "gpus_per_node": gpus, "gpu": "cpu"}, "parallel": fixed})
    best = plan_job(spec, top=0).best
    assert best is not None
    return best


MOE = {"layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "vocab": 256, "ffn_hidden": 128, "experts": 4,
       "experts_per_token": 2}
PLANS: dict[str, dict[str, Any]] = {
    "dp8 z0": dict(tp=1, cp=1, pp=1, zero=0),
    "tp2 pp2 dp2 z1 selective": dict(tp=2, cp=1, pp=2, recompute="selective"),
    "tp2 cp2 dp2 z3 full": dict(tp=2, cp=2, pp=1, zero=3, recompute="full"),
    "pp2 v2 interleaved z2": dict(tp=1, cp=1, pp=2, zero=2, schedule="interleaved-1f1b", virtual_stages=2),
    "pp2 gpipe": dict(tp=1, cp=1, pp=2, schedule="gpipe"),
    "pp2 zero-bubble-v z1": dict(tp=1, cp=1, pp=2, schedule="zero-bubble-v", virtual_stages=2),
    "pp3 uneven": dict(tp=1, cp=1, pp=3),
    "dp-outer order": dict(tp=2, cp=1, pp=2, mesh_order=["dp", "pp", "cp", "tp"]),
}


def all_plans():
    out = {name: plan(6 if "pp3" in name else 8, **kw) for name, kw in PLANS.items()}
    out["moe ep4 tp1"] = plan(8, MOE, tp=1, cp=1, pp=1, ep=4)
    out["moe ep2 tp2"] = plan(8, MOE, tp=2, cp=1, pp=1, ep=2)
    return out


@pytest.fixture(scope="module")
def plans():
    return all_plans()


def test_torchtitan_names_are_its_job_config_fields(plans):
    for name, p in plans.items():
        out = export(p, "torchtitan")
        assert set(out.options) <= set(TORCHTITAN), name
        for section, values in out.options.items():
            for key, value in values.items():
                assert key in TORCHTITAN[section], f"{name}: [{section}] {key}"
                allowed = TORCHTITAN[section][key]
                assert allowed is None or value in allowed, f"{name}: [{section}] {key} = {value!r}"
        # the printed text is TOML that reads back as the options
        assert tomllib.loads(out.text) == out.options, name


def test_megatron_names_are_its_flags(plans):
    for name, p in plans.items():
        out = export(p, "megatron")
        for flag, value in out.options.items():
            if value is True:
                assert flag in MEGATRON_SWITCHES, f"{name}: {flag}"
            else:
                assert flag in MEGATRON_VALUES, f"{name}: {flag}"
                allowed = MEGATRON_VALUES[flag]
                assert allowed is None or value in allowed, f"{name}: {flag} {value!r}"
        words = [w.rstrip("\\").strip() for w in out.text.splitlines() if not w.startswith("#")]
        assert all(w.split()[0] in out.options for w in words if w), name


def test_schedule_names_are_torch_pipelinings():
    from torch.distributed.pipelining.schedules import get_schedule_class

    from launcher.plan.capabilities import SCHEDULES
    from launcher.plan.export import TORCH_SCHEDULES

    assert set(TORCH_SCHEDULES) == set(SCHEDULES), "every schedule the planner can pick has torchtitan's name"
    from launcher.trainer.pipeline import MULTI, SINGLE

    for ours, theirs in TORCH_SCHEDULES.items():
        assert get_schedule_class(theirs).__name__.lower().replace("schedule", "") == theirs.lower(), ours
        assert get_schedule_class(theirs) is {**SINGLE, **MULTI}[ours], f"{ours}: the trainer runs another class"


def test_the_layout_is_what_the_plan_says(plans):
    p = plans["tp2 cp2 dp2 z3 full"]
    mg = export(p, "megatron").options
    assert (mg["--tensor-model-parallel-size"], mg["--context-parallel-size"], mg["--pipeline-model-parallel-size"]) \
        == (2, 2, 1)
    assert mg["--sequence-parallel"] is True and mg["--data-parallel-sharding-strategy"] == "optim_grads_params"
    assert (mg["--recompute-granularity"], mg["--recompute-method"], mg["--recompute-num-layers"]) == ("full", "uniform", 1)
    assert (mg["--micro-batch-size"], mg["--global-batch-size"], mg["--seq-length"]) == (1, 16, 64)
    tt = export(p, "torchtitan").options
    assert tt["parallelism"]["data_parallel_shard_degree"] == 2 and tt["parallelism"]["fsdp_reshard_after_forward"] \
        == "always"
    assert tt["activation_checkpoint"] == {"mode": "full"} and tt["training"]["local_batch_size"] == 1
    assert export(p, "torchtitan").exact and export(p, "megatron").exact

    z1 = plans["tp2 pp2 dp2 z1 selective"]
    assert export(z1, "megatron").options["--use-distributed-optimizer"] is True and export(z1, "megatron").exact
    # with pp, torchtitan takes all of a rank's micro-batches per step into the pipeline
    ex = export(z1, "torchtitan")
    assert ex.options["training"]["local_batch_size"] == z1.micro_batch * z1.grad_accum
    assert ex.options["parallelism"]["pipeline_parallel_microbatch_size"] == z1.micro_batch
    assert not ex.exact and ex.cannot[0].startswith("ZeRO 1")


def test_stage_splits_are_exact(plans):
    for name in ("pp2 v2 interleaved z2", "pp3 uneven", "tp2 pp2 dp2 z1 selective"):
        p = plans[name]
        parts = stage_modules(p)
        assert [len([m for m in part if m.startswith("layers.")]) for part in parts] == p.stage_layers
        assert parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "output"]
        layout = pipeline_layout(p)
        assert LAYOUT.fullmatch(layout) and [s.count("t") for s in layout.split("|")] == p.stage_layers
    v2 = export(plans["pp2 v2 interleaved z2"], "megatron").options
    assert v2["--num-layers-per-virtual-pipeline-stage"] == 1 and "--pipeline-model-parallel-layout" not in v2
    assert export(plans["pp2 v2 interleaved z2"], "torchtitan").options["parallelism"][
        "pipeline_parallel_schedule"] == "Interleaved1F1B"
    uneven = plans["pp3 uneven"]
    if len(set(uneven.stage_layers)) > 1:
        assert export(uneven, "megatron").options["--pipeline-model-parallel-layout"] == pipeline_layout(uneven)


def test_what_a_stack_cannot_express_is_one_line_each(plans):
    gpipe = export(plans["pp2 gpipe"], "megatron")
    assert len(gpipe.cannot) == 1 and gpipe.cannot[0].startswith("schedule gpipe")
    assert export(plans["pp2 gpipe"], "torchtitan").options["parallelism"]["pipeline_parallel_schedule"] == "GPipe"
    zbv = plans["pp2 zero-bubble-v z1"]
    assert export(zbv, "torchtitan").options["parallelism"]["pipeline_parallel_schedule"] == "ZBVZeroBubble"
    assert [c for c in export(zbv, "megatron").cannot if c.startswith("schedule zero-bubble-v")]
    order = plans["dp-outer order"]
    assert export(order, "megatron").options["--use-tp-pp-dp-mapping"] is True
    assert any(c.startswith("mesh_order dp,pp,cp,tp") for c in export(order, "torchtitan").cannot)
    moe = export(plans["moe ep4 tp1"], "megatron")
    assert moe.options["--expert-model-parallel-size"] == 4 and moe.exact
    assert export(plans["moe ep4 tp1"], "torchtitan").options["parallelism"]["expert_parallel_degree"] == 4
    assert any(c.startswith("ep=2 under tp=2") for c in export(plans["moe ep2 tp2"], "megatron").cannot)
    ddp = export(plans["dp8 z0"], "torchtitan")
    assert ddp.exact and ddp.options["parallelism"]["data_parallel_replicate_degree"] == 8
    for p in plans.values():
        for target in ("torchtitan", "megatron"):
            out = export(p, target)
            assert all("\n" not in c for c in out.cannot)
            assert sum(line.startswith("# cannot express:") for line in out.text.splitlines()) == len(out.cannot)


def test_launch_export_cli(tmp_path):
    launch = str(Path(sys.executable).with_name("launch"))
    p = plan(8, tp=2, cp=1, pp=2, zero=1, schedule="1f1b")
    p.save(tmp_path / "plan.json")
    env = {**os.environ, "LAUNCH4D_STATE": str(tmp_path / "state")}
    r = subprocess.run([launch, "export", tmp_path / "plan.json", "--to", "megatron"], capture_output=True, text=True,
                       env=env)
    assert r.returncode == 0, r.stderr
    assert "--tensor-model-parallel-size 2 \\" in r.stdout and "--use-distributed-optimizer" in r.stdout
    r = subprocess.run([launch, "export", tmp_path / "plan.json", "--to", "torchtitan", "--json"], capture_output=True,
                       text=True, env=env)
    assert r.returncode == 1 and "torchtitan cannot express: ZeRO 1" in r.stderr
    out = json.loads(r.stdout)
    assert out["exact"] is False and out["options"]["parallelism"]["tensor_parallel_degree"] == 2
    r = subprocess.run([launch, "export", tmp_path / "plan.json", "--to", "deepspeed"], capture_output=True, text=True,
                       env=env)
    assert r.returncode == 2 and "--to" in r.stderr
