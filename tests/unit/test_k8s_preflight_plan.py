"""The plan preflight on Kubernetes, where no API server can run here: the gate (`launch submit
--preflight-plan`) as an init container of every pod of the gang, checked against the published CRDs
(/work/shared/specs: Trainer v2.3.0 with JobSet v0.12.0, kubeflow.org/v1 PyTorchJob) and the kubernetes
client's models; its shell derives the node rank and the trainer's rendezvous as the pods will (bash
on the rendered text); and `launch preflight --plan --backend k8s` as a one-off gang of pods through the
real kubernetes client over the recorded-response API of tests/unit/test_k8s_backend.py. The probe itself
running inside those pods is tests/integration/test_k8s_preflight_plan_run.py."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import zlib
from urllib.parse import parse_qs, urlparse

import pytest
import yaml

from launcher.backends.k8s_crd import load_crd, validate
from launcher.plan.commgroups import probe_spec
from launcher.plan.model import Plan
from launcher.plan.planner import plan_job
from launcher.plan.spec import spec_from_dict
from launcher.render.k8s import render_k8s
from tests.cli_helpers import invoke, run_main
from tests.conftest import EXAMPLES, spec_file
from tests.plan_helpers import chosen
from tests.unit.test_k8s_backend import CMS, NS, PODS, echo_created, install_fake, one_error_line, status_obj

pytestmark = pytest.mark.unit
pytest.importorskip("jsonschema")

SVCS = f"/api/v1/namespaces/{NS}/services"
PJOBS = f"/apis/kubeflow.org/v1/namespaces/{NS}/pytorchjobs"


def crd(name: str) -> dict:
    return load_crd(spec_file(name))


def render(api: str = "trainjob", tolerance: float = 0.3, **k8s):
    d = yaml.safe_load((EXAMPLES / "tiny-k8s.yaml").read_text())
    d["backend"]["k8s"].update(api=api, **k8s)
    d["backend"]["k8s"] = {k: v for k, v in d["backend"]["k8s"].items() if v is not None}
    spec = spec_from_dict(d, source="job.yaml")
    plan = chosen(plan_job(spec))
    assert plan is not None
    r = render_k8s(spec, plan, preflight_plan=tolerance)
    return plan, r, [x for x in yaml.safe_load_all(r.files["manifest.yaml"]) if x]


def runtime_pod(rt: dict) -> tuple[dict, dict]:
    (rj,) = rt["spec"]["template"]["spec"]["replicatedJobs"]
    return rj["template"]["spec"], rj["template"]["spec"]["template"]["spec"]


def patch_pod(tj: dict) -> dict:
    (rj,) = tj["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    return rj["template"]["spec"]["template"]["spec"]


def head(script: str) -> str:
    """The init container's command up to the probe: what decides the node rank and the rendezvous."""
    return script.split("\nif [ -n \"${LAUNCH4D_GPU_LISTS", 1)[0] + '\nprintf "%s %s %s" "$node_rank" "$master_addr" "$port"'


def sh(script: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script], env={"PATH": "/usr/bin:/bin", **env}, capture_output=True, text=True)


