"""Kubernetes: a Plan as its ConfigMap and a Kubeflow Trainer v2 TrainJob (trainjob.py) or a
kubeflow.org/v1 PyTorchJob (templates/k8s/pytorchjob.yaml.j2), checked against the CRD's rules and
the kubernetes client's models before anything is submitted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from launcher.errors import UserError
from launcher.formats import rundir
from launcher.formats.shell import quote as shell_quote
from launcher.plan.model import Plan
from launcher.plan.spec import JobSpec
from launcher.render import RFC1123_SUBDOMAIN, bash_syntax_check, check_k8s_name, render_template
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
from launcher.render.rendered import Rendered, check_plan, gpu_lists

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


def k8s_context(spec: JobSpec, plan: Plan, run_dir: str) -> dict[str, Any]:
    check_plan(spec, plan)
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
    return {
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


def k8s_warnings(spec: JobSpec) -> list[str]:
    """Settings that do not do what they say: a restart budget whose restarts cannot resume (the run
    dir must outlive the pods), and fields of the other job kind."""
    k = spec.backend.k8s
    out = []
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
               templates: str | Path | None = None, exclude: list[str] | None = None) -> Rendered:
    """The plan's ConfigMap, then a TrainJob (with its TrainingRuntime when one is needed) or a
    PyTorchJob. `exclude`: bad nodes from a BandwidthMap, kept out like backend.k8s.exclude_nodes."""
    import dataclasses

    if exclude:
        k = spec.backend.k8s
        k = dataclasses.replace(k, exclude_nodes=sorted(set(k.exclude_nodes) | set(exclude)))
        spec = dataclasses.replace(spec, backend=dataclasses.replace(spec.backend, k8s=k))
    run_dir = run_dir or f"{k8s_log_dir(spec)}/{spec.name}"
    ctx = k8s_context(spec, plan, run_dir)
    configmap = render_template("k8s/configmap.yaml.j2", ctx, templates)
    if spec.backend.k8s.api == "trainjob":
        from launcher.render.trainjob import documents, dump

        job = dump(documents(ctx))
    else:
        job = render_template("k8s/pytorchjob.yaml.j2", ctx, templates)
    manifests = parse_manifests(configmap + "---\n" + job)
    check_manifests(manifests)
    return Rendered("k8s", run_dir, "manifest.yaml",
                    {"manifest.yaml": configmap + "---\n" + job, rundir.PLAN: plan.to_json() + "\n"},
                    warnings=image_warnings(spec.backend.k8s.image or "") + k8s_warnings(spec))


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
    if kinds != ["ConfigMap", "PyTorchJob"]:
        raise UserError(f"rendered manifest holds {kinds}; expected a ConfigMap then a PyTorchJob")
    job = docs[1]
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
