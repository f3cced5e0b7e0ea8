"""One typed model of the job and the plan: required fields, the trainer's capability table, the
exported JSON Schemas, the generated doc reference, and hostile job files.

Every hostile input goes through the real CLI (`launch plan JOB -o ...`): exit 2, one line that
names the field or file, nothing written, and a bounded message.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from launcher.errors import UserError
from launcher.plan import capabilities
from launcher.plan.model import Plan, check_plan, plan_schema
from launcher.plan.planner import plan_job
from launcher.plan.schema_doc import DOC, render_reference, updated
from launcher.plan.spec import job_schema, load_spec, spec_from_dict
from tests.cli_helpers import invoke
from tests.plan_helpers import chosen

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
BASE = {"model": "tiny", "train": {"seq_len": 32, "global_batch": 8},
        "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu": "cpu"}}


def with_(path: str, value) -> dict:
    d = copy.deepcopy(BASE)
    *parents, last = path.split(".")
    node: dict = d
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value
    return d


def without(path: str, base: dict | None = None) -> dict:
    d = copy.deepcopy(base or BASE)
    *parents, last = path.split(".")
    node: dict = d
    for p in parents:
        node = node[p]
    del node[last]
    return d


def alias_bomb(levels: int = 9) -> str:
    """A YAML flow list whose expansion has 9**levels leaves (the text stays a few hundred bytes)."""
    parts = ['&l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels):
        parts.append(f"&l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    return "[" + ", ".join(parts) + "]"


CUSTOM_MODEL = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 256}
GPU = {"memory_gb": 16, "peak_tflops": 1, "nvlink_gbs": 10}

# (id, job-file text or dict, the start of the one error line after "error: ")
HOSTILE = [
    ("train-without-seq_len", with_("train", {"global_batch": 8}), "train.seq_len: is required"),
    ("model-without-layers", with_("model", without("layers", CUSTOM_MODEL)), "model.layers: is required"),
    ("gpu-without-peak", with_("cluster.gpu", without("peak_tflops", GPU)), "cluster.gpu.peak_tflops: is required"),
    ("fp16", with_("train.precision", "fp16"), "train.precision: 'fp16' is not run by the bundled trainer"),
    ("zero7", with_("parallel", {"zero": 7}), "parallel.zero: 7 is not valid; choose one of 0, 1, 2, 3"),
    ("lr-nan", "model: tiny\ntrain: {seq_len: 32, global_batch: 8, lr: .nan}\n", "train.lr: nan is not a finite"),
    ("lr-negative", with_("train.lr", -1.0), "train.lr: -1.0 is below the minimum 0"),
    ("efficiency-nan", "model: tiny\ntrain: {seq_len: 32, global_batch: 8}\ncluster: {compute_efficiency: .nan}\n",
     "cluster.compute_efficiency: nan is not a finite"),
    ("memory-inf", "model: tiny\ntrain: {seq_len: 32, global_batch: 8}\n"
                   "cluster: {gpu: {memory_gb: .inf, peak_tflops: 1, nvlink_gbs: 1}}\n",
     "cluster.gpu.memory_gb: inf is not a finite"),
    ("seq_len-inf", "model: tiny\ntrain: {seq_len: .inf, global_batch: 8}\n", "train.seq_len: inf is not an integer"),
    ("layers-huge", with_("model", {**CUSTOM_MODEL, "layers": 10**30}), "model.layers: "),
    ("env-key-newline", with_("backend", {"env": {"FOO\n": "bar"}}), "backend.env.'FOO\\n': "),
    ("env-value-newline", with_("backend", {"env": {"FOO": "bar\nrm -rf /"}}), "backend.env.FOO: "),
    ("partition-newline", with_("backend", {"slurm": {"partition": "gpu\n"}}), "backend.slurm.partition: "),
    ("name-300", with_("name", "x" * 300), "name: "),
    ("name-dotdot", with_("name", "../../../../tmp/x"), "name: "),
    ("name-slash", with_("name", "a/b"), "name: "),
    ("name-newline", with_("name", "job\ntouch pwned\n#"), "name: "),
    ("name-int", with_("name", 12), "name: 12 is not a valid job name"),
    ("heartbeat-gone", with_("diagnostics", {"heartbeat": True}), "diagnostics.heartbeat: unknown key"),
    ("grad_dtype-fp16", with_("train.grad_dtype", "fp16"), "train.grad_dtype: "),
    ("alias-bomb-in-data", "model: tiny\ntrain: {seq_len: 32, global_batch: 8, data: " + alias_bomb() + "}\n",
     "train.data: "),
    ("alias-bomb-as-gpu", "model: tiny\ntrain: {seq_len: 32, global_batch: 8}\ncluster: {gpu: " + alias_bomb() + "}\n",
     "cluster.gpu: "),
    ("alias-bomb-as-name", "name: " + alias_bomb() + "\nmodel: tiny\ntrain: {seq_len: 32, global_batch: 8}\n",
     "name: "),
    ("nested-1000", "model: tiny\ntrain: {seq_len: 32, global_batch: 8, data: " + "[" * 1000 + "]" * 1000 + "}\n",
     "{file}: YAML nested too deeply"),
    ("nested-1000-maps", "model: tiny\ntrain: " + "{a: " * 1000 + "1" + "}" * 1000 + "\n", "{file}: YAML nested too deeply"),
    ("not-utf8", b"model: tiny\ntrain: {seq_len: 32, global_batch: 8}\nname: \xff\xfe\n", "{file}: job file is not UTF-8"),
    ("not-a-mapping", "- 1\n- 2\n", "{file}: expected a mapping"),
    ("bad-yaml", "model: [tiny\n", "{file}: line"),
]


@pytest.mark.parametrize("case, content, expected", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_job_file_is_one_line_exit_2_nothing_written(case, content, expected, tmp_path):
    job = tmp_path / "job.yaml"
    if isinstance(content, dict):
        job.write_text(yaml.safe_dump(content))
    elif isinstance(content, bytes):
        job.write_bytes(content)
    else:
        job.write_text(content)
    out = tmp_path / "out" / "plan.json"
    r = invoke("plan", str(job), "-o", str(out))
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2, r.output[:2000]
    assert len(lines) == 1 and len(lines[0]) < 400, lines[:3]
    assert lines[0].startswith("error: " + expected.format(file=job)), lines[0]
    assert not out.exists() and not out.parent.exists()
    assert r.exception is None or isinstance(r.exception, SystemExit)


@pytest.mark.parametrize("value", ["nan", "-1", "inf", "0", "-inf"])
def test_memory_params_must_be_finite_and_positive(value):
    r = invoke("memory", "--params", value)
    assert r.exit_code == 2
    assert r.output.strip().splitlines() == [f"error: --params: {float(value)} is not a finite number > 0 (e.g. 7e9)"]


def test_file_name_with_newline_cannot_become_the_job_name(tmp_path):
    job = tmp_path / "job\ntouch pwned\n#.yaml"
    job.write_text(yaml.safe_dump(BASE))
    with pytest.raises(UserError, match=r"^name: .* \(taken from the file name"):
        load_spec(job)


# --- the trainer's capabilities, one table -------------------------------------------------------

def test_planner_never_proposes_what_the_trainer_cannot_run():
    for example in sorted(EXAMPLES.glob("*.yaml")):
        result = plan_job(load_spec(example), top=10)
        for p in [chosen(result)] + result.alternatives:
            assert p.layout.zero in capabilities.ZERO_STAGES, (example.name, p.layout)
            assert p.train.precision in capabilities.PRECISIONS
            check_plan(p)      # the trainer's own start-up check accepts it


def test_trainer_refuses_a_plan_outside_the_table():
    from tests.trainer_helpers import make_plan

    with pytest.raises(UserError, match=r"^plan.layout.zero=5 is not a ZeRO stage"):
        check_plan(make_plan(dp=2, zero=5))
    plan = make_plan()
    fp16 = dataclasses.replace(plan, train=dataclasses.replace(plan.train, precision="fp16"))
    with pytest.raises(UserError, match=r"^plan.train.precision='fp16' is not run by the bundled trainer"):
        check_plan(fp16)


def test_zero_stages_follow_the_table():
    """The job file, the planner and the trainer's check all read capabilities.ZERO_STAGES."""
    for stage in capabilities.ZERO_STAGES:
        spec = spec_from_dict(with_("parallel", {"tp": 1, "cp": 1, "pp": 1, "zero": stage, "recompute": "none",
                                                 "micro_batch": 2}))
        best = chosen(plan_job(spec, top=0))
        assert best.layout.zero == stage
        check_plan(best)


