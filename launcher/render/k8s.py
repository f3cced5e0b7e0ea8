"""Kubernetes: a Plan as its ConfigMap and a Kubeflow Trainer v2 TrainJob (trainjob.py) or a
kubeflow.org/v1 PyTorchJob (templates/k8s/pytorchjob.yaml.j2), checked against the CRD's rules and
the kubernetes client's models before anything is submitted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from launcher.errors import UserError
from launcher.formats import rundir
from launcher.formats.k8snames import RFC1123_SUBDOMAIN
from launcher.formats.shell import quote as shell_quote
from launcher.plan.model import Plan
from launcher.plan.spec import JobSpec
from launcher.render import bash_syntax_check, check_k8s_name, render_template
from launcher.render.env import (
    diagnostics_env,
    entry_command,
    measured_nccl_env,
    plan_env,
    trainer_args,
    trainer_env_prefix,
    user_env,
)
from launcher.render.k8s_fields import check_k8s_fields
from launcher.render.rendered import Rendered, check_rank_map, gpu_lists

PLAN_MOUNT = "/etc/launch4d"
# A PyTorchJob's pods are named <name>-worker-<i>; keep the name short enough for that.
K8S_NAME_MAX = 50


def k8s_log_dir(spec: JobSpec) -> str:
    """backend.log_dir inside the pods: a relative one is taken under /workspace."""
    d = spec.backend.log_dir.rstrip("/") or "/"
    return d if d.startswith("/") else f"/workspace/{d}"


def shutdown_timeout(grace_s: int) -> int:
    """How long torchrun (the pod's PID 1) waits for its workers after the SIGTERM the kubelet sends
    on preemption or delete, before it SIGKILLs them: the pod's grace period less a margin for
    torchrun's own exit. torchrun's default, 30 s, would kill a trainer mid-checkpoint."""
    return max(grace_s - 15, 1)


def k8s_context(spec: JobSpec, plan: Plan, run_dir: str, preflight_plan: float | None = None) -> dict[str, Any]:
    """`preflight_plan`: a tolerance, to measure the plan's communication groups in an init container of
    every pod before the trainer (`launch submit --preflight-plan`)."""
    check_rank_map(plan)
    k = spec.backend.k8s
    tolerations = check_k8s_fields(k)   # names, labels, quantities, images, tolerations: as the API server
    name = check_k8s_name(spec.name, "name", K8S_NAME_MAX)
    check_k8s_name(k.namespace, "backend.k8s.namespace")
    for i, node in enumerate(k.exclude_nodes):
        if len(node) > 253 or not RFC1123_SUBDOMAIN.fullmatch(node):
            raise UserError(f"backend.k8s.exclude_nodes[{i}]: {node!r} is not a Kubernetes node name "
                            "(RFC 1123 subdomain: lowercase letters, digits, '-' and '.')")
    if k.topology.required and k.topology.preferred:
        raise UserError("backend.k8s.topology: set required or preferred, not both")
    if k.api == "trainjob":
        check_k8s_name(k.runtime, "backend.k8s.runtime", 253)
        if not name[0].isalpha():
            raise UserError(f"name: {name!r} must start with a letter for a TrainJob (RFC 1035 label)")
    for i, s in enumerate(k.image_pull_secrets):
        check_k8s_name(s, f"backend.k8s.image_pull_secrets[{i}]", 253)
    for i, s in enumerate(k.env_from_secrets):
        check_k8s_name(s, f"backend.k8s.env_from_secrets[{i}]", 253)
    g = plan.gpus_per_node
    resources: dict[str, str] = {"nvidia.com/gpu": str(g)}
    if k.rdma_resource:
        resources[k.rdma_resource] = "1"
    if k.cpu:
        resources["cpu"] = k.cpu
    if k.memory:
        resources["memory"] = k.memory
    plan_path = f"{PLAN_MOUNT}/{rundir.PLAN}"
    # the plan's layout for the program torchrun starts (train.entrypoint's own code reads it), relative
    # paths of own code taken from the image's working directory
    env = [*plan_env(plan, plan_path, run_dir), ("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[rank${rank}]: ")]
    job_env = user_env(spec)  # the user has the last word: a name set there replaces ours, never doubles it
    env = [(k, v) for k, v in env if k not in dict(job_env)]
    env += [(k, v) for k, v in diagnostics_env(spec, run_dir, measured_nccl_env(plan)) if k not in dict(job_env)]
    env += job_env
    # LD_LIBRARY_PATH / PATH / PYTHONPATH from backend.env: the trainer's command only, not this script
    trainer_only = "env " + trainer_env_prefix(spec) if trainer_env_prefix(spec) else ""
    lists = gpu_lists(plan)
    if any(lst != ",".join(str(i) for i in range(g)) for lst in lists):
        env.append(("LAUNCH4D_GPU_LISTS", " ".join(lists)))
    q = shell_quote
    if k.api == "trainjob":     # Trainer's torch plugin sets PET_*; the head's hostname is stable
        from launcher.render.trainjob import DEFAULT_PORT, head_host

        rendezvous = [f"master_addr=${{PET_MASTER_ADDR:-{head_host(name)}}}",
                      f"master_port=${{PET_MASTER_PORT:-{DEFAULT_PORT}}}"]
    else:                       # the training operator sets MASTER_ADDR/PORT on every pod
        rendezvous = ['master_addr="$MASTER_ADDR"', 'master_port="$MASTER_PORT"']
    script = "\n".join([
        "set -euo pipefail",
        # nothing here or in the trainer writes through a symbolic link planted in the run dir
        f"planted=$(find {q(run_dir)} -type l -print -quit 2>/dev/null || true)",
        'if [ -n "$planted" ]; then echo "launch4d: run dir holds a symbolic link ($planted); not starting" >&2; '
        "exit 3; fi",
        "mkdir -p " + " ".join(q(f"{run_dir}/{d}") for d in (rundir.NCCL_LOGS, rundir.FLIGHT, rundir.HEARTBEAT)),
        # PET_NODE_RANK: both operators set it; an Indexed Job's pod (TrainJob) also has its index.
        "node_rank=${PET_NODE_RANK:-${JOB_COMPLETION_INDEX:-${RANK:-0}}}",
        *rendezvous,
        "if [ -n \"${LAUNCH4D_GPU_LISTS:-}\" ]; then lists=( $LAUNCH4D_GPU_LISTS ); "
        "export CUDA_VISIBLE_DEVICES=${lists[$node_rank]}; fi",
        f"exec {trainer_only}python -m torch.distributed.run --nnodes={plan.nodes} --nproc-per-node={g} "
        "--node-rank=\"$node_rank\" --rdzv-backend=static --master-addr=\"$master_addr\" "
        "--master-port=\"$master_port\" --max-restarts=0 --tee=3 "
        f"--shutdown-timeout={shutdown_timeout(k.termination_grace_s)} "
        + entry_command(plan.train.entrypoint, trainer_args(spec, plan_path, run_dir)),
    ])
    if not k.image:
        raise UserError("backend.k8s.image: required; give an image with launch4d[train] installed "
                        "(build one from the repository's Containerfile)")
    bash_syntax_check(script, "pod command")
    probe = None
    if preflight_plan is not None:
        probe = probe_context(spec, plan, name, run_dir, env, resources, trainer_only, preflight_plan)
    return {
        "probe": probe,
        "name": name,
        "configmap_name": check_k8s_name(f"{name}-plan", "name"),
        "k": k,
        "nodes": plan.nodes,
        "nproc": g,
        "resources": resources,
        "tolerations": tolerations,
        "env": env,
        "command": ["bash", "-c", script],
        "plan_mount": PLAN_MOUNT,
        "plan_json": plan.to_json() + "\n",
        "log_dir": k8s_log_dir(spec),
        "master_port": k.master_port,
    }


def gang_service(name: str) -> str:
    """A PyTorchJob's headless Service for the gate: its pods' DNS names before they are Ready."""
    if not name[0].isalpha():
        raise UserError(f"name: {name!r} must start with a letter for --preflight-plan on a PyTorchJob "
                        "(its gang's Service is an RFC 1035 label)")
    return f"{name}-gang"


def probe_context(spec: JobSpec, plan: Plan, name: str, run_dir: str, env: list[tuple[str, str]],
                  resources: dict[str, str], trainer_only: str, tolerance: float) -> dict[str, Any]:
    """The gate's init container for every pod of the gang (per role: a PyTorchJob's master and
    workers find their node rank differently), the spec for the ConfigMap, and for a PyTorchJob the
    headless Service that publishes the pods' addresses before they are Ready.

    The rendezvous is the trainer's, resolvable while every pod is still initialising: a TrainJob's
    head `<job>-node-0-0.<job>` is JobSet's headless Service, which publishes not-ready addresses
    (the runtime sets it; JobSet's default too); a PyTorchJob's operator Service for the master only
    answers once the master is Ready (after its init containers: a deadlock), so the pods take a
    subdomain of our own Service and the master is `<job>-master-0.<job>-gang`."""
    from launcher.render.groupprobe import PROBE_CONTAINER, k8s_probe_script, probe_files

    k = spec.backend.k8s
    probe, files = probe_files(plan, tolerance, spec.diagnostics.init_timeout_s)
    spec_path = f"{PLAN_MOUNT}/{rundir.PREFLIGHT_PLAN_SPEC}"
    next_port = "$(( {p} < 65535 ? {p} + 1 : {p} - 1 ))"   # the trainer's own port is bound right after
    if k.api == "trainjob":
        from launcher.render.trainjob import DEFAULT_PORT, head_host

        service = None
        roles = {"node": ("${PET_NODE_RANK:-${JOB_COMPLETION_INDEX:-}}",
                          f"${{PET_MASTER_ADDR:-{head_host(name)}}}",
                          next_port.format(p=f"${{PET_MASTER_PORT:-{DEFAULT_PORT}}}"))}
    else:
        service = gang_service(name)
        port = next_port.format(p=k.master_port)
        roles = {"master": ("0", f"{name}-master-0.{service}", port),
                 "worker": ("${LAUNCH4D_REPLICA_INDEX:+$((LAUNCH4D_REPLICA_INDEX + 1))}",
                            f"{name}-master-0.{service}", port)}
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"},
              {"name": "plan", "mountPath": PLAN_MOUNT, "readOnly": True},
              {"name": "runs", "mountPath": k8s_log_dir(spec)}]
    base_env: list[dict[str, Any]] = [{"name": key, "value": value} for key, value in env]
    base_env.append({"name": "LAUNCH4D_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}})
    init: dict[str, list[dict[str, Any]]] = {}
    for role, (rank, master, port_expr) in roles.items():
        script = k8s_probe_script(nodes=plan.nodes, nproc=plan.gpus_per_node, node_rank=rank, master_addr=master,
                                  master_port=port_expr, spec_path=spec_path, run_dir=run_dir,
                                  shared_run_dir=bool(k.pvc), timeout_s=probe["timeout_s"], groups=probe["groups"],
                                  python_prefix=trainer_only)
        bash_syntax_check(script, "plan preflight init container command")
        role_env = list(base_env)
        if role == "worker":    # the operator's label on the pod; its env reaches the trainer container only
            role_env.append({"name": "LAUNCH4D_REPLICA_INDEX", "valueFrom": {"fieldRef": {
                "fieldPath": "metadata.labels['training.kubeflow.org/replica-index']"}}})
        init[role] = [{"name": PROBE_CONTAINER, "image": k.image, "imagePullPolicy": "IfNotPresent",
                       "command": ["bash", "-c", script], "env": role_env,
                       "resources": {"limits": dict(resources), "requests": dict(resources)},
                       "volumeMounts": mounts}]
    return {**probe, "init": init, "service": service, "spec_key": rundir.PREFLIGHT_PLAN_SPEC,
            "spec_text": files[rundir.PREFLIGHT_PLAN_SPEC], "files": files}


def service_doc(ctx: dict[str, Any]) -> dict[str, Any]:
    """The gang's headless Service (PyTorchJob gate): every pod of the job, published before Ready."""
    name = ctx["name"]
    labels = {"app.kubernetes.io/managed-by": "launch4d", "launch4d/job": name}
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": ctx["probe"]["service"], "namespace": ctx["k"].namespace, "labels": labels},
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": {"launch4d/job": name}}}


def image_warnings(image: str) -> list[str]:
    """A `latest` (or missing) tag names a different image tomorrow: reruns stop being reruns."""
    last = image.rsplit("/", 1)[-1]
    if "@" in last:
        return []
    tag = last.split(":", 1)[1] if ":" in last else "latest"
    return [f"backend.k8s.image {image}: tag `latest` moves; pin a version or digest"] if tag == "latest" else []


#: Fields only one job kind reads; set on the other they would be silently without effect.
K8S_ONLY = {"pytorchjob": ("clean_pod_policy", "backoff_limit", "ttl_seconds_after_finished", "restart_policy"),
            "trainjob": ("runtime", "max_restarts", "topology")}


def k8s_warnings(spec: JobSpec, gate: bool = False) -> list[str]:
    """Settings that do not do what they say: a restart budget whose restarts cannot resume (the run
    dir must outlive the pods), fields of the other job kind, and a gate the kubelet reruns in place."""
    k = spec.backend.k8s
    out = []
    if gate and k.api == "pytorchjob" and k.restart_policy in ("OnFailure", "Always"):
        out.append(f"backend.k8s.restart_policy {k.restart_policy} with --preflight-plan: the kubelet reruns a "
                   "failed plan preflight in place until backoff_limit; restart_policy ExitCode or Never fails "
                   "the job at once")
    if k.api == "trainjob" and k.max_restarts and not k.pvc:
        out.append(f"backend.k8s.max_restarts {k.max_restarts} without backend.k8s.pvc: the run dir is in the "
                   "pods, so a restarted gang starts again from step 0")
    default = type(k)()
    for api, names in K8S_ONLY.items():
        if api != k.api:
            out += [f"backend.k8s.{n}: only read with api: {api}; ignored for api: {k.api}" for n in names
                    if getattr(k, n) != getattr(default, n)]
    return out


def render_k8s(spec: JobSpec, plan: Plan, run_dir: str | None = None,
               templates: str | Path | None = None, exclude: list[str] | None = None,
               preflight_plan: float | None = None) -> Rendered:
    """The plan's ConfigMap, then a TrainJob (with its TrainingRuntime when one is needed) or a
    PyTorchJob. `exclude`: bad nodes from a BandwidthMap, kept out like backend.k8s.exclude_nodes.
    `preflight_plan`: a tolerance; the gang's pods measure the plan's groups first (an init container;
    a PyTorchJob's gang gets a headless Service for it)."""
    import dataclasses

    if exclude:
        k = spec.backend.k8s
        k = dataclasses.replace(k, exclude_nodes=sorted(set(k.exclude_nodes) | set(exclude)))
        spec = dataclasses.replace(spec, backend=dataclasses.replace(spec.backend, k8s=k))
    run_dir = run_dir or f"{k8s_log_dir(spec)}/{spec.name}"
    ctx = k8s_context(spec, plan, run_dir, preflight_plan)
    configmap = render_template("k8s/configmap.yaml.j2", ctx, templates)
    from launcher.render.trainjob import dump

    if spec.backend.k8s.api == "trainjob":
        from launcher.render.trainjob import documents

        job = dump(documents(ctx))
    else:
        job = render_template("k8s/pytorchjob.yaml.j2", ctx, templates)
        if ctx["probe"] is not None:
            job = dump([service_doc(ctx)]) + "---\n" + job
    manifests = parse_manifests(configmap + "---\n" + job)
    check_manifests(manifests)
    probe_files = ctx["probe"]["files"] if ctx["probe"] is not None else {}
    return Rendered("k8s", run_dir, "manifest.yaml",
                    {"manifest.yaml": configmap + "---\n" + job, rundir.PLAN: plan.to_json() + "\n", **probe_files},
                    warnings=image_warnings(spec.backend.k8s.image or "") + k8s_warnings(spec, ctx["probe"] is not None))


def parse_manifests(text: str) -> list[dict]:
    import yaml

    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise UserError(f"rendered manifest is not valid YAML: {exc}") from None
    return docs


def check_manifests(docs: list[dict]) -> None:
    """What the PyTorchJob CRD requires, and the pod templates through the kubernetes client's
    models (which reject unknown fields and wrong shapes as the API server would)."""
    kinds = [d.get("kind") for d in docs]
    if kinds[-1:] == ["TrainJob"]:
        return _check_trainjob(docs)
    if kinds not in (["ConfigMap", "PyTorchJob"], ["ConfigMap", "Service", "PyTorchJob"]):
        raise UserError(f"rendered manifest holds {kinds}; expected a ConfigMap, [the gang's Service,] a PyTorchJob")
    if kinds[1] == "Service":
        to_model(docs[1], "V1Service")
    job = docs[-1]
    if job.get("apiVersion") != "kubeflow.org/v1":
        raise UserError(f"PyTorchJob apiVersion {job.get('apiVersion')!r}; expected kubeflow.org/v1")
    specs = (job.get("spec") or {}).get("pytorchReplicaSpecs") or {}
    if "Master" not in specs or set(specs) - {"Master", "Worker"}:
        raise UserError(f"PyTorchJob replica types {sorted(specs)}; expected Master and optional Worker")
    if specs["Master"].get("replicas") != 1:
        raise UserError("PyTorchJob Master must have exactly 1 replica")
    for role, rs in specs.items():
        containers = rs["template"]["spec"]["containers"]
        if not any(c.get("name") == "pytorch" for c in containers):
            raise UserError(f"PyTorchJob {role}: no container named 'pytorch' (the operator requires it)")
        to_model(rs["template"], "V1PodTemplateSpec")
    to_model(docs[0], "V1ConfigMap")


def _check_trainjob(docs: list[dict]) -> None:
    """ConfigMap, optional TrainingRuntime, TrainJob; every pod template and patch through the
    kubernetes client's models."""
    kinds = [d.get("kind") for d in docs]
    if kinds not in (["ConfigMap", "TrainJob"], ["ConfigMap", "TrainingRuntime", "TrainJob"]):
        raise UserError(f"rendered manifest holds {kinds}; expected a ConfigMap, [a TrainingRuntime,] a TrainJob")
    to_model(docs[0], "V1ConfigMap")
    for doc in docs[1:]:
        spec = doc.get("spec") or {}
        jobsets = [p["trainingRuntimeSpec"]["template"]["spec"] for p in spec.get("runtimePatches") or []]
        if doc["kind"] == "TrainingRuntime":
            jobsets.append(spec["template"]["spec"])
        for js in jobsets:
            for rj in js.get("replicatedJobs") or []:
                to_model(rj["template"]["spec"]["template"], "V1PodTemplateSpec")


def to_model(obj: dict, kind: str) -> Any:
    """Deserialize through the kubernetes client's models (validates shapes and required fields)."""
    import inspect

    from kubernetes.client import ApiClient

    class _Resp:  # older clients deserialize a response object
        def __init__(self, data: str):
            self.data = data

    client = ApiClient()
    try:
        if "response_text" in inspect.signature(client.deserialize).parameters:
            return client.deserialize(json.dumps(obj), kind, "application/json")
        return client.deserialize(_Resp(json.dumps(obj)), kind)  # type: ignore[call-arg, arg-type]  # older clients
    except (ValueError, TypeError) as exc:
        raise UserError(f"rendered {kind} is invalid: {exc}") from None
