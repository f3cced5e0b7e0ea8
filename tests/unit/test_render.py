"""Rendering: the sbatch script and the PyTorchJob manifest, from a job file through the planner.

No scheduler here: the script is checked with `bash -n`, its per-node logic is run in bash with
stub `srun`/`scontrol`/python, and the manifest is checked against the PyTorchJob CRD's own
OpenAPI schema (../shared/specs, skipped where absent) and the kubernetes client's models.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from launcher.cli import cli
from launcher.errors import UserError
from launcher.plan.planner import plan_job
from launcher.plan.spec import load_spec, spec_from_dict
from launcher.render import check_k8s_name
from launcher.render.k8s import render_k8s
from launcher.render.sbatch import render_slurm
from tests.cli_helpers import invoke
from tests.conftest import EXAMPLES, spec_file
from tests.plan_helpers import chosen

pytestmark = pytest.mark.unit


def job_dict(**over) -> dict:
    d = yaml.safe_load((EXAMPLES / "tiny-slurm.yaml").read_text())
    for key, value in over.items():
        node = d
        *path, last = key.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[last] = value
    return d


def spec_plan(**over):
    spec = spec_from_dict(job_dict(**over), source="job.yaml")
    return spec, chosen(plan_job(spec))


def cli_run(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


# --- Slurm ------------------------------------------------------------------------------------
def test_sbatch_has_the_directives_and_static_rendezvous(tmp_path):
    spec, plan = spec_plan(**{"backend.slurm.account": "proj1", "backend.slurm.qos": "high",
                              "backend.slurm.switches": 1, "backend.slurm.dependency": "afterok:123",
                              "backend.slurm.mem": "0", "backend.slurm.cpus_per_task": 16,
                              "backend.slurm.exclude": ["bad01"]})
    r = render_slurm(spec, plan, str(tmp_path / "run"), exclude=["bad02"])
    s = r.files["train.sbatch"]
    for line in ("--job-name=tiny-slurm", "--nodes=2", "--ntasks-per-node=1",
                 "--cpus-per-task=16", "--mem=0", "--time=00:20:00", "--partition=debug", "--account=proj1",
                 "--qos=high", "--exclusive", "--requeue", "--signal=B:USR2@60", "--open-mode=append",
                 "--switches=1", "--exclude=bad01,bad02", "--dependency=afterok:123",
                 f"--output={tmp_path}/run/logs/slurm-%j.out", f"--error={tmp_path}/run/logs/slurm-%j.err"):
        assert f"#SBATCH {line}\n" in s, line
    assert "--rdzv-backend=static" in s and 'node-rank="$node_rank"' in s and "--rdzv-backend=c10d" not in s
    assert "--kill-on-bad-exit=1" in s
    assert (f"-m launcher.trainer --plan {tmp_path}/run/plan.json --run-dir {tmp_path}/run --resume auto "
            "--init-timeout-s 120 --step-timeout-s 120 &") in s
    assert "scontrol requeue" in s and "trap on_checkpoint_signal USR2" in s and "USR1" not in s
    assert f"export NCCL_DEBUG_FILE={tmp_path}/run/logs/nccl/%h.%p.log" in s
    assert "export NCCL_DEBUG=INFO" in s and "export TORCH_NCCL_DUMP_ON_TIMEOUT=1" in s
    assert f"export TORCH_NCCL_DEBUG_INFO_TEMP_FILE={tmp_path}/run/logs/flight/rank_" in s
    assert json.loads(r.files["plan.json"])["world_size"] == 4
    assert subprocess.run(["bash", "-n"], input=s, text=True).returncode == 0


def test_same_input_same_bytes(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(job_dict()))
    outs = []
    for _ in range(2):
        res = cli_run("render", str(job), "-o", str(tmp_path / "out"), "--json")
        assert res.exit_code == 0, res.output
        outs.append({p.name: p.read_bytes() for p in sorted((tmp_path / "out").iterdir()) if p.is_file()})
    assert outs[0] == outs[1]
    assert set(outs[0]) == {"train.sbatch", "plan.json", "job.yaml"}
    assert os.access(tmp_path / "out" / "train.sbatch", os.X_OK)


def test_gpus_are_requested_for_gpu_plans_only(tmp_path):
    """examples/tiny-slurm.yaml (gpu: cpu) asks Slurm for no GPUs; the same job on GPUs asks for them."""
    spec, plan = spec_plan()
    assert "--gpus-per-node" not in render_slurm(spec, plan, str(tmp_path)).files["train.sbatch"]
    spec, plan = spec_plan(**{"cluster.gpu": "h100-sxm"})
    assert "#SBATCH --gpus-per-node=2\n" in render_slurm(spec, plan, str(tmp_path)).files["train.sbatch"]


def test_no_requeue_and_container_and_no_gres(tmp_path):
    spec, plan = spec_plan(**{"backend.slurm.requeue": False, "backend.slurm.gres_gpus": False, "cluster.gpu": "h100-sxm",
                              "backend.slurm.container_image": "nvcr.io#nvidia/pytorch:25.01-py3",
                              "backend.slurm.container_mounts": ["/data:/data", "/scratch:/scratch"]})
    s = render_slurm(spec, plan, str(tmp_path)).files["train.sbatch"]
    assert "#SBATCH --no-requeue" in s and "--signal" not in s and "scontrol requeue" not in s
    assert "--gpus-per-node" not in s
    assert "--container-image=" + shlex.quote("nvcr.io#nvidia/pytorch:25.01-py3") in s
    assert "--container-mounts=/data:/data,/scratch:/scratch" in s
    assert f"--container-workdir={tmp_path}" in s


def test_user_values_reaching_the_shell_are_quoted(tmp_path):
    evil = "a b; $(touch PWNED) `touch PWNED2` 'q' \"d\""
    spec, plan = spec_plan(**{"backend.env": {"EVIL": evil}})
    run_dir = str(tmp_path / "dir with space")
    with pytest.raises(UserError, match="#SBATCH"):
        render_slurm(spec, plan, run_dir)  # a run dir with a space cannot go on an #SBATCH line
    s = render_slurm(spec, plan, str(tmp_path / "run")).files["train.sbatch"]
    line = next(ln for ln in s.splitlines() if ln.startswith("export EVIL="))
    out = subprocess.run(["bash", "-c", f'{line}; printf %s "$EVIL"'], cwd=tmp_path, capture_output=True,
                         text=True)
    assert out.stdout == evil
    assert not (tmp_path / "PWNED").exists() and not (tmp_path / "PWNED2").exists()


@pytest.mark.parametrize("field,value", [("backend.slurm.partition", "debug;rm -rf /"), ("name", "my job"),
                                         ("backend.slurm.account", "a b"),
                                         ("backend.slurm.time", "1:00\n#SBATCH --uid=0")])
def test_unsafe_sbatch_values_are_refused(field, value, tmp_path):
    """Refused by the job-file loader (names, control characters) or by the renderer (the rest)."""
    with pytest.raises(UserError, match=rf"^{re.escape(field)}: .*(cannot go on an #SBATCH line|not a valid job "
                                        "name|control character)"):
        spec, plan = spec_plan(**{field: value})
        render_slurm(spec, plan, str(tmp_path))


def test_secret_looking_env_is_never_rendered(tmp_path):
    spec, plan = spec_plan(**{"backend.env": {"WANDB_API_KEY": "s3cr3t"}})
    with pytest.raises(UserError, match="looks like a secret"):
        render_slurm(spec, plan, str(tmp_path))
    with pytest.raises(UserError, match="looks like a secret"):
        render_k8s(spec, plan)


def _run_node_logic(script: str, tmp_path: Path, nodes: list[tuple[str, int]]) -> list[str]:
    """Run the batch script with stub srun/scontrol/python: srun runs the per-node function once per
    (SLURMD_NODENAME, SLURM_NODEID); the python stub prints the torchrun arguments it got."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = " ".join(f"{n}:{i}" for n, i in nodes)
    (bin_dir / "srun").write_text(
        "#!/bin/bash\nwhile [[ \"$1\" == --* ]]; do shift; done\nfor ni in " + calls
        + "; do SLURMD_NODENAME=${ni%%:*} SLURM_NODEID=${ni##*:} \"$@\"; done\n")
    (bin_dir / "scontrol").write_text(
        "#!/bin/bash\nif [ \"$1 $2\" = 'show hostnames' ]; then echo " + " ".join(sorted(n for n, _ in nodes))
        + "; else echo \"NodeName=$3 Arch=x NodeAddr=10.0.0.$((${#3})) NodeHostName=$3\"; fi\n")
    (bin_dir / "fakepython").write_text(
        "#!/bin/bash\necho \"RUN $SLURMD_NODENAME CVD=$CUDA_VISIBLE_DEVICES MASTER=$MASTER_ADDR:$MASTER_PORT $* "
        "LDLP=${LD_LIBRARY_PATH-unset} PYP=${PYTHONPATH-unset}\"\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    script = script.replace(shlex.quote("python3") + " -m", str(bin_dir / "fakepython") + " -m")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "nodes"}
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return [ln for ln in out.stdout.splitlines() if ln.startswith("RUN ")]


def test_library_and_module_paths_reach_the_trainer_only(tmp_path):
    """backend.env's LD_LIBRARY_PATH / PYTHONPATH (allowed on purpose, for containers) are given to the
    trainer's command, never exported in the batch script or the pods' shell (issue 23)."""
    libs, mods = "/opt/site lib/$(touch PWNED)", "/opt/mods"
    spec, plan = spec_plan(**{"backend.env": {"LD_LIBRARY_PATH": libs, "PYTHONPATH": mods, "OMP_NUM_THREADS": "2"}})
    s = render_slurm(spec, plan, str(tmp_path / "run")).files["train.sbatch"]
    assert "export OMP_NUM_THREADS=2" in s
    assert not re.search(r"^\s*export (LD_LIBRARY_PATH|PYTHONPATH)", s, re.M)
    runs = _run_node_logic(s, tmp_path, [("n1", 0), ("n2", 1)])
    assert len(runs) == 2 and all(ln.endswith(f"LDLP={libs} PYP={mods}") for ln in runs)
    assert not (tmp_path / "PWNED").exists()
    k8s_spec, k8s_plan = spec_plan(**{"backend.env": {"LD_LIBRARY_PATH": libs, "PYTHONPATH": mods},
                                      "backend.k8s": {"api": "pytorchjob", "image": "ghcr.io/example/launch4d:0.1.0"}})
    docs = [d for d in yaml.safe_load_all(render_k8s(k8s_spec, k8s_plan).files["manifest.yaml"]) if d]
    for rs in docs[-1]["spec"]["pytorchReplicaSpecs"].values():
        c = rs["template"]["spec"]["containers"][0]
        assert not {"LD_LIBRARY_PATH", "PYTHONPATH"} & {e["name"] for e in c["env"]}
        assert f"exec env LD_LIBRARY_PATH={shlex.quote(libs)} PYTHONPATH={mods} python -m torch" in c["command"][2]


def test_batch_script_stops_at_a_link_planted_in_the_run_dir(tmp_path):
    """A requeued job meets its run dir again: a symbolic link planted in it (a checkpoint's .tmp dir, a
    log) stops the job before anything writes through it (issue 23)."""
    rd = tmp_path / "run"
    (rd / "checkpoints").mkdir(parents=True)
    (rd / "checkpoints" / "step-2.tmp").symlink_to(tmp_path / "elsewhere")
    spec, plan = spec_plan()
    s = render_slurm(spec, plan, str(rd)).files["train.sbatch"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).write_text(f"#!/bin/bash\ntouch {tmp_path}/ran-{tool}\n")
        (bin_dir / tool).chmod(0o755)
    out = subprocess.run(["bash", "-c", s], env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
                                                 "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1"},
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 3 and "run dir holds a symbolic link" in out.stderr and "step-2.tmp" in out.stderr
    assert not list(tmp_path.glob("ran-*")) and not (tmp_path / "elsewhere").exists()
    assert sorted(p.name for p in rd.iterdir()) == ["checkpoints"]   # not even logs/ made


@pytest.mark.parametrize("array", [False, True])
def test_batch_script_replaces_a_link_planted_at_its_own_output(tmp_path, array):
    """slurmd opens --output/--error (logs/slurm-<job>.out/.err; an array task's under the array's base dir)
    before the script runs, through a link planted at that name: the script puts files of its own in the
    links' place before writing a line, says so there and stops (exit 3); the targets keep what they held."""
    rd = tmp_path / "run"
    spec, plan = spec_plan()
    s = render_slurm(spec, plan, str(rd)).files["train.sbatch"]
    logs = (tmp_path / "base" if array else rd) / "logs"
    logs.mkdir(parents=True)
    stem = logs / ("slurm-5_0" if array else "slurm-7")
    victims = {ext: tmp_path / f"victim{ext}" for ext in (".out", ".err")}
    for ext, victim in victims.items():
        victim.write_text("precious\n")
        Path(f"{stem}{ext}").symlink_to(victim)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("srun", "scontrol", "find"):
        (bin_dir / tool).write_text(f"#!/bin/bash\ntouch {tmp_path}/ran-{tool}\n")
        (bin_dir / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1"}
    if array:
        env["LAUNCH4D_SLURM_OUTPUT"] = str(stem)
    with open(victims[".out"], "ab") as out, open(victims[".err"], "ab") as err:   # what slurmd opened
        rc = subprocess.run(["bash", "-c", s], env=env, stdout=out, stderr=err, timeout=30).returncode
    assert rc == 3 and all(v.read_text() == "precious\n" for v in victims.values())
    assert not Path(f"{stem}.out").is_symlink() and not Path(f"{stem}.err").is_symlink()
    assert Path(f"{stem}.out").read_text() == "launch4d: step finished with exit code 3\n"
    assert "the job's output was a symbolic link" in Path(f"{stem}.err").read_text()
    assert f"{stem}.out -> {victims['.out']}" in Path(f"{stem}.err").read_text()
    assert not list(tmp_path.glob("ran-*"))


def test_array_script_names_each_tasks_output_for_its_link_check(tmp_path):
    from launcher.render.sbatch import render_slurm_array

    spec, plan = spec_plan()
    script, _ = render_slurm_array(spec, [plan, plan], str(tmp_path / "base"), [str(tmp_path / "t0"), str(tmp_path / "t1")])
    assert f"export LAUNCH4D_SLURM_OUTPUT={tmp_path}/base/logs/slurm-\"${{SLURM_ARRAY_JOB_ID}}_${{SLURM_ARRAY_TASK_ID}}\"" \
        in script
    assert f"#SBATCH --output={tmp_path}/base/logs/slurm-%A_%a.out" in script


def test_pod_command_stops_at_a_link_planted_in_the_run_dir(tmp_path):
    spec, plan = spec_plan(**{"backend.k8s": {"api": "pytorchjob", "image": "ghcr.io/example/launch4d:0.1.0"}})
    rendered = render_k8s(spec, plan)
    job = [d for d in yaml.safe_load_all(rendered.files["manifest.yaml"]) if d][-1]
    script = next(iter(job["spec"]["pytorchReplicaSpecs"].values()))["template"]["spec"]["containers"][0]["command"][2]
    rd = tmp_path / "run"
    (rd / "logs").mkdir(parents=True)
    (rd / "logs" / "node0.log").symlink_to(tmp_path / "elsewhere")
    out = subprocess.run(["bash", "-c", script.replace(rendered.run_dir, str(rd))], capture_output=True, text=True,
                         timeout=30, env={**os.environ, "PATH": f"{tmp_path}/nobin:/usr/bin:/bin"})
    assert out.returncode == 3 and "run dir holds a symbolic link" in out.stderr and "node0.log" in out.stderr
    assert sorted(p.name for p in rd.iterdir()) == ["logs"] and not (tmp_path / "elsewhere").exists()


def test_node_rank_follows_the_plans_hosts_not_slurms_order(tmp_path):
    spec, plan = spec_plan(**{"cluster.gpus_per_node": 4, "parallel.tp": 2})
    plan.hosts = ["nodeB", "nodeA"]              # the planner's order (e.g. from preflight)
    for r in plan.ranks:                          # an NVLink-pair GPU order inside each node
        r.gpu = [0, 2, 1, 3][r.local_rank]
    rd = str(tmp_path / "run")
    s = render_slurm(spec, plan, rd).files["train.sbatch"]
    assert "#SBATCH --nodelist" not in s                 # ordered at start, never pinned (requeue takes any node)
    runs = _run_node_logic(s, tmp_path, [("nodeA", 0), ("nodeB", 1)])   # Slurm sorts: nodeA gets id 0
    by_node = {ln.split()[1]: ln for ln in runs}
    assert "--node-rank=1" in by_node["nodeA"] and "--node-rank=0" in by_node["nodeB"]
    assert all("CVD=0,2,1,3" in ln for ln in runs)
    assert all("MASTER=10.0.0.5:24242" in ln for ln in runs)     # NodeAddr of nodeB, port from job id
    assert all("--nnodes=2 --nproc-per-node=4" in ln and "--rdzv-backend=static" in ln for ln in runs)


def test_without_plan_hosts_node_rank_is_slurm_nodeid(tmp_path):
    spec, plan = spec_plan()
    s = render_slurm(spec, plan, str(tmp_path / "run")).files["train.sbatch"]
    assert "#SBATCH --nodelist" not in s
    runs = _run_node_logic(s, tmp_path, [("n1", 0), ("n2", 1)])
    assert "--node-rank=0" in runs[0] and runs[0].split()[1] == "n1"
    assert "--node-rank=1" in runs[1] and "MASTER=10.0.0.2:" in runs[1]


def test_excluded_node_in_nodelist_is_refused(tmp_path):
    spec, plan = spec_plan(**{"backend.slurm.nodelist": ["a1", "a2"]})
    with pytest.raises(UserError, match="a2 also excluded"):
        render_slurm(spec, plan, str(tmp_path), exclude=["a2"])


def test_templates_override_file_by_file(tmp_path):
    over = tmp_path / "tpl" / "slurm"
    over.mkdir(parents=True)
    (over / "train.sbatch.j2").write_text("#!/bin/bash\n#SBATCH --job-name={{ name | sbatch }}\n"
                                          "echo site-specific {{ nodes }}\n")
    spec, plan = spec_plan(**{"backend.k8s": {"api": "pytorchjob", "image": "ghcr.io/example/launch4d:0.1.0"}})
    s = render_slurm(spec, plan, str(tmp_path), templates=tmp_path / "tpl").files["train.sbatch"]
    assert s == "#!/bin/bash\n#SBATCH --job-name=tiny-slurm\necho site-specific 2\n"
    k = render_k8s(spec, plan, templates=tmp_path / "tpl").files["manifest.yaml"]   # not overridden
    assert "kind: PyTorchJob" in k
    (over / "train.sbatch.j2").write_text("{{ no_such_variable }}\n")
    with pytest.raises(UserError, match="no_such_variable"):
        render_slurm(spec, plan, str(tmp_path), templates=tmp_path / "tpl")
    (over / "train.sbatch.j2").write_text("#!/bin/bash\nif then fi {{ nodes }}\n")
    with pytest.raises(UserError, match="does not parse"):
        render_slurm(spec, plan, str(tmp_path), templates=tmp_path / "tpl")


# --- Kubernetes -------------------------------------------------------------------------------
def crd_validator():
    jsonschema = pytest.importorskip("jsonschema")
    crd = yaml.safe_load(spec_file("kubeflow.org_pytorchjobs.yaml").read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return jsonschema.Draft7Validator(version["schema"]["openAPIV3Schema"])


def k8s_docs(**over):
    d = yaml.safe_load((EXAMPLES / "tiny-k8s-pytorchjob.yaml").read_text())
    for key, value in over.items():
        node = d
        *path, last = key.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[last] = value
    spec = spec_from_dict(d, source="job.yaml")
    plan = chosen(plan_job(spec))
    text = render_k8s(spec, plan).files["manifest.yaml"]
    return spec, plan, text, list(yaml.safe_load_all(text))


def test_pytorchjob_matches_the_crd_schema_and_the_issue():
    validator = crd_validator()
    spec, plan, text, (cm, job) = k8s_docs()
    errors = sorted(validator.iter_errors(job), key=lambda e: list(e.path))
    assert not errors, [f"{list(e.path)}: {e.message}" for e in errors]
    s = job["spec"]
    assert s["nprocPerNode"] == "2"
    assert s["runPolicy"]["schedulingPolicy"] == {"minAvailable": 2, "queue": "default",
                                                  "priorityClass": "high-priority"}
    assert s["runPolicy"]["cleanPodPolicy"] == "Running" and s["runPolicy"]["backoffLimit"] == 2
    assert s["runPolicy"]["ttlSecondsAfterFinished"] == 86400
    reps = s["pytorchReplicaSpecs"]
    assert reps["Master"]["replicas"] == 1 and reps["Worker"]["replicas"] == 1
    for rs in reps.values():
        pod = rs["template"]["spec"]
        (c,) = pod["containers"]
        assert c["name"] == "pytorch"
        assert c["resources"]["limits"] == {"nvidia.com/gpu": "2", "rdma/rdma_shared_device_a": "1"}
        assert pod["schedulerName"] == "volcano" and pod["priorityClassName"] == "high-priority"
        assert pod["imagePullSecrets"] == [{"name": "regcred"}]
        assert c["envFrom"] == [{"secretRef": {"name": "wandb-credentials"}}]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
        assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
        anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
        assert anti["topologyKey"] == "kubernetes.io/hostname"
        assert anti["labelSelector"]["matchLabels"] == {"launch4d/job": "tiny-k8s"}
        vols = {v["name"]: v for v in pod["volumes"]}
        assert vols["dshm"]["emptyDir"]["medium"] == "Memory"
        assert vols["plan"]["configMap"]["name"] == cm["metadata"]["name"] == "tiny-k8s-plan"
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert mounts == {"dshm": "/dev/shm", "plan": "/etc/launch4d"}
        env = {e["name"]: e["value"] for e in c["env"]}
        assert env["NCCL_DEBUG_FILE"] == "/workspace/runs/tiny-k8s/logs/nccl/%h.%p.log"
        assert env["NCCL_SOCKET_IFNAME"] == "eth0"
        script = c["command"][2]
        assert "--rdzv-backend=static" in script and "--plan /etc/launch4d/plan.json" in script
        assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    assert json.loads(cm["data"]["plan.json"]) == json.loads(plan.to_json())


def test_single_node_job_has_no_worker_replicas():
    validator = crd_validator()
    _, _, _, (_, job) = k8s_docs(**{"cluster.nodes": 1, "cluster.gpus_per_node": 4})
    assert not list(validator.iter_errors(job))
    assert set(job["spec"]["pytorchReplicaSpecs"]) == {"Master"}   # Worker replicas 0 would still make a pod


def test_pod_templates_pass_the_kubernetes_client_models():
    from launcher.render.k8s import to_model

    _, _, _, (cm, job) = k8s_docs()
    pod = to_model(job["spec"]["pytorchReplicaSpecs"]["Master"]["template"], "V1PodTemplateSpec")
    assert pod.spec.containers[0].name == "pytorch"
    bad = json.loads(json.dumps(job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]))
    bad["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = {"x": 1}
    with pytest.raises(UserError, match="invalid"):
        to_model(bad, "V1PodTemplateSpec")


def test_no_secret_value_in_the_manifest():
    _, _, text, _ = k8s_docs()
    assert "wandb-credentials" in text and "regcred" in text    # referenced by name only
    assert "kind: Secret" not in text and "stringData" not in text


@pytest.mark.parametrize("name", ["Tiny_Job", "-tiny", "tiny.job", "x" * 51])
def test_invalid_kubernetes_names(name, tmp_path):
    d = yaml.safe_load((EXAMPLES / "tiny-k8s-pytorchjob.yaml").read_text())
    d["name"] = name
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(d))
    res = invoke("render", str(job), "-o", str(tmp_path / "out"))
    assert res.exit_code == 2
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: name:")
    assert "RFC 1123" in lines[0] or "not a valid job name" in lines[0]
    assert not (tmp_path / "out").exists()


def test_check_k8s_name():
    assert check_k8s_name("tiny-k8s-0") == "tiny-k8s-0"
    with pytest.raises(UserError):
        check_k8s_name("UPPER")


def test_render_cli_human_and_json(tmp_path):
    res = cli_run("render", str(EXAMPLES / "tiny-k8s-pytorchjob.yaml"), "-o", str(tmp_path / "k"))
    assert res.exit_code == 0 and "kind: PyTorchJob" in res.output
    assert {p.name for p in (tmp_path / "k").iterdir() if p.is_file()} == {"manifest.yaml", "plan.json", "job.yaml"}
    res = cli_run("render", str(EXAMPLES / "tiny-slurm.yaml"), "--json")
    data = json.loads(res.output)
    assert data["backend"] == "slurm" and data["written"] == []
    assert re.search(r"^#SBATCH --nodes=2$", data["files"]["train.sbatch"], re.M)


def test_examples_load():
    for name in ("tiny-slurm.yaml", "tiny-k8s.yaml", "tiny-k8s-pytorchjob.yaml"):
        assert load_spec(EXAMPLES / name).backend.kind in ("slurm", "k8s")


def test_interface_hints_measured_or_given(tmp_path):
    spec, plan = spec_plan()
    for r in plan.ranks:
        r.nic = f"mlx5_{r.local_rank}"
    s = render_slurm(spec, plan, str(tmp_path)).files["train.sbatch"]
    assert "export NCCL_IB_HCA==mlx5_0,mlx5_1\n" in s and "NCCL_SOCKET_IFNAME" not in s
    spec, _ = spec_plan(**{"diagnostics.ib_hca": "^mlx5_bond0", "diagnostics.socket_ifname": "^lo,docker"})
    s = render_slurm(spec, plan, str(tmp_path)).files["train.sbatch"]
    assert f"export NCCL_IB_HCA={shlex.quote('^mlx5_bond0')}\n" in s
    assert f"export NCCL_SOCKET_IFNAME={shlex.quote('^lo,docker')}\n" in s


def test_preflight_exclude_list_reaches_sbatch(tmp_path):
    from launcher.formats.bwmap import BandwidthMap, NodeReport

    bw = BandwidthMap(nodes={h: NodeReport(host=h, gpus=2) for h in ("a1", "a2", "a3")}, exclude=["a2"])
    (tmp_path / "bw.json").write_text(json.dumps(bw.to_dict()))
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(job_dict()))
    res = cli_run("render", str(job), "--preflight", str(tmp_path / "bw.json"), "--json")
    assert res.exit_code == 0, res.output
    s = json.loads(res.output)["files"]["train.sbatch"]
    assert "#SBATCH --exclude=a2\n" in s
    assert "#SBATCH --nodelist" not in s and "node_order=( a1 a3 )" in s


def test_submit_dry_run_writes_and_records_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("LAUNCH4D_STATE", str(tmp_path / "state"))
    d = job_dict(**{"backend.log_dir": str(tmp_path / "runs")})
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(d))
    res = cli_run("submit", str(job), "--dry-run", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["dry_run"] and out["id"] == "dry-run"
    assert out["request"].startswith(f"cd {tmp_path}/runs/tiny-slurm-") and "sbatch --parsable train.sbatch" in out["request"]
    assert "#SBATCH --nodes=2" in out["request"]
    assert not (tmp_path / "runs").exists() and not (tmp_path / "state").exists()


# --- one artefact from plan to launch: render/submit take a plan.json ------------------------------
def _alternative_plan(tmp_path) -> tuple[Path, Path, dict]:
    """A job file with `parallel: auto`, and a plan.json of a layout the planner does NOT pick first (its
    first alternative): rendering it must launch that layout, not re-plan the job."""
    d = job_dict(parallel="auto")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(d))
    spec = spec_from_dict(d, source=str(job))
    result = plan_job(spec, top=1, ranks_for=2)
    alt = result.alternatives[0]
    assert alt.degrees != chosen(result).degrees and len(alt.ranks) == alt.world_size
    alt.save(tmp_path / "plan.json")
    return job, tmp_path / "plan.json", alt.to_dict()