# --- plan.json: version, typed sections, one line for a bad plan -----------------------------------

def test_plan_json_round_trips_through_the_typed_model(tmp_path):
    best = chosen(plan_job(load_spec(EXAMPLES / "tiny-cpu.yaml"), top=0))
    path = tmp_path / "plan.json"
    best.save(path)
    data = json.loads(path.read_text())
    assert data["version"] == 2 and data["model"]["layers"] == 4 and data["train"]["grad_dtype"] == "bf16"
    jsonschema.validate(data, plan_schema())
    loaded = Plan.load(path)
    assert loaded == best and loaded.train == load_spec(EXAMPLES / "tiny-cpu.yaml").train


@pytest.mark.parametrize("edit, expected", [
    (lambda d: d.update(version=1), "plan.version: 1 is not supported (expected 2)"),
    (lambda d: d["train"].pop("seq_len"), "plan.train.seq_len: is required"),
    (lambda d: d["layout"].update(zero=7), "plan.layout.zero: 7 is not valid; choose one of 0, 1, 2, 3"),
    (lambda d: d["train"].update(lr=float("nan")), "plan.train.lr: nan is not a finite number"),
    (lambda d: d["model"].update(heads="many"), "plan.model.heads: 'many' is not an integer"),
    (lambda d: d.update(extra=1), "plan.extra: unknown key"),
    # issue 23: a hand-edited plan is checked for every invariant it promises, not trusted
    (lambda d: d.update(mesh_order=["pp", "dp", "cp", "xx"]), "plan.mesh_order: ['pp', 'dp', 'cp', 'xx'] must order"),
    (lambda d: d.update(mesh_order=["pp", "dp", "cp", "tp", "tp"]), "plan.mesh_order: "),
    (lambda d: d["ranks"]["gpu"].__setitem__(0, 99), "plan.ranks[0].gpu: 99 is not a GPU of the node (0..3)"),
    (lambda d: d["ranks"]["gpu"].__setitem__(1, 0), "plan.ranks[1].gpu: GPU 0 of node 0 is another rank's too"),
    (lambda d: d["ranks"]["node"].__setitem__(0, 5), "plan.ranks[0]: node 5, local rank 0: rank 0 runs as local rank 0"),
    (lambda d: d["ranks"]["local_rank"].__setitem__(1, 0), "plan.ranks[1]: node 0, local rank 0: rank 1 runs as"),
    (lambda d: [d["ranks"][k].pop() for k in ("node", "local_rank", "gpu")], "plan.ranks.node: has 3 entries but"),
    (lambda d: d.update(nodes=3), "plan.nodes: nodes × gpus_per_node = 3 × 4 = 12, but world_size is 4"),
    (lambda d: d.update(world_size=8), "plan.world_size: 8, but layout tp·cp·pp·dp"),
    (lambda d: d.update(name="../../x"), "plan.name: '../../x' is not a job name"),
    (lambda d: d.update(hosts=["../../etc"]), "plan.hosts[0]: '../../etc' is not a host name"),
    (lambda d: d["ranks"].update(nic=["../x", "a", "b", "c"]), "plan.ranks[0].nic: '../x' is not a network device"),
    (lambda d: d.update(gpu_order=[0, 0, 1, 2]), "plan.gpu_order: [0, 0, 1, 2] is not an order of the GPUs 0..3"),
    (lambda d: d.update(stage_layers=[1]), "plan.stage_layers: [1] must be pp·virtual_stages = 1 counts"),
    (lambda d: d.update(ranks=[{"rank": 0, "node": 0, "local_rank": 0, "gpu": 0}]), "plan.ranks: has 1 entries but"),
    (lambda d: d.update(ranks=[{"rank": 0, "node": 0, "local_rank": 0, "gpu": 0, "coords": {"tp": 1}}]
                        + [{"rank": r, "node": 0, "local_rank": r, "gpu": r} for r in (1, 2, 3)]),
     "plan.ranks[0].coords: {'tp': 1}, but the layout"),
])
def test_bad_plan_json_is_one_line(edit, expected, tmp_path):
    best = chosen(plan_job(load_spec(EXAMPLES / "tiny-cpu.yaml"), top=0))
    data = best.to_dict()
    edit(data)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UserError) as exc:
        Plan.load(path)
    assert str(exc.value) == f"{path}: {expected}" or str(exc.value).startswith(f"{path}: {expected}")


