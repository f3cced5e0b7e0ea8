"""Job-file validation: presets, defaults, and one clear line per mistake (exit 2)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from launcher.errors import SpecError
from launcher.plan.spec import load_spec, spec_from_dict
from tests.cli_helpers import invoke
from tests.conftest import EXAMPLES, REPO

pytestmark = pytest.mark.unit

BASE = {"model": "llama3-8b", "train": {"seq_len": 4096, "global_batch": 64},
        "cluster": {"nodes": 1, "gpus_per_node": 8, "gpu": "h100-sxm"}}


def with_(path: str, value):
    data = yaml.safe_load(yaml.safe_dump(BASE))
    *parents, leaf = path.split(".")
    cur = data
    for p in parents:
        cur = cur.setdefault(p, {})
    cur[leaf] = value
    return data


def error_of(data) -> str:
    with pytest.raises(SpecError) as exc:
        spec_from_dict(data)
    return str(exc.value)


def test_presets_resolve():
    spec = spec_from_dict(BASE)
    assert spec.model.layers == 32 and spec.model.kv_heads == 8 and spec.model.preset == "llama3-8b"
    assert spec.gpu.peak_tflops == 989 and spec.gpu.memory_gb == 80 and spec.gpu.name == "h100-sxm"
    assert spec.parallel.tp is None and spec.parallel.mesh_order == ["pp", "dp", "cp", "tp"]


@pytest.mark.parametrize("name", ["tiny", "llama3-8b", "llama3-70b", "llama3-405b", "gpt3-175b", "mixtral-8x7b"])
def test_required_model_presets(name):
    assert spec_from_dict(with_("model", name)).model.preset == name


@pytest.mark.parametrize("gpu", ["a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "b200", "l40s"])
def test_required_gpu_presets(gpu):
    assert spec_from_dict(with_("cluster.gpu", gpu)).gpu.memory_gb > 0


def test_explicit_model_defaults():
    spec = spec_from_dict(with_("model", {"layers": 2, "hidden": 64, "heads": 4, "vocab": 100}))
    assert spec.model.kv_heads == 4 and spec.model.ffn_hidden == 256 and spec.model.experts == 1


def test_explicit_gpu():
    spec = spec_from_dict(with_("cluster.gpu", {"memory_gb": 24, "peak_tflops": 100, "nvlink_gbs": 64}))
    assert spec.gpu.memory_gb == 24 and spec.gpu.network_gbs_per_gpu == 25.0


def test_parallel_auto_and_mapping():
    assert spec_from_dict(with_("parallel", "auto")).parallel.tp is None
    assert spec_from_dict(with_("parallel", {"tp": 8, "zero": 1})).parallel.tp == 8


@pytest.mark.parametrize("path, value, expected", [
    ("parallel.tp", 3, "parallel.tp: 3 does not divide"),
    ("parallel.zero", 4, "parallel.zero: 4 is not valid; choose one of 0, 1, 2, 3"),
    ("train.precision", "fp16", "train.precision: 'fp16' is not run by the bundled trainer"),
    ("parallel.recompute", "some", "parallel.recompute: 'some' is not valid; choose one of 'none', 'selective', 'full'"),
    ("parallel.schedul", "1f1b", "parallel.schedul: unknown key (did you mean 'schedule'?)"),
    ("train.seq_lne", 1, "train.seq_lne: unknown key (did you mean 'seq_len'?)"),
    ("train.global_batch", "many", "train.global_batch: 'many' is not an integer"),
    ("train.optimizer", "adamw", "train.optimizer: 'adamw' is not valid; choose one of 'adam', 'sgd', 'adam8bit' (did you mean 'adam'?)"),
    ("cluster.gpu", "v100", "cluster.gpu: unknown GPU preset 'v100'"),
    ("cluster.nodes", 0, "cluster.nodes: 0 is below the minimum 1"),
    ("model", "llama3-7b", "model: unknown model preset 'llama3-7b' (did you mean"),
    ("parallel.pp", 64, "parallel.pp: 64 does not divide the world size 8"),
    ("parallel.cp", 3, "parallel.cp: 3 does not divide the world size 8"),
    ("parallel.mesh_order", ["tp", "dp"], "parallel.mesh_order"),
])
def test_bad_values_name_the_path(path, value, expected):
    assert expected in error_of(with_(path, value))


def test_tp_larger_than_a_node_needs_force():
    data = with_("model", {"layers": 4, "hidden": 512, "heads": 16, "vocab": 128})
    data["cluster"]["nodes"] = 2
    data["parallel"] = {"tp": 16}
    assert "parallel.tp: 16 does not divide gpus_per_node=8 (set parallel.allow_cross_node_tp" in error_of(data)
    data["parallel"]["allow_cross_node_tp"] = True
    assert spec_from_dict(data).parallel.tp == 16


def test_unknown_section_did_you_mean():
    data = dict(BASE, paralel="auto")
    assert error_of(data).startswith("paralel: unknown section (did you mean 'parallel'?)")


def test_degrees_must_multiply_to_world():
    assert "tp·cp·pp·dp = 4 but the cluster has 8 GPUs" in error_of(with_("parallel", {"tp": 2, "cp": 1, "pp": 1, "dp": 2}))


def test_seq_len_divisible_by_cp_tp():
    data = with_("parallel", {"tp": 8, "cp": 2})
    data["train"]["seq_len"] = 4100
    data["cluster"]["nodes"] = 2
    assert "parallel.cp: 2 needs train.seq_len=4100 divisible by 2·cp·tp=32" in error_of(data)


def test_cli_bad_job_exit_2_one_line(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(with_("parallel.tp", 3)))
    r = invoke("plan", str(job))
    assert r.exit_code == 2
    assert r.output.strip().splitlines() == ["error: parallel.tp: 3 does not divide model.heads=32"]


def test_cli_missing_file_and_bad_yaml(tmp_path):
    r = invoke("plan", str(tmp_path / "nope.yaml"))
    assert r.exit_code == 2 and "cannot read job file" in r.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    r = invoke("plan", str(bad))
    assert r.exit_code == 2 and "is not valid YAML" in r.output and "Traceback" not in r.output


def test_real_subprocess_error_has_no_traceback(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(with_("train.optimizer", "adamw")))
    r = subprocess.run([sys.executable, "-m", "launcher.cli", "plan", str(job)], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and r.stderr.startswith("error: train.optimizer:")


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_examples_load(path):
    assert load_spec(path).name


def test_virtual_stages_llama3_split_accepted_others_named():
    """Llama 3 405B's layout is expressible: 126 layers on pp 16 × v 8 (ends empty), v 4 (ends one layer);
    v 3 (48 chunks) leaves 18 short and is refused on the field."""
    base = dict(BASE, model="llama3-405b", cluster={"nodes": 256, "gpus_per_node": 8, "gpu": "h100-sxm"})
    for v in (4, 8):
        par = {"tp": 8, "pp": 16, "dp": 16, "schedule": "interleaved-1f1b", "virtual_stages": v}
        assert spec_from_dict(dict(base, parallel=par)).parallel.virtual_stages == v
    msg = error_of(dict(base, parallel={"tp": 8, "pp": 16, "dp": 16, "schedule": "interleaved-1f1b",
                                        "virtual_stages": 3}))
    assert "parallel.virtual_stages" in msg and "126" in msg and "48" in msg


# --- YAML 1.2, not 1.1 (issue 23) ------------------------------------------------------------------
SLURM_TEXT = (EXAMPLES / "tiny-slurm.yaml").read_text()


@pytest.mark.parametrize("written", ["1:00:00", "no", "yes", "off", "on", "0777", "010", "0x1F", "0o17", "1_000",
                                     "2024-01-01", "1.10", "=", "NO", "Yes", "1e3", ".inf", "~x"])
def test_yaml_11_scalars_stay_what_was_written_in_text_fields(written):
    """`partition: no` is "no", `account: 0777` is "0777", `time: 1:00:00` is "1:00:00": a job file is
    YAML 1.2, and a text field keeps the number's text as written."""
    from launcher.plan.spec import spec_from_text

    text = SLURM_TEXT.replace("partition: debug", f"partition: {written}\n    account: {written}")
    text = text.replace('time: "00:20:00"', "time: 1:00:00").replace('OMP_NUM_THREADS: "1"', f"OMP_NUM_THREADS: {written}")
    spec = spec_from_text(text, "job.yaml")
    assert (spec.backend.slurm.partition, spec.backend.slurm.account) == (written, written)
    assert spec.backend.slurm.time == "1:00:00" and spec.backend.env["OMP_NUM_THREADS"] == written