def test_render_and_submit_take_a_plan_json_as_it_is(tmp_path, monkeypatch):
    monkeypatch.setenv("LAUNCH4D_STATE", str(tmp_path / "state"))
    job, plan_file, alt = _alternative_plan(tmp_path)
    for args in (["render", str(plan_file)], ["render", str(job), "--plan", str(plan_file)]):
        res = cli_run(*args, "-o", str(tmp_path / args[-1].replace("/", "_")), "--json")
        assert res.exit_code == 0, res.output
        out = json.loads(res.stdout)
        written = json.loads(out["files"]["plan.json"])
        assert written["layout"] == alt["layout"] and written["ranks"] == alt["ranks"]
        assert written["stage_layers"] == alt["stage_layers"]
        assert "not re-planned" in res.stderr
    assert "rendered from plan.json" in json.loads(cli_run("render", str(plan_file), "--json").stdout)["files"][
        "train.sbatch"]
    # the run dir's job.yaml is a job file that says the same job, its layout fixed
    assert cli_run("render", str(plan_file), "-o", str(tmp_path / "o")).exit_code == 0
    again = spec_from_dict(yaml.safe_load((tmp_path / "o" / "job.yaml").read_text()))
    assert (again.parallel.tp, again.parallel.cp, again.parallel.dp) == (alt["layout"]["tp"], alt["layout"]["cp"],
                                                                         alt["layout"]["dp"])
    res = cli_run("submit", str(plan_file), "--dry-run", "--json")
    assert res.exit_code == 0, res.output
    req = json.loads(res.stdout)
    assert json.loads(req["files"]["plan.json"])["layout"] == alt["layout"]
    assert not (tmp_path / "state").exists()