def test_binary_and_deep_plan_json_are_one_line(tmp_path):
    path = tmp_path / "plan.json"
    path.write_bytes(b"\xff\xfe{}")
    with pytest.raises(UserError, match="not UTF-8"):
        Plan.load(path)
    for data, expected in ((b"\xef\xbb\xbf{}", "BOM"), ("{}".encode("utf-16"), "not UTF-8"), (b"null", "not NoneType"),
                           (b'{"a": 1\x00}', "not a plan.json"), (b"[]", "not list")):
        path.write_bytes(data)
        with pytest.raises(UserError, match=expected):
            Plan.load(path)
    path.write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(UserError, match="not a plan.json"):
        Plan.load(path)


# --- exported schemas and the generated doc -----------------------------------------------------

def test_job_schema_accepts_every_example_and_rejects_what_the_loader_rejects():
    schema = job_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    for example in sorted(EXAMPLES.glob("*.yaml")):
        jsonschema.validate(yaml.safe_load(example.read_text()), schema)
    v = jsonschema.Draft202012Validator(schema)
    for _, content, _ in HOSTILE[:12]:
        if isinstance(content, dict) and not (set(content) - {"model", "train", "cluster", "parallel"}):
            assert not v.is_valid(content), content


def test_cli_schema_json():
    for which, title in (("job", "launch4d job file"), ("plan", "launch4d plan.json")):
        r = invoke("schema", which, "--json")
        assert r.exit_code == 0 and json.loads(r.output)["title"] == title


def test_doc_reference_is_generated_and_current():
    text = DOC.read_text()
    assert updated(text, render_reference()) == text, "docs/job-file.md is stale: run python -m launcher.plan.schema_doc"
    assert "| `seq_len` | integer 1 … 16777216 | **required** |" in text


def test_every_job_file_field_has_a_meaning():
    """Every key of every section, nested ones included, says what it does: the reference's meaning
    column is never empty (it is generated from the same schema)."""
    from launcher.plan.schema_doc import SECTIONS
    from launcher.plan.spec import job_schema

    defs = job_schema()["$defs"]
    missing = [f"{name}.{key}" for name, d in defs.items() for key, s in d.get("properties", {}).items()
               if not s.get("description", "").strip()]
    assert not missing, f"fields without a doc= meaning: {missing}"
    assert {ref for _, ref in SECTIONS} == set(defs), "every section of the job file has a table in the reference"
    rows = [line for line in render_reference().splitlines() if line.startswith("| `")]
    assert rows and all(line.rsplit("|", 2)[-2].strip() for line in rows)