# --- the gate, rendered ----------------------------------------------------------------------------
def test_trainjob_gate_is_an_init_container_of_every_pod_in_its_own_runtime():
    plan, r, (cm, rt, tj) = render(max_restarts=None, env_from_secrets=None, queue=None, priority_class=None)
    assert validate(rt, crd("trainer.kubeflow.org_trainingruntimes.yaml")) == []
    assert validate(tj, crd("trainer.kubeflow.org_trainjobs.yaml")) == []
    # a runtimePatches entry may only amend an init container: the gate brings its own runtime
    assert tj["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "TrainingRuntime",
                                        "name": "tiny-k8s-runtime"}
    job, pod = runtime_pod(rt)
    (init,) = pod["initContainers"]
    assert init["name"] == "groupprobe" and init["image"] == tj["spec"]["trainer"]["image"]
    assert init["resources"] == tj["spec"]["trainer"]["resourcesPerNode"]      # the node's GPUs and NIC
    env = {e["name"]: e for e in init["env"]}
    assert env["LAUNCH4D_NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    trainer_env = {e["name"]: e["value"] for e in tj["spec"]["trainer"]["env"]}
    assert {k: env[k]["value"] for k in trainer_env} == trainer_env           # NCCL/gloo settings as the trainer's
    mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    assert mounts == {"dshm": "/dev/shm", "plan": "/etc/launch4d", "runs": "/workspace/runs"}
    # the volumes it mounts are the pods' (from the patch), the run dir one the trainer mounts too
    patch = patch_pod(tj)
    assert set(mounts) <= {v["name"] for v in patch["volumes"]}
    assert {m["name"] for m in patch["containers"][0]["volumeMounts"]} == set(mounts)
    # rendezvous before Ready; a slow group fails the JobSet instead of a gang restart onto the same nodes
    js = rt["spec"]["template"]["spec"]
    assert js["network"] == {"publishNotReadyAddresses": True}
    assert js["failurePolicy"]["rules"] == [{"name": "plan-preflight-slow", "action": "FailJobSet",
                                             "onJobFailureReasons": ["PodFailurePolicy"]}]
    assert job["podFailurePolicy"] == {"rules": [{"action": "FailJob", "onExitCodes": {
        "containerName": "groupprobe", "operator": "In", "values": [1]}}]}
    assert pod["restartPolicy"] == "Never" and job["backoffLimit"] == 0     # podFailurePolicy needs Never
    # the groups travel in the plan's ConfigMap, beside plan.json, and in the run dir's files
    spec = json.loads(cm["data"]["preflight-plan.spec.json"])
    want = probe_spec(plan, tolerance=0.3)
    assert [(g["kind"], g["ranks"]) for g in spec["groups"]] == [(g.kind, g.ranks) for g in want.groups]
    assert spec["tolerance"] == 0.3 and r.files["preflight-plan.spec.json"] == cm["data"]["preflight-plan.spec.json"]
    script = init["command"][2]
    assert init["command"][:2] == ["bash", "-c"] and sh(f"bash -n <<'EOF'\n{script}\nEOF").returncode == 0
    assert "-m checks.groupprobe.worker /etc/launch4d/preflight-plan.spec.json" in script
    assert "--every-node" in script and "--nnodes=2 --nproc-per-node=2" in script


def test_trainjob_gate_without_a_volume_gives_the_run_dir_one_the_trainer_reads():
    _, _, (_, rt, tj) = render(pvc=None)
    vols = {v["name"]: v for v in patch_pod(tj)["volumes"]}
    assert vols["runs"] == {"name": "runs", "emptyDir": {}}
    assert validate(tj, crd("trainer.kubeflow.org_trainjobs.yaml")) == []
    assert validate(rt, crd("trainer.kubeflow.org_trainingruntimes.yaml")) == []
    # every pod keeps its own copy then (no shared volume): none waits for node 0's
    script = runtime_pod(rt)[1]["initContainers"][0]["command"][2]
    assert "if true && [ -f \"$d/result.json\" ]" in script
    shared = runtime_pod(render()[2][1])[1]["initContainers"][0]["command"][2]
    assert "if [ \"$node_rank\" = 0 ] && [ -f \"$d/result.json\" ]" in shared


def test_trainjob_gate_node_rank_and_rendezvous_are_the_trainers():
    _, _, (_, rt, tj) = render()
    script = head(runtime_pod(rt)[1]["initContainers"][0]["command"][2])
    # the Indexed Job's index reaches init containers too; Trainer's PET_* wins where it sets them
    assert sh(script, JOB_COMPLETION_INDEX="1").stdout == "1 tiny-k8s-node-0-0.tiny-k8s 29401"
    assert sh(script, PET_NODE_RANK="0", PET_MASTER_ADDR="h", PET_MASTER_PORT="2000").stdout == "0 h 2001"
    assert "master_addr=${PET_MASTER_ADDR:-tiny-k8s-node-0-0.tiny-k8s}" in tj["spec"]["trainer"]["command"][2]
    res = sh(script)
    assert res.returncode == 3 and "this pod has no node rank" in res.stderr


def test_pytorchjob_gate_publishes_the_gang_before_it_is_ready():
    _, r, docs = render("pytorchjob", max_restarts=None, topology=None, restart_policy="ExitCode")
    cm, svc, job = docs
    assert [d["kind"] for d in docs] == ["ConfigMap", "Service", "PyTorchJob"]
    assert validate(job, crd("kubeflow.org_pytorchjobs.yaml")) == []
    assert svc["spec"] == {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": {"launch4d/job": "tiny-k8s"}}
    assert svc["metadata"]["name"] == "tiny-k8s-gang" and r.warnings == []
    roles = job["spec"]["pytorchReplicaSpecs"]
    scripts = {}
    for role, rs in roles.items():
        ps = rs["template"]["spec"]
        assert ps["subdomain"] == "tiny-k8s-gang"
        assert set(svc["spec"]["selector"].items()) <= set(rs["template"]["metadata"]["labels"].items())
        (init,) = ps["initContainers"]
        assert init["name"] == "groupprobe" and init["resources"] == ps["containers"][0]["resources"]
        scripts[role] = head(init["command"][2])
    assert sh(scripts["Master"]).stdout == "0 tiny-k8s-master-0.tiny-k8s-gang 23457"
    # a worker's node rank: the operator's replica-index label (downward API) + 1, as PET_NODE_RANK is
    worker_env = {e["name"]: e for e in roles["Worker"]["template"]["spec"]["initContainers"][0]["env"]}
    assert worker_env["LAUNCH4D_REPLICA_INDEX"]["valueFrom"] == {
        "fieldRef": {"fieldPath": "metadata.labels['training.kubeflow.org/replica-index']"}}
    assert sh(scripts["Worker"], LAUNCH4D_REPLICA_INDEX="0").stdout == "1 tiny-k8s-master-0.tiny-k8s-gang 23457"
    assert sh(scripts["Worker"]).returncode == 3
    _, r, _ = render("pytorchjob", max_restarts=None, topology=None)
    assert any("restart_policy OnFailure with --preflight-plan" in w for w in r.warnings)


def test_pytorchjob_gate_needs_a_name_that_can_be_a_service():
    d = yaml.safe_load((EXAMPLES / "tiny-k8s-pytorchjob.yaml").read_text())
    d["name"] = "7b-run"
    spec = spec_from_dict(d, source="job.yaml")
    from launcher.errors import UserError

    with pytest.raises(UserError, match="must start with a letter for --preflight-plan"):
        render_k8s(spec, chosen(plan_job(spec)), preflight_plan=0.3)


def test_without_the_gate_nothing_changes():
    d = yaml.safe_load((EXAMPLES / "tiny-k8s.yaml").read_text())
    spec = spec_from_dict(d, source="job.yaml")
    text = render_k8s(spec, chosen(plan_job(spec))).files["manifest.yaml"]
    assert "groupprobe" not in text and "preflight-plan" not in text and "publishNotReadyAddresses" not in text


def test_the_pods_verdict_exit_status_tells_slow_from_not_measured(tmp_path, capsys):
    """What the init container exits with: 1 for a slow group (the pod failure policy fails the job on
    it), 3 when nothing was measured (a failure like any other), 0 when every group kept up; without
    --hosts the gang's own node names, in node order."""
    from dataclasses import replace

    from checks.groupprobe.verdict import main

    d = yaml.safe_load((EXAMPLES / "tiny-k8s.yaml").read_text())
    probe = probe_spec(chosen(plan_job(spec_from_dict(d, source="job.yaml"))), tolerance=0.3)

    def measured(slow: tuple[str, int] | None):
        return replace(probe, groups=[replace(g, measured_s=g.assumed_s * (2 if (g.kind, g.index) == slow else 0.5),
                                              hosts=[["gpu-a", "gpu-b"][n] for n in g.nodes]) for g in probe.groups])

    path = tmp_path / "result.json"
    measured(None).save(path)
    assert main([str(path)]) == 0
    assert capsys.readouterr().out.splitlines() == ["launch4d-check gpu-a ok", "launch4d-check gpu-b ok"]
    measured(("dp", 0)).save(path)
    assert main([str(path), "--print-result"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert [ln.split(" plan preflight")[0] for ln in out[:2]] == ["launch4d-check gpu-a FAIL", "launch4d-check gpu-b FAIL"]
    assert out[2].startswith("launch4d-groupprobe-result ") and json.loads(out[2].split(" ", 1)[1])["groups"]
    assert main([str(tmp_path / "none.json")]) == 3
    assert "FAIL missing: plan preflight did not measure" in capsys.readouterr().out


# --- the gate, submitted through the API -----------------------------------------------------------
def test_submit_with_the_gate_creates_the_gangs_service_and_cancel_removes_it(monkeypatch, tmp_path):
    k8s = install_fake(monkeypatch, tmp_path)
    name = "tiny-k8s"
    api = k8s([("POST", CMS, 201, echo_created), ("POST", SVCS, 201, echo_created), ("POST", PJOBS, 201, echo_created),
               ("PATCH", f"{CMS}/{name}-plan", 200, {}), ("PATCH", f"{SVCS}/{name}-gang", 200, {})])
    res = invoke("submit", str(EXAMPLES / "tiny-k8s-pytorchjob.yaml"), "--preflight-plan",
                 "--tolerance", "0.2", "--json")
    assert res.exit_code == 0, res.output
    assert api.methods() == [("POST", CMS), ("POST", SVCS), ("POST", PJOBS), ("PATCH", f"{CMS}/{name}-plan"),
                             ("PATCH", f"{SVCS}/{name}-gang")]
    cm, svc, job = (c[3] for c in api.calls[:3])
    assert json.loads(cm["data"]["preflight-plan.spec.json"])["tolerance"] == 0.2
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["initContainers"][0]["name"] == "groupprobe"
    owner = api.calls[4][3]["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"]) == ("PyTorchJob", name)
    # `launch logs` shows the gate's init container first; when it failed, the trainer never started
    log = (b"launch4d-check gpu-b FAIL plan preflight: TP group 1, ranks 2,3 on gpu-b (intra-node): all_gather\n")
    not_started = status_obj(400, "BadRequest", 'container "pytorch" in pod "tiny-k8s-master-0" is waiting to start: '
                             "PodInitializing", "", "")

    api = k8s([])
    answer = api.request

    def request(method, url, **kw):   # the fake answers by path; the container is in the query
        container = parse_qs(urlparse(url).query).get("container", [""])[0]
        api.routes[:] = [("GET", f"{PODS}/{name}-master-0/log",
                          *((200, log) if container == "groupprobe" else (400, not_started)))]
        return answer(method, url, **kw)

    monkeypatch.setattr(api, "request", request)
    res = invoke("logs", name, "--rank", "0")
    containers = [c[2].get("container") for c in api.calls]
    assert containers == [["groupprobe"], ["pytorch"]], api.calls
    assert res.exit_code == 0, res.output
    assert "tiny-k8s-master-0: the pytorch container did not start (plan preflight above)" in res.output
    api = k8s([])
    res = invoke("cancel", name, "--json")
    assert res.exit_code == 0, res.output
    assert ("DELETE", f"{SVCS}/{name}-gang") in api.methods()


# --- `launch preflight --plan --backend k8s`: a one-off gang ------------------------------------
@pytest.fixture
def plan2(tmp_path):
    out = tmp_path / "plan.json"
    res = invoke("plan", str(EXAMPLES / "tiny-k8s.yaml"), "-o", str(out))
    assert res.exit_code == 0, res.output
    return out


def measured_log(plan_path, slow: tuple[str, int] | None) -> bytes:
    """Pod 0's log as the worker writes it (`-o -`: its marker line, then the document): each group
    measured at half its assumed time, `slow` at twice it, on nodes gpu-a and gpu-b."""
    from dataclasses import replace

    from checks.groupprobe.worker import RESULT_MARKER

    probe = probe_spec(Plan.load(plan_path), tolerance=0.3)
    names = ["gpu-a", "gpu-b"]
    groups = [replace(g, measured_s=g.assumed_s * (2 if (g.kind, g.index) == slow else 0.5),
                      samples_s=[g.assumed_s] * 5, hosts=[names[n] for n in g.nodes]) for g in probe.groups]
    doc = replace(probe, groups=groups, backend="nccl").to_dict()
    return f"rank 0 says hello\n{RESULT_MARKER}{json.dumps(doc, separators=(',', ':'))}\n".encode()


GANG = r"launch4d-pp-[0-9a-f]{8}"


def pod_read(body=None) -> dict:
    return {"kind": "Pod", "apiVersion": "v1", "metadata": {"name": "p", "namespace": NS},
            "status": {"phase": "Succeeded", "containerStatuses": [
                {"name": "groupprobe", "ready": False, "restartCount": 0, "image": "i", "imageID": "i",
                 "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}]}}


def gang_routes(log: bytes) -> list:
    gone = {"kind": "Status", "apiVersion": "v1", "status": "Success"}
    return [("POST", SVCS, 201, echo_created), ("POST", PODS, 201, echo_created),
            ("GET", f"{PODS}/{GANG}-[0-9]+", 200, pod_read), ("GET", f"{PODS}/{GANG}-0/log", 200, log),
            ("DELETE", f"{PODS}/{GANG}-[0-9]+", 200, pod_read), ("DELETE", f"{SVCS}/{GANG}", 200, gone)]


def decode(command: str) -> tuple[dict, list[str]]:
    """The spec inlined in a pod's command, and its torchrun arguments."""
    blob = re.search(r" ([A-Za-z0-9+/=]{40,}) ", command)
    assert blob is not None, command
    return (json.loads(zlib.decompress(base64.b64decode(blob.group(1)))),
            command.split("torch.distributed.run ", 1)[1].split())


def test_preflight_plan_on_kubernetes_is_a_gang_of_pods_and_names_a_slow_group(capsys, monkeypatch, tmp_path, plan2):
    k8s = install_fake(monkeypatch, tmp_path)
    api = k8s(gang_routes(measured_log(plan2, slow=("tp", 1))))
    rc, out, err = run_main(capsys, monkeypatch, "preflight", "--plan", str(plan2), "--backend", "k8s", "--json")
    assert rc == 1, out + err
    rep = json.loads(out)
    assert [(s["kind"], s["ranks"], s["hosts"]) for s in rep["slow"]] == [("tp", [2, 3], ["gpu-b", "gpu-b"])]
    assert rep["backend"] == "nccl" and rep["measured_step_s"] > rep["predicted_step_s"]
    posts = [c for c in api.calls if c[0] == "POST"]
    svc, *pods = (c[3] for c in posts)
    assert [c[1] for c in posts] == [SVCS, PODS, PODS]        # the Service first, then pod 0 and pod 1
    name = svc["metadata"]["name"]
    assert re.fullmatch(GANG, name) and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["clusterIP"] == "None"
    for i, pod in enumerate(pods):
        ps = pod["spec"]
        assert (ps["hostname"], ps["subdomain"]) == (f"{name}-{i}", name)         # <name>-i.<name> resolves
        assert set(svc["spec"]["selector"].items()) <= set(pod["metadata"]["labels"].items())
        (c,) = ps["containers"]
        # the plan's own image, namespace, node selector and tolerations (backend.k8s)
        assert c["image"] == "ghcr.io/example/launch4d:0.1.0" and pod["metadata"]["namespace"] == NS
        assert ps["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
        assert ps["tolerations"][0]["key"] == "nvidia.com/gpu" and "resources" not in c   # a cpu plan: no GPUs
        spec, args = decode(c["command"][2])
        assert len(spec["groups"]) == len(probe_spec(Plan.load(plan2)).groups)
        assert f"--node-rank={i}" in args and f"--master-addr={name}-0.{name}" in args
        assert "--rdzv-backend=static" in args and "--nnodes=2" in args
    # every pod read, node 0's log read, then the pods and the Service deleted
    assert ("GET", f"{PODS}/{name}-0/log") in api.methods()
    assert [p for m, p in api.methods() if m == "DELETE"] == [f"{PODS}/{name}-0", f"{PODS}/{name}-1", f"{SVCS}/{name}"]


def test_preflight_plan_on_kubernetes_within_tolerance_and_pinned_to_nodes(capsys, monkeypatch, tmp_path, plan2):
    k8s = install_fake(monkeypatch, tmp_path)
    api = k8s(gang_routes(measured_log(plan2, slow=None)))
    rc, out, err = run_main(capsys, monkeypatch, "preflight", "--plan", str(plan2), "--backend", "k8s", "--hosts",
                          "gpu-a,gpu-b", "--namespace", NS, "--image", "registry.example/l4d:1")
    assert rc == 0, out + err
    assert "every group within 30% of what the plan assumed" in out
    pods = [c[3] for c in api.calls if c[0] == "POST"][1:]
    assert [p["spec"]["nodeName"] for p in pods] == ["gpu-a", "gpu-b"]
    assert {p["spec"]["containers"][0]["image"] for p in pods} == {"registry.example/l4d:1"}


def test_preflight_plan_on_kubernetes_dry_run_creates_nothing(capsys, monkeypatch, tmp_path, plan2):
    k8s = install_fake(monkeypatch, tmp_path)
    api = k8s([])
    rc, out, err = run_main(capsys, monkeypatch, "preflight", "--plan", str(plan2), "--backend", "k8s", "--dry-run")
    assert rc == 0, out + err
    docs = [d for d in yaml.safe_load_all(out) if d]
    assert [d["kind"] for d in docs] == ["Service", "Pod", "Pod"] and api.calls == []


def test_preflight_plan_on_kubernetes_without_a_cluster_is_one_line_and_exit_2(monkeypatch, tmp_path, plan2):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("LAUNCH4D_STATE", str(tmp_path / "state"))
    res = invoke("preflight", "--plan", str(plan2), "--backend", "k8s")
    assert "no Kubernetes credentials" in one_error_line(res)
    # a kubeconfig whose API server answers nothing: also one line, exit 2, nothing half-made
    cfg = {"apiVersion": "v1", "kind": "Config", "current-context": "a",
           "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:9", "insecure-skip-tls-verify": True}}],
           "users": [{"name": "u", "user": {"token": "not-a-real-token"}}],
           "contexts": [{"name": "a", "context": {"cluster": "c", "user": "u"}}]}
    (tmp_path / "kubeconfig").write_text(yaml.safe_dump(cfg))
    data = json.loads(plan2.read_text())
    data["backend"]["k8s"]["kubeconfig"] = str(tmp_path / "kubeconfig")      # the plan's own kubeconfig is read
    plan2.write_text(json.dumps(data))
    res = invoke("preflight", "--plan", str(plan2), "--backend", "k8s")
    errors = [ln for ln in res.output.splitlines() if ln.startswith("error")]
    assert res.exit_code == 2 and len(errors) == 1 and "Traceback" not in res.output, res.output
    assert "Service training/launch4d-pp-" in errors[0] and "cannot reach the Kubernetes API" in errors[0]