@pytest.mark.parametrize("written, value", [("0x10", 16), ("0o10", 8), ("016", 16), ("+8", 8), ("8e1", 80)])
def test_yaml_12_numbers_in_number_fields(written, value):
    from launcher.plan.spec import spec_from_text

    spec = spec_from_text(SLURM_TEXT.replace("global_batch: 8", f"global_batch: {written}"), "job.yaml")
    assert spec.train.global_batch == value and type(spec.train.global_batch) is int


@pytest.mark.parametrize("text, expected", [
    (SLURM_TEXT + "\nmodel: tiny\n", r"job.yaml: duplicate key 'model' \(line 8 and again on line \d+\)"),
    (SLURM_TEXT.replace("  steps: 6\n", "  steps: 6\n  steps: 7\n"), "duplicate key 'steps'"),
    (SLURM_TEXT.replace("zero: 3", "zero: true"), r"parallel.zero: True is not valid"),
    (SLURM_TEXT.replace("zero: 3", "zero: 1.0"), r"parallel.zero: 1.0 is not valid"),
    (SLURM_TEXT.replace("zero: 3", "zero: '1'"), r"parallel.zero: '1' is not valid.*without quotes"),
    (SLURM_TEXT.replace("exclusive: true", "exclusive: yes"), r"backend.slurm.exclusive: 'yes' is not true or false"),
])
def test_repeated_keys_and_wrong_scalar_types_are_one_line(text, expected):
    from launcher.errors import UserError
    from launcher.plan.spec import spec_from_text

    with pytest.raises(UserError, match=expected):
        spec_from_text(text, "job.yaml")


@pytest.mark.parametrize("name", ["BASH_ENV", "ENV", "PROMPT_COMMAND", "PS4", "SHELLOPTS", "BASH_FUNC_f%%",
                                  "BASH_FUNC_f", "LD_PRELOAD", "LD_AUDIT", "LD_DEBUG_OUTPUT", "GLIBC_TUNABLES",
                                  "PYTHONSTARTUP", "PYTHONHOME", "PYTHONINSPECT", "PERL5OPT", "NODE_OPTIONS"])
def test_env_names_that_run_code_are_refused_when_read(name):
    assert error_of(with_("backend", {"env": {name: "/tmp/x"}})).startswith(f"backend.env.{name}: ")


def test_library_paths_are_allowed_for_the_trainer():
    from launcher.plan.spec_backend import split_env

    spec = spec_from_dict(with_("backend", {"env": {"LD_LIBRARY_PATH": "/opt/l", "PYTHONPATH": "/opt/p", "A": "1"}}))
    assert split_env(spec.backend.env) == ({"A": "1"}, {"LD_LIBRARY_PATH": "/opt/l", "PYTHONPATH": "/opt/p"})
