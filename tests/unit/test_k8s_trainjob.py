"""TrainJob rendering (Kubeflow Trainer v2.3.0), validated against the published CRDs.

No API server can run here, so acceptance is proven with the CRDs' own schemas
(/work/shared/specs, Trainer v2.3.0 and JobSet v0.12.0): jsonschema for the OpenAPI v3 schema,
launcher.backends.k8s_crd for unknown fields and the CEL rules. The same validator is first shown
to accept the upstream example TrainJobs and runtime, and to refuse broken copies of them.
"""

from __future__ import annotations

import functools
import json
import subprocess

import pytest
import yaml

from launcher.backends.k8s_crd import load_crd, validate
from launcher.errors import UserError
from launcher.plan.planner import plan_job
from launcher.plan.spec import spec_from_dict
from launcher.render.k8s import render_k8s
from tests.cli_helpers import invoke
from tests.conftest import EXAMPLES, spec_file
from tests.plan_helpers import chosen

pytestmark = pytest.mark.unit

pytest.importorskip("jsonschema")


@functools.cache
def crd(name: str) -> dict:
    return load_crd(spec_file(f"trainer.kubeflow.org_{name}.yaml"))


def upstream(name: str) -> dict:
    (doc,) = [d for d in yaml.safe_load_all(spec_file(name).read_text()) if d]
    return doc


