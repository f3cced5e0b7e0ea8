"""The gate's init container, run: the rendered TrainJob's `groupprobe` command executed as the two pods
of the tiny 2-node CPU plan would run it, one bash per pod on this machine, with what Kubernetes would
give each pod: the container's rendered env, the Indexed Job's JOB_COMPLETION_INDEX, the node name
(downward API), the ConfigMap's files where /etc/launch4d is mounted and the run-dir volume where
/workspace/runs is. Only the head pod's address differs: Trainer's PET_MASTER_ADDR (which the command
honours first) is 127.0.0.1 here instead of the JobSet's DNS name. The plan's assumed bandwidths are 0.5
MB/s (gloo on loopback is far faster); then rank 3's all-gathers are delayed by 0.5 s in its own process
(tests/integration/test_preflight_plan.py's sitecustomize), and both pods fail with the slow group named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from checks.groupprobe.worker import RESULT_MARKER
from launcher.plan.planner import plan_job
from launcher.plan.spec import spec_from_dict
from launcher.render.k8s import render_k8s
from tests.conftest import EXAMPLES, REPO
from tests.integration.test_preflight_plan import SLOW_SITE
from tests.job_helpers import free_port
from tests.plan_helpers import chosen

pytestmark = [pytest.mark.integration, pytest.mark.slow]
NODES = ["gpu-a", "gpu-b"]


@pytest.fixture(scope="module")
def gate(tmp_path_factory):
    """The rendered init container (command, env) and the ConfigMap's files, for a slow-cluster plan."""
    d = yaml.safe_load((EXAMPLES / "tiny-k8s.yaml").read_text())
    d["diagnostics"].pop("socket_ifname")                # loopback here, not the pods' eth0
    spec = spec_from_dict(d, source="job.yaml")
    plan = chosen(plan_job(spec))
    plan.bandwidth.update(intra_gbs=5e-4, net_per_gpu_gbs=5e-4, source="test: a slow cluster")
    r = render_k8s(spec, plan, preflight_plan=0.3)
    cm, rt, _ = [x for x in yaml.safe_load_all(r.files["manifest.yaml"]) if x]
    (rj,) = rt["spec"]["template"]["spec"]["replicatedJobs"]
    (init,) = rj["template"]["spec"]["template"]["spec"]["initContainers"]
    assert json.loads(cm["data"]["preflight-plan.spec.json"])["groups"][0]["assumed_busbw_gbs"] == pytest.approx(5e-4)
    return init, cm["data"]


def run_pods(gate, root: Path, slow_rank: int | None = None) -> list[subprocess.CompletedProcess]:
    init, files = gate
    etc, runs, fake_bin = root / "etc", root / "runs", root / "bin"
    for folder in (etc, runs, fake_bin):
        folder.mkdir(parents=True)
    for name, text in files.items():
        (etc / name).write_text(text)
    (fake_bin / "python").write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")   # the image's python
    (fake_bin / "python").chmod(0o755)

    def here(text: str) -> str:
        return text.replace("/etc/launch4d", str(etc)).replace("/workspace/runs", str(runs))

    port = free_port()
    procs = []
    for i, node in enumerate(NODES):
        script = here(init["command"][2]).replace("/dev/termination-log", str(root / f"termination-log.{i}"))
        env = {"PATH": f"{fake_bin}:/usr/bin:/bin", "HOME": str(root), "OMP_NUM_THREADS": "1",
               **{e["name"]: here(e["value"]) for e in init["env"] if "value" in e},
               "LAUNCH4D_NODE_NAME": node, "JOB_COMPLETION_INDEX": str(i),
               "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port - 1), "PYTHONPATH": str(REPO)}
        if slow_rank is not None:
            site = root / "site"
            site.mkdir(exist_ok=True)
            (site / "sitecustomize.py").write_text(SLOW_SITE)
            env.update(PYTHONPATH=f"{site}:{REPO}", L4D_SLOW_RANK=str(slow_rank), L4D_SLOW_S="0.5")
        procs.append(subprocess.Popen(["bash", "-c", script], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, cwd=root))
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def test_both_pods_measure_the_gang_and_the_trainer_finds_the_result(gate, tmp_path):
    pods = run_pods(gate, tmp_path)
    for i, p in enumerate(pods):
        assert p.returncode == 0, f"pod {i}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        assert "launch4d-check gpu-a ok" in p.stdout and "launch4d-check gpu-b ok" in p.stdout
        # the result on the pod's log too: the run dir may go with the pods
        (line,) = [ln for ln in p.stdout.splitlines() if ln.startswith(RESULT_MARKER)]
        assert len(json.loads(line[len(RESULT_MARKER):])["groups"]) == 4
        assert (tmp_path / f"termination-log.{i}").read_text() == ""
    measured = json.loads((tmp_path / "runs" / "tiny-k8s" / "preflight-plan.json").read_text())
    assert {(g["kind"], tuple(g["hosts"])) for g in measured["groups"]} == {
        ("tp", ("gpu-a", "gpu-a")), ("tp", ("gpu-b", "gpu-b")), ("dp", ("gpu-a", "gpu-b"))}
    assert all(g["measured_s"] > 0 and g["ratio"] > 1 for g in measured["groups"])
    assert (tmp_path / "runs" / "tiny-k8s" / "logs" / "preflight-plan.log").is_file()


def test_a_slowed_group_fails_every_pod_naming_the_group_and_its_node(gate, tmp_path):
    pods = run_pods(gate, tmp_path, slow_rank=3)
    for i, p in enumerate(pods):
        assert p.returncode == 1, f"pod {i}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"   # the pod failure policy's code
        assert "launch4d-check gpu-a ok" in p.stdout
        fail = next(ln for ln in p.stdout.splitlines() if ln.startswith("launch4d-check gpu-b FAIL"))
        assert "plan preflight: TP group 1, ranks 2,3 on gpu-b (intra-node): all_gather" in fail
        assert (tmp_path / f"termination-log.{i}").read_text().strip() == fail     # the pod's status message
        assert "the job fails: keep the node(s) named above out" in p.stderr
    measured = json.loads((tmp_path / "runs" / "tiny-k8s" / "preflight-plan.json").read_text())
    slow = [(g["kind"], g["ranks"]) for g in measured["groups"] if g["ratio"] < 0.7]
    assert slow == [("tp", [2, 3])]