def test_a_plan_made_for_another_job_is_refused_with_the_first_difference(tmp_path):
    job, plan_file, _ = _alternative_plan(tmp_path)
    other = tmp_path / "other.yaml"
    other.write_text(job.read_text().replace("seq_len: 64", "seq_len: 128"))
    for cmd in ("render", "submit", "verify"):
        res = cli_run(cmd, str(other), "--plan", str(plan_file))
        assert res.exit_code == 2
        assert res.stderr.startswith(f"error: --plan: {plan_file} was not made for {other}: train.seq_len: the job "
                                     "file has 128, the plan 64") and len(res.stderr.splitlines()) == 1
    res = cli_run("render", str(plan_file), "--plan", str(plan_file))
    assert res.exit_code == 2 and "is a plan.json already" in res.stderr
    res = cli_run("render", str(plan_file), "--preflight", str(plan_file))
    assert res.exit_code == 2 and res.stderr.startswith("error: --preflight: ")


def test_an_older_plan_without_its_cluster_and_backend_sections(tmp_path):
    """A plan.json written before plans carried the job's cluster and backend sections still launches:
    the backend is then the default (local), so render needs --backend."""
    _, plan_file, alt = _alternative_plan(tmp_path)
    data = json.loads(plan_file.read_text())
    del data["cluster"], data["backend"]
    plan_file.write_text(json.dumps(data))
    res = cli_run("render", str(plan_file))
    assert res.exit_code == 2 and "give --backend slurm|k8s" in res.stderr
    res = cli_run("render", str(plan_file), "--backend", "slurm", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(json.loads(res.stdout)["files"]["plan.json"])["layout"] == alt["layout"]
    data["world_size"] = 8                               # a hand-edited plan that contradicts itself
    plan_file.write_text(json.dumps(data))
    res = cli_run("render", str(plan_file), "--backend", "slurm")
    assert res.exit_code == 2 and "world_size" in res.stderr


def test_a_queued_trainjob_gives_its_pods_no_priority_class():
    """examples/tiny-k8s.yaml is queued by Kueue with priority_class: that names a WorkloadPriorityClass
    (the TrainJob's label), never the pods' priorityClassName, though the job renders its own runtime."""
    spec = load_spec(EXAMPLES / "tiny-k8s.yaml")
    docs = list(yaml.safe_load_all(render_k8s(spec, chosen(plan_job(spec)), "/tmp/x").files["manifest.yaml"]))
    train = next(d for d in docs if d["kind"] == "TrainJob")
    assert train["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "high-priority"
    runtime = next(d for d in docs if d["kind"] == "TrainingRuntime")
    assert "priorityClassName" not in json.dumps(runtime) and "priorityClassName" not in json.dumps(train)
    d = job_dict(**{"backend.kind": "k8s", "backend.k8s.image": "img:1", "backend.k8s.priority_class": "high"})
    s2 = spec_from_dict(d)                             # not queued: the pods' priorityClassName, in its own runtime
    docs = list(yaml.safe_load_all(render_k8s(s2, chosen(plan_job(s2)), "/tmp/x").files["manifest.yaml"]))
    runtime = next(d for d in docs if d["kind"] == "TrainingRuntime")
    assert '"priorityClassName": "high"' in json.dumps(runtime)