def job_dict(path=EXAMPLES / "tiny-k8s.yaml", **over) -> dict:
    d = yaml.safe_load(path.read_text())
    for key, value in over.items():
        node = d
        *parts, last = key.split(".")
        for p in parts:
            node = node.setdefault(p, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    return d


def render_docs(path=EXAMPLES / "tiny-k8s.yaml", exclude=None, **over):
    spec = spec_from_dict(job_dict(path, **over), source="job.yaml")
    plan = chosen(plan_job(spec))
    rendered = render_k8s(spec, plan, exclude=exclude)
    return spec, plan, rendered, [d for d in yaml.safe_load_all(rendered.files["manifest.yaml"]) if d]


def assert_valid(doc: dict) -> None:
    kind = {"TrainJob": "trainjobs", "TrainingRuntime": "trainingruntimes",
            "ClusterTrainingRuntime": "clustertrainingruntimes"}[doc["kind"]]
    assert validate(doc, crd(kind)) == []


# --- the validator, proven on the upstream manifests ----------------------------------------------
@pytest.mark.parametrize("name", ["01-multi-node.yaml", "02-runtime-patches.yaml", "03-kueue-integration.yaml"])
def test_upstream_example_trainjobs_validate(name):
    assert_valid(upstream(name))


def test_upstream_torch_distributed_runtime_validates():
    assert_valid(upstream("torch_distributed.yaml"))


def test_validator_refuses_what_the_api_server_refuses():
    tj = crd("trainjobs")
    bad = upstream("01-multi-node.yaml")
    bad["metadata"]["name"] = "Multi_Node"                      # CEL: RFC 1035 label
    bad["spec"]["trainer"]["numNodes"] = "three"                # schema: integer
    bad["spec"]["trainer"]["nodes"] = 3                         # unknown: dropped by the server
    bad["spec"]["managedBy"] = "someone-else"                   # CEL: one of two managers
    errors = validate(bad, tj)
    assert any("RFC 1035" in e for e in errors)
    assert any(e.startswith("/spec/trainer/numNodes") for e in errors)
    assert any("/spec/trainer/nodes: unknown field" in e for e in errors)
    assert any("ManagedBy must be" in e for e in errors)
    long = upstream("01-multi-node.yaml")
    long["metadata"]["name"] = "x" * 64
    assert validate(long, tj) == ["/: metadata.name must be no more than 63 characters"]
    rt = upstream("torch_distributed.yaml")
    rt["spec"]["mlPolicy"]["mpi"] = {}
    assert any("Only one of the policy" in e for e in validate(rt, crd("clustertrainingruntimes")))


# --- what we render ---------------------------------------------------------------------------
def test_tiny_trainjob_and_its_runtime_validate_and_keep_the_settings():
    spec, plan, rendered, (cm, rt, tj) = render_docs()
    assert [cm["kind"], rt["kind"], tj["kind"]] == ["ConfigMap", "TrainingRuntime", "TrainJob"]
    assert_valid(rt)
    assert_valid(tj)
    assert tj["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "TrainingRuntime",
                                        "name": "tiny-k8s-runtime"}
    t = tj["spec"]["trainer"]
    assert t["numNodes"] == 2 and t["numProcPerNode"] == 2 and t["image"] == "ghcr.io/example/launch4d:0.1.0"
    assert t["resourcesPerNode"]["limits"] == {"nvidia.com/gpu": "2", "rdma/rdma_shared_device_a": "1"}
    env = {e["name"]: e["value"] for e in t["env"]}
    assert env["NCCL_DEBUG_FILE"] == "/workspace/runs/tiny-k8s/logs/nccl/%h.%p.log"
    assert env["NCCL_SOCKET_IFNAME"] == "eth0" and env["LAUNCH4D_PLAN"] == "/etc/launch4d/plan.json"
    script = t["command"][2]
    assert t["command"][:2] == ["bash", "-c"]
    assert "--rdzv-backend=static" in script and "--nnodes=2 --nproc-per-node=2" in script
    assert "master_addr=${PET_MASTER_ADDR:-tiny-k8s-node-0-0.tiny-k8s}" in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    (patch,) = tj["spec"]["runtimePatches"]
    (rj,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert rj["name"] == "node"
    pod = rj["template"]["spec"]["template"]
    ps = pod["spec"]
    assert ps["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert ps["tolerations"][0]["key"] == "nvidia.com/gpu" and ps["imagePullSecrets"] == [{"name": "regcred"}]
    vols = {v["name"]: v for v in ps["volumes"]}
    assert vols["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert vols["plan"]["configMap"]["name"] == cm["metadata"]["name"] == "tiny-k8s-plan"
    assert vols["runs"]["persistentVolumeClaim"]["claimName"] == "launch4d-runs"
    (c,) = ps["containers"]
    assert c["name"] == "node"
    assert {m["name"]: m["mountPath"] for m in c["volumeMounts"]} == {
        "dshm": "/dev/shm", "plan": "/etc/launch4d", "runs": "/workspace/runs"}
    anti = ps["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    assert json.loads(cm["data"]["plan.json"]) == json.loads(plan.to_json())
    # what a patch cannot carry is in the runtime
    js = rt["spec"]["template"]["spec"]
    assert js["failurePolicy"] == {"maxRestarts": 3, "restartStrategy": "Recreate"}
    (rrj,) = js["replicatedJobs"]
    assert rrj["template"]["spec"]["backoffLimit"] == 0          # a failed pod fails its Job: gang restart
    rpod = rrj["template"]["spec"]["template"]["spec"]
    assert rpod["restartPolicy"] == "Never"
    assert rpod["containers"][0]["envFrom"] == [{"secretRef": {"name": "wandb-credentials"}}]
    assert rt["spec"]["mlPolicy"] == {"numNodes": 2, "torch": {}}


def test_default_runtime_is_the_clusters_torch_distributed():
    _, _, _, docs = render_docs(**{"backend.k8s.max_restarts": None, "backend.k8s.env_from_secrets": None,
                                   "backend.k8s.queue": None, "backend.k8s.priority_class": None,
                                   "backend.k8s.topology": None})
    cm, tj = docs
    assert_valid(tj)
    assert tj["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                                        "name": "torch-distributed"}
    assert "suspend" not in tj["spec"] and "kueue.x-k8s.io/queue-name" not in tj["metadata"]["labels"]


def test_queued_topology_constrained_trainjob_renders_as_kueues_example():
    """Kueue's own example (03-kueue-integration.yaml): queue label on the TrainJob, suspend true,
    the torch-distributed ClusterTrainingRuntime; the topology annotation on the pod template of
    the `node` replicatedJob through runtimePatches (where Kueue reads it, per specs/README.md)."""
    _, _, _, (_, tj) = render_docs(**{"backend.k8s.max_restarts": None, "backend.k8s.env_from_secrets": None})
    assert_valid(tj)
    ref = upstream("03-kueue-integration.yaml")
    assert tj["apiVersion"] == ref["apiVersion"] and tj["kind"] == ref["kind"]
    assert tj["spec"]["runtimeRef"] == ref["spec"]["runtimeRef"]
    assert tj["spec"]["suspend"] is ref["spec"]["suspend"] is True
    assert set(ref["metadata"]["labels"]) <= set(tj["metadata"]["labels"])
    assert tj["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "training-queue"
    assert tj["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "high-priority"
    (rj,) = tj["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert rj["template"]["spec"]["template"]["metadata"]["annotations"] == {
        "kueue.x-k8s.io/podset-required-topology": "topology.kubernetes.io/rack"}
    _, _, _, (_, pref) = render_docs(**{"backend.k8s.max_restarts": None, "backend.k8s.env_from_secrets": None,
                                        "backend.k8s.topology": {"preferred": "cloud.example/block"}})
    (rj,) = pref["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert rj["template"]["spec"]["template"]["metadata"]["annotations"] == {
        "kueue.x-k8s.io/podset-preferred-topology": "cloud.example/block"}


def test_bad_nodes_become_a_node_affinity_not_in():
    _, _, _, (_, _, tj) = render_docs(exclude=["gpu-node-7", "gpu-node-3"],
                                      **{"backend.k8s.exclude_nodes": ["gpu-node-3", "gpu-node-9"]})
    assert_valid(tj)
    ps = tj["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0][
        "template"]["spec"]["template"]["spec"]
    (term,) = ps["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term["matchExpressions"] == [
        {"key": "launch4d.io/health", "operator": "NotIn", "values": ["fail"]},   # `preflight --drain` labels
        {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["gpu-node-3", "gpu-node-7", "gpu-node-9"]}]


@pytest.mark.parametrize("example", ["tiny-k8s.yaml", "llama3-405b-1024xh100.yaml"])
@pytest.mark.parametrize("api", ["trainjob", "pytorchjob"])
def test_tiny_and_large_examples_render_valid_jobs(example, api):
    over = {"backend.kind": "k8s", "backend.k8s.api": api, "backend.k8s.image": "ghcr.io/example/launch4d:0.1.0"}
    _, plan, _, docs = render_docs(EXAMPLES / example, **over)
    job = docs[-1]
    if api == "trainjob":
        for d in docs[1:]:
            assert_valid(d)
        assert job["spec"]["trainer"]["numNodes"] == plan.nodes
    else:
        pj = load_crd(spec_file("kubeflow.org_pytorchjobs.yaml"))
        assert validate(job, pj) == []
        reps = job["spec"]["pytorchReplicaSpecs"]
        assert 1 + reps.get("Worker", {}).get("replicas", 0) == plan.nodes


def test_image_is_required_and_latest_warns(tmp_path):
    with pytest.raises(UserError, match="backend.k8s.image: required"):
        render_docs(**{"backend.k8s.image": None})
    _, _, rendered, _ = render_docs(**{"backend.k8s.image": "registry.example:5000/launch4d"})
    assert rendered.warnings == ["backend.k8s.image registry.example:5000/launch4d: tag `latest` moves; "
                                 "pin a version or digest"]
    _, _, rendered, _ = render_docs(**{"backend.k8s.image": "ghcr.io/x/launch4d@sha256:" + "a" * 64})
    assert rendered.warnings == []
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(job_dict(**{"backend.k8s.image": "ghcr.io/x/launch4d:latest"})))
    res = invoke("render", str(job), "--json")
    assert res.exit_code == 0
    assert "tag `latest` moves" in res.stderr
    job.write_text(yaml.safe_dump(job_dict(**{"backend.k8s.image": None})))
    res = invoke("render", str(job))
    assert res.exit_code == 2 and "backend.k8s.image: required" in res.output


@pytest.mark.parametrize("field,value,message", [
    ("backend.k8s.topology", {"required": "a", "preferred": "b"}, "required or preferred, not both"),
    ("backend.k8s.runtime", "Torch_Distributed", "backend.k8s.runtime"),
    ("backend.k8s.exclude_nodes", ["bad node"], "backend.k8s.exclude_nodes[0]"),
    ("backend.k8s.api", "mpijob", "backend.k8s.api"),
    # issue 23: what the API server (or the kubelet, for the image) would refuse is refused here
    ("backend.k8s.queue", "q" * 64, "backend.k8s.queue: 'qqqq"),
    ("backend.k8s.queue", "my queue", "backend.k8s.queue: 'my queue' is not a label value"),
    ("backend.k8s.priority_class", "high_prio", "backend.k8s.priority_class: 'high_prio' is not a Kubernetes name"),
    ("backend.k8s.scheduler_name", "my scheduler", "backend.k8s.scheduler_name: 'my scheduler'"),
    ("backend.k8s.service_account", "Trainer", "backend.k8s.service_account: 'Trainer'"),
    ("backend.k8s.pvc", "runs/x", "backend.k8s.pvc: 'runs/x'"),
    ("backend.k8s.node_selector", {"gpu type": "h100"}, "backend.k8s.node_selector.gpu type: 'gpu type' is not a label key"),
    ("backend.k8s.node_selector", {"nvidia.com/gpu.product": "H100 SXM"}, "node_selector.nvidia.com/gpu.product: 'H100 SXM'"),
    ("backend.k8s.node_selector", {"-bad.example/x": "a"}, "is not a label key"),
    ("backend.k8s.image", "ghcr.io/Acme/trainer:1.0", "backend.k8s.image: 'ghcr.io/Acme/trainer:1.0' is not an image"),
    ("backend.k8s.image", "ghcr.io/acme/trainer 1.0", "backend.k8s.image: "),
    ("backend.k8s.memory", "-16Gi", "backend.k8s.memory: '-16Gi' is not a Kubernetes quantity"),
    ("backend.k8s.cpu", "eight", "backend.k8s.cpu: 'eight'"),
    ("backend.k8s.shm_size", "16 GB", "backend.k8s.shm_size: '16 GB'"),
    ("backend.k8s.rdma_resource", "rdma shared", "backend.k8s.rdma_resource: 'rdma shared'"),
    ("backend.k8s.topology", {"required": "rack level"}, "backend.k8s.topology.required: 'rack level'"),
    ("backend.k8s.tolerations", [{"key": "gpu", "operator": "In"}], "backend.k8s.tolerations[0].operator: 'In'"),
    ("backend.k8s.tolerations", [{"key": "gpu", "operator": "Exists", "value": "x"}], "must be empty when operator is Exists"),
    ("backend.k8s.tolerations", [{"key": "gpu", "effect": "NoRun"}], "backend.k8s.tolerations[0].effect: 'NoRun'"),
    ("backend.k8s.tolerations", [{"key": "a b"}], "backend.k8s.tolerations[0].key: 'a b' is not a taint key"),
    ("backend.k8s.tolerations", [{"key": "gpu", "tolerationSeconds": "soon", "effect": "NoExecute"}], "tolerationSeconds"),
    ("backend.k8s.tolerations", [{"key": "gpu", "tolerationSeconds": 30}], "only with effect NoExecute"),
    ("backend.k8s.tolerations", [{"key": "gpu", "operater": "Exists"}], "tolerations[0].operater: unknown key"),
])
def test_bad_k8s_fields_are_one_clear_line(field, value, message, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(job_dict(**{field: value})))
    res = invoke("render", str(job))
    assert res.exit_code == 2 and message in res.output and "Traceback" not in res.output
    assert len([ln for ln in res.output.splitlines() if ln.startswith("error")]) == 1, res.output


@pytest.mark.parametrize("api", ["trainjob", "pytorchjob"])
def test_valid_k8s_fields_render_as_the_api_takes_them(api):
    """tolerationSeconds is an integer in the pod spec (it was refused as a string); quantities,
    qualified label keys, registry ports and digests pass."""
    tol = [{"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute",
            "tolerationSeconds": 300}, {"key": "gpu", "value": "h100", "effect": "NoSchedule"}]
    image = "registry.example.com:5000/acme/trainer:1.0@sha256:" + "a" * 64
    *_, docs = render_docs(**{"backend.k8s.api": api, "backend.k8s.tolerations": tol, "backend.k8s.image": image,
                              "backend.k8s.memory": "512Gi", "backend.k8s.cpu": "500m", "backend.k8s.shm_size": "64G",
                              "backend.k8s.node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}})
    text = json.dumps(docs)
    assert '"tolerationSeconds": 300' in text and image in text
    for doc in docs:
        if doc["kind"] in ("TrainJob", "TrainingRuntime"):
            assert_valid(doc)


def test_same_input_same_bytes():
    a = render_docs()[2].files["manifest.yaml"]
    b = render_docs()[2].files["manifest.yaml"]
    assert a == b


def test_preflight_bandwidth_map_keeps_failed_nodes_out(tmp_path, monkeypatch):
    """`launch submit --preflight BWMAP` (dry run: nothing reaches an API): the map's failed nodes
    are a nodeAffinity NotIn on the TrainJob's pods."""
    from launcher.formats.bwmap import BandwidthMap, NodeReport

    monkeypatch.setenv("LAUNCH4D_STATE", str(tmp_path / "state"))
    bw = BandwidthMap(nodes={h: NodeReport(host=h, gpus=2) for h in ("gpu-a1", "gpu-a2", "gpu-a3")},
                      exclude=["gpu-a2"])
    (tmp_path / "bw.json").write_text(json.dumps(bw.to_dict()))
    res = invoke("submit", str(EXAMPLES / "tiny-k8s.yaml"), "--preflight", str(tmp_path / "bw.json"),
                 "--dry-run", "--json")
    assert res.exit_code == 0, res.output
    tj = [d for d in yaml.safe_load_all(json.loads(res.stdout)["request"]) if d][-1]
    assert_valid(tj)
    ps = tj["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0][
        "template"]["spec"]["template"]["spec"]
    expr = ps["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
    assert expr["matchExpressions"][1] == {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["gpu-a2"]}


def test_preemption_grace_and_restart_without_volume_warns():
    _, _, rendered, (_, _, tj) = render_docs(**{"backend.k8s.termination_grace_s": 900})
    ps = tj["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0][
        "template"]["spec"]["template"]["spec"]
    assert ps["terminationGracePeriodSeconds"] == 900    # SIGTERM first: the trainer checkpoints, then exits
    assert rendered.warnings == []
    _, _, rendered, _ = render_docs(**{"backend.k8s.pvc": None})
    assert rendered.warnings == ["backend.k8s.max_restarts 3 without backend.k8s.pvc: the run dir is in the pods, "
                                 "so a restarted gang starts again from step 0"]
    assert "--resume auto" in render_docs()[3][-1]["spec"]["trainer"]["command"][2]


def test_fields_of_the_other_job_kind_warn():
    _, _, rendered, _ = render_docs(**{"backend.k8s.backoff_limit": 5, "backend.k8s.clean_pod_policy": "All"})
    assert rendered.warnings == ["backend.k8s.clean_pod_policy: only read with api: pytorchjob; ignored for api: "
                                 "trainjob", "backend.k8s.backoff_limit: only read with api: pytorchjob; ignored "
                                 "for api: trainjob"]
    _, _, rendered, _ = render_docs(**{"backend.k8s.api": "pytorchjob"})
    assert rendered.warnings == [f"backend.k8s.{n}: only read with api: trainjob; ignored for api: pytorchjob"
                                 for n in ("max_restarts", "topology")]


def test_torchrun_waits_the_grace_period_for_the_checkpoint():
    """Kubernetes SIGTERMs the container's PID 1 (torchrun, exec'd) and SIGKILLs after the grace
    period; torchrun forwards SIGTERM to the trainers and kills them after --shutdown-timeout
    (default 30 s). The rendered value is inside the grace period, and this torch's torchrun
    parser takes the rendered arguments."""
    import shlex

    torch_run = pytest.importorskip("torch.distributed.run")
    for api in ("trainjob", "pytorchjob"):
        _, _, _, docs = render_docs(**{"backend.k8s.api": api, "backend.k8s.termination_grace_s": 600})
        job = docs[-1]
        command = (job["spec"]["trainer"] if api == "trainjob"
                   else job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0])["command"]
        line = next(ln for ln in command[2].splitlines() if ln.startswith("exec python -m torch.distributed.run"))
        shell = {"$node_rank": "1", "$master_addr": "head", "$master_port": "29400"}   # what bash expands
        argv = []
        for arg in shlex.split(line)[4:]:
            key, _, value = arg.partition("=")
            argv.append(f"{key}={shell[value]}" if value in shell else arg)
        args = torch_run.get_args_parser().parse_args(argv)
        assert args.shutdown_timeout == 585 and args.rdzv_backend == "static"
        assert args.training_script == "launcher.trainer" and args.module


def test_node_rank_is_the_pods_index_even_without_trainers_env(tmp_path):
    """The pod command's node rank: PET_NODE_RANK when Trainer sets it, else the Indexed Job's
    JOB_COMPLETION_INDEX (the pod's JobSet index), never a silent 0 on every node."""
    _, _, _, docs = render_docs()
    script = docs[-1]["spec"]["trainer"]["command"][2]
    head = script.split("exec python", 1)[0] + 'printf "%s %s %s" "$node_rank" "$master_addr" "$master_port"'
    head = head.replace("mkdir -p", "true")
    for env, want in (({"PET_NODE_RANK": "1", "PET_MASTER_ADDR": "h", "PET_MASTER_PORT": "2"}, "1 h 2"),
                      ({"JOB_COMPLETION_INDEX": "1"}, "1 tiny-k8s-node-0-0.tiny-k8s 29400")):
        out = subprocess.run(["bash", "-c", head], env={"PATH": "/usr/bin:/bin", **env}, capture_output=True,
                             text=True, check=True).stdout
        assert out == want
