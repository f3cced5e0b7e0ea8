"""Kubeflow Trainer v2 TrainJob (trainer.kubeflow.org/v1alpha1, on JobSet) from a plan.

The TrainJob refers to the cluster's `torch-distributed` ClusterTrainingRuntime (backend.k8s.runtime)
and sets what the PyTorchJob template sets through `trainer` (nodes, processes per node, image,
command, env, resources) and one `runtimePatches` entry (pod labels/annotations, node selector,
tolerations, affinity, pull secrets, volumes and mounts). What a patch cannot carry (a JobSet
failure policy for whole-gang restart, the pod priority class or scheduler, envFrom Secrets) goes
into a TrainingRuntime rendered with the job, which the TrainJob then refers to instead.

Rank order: JobSet gives the pods of replicatedJob `node` completion indices 0..N-1 and Trainer
passes that index as PET_NODE_RANK, so a pod's index is its node rank in the plan; rendezvous is
static on the head pod's stable hostname `<job>-node-0-0.<job>` (JobSet's headless Service).
Built as data and dumped with yaml.safe_dump: nothing the user wrote is spliced into YAML text.
"""

from __future__ import annotations

from typing import Any

from launcher.formats.health import HEALTH_KEY

GROUP, VERSION = "trainer.kubeflow.org", "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
CONTAINER = "node"                       # the torch runtime's trainer container and replicatedJob
MANAGER = "launch4d"                     # our runtimePatches entry
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
TOPOLOGY = {"required": "kueue.x-k8s.io/podset-required-topology",
            "preferred": "kueue.x-k8s.io/podset-preferred-topology"}
DEFAULT_PORT = 29400                     # Trainer's torch plugin PET_MASTER_PORT


def head_host(name: str) -> str:
    """The head pod's stable DNS name: JobSet pod `<jobset>-<rjob>-<job index>-<pod index>` under
    the JobSet's headless Service (named after the JobSet, which Trainer names after the TrainJob)."""
    return f"{name}-{CONTAINER}-0-0.{name}"


def needs_own_runtime(k: Any, gate: bool = False) -> bool:
    """Settings a runtimePatches entry cannot carry (a patch may only amend an init container, not add one)."""
    return bool(gate or k.max_restarts or k.scheduler_name or k.env_from_secrets
                or (k.priority_class and not k.queue))


def runtime_name(name: str) -> str:
    return f"{name}-runtime"


