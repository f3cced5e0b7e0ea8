"""train.entrypoint: the user's own training code under the plan, in every backend.

End to end: a script written here runs under `launch run` as 2 CPU ranks (torchrun, gloo), sees the
plan in its environment (LAUNCH4D_PLAN and the degrees), its rank in the plan's order, and does one
real all-reduce. The Slurm and Kubernetes renders start the same script with the same variables.
The field is checked like every other (one line naming it, exit 2), and `launch plan` / `verify`
mark the memory verdict as not verified for own code.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml

from tests.cli_helpers import launch, state_env
from tests.plan_helpers import chosen

pytestmark = pytest.mark.e2e

USER_SCRIPT = textwrap.dedent('''
    """A user's own training script: reads the plan launch4d put in its environment."""
    import json, os, sys
    import torch
    import torch.distributed as dist

    out = sys.argv[sys.argv.index("--out") + 1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    seen = {k: v for k, v in os.environ.items() if k.startswith("LAUNCH4D_")}
    seen.update(RANK=os.environ["RANK"], LOCAL_RANK=os.environ["LOCAL_RANK"], WORLD_SIZE=str(world),
                SUM=t.item(), ARGV=sys.argv[1:], NCCL_DEBUG=os.environ.get("NCCL_DEBUG"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(seen, fh)
    print(f"user script rank {rank} of {world}: sum {t.item()}", flush=True)
    dist.destroy_process_group()
''')


def job(tmp_path: Path, entrypoint: dict, backend: dict | None = None, **cluster) -> Path:
    data = {"name": "own-code", "model": "tiny",
            "train": {"seq_len": 32, "global_batch": 4, "steps": 3, "precision": "fp32", "entrypoint": entrypoint},
            "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu": "cpu", **cluster},
            "parallel": {"tp": 2, "zero": 1, "recompute": "none", "micro_batch": 1}}
    if backend:
        data["backend"] = backend
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_user_script_runs_under_launch_run_with_the_plans_ranks(tmp_path):
    (tmp_path / "train.py").write_text(USER_SCRIPT)
    out = tmp_path / "seen"
    out.mkdir()
    path = job(tmp_path, {"script": "train.py", "args": ["--out", str(out), "--lr=1e-3"]})
    rd = tmp_path / "rd"
    r = launch("run", path, "--run-dir", rd, "--json", env=state_env(tmp_path), cwd=tmp_path)  # script relative to cwd
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["state"] == "SUCCEEDED"
    assert "user script rank 0 of 2: sum 3.0" in r.stderr + r.stdout or "user script rank 0" in \
        (rd / "logs" / "node0.log").read_text()
    plan = json.loads((rd / "plan.json").read_text())
    for rank in (0, 1):
        seen = json.loads((out / f"rank{rank}.json").read_text())
        assert seen["RANK"] == str(rank) and seen["WORLD_SIZE"] == "2" and seen["SUM"] == 3.0
        assert int(seen["LOCAL_RANK"]) == plan["ranks"]["local_rank"][rank]      # the plan's rank order
        assert seen["LAUNCH4D_PLAN"] == str(rd.resolve() / "plan.json")
        assert Path(seen["LAUNCH4D_RUN_DIR"]) == rd.resolve()
        assert (seen["LAUNCH4D_TP"], seen["LAUNCH4D_CP"], seen["LAUNCH4D_PP"], seen["LAUNCH4D_DP"],
                seen["LAUNCH4D_EP"]) == ("2", "1", "1", "1", "1")
        assert seen["LAUNCH4D_ZERO"] == "1" and seen["LAUNCH4D_MICRO_BATCH"] == "1"
        assert seen["LAUNCH4D_GRAD_ACCUM"] == str(plan["layout"]["grad_accum"]) == "4"
        assert seen["LAUNCH4D_MESH_ORDER"] == "pp,dp,cp,tp" and seen["LAUNCH4D_RESUME"] == "never"
        assert seen["ARGV"] == ["--out", str(out), "--lr=1e-3"]
        assert seen["NCCL_DEBUG"] == "INFO"                                   # the diagnostics environment
    assert plan["train"]["entrypoint"]["script"] == str((tmp_path / "train.py").resolve())


def test_a_missing_script_is_refused_before_anything_starts(tmp_path):
    path = job(tmp_path, {"script": "nowhere.py"})
    r = launch("run", path, "--run-dir", tmp_path / "rd", env=state_env(tmp_path), cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("error: train.entrypoint.script:") and "no such file" in r.stderr
    assert not (tmp_path / "rd").exists()


@pytest.mark.parametrize("entry, field", [
    ({"script": "a.py", "module": "pkg.train"}, "train.entrypoint"),
    ({"args": ["--x"]}, "train.entrypoint"),
    ({"module": "my-pkg"}, "train.entrypoint.module"),
    ({"module": "launcher.trainer"}, "train.entrypoint.module"),
    ({"script": "--help"}, "train.entrypoint.script"),
    ({"script": "a.py", "args": "--x"}, "train.entrypoint.args"),
    ({"script": "a.py", "argv": []}, "train.entrypoint.argv"),
])
def test_bad_entrypoints_name_the_field(tmp_path, entry, field):
    r = launch("plan", job(tmp_path, entry), "--json", env=state_env(tmp_path))
    assert r.returncode == 2, r.stderr
    assert json.loads(r.stdout)["field"] == field and r.stderr.startswith(f"error: {field}:")


def test_sbatch_render_starts_the_users_script(tmp_path):
    path = job(tmp_path, {"script": "train.py", "args": ["--config", "a b.toml"]},
               backend={"kind": "slurm", "slurm": {"partition": "cpu"}})
    r = launch("render", path, "--backend", "slurm", "-o", tmp_path / "out", env=state_env(tmp_path), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    script = (tmp_path / "out" / "train.sbatch").read_text()
    started = f"--max-restarts=0 --tee=3 \\\n    {(tmp_path / 'train.py').resolve()} --config 'a b.toml' &"
    assert started in script and "-m launcher.trainer" not in script
    for line in ("export LAUNCH4D_TP=2", "export LAUNCH4D_DP=1", "export LAUNCH4D_RESUME=auto",
                 "export LAUNCH4D_PLAN=", "export NCCL_DEBUG=INFO", "--rdzv-backend=static"):
        assert line in script, line
    assert "#SBATCH --gpus-per-node" not in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_sbatch_over_ssh_refuses_a_relative_script(tmp_path):
    from launcher.errors import UserError
    from launcher.plan.planner import plan_job
    from launcher.plan.spec import load_spec
    from launcher.render.sbatch import render_slurm

    spec = load_spec(job(tmp_path, {"script": "train.py"},
                         backend={"kind": "slurm", "slurm": {"login_host": "login01"}}))
    plan = chosen(plan_job(spec, top=0))
    with pytest.raises(UserError, match=r"^train.entrypoint.script: .*absolute path on the cluster"):
        render_slurm(spec, plan, "/shared/runs/own-code")
    spec = load_spec(job(tmp_path, {"script": "/shared/train.py"},
                         backend={"kind": "slurm", "slurm": {"login_host": "login01"}}))
    plan = chosen(plan_job(spec, top=0))
    assert "/shared/train.py &" in render_slurm(spec, plan, "/shared/runs/own-code").files["train.sbatch"]


@pytest.mark.parametrize("api", ["trainjob", "pytorchjob"])
def test_k8s_render_starts_the_users_module(tmp_path, api):
    path = job(tmp_path, {"module": "mypkg.train", "args": ["--steps", "3"]},
               backend={"kind": "k8s", "k8s": {"api": api, "image": "ghcr.io/acme/train:1.0"}})
    r = launch("render", path, "--backend", "k8s", "-o", tmp_path / "out", env=state_env(tmp_path))
    assert r.returncode == 0, r.stderr
    docs = list(yaml.safe_load_all((tmp_path / "out" / "manifest.yaml").read_text()))
    text = json.dumps(docs)
    assert "-m mypkg.train --steps 3" in text and "launcher.trainer" not in text
    for key, value in (("LAUNCH4D_TP", "2"), ("LAUNCH4D_PLAN", "/etc/launch4d/plan.json"), ("LAUNCH4D_RESUME", "auto")):
        assert f'"name": "{key}", "value": "{value}"' in text, key


def test_plan_and_verify_say_own_code_is_not_verified(tmp_path):
    path = job(tmp_path, {"script": "train.py"})
    r = launch("plan", path, env=state_env(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "not verified: own code" in r.stdout
    r = launch("verify", path, "--json", env=state_env(tmp_path))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["verdict"] == "not verified: own code" and out["traced"] is False
    r = launch("verify", path, env=state_env(tmp_path))
    assert r.returncode == 0 and r.stdout.strip().count("\n") == 0 and "not verified: own code" in r.stdout


def test_benchmark_refuses_own_code(tmp_path):
    r = launch("plan", job(tmp_path, {"script": "train.py"}), "--benchmark", "2", env=state_env(tmp_path))
    assert r.returncode == 2 and r.stderr.startswith("error: --benchmark:") and "train.entrypoint" in r.stderr


def test_a_plan_made_for_the_job_may_change_the_entrypoint(tmp_path):
    """--plan compares what decides the layout: the entrypoint only says what code runs."""
    path = job(tmp_path, {"script": "a.py"})
    r = launch("plan", path, "-o", tmp_path / "plan.json", env=state_env(tmp_path))
    assert r.returncode == 0, r.stderr
    other = job(tmp_path, {"script": "b.py", "args": ["--x"]})
    r = launch("render", other, "--plan", tmp_path / "plan.json", "--backend", "slurm", "-o", tmp_path / "out",
               env=state_env(tmp_path), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"{(tmp_path / 'b.py').resolve()} --x &" in (tmp_path / "out" / "train.sbatch").read_text()