def _pod_patch(ctx: dict[str, Any]) -> dict[str, Any]:
    k, name = ctx["k"], ctx["name"]
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"},
              {"name": "plan", "mountPath": ctx["plan_mount"], "readOnly": True}]
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": k.shm_size}},
        {"name": "plan", "configMap": {"name": ctx["configmap_name"]}}]
    if k.pvc:
        mounts.append({"name": "runs", "mountPath": ctx["log_dir"]})
        volumes.append({"name": "runs", "persistentVolumeClaim": {"claimName": k.pvc}})
    elif ctx.get("probe"):     # the gate's init container writes its measurements where the trainer reads them
        mounts.append({"name": "runs", "mountPath": ctx["log_dir"]})
        volumes.append({"name": "runs", "emptyDir": {}})
    affinity: dict[str, Any] = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchLabels": {"launch4d/job": name}}, "topologyKey": "kubernetes.io/hostname"}]}}
    # Nodes `launch preflight --drain --scheduler k8s` labelled failed, and the ones named here.
    keep_out = [{"key": HEALTH_KEY, "operator": "NotIn", "values": ["fail"]}]
    if k.exclude_nodes:
        keep_out.append({"key": "kubernetes.io/hostname", "operator": "NotIn", "values": sorted(k.exclude_nodes)})
    affinity["nodeAffinity"] = {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": keep_out}]}}
    pod: dict[str, Any] = {}
    if k.service_account:
        pod["serviceAccountName"] = k.service_account
    if k.node_selector:
        pod["nodeSelector"] = dict(k.node_selector)
    if ctx["tolerations"]:
        pod["tolerations"] = [dict(t) for t in ctx["tolerations"]]
    if k.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": s} for s in k.image_pull_secrets]
    pod.update(affinity=affinity, volumes=volumes, terminationGracePeriodSeconds=k.termination_grace_s,
               containers=[{"name": CONTAINER, "volumeMounts": mounts}])
    meta: dict[str, Any] = {"labels": {"app.kubernetes.io/managed-by": "launch4d", "launch4d/job": name}}
    topo = {TOPOLOGY[kind]: level for kind, level in (("required", k.topology.required),
                                                        ("preferred", k.topology.preferred)) if level}
    if topo:
        meta["annotations"] = topo
    return {"metadata": meta, "spec": pod}


def trainjob(ctx: dict[str, Any]) -> dict[str, Any]:
    k, name = ctx["k"], ctx["name"]
    labels = {"app.kubernetes.io/managed-by": "launch4d", "launch4d/job": name}
    if k.queue:
        labels[QUEUE_LABEL] = k.queue
        if k.priority_class:
            labels[PRIORITY_LABEL] = k.priority_class
    own = needs_own_runtime(k, bool(ctx.get("probe")))
    ref = ({"apiGroup": GROUP, "kind": "TrainingRuntime", "name": runtime_name(name)} if own
           else {"apiGroup": GROUP, "kind": "ClusterTrainingRuntime", "name": k.runtime})
    spec: dict[str, Any] = {"runtimeRef": ref}
    if k.queue:
        spec["suspend"] = True           # Kueue admits the job by setting suspend to false
    spec["trainer"] = {
        "numNodes": ctx["nodes"], "numProcPerNode": ctx["nproc"], "image": k.image, "command": ctx["command"],
        "env": [{"name": key, "value": value} for key, value in ctx["env"]],
        "resourcesPerNode": {"limits": dict(ctx["resources"]), "requests": dict(ctx["resources"])}}
    spec["runtimePatches"] = [{"manager": MANAGER, "trainingRuntimeSpec": {"template": {"spec": {
        "replicatedJobs": [{"name": CONTAINER, "template": {"spec": {"template": _pod_patch(ctx)}}}]}}}}]
    return {"apiVersion": API_VERSION, "kind": "TrainJob",
            "metadata": {"name": name, "namespace": k.namespace, "labels": labels}, "spec": spec}


def training_runtime(ctx: dict[str, Any]) -> dict[str, Any]:
    """The torch-distributed runtime's shape plus what patches cannot set. With max_restarts, a
    failed pod fails its Job (backoffLimit 0, restartPolicy Never) and the JobSet recreates every
    Job (restartStrategy Recreate): the whole gang restarts and resumes from the last checkpoint."""
    k, name = ctx["k"], ctx["name"]
    container: dict[str, Any] = {"name": CONTAINER, "image": k.image}
    if k.env_from_secrets:
        container["envFrom"] = [{"secretRef": {"name": s}} for s in k.env_from_secrets]
    pod: dict[str, Any] = {"restartPolicy": "Never", "containers": [container]}
    if k.scheduler_name:
        pod["schedulerName"] = k.scheduler_name
    if k.priority_class and not k.queue:  # queued: it names Kueue's WorkloadPriorityClass (a label), not a pod's
        pod["priorityClassName"] = k.priority_class
    job: dict[str, Any] = {"backoffLimit": 0, "template": {"spec": pod}}
    jobset: dict[str, Any] = {
        "failurePolicy": {"maxRestarts": k.max_restarts, "restartStrategy": "Recreate"},
        "replicatedJobs": [{"name": CONTAINER, "template": {
            "metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
            "spec": job}}]}
    probe = ctx.get("probe")
    if probe:
        gate(jobset, job, pod, probe)
    return {"apiVersion": API_VERSION, "kind": "TrainingRuntime",
            "metadata": {"name": runtime_name(name), "namespace": k.namespace,
                         "labels": {"app.kubernetes.io/managed-by": "launch4d", "launch4d/job": name,
                                    "trainer.kubeflow.org/framework": "torch"}},
            "spec": {"mlPolicy": {"numNodes": ctx["nodes"], "torch": {}}, "template": {"spec": jobset}}}


def gate(jobset: dict[str, Any], job: dict[str, Any], pod: dict[str, Any], probe: dict[str, Any]) -> None:
    """`--preflight-plan`: the plan preflight as every pod's init container, over the gang's rendezvous
    (JobSet's headless Service, published before the pods are Ready: they are not, while initialising).
    A slow group (exit SLOW_EXIT) fails the pod's Job by its pod failure policy, and that reason fails
    the JobSet, not a gang restart that would land on the same nodes; a probe that measured nothing
    fails like any pod (the restart budget applies)."""
    from launcher.render.groupprobe import PROBE_CONTAINER, SLOW_EXIT

    pod["initContainers"] = probe["init"]["node"]
    jobset["network"] = {"publishNotReadyAddresses": True}
    jobset["failurePolicy"]["rules"] = [{"name": "plan-preflight-slow", "action": "FailJobSet",
                                         "onJobFailureReasons": ["PodFailurePolicy"]}]
    job["podFailurePolicy"] = {"rules": [{"action": "FailJob", "onExitCodes": {
        "containerName": PROBE_CONTAINER, "operator": "In", "values": [SLOW_EXIT]}}]}


def documents(ctx: dict[str, Any]) -> list[dict[str, Any]]:
    """[TrainingRuntime,] TrainJob, in the order they must be created."""
    docs = [training_runtime(ctx)] if needs_own_runtime(ctx["k"], bool(ctx.get("probe"))) else []
    return docs + [trainjob(ctx)]


def dump(docs: list[dict[str, Any]]) -> str:
    import yaml

    return "---\n".join(yaml.safe_dump(d, sort_keys=False, width=1 << 16) for d in docs)
